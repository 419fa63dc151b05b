"""How results look: the stats line on stderr, the JSON object on stdout, messages."""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections import Counter
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from cli.units import human_bytes

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

    from cli.engine.metrics import RunMetrics


# rich costs a tenth of a second to import: a command that prints no styled line never pays it.
@cache
def _console(stream: str) -> Console:
    from rich.console import Console

    if stream == "stderr":
        # rich drops colour by itself when stderr is not a terminal (and honours NO_COLOR).
        return Console(stderr=True, highlight=False, soft_wrap=True)
    # Off a terminal, lines are as long as they need to be: scripts should not get wrapped paths.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 4096)


def __getattr__(name: str) -> Any:
    if name == "stderr_console":
        return _console("stderr")
    if name == "stdout_console":
        return _console("stdout")
    raise AttributeError(name)


def _text(text: str = "", style: str = "") -> Text:
    from rich.text import Text

    return Text(text, style=style)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def stats_parts(
    metrics: RunMetrics, local: bool = True, model: str | None = None
) -> list[tuple[str, str]]:
    """(label, value) pairs of the stats line, in the order they are shown; a server's model
    (not local) has no load time, KV cache or threads of ours. The model it ran comes last (None:
    none named), so that what reads the line from its start finds the timings where they were."""
    m = metrics
    prefill = f"{m.prompt_tokens - m.cached_prompt_tokens} tok, {m.prefill_tokens_per_s:.1f} tok/s"
    if m.cached_prompt_tokens:
        prefill += f" ({_cached_text(m)})"
    p50, p95 = m.inter_token_latency_p50_ms, m.inter_token_latency_p95_ms
    itl = "n/a" if p50 is None or p95 is None else f"p50 {p50:.1f} ms, p95 {p95:.1f} ms"
    finish = m.finish_reason or "n/a"
    if m.stop_string is not None:
        finish += f" ({json.dumps(m.stop_string, ensure_ascii=False)})"
    thinking = [  # a reply that reasoned: thinking and answer apart, and when the answer began
        ("thinking", f"{m.thinking_tokens} tok, answer {m.answer_tokens} tok"),
        ("first answer", _ms(m.time_to_first_answer_s)),
    ]
    parts = [
        ("load", f"{m.load_s:.2f} s"),
        ("TTFT", _ms(m.ttft_s)),
        ("prefill", prefill),
        ("decode", f"{m.generation_tokens} tok, {m.decode_tokens_per_s:.1f} tok/s"),
        *([("spec", speculation_text(m.speculation))] if m.speculation is not None else []),
        *(thinking if m.thinking_tokens else []),
        ("ITL", itl),
        ("total", f"{m.total_s:.2f} s"),
        ("finish", finish),
        ("KV", f"{m.kv_cache_type} {human_bytes(m.kv_cache_bytes)} @ ctx {m.n_ctx}"),
        ("threads", _threads_text(m)),
        *([("weights", m.weights)] if m.weights else []),
        # Offloaded layers: to a GPU, or over RPC to the servers named.
        ("RPC", f"{m.gpu_layers} layers on {', '.join(m.rpc)}")
        if m.rpc
        else ("GPU layers", str(m.gpu_layers)),
    ]
    shown = [part for part in parts if local or part[0] in REMOTE_PARTS]
    return shown + ([("model", model)] if model is not None else [])


def _threads_text(m: RunMetrics) -> str:
    """The threads a reply ended with, and why there may be fewer than usual."""
    if not m.busy_cores:
        return str(m.threads)
    return f"{m.threads} ({m.busy_cores} {'core' if m.busy_cores == 1 else 'cores'} busy elsewhere)"


def _cached_text(m: RunMetrics) -> str:
    """The prompt tokens not prefilled, and how many of them were read from disk."""
    if not m.restored_prompt_tokens:
        return f"{m.cached_prompt_tokens} cached"
    return f"{m.cached_prompt_tokens} cached, {m.restored_prompt_tokens} from disk"


def model_shown(label: str) -> str:
    """A model as a stats line names it: a file by its name (a path would fill the line)."""
    return label.rsplit("/", 1)[-1] if label.endswith(".gguf") else label


