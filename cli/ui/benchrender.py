"""How bench results look: a table, JSON, CSV or Markdown on stdout; bars on the terminal; a PNG."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.text import Text

from cli.errors import UsageError
from cli.measure.bench import BenchRow
from cli.measure.paths import PathTable
from cli.ui.render import markdown_table, print_table
from cli.units import human_bytes

# The CSV's columns: every field of a row but its samples and the extras of some rows.
COLUMNS: tuple[str, ...] = (
    "test",
    "depth",
    "kv_type",
    "threads",
    "batch",
    "tokens_per_s",
    "tokens_per_s_sd",
)
COLUMNS += ("ttft_ms", "ttft_ms_sd", "bytes_per_token", "weights_kv_gb_per_s", "bandwidth_share")
COLUMNS += ("cpu_path",)
HEADERS = ["test", "depth", "KV", "threads", "batch", "tokens/s", "TTFT ms", "bytes/token"]
HEADERS += ["read GB/s", "of limit"]
COLUMNS += ("replica_of", "rpc", "predicted_tokens_per_s", "measured_over_predicted")
# Where any row has a prediction (bench --replica, --predict): the tg rows' predicted decode
# speed and measured/predicted.
PREDICTED = ["predicted", "measured/pred"]


def _known(value: int | None) -> str:
    """A remote server's threads and batch are its own: shown as "-", not as 0."""
    return "-" if value is None else str(value)


def _settings(row: BenchRow) -> str:
    return f"{row.kv_type}, {_known(row.threads)} threads, batch {_known(row.batch)}"


def _compares_cpu_paths(rows: Sequence[BenchRow]) -> bool:
    return len({row.cpu_path for row in rows}) > 1


def _grid(rows: Sequence[BenchRow]) -> tuple[list[str], list[list[str]]]:
    """The table's headers and cells, with a CPU path column when the rows compare several."""
    several = _compares_cpu_paths(rows)
    replica = any(row.replica_of for row in rows)
    rpc = any(row.rpc for row in rows)
    predicted = any(row.predicted_tokens_per_s for row in rows)
    cells = []
    for row in rows:
        ttft = "" if row.ttft_ms is None else f"{row.ttft_ms:.1f} ± {row.ttft_ms_sd or 0:.1f}"
        per_token = "" if row.bytes_per_token is None else human_bytes(row.bytes_per_token)
        read = "" if row.weights_kv_gb_per_s is None else f"{row.weights_kv_gb_per_s:.2f}"
        share = "" if row.bandwidth_share is None else f"{row.bandwidth_share:.0%}"
        rate = f"{row.tokens_per_s:.1f} ± {row.tokens_per_s_sd:.1f}"
        where = [row.test, str(row.depth), row.kv_type, _known(row.threads), _known(row.batch)]
        path = [row.cpu_path] if several else []
        model = [f"replica of {row.replica_of}"] if replica else []
        servers = [",".join(row.rpc) or "local"] if rpc else []
        guess = _predicted_cells(row) if predicted else []
        cells.append([*where, rate, ttft, per_token, read, share, *guess, *path, *model, *servers])
    headers = [*HEADERS, *PREDICTED * predicted, *["CPU path"] * several, *["model"] * replica]
    return [*headers, *["RPC servers"] * rpc], cells


def _predicted_cells(row: BenchRow) -> list[str]:
    if row.predicted_tokens_per_s is None or row.measured_over_predicted is None:
        return ["", ""]
    return [f"{row.predicted_tokens_per_s:.1f}", f"{row.measured_over_predicted:.2f}"]


def table(rows: Sequence[BenchRow]) -> None:
    print_table(*_grid(rows), left=("test", "KV", "CPU path", "model", "RPC servers"))


def markdown(rows: Sequence[BenchRow]) -> str:
    return markdown_table(*_grid(rows))


