"""What every command shares, as a llama.cpp user expects it: -ngl wherever --gpu-layers is, one
default context for serve as for run and chat, and each --help ending with its own exit codes."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from cli.app import COMMANDS, app
from cli.engine.options import DEFAULT_CTX
from cli.errors import EXIT_CODES, EXIT_INVALID_OUTPUT


def _help(runner: CliRunner, command: str) -> str:
    result = runner.invoke(app, [command, "--help"], terminal_width=2000)
    assert result.exit_code == 0, result.output
    return result.output


def test_ngl_is_accepted_wherever_gpu_layers_is(runner: CliRunner, tiny_path: Path) -> None:
    with_gpu_layers = [name for name, *_ in COMMANDS if "--gpu-layers" in _help(runner, name)]
    assert {"run", "chat", "serve", "perplexity"} <= set(with_gpu_layers)
    for command in with_gpu_layers:
        assert "-ngl, --gpu-layers" in _help(runner, command), command
        after = {"run": ["hi"], "perplexity": ["-f", str(tiny_path)]}.get(command, [])
        result = runner.invoke(app, [command, "-ngl", "lots", "-m", str(tiny_path), *after])
        assert result.exit_code == 2, (command, result.output)
        assert "--gpu-layers takes a number of layers or 'all'" in result.stderr, command
    result = runner.invoke(
        app, ["run", "-m", str(tiny_path), "-ngl", "0", "--raw", "-n", "2", "hi"]
    )
    assert result.exit_code == 0, result.stderr


def test_serve_defaults_to_the_context_run_and_chat_use(runner: CliRunner) -> None:
    # --parallel past a batch is refused before loading, naming the --ctx it assumed.
    result = runner.invoke(app, ["serve", "--parallel", "600"])
    assert result.exit_code == 2
    assert f"--ctx {DEFAULT_CTX}" in result.stderr
    ctx_help = f"Default: {DEFAULT_CTX}, or the model's trained context if that is less."
    assert ctx_help in _help(runner, "serve") and ctx_help in _help(runner, "run")


def test_each_help_ends_with_its_own_exit_codes(runner: CliRunner) -> None:
    for command, *_ in COMMANDS:
        last = _help(runner, command).strip().splitlines()[-1]
        assert "Exit codes: 0 success" in last and last.endswith("130 interrupted."), command
        schema = f"{EXIT_INVALID_OUTPUT} {EXIT_CODES[EXIT_INVALID_OUTPUT]}"
        assert (schema in last) == (command == "run"), command
    assert "3 model not found" not in _help(runner, "list")
    assert "3 model not found" in _help(runner, "pull")
