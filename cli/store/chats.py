"""Saved chats: which transcript a name stands for (those under QUILL_HOME/chats and those used
lately elsewhere), and whether a running chat has one open."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from cli.errors import ChatNotFoundError
from cli.store.home import quill_home
from quant.partfiles import write_replacing

RECENT_LIMIT = 100  # transcripts outside chats_dir() that --resume still finds


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


def saved_chats(folder: Path | None = None) -> list[Path]:
    """The transcripts in folder, or in chats_dir() and those used lately elsewhere, the most
    recently written last."""
    found = _written((folder or chats_dir()).glob("*.json"))
    if folder is None:
        found |= _written(p for p in _recent() if p.suffix == ".json")
    return sorted(found, key=found.__getitem__)


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
    matches = [p for p in saved if p.stem == value] or [
        p for p in saved if p.stem.startswith(value)
    ]
    if len(matches) != 1:
        names = [p.stem if p.parent == folder.absolute() else str(p) for p in matches]
        raise ChatNotFoundError(value, folder, names)
    return matches[0]


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
