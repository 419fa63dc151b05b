"""A chat longer than its context: under --on-overflow error it exits 4 in one line and keeps the
conversation as it was (resumed, or named by --transcript); under truncate it drops old turns and
answers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import QUILL, quill_env
from refusals import home as home
from refusals import one_short_error_line as one_error_line


def long_transcript(path: Path, messages: int = 40) -> None:
    """A saved chat far longer than 512 tokens."""
    words = " ".join(f"word{i}" for i in range(40))
    turns = [
        {"role": role, "content": f"{n}: {words}", "interrupted": False, "finish_reason": None}
        for n, role in enumerate(["user", "assistant"] * (messages // 2))
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": "tiny", "system": None, "messages": turns}))


@pytest.mark.parametrize("resume", [True, False])
def test_chat_overflow_under_on_overflow_error_exits_4(tiny_path, home, resume):
    chats = home / "chats"
    long_transcript(chats / "20250101-000000-tiny.json")
    where = ["--resume", "last"] if resume else ["--transcript", str(next(chats.iterdir()))]
    command = [QUILL, "chat", "-m", str(tiny_path), *where, "-c", "512", "-n", "8",
               "--on-overflow", "error"]  # fmt: skip
    result = subprocess.run(
        command, input="x\n", capture_output=True, text=True, env=quill_env(home), timeout=120
    )
    assert result.returncode == 4, result.stderr
    one_error_line(result.stderr, "the context holds 512")
    # The conversation was kept as it was: no turn added.
    kept = json.loads(next(chats.iterdir()).read_text())["messages"]
    assert len(kept) == 40
    # Under truncate the same chat drops old turns and answers: exit 0.
    command[command.index("error")] = "truncate"
    result = subprocess.run(
        command, input="x\n", capture_output=True, text=True, env=quill_env(home), timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "dropped the" in result.stderr
