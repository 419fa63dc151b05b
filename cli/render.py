"""How results look: the stats line on stderr, the JSON object on stdout, messages."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.text import Text

from cli.metrics import RunMetrics

# rich drops colour by itself when stderr is not a terminal (and honours NO_COLOR).
stderr_console = Console(stderr=True, highlight=False, soft_wrap=True)


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def stats_parts(metrics: RunMetrics) -> list[tuple[str, str]]:
    """(label, value) pairs of the stats line, in the order they are shown."""
    m = metrics
    prefill = f"{m.prompt_tokens - m.cached_prompt_tokens} tok, {m.prefill_tokens_per_s:.1f} tok/s"
    if m.cached_prompt_tokens:
        prefill += f" ({m.cached_prompt_tokens} cached)"
    itl = "n/a"
    if m.inter_token_latency_p50_ms is not None and m.inter_token_latency_p95_ms is not None:
        itl = (
            f"p50 {m.inter_token_latency_p50_ms:.1f} ms, p95 {m.inter_token_latency_p95_ms:.1f} ms"
        )
    finish = m.finish_reason or "n/a"
    if m.stop_string is not None:
        finish += f" ({json.dumps(m.stop_string, ensure_ascii=False)})"
    return [
        ("load", f"{m.load_s:.2f} s"),
        ("TTFT", _ms(m.ttft_s)),
        ("prefill", prefill),
        ("decode", f"{m.generation_tokens} tok, {m.decode_tokens_per_s:.1f} tok/s"),
        ("ITL", itl),
        ("total", f"{m.total_s:.2f} s"),
        ("finish", finish),
        ("KV", f"{m.kv_cache_type} {human_bytes(m.kv_cache_bytes)} @ ctx {m.n_ctx}"),
        ("threads", str(m.threads)),
        ("GPU layers", str(m.gpu_layers)),
    ]


def print_stats(metrics: RunMetrics) -> None:
    line = Text()
    for index, (label, value) in enumerate(stats_parts(metrics)):
        if index:
            line.append(" · ", style="dim")
        line.append(f"{label} ", style="dim")
        line.append(value, style="bold" if label in ("TTFT", "decode", "finish") else "")
    stderr_console.print(line)


def run_json(model: str, path: str, text: str, metrics: RunMetrics) -> str:
    result: dict[str, Any] = {"model": model, "path": path, "text": text}
    result.update(metrics.as_dict())
    return json.dumps(result, ensure_ascii=False)


def error_line(message: str) -> None:
    stderr_console.print(Text("quill: error: ", style="bold red") + Text(message))


def warning_line(message: str) -> None:
    stderr_console.print(Text("quill: warning: ", style="yellow") + Text(message))


def info_line(message: str) -> None:
    stderr_console.print(Text(message, style="dim"))


def write_stdout(text: str) -> None:
    """Model text as UTF-8 bytes, flushed at once, whatever the locale says."""
    if text:
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.buffer.flush()


def silence_stdout() -> None:
    """Point stdout at /dev/null so that Python's final flush at exit finds no broken pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
