"""Chats you can find (issue 47): `quill chat --list` shows the saved chats, the newest first, each
with the ID --resume takes; an ID that starts several chats' names is refused naming each of them;
new transcripts' names hold only characters every shell and file system takes, while old names
with ':' are still listed and resumed; a chat that switched model is listed under the last."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from cli.app import app
from cli.store.chats import new_transcript

from refusals import home as home
from refusals import one_error_line

SAFE = re.compile(r"[A-Za-z0-9._-]+\.json")


def chat(runner: CliRunner, *args: str, stdin: str = "") -> Result:
    result = runner.invoke(app, ["chat", "-n", "2", "--seed", "1", *args], input=stdin)
    assert result.exit_code == 0, result.stderr
    return result


def listed(runner: CliRunner) -> list[dict]:
    result = runner.invoke(app, ["chat", "--list", "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def write_transcript(path: Path, model: str, *said: str, written: float | None = None) -> None:
    """A transcript as quill writes one: each message said, and a reply to it."""
    messages = [
        {"role": role, "content": text, "interrupted": False, "finish_reason": None}
        for message in said
        for role, text in (("user", message), ("assistant", "ok"))
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "system": None, "messages": messages}), "utf-8")
    if written is not None:
        os.utime(path, (written, written))


def test_list_shows_each_chat_newest_first_and_its_id_resumes_it(runner, home, tiny_path, tmp_path):
    chat(runner, "-m", str(tiny_path), stdin="How are you?\n")
    chat(runner, "-m", str(tiny_path), stdin="Tell me   about\nthe sky.\n")
    notes = tmp_path / "notes.json"  # kept outside chats/: --resume finds it, so --list shows it
    chat(runner, "-m", str(tiny_path), "--transcript", str(notes), stdin="Notes first.\n")
    # In the order they were made (two in one second: the second is named DATE-TIME-2-MODEL).
    first, second = sorted((home / "chats").glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    broken = home / "chats" / "broken.json"
    broken.write_text("{}", "utf-8")
    now = time.time()
    for age, path in enumerate((notes, second, first, broken)):  # newest to oldest
        os.utime(path, (now - 60 * age, now - 60 * age))
    chats = listed(runner)
    assert [c["path"] for c in chats] == [str(p) for p in (notes, second, first, broken)]
    assert [c["turns"] for c in chats] == [1, 2, 1, 0]
    assert [c["first_message"] for c in chats] == ["Notes first.", "Tell me about", "How are you?",
                                                  None]  # fmt: skip
    assert [c["model"] for c in chats[:3]] == [str(tiny_path)] * 3 and chats[3]["model"] is None
    assert "not a quill chat transcript" in chats[3]["error"] and chats[0]["error"] is None
    assert chats[0]["id"] == "notes" and len({c["id"] for c in chats}) == 4
    assert all(Path(c["path"]).stem.startswith(c["id"]) for c in chats)  # a start of its name
    table = runner.invoke(app, ["chat", "--list"])
    assert table.exit_code == 0 and "--resume ID" in table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split() == ["ID", "SAVED", "TURNS", "MODEL", "FIRST"]
    assert [row.split()[0] for row in rows] == [c["id"] for c in chats]
    assert rows[1].endswith("Tell me about") and "(unreadable)" in rows[3]
    for entry, path in ((chats[0], notes), (chats[2], first)):
        resumed = chat(runner, "--resume", entry["id"])  # no -m: the model the chat names
        assert f"continuing the 2 messages in {path}" in resumed.stderr


def test_list_with_no_chats_says_so_and_exits_0(runner, home):
    table = runner.invoke(app, ["chat", "--list"])
    assert table.exit_code == 0 and table.stdout == ""
    assert table.stderr == f"no saved chats in {home / 'chats'} yet: `quill chat` starts one\n"
    assert listed(runner) == []


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--json"], "--json goes with --list"),
        (["--list", "--resume", "last"], "--list starts no chat"),
        (["--list", "smollm2-135m"], "--list starts no chat"),
        (["--list", "--transcript", "chat.json"], "--list starts no chat"),
    ],
)
def test_list_options_out_of_place_are_refused_in_one_line(runner, home, args, needle):
    result = runner.invoke(app, ["chat", *args])
    assert result.exit_code == 2
    one_error_line(result.stderr, needle)


def test_resume_by_a_start_several_chats_share_names_every_one(runner, home):
    for n in range(6):
        write_transcript(home / "chats" / f"20260101-12000{n}-m.json", "m", f"Question {n} here")
    result = runner.invoke(app, ["chat", "--resume", "2026"], input="")
    assert result.exit_code == 2
    one_error_line(result.stderr, "--resume '2026' matches 6 chats (")
    (line,) = result.stderr.splitlines()
    for entry in listed(runner):
        assert f'{entry["id"]} "{entry["first_message"]}"' in line
    assert line.endswith("; give more of it")


@pytest.mark.parametrize(
    "label",
    ["owner/repo:Q4_K_M", "smollm2-135m:q4_1", "hf://o/r/F.gguf", 'C:\\m o<d>e|l?*"', "x" * 300],
)
def test_new_transcript_names_hold_only_safe_characters(home, label):
    path = new_transcript(label)
    assert path.parent == home / "chats" and SAFE.fullmatch(path.name), path.name
    assert len(path.name) < 120


def test_a_second_chat_started_in_the_same_second_gets_a_name_of_its_own(home, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda form, *rest: "20260101-120000")
    first = new_transcript("smollm2-135m:q4_1")
    assert first.name == "20260101-120000-smollm2-135m_q4_1.json"
    write_transcript(first, "smollm2-135m:q4_1", "Hi.")
    assert new_transcript("smollm2-135m:q4_1").name == "20260101-120000-2-smollm2-135m_q4_1.json"


def test_a_model_path_with_colons_and_spaces_names_a_safe_transcript(runner, home, tiny_path):
    odd = home.parent / "own:er x" / "tiny:Q4.gguf"
    odd.parent.mkdir()
    odd.symlink_to(tiny_path)
    chat(runner, "-m", str(odd), stdin="Hello.\n")
    (made,) = (home / "chats").glob("*.json")
    assert SAFE.fullmatch(made.name) and made.name.endswith("_own_er_x_tiny_Q4.gguf.json")
    assert listed(runner)[0]["model"] == str(odd)


def test_old_transcripts_with_colons_in_their_names_are_listed_and_resumed(runner, home, tiny_path):
    old = home / "chats" / "20250101-120000-smollm2-135m:q4_1.json"
    write_transcript(old, str(tiny_path), "An old question.")
    (entry,) = listed(runner)
    assert entry["path"] == str(old) and entry["first_message"] == "An old question."
    resumed = chat(runner, "--resume", entry["id"], stdin="A new one.\n")
    assert f"continuing the 2 messages in {old}" in resumed.stderr
    assert [p.name for p in (home / "chats").glob("*.json")] == [old.name]  # not renamed
    assert listed(runner)[0]["turns"] == 2


def test_a_chat_that_switched_model_is_listed_under_the_model_it_ended_with(
    runner, home, tiny_path, tiny32_path
):
    chat(runner, "-m", str(tiny_path), stdin=f"Hello.\n/model {tiny32_path}\nAgain.\n")
    (entry,) = listed(runner)
    assert entry["model"] == str(tiny32_path) and entry["turns"] == 2
    table = runner.invoke(app, ["chat", "--list"]).stdout.splitlines()
    assert str(tiny32_path) in table[1] and str(tiny_path) not in table[1]
    resumed = chat(runner, "--resume", entry["id"], stdin="/show\n")  # the model it ended with
    assert f"model      {tiny32_path} (" in resumed.stderr


def test_the_default_models_chat_is_named_without_a_colon_and_listed_after_a_switch(
    runner, smollm2_path, tiny_path
):
    """The registry label smollm2-135m:q4_1 in a new transcript's name, and /model from it."""
    before = {c["path"] for c in listed(runner)}  # the session's quill home, where the model is
    chat(runner, stdin=f"Hi.\n/model {tiny_path}\nHi again.\n")
    (entry,) = [c for c in listed(runner) if c["path"] not in before]
    name = Path(entry["path"]).name
    assert SAFE.fullmatch(name) and name.endswith("-smollm2-135m_q4_1.json")
    assert entry["model"] == str(tiny_path) and entry["first_message"] == "Hi."
