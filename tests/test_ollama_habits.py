"""What an Ollama user types, answered as they expect (issue 47): `quill run MODEL` alone at a
terminal opens a chat with it (through a real pseudo-terminal, pexpect), `echo hi | quill run
MODEL` runs that model on stdin, a model's name that only resembles one is refused with a guess,
and the stats line names the model it ran."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pexpect
import pytest
from typer.testing import CliRunner

from cli.app import app
from cli.commands.run import names_model

from conftest import QUILL, quill_env

PROMPT = ">>> "
TURN_STATS = re.compile(r"prefill \d+ new tokens \(\d+ cached\)")


def spawn_run(quill_home: Path, *args: str) -> pexpect.spawn:
    """quill run at a terminal: stdin is the pseudo-terminal, so no prompt comes from it."""
    return pexpect.spawn(
        QUILL,
        ["run", *args],
        env=quill_env(quill_home, TERM="dumb"),
        encoding="utf-8",
        timeout=90,
        dimensions=(40, 200),
    )


def test_run_model_alone_at_a_terminal_chats_with_it_and_bye_leaves(smollm2_path, quill_home):
    child = spawn_run(quill_home, "smollm2-135m", "--temperature", "0", "-n", "16")
    child.expect_exact(PROMPT)
    assert "quill chat · smollm2-135m:q4_1 · context" in child.before
    child.sendline("What is the capital of France?")
    child.expect(TURN_STATS)
    reply = child.before.split("What is the capital of France?")[-1]
    assert reply.strip(), child.before
    child.expect_exact(PROMPT)
    child.sendline("/show")  # run's -n and --temperature reached the chat
    child.expect_exact(PROMPT)
    assert "max_tokens 16" in child.before and "temperature 0.0" in child.before
    child.sendline("/bye")
    child.expect_exact("transcript saved to")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_run_a_model_file_alone_at_a_terminal_chats_and_ctrl_d_leaves(tiny_path, quill_home):
    child = spawn_run(quill_home, str(tiny_path), "-n", "4")
    child.expect_exact(PROMPT)
    assert f"quill chat · {tiny_path}" in child.before
    child.sendline("hello")
    child.expect(TURN_STATS)
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect_exact("transcript saved to")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.parametrize("option", [["--json"], ["--raw"], ["--timeline"], ["--logprobs", "2"]])
def test_an_option_only_a_reply_has_is_refused_before_a_chat_opens(quill_home, option):
    # smollm2-135m is a registry alias: refused before anything is downloaded or loaded.
    child = spawn_run(quill_home, "smollm2-135m", *option)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2
    line = child.before
    assert line.count("\n") == 1, line
    assert f"quill: error: {option[0]} goes with a prompt" in line and "opens a chat" in line


def test_piped_stdin_is_the_prompt_of_the_model_named_alone(runner: CliRunner, tiny_path: Path):
    # `echo hello | quill run MODEL`: the model is the argument, the prompt only stdin's text.
    args = ["--raw", "-n", "2", "--json", "--temperature", "0"]
    piped = runner.invoke(app, ["run", str(tiny_path), *args], input="hello world\n")
    assert piped.exit_code == 0, piped.stderr
    typed = runner.invoke(app, ["run", "-m", str(tiny_path), "hello world", *args])
    assert typed.exit_code == 0, typed.stderr
    reply, expected = json.loads(piped.stdout), json.loads(typed.stdout)
    assert reply["model"] == str(tiny_path)
    # same path: one prompt, greedy, each run alone on one process's CPU path
    assert reply["prompt_tokens"] == expected["prompt_tokens"] and reply["text"] == expected["text"]


def test_a_model_named_alone_with_nothing_on_stdin_asks_for_a_prompt(runner, tiny_path):
    result = runner.invoke(app, ["run", str(tiny_path)], input="")
    assert result.exit_code == 2 and "no prompt" in result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("word", "guess"),
    [("llama3", "llama3.2-1b"), ("qwen:0.5b", "qwen2.5-0.5b"), ("qwen2.5:0.5x", "qwen2.5-0.5b")],
)
def test_a_word_that_resembles_a_model_is_refused_with_a_guess(runner, word, guess):
    result = runner.invoke(app, ["run", word], input="")
    assert result.exit_code == 3, result.stderr
    assert result.stderr.count("\n") == 1 and "unknown model" in result.stderr
    assert f"did you mean {guess}" in result.stderr


@pytest.mark.parametrize(
    "word",
    [
        "smollm2-135m",  # a registry alias
        "smollm2-135m:q8_0",  # alias:tag
        "qwen2.5:0.5b",  # Ollama's size as a tag
        "qwen2.5:0.5b-q8_0",
        "Qwen/Qwen2.5-0.5B-Instruct-GGUF",  # OWNER/REPO
        "bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M",  # OWNER/REPO:QUANT
        "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf",
        "missing.gguf",  # a model file, even one that is not there: opening it says so
    ],
)
def test_names_a_model(word: str) -> None:
    assert names_model(word)


@pytest.mark.parametrize("word", ["Hello", "Why?", "2+2", "What is smollm2-135m?", ""])
def test_is_a_prompt(word: str) -> None:
    assert not names_model(word)


def test_a_file_of_another_kind_is_a_prompt(tmp_path, monkeypatch, tiny_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").write_text("not a model")
    assert not names_model("notes") and names_model(str(tiny_path))


def test_the_stats_line_names_the_model_it_ran(runner: CliRunner, tiny_path: Path) -> None:
    result = runner.invoke(app, ["run", "-m", str(tiny_path), "--raw", "-n", "2", "hi"])
    assert result.exit_code == 0, result.stderr
    (line,) = [text for text in result.stderr.splitlines() if " TTFT " in text]
    assert line.startswith("load ") and line.endswith(f" · model {tiny_path.name}")


def test_a_chat_turns_stats_line_names_the_model_too(runner: CliRunner, tiny_path: Path) -> None:
    result = runner.invoke(app, ["chat", "-m", str(tiny_path), "-n", "2"], input="hi\n")
    assert result.exit_code == 0, result.stderr
    (line,) = [text for text in result.stderr.splitlines() if TURN_STATS.search(text)]
    assert line.endswith(f" · model {tiny_path.name}")


def test_the_stats_line_names_the_tag_an_alias_ran(runner: CliRunner, smollm2_path: Path) -> None:
    result = runner.invoke(app, ["run", "smollm2-135m", "-n", "2", "--offline"], input="Hi")
    assert result.exit_code == 0, result.stderr
    (line,) = [text for text in result.stderr.splitlines() if " TTFT " in text]
    assert line.endswith(" · model smollm2-135m:q4_1")
