"""Chat transcripts: --transcript naming a saved chat continues it (an empty stdin leaves it as it
was), a file that is not a transcript is refused and left untouched, and every chat that ends is
recorded in recent_chats.json (what --resume last reads), two ending at once included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import QUILL, quill_env
from refusals import one_error_line


def test_chat_continues_an_existing_transcript_and_refuses_other_files(
    smollm2_path, quill_home, tmp_path
):
    old = tmp_path / "old.json"
    messages = [
        {"role": role, "content": f"message {n}", "interrupted": False, "finish_reason": None}
        for n, role in enumerate(["user", "assistant"] * 3)
    ]
    old.write_text(json.dumps({"model": "x", "system": "Be brief.", "messages": messages}))

    def chat(transcript: Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [QUILL, "chat", "--temperature", "0", "-n", "6", "--transcript", str(transcript)],
            input=stdin, capture_output=True, text=True, env=quill_env(quill_home), timeout=120,
        )  # fmt: skip

    result = chat(old)  # stdin empty, as </dev/null
    assert result.returncode == 0, result.stderr
    assert "continuing the 6 messages" in result.stderr
    kept = json.loads(old.read_text())
    assert kept["messages"] == messages and kept["system"] == "Be brief."
    result = chat(old, "One more.\n")
    assert result.returncode == 0, result.stderr
    grown = json.loads(old.read_text())["messages"]
    assert grown[:6] == messages and [m["role"] for m in grown[6:]] == ["user", "assistant"]

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    result = chat(notes, "Hello.\n")
    assert result.returncode == 2
    one_error_line(result.stderr, "is not a quill chat transcript")
    assert notes.read_text() == "my notes\n"


def test_chats_ending_together_are_all_recorded(tmp_path):
    """Each chat records its transcript in recent_chats.json as it ends (what --resume last reads
    for transcripts kept elsewhere): a read-change-write that two processes at once lost entries
    of."""
    home, each = tmp_path / "home", 40
    record = (
        "import sys\nfrom pathlib import Path\nfrom cli.store.chats import note_used\n"
        "for n in range(int(sys.argv[2])):\n"
        "    note_used(Path(sys.argv[1]) / f'chat-{n}.json')\n"
    )
    command = [sys.executable, "-c", record]
    writers = [
        subprocess.Popen([*command, str(tmp_path / name), str(each)], env=quill_env(home))
        for name in ("a", "b")
    ]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    recorded = json.loads((home / "recent_chats.json").read_text())
    assert len(recorded) == len(set(recorded)) == 2 * each
