"""quill chat --resume: the transcript and the KV state saved beside it; the turn after a resume
prefills only the new message and answers as the chat would have, had it never stopped."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pexpect
import pytest
from test_chat import PROMPT, say

from cli.store.promptcache import cache_dir, files

from conftest import QUILL, quill_env

STATS = re.compile(r"prefill (\d+) new tokens \((\d+) cached")
FIRST = "Describe a lighthouse keeper's day in four sentences."
SECOND = "Now describe the night."
# A system prompt long enough that the saved state is worth loading even where a random-weight
# model's reply does not tokenize back to the tokens it was sampled as.
SYSTEM = "You are a patient writer of short, plain prose. " * 12


def chat(home: Path, model: Path, lines: str, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        # One thread count for every chat: a resumed chat and an uninterrupted one take one path.
        [QUILL, "chat", "-m", str(model), "--temperature", "0", "-n", "48", "-t", "1", "-s", SYSTEM,
         *args],
        input=lines, capture_output=True, text=True, env=quill_env(home), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result


def replies(transcript: Path) -> list[str]:
    messages = json.loads(transcript.read_text())["messages"]
    return [m["content"] for m in messages if m["role"] == "assistant"]


def kv_files(home: Path) -> list[Path]:
    """The KV store's files (a chat's state is kept there, named by FILE.kvstate)."""
    return files(cache_dir(home))


@pytest.mark.parametrize("model", ["smollm2_path", "tiny_path"])
def test_a_resumed_chat_answers_as_if_it_had_never_stopped(tmp_path, request, model):
    path = request.getfixturevalue(model)
    home = tmp_path / "home"
    straight = tmp_path / "straight.json"
    # Its own QUILL_HOME: its state, in the one KV store, would cover the resumed chat's turn.
    whole = chat(tmp_path / "other", path, f"{FIRST}\n{SECOND}\n", "--transcript", str(straight))
    split = home / "chats" / "split.json"
    chat(home, path, f"{FIRST}\n", "--transcript", str(split))
    assert len(kv_files(home)) == 1 and split.with_name("split.kvstate").is_file()
    resumed = chat(home, path, f"{SECOND}\n", "--resume", "split")
    # same path: the KV cells come back bit for bit and the new turn prefills as it did straight
    assert replies(split) == replies(straight)
    new, cached = (int(n) for n in STATS.findall(resumed.stderr)[-1])
    assert f"resumed: {cached} tokens of KV cache loaded" in resumed.stderr
    # As much was prefilled as the uninterrupted chat's second turn did: the new message (and
    # whatever of the last reply does not tokenize back as it was sampled).
    assert (new, cached) == tuple(int(n) for n in STATS.findall(whole.stderr)[1])
    assert cached > 100
    assert len(kv_files(home)) == 1  # the state was saved again, replacing the one it extends


def test_resume_last_takes_the_newest_chat(tmp_path, tiny_path):
    home = tmp_path / "home"
    chat(home, tiny_path, f"{FIRST}\n", "--transcript", str(home / "chats" / "old.json"))
    chat(home, tiny_path, f"{SECOND}\n", "--transcript", str(home / "chats" / "new.json"))
    resumed = chat(home, tiny_path, "Thanks.\n", "--resume", "last")
    assert "new.json" in resumed.stderr and "resumed:" in resumed.stderr
    assert len(replies(home / "chats" / "new.json")) == 2
    assert len(replies(home / "chats" / "old.json")) == 1


# A larger --ctx is no change: a sequence's state is the same bytes in any context that holds it.
@pytest.mark.parametrize("change", [["--kv-type", "q8_0"], ["--kv-v", "q8_0"]])
def test_a_stale_cache_is_refused_in_one_line(tmp_path, tiny32_path, change):
    home = tmp_path / "home"
    transcript = home / "chats" / "c.json"
    chat(home, tiny32_path, f"{FIRST}\n", "--transcript", str(transcript))
    resumed = chat(home, tiny32_path, f"{SECOND}\n", "--resume", "c", *change)
    lines = [line for line in resumed.stderr.splitlines() if "saved KV cache" in line]
    assert len(lines) == 1 and "prefilled again" in lines[0]
    assert "resumed:" not in resumed.stderr
    new, cached = (int(n) for n in STATS.findall(resumed.stderr)[-1])
    assert cached == 0 and new > 40


def test_a_damaged_chat_cache_gives_one_warning(tmp_path, tiny_path):
    home = tmp_path / "home"
    transcript = home / "chats" / "c.json"
    chat(home, tiny_path, f"{FIRST}\n", "--transcript", str(transcript))
    (state,) = kv_files(home)
    data = bytearray(state.read_bytes())
    data[-50] ^= 0xFF
    state.write_bytes(bytes(data))
    resumed = chat(home, tiny_path, f"{SECOND}\n", "--resume", "c")
    warnings = [line for line in resumed.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "checksum" in warnings[0]
    assert len(replies(transcript)) == 2


def test_resume_refuses_what_it_cannot_find(tmp_path, tiny_path):
    home = tmp_path / "home"
    for args, needle in (
        (["--resume", "last"], "no saved chats"),
        (["--resume", "nope", "--transcript", str(tmp_path / "t.json")], "drop --transcript"),
    ):
        result = subprocess.run(
            [QUILL, "chat", "-m", str(tiny_path), *args], input="hi\n",
            capture_output=True, text=True, env=quill_env(home), timeout=120,
        )  # fmt: skip
        assert result.returncode == 2 and needle in result.stderr
        assert result.stderr.count("\n") == 1


# --- in a pseudo-terminal, as a user types it (issue 30, item 10) ---------------------------------

CONTEXT = re.compile(r"context (\d+)/")


def typed(home: Path, *args: str) -> pexpect.spawn:
    """quill chat in a pseudo-terminal, at its first prompt."""
    child = pexpect.spawn(
        QUILL, ["chat", *args], env=quill_env(home, TERM="dumb"), encoding="utf-8", timeout=120,
        dimensions=(40, 250),
    )  # fmt: skip
    child.expect_exact(PROMPT)
    return child


def leave(child: pexpect.spawn) -> None:
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_resume_last_takes_the_chat_used_last_wherever_its_transcript_is(tmp_path, tiny_path):
    home, elsewhere = tmp_path / "home", tmp_path / "project" / "notes.json"
    first = typed(home, "-m", str(tiny_path), "-n", "4")
    say(first, "Hello.")
    leave(first)
    (kept,) = (home / "chats").glob("*.json")
    second = typed(home, "-m", str(tiny_path), "-n", "4", "--transcript", str(elsewhere))
    say(second, "Hello from elsewhere.")
    leave(second)
    resumed = typed(home, "--resume", "last")  # no -m: the chat's own model, as `llm -c`
    assert f"continuing the 2 messages in {elsewhere}" in resumed.before
    say(resumed, "And again.")
    leave(resumed)
    assert len(replies(elsewhere)) == 2
    by_id = typed(home, "--resume", kept.stem[:8])  # the one in chats/, by the start of its name
    assert f"continuing the 2 messages in {kept}" in by_id.before
    leave(by_id)
    again = typed(home, "--resume", "last")  # now the one in chats/ was used last
    assert f"continuing the 2 messages in {kept}" in again.before
    leave(again)
    by_name = typed(home, "--resume", "notes")  # an ID finds one outside chats/ too
    assert f"continuing the 4 messages in {elsewhere}" in by_name.before
    leave(by_name)


def test_a_chat_open_elsewhere_goes_on_in_a_copy_and_says_so(tmp_path, tiny_path):
    home, transcript = tmp_path / "home", tmp_path / "chat.json"
    first = typed(home, "-m", str(tiny_path), "-n", "4", "--transcript", str(transcript))
    say(first, "Hello.")
    second = typed(home, "--resume", "last")  # the first chat is still open in its terminal
    copy = tmp_path / "chat-2.json"
    (warning,) = [line for line in second.before.splitlines() if "warning" in line]
    assert f"{transcript} is open in another quill chat (pid {first.pid})" in warning
    assert f"goes on in a copy, {copy}" in warning and "leave the other chat first" in warning
    assert f"continuing the 2 messages in {copy}" in second.before
    say(first, "One more from the first.")
    say(second, "One more from the second.")
    leave(second)
    leave(first)
    # Neither lost a turn: each file holds its own chat's messages.
    assert [m["content"] for m in saved(transcript)[::2]] == ["Hello.", "One more from the first."]
    assert [m["content"] for m in saved(copy)[::2]] == ["Hello.", "One more from the second."]
    # A chat that was killed holds nothing: the next one continues the file, without a warning.
    killed = typed(home, "--resume", "chat")
    killed.kill(signal.SIGKILL)
    killed.close()
    after = typed(home, "--resume", "chat")
    assert "warning" not in after.before
    assert f"continuing the 4 messages in {transcript}" in after.before
    leave(after)


def test_resume_restores_the_settings_and_the_system_prompt(tmp_path, tiny_path):
    home, transcript = tmp_path / "home", tmp_path / "chat.json"
    child = typed(home, "-m", str(tiny_path), "--transcript", str(transcript))
    for command, said in (("/set max_tokens 6", "max_tokens = 6"),
                          ("/set temperature 0.25", "temperature = 0.25"),
                          ("/set stop \\n\\n,END", "stop = "),
                          ("/system You are terse.", "system prompt set")):  # fmt: skip
        child.sendline(command)
        child.expect_exact(said)
        child.expect_exact(PROMPT)
    say(child, "Hello.")
    leave(child)
    resumed = typed(home, "--resume", "last")
    resumed.sendline("/show")
    resumed.expect_exact("system     You are terse.")
    resumed.expect_exact("temperature 0.25")
    resumed.expect_exact("max_tokens 6, stop ['\\n\\n', 'END']")
    resumed.expect_exact(PROMPT)
    resumed.sendline("Tell me a very long story.")
    resumed.expect(r"decode (\d+) tok")
    assert int(resumed.match.group(1)) <= 6
    resumed.expect_exact(PROMPT)
    leave(resumed)
    # What is typed on the command line wins over what the transcript kept.
    overridden = typed(home, "--resume", "last", "-n", "9", "--temperature", "0")
    overridden.sendline("/show")
    overridden.expect_exact("temperature 0.0")
    overridden.expect_exact("max_tokens 9")
    overridden.expect_exact(PROMPT)
    leave(overridden)
    # A transcript written before settings were kept still loads, with the defaults.
    data = json.loads(transcript.read_text())
    del data["settings"]
    transcript.write_text(json.dumps(data))
    old = typed(home, "--resume", "last")
    assert "continuing the" in old.before
    old.sendline("/show")
    old.expect_exact("max_tokens 512")
    old.expect_exact(PROMPT)
    leave(old)


def test_the_turn_after_a_reply_cut_at_the_length_limit_reuses_the_whole_conversation(
    tmp_path, smollm2_path
):
    """Sampled replies hold tokens their text does not tokenize back to (" ra" "is" "se" where
    " raisse" is one token): the next turn keeps them as sampled, so every cell is reused."""
    child = typed(tmp_path / "home", "-m", str(smollm2_path), "--temperature", "1", "--seed", "5",
                  "-n", "40", "--transcript", str(tmp_path / "chat.json"))  # fmt: skip
    held = 0
    for message in ("Écris une longue histoire sur Paris, en français.", "Continue, en français.",
                    "Encore, en français.", "Et la fin, en français."):  # fmt: skip
        child.sendline(message)
        child.expect(STATS)
        new, cached = int(child.match.group(1)), int(child.match.group(2))
        child.expect(CONTEXT)
        assert cached == held, f"{message!r}: {cached} of the {held} cells held were reused"
        assert held == 0 or new < 30  # the new message and the turn's template tokens
        held = int(child.match.group(1))
        child.expect_exact(PROMPT)
    leave(child)
    assert all(m["finish_reason"] == "length" for m in saved(tmp_path / "chat.json")[1::2])


def saved(transcript: Path) -> list[dict]:
    return json.loads(transcript.read_text())["messages"]
