"""quill chat --resume: the transcript and the KV state saved beside it; the turn after a resume
prefills only the new message and answers as the chat would have, had it never stopped."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli.store.promptcache import files

from conftest import quill_env

QUILL = str(Path(sys.executable).with_name("quill"))
STATS = re.compile(r"prefill (\d+) new tokens \((\d+) cached\)")
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


def kv_files(transcript: Path) -> list[Path]:
    return files(transcript.with_name(transcript.stem + ".kvcache"))


@pytest.mark.parametrize("model", ["smollm2_path", "tiny_path"])
def test_a_resumed_chat_answers_as_if_it_had_never_stopped(tmp_path, request, model):
    path = request.getfixturevalue(model)
    home = tmp_path / "home"
    straight = tmp_path / "straight.json"
    whole = chat(home, path, f"{FIRST}\n{SECOND}\n", "--transcript", str(straight))
    split = home / "chats" / "split.json"
    chat(home, path, f"{FIRST}\n", "--transcript", str(split))
    assert len(kv_files(split)) == 1
    resumed = chat(home, path, f"{SECOND}\n", "--resume", "split")
    # same path: the KV cells come back bit for bit and the new turn prefills as it did straight
    assert replies(split) == replies(straight)
    new, cached = (int(n) for n in STATS.findall(resumed.stderr)[-1])
    assert f"resumed: {cached} tokens of KV cache loaded" in resumed.stderr
    # As much was prefilled as the uninterrupted chat's second turn did: the new message (and
    # whatever of the last reply does not tokenize back as it was sampled).
    assert (new, cached) == tuple(int(n) for n in STATS.findall(whole.stderr)[1])
    assert cached > 100
    assert len(kv_files(split)) == 1  # the state was saved again, over the old one


def test_resume_last_takes_the_newest_chat(tmp_path, tiny_path):
    home = tmp_path / "home"
    chat(home, tiny_path, f"{FIRST}\n", "--transcript", str(home / "chats" / "old.json"))
    chat(home, tiny_path, f"{SECOND}\n", "--transcript", str(home / "chats" / "new.json"))
    resumed = chat(home, tiny_path, "Thanks.\n", "--resume", "last")
    assert "new.json" in resumed.stderr and "resumed:" in resumed.stderr
    assert len(replies(home / "chats" / "new.json")) == 2
    assert len(replies(home / "chats" / "old.json")) == 1


@pytest.mark.parametrize("change", [["--kv-type", "q8_0"], ["--ctx", "2048"]])
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
    (state,) = kv_files(transcript)
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
