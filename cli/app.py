"""The quill program: the Typer app, its commands registered (defined in cli/commands/), and the
one place where errors leave: a QuillError becomes its message and exit code, Ctrl-C becomes 130.

Importing this module is cheap (typer and the command signatures): each command imports what it
needs when it runs, so `quill --help` never loads llama.cpp or numpy.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

try:  # recent typer vendors click; earlier releases use click itself
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, NoArgsIsHelpError

from cli import __version__
from cli.commands import bench, cache, chat, models, quality, quantize, run, serve, tokenize
from cli.errors import EXIT_CODES_HELP, EXIT_INTERRUPTED, EXIT_USAGE, QuillError


class QuillGroup(TyperGroup):
    """Every command runs inside invoke: the one handler of QuillError and Ctrl-C."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except QuillError as error:
            from cli.ui.render import error_line

            error_line(str(error))
            raise typer.Exit(error.exit_code) from None
        except KeyboardInterrupt:
            from cli.ui.render import error_line

            error_line("interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None


app = typer.Typer(
    name="quill",
    cls=QuillGroup,
    help="Run quantized language models on your own machine, with honest numbers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
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


app.command(name="run", epilog=EXIT_CODES_HELP)(run.run)
app.command(name="pull", epilog=EXIT_CODES_HELP)(models.pull)
app.command(name="list")(models.list_models)
app.command(name="rm")(models.rm)
app.command(name="inspect", epilog=EXIT_CODES_HELP)(models.inspect)
app.command(name="quantize", epilog=EXIT_CODES_HELP)(quantize.quantize)
app.command(name="bench", epilog=EXIT_CODES_HELP)(bench.bench)
app.command(name="chat", epilog=chat.CHAT_EPILOG)(chat.chat)
app.command(name="tokenize", epilog=tokenize.EPILOG)(tokenize.tokenize)
app.command(name="serve", epilog=serve.SERVE_EPILOG)(serve.serve)
app.command(name="perplexity", epilog=quality.PPL_EPILOG)(quality.perplexity)
app.command(name="quant-report", epilog=EXIT_CODES_HELP)(quality.quant_report)
app.command(name="cache", epilog=EXIT_CODES_HELP)(cache.cache)


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
