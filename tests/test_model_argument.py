"""How run takes its model, as an Ollama user types it: `quill run MODEL PROMPT` (a path or a store
name first), one argument beside -m still the prompt, an unquoted prompt one line saying to quote
it, and an unknown model answered with the near names it might be (Ollama's names read as
models.yaml writes them), or with no guess when none is near."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app


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
    # The prompt is a model's name: beside -m, it is the prompt, not the model
    # (alone it is the model: tests/test_ollama_habits.py).
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


@pytest.mark.parametrize("name", ["qwen2.5:0.5x", "qwen:0.5b", "qwen2.5-0.5"])
def test_an_ollama_style_name_suggests_the_registry_model_first(
    runner: CliRunner, name: str
) -> None:
    result = runner.invoke(app, ["run", "-m", name, "hi"])
    assert result.exit_code == 3 and result.stderr.count("\n") == 1
    assert "did you mean qwen2.5-0.5b" in result.stderr
