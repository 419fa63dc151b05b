"""quill's commands. Thin: parse options, call the library, render its events, map errors."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

try:  # recent typer vendors click; earlier releases use click itself
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, NoArgsIsHelpError

from cli import __version__
from cli.errors import EXIT_INTERRUPTED, EXIT_USAGE, QuillError, UsageError
from cli.sampling import SamplingParams

app = typer.Typer(
    name="quill",
    help="Run quantized language models on your own machine, with honest numbers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

DEFAULT_SAMPLING = SamplingParams()  # the CLI shows the engine's own defaults

EXIT_CODES_HELP = (
    "Exit codes: 0 success (finish stop or length), 2 usage, 3 model not found or not obtainable, "
    "4 context overflow, 5 model failed to load, 130 interrupted."
)


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


def parse_gpu_layers(value: str | None) -> int | None:
    if value is None:
        return None
    if value == "all":
        from cli.engine import ALL_LAYERS

        return ALL_LAYERS
    if value.isdigit():
        return int(value)
    raise UsageError(f"--gpu-layers takes a number of layers or 'all', not {value!r}")


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
    temperature: Annotated[
        float, typer.Option("--temperature", "--temp", min=0.0, help="0 means greedy.")
    ] = DEFAULT_SAMPLING.temperature,
    top_k: Annotated[
        int, typer.Option("--top-k", min=0, help="0 turns it off.")
    ] = DEFAULT_SAMPLING.top_k,
    top_p: Annotated[
        float, typer.Option("--top-p", min=0.0, max=1.0, help="1 turns it off.")
    ] = DEFAULT_SAMPLING.top_p,
    min_p: Annotated[
        float, typer.Option("--min-p", min=0.0, max=1.0, help="0 turns it off.")
    ] = DEFAULT_SAMPLING.min_p,
    repeat_penalty: Annotated[
        float, typer.Option("--repeat-penalty", min=0.0, help="1 turns it off.")
    ] = DEFAULT_SAMPLING.repeat_penalty,
    seed: Annotated[
        int | None, typer.Option("--seed", min=0, help="Sampling seed. Default: random, reported.")
    ] = None,
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
    offline: Annotated[
        bool, typer.Option("--offline", help="Use only models already on disk; no network.")
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
) -> None:
    """Generate a reply to PROMPT, streamed to stdout; timing goes to stderr."""
    from cli import runner

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
                offline=offline,
                json_output=json_output,
                show_stats=not no_stats,
                verbose=verbose,
            )
        )
    except QuillError as error:
        _fail(error)
    except KeyboardInterrupt:
        from cli.render import error_line

        error_line("interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    raise typer.Exit(code)


def _fail(error: QuillError) -> None:
    from cli.render import error_line

    error_line(str(error))
    raise typer.Exit(error.exit_code)


def main() -> None:
    """The console script: every outcome leaves through here with a documented exit code."""
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as error:
        error.ctx.get_help()  # typer renders the help itself
        sys.exit(EXIT_USAGE)
    except ClickException as error:
        from cli.render import error_line

        where = error.ctx.command_path if getattr(error, "ctx", None) else "quill"
        error_line(f"{error.format_message()} (see {where} --help)")
        sys.exit(error.exit_code)
    except typer.Abort:
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)
