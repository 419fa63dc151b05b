"""How bench results look: a table, JSON, CSV or Markdown on stdout; bars on the terminal; a PNG."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table
from rich.text import Text

from cli.errors import UsageError
from cli.measure.bench import BenchRow
from cli.ui.render import stdout_console
from cli.units import human_bytes

COLUMNS = (
    "test",
    "depth",
    "kv_type",
    "threads",
    "batch",
    "tokens_per_s",
    "tokens_per_s_sd",
    "ttft_ms",
    "ttft_ms_sd",
    "bytes_per_token",
    "bandwidth_gb_s",
    "cpu_path",
)


def _known(value: int | None) -> str:
    """A remote server's threads and batch are its own: shown as "-", not as 0."""
    return "-" if value is None else str(value)


def _settings(row: BenchRow) -> str:
    return f"{row.kv_type}, {_known(row.threads)} threads, batch {_known(row.batch)}"


def _cells(row: BenchRow, with_cpu_path: bool = False) -> list[str]:
    ttft = "" if row.ttft_ms is None else f"{row.ttft_ms:.1f} ± {row.ttft_ms_sd or 0:.1f}"
    per_token = "" if row.bytes_per_token is None else human_bytes(row.bytes_per_token)
    bandwidth = "" if row.bandwidth_gb_s is None else f"{row.bandwidth_gb_s:.2f}"
    return [
        row.test,
        str(row.depth),
        row.kv_type,
        _known(row.threads),
        _known(row.batch),
        f"{row.tokens_per_s:.1f} ± {row.tokens_per_s_sd:.1f}",
        ttft,
        per_token,
        bandwidth,
        *([row.cpu_path] if with_cpu_path else []),
    ]


HEADERS = ["test", "depth", "KV", "threads", "batch", "tokens/s", "TTFT ms", "bytes/token", "GB/s"]


def _compares_cpu_paths(rows: Sequence[BenchRow]) -> bool:
    return len({row.cpu_path for row in rows}) > 1


def _headers(rows: Sequence[BenchRow]) -> tuple[list[str], bool]:
    """The table's headers, with a CPU path column when the rows compare several."""
    several = _compares_cpu_paths(rows)
    return [*HEADERS, "CPU path"] if several else HEADERS, several


def table(rows: Sequence[BenchRow]) -> None:
    headers, with_cpu_path = _headers(rows)
    out = Table(box=None, pad_edge=False, header_style="bold")
    for header in headers:
        left = header in ("test", "KV", "CPU path")
        out.add_column(header, justify="left" if left else "right")
    for row in rows:
        out.add_row(*_cells(row, with_cpu_path))
    stdout_console.print(out)


def markdown(rows: Sequence[BenchRow]) -> str:
    headers, with_cpu_path = _headers(rows)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cells(row, with_cpu_path)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def csv_text(rows: Sequence[BenchRow]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(COLUMNS)
    for row in rows:
        data = row.as_dict()
        writer.writerow(["" if data[c] is None else data[c] for c in COLUMNS])
    return buffer.getvalue()


def json_text(model: str, rows: Sequence[BenchRow]) -> str:
    return json.dumps({"model": model, "rows": [r.as_dict() for r in rows]}, indent=1) + "\n"


def bars(rows: Sequence[BenchRow], width: int = 40) -> list[Text]:
    """The two pictures as text: decode speed against depth, TTFT against prompt length."""
    pictures: list[Text] = []
    for title, chosen, value, unit in (
        (
            "decode tokens/s by KV depth",
            [r for r in rows if r.test.startswith("tg")],
            lambda r: r.tokens_per_s,
            "tok/s",
        ),
        (
            "time to first token by prompt length",
            [r for r in rows if r.test.startswith("pp")],
            lambda r: r.ttft_ms or 0.0,
            "ms",
        ),
    ):
        if len(chosen) < 2:
            continue
        top = max(value(r) for r in chosen) or 1.0
        several_paths = _compares_cpu_paths(rows)
        pictures.append(Text(title, style="bold"))
        for row in chosen:
            threads, batch = _known(row.threads), _known(row.batch)
            label = f"{row.test} @ d{row.depth} {row.kv_type} t{threads} b{batch}"
            if several_paths:
                label += f" {row.cpu_path}"
            filled = value(row) / top * width
            bar = "█" * int(filled) + ("▌" if filled - int(filled) >= 0.5 else "")
            line = Text(f"  {label:<28} ")
            line.append(bar.ljust(width + 1), style="cyan")
            line.append(f" {value(row):.1f} {unit}")
            pictures.append(line)
    return pictures


def plot(rows: Sequence[BenchRow], model: str, target: Path) -> None:
    """decode tokens/s against depth and TTFT against prompt length, as a PNG (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise UsageError(
            "--plot needs matplotlib: pip install 'quill-llm[plot]' (or pip install matplotlib)"
        ) from error
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    several_paths = _compares_cpu_paths(rows)
    series: dict[tuple[str, str], list[BenchRow]] = {}
    for row in rows:
        path = f", {row.cpu_path}" if several_paths else ""
        series.setdefault((row.test, f"{_settings(row)}{path}"), []).append(row)
    for (test, label), points in series.items():
        if test.startswith("tg"):
            points.sort(key=lambda r: r.depth)
            left.errorbar(
                [r.depth for r in points],
                [r.tokens_per_s for r in points],
                yerr=[r.tokens_per_s_sd for r in points],
                marker="o",
                capsize=3,
                label=f"{test}, {label}",
            )
    prompts: dict[str, list[BenchRow]] = {}
    for row in rows:
        if row.test.startswith("pp"):
            key = f"depth {row.depth}, {_settings(row)}"
            if several_paths:
                key += f", {row.cpu_path}"
            prompts.setdefault(key, []).append(row)
    for label, points in prompts.items():
        points.sort(key=lambda r: int(r.test[2:]))
        right.errorbar(
            [int(r.test[2:]) for r in points],
            [r.ttft_ms or 0 for r in points],
            yerr=[r.ttft_ms_sd or 0 for r in points],
            marker="o",
            capsize=3,
            label=label,
        )
    left.set(
        title="Decode speed as the context fills",
        xlabel="tokens already in the KV cache",
        ylabel="decode tokens/s",
    )
    right.set(
        title="Waiting for the first token",
        xlabel="prompt tokens",
        ylabel="time to first token (ms)",
    )
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.set_ylim(bottom=0)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    figure.suptitle(f"quill bench: {model}", fontsize=10)
    figure.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part.png")
    figure.savefig(partial, dpi=120)
    plt.close(figure)
    partial.replace(target)
