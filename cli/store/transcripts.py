"""Chat transcripts on disk: read and checked (a file that is not one is refused, never
overwritten), and rewritten whole through a part file and a rename, so that a killed process
leaves the last complete save."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from cli.engine.chatsession import (
    RESTORED,
    ChatSettings,
    Message,
    SavedConversation,
    check_text,
    with_settings,
)
from cli.errors import TranscriptError
from quant.partfiles import UnsafeTargetError, check_replaceable, write_text_replacing


class TranscriptFiles:
    """The Transcripts a ChatSession keeps its conversation through: JSON files."""

    def read(self, path: Path, continuing: bool) -> SavedConversation:
        if continuing:  # a file the session will rewrite: one a rename can replace
            try:
                check_replaceable(path)
            except UnsafeTargetError as error:
                raise TranscriptError(str(error)) from None
        return read_transcript(path, continuing)

    def write(self, path: Path, data: dict[str, Any]) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_replacing(path, json.dumps(data, ensure_ascii=False, indent=1) + "\n")
        except OSError as error:
            raise TranscriptError(f"cannot write {path}: {error.strerror}") from None


class NotATranscriptError(TranscriptError):
    """A file that is not a quill transcript (continuing: it was named to be continued)."""

    def __init__(self, message: str, continuing: bool) -> None:
        super().__init__(message)
        self.continuing = continuing


def read_transcript(path: Path, continuing: bool) -> SavedConversation:
    """A transcript file's conversation; TranscriptError says why it cannot be one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        messages = [Message(**m) for m in data["messages"]]
        earlier = [Message(**m) for m in data.get("earlier", [])]
        system = data.get("system")
        if system is not None and not isinstance(system, str):
            raise TypeError("'system' is not text")
        saved = data.get("settings", {})
        settings = {key: saved[key] for key in RESTORED if saved.get(key) is not None}
        with_settings(ChatSettings(), settings)  # or ValueError/TypeError: not a transcript
        for message in [*messages, *earlier]:
            if not isinstance(message.content, str) or message.role not in ("user", "assistant"):
                raise TypeError("a message without a role and text")
            if not isinstance(message.interrupted, bool):
                raise TypeError("a message whose 'interrupted' is not true or false")
            if not isinstance(message.finish_reason, (str, type(None))):
                raise TypeError("a message whose 'finish_reason' is not text")
            check_text(message.content)
    except OSError as error:
        raise TranscriptError(f"cannot read {path}: {error.strerror}") from None
    except (RecursionError, ValueError, KeyError, TypeError, AttributeError) as error:
        why = "JSON nested too deep" if isinstance(error, RecursionError) else error
        raise NotATranscriptError(
            f"{path} is not a quill chat transcript ({why})", continuing
        ) from None
    return SavedConversation(system, messages, earlier, settings)


def saved_model(path: Path) -> str | None:
    """The model a transcript was written with, if it names one."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        model = json.loads(path.read_text(encoding="utf-8")).get("model")
        return model if isinstance(model, str) and model else None
    return None
