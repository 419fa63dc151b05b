"""quill chat through a real pseudo-terminal (pexpect), and scripted on a pipe, on SmolLM2."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pexpect
import pytest

from conftest import QUILL, quill_env

PROMPT = ">>> "
STATS = re.compile(r"prefill (\d+) new tokens \((\d+) cached\)")
BRIEF = "You are a helpful assistant. Answer briefly."


def spawn(quill_home: Path, transcript: Path, *args: str) -> pexpect.spawn:
    child = pexpect.spawn(
        QUILL,
        ["chat", "--temperature", "0", "--transcript", str(transcript), *args],
        env=quill_env(quill_home, TERM="dumb"),
        encoding="utf-8",
        timeout=90,
        dimensions=(40, 200),
    )
    child.expect_exact(PROMPT)
    return child


def say(child: pexpect.spawn, text: str) -> tuple[str, int, int]:
    """Send a message; (the reply and stats as the terminal showed them, new, cached)."""
    child.sendline(text)
    child.expect(STATS)
    new, cached = int(child.match.group(1)), int(child.match.group(2))
    shown = child.before
    child.expect_exact(PROMPT)
    return shown, new, cached


def saved(transcript: Path) -> dict:
    return json.loads(transcript.read_text(encoding="utf-8"))


@pytest.fixture
def transcript(tmp_path: Path) -> Path:
    return tmp_path / "chat.json"


def test_recalls_a_fact_two_turns_back_reuses_the_cache_and_clear_forgets(
    smollm2_path, quill_home, transcript
):
    child = spawn(quill_home, transcript, "-n", "30", "-s", BRIEF)
    _, _, cached_1 = say(child, "My dog is called Rex.")
    _, new_2, cached_2 = say(child, "What is 2 + 2?")
    answer, new_3, cached_3 = say(child, "What is the name of my dog?")
    assert "Rex" in answer.split("What is the name of my dog?")[-1]
    # Each turn prefills only its own message; the history comes from the cache.
    assert cached_1 == 0 and 0 < cached_2 < cached_3
    assert new_2 < 30 and new_3 < 30
    child.sendline("/clear")
    child.expect_exact("conversation and KV cache cleared")
    child.expect_exact(PROMPT)
    forgotten, _, cached_4 = say(child, "What is the name of my dog?")
    assert "Rex" not in forgotten.split("What is the name of my dog?")[-1]
    assert cached_4 < cached_3  # the old conversation is gone from the cache too
    child.sendeof()
    child.expect(pexpect.EOF)
    messages = saved(transcript)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    earlier = saved(transcript)["earlier"]  # /clear hid them from the model, not from the user
    assert len(earlier) == 6 and earlier[0]["content"] == "My dog is called Rex."


def test_ctrl_c_stops_the_reply_keeps_it_and_returns_to_the_prompt(
    smollm2_path, quill_home, transcript
):
    child = spawn(quill_home, transcript, "-n", "2000")
    child.sendline("Write a very long story about a dragon who learns to cook.")
    child.expect_exact("learns to cook.")  # the terminal's echo of the message
    child.expect(r"\w+\W+\w+\W+\w+\W+\w+\W+\w+")  # the reply is streaming
    child.sendintr()
    child.expect_exact("reply interrupted")
    child.expect_exact(PROMPT)
    reply = saved(transcript)["messages"][-1]
    assert reply["role"] == "assistant" and reply["interrupted"] is True
    assert len(reply["content"].split()) >= 5
    # The chat goes on: the next turn answers, with the interrupted reply in its history.
    child.sendline("/set max_tokens 16")
    child.expect_exact(PROMPT)
    _, _, cached = say(child, "Thank you.")
    assert cached > 0
    child.sendintr()  # Ctrl-C at an empty prompt leaves
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert len(saved(transcript)["messages"]) == 4


def test_save_then_load_round_trips(smollm2_path, quill_home, transcript, tmp_path):
    child = spawn(quill_home, transcript, "-n", "12")
    say(child, "Hello there.")
    say(child, "Tell me about tea.")
    copy = tmp_path / "copy.json"
    child.sendline(f"/save {copy}")
    child.expect_exact(f"saved to {copy}")
    child.expect_exact(PROMPT)
    child.sendline("/clear")
    child.expect_exact(PROMPT)
    child.sendline(f"/load {copy}")
    child.expect_exact(f"loaded 4 messages from {copy}")
    child.expect_exact(PROMPT)
    child.sendline("/show")
    child.expect_exact("4 messages")
    child.expect_exact(PROMPT)
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    assert saved(transcript)["messages"] == saved(copy)["messages"]
    assert [m["content"] for m in saved(copy)["messages"][::2]] == [
        "Hello there.",
        "Tell me about tea.",
    ]


def test_overflow_drops_the_oldest_turns_and_says_so(smollm2_path, quill_home, transcript):
    child = spawn(quill_home, transcript, "--ctx", "160", "-n", "24")
    dropped = False
    for turn in range(8):
        child.sendline(f"Turn {turn}: tell me one fact about the number {turn}.")
        index = child.expect([STATS, "dropped the (\\d+) oldest messages"])
        if index == 1:
            dropped = True
            child.expect(STATS)
            child.expect_exact(PROMPT)
            break
        child.expect_exact(PROMPT)
    assert dropped, "the context never filled"
    messages = saved(transcript)["messages"]
    assert not messages[0]["content"].startswith("Turn 0:")
    assert messages[-2]["content"].startswith(f"Turn {turn}:")
    earlier = saved(transcript)["earlier"]  # dropped for the model, kept for the user
    assert earlier[0]["content"].startswith("Turn 0:")
    assert len(earlier) + len(messages) == 2 * (turn + 1)
    child.sendline("/bye")
    child.expect(pexpect.EOF)


def test_overflow_error_policy_refuses_the_turn_and_keeps_the_chat(
    smollm2_path, quill_home, transcript
):
    child = spawn(quill_home, transcript, "--ctx", "160", "-n", "24", "--on-overflow", "error")
    for turn in range(8):
        child.sendline(f"Turn {turn}: tell me one fact about the number {turn}.")
        if child.expect([STATS, "the conversation needs \\d+ tokens"]) == 1:
            break
        child.expect_exact(PROMPT)
    else:
        pytest.fail("the context never filled")
    child.expect_exact(PROMPT)
    messages = saved(transcript)["messages"]
    assert messages[0]["content"].startswith("Turn 0:")  # nothing was dropped
    assert messages[-1]["role"] == "assistant"  # the refused message is not kept
    child.sendline("/bye")
    child.expect(pexpect.EOF)


def test_a_killed_chat_leaves_its_transcript(smollm2_path, quill_home, transcript):
    child = spawn(quill_home, transcript, "-n", "2000")
    child.sendline("Write a very long story about a lighthouse keeper.")
    child.expect_exact("lighthouse keeper.")  # the terminal's echo of the message
    child.expect(r"(\w+\W+){25}")  # a few dozen words in
    time.sleep(0.3)
    child.kill(signal.SIGKILL)
    child.close()
    messages = saved(transcript)["messages"]
    assert messages[0]["content"].startswith("Write a very long story")
    assert messages[1]["interrupted"] is True and len(messages[1]["content"].split()) >= 8


def test_slash_commands_set_show_and_unknown(smollm2_path, tiny_path, quill_home, transcript):
    child = spawn(quill_home, transcript)
    child.sendline("/set temperature 0.3")
    child.expect_exact("temperature = 0.3")
    child.sendline("/set top_k many")
    child.expect_exact("top_k takes a number, not 'many'")
    child.sendline("/system You are terse.")
    child.expect_exact("system prompt set")
    child.sendline("/show")
    child.expect_exact("system     You are terse.")
    child.expect_exact("temperature 0.3")
    child.sendline("/frobnicate")
    child.expect_exact("unknown command /frobnicate; /help lists the commands")
    child.sendline("/help")
    child.expect_exact("/retry")
    child.expect_exact(PROMPT)
    child.sendline('"""')
    child.sendline("Say the word")
    child.sendline('yes."""')
    child.expect(STATS)
    child.expect_exact(PROMPT)
    assert saved(transcript)["messages"][0]["content"] == "Say the word\nyes."
    assert saved(transcript)["system"] == "You are terse."
    child.sendline("/retry")  # the same message answered again: the reply is replaced
    child.expect(STATS)
    child.expect_exact(PROMPT)
    assert [m["role"] for m in saved(transcript)["messages"]] == ["user", "assistant"]
    child.sendline(f"/model {tiny_path}")
    child.expect_exact("now chatting with")
    child.expect_exact(PROMPT)
    child.sendline("/show")
    child.expect_exact(str(tiny_path))
    child.expect_exact("2 messages")
    child.expect_exact(PROMPT)
    child.sendline("/model no-such-model")
    child.expect_exact("quill: error:")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)