def turn_stats_line(m: RunMetrics, context_used: int | None, model: str | None = None) -> str:
    """The line after each chat reply (and /stats): what the turn prefilled next to what was
    cached, the speeds, the context filled (None: a server keeps its own), speculation, and the
    model that answered, last (as run's stats line)."""
    line = (
        f"prefill {m.prompt_tokens - m.cached_prompt_tokens} new tokens "
        f"({_cached_text(m)}), {m.prefill_tokens_per_s:.0f} tok/s · "
        f"TTFT {_ms(m.ttft_s or 0.0)} · decode {m.generation_tokens} tok, "
        f"{m.decode_tokens_per_s:.1f} tok/s · finish {m.finish_reason}"
    )
    if context_used is not None:  # a local model: its context and threads
        line += f" · context {context_used}/{m.n_ctx} · threads {_threads_text(m)}"
    if m.speculation is not None:
        line += f" · spec {speculation_text(m.speculation)}"
    if m.weights:
        line += f" · weights {m.weights}"
    if m.rpc:
        line += f" · RPC {', '.join(m.rpc)}"
    if model:
        line += f" · model {model}"
    return line


def speculation_text(spec: dict[str, Any]) -> str:
    """What speculative decoding did: guesses kept, and the plain decode speed it beat (or not)."""
    text = f"{spec['mode']} accepted {spec['accepted']}/{spec['drafted']}"
    if spec["acceptance_rate"] is not None:
        text += f" ({spec['acceptance_rate']:.0%})"
    if spec["plain_tokens_per_s"] is not None:
        text += f", plain steps {spec['plain_tokens_per_s']:.1f} tok/s"
    if spec["first_paused_at"] is not None:
        times = f" {spec['pauses']} times" if spec["pauses"] > 1 else ""
        text += f", paused{times} from {spec['first_paused_at']} tok (guesses held nothing)"
    return text


REMOTE_PARTS = ("TTFT", "prefill", "decode", "thinking", "first answer", "ITL", "total", "finish")


def write_reasoning(text: str) -> None:
    """Reasoning on stderr as it comes: dim on a terminal, plain text in a file or pipe."""
    if text and sys.stderr.isatty() and not os.environ.get("NO_COLOR"):
        text = f"\x1b[2m{text}\x1b[0m"
    write_stderr(text)


def print_stats(metrics: RunMetrics, local: bool = True, model: str | None = None) -> None:
    line = _text()
    for index, (label, value) in enumerate(stats_parts(metrics, local, model)):
        if index:
            line.append(" · ", style="dim")
        line.append(f"{label} ", style="dim")
        line.append(value, style="bold" if label in ("TTFT", "decode", "finish") else "")
    _console("stderr").print(line)


def print_timeline(
    arrivals: list[tuple[float, str]], width: int = 40, guessed: Sequence[int] = ()
) -> None:
    """When each token arrived, then how the gaps between tokens are spread. Tokens numbered
    in guessed were accepted speculative guesses: marked +, they arrive in bursts."""
    console = _console("stderr")
    console.print(_text("token  arrived (ms)  gap (ms)  text", style="bold"))
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(arrivals)]
    marked = set(guessed)
    for index, (at, text) in enumerate(arrivals, start=1):
        gap = f"{gaps[index - 2]:8.1f}" if index > 1 else ""
        mark = "+" if index in marked else " "
        shown = json.dumps(text, ensure_ascii=False)
        console.print(f"{index:5d}{mark} {at:12.1f}  {gap:>8}  {shown}")
    if len(gaps) < 2:
        return
    low, bins = min(gaps), 10
    step = (max(gaps) - low) / bins or 1.0
    counts = Counter(min(int((gap - low) / step), bins - 1) for gap in gaps)
    top = max(counts.values())
    console.print(_text("gaps between tokens (ms)", style="bold"))
    for number in range(bins):
        start = low + number * step
        bar = "█" * round(counts[number] / top * width)
        console.print(f"  {start:8.1f} – {start + step:8.1f}  {bar} {counts[number]}")


def grammar_line(metrics: RunMetrics) -> str:
    """Where structured output's time went: the grammar's share of decoding (--verbose)."""
    share = metrics.grammar_s / metrics.total_s * 100 if metrics.total_s > 0 else 0.0
    return (
        f"grammar {metrics.grammar_s * 1000:.1f} ms ({share:.0f}% of the request) · "
        f"{metrics.grammar_resampled} of {metrics.generation_tokens} tokens resampled under "
        "the grammar's mask"
    )


