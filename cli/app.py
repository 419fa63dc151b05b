"""The quill program: the Typer app over cli/commands/, and the one place where errors leave (a
QuillError becomes its message and exit code, Ctrl-C 130). `quill --help` loads no command."""

from __future__ import annotations

import importlib
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperGroup
from typer.models import CommandInfo

try:  # recent typer vendors click; earlier releases use click itself
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover
    # The same classes from the other module: the type checker sees the installed typer's.
    from click.exceptions import (  # type: ignore[assignment]
        ClickException,
        NoArgsIsHelpError,
    )

from cli import __version__
from cli.errors import EXIT_INTERRUPTED, EXIT_USAGE, QuillError, exit_codes_help

# name, module under cli.commands, function, and the module's attribute holding the prose that
# ends its --help (None: none); the command's exit codes follow it (cli/errors.py).
COMMANDS: tuple[tuple[str, str, str, str | None], ...] = (
    ("run", "run", "run", None),
    ("pull", "models", "pull", None),
    ("list", "models", "list_models", None),
    ("rm", "models", "rm", None),
    ("inspect", "models", "inspect", None),
    ("quantize", "quantize", "quantize", None),
    ("bench", "bench", "bench", None),
    ("chat", "chat", "chat", "CHAT_EPILOG"),
    ("tokenize", "tokenize", "tokenize", "EPILOG"),
    ("embed", "embed", "embed", "EMBED_EPILOG"),
    ("rerank", "embed", "rerank", None),
    ("similar", "similar", "similar", None),
    ("collections", "similar", "collections", None),
    ("serve", "serve", "serve", "SERVE_EPILOG"),
    ("ps", "serve", "ps", None),
    ("stop", "serve", "stop", None),
    ("perplexity", "quality", "perplexity", "PPL_EPILOG"),
    ("quant-report", "quality", "quant_report", None),
    ("cache", "cache", "cache", None),
    ("config", "config", "config", "CONFIG_EPILOG"),
    ("rpc-server", "rpcserver", "rpc_server", "RPC_EPILOG"),
)


# Ollama's names for two commands, answered as the commands themselves (not listed apart).
ALIASES = {"ls": "list", "show": "inspect"}


# The first sentence of each command's docstring: `quill --help` lists the commands without
# importing their modules (tests/test_layers.py checks each against its docstring).
SUMMARIES: dict[str, str] = {
    "run": ("Generate a reply to PROMPT, streamed to stdout; reasoning and timing go to stderr."),
    "pull": "Download a model into the local cache: resumable, checked against its sha256.",
    "list": (
        "List the models on disk: what quill fetched, and registry models other tools cached."
    ),
    "rm": "Delete a model quill downloaded.",
    "inspect": (
        "Show what a GGUF file holds and the memory it needs at a context, without loading weights."
    ),
    "quantize": (
        "Quantize a model's weights with llama.cpp's quantizer; --to f16 turns a "
        "quantized model back into F16 (it cannot restore the precision already lost)."
    ),
    "bench": (
        "Measure prefill and decode speed over a grid of lengths, depths, KV types and threads."
    ),
    "chat": "Chat with a model in the terminal: each turn prefills only what is new.",
    "tokenize": (
        "Show the tokens a text becomes: tokens, not characters, are what context, "
        "max_tokens and speed are counted in."
    ),
    "embed": (
        "Embed texts: one vector per text, as JSON lines on stdout (or a .npy matrix, or into "
        "a collection quill similar searches)."
    ),
    "rerank": (
        "Rank documents (one per line of stdin) by relevance to QUERY with a reranker model: "
        "the best first, each with its score."
    ),
    "similar": "Show the items of a collection nearest a text, best first, by cosine similarity.",
    "collections": "List the embedding collections: name, model, items, dimensions, last update.",
    "serve": "Serve a model over an OpenAI-compatible HTTP API, batching concurrent requests.",
    "ps": "List the models a running quill serve holds: memory, slots busy, time to unload.",
    "stop": "Unload a model from a running quill serve (once its requests in flight finish).",
    "perplexity": (
        "Perplexity of a model over a text file, with its ± error: lower is better, and "
        "the change against the F16 model is what a quantization costs."
    ),
    "quant-report": "Which quant should I use on this machine?",
    "cache": (
        "The KV store (the prompt caches quill run, chat and serve keep) and the replicas "
        "under QUILL_HOME/cache: list or clear them."
    ),
    "config": "Show the defaults in force and where each comes from, or set one in QUILL_HOME's "
    "config.toml.",
    "rpc-server": (
        "Serve this machine's CPU (or GPUs) to quill and llama.cpp clients over llama.cpp's "
        "RPC protocol, one client at a time, until Ctrl-C or SIGTERM."
    ),
}


