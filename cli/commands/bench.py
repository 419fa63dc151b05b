"""quill bench: prefill and decode speed over a grid, locally or against a server."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cli.commands import options as shared
from cli.commands.speculation import DraftModel, DraftTokens, spec_options
from cli.errors import UsageError

if TYPE_CHECKING:
    from cli.engine.speculative import SpecOptions
    from cli.measure.bench import BenchGrid, BenchRow


def _numbers(value: str, flag: str, least: int = 1) -> tuple[int, ...]:
    try:
        numbers = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise UsageError(
            f"{flag} takes comma-separated whole numbers, like 0,1024; got {value!r}"
        ) from None
    if min(numbers) < least:
        takes = "positive numbers" if least else "numbers of tokens >= 0"
        raise UsageError(f"{flag} takes {takes}, not {list(numbers)}")
    return numbers


def _check_grid(grid: BenchGrid, trained_ctx: int | None = None) -> None:
    """Refuse a grid that cannot run, before anything is loaded."""
    from quant.kv import check_kv_type

    if not (grid.prompt_tokens or grid.gen_tokens):
        raise UsageError("nothing to measure: give -p or -n a length")
    if grid.repetitions < 1:
        raise UsageError(f"-r/--repetitions must be at least 1, not {grid.repetitions}")
    for threads in grid.threads:
        shared.check_threads(threads)
    for kv in grid.kv_types:
        try:
            check_kv_type(kv, "--kv-type")
        except ValueError as error:
            raise UsageError(str(error)) from None
    if trained_ctx is not None and grid.needed_ctx > trained_ctx:
        raise UsageError(
            f"depth {max(grid.depths)} + {grid.needed_ctx - max(grid.depths)} more tokens need "
            f"{grid.needed_ctx} positions, but the model was trained for {trained_ctx}: "
            "lower --depth, -p or -n"
        )


def bench(
    name: shared.ModelArgument = None,
    model: shared.ModelOption = None,
    prompt_tokens: Annotated[
        str,
        typer.Option(
            "-p", "--prompt-tokens", help="Prompt lengths to prefill (ppP), e.g. 128,512."
        ),
    ] = "512",
    gen_tokens: Annotated[
        str, typer.Option("-n", "--gen-tokens", help="Lengths to decode (tgN), e.g. 128.")
    ] = "128",
    depth: Annotated[
        str, typer.Option("-d", "--depth", help="Tokens already in the KV cache, e.g. 0,1024,4096.")
    ] = "0",
    kv_type: Annotated[
        str, typer.Option("--kv-type", help="KV-cache types, e.g. f16,q8_0,q4_0.")
    ] = "f16",
    threads: Annotated[
        str | None,
        typer.Option(
            "-t",
            "--threads",
            help="Thread counts, e.g. 1,2. Default: the physical cores that other work leaves "
            "free, measured at each load and kept for its rows.",
        ),
    ] = None,
    batch: Annotated[
        str,
        typer.Option(
            "-b",
            "--batch",
            help="Batch sizes for prefill, e.g. 128,512; each at most the context the grid needs "
            "(deepest -d + longest -p or -n + 1), so -p 64 -n 16 runs batch 65.",
        ),
    ] = "512",
    repetitions: Annotated[
        int, typer.Option("-r", "--repetitions", help="Measured rounds, after one warm-up round.")
    ] = 5,
    repack: Annotated[
        str,
        typer.Option(
            "--repack",
            help="Weight repacking: auto (each row's weights placed as quill run would place "
            "them for that work: --paths), on, off, or a list such as auto,on,off to compare "
            "(on an AMX CPU, on means repacking by tensor name with AMX avoided).",
        ),
    ] = "auto",
    json_output: shared.JsonOutput = False,
    csv_output: Annotated[bool, typer.Option("--csv", help="Print CSV on stdout.")] = False,
    markdown_output: shared.MarkdownOutput = False,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Also draw the results into this PNG (needs matplotlib)."),
    ] = None,
    offline: shared.Offline = False,
    endpoint: Annotated[
        str | None,
        typer.Option(
            "--endpoint",
            help="Measure an OpenAI-compatible server instead (-p, -n and -r apply; the model "
            "is its model name).",
        ),
    ] = None,
    api_key: shared.ApiKey = None,
    spec: Annotated[
        str,
        typer.Option(
            "--spec",
            help="Speculative decoding for the tg rows: off, ngram, draft, or a list like "
            "off,ngram (rows tgN+ngram, with the acceptance rate).",
        ),
    ] = "off",
    draft: DraftModel = None,
    draft_tokens: DraftTokens = None,
    replica: Annotated[
        bool,
        typer.Option(
            "--replica",
            help="Measure a replica: the model's header (from the Hub by range requests when "
            "it is not on disk) with weights of noise, built once under QUILL_HOME/cache/"
            "replicas. Its speed and memory are the model's; its text is noise.",
        ),
    ] = False,
    rpc: shared.Rpc = None,
    predict: Annotated[
        bool | None,
        typer.Option(
            "--predict/--no-predict",
            help="Also predict each tg row's decode speed from the model's header alone and show "
            "measured/predicted (docs/models.md says how; the first time with a thread count it "
            "calibrates on synthetic models, a few seconds). Default: on with --replica.",
        ),
    ] = None,
    paths: Annotated[
        bool,
        typer.Option(
            "--paths",
            help="Show this CPU's path table instead: each weight type's prefill and decode "
            "speed repacked and plain, measured once per CPU, threads and build on synthetic "
            "models (a few seconds a type) and kept; what --repack auto follows.",
        ),
    ] = False,
) -> None:
    """Measure prefill and decode speed over a grid of lengths, depths, KV types and threads."""
    from cli.measure.bench import BenchGrid
    from cli.store.models import read_model

    chosen = shared.model_name(name, model)
    output = shared.output_format(json_output, csv_output, markdown_output)
    if paths:
        _show_paths(_numbers(threads, "--threads")[0] if threads else None, output)
        return
    grid = BenchGrid(
        prompt_tokens=_numbers(prompt_tokens, "-p/--prompt-tokens") if prompt_tokens != "0" else (),
        gen_tokens=_numbers(gen_tokens, "-n/--gen-tokens") if gen_tokens != "0" else (),
        depths=_numbers(depth, "--depth", least=0),
        kv_types=tuple(kv_type.split(",")),
        threads=_numbers(threads, "--threads") if threads else (),
        batches=_numbers(batch, "--batch"),
        repacks=_repack_modes(repack),
        repetitions=repetitions,
        spec=tuple(spec.split(",")),
        rpc=shared.parse_rpc(rpc),
        predict=replica if predict is None else predict,
    )
    _check_grid(grid)
    specs = _spec_options(grid, draft, draft_tokens, endpoint)
    if endpoint and replica:
        raise UsageError("--replica measures here, and --endpoint a server: choose one")
    if endpoint and predict:
        raise UsageError(
            "--predict predicts this machine's decode, and --endpoint measures a server's"
        )
    source = shared.model_source(endpoint, api_key, offline, rpc, configured=False)
    if source.endpoint:
        rows = _bench_endpoint(source, chosen, grid)
        _show_bench(rows, chosen or "endpoint", output, plot)
        return
    if replica:
        label, path = _replica(chosen, grid, offline)
    else:
        label, path = shared.obtain_model(chosen, offline)
    _check_grid(grid, read_model(path).context_length)
    drafted = shared.obtain_model(draft, offline) if "draft" in specs else None
    rows = _bench_here(path, grid, specs, drafted, label if replica else None)
    shown = f"replica of {label}" if replica else label
    _show_bench(rows, shown, output, plot)


def _spec_options(
    grid: BenchGrid, draft: str | None, draft_tokens: int | None, endpoint: str | None
) -> dict[str, SpecOptions | None]:
    """Each --spec mode of the grid with its options, checked before anything loads."""
    # The flags together, as the mode that asks the most of them takes them; then each row's.
    most = "draft" if "draft" in grid.spec else max(grid.spec, key=lambda mode: mode != "off")
    spec_options(most, draft, draft_tokens, endpoint)
    return {
        mode: spec_options(
            mode, draft if mode == "draft" else None, draft_tokens if mode != "off" else None
        )
        for mode in grid.spec
    }


def _bench_here(
    path: Path,
    grid: BenchGrid,
    specs: dict[str, SpecOptions | None],
    drafted: tuple[str, Path] | None,
    replica_of: str | None,
) -> list[BenchRow]:
    """The grid's rows measured on this machine, each said as it is measured (replica_of: the
    model a replica at path stands for)."""
    from cli.engine.opening import speculate as attach
    from cli.measure.bench import run_bench
    from cli.ui import render

    def speculate(engine, mode: str) -> None:
        attach(engine, specs[mode], drafted if mode == "draft" else None)

    def name_cpu_path(engine) -> None:
        render.info_line(f"CPU path: {engine.cpu_path.describe()}")

    rows = []
    of = f" (replica of {replica_of})" if replica_of else ""
    said = render.info_line
    for row in run_bench(path, grid, on_load=name_cpu_path, speculate=speculate, on_note=said):
        rows.append(replace(row, replica_of=replica_of) if replica_of else row)
        predicted = ""
        if row.predicted_tokens_per_s and row.measured_over_predicted:
            predicted = (
                f", predicted {row.predicted_tokens_per_s:.1f} "
                f"(measured/predicted {row.measured_over_predicted:.2f})"
            )
        render.info_line(
            f"{row.test} @ depth {row.depth}, {row.kv_type}, {row.threads} threads, "
            f"batch {row.batch}: {row.tokens_per_s:.1f} ± {row.tokens_per_s_sd:.1f} tok/s"
            f"{predicted}{of}"
        )
    for limit in dict.fromkeys(row.read_bandwidth for row in rows if row.read_bandwidth):
        render.info_line(limit.describe())
    calibrations = {row.threads: row.calibration for row in rows if row.calibration}
    for calibration in calibrations.values():
        render.info_line(calibration.describe())
    return rows


def _replica(name: str | None, grid: BenchGrid, offline: bool) -> tuple[str, Path]:
    """(the model's label, its replica's first file), built from the model's header or reused;
    refused before anything is written where it cannot fit this machine at the grid's context."""
    from cli.commands.models import available_memory
    from cli.store.models import model_header
    from cli.store.promptcache import DEFAULT_MAX_BYTES, make_room
    from cli.store.replicas import check_memory, obtain_replica
    from cli.ui import render
    from cli.units import human_bytes
    from quant.memory import plan

    request = shared.model_request(name)
    model = model_header(request, offline, prefixes=True)
    _check_grid(grid, model.shape.trained_ctx or None)
    plans = (plan(model.shape, grid.needed_ctx, kv) for kv in grid.kv_types)
    check_memory(request.label, max(plans, key=lambda p: p.total_bytes), available_memory())
    built, took = obtain_replica(model, request.label)
    done = f"reused {human_bytes(built.size)}"
    if took:
        make_room(built.folder)
        rate = human_bytes(built.size / took)
        done = f"built {human_bytes(built.size)} in {took:.2f} s ({rate}/s)"
    render.info_line(f"replica of {request.label}: {done}, at {built.path}; its text is noise")
    if built.size > DEFAULT_MAX_BYTES:  # the least recently used cache goes first: this one
        render.info_line(
            f"replica of {request.label} is larger than the cache's default limit "
            f"({human_bytes(DEFAULT_MAX_BYTES)}): the next quill run that keeps a prompt cache "
            "removes it, unless its --cache-max is larger"
        )
    return request.label, built.path


