"""Saved chats under QUILL_HOME/chats: which transcript a name stands for."""

from __future__ import annotations

from pathlib import Path

from cli.errors import ChatNotFoundError
from cli.store.home import quill_home


def chats_dir() -> Path:
    return quill_home() / "chats"


def find_transcript(value: str, folder: Path | None = None) -> Path:
    """The transcript value names: last (the newest in folder, chats_dir() by default), a file
    name there or the start of one, or a path to a .json file; ChatNotFoundError (with the near
    matches) otherwise."""
    folder = folder or chats_dir()
    saved = (
        sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    )
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
        raise ChatNotFoundError(value, folder, [p.stem for p in matches])
    return matches[0]