def _command_info(name: str) -> CommandInfo | None:
    """The registration of one command, importing only its module."""
    for command, module_name, function, epilog in COMMANDS:
        if command == name:
            module = importlib.import_module(f"cli.commands.{module_name}")
            prose = getattr(module, epilog, "") if epilog else ""
            text = f"{prose} {exit_codes_help(name)}".strip()
            return CommandInfo(name=name, callback=getattr(module, function), epilog=text)
    return None


class QuillGroup(TyperGroup):
    """The group main() runs. It imports and builds only the command being run (Typer would
    otherwise import every command module and read every signature on every start), and every
    command runs inside invoke: the one handler of QuillError and Ctrl-C."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except QuillError as error:
            from cli.commands.wording import user_message
            from cli.ui.render import error_line

            error_line(user_message(error))
            raise typer.Exit(error.exit_code) from None
        except KeyboardInterrupt:
            from cli.ui.render import error_line

            error_line("interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None

    def list_commands(self, ctx: Any) -> list[str]:
        return [name for name, *_ in COMMANDS]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        info = _command_info(ALIASES.get(cmd_name, cmd_name))
        if info is None:
            return None
        return typer.main.get_command_from_info(
            info, pretty_exceptions_short=True, rich_markup_mode=None
        )

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        with formatter.section("Commands"):
            named = {name: f"{name} ({alias})" for alias, name in ALIASES.items()}
            formatter.write_dl([(named.get(name, name), SUMMARIES[name]) for name, *_ in COMMANDS])


# Help is click's plain text: rich's panels cost more start-up time (its import alone is a
# tenth of a second) than the whole of `quill list`, and plain text is what a pipe wants.
SETTINGS: dict[str, Any] = {
    "name": "quill",
    "help": "Run quantized language models on your own machine, with honest numbers.",
    "no_args_is_help": True,
    "add_completion": False,
    "pretty_exceptions_enable": False,
    "rich_markup_mode": None,
    "context_settings": {"help_option_names": ["-h", "--help"]},
}
# The console script, tests (CliRunner) and docgen all run this app.
app = typer.Typer(cls=QuillGroup, **SETTINGS)


def _version(value: bool) -> None:
    if value:
        print(f"quill {__version__} ({_llama_build()})")
        raise typer.Exit()


def _llama_build() -> str:
    """llama-cpp-python's version and whether it has the RPC backend (docs/scale.md), read from
    its files: importing it costs half a second."""
    import importlib.metadata
    import importlib.util
    from pathlib import Path

    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return "llama-cpp-python missing"
    spec = importlib.util.find_spec("llama_cpp")
    libs = Path(spec.origin).parent / "lib" if spec and spec.origin else None
    rpc = bool(libs and any(libs.glob("*ggml-rpc.*")))
    return f"llama-cpp-python {version}, RPC {'on' if rpc else 'off: reinstall as the README says'}"


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """Run quantized language models on your own machine, with honest numbers."""


def main() -> None:
    """The console script: every outcome leaves through here with a documented exit code."""
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as error:
        sys.stderr.write(error.ctx.get_help() + "\n")
        sys.exit(EXIT_USAGE)
    except ClickException as error:
        from cli.ui.render import error_line

        context = getattr(error, "ctx", None)  # a UsageError's; other ClickExceptions have none
        where = context.command_path if context else "quill"
        error_line(f"{error.format_message()} (see {where} --help)")
        sys.exit(error.exit_code)
    except typer.Abort:
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)
