"""quill's commands. Thin: parse options, call the library, render its events, map errors."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

try:  # recent typer vendors click; earlier releases use click itself
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, NoArgsIsHelpError

from cli import __version__
from cli.commands import chat as chat_command
from cli.commands import quality
from cli.commands import serve as serve_command
from cli.commands import tokenize as tokenize_command
from cli.commands.options import (
    EXIT_CODES_HELP,
    ApiKey,
    KvType,
    MinP,
    Offline,
    RepeatPenalty,
    Seed,
    Temperature,
    Threads,
    TopK,
    TopP,
    fail,
    kv_types,
    obtain_model,
    parse_gpu_layers,
)
from cli.engine.sampling import SamplingParams
from cli.errors import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    ModelNotFoundError,
    QuillError,
    UsageError,
)

app = typer.Typer(
    name="quill",
    help="Run quantized language models on your own machine, with honest numbers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

DEFAULT_SAMPLING = SamplingParams()  # the CLI shows the engine's own defaults


def _version(value: bool) -> None:
    if value:
        print(f"quill {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """Run quantized language models on your own machine, with honest numbers."""


def stdin_is_terminal() -> bool:
    return sys.stdin.isatty()


def read_prompt(argument: str | None) -> str:
    """The argument, then stdin (when it is not a terminal) appended after a blank line."""
    parts = [argument] if argument else []
    if not sys.stdin.isatty():
        piped = sys.stdin.buffer.read().decode("utf-8", errors="replace")
        if piped.strip():
            parts.append(piped.rstrip("\n"))
    if not parts:
        raise UsageError('no prompt: give one as an argument (quill run "...") or on stdin')
    return "\n\n".join(parts)


@app.command(epilog=EXIT_CODES_HELP)
def run(
    prompt: Annotated[
        str | None, typer.Argument(help="The prompt. Text on stdin is appended after it.")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "-m",
            "--model",
            help="Alias from models.yaml (alias or alias:tag), a .gguf path, or "
            "hf://OWNER/REPO/FILE.gguf. Default: smollm2-135m.",
        ),
    ] = None,
    system: Annotated[str | None, typer.Option("-s", "--system", help="System prompt.")] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as it is, without the chat template.")
    ] = False,
    max_tokens: Annotated[
        int, typer.Option("-n", "--max-tokens", min=1, help="Most tokens to generate.")
    ] = 512,
    temperature: Temperature = DEFAULT_SAMPLING.temperature,
    top_k: TopK = DEFAULT_SAMPLING.top_k,
    top_p: TopP = DEFAULT_SAMPLING.top_p,
    min_p: MinP = DEFAULT_SAMPLING.min_p,
    repeat_penalty: RepeatPenalty = DEFAULT_SAMPLING.repeat_penalty,
    seed: Seed = None,
    ignore_eos: Annotated[
        bool,
        typer.Option(
            "--ignore-eos", help="Never end at the model's end-of-text token (benchmarks)."
        ),
    ] = False,
    stop: Annotated[
        list[str] | None,
        typer.Option("--stop", help="Stop when this text appears (repeatable); it is not printed."),
    ] = None,
    ctx: Annotated[
        int | None,
        typer.Option(
            "--ctx",
            min=16,
            help="Context window in tokens. Default: 4096, or less if trained less.",
        ),
    ] = None,
    threads: Annotated[
        int | None, typer.Option("--threads", "-t", min=1, help="Default: physical cores.")
    ] = None,
    gpu_layers: Annotated[
        str | None,
        typer.Option(
            "--gpu-layers",
            help="Layers to offload, a number or 'all'. Default: all on a GPU build, else 0.",
        ),
    ] = None,
    kv_type: KvType = "f16",
    kv_k: Annotated[
        str | None, typer.Option("--kv-k", help="K cache type (overrides --kv-type).")
    ] = None,
    kv_v: Annotated[
        str | None,
        typer.Option(
            "--kv-v",
            help="V cache type (overrides --kv-type); quantized V turns on flash attention.",
        ),
    ] = None,
    offline: Annotated[
        bool, typer.Option("--offline", help="Use only models already on disk; no network.")
    ] = False,
    timeline: Annotated[
        bool,
        typer.Option(
            "--timeline", help="After the reply, each token's arrival time and a histogram of gaps."
        ),
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (text and metrics) on stdout.")
    ] = False,
    no_stats: Annotated[
        bool, typer.Option("--no-stats", help="Do not print the stats line.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show llama.cpp's own log lines.")
    ] = False,
    endpoint: Annotated[
        str | None,
        typer.Option(
            "--endpoint",
            help="An OpenAI-compatible server (e.g. http://127.0.0.1:8080/v1) instead of a "
            "local model; -m names its model.",
        ),
    ] = None,
    api_key: ApiKey = None,
) -> None:
    """Generate a reply to PROMPT, streamed to stdout; timing goes to stderr."""
    from cli.commands import run as runner

    try:
        code = runner.run_once(
            runner.RunRequest(
                prompt=read_prompt(prompt),
                model=model,
                system=system,
                raw=raw,
                max_tokens=max_tokens,
                sampling=SamplingParams(
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    min_p=min_p,
                    repeat_penalty=repeat_penalty,
                    seed=seed,
                    ignore_eos=ignore_eos,
                ),
                stop=tuple(stop or ()),
                ctx=ctx,
                threads=threads,
                gpu_layers=parse_gpu_layers(gpu_layers),
                kv_types=kv_types(kv_type, kv_k, kv_v),
                offline=offline,
                json_output=json_output,
                show_stats=not no_stats,
                timeline=timeline,
                verbose=verbose,
                endpoint=endpoint,
                api_key=api_key,
            )
        )
    except QuillError as error:
        fail(error)
    except KeyboardInterrupt:
        from cli.ui.render import error_line

        error_line("interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    raise typer.Exit(code)


@app.command(epilog=EXIT_CODES_HELP)
def pull(
    name: Annotated[
        str, typer.Argument(help="Alias[:tag], OWNER/REPO[:QUANT] or hf://OWNER/REPO/FILE.gguf.")
    ],
    offline: Annotated[
        bool, typer.Option("--offline", help="Only check the local cache; no network.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show the Hub client's log.")
    ] = False,
) -> None:
    """Download a model into the local cache: resumable, checked against its sha256."""
    from cli.store.models import local_path, obtain, parse_model_name
    from cli.store.registry import load_registry
    from cli.ui import render
    from cli.ui.progress import download_progress
    from cli.units import human_bytes

    try:
        request = parse_model_name(name, load_registry())
        if request.path is not None:
            raise UsageError(f"{name} is a local file already; `quill run -m {name}` runs it")
        try:
            path = local_path(request)
            render.info_line(f"{request.label}: already on disk at {path}")
        except ModelNotFoundError:
            path = obtain(
                request,
                offline=offline,
                report=render.info_line,
                progress=download_progress(),
                terminal=sys.stderr.isatty(),
                verbose=verbose,
            )
        render.info_line(f"{request.label}: {human_bytes(path.stat().st_size)}")
    except QuillError as error:
        fail(error)
    except KeyboardInterrupt:
        from cli.ui.render import error_line

        error_line("interrupted; run the same command again to resume the download")
        raise typer.Exit(EXIT_INTERRUPTED) from None


@app.command(name="list")
def list_models(
    json_output: Annotated[bool, typer.Option("--json", help="One JSON array on stdout.")] = False,
) -> None:
    """List the models on disk: what quill fetched, and registry models other tools cached."""
    import json

    from cli.gguf_info import read_gguf
    from cli.store.models import list_local
    from cli.store.registry import load_registry
    from cli.ui import render

    try:
        models = list_local(load_registry())
    except QuillError as error:
        fail(error)
    quants = {}
    for model in models:
        try:
            quants[str(model.path)] = read_gguf(model.path).file_type or "?"
        except QuillError:
            quants[str(model.path)] = "unreadable"
    if json_output:
        rows = [
            {
                "name": m.name,
                "quant": quants[str(m.path)],
                "size": m.size,
                "source": m.source,
                "owned": m.owned,
                "path": str(m.path),
            }
            for m in models
        ]
        render.write_stdout(json.dumps(rows, indent=1) + "\n")
    elif not models:
        render.info_line("no models on disk yet: `quill pull smollm2-135m` gets the default one")
    else:
        render.models_table(models, quants)


@app.command()
def rm(
    name: Annotated[str, typer.Argument(help="The model to delete, as `quill list` names it.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
) -> None:
    """Delete a model quill downloaded. Files quill did not fetch or make are never touched."""
    from cli.store.models import local_path, owns, parse_model_name, remove
    from cli.store.registry import load_registry
    from cli.ui import render
    from cli.units import human_bytes

    try:
        request = parse_model_name(name, load_registry())
        path = local_path(request)
        if not owns(path):
            remove(request)  # raises the refusal, with its reason
        if not yes:
            if not stdin_is_terminal():
                raise UsageError(f"not deleting {path} without confirmation: add -y")
            size = human_bytes(path.stat().st_size)
            if not typer.confirm(f"Delete {path} ({size})?", err=True):
                raise typer.Exit(1)
        removed = remove(request)
        render.info_line(f"removed {removed.name}: {removed.path} ({human_bytes(removed.size)})")
    except QuillError as error:
        fail(error)


@app.command(epilog=EXIT_CODES_HELP)
def inspect(
    name: Annotated[
        str,
        typer.Argument(
            help="A model on disk: alias[:tag], OWNER/REPO[:QUANT], hf://..., or a path."
        ),
    ],
    ctx: Annotated[
        int | None,
        typer.Option("--ctx", min=1, help="Plan memory for this context (default 4096)."),
    ] = None,
    kv_type: KvType = "f16",
    kv_k: Annotated[str | None, typer.Option("--kv-k", help="K cache type.")] = None,
    kv_v: Annotated[str | None, typer.Option("--kv-v", help="V cache type.")] = None,
    mem: Annotated[
        str | None,
        typer.Option("--mem", help="A memory budget, e.g. 4GiB: the largest context that fits."),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Show what a GGUF file holds and the memory it needs at a context, without loading weights."""
    import json

    from cli.gguf_info import read_gguf
    from cli.store.models import local_path, parse_model_name
    from cli.store.registry import load_registry
    from cli.ui import render
    from quant.memory import ModelShape, largest_context, parse_size, plan

    try:
        path = local_path(parse_model_name(name, load_registry()))
        info = read_gguf(path)
        type_k, type_v = kv_types(kv_type, kv_k, kv_v)
        try:
            budget = parse_size(mem) if mem is not None else None
        except ValueError as error:
            raise UsageError(f"--mem: {error}") from None
    except QuillError as error:
        fail(error)
    shape = ModelShape.from_gguf(path)
    n_ctx = ctx or min(4096, shape.trained_ctx or 4096)
    memory = plan(shape, n_ctx, type_k, type_v)
    largest = largest_context(shape, budget, type_k, type_v) if budget is not None else None
    if json_output:
        data = {**info.as_dict(), "memory": memory.as_dict()}
        if budget is not None:
            data["memory_budget"] = {"bytes": budget, "largest_context": largest}
        render.write_stdout(json.dumps(data, indent=1) + "\n")
    else:
        render.gguf_report(info)
        render.memory_report(memory, budget, largest)