def csv_text(rows: Sequence[BenchRow]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(COLUMNS)
    for row in rows:
        data = asdict(row) | {"rpc": ",".join(row.rpc)}
        writer.writerow(["" if data[c] is None else data[c] for c in COLUMNS])
    return buffer.getvalue()


def json_text(model: str, rows: Sequence[BenchRow]) -> str:
    return json.dumps({"model": model, "rows": [asdict(r) for r in rows]}, indent=1) + "\n"


def _point(row: BenchRow) -> tuple[int, float, float]:
    """(x, y, spread of y) of a row in its picture: a tg row's decode speed at its depth, a pp
    row's time to the first token at its prompt length."""
    if row.test.startswith("tg"):
        return row.depth, row.tokens_per_s, row.tokens_per_s_sd
    return int(row.test[2:]), row.ttft_ms or 0.0, row.ttft_ms_sd or 0.0


def bars(rows: Sequence[BenchRow], width: int = 40) -> list[Text]:
    """The two pictures as text: decode speed against depth, TTFT against prompt length."""
    pictures: list[Text] = []
    several_paths = _compares_cpu_paths(rows)
    for kind, title, unit in (
        ("tg", "decode tokens/s by KV depth", "tok/s"),
        ("pp", "time to first token by prompt length", "ms"),
    ):
        chosen = [row for row in rows if row.test.startswith(kind)]
        if len(chosen) < 2:
            continue
        top = max(_point(row)[1] for row in chosen) or 1.0
        pictures.append(Text(title, style="bold"))
        for row in chosen:
            threads, batch = _known(row.threads), _known(row.batch)
            label = f"{row.test} @ d{row.depth} {row.kv_type} t{threads} b{batch}"
            if several_paths:
                label += f" {row.cpu_path}"
            value = _point(row)[1]
            filled = value / top * width
            bar = "█" * int(filled) + ("▌" if filled - int(filled) >= 0.5 else "")
            line = Text(f"  {label:<28} ")
            line.append(bar.ljust(width + 1), style="cyan")
            line.append(f" {value:.1f} {unit}")
            pictures.append(line)
    return pictures


AXES = {  # kind of row: the title and labels of its picture in the PNG
    "tg": (
        "Decode speed as the context fills",
        "tokens already in the KV cache",
        "decode tokens/s",
    ),
    "pp": ("Waiting for the first token", "prompt tokens", "time to first token (ms)"),
}


def plot(rows: Sequence[BenchRow], model: str, target: Path) -> None:
    """decode tokens/s against depth and TTFT against prompt length, as a PNG (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise UsageError(
            "drawing a plot needs matplotlib: pip install 'quill-llm[plot]' (or pip install "
            "matplotlib)"
        ) from error
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    several_paths = _compares_cpu_paths(rows)
    for axis, (kind, (title, xlabel, ylabel)) in zip(axes, AXES.items(), strict=True):
        series: dict[str, list[BenchRow]] = {}  # a line per test (tg) or depth (pp) and settings
        for row in rows:
            if row.test.startswith(kind):
                where = _settings(row) + (f", {row.cpu_path}" if several_paths else "")
                label = f"{row.test}, {where}" if kind == "tg" else f"depth {row.depth}, {where}"
                series.setdefault(label, []).append(row)
        for label, points in series.items():
            points.sort(key=lambda row: _point(row)[0])
            xs, ys, spreads = zip(*map(_point, points), strict=True)
            axis.errorbar(xs, ys, yerr=spreads, marker="o", capsize=3, label=label)
        axis.set(title=title, xlabel=xlabel, ylabel=ylabel)
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


def paths_rows(table: PathTable, kinds: Sequence[str]) -> list[dict[str, Any]]:
    """A row a weight type: its layout and speeds both ways, or why it has one path only."""
    rows: list[dict[str, Any]] = []
    for kind in kinds:
        measured = table.types.get(kind)
        if measured is None:
            why = "not made here" if kind in table.unmade else "no repacked layout on this CPU"
            rows.append({"weight_type": kind, "layout": None, "one_path": why})
            continue
        prefill, decode = measured.faster("prefill"), measured.faster("decode")
        rows.append({
            **measured.as_dict(),
            "prefill_faster": {"placement": prefill[0], "times": round(prefill[1], 3)},
            "decode_faster": {"placement": decode[0], "times": round(decode[1], 3)},
        })  # fmt: skip
    return rows


PATHS_HEADERS = ["type", "layout", "prefill repacked", "prefill plain", "decode repacked"]
PATHS_HEADERS += ["decode plain", "prefill faster", "decode faster"]


def show_paths(table: PathTable, kinds: Sequence[str], shown: str) -> None:
    """The path table on stdout: a table, or JSON, CSV or Markdown (shown)."""
    from cli.ui.render import write_stdout

    rows = paths_rows(table, kinds)
    if shown == "json":
        facts = {"threads": table.threads, "key": table.key, "types": rows}
        write_stdout(json.dumps(facts, indent=2) + "\n")
        return
    cells = []
    for row in rows:
        if row["layout"] is None:
            cells.append([row["weight_type"], "-", *["-"] * 4, row["one_path"], ""])
            continue
        prefill, decode = row["prefill_tokens_per_s"], row["decode_tokens_per_s"]
        speeds = [f"{prefill['repacked']:.1f}", f"{prefill['plain']:.1f}"]
        speeds += [f"{decode['repacked']:.1f}", f"{decode['plain']:.1f}"]
        faster = [
            f"{row[key]['placement']} {row[key]['times']:.2f}x"
            for key in ("prefill_faster", "decode_faster")
        ]
        cells.append([row["weight_type"], row["layout"], *speeds, *faster])
    if shown == "csv":
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerows([PATHS_HEADERS, *cells])
        write_stdout(out.getvalue())
    elif shown == "markdown":
        write_stdout(markdown_table(PATHS_HEADERS, cells))
    else:
        print_table(
            PATHS_HEADERS, cells, left=("type", "layout", "prefill faster", "decode faster")
        )
