"""How results look: the stats line on stderr, the JSON object on stdout, messages."""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.text import Text

from cli.engine.metrics import RunMetrics
from cli.units import human_bytes

# rich drops colour by itself when stderr is not a terminal (and honours NO_COLOR).
stderr_console = Console(stderr=True, highlight=False, soft_wrap=True)


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
    local = m.n_ctx > 0  # a model behind --endpoint has no load time, KV or threads of ours
    threads = str(m.threads)
    if m.busy_cores:  # other work took cores: why there may be fewer threads than usual
        threads += f" ({m.busy_cores} {'core' if m.busy_cores == 1 else 'cores'} busy elsewhere)"
    parts = [
        ("load", f"{m.load_s:.2f} s"),
        ("TTFT", _ms(m.ttft_s)),
        ("prefill", prefill),
        ("decode", f"{m.generation_tokens} tok, {m.decode_tokens_per_s:.1f} tok/s"),
        ("ITL", itl),
        ("total", f"{m.total_s:.2f} s"),
        ("finish", finish),
        ("KV", f"{m.kv_cache_type} {human_bytes(m.kv_cache_bytes)} @ ctx {m.n_ctx}"),
        ("threads", threads),
        ("GPU layers", str(m.gpu_layers)),
    ]
    if m.speculation is not None:
        parts.insert(4, ("spec", speculation_text(m.speculation)))
    if local:
        return parts
    return [(label, value) for label, value in parts if label in REMOTE_PARTS]


def speculation_text(spec: dict[str, Any]) -> str:
    """What speculative decoding did: guesses kept, and the plain decode speed it beat (or
    did not)."""
    text = f"{spec['mode']} accepted {spec['accepted']}/{spec['drafted']}"
    if spec["acceptance_rate"] is not None:
        text += f" ({spec['acceptance_rate']:.0%})"
    if spec["plain_tokens_per_s"] is not None:
        text += f", plain steps {spec['plain_tokens_per_s']:.1f} tok/s"
    if spec["switched_off_after"] is not None:
        text += f", off after {spec['switched_off_after']} tok (slower than plain)"
    return text


REMOTE_PARTS = ("TTFT", "prefill", "decode", "ITL", "total", "finish")


def print_stats(metrics: RunMetrics) -> None:
    line = Text()
    for index, (label, value) in enumerate(stats_parts(metrics)):
        if index:
            line.append(" · ", style="dim")
        line.append(f"{label} ", style="dim")
        line.append(value, style="bold" if label in ("TTFT", "decode", "finish") else "")
    stderr_console.print(line)


def print_timeline(
    arrivals: list[tuple[float, str]], width: int = 40, guessed: Sequence[int] = ()
) -> None:
    """When each token arrived, then how the gaps between tokens are spread. Tokens numbered
    in guessed were accepted speculative guesses: marked +, they arrive in bursts."""
    console = stderr_console
    console.print(Text("token  arrived (ms)  gap (ms)  text", style="bold"))
    previous = None
    marked = set(guessed)
    for index, (at, text) in enumerate(arrivals, start=1):
        gap = "" if previous is None else f"{at - previous:8.1f}"
        mark = "+" if index in marked else " "
        shown = json.dumps(text, ensure_ascii=False)
        console.print(f"{index:5d}{mark} {at:12.1f}  {gap:>8}  {shown}")
        previous = at
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(arrivals)]
    if len(gaps) < 2:
        return
    low, high = min(gaps), max(gaps)
    bins = 10
    step = (high - low) / bins or 1.0
    counts = [0] * bins
    for gap in gaps:
        counts[min(int((gap - low) / step), bins - 1)] += 1
    console.print(Text("gaps between tokens (ms)", style="bold"))
    top = max(counts)
    for number, count in enumerate(counts):
        start = low + number * step
        bar = "█" * round(count / top * width)
        console.print(f"  {start:8.1f} – {start + step:8.1f}  {bar} {count}")


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


def write_stderr(text: str) -> None:
    """Plain text on stderr (help, tables of settings): no markup, no wrapping."""
    sys.stderr.write(text)
    sys.stderr.flush()


