"""Saved chats: where a new one is written, which transcript a name stands for (those under
QUILL_HOME/chats and those used lately elsewhere), what each holds (for --list), and whether a
running chat has one open."""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cli.errors import ChatNotFoundError, TranscriptError
from cli.store.home import quill_home
from cli.store.transcripts import read_transcript, saved_model
from cli.units import shortened
from quant.partfiles import write_replacing

RECENT_LIMIT = 100  # transcripts outside chats_dir() that --resume still finds
# The characters a new transcript's name keeps of its model's label: what no shell quotes and
# Windows and macOS file systems take (a label such as owner/repo:Q4_K_M has '/' and ':').
UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
LABEL_MOST = 80  # of the label in a name: a model's path can be long, its end says the most
ID_LEAST = 8  # characters of an ID at least: a chats/ name's date, while no other shares it


def chats_dir() -> Path:
    return quill_home() / "chats"


def _recent_file() -> Path:
    return quill_home() / "recent_chats.json"


def _recent() -> list[Path]:
    with contextlib.suppress(OSError, ValueError):
        paths = json.loads(_recent_file().read_text(encoding="utf-8"))
        if isinstance(paths, list):
            return [Path(p) for p in paths if isinstance(p, str)]
    return []


def note_used(transcript: Path) -> None:
    """Put transcript first in the record of chats used lately, so that --resume finds one kept
    outside chats_dir() (--transcript FILE)."""
    path = transcript.absolute()
    record = _recent_file()
    with contextlib.suppress(OSError):  # unrecorded, it is still found by path and in chats_dir()
        record.parent.mkdir(parents=True, exist_ok=True)
        # Read, change and write under one lock: two chats ending together both stay recorded.
        with record.with_name(f".{record.name}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            paths = [path, *(p for p in _recent() if p != path)][:RECENT_LIMIT]
            write_replacing(record, json.dumps([str(p) for p in paths], indent=1) + "\n")


def new_transcript(label: str) -> Path:
    """A new chat's transcript: chats_dir()/DATE-TIME-MODEL.json, the label's characters that
    are not letters, digits, '-', '_' or '.' made '_'. Where a chat started in the same second
    with the same model has the name (a script's chats, one a line), DATE-TIME-2-MODEL.json and
    on: the number right after the time keeps their IDs short."""
    safe = UNSAFE.sub("_", label)[-LABEL_MOST:]
    started = time.strftime("%Y%m%d-%H%M%S")
    path, number = chats_dir() / f"{started}-{safe}.json", 2
    while path.exists() or path.is_symlink():
        path, number = chats_dir() / f"{started}-{number}-{safe}.json", number + 1
    return path


def saved_chats(folder: Path | None = None) -> list[Path]:
    """The transcripts in folder, or in chats_dir() and those used lately elsewhere, the most
    recently written last."""
    found = _saved(folder)
    return sorted(found, key=found.__getitem__)


def _saved(folder: Path | None) -> dict[Path, float]:
    """saved_chats', with the time each was last written."""
    found = _written((folder or chats_dir()).glob("*.json"))
    if folder is None:
        found |= _written(p for p in _recent() if p.suffix == ".json")
    return found


def _written(paths: Iterable[Path]) -> dict[Path, float]:
    found = {}
    for path in paths:
        with contextlib.suppress(OSError):  # gone meanwhile
            if path.is_file():
                found[path.absolute()] = path.stat().st_mtime
    return found


def find_transcript(value: str, folder: Path | None = None) -> Path:
    """The transcript value names: last (the chat used last), a transcript's file name or the
    start of one, or a path to a .json file; ChatNotFoundError (with the near matches) otherwise."""
    saved = saved_chats(folder)
    folder = folder or chats_dir()
    if value == "last":
        if not saved:
            raise ChatNotFoundError(value, folder, [])
        return saved[-1]
    try:
        path = Path(value).expanduser()
        if path.suffix == ".json" and path.is_file():
            return path
    except (OSError, ValueError, RuntimeError):  # too long, a NUL, ~user that is no user
        pass  # not a file: an ID, or nothing
    matches = _matching(value, saved)
    if len(matches) != 1:
        ids = chat_ids(saved)
        raise ChatNotFoundError(value, folder, [_named(ids[p], p) for p in matches])
    return matches[0]


def _matching(value: str, saved: list[Path]) -> list[Path]:
    """The transcripts an ID names: the one of that name, or else those whose names start so."""
    return [p for p in saved if p.stem == value] or [p for p in saved if p.stem.startswith(value)]


def _named(chat_id: str, path: Path) -> str:
    """A chat as a refusal names it: its ID, and its first words where it has some."""
    summary = _summary(path, chat_id, 0.0)
    return f'{chat_id} "{shortened(summary.first, 24)}"' if summary.first else chat_id


def chat_ids(paths: Iterable[Path]) -> dict[Path, str]:
    """The ID of each chat, what --resume takes: the shortest start of its file name that no
    other's shares (ID_LEAST characters at least), its whole name where another's only goes on
    from it (NAME beside NAME-2), or its path where another file elsewhere has its name."""
    paths = list(paths)
    stems = sorted(p.stem for p in paths)
    ids = {}
    for path in paths:
        stem, at = path.stem, bisect.bisect_left(stems, path.stem)
        # The neighbours in sorted order share the longest start with it of all names.
        near = stems[max(at - 1, 0) : at] + stems[at + 1 : at + 2]
        shared = max((_shared_start(stem, other) for other in near), default=0)
        chat_id = stem[: max(shared + 1, ID_LEAST)]
        twin = at + 1 < len(stems) and stems[at + 1] == stem
        ids[path] = str(path) if twin or chat_id == "last" else chat_id
    return ids


def _shared_start(one: str, other: str) -> int:
    """How many characters two names share from their start."""
    differ = (at for at, (a, b) in enumerate(zip(one, other, strict=False)) if a != b)
    return next(differ, min(len(one), len(other)))


@dataclass(frozen=True)
class ChatSummary:
    """A saved chat as --list shows it."""

    id: str  # what --resume takes (chat_ids)
    path: Path
    written: float  # when it was last written (its mtime), seconds since the epoch
    model: str | None  # the model it ended with, as the transcript names it
    first: str | None  # the first message the user sent ("earlier" ones included)
    turns: int  # messages the user sent
    problem: str | None = None  # why it cannot be read as a transcript


def chat_summaries(folder: Path | None = None) -> list[ChatSummary]:
    """Each saved chat (those saved_chats finds), the most recently written first."""
    found = _saved(folder)
    ids = chat_ids(found)
    paths = sorted(found, key=found.__getitem__, reverse=True)
    return [_summary(path, ids[path], found[path]) for path in paths]


def _summary(path: Path, chat_id: str, written: float) -> ChatSummary:
    try:
        saved = read_transcript(path, continuing=False)
    except TranscriptError as error:
        return ChatSummary(chat_id, path, written, None, None, 0, str(error))
    said = [m.content for m in [*saved.earlier, *saved.messages] if m.role == "user"]
    first = " ".join(said[0].split()) if said else None
    return ChatSummary(chat_id, path, written, saved_model(path), first, len(said))


@contextlib.contextmanager
def chat_lock(transcript: Path) -> Iterator[int | None]:
    """Hold transcript's advisory lock (.NAME.lock beside it) while a chat has it open; yields
    None, or the pid of the running chat that holds it (a lock goes with its process, so a
    killed chat's does not count)."""
    lock = transcript.with_name(f".{transcript.name}.lock")
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            handle = lock.open("a+", encoding="utf-8")
        except OSError:  # a folder quill cannot write: saving the transcript will say so
            yield None
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip()
            handle.close()
            yield int(owner) if owner.isdigit() else 0
            return
        with contextlib.suppress(OSError):
            if os.stat(lock).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        handle.close()  # removed by the chat that held it as this one opened it: again
    with handle:
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield None
        finally:
            lock.unlink(missing_ok=True)  # before the lock is let go: see the inode test above


def copy_transcript(transcript: Path) -> Path:
    """A copy of transcript under the first free name NAME-2.json, NAME-3.json, ..."""
    number = 2
    while (copy := transcript.with_name(f"{transcript.stem}-{number}.json")).exists():
        number += 1
    with contextlib.suppress(FileNotFoundError):  # the other chat has not written it yet
        shutil.copyfile(transcript, copy)
    return copy