@app.command(epilog=EXIT_CODES_HELP)
def quantize(
    name: Annotated[str, typer.Argument(help="The model to quantize (F32/F16/BF16 GGUF).")],
    to: Annotated[
        str,
        typer.Option("--to", help="int8 (q8_0), int4 (q4_k_m), q4_0, q5_k_m, q6_k, ... or f16."),
    ],
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Where to write it.")
    ] = None,
    threads: Threads = None,
    allow_requantize: Annotated[
        bool,
        typer.Option(
            "--allow-requantize", help="Quantize an already-quantized model (loses quality)."
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Replace the output if it exists.")
    ] = False,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    offline: Offline = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log (one line per tensor).")
    ] = False,
) -> None:
    """Quantize a model's weights with llama.cpp's quantizer; --to f16 turns a quantized model back
    into F16 (it cannot restore the precision already lost)."""
    import json

    from cli.engine.hardware import physical_cores
    from cli.engine.llamalog import llama_log
    from cli.store.making import make_quantized
    from cli.store.models import obtain, parse_model_name
    from cli.store.registry import load_registry
    from cli.ui import render
    from cli.ui.progress import StepProgress, download_progress
    from cli.units import human_bytes
    from quant.quantize import QuantizeError, weight_type

    try:
        try:
            target = weight_type(to)
        except QuantizeError as error:
            raise UsageError(str(error)) from None
        registry = load_registry()
        request = parse_model_name(name, registry)
        source = obtain(
            request,
            offline=offline,
            report=render.info_line,
            progress=download_progress(),
            terminal=sys.stderr.isatty(),
        )
        threads = threads or physical_cores()
        llama_log().verbose = verbose
        render.info_line(f"quantizing {source.name} to {target} with {threads} threads")
        with StepProgress("tensors") as progress:
            made = make_quantized(
                name,
                request,
                source,
                target,
                registry,
                threads,
                output=output,
                allow_requantize=allow_requantize,
                force=force,
                on_tensor=None if verbose else progress.update,
            )
        result, made_name = made.result, made.name
        if result.dequantized:
            render.warning_line(
                f"{name} is quantized: the {target} copy holds exactly its rounded weights, "
                "it cannot restore the precision they lost"
            )
    except QuillError as error:
        fail(error)
    if json_output:
        render.write_stdout(json.dumps({"name": made_name, **result.as_dict()}, indent=1) + "\n")
    render.info_line(
        f"{made_name}: {human_bytes(result.output_bytes)} from {human_bytes(result.source_bytes)} "
        f"({result.ratio:.3f}), {result.bits_per_weight:.2f} bits per weight, "
        f"{result.seconds:.1f} s with {result.threads} threads -> {result.output}"
    )