def test_piped_stdin_one_turn_per_line(smollm2_path, quill_home, transcript):
    result = subprocess.run(
        [QUILL, "chat", "--temperature", "0", "-n", "30", "-s", BRIEF, "--transcript",
         str(transcript)],
        input="My dog is called Rex.\nWhat is 2 + 2?\nWhat is the name of my dog?\n",
        capture_output=True, text=True, env=quill_env(quill_home), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    replies = [m["content"] for m in saved(transcript)["messages"] if m["role"] == "assistant"]
    assert len(replies) == 3 and "Rex" in replies[2]
    # stdout carries only the replies; the stats went to stderr.
    assert result.stdout == "".join(r if r.endswith("\n") else r + "\n" for r in replies)
    assert len(STATS.findall(result.stderr)) == 3 and ">>>" not in result.stdout


def test_model_switch_keeps_the_template_and_thinking_settings(runner, tiny_path, tmp_path):
    """/model opens the next model as the first was opened: --chat-template and --no-think still
    shape the prompt (the whole conversation, prefilled again by the new model)."""
    from cli.app import app
    from cli.engine.engine import Engine
    from cli.engine.options import LoadOptions
    from cli.engine.settings import ModelSettings
    from cli.engine.templates import template_from_file

    template = tmp_path / "switch.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}{{ 'no thoughts ' * 20 }}"
        "{% endif %}",
        "utf-8",
    )
    transcript = tmp_path / "switch.json"
    args = ["chat", "-m", str(tiny_path), "-n", "3", "--seed", "1", "--ctx", "512"]
    args += ["--chat-template", str(template), "--no-think", "--transcript", str(transcript)]
    result = runner.invoke(app, args, input=f"hello\n/model {tiny_path}\nhello again\n")
    assert result.exit_code == 0, result.stderr
    (_, first_cached), (new, cached) = [tuple(map(int, m)) for m in STATS.findall(result.stderr)]
    assert "now chatting with" in result.stderr and first_cached == cached == 0
    conversation = [(m["role"], m["content"]) for m in saved(transcript)["messages"][:3]]
    options = LoadOptions(n_ctx=512, threads=1)

    def tokens(settings: ModelSettings) -> int:
        with Engine(tiny_path, options, settings=settings) as engine:
            return engine.count_tokens(conversation)

    chosen = template_from_file(str(template))
    assert new == tokens(ModelSettings(chat_template=chosen, think=False))
    assert new > tokens(ModelSettings(chat_template=chosen)) + 20  # --no-think's 40 tokens
    assert new != tokens(ModelSettings())  # the model's own template


