"""Odd bytes in what a user types: a chat line that is not valid UTF-8 is refused alone, saying
which byte, and the chat goes on; a NUL does not cut a prompt, templated or read from stdin."""

from __future__ import annotations

import json
import subprocess

from cli.app import app
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions

from conftest import QUILL, quill_env
from refusals import one_error_line


def test_an_invalid_utf8_line_is_refused_alone(smollm2_path, quill_home, tmp_path):
    transcript = tmp_path / "chat.json"
    result = subprocess.run(
        [QUILL, "chat", "--temperature", "0", "-n", "20", "--transcript", str(transcript)],
        input=b"My name is Bob.\nhello \xff there\nWhat is my name?\n",
        capture_output=True, env=quill_env(quill_home), timeout=120,
    )  # fmt: skip
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    one_error_line(stderr, "line 2 is not valid UTF-8 (byte 0xff at character 7)")
    messages = json.loads(transcript.read_text())["messages"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert users == ["My name is Bob.", "What is my name?"]
    assert all(m["content"] for m in messages if m["role"] == "assistant")
    assert len(messages) == 4 and not list(tmp_path.glob(".*.part"))


def test_a_nul_does_not_cut_the_templated_prompt(runner, smollm2_path):
    with Engine(smollm2_path, LoadOptions(n_ctx=256, threads=2)) as engine:
        rendered = engine.chat_prompt([("user", "before\0after the nul")])
    assert rendered is not None and "before\0after the nul" in rendered

    def prompt_tokens(stdin: str) -> int:
        result = runner.invoke(app, ["run", "--json", "-n", "1", "--temp", "0"], input=stdin)
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)["prompt_tokens"]

    head = prompt_tokens("Say hi\0")
    assert prompt_tokens("Say hi\0 and then tell me about the sea in five words") > head + 5