def run_json(
    model: str,
    path: str,
    text: str,
    metrics: RunMetrics,
    reasoning: str | None = None,
    logprobs: Sequence[Any] | None = None,
    memory: dict[str, Any] | None = None,
) -> str:
    """quill run --json's document; logprobs (TokenLogprobs) as OpenAI's logprobs.content;
    memory: the plan of the model as it was opened (a local model's)."""
    result: dict[str, Any] = {"model": model, "path": path, "text": text}
    if reasoning is not None:
        result["reasoning"] = reasoning
    result.update(metrics.as_dict())
    if memory is not None:
        result["memory"] = memory
    if logprobs is not None:
        from cli.api.replies import chat_logprob

        result["logprobs"] = [chat_logprob(entry) for entry in logprobs]
    return json.dumps(result, ensure_ascii=False)


def error_line(message: str) -> None:
    _console("stderr").print(_text("quill: error: ", style="bold red") + _text(message))


def warning_line(message: str) -> None:
    _console("stderr").print(_text("quill: warning: ", style="yellow") + _text(message))


def info_line(message: str) -> None:
    _console("stderr").print(_text(message, style="dim"))


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


def columns(headers: list[str] | None, rows: list[list[str]], right: tuple[int, ...] = ()) -> str:
    """A plain table, as `ollama list` prints one: columns in right aligned right (numbers),
    nothing to strip in a pipe, and no rich import, which costs more than `quill list` does."""
    table = [headers, *rows] if headers else rows
    widths = [max(len(cell) for cell in column) for column in zip(*table, strict=True)]
    lines = []
    for line in table:
        cells = [
            cell.rjust(width) if index in right else cell.ljust(width)
            for index, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def models_table(models: list[Any], quants: dict[str, str], kinds: dict[str, str | None]) -> None:
    rows = []
    for model in models:
        source = model.source if model.owned else f"{model.source} (not quill's)"
        where = str(model.path)
        size = human_bytes(model.size)
        rows.append([model.name, quants[where], kinds[where] or "-", size, source, where])
    write_stdout(columns(["NAME", "QUANT", "KIND", "SIZE", "SOURCE", "PATH"], rows))


def gguf_report(
    info: Any, template: str | None = None, base: str | None = None, read: int | None = None
) -> None:
    def number(value: Any) -> str:
        return f"{value:,}" if isinstance(value, int) else str(value if value is not None else "-")

    weights = f"{human_bytes(info.file_size - (read or 0))} of weights"
    facts = [
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
        ("chat template", template or ("yes" if info.chat_template else "no")),
        *([("pooling", info.pooling)] if info.pooling else []),
        *([("kind", base)] if base else []),
        ("file size", f"{human_bytes(info.file_size)} ({info.file_size:,} bytes)"),
        *(
            [("read", f"header only: {human_bytes(read)} read, {weights} not downloaded")]
            if read
            else []
        ),
        ("path", info.path),
    ]
    width = max(len(label) for label, _ in facts)
    text = "".join(f"{label.ljust(width)}  {value}\n" for label, value in facts)
    rows = [[kind.type, str(kind.tensors), human_bytes(kind.bytes)] for kind in info.tensor_types]
    write_stdout(text + "\n" + columns(["TENSOR TYPE", "TENSORS", "BYTES"], rows, right=(1, 2)))


def memory_line(memory: Any) -> str:
    kv = f"{memory.type_k}/{memory.type_v}" if memory.type_k != memory.type_v else memory.type_k
    return (
        f"memory plan at {memory.n_ctx} cells: weights {human_bytes(memory.weights_bytes)}, "
        f"KV {kv} {human_bytes(memory.kv_bytes)}, compute {human_bytes(memory.compute_bytes)}, "
        f"output {human_bytes(memory.output_bytes)}, "
        + (f"draft {human_bytes(memory.draft_bytes)}, " if memory.draft_bytes else "")
        + (f"parked caches {human_bytes(memory.parked_bytes)}, " if memory.parked_bytes else "")
        + f"total {human_bytes(memory.total_bytes)}"
    )


def memory_report(
    memory: Any, budget: int | None, largest: int | None, available: list[tuple[str, int]]
) -> None:
    kv = f"{memory.type_k}/{memory.type_v}" if memory.type_k != memory.type_v else memory.type_k
    note = f"{memory.n_ctx} cells"
    if memory.kv_bytes_windowed != memory.kv_bytes:
        windowed = human_bytes(memory.kv_bytes_windowed)
        note += f"; {windowed} if sliding-window layers kept only their window"
    rows = [
        ["weights", human_bytes(memory.weights_bytes), ""],
        [f"KV cache ({kv})", human_bytes(memory.kv_bytes), note],
        ["compute buffer", human_bytes(memory.compute_bytes), "one batch of logits, mostly"],
        ["output buffer", human_bytes(memory.output_bytes), ""],
    ]
    if memory.draft_bytes:
        rows.append(["draft model", human_bytes(memory.draft_bytes), "weights, KV and buffers"])
    if memory.parked_bytes:
        rows.append(["parked caches", human_bytes(memory.parked_bytes), "at most"])
    rows.append(["total", human_bytes(memory.total_bytes), ""])
    text = f"\nmemory at a context of {memory.n_ctx} tokens\n"
    text += columns(None, rows, right=(1,))  # no header: the labels say what each line is
    if budget is not None and largest:
        text += f"largest context that fits {human_bytes(budget)}: {largest} tokens\n"
    elif budget is not None:
        text += f"the model does not fit {human_bytes(budget)} even with 256 tokens of context\n"
    for where, free in available:
        fits = "fits" if memory.total_bytes <= free else "does not fit"
        text += f"{fits} in {where}: {human_bytes(free)} available\n"
    write_stdout(text)


def fit_report(decision: Any) -> None:
    """quill pull's decision (cli/measure/fit.py's FitDecision), on stderr: each file considered,
    what its plan needs at the context, whether it fits, its predicted decode speed here."""
    chosen, room = decision.chosen, decision.room
    if len(decision.files) > 1:
        rows = [
            [
                ("* " if one is chosen else "  ") + one.file,
                one.quant or "?",
                human_bytes(one.size_bytes),
                human_bytes(one.memory.total_bytes),
                "yes" if one.fits else "no",
                _tokens_per_s(one.decode_tokens_per_s),
            ]
            for one in decision.files
        ]
        headers = ["FILE", "QUANT", "SIZE", "NEEDS", "FITS", "DECODE HERE"]
        write_stderr(columns(headers, rows, right=(2, 3, 5)))
    speed = _tokens_per_s(chosen.decode_tokens_per_s)
    write_stderr(
        f"{decision.model}: {chosen.file} needs {human_bytes(chosen.memory.total_bytes)} at a "
        f"context of {chosen.memory.n_ctx} ({room.where} has {human_bytes(room.bytes)}): "
        f"{decision.why}; decode predicted here {speed}\n"
    )


def _tokens_per_s(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f} tok/s"


def split_report(shares: list[Any]) -> None:
    """What each device holds when the layers are split (inspect --rpc)."""
    rows = []
    for share in shares:
        layers = list(share.layers)
        held = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else "".join(map(str, layers))
        rows.append([share.device, held or "-", human_bytes(share.weights_bytes)])
        rows[-1].append(human_bytes(share.kv_bytes))
    text = "\nsplit over the RPC servers (layers; the last is the output layer)\n"
    write_stdout(text + columns(["device", "layers", "weights", "KV cache"], rows, right=(2, 3)))


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(line) + " |" for line in [headers, *rows]]
    lines.insert(1, "|" + "---|" * len(headers))
    return "\n".join(lines) + "\n"