def silence_stdout() -> None:
    """Point stdout at /dev/null so that Python's final flush at exit finds no broken pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


# Off a terminal, lines are as long as they need to be: scripts should not get wrapped paths.
stdout_console = Console(highlight=False, width=None if sys.stdout.isatty() else 4096)


def models_table(models: list[Any], quants: dict[str, str]) -> None:
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("NAME", "QUANT", "SIZE", "SOURCE", "PATH"):
        table.add_column(column, no_wrap=column != "PATH", overflow="fold")
    for model in models:
        source = model.source if model.owned else f"{model.source} (not quill's)"
        table.add_row(
            model.name, quants[str(model.path)], human_bytes(model.size), source, str(model.path)
        )
    stdout_console.print(table)


def gguf_report(info: Any) -> None:
    from rich.table import Table

    def number(value: Any) -> str:
        return f"{value:,}" if isinstance(value, int) else str(value if value is not None else "-")

    facts = Table(box=None, show_header=False, pad_edge=False)
    facts.add_column(style="dim", no_wrap=True)
    facts.add_column(overflow="fold")
    rows = [
        ("name", info.name or "-"),
        ("architecture", info.architecture),
        ("quantization", info.file_type or "-"),
        ("parameters", f"{info.parameters:,} ({info.parameters / 1e6:.1f} M)"),
        ("layers", number(info.layers)),
        ("embedding length", number(info.embedding_length)),
        ("attention heads", number(info.heads)),
        ("KV heads", number(info.kv_heads)),
        ("head dimension", number(info.head_dim)),
        ("trained context", number(info.context_length)),
        ("sliding window", number(info.sliding_window)),
        ("vocabulary", f"{number(info.vocab_size)} tokens ({info.tokenizer or '-'})"),
        ("chat template", "yes" if info.chat_template else "no"),
        ("file size", f"{human_bytes(info.file_size)} ({info.file_size:,} bytes)"),
        ("path", info.path),
    ]
    for label, text in rows:
        facts.add_row(label, text)
    stdout_console.print(facts)
    tensors = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("TENSOR TYPE", "TENSORS", "BYTES"):
        tensors.add_column(column, justify="left" if column == "TENSOR TYPE" else "right")
    for kind in info.tensor_types:
        tensors.add_row(kind.type, str(kind.tensors), human_bytes(kind.bytes))
    stdout_console.print()
    stdout_console.print(tensors)


def memory_line(memory: Any) -> str:
    kv = f"{memory.type_k}/{memory.type_v}" if memory.type_k != memory.type_v else memory.type_k
    return (
        f"memory plan at {memory.n_ctx} cells: weights {human_bytes(memory.weights_bytes)}, "
        f"KV {kv} {human_bytes(memory.kv_bytes)}, compute {human_bytes(memory.compute_bytes)}, "
        f"output {human_bytes(memory.output_bytes)}, total {human_bytes(memory.total_bytes)}"
    )


def memory_report(memory: Any, budget: int | None, largest: int | None) -> None:
    from rich.table import Table

    kv = f"{memory.type_k}/{memory.type_v}" if memory.type_k != memory.type_v else memory.type_k
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="dim", no_wrap=True)
    table.add_column(justify="right")
    table.add_column(style="dim")
    table.add_row("weights", human_bytes(memory.weights_bytes), "")
    note = f"{memory.n_ctx} cells"
    if memory.kv_bytes_windowed != memory.kv_bytes:
        windowed = human_bytes(memory.kv_bytes_windowed)
        note += f"; {windowed} if sliding-window layers kept only their window"
    table.add_row(f"KV cache ({kv})", human_bytes(memory.kv_bytes), note)
    table.add_row(
        "compute buffer", human_bytes(memory.compute_bytes), "one batch of logits, mostly"
    )
    table.add_row("output buffer", human_bytes(memory.output_bytes), "")
    table.add_row("total", human_bytes(memory.total_bytes), "")
    stdout_console.print()
    stdout_console.print(Text(f"memory at a context of {memory.n_ctx} tokens", style="bold"))
    stdout_console.print(table)
    if budget is not None:
        if largest:
            line = f"largest context that fits {human_bytes(budget)}: {largest} tokens"
        else:
            line = f"the model does not fit {human_bytes(budget)} even with 256 tokens of context"
        stdout_console.print(line)


def quant_report_table(rows: list[Any], kv_ctx: int, markdown: bool = False) -> None:
    """weights x KV rows: size, perplexity and its change, speeds, KV bytes at kv_ctx."""
    headers = [
        "weights",
        "KV",
        "file",
        "PPL",
        "vs F16",
        "prefill tok/s",
        "decode tok/s",
        f"KV @ {kv_ctx}",
    ]
    cells = [
        [
            row.weights,
            row.kv_type,
            human_bytes(row.file_bytes),
            f"{row.perplexity:.4f} ± {row.perplexity_error:.4f}",
            f"{row.perplexity_change_pct:+.2f}%",
            f"{row.prefill_tokens_per_s:.0f}",
            f"{row.decode_tokens_per_s:.1f}",
            human_bytes(row.kv_bytes),
        ]
        for row in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(line) + " |" for line in cells]
        write_stdout("\n".join(lines) + "\n")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for header in headers:
        table.add_column(header, justify="left" if header in ("weights", "KV") else "right")
    for line in cells:
        table.add_row(*line)
    stdout_console.print(table)