def test_model_in_a_chat_with_an_endpoint_asks_the_server(runner, tiny_path, quill_home, tmp_path):
    """/model NAME in a chat with --endpoint names the server's model, as ollama's /load asks its
    server: no local model opens (no-such-model would be a download refused offline), the server
    answers for the name, and its own name brings replies back."""
    from cli.app import app

    from conftest import start_server

    # --strict-model: a one-model server otherwise answers any name, as llama-server does
    process, url = start_server(
        quill_home, tmp_path, str(tiny_path), "--ctx", "256", "-np", "1", "--strict-model"
    )
    transcript = tmp_path / "remote.json"
    try:
        result = runner.invoke(
            app,
            ["chat", "--endpoint", f"{url}/v1", "-n", "3", "--transcript", str(transcript)],
            input="/model no-such-model\nhello\n/model quill\nhello again\n",
        )
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert result.exit_code == 0, result.stderr
    assert f"now chatting with no-such-model at {url}/v1" in result.stderr
    assert "'no-such-model' does not exist" in result.stderr  # the server's refusal, one line
    assert f"now chatting with quill at {url}/v1" in result.stderr
    assert "download" not in result.stderr and len(STATS.findall(result.stderr)) == 1
    assert saved(transcript)["model"] == "quill"
    roles = [m["role"] for m in saved(transcript)["messages"]]
    assert roles[-2:] == ["user", "assistant"]


def test_up_arrow_recalls_a_block_whole_and_sends_it_again(tiny_path, quill_home, transcript):
    child = spawn(quill_home, transcript, "-m", str(tiny_path), "-n", "3")
    child.sendline('"""')
    child.sendline("First line,")
    child.sendline('second line."""')
    child.expect(STATS)
    child.expect_exact(PROMPT)
    child.send("\x1b[A")  # up arrow: the whole block, not its last line
    child.expect_exact('"""First line,')
    child.send("\r")
    child.expect(STATS)
    child.expect_exact(PROMPT)
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    again = spawn(quill_home, transcript, "-m", str(tiny_path))  # the next chat: from the file
    again.send("\x1b[A\x1b[A")  # over /bye
    again.expect_exact('"""First line,')
    again.sendintr()
    again.expect_exact(PROMPT)
    again.sendline("/bye")
    again.expect(pexpect.EOF)
    sent = [m["content"] for m in saved(transcript)["messages"][::2]]
    assert sent == ["First line,\nsecond line."] * 2