def _bench_endpoint(
    source: shared.ModelSource, model: str | None, grid: BenchGrid
) -> list[BenchRow]:
    from cli.measure.bench import run_endpoint_bench
    from cli.ui import render

    if grid.depths != (0,) or grid.kv_types != ("f16",) or grid.threads or grid.batches != (512,):
        raise UsageError("--depth, --kv-type, --threads and --batch are the server's to choose")
    endpoint = source.endpoint
    assert endpoint is not None  # a bench on this machine does not come here
    model = source.served_name(model)
    rows = []
    if grid.prompt_tokens:
        render.info_line("prompt cache off: a distinct prompt per repetition, cache_prompt false")
    for row in run_endpoint_bench(endpoint, model, grid, source.api_key):
        rows.append(row)
        render.info_line(
            f"{row.test} at {endpoint}: {row.tokens_per_s:.1f} ± {row.tokens_per_s_sd:.1f} tok/s"
        )
        if row.cached_tokens:
            render.warning_line(
                f"{row.test}: the server still reused up to {row.cached_tokens} cached prompt "
                "tokens, so its prefill rate counts tokens it did not compute"
            )
    return rows


def _show_bench(
    rows: list[BenchRow], label: str, output: shared.OutputFormat, plot: Path | None
) -> None:
    from cli.ui import benchrender, render

    if output.json:
        render.write_stdout(benchrender.json_text(label, rows))
    elif output.csv:
        render.write_stdout(benchrender.csv_text(rows))
    elif output.markdown:
        render.write_stdout(benchrender.markdown(rows))
    else:
        benchrender.table(rows)
        for line in benchrender.bars(rows):
            render.stdout_console.print(line)
    if plot is not None:
        benchrender.plot(rows, label, plot)
        render.info_line(f"plot written to {plot}")


def _repack_modes(value: str) -> tuple[str, ...]:
    parts = tuple(dict.fromkeys(value.split(",")))
    if any(part not in shared.REPACK_MODES for part in parts):
        raise UsageError(f"--repack takes auto, on, off or a list such as auto,off; got {value!r}")
    return parts


def _show_paths(threads: int | None, output: shared.OutputFormat) -> None:
    """The path table for threads (default: the physical cores), measured where it lacks a type."""
    from cli.engine.hardware import physical_cores
    from cli.measure.paths import TABLE_TYPES, path_table, repackable_types
    from cli.ui import benchrender, render

    threads = threads or physical_cores()
    kinds = repackable_types((kind, 4096) for kind in TABLE_TYPES)

    def before(missing: list[str]) -> None:
        render.info_line(
            f"the path table for {threads} threads: measuring {', '.join(missing)} "
            "(a few seconds a type, once per CPU and build)"
        )

    table = path_table(threads, kinds, before)
    if table.seconds:
        render.info_line(table.describe())
    shown = (
        "json" if output.json else "csv" if output.csv else "markdown" if output.markdown else ""
    )
    benchrender.show_paths(table, TABLE_TYPES, shown)