def print_table(headers: list[str], rows: list[list[str]], left: tuple[str, ...]) -> None:
    """rows under bold headers on stdout, the columns named in left aligned left."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for header in headers:
        table.add_column(header, justify="left" if header in left else "right")
    for line in rows:
        table.add_row(*line)
    _console("stdout").print(table)


def quant_report_table(rows: list[Any], kv_ctx: int, markdown: bool = False) -> None:
    """weights x KV rows: size, perplexity and its change, speeds, KV bytes at kv_ctx."""
    headers = ["weights", "KV", "file", "PPL", "vs F16", "threads"]
    headers += ["prefill tok/s", "decode tok/s", f"KV @ {kv_ctx}"]
    cells = [
        [
            row.weights,
            row.kv_type,
            human_bytes(row.file_bytes),
            f"{row.perplexity:.4f} ± {row.perplexity_error:.4f}",
            f"{row.perplexity_change_pct:+.2f}%",
            str(row.threads),
            f"{row.prefill_tokens_per_s:.0f} ± {row.prefill_tokens_per_s_sd:.0f}",
            f"{row.decode_tokens_per_s:.1f} ± {row.decode_tokens_per_s_sd:.1f}",
            human_bytes(row.kv_bytes),
        ]
        for row in rows
    ]
    if markdown:
        write_stdout(markdown_table(headers, cells))
    else:
        print_table(headers, cells, left=("weights", "KV"))
