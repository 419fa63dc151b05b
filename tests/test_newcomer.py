"""Issue 30, a newcomer's first hour: what an Ollama or llama.cpp user types works, through the
CLI as they type it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import COMMANDS, app
from cli.engine.options import DEFAULT_CTX
from cli.errors import EXIT_CODES, EXIT_INVALID_OUTPUT

# --- item 4: `quill run MODEL PROMPT`, and "did you mean" for an unknown model ----------------


def test_run_takes_the_model_first_as_ollama_does(runner: CliRunner, tiny_path: Path) -> None:
    result = runner.invoke(app, ["run", str(tiny_path), "hi", "--raw", "-n", "4", "--json"])
    assert result.exit_code == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["model"] == str(tiny_path)
    assert reply["path"] == str(tiny_path) and reply["prompt_tokens"] >= 1


def test_run_takes_a_store_name_first(runner: CliRunner, smollm2_path: Path) -> None:
    words = ["run", "smollm2-135m:q4_1", "Name a colour.", "-n", "8", "--json", "--offline"]
    result = runner.invoke(app, words)
    assert result.exit_code == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["model"] == "smollm2-135m:q4_1" and reply["text"]


def test_one_argument_is_still_the_prompt(runner: CliRunner, tiny_path: Path) -> None:
    # The prompt is a model's name: alone, it is the prompt, not the model.
    result = runner.invoke(app, ["run", "-m", str(tiny_path), "gemma3-270m", "--raw", "-n", "2"])
    assert result.exit_code == 0, result.stderr


def test_an_unquoted_prompt_is_one_line_saying_to_quote_it(runner: CliRunner) -> None:
    result = runner.invoke(app, ["run", "hello", "world"])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "quote" in result.stderr
    assert 'quill run "hello world"' in result.stderr
    result = runner.invoke(app, ["run", "-m", "smollm2-135m", "hello", "world"])
    assert result.exit_code == 2 and '-m smollm2-135m "hello world"' in result.stderr


@pytest.mark.parametrize("words", [["-m", "llama3.2", "hi"], ["llama3.2", "hi"]])
def test_an_unknown_model_suggests_near_names(runner: CliRunner, words: list[str]) -> None:
    result = runner.invoke(app, ["run", *words])
    assert result.exit_code == 3
    line = result.stderr
    assert line.count("\n") == 1 and "unknown model 'llama3.2'" in line
    assert "did you mean" in line and "llama3.2-1b" in line.split("?")[0]


def test_a_model_name_far_from_any_gets_no_guess(runner: CliRunner) -> None:
    result = runner.invoke(app, ["run", "-m", "zzzzzz", "hi"])
    assert result.exit_code == 3 and "did you mean" not in result.stderr


# --- item 9: -ngl, one default context, each command's own exit codes --------------------------


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