def _numbers(value: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise UsageError(
            f"{flag} takes comma-separated whole numbers, like 0,1024; got {value!r}"
        ) from None


@app.command(epilog=EXIT_CODES_HELP)
def bench(
    model: Annotated[str | None, typer.Argument(help="The model (default: smollm2-135m).")] = None,
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
        typer.Option("-t", "--threads", help="Thread counts, e.g. 1,2. Default: physical cores."),
    ] = None,
    batch: Annotated[
        str, typer.Option("-b", "--batch", help="Batch sizes for prefill, e.g. 128,512.")
    ] = "512",
    repetitions: Annotated[
        int, typer.Option("-r", "--repetitions", help="Measured rounds, after one warm-up round.")
    ] = 5,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
    csv_output: Annotated[bool, typer.Option("--csv", help="Print CSV on stdout.")] = False,
    markdown_output: Annotated[
        bool, typer.Option("--markdown", help="Print a Markdown table on stdout.")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Also draw the results into this PNG (needs matplotlib)."),
    ] = None,
    offline: Offline = False,
    endpoint: Annotated[
        str | None,
        typer.Option(
            "--endpoint",
            help="Measure an OpenAI-compatible server instead (-p, -n and -r apply; MODEL is "
            "its model name).",
        ),
    ] = None,
    api_key: ApiKey = None,
) -> None:
    """Measure prefill and decode speed over a grid of lengths, depths, KV types and threads."""
    from cli.gguf_info import read_gguf
    from cli.measure.bench import BenchGrid, run_bench
    from cli.ui import render

    try:
        if sum((json_output, csv_output, markdown_output)) > 1:
            raise UsageError("choose one of --json, --csv and --markdown")
        grid = BenchGrid(
            prompt_tokens=_numbers(prompt_tokens, "-p/--prompt-tokens")
            if prompt_tokens != "0"
            else (),
            gen_tokens=_numbers(gen_tokens, "-n/--gen-tokens") if gen_tokens != "0" else (),
            depths=_numbers(depth, "--depth"),
            kv_types=tuple(kv_type.split(",")),
            threads=_numbers(threads, "--threads") if threads else (),
            batches=_numbers(batch, "--batch"),
            repetitions=repetitions,
        )
        grid.check()
        if endpoint:
            rows = _bench_endpoint(endpoint, model, grid, api_key)
            label = model or "endpoint"
            _show_bench(rows, label, json_output, csv_output, markdown_output, plot)
            return
        label, path = obtain_model(model, offline)
        grid.check(read_gguf(path).context_length)
        rows = []
        for row in run_bench(path, grid):
            rows.append(row)
            render.info_line(
                f"{row.test} @ depth {row.depth}, {row.kv_type}, {row.threads} threads, "
                f"batch {row.batch}: {row.tokens_per_s:.1f} ± {row.tokens_per_s_sd:.1f} tok/s"
            )
    except QuillError as error:
        fail(error)
    except KeyboardInterrupt:
        render.error_line("interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    _show_bench(rows, label, json_output, csv_output, markdown_output, plot)


def _bench_endpoint(endpoint: str, model: str | None, grid, api_key: str | None) -> list:
    from cli.api.client import first_model
    from cli.measure.bench import run_endpoint_bench
    from cli.ui import render

    if grid.depths != (0,) or grid.kv_types != ("f16",) or grid.threads or grid.batches != (512,):
        raise UsageError("--depth, --kv-type, --threads and --batch are the server's to choose")
    model = model or first_model(endpoint, api_key) or "default"
    rows = []
    for row in run_endpoint_bench(endpoint, model, grid, api_key):
        rows.append(row)
        render.info_line(
            f"{row.test} at {endpoint}: {row.tokens_per_s:.1f} ± {row.tokens_per_s_sd:.1f} tok/s"
        )
    return rows


def _show_bench(rows, label, json_output, csv_output, markdown_output, plot) -> None:
    from cli.ui import benchrender, render

    if json_output:
        render.write_stdout(benchrender.json_text(label, rows))
    elif csv_output:
        render.write_stdout(benchrender.csv_text(rows))
    elif markdown_output:
        render.write_stdout(benchrender.markdown(rows))
    else:
        benchrender.table(rows)
        for line in benchrender.bars(rows):
            render.stdout_console.print(line)
    if plot is not None:
        try:
            benchrender.plot(rows, label, plot)
        except QuillError as error:
            fail(error)
        render.info_line(f"plot written to {plot}")


app.command(name="chat", epilog=chat_command.CHAT_EPILOG)(chat_command.chat)
app.command(name="tokenize", epilog=tokenize_command.EPILOG)(tokenize_command.tokenize)
app.command(name="serve", epilog=serve_command.SERVE_EPILOG)(serve_command.serve)
app.command(name="perplexity", epilog=quality.PPL_EPILOG)(quality.perplexity)
app.command(name="quant-report", epilog=EXIT_CODES_HELP)(quality.quant_report)


def main() -> None:
    """The console script: every outcome leaves through here with a documented exit code."""
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as error:
        error.ctx.get_help()  # typer renders the help itself
        sys.exit(EXIT_USAGE)
    except ClickException as error:
        from cli.ui.render import error_line

        where = error.ctx.command_path if getattr(error, "ctx", None) else "quill"
        error_line(f"{error.format_message()} (see {where} --help)")
        sys.exit(error.exit_code)
    except typer.Abort:
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)
