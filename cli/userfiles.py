"""Files the user names for their text (a text to score, a schema, a grammar, a chat template),
read the one guarded way: a FIFO, a device, a directory, a file past its budget or bytes that are
not UTF-8 come back as one line naming the file and the reason, and nothing waits or grows."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cli.errors import UsageError
from cli.units import shortened
from quant.partfiles import file_kind


class UserFileError(UsageError):
    """A file the user named that cannot be read as the text it should hold."""

    def __init__(self, what: str, path: str, reason: str) -> None:
        self.what, self.path, self.reason = what, path, reason
        super().__init__(f"cannot read the {what} {shortened(path)}: {reason}")


def read_user_text(path: str | Path, what: str, max_bytes: int, too_big: str = "") -> str:
    """The UTF-8 text of the file the user named as `what`, at most max_bytes long (too_big:
    why a longer one cannot be one)."""
    shown = str(path)
    try:
        # O_NONBLOCK: opening a named pipe does not wait for a writer (the fstat then refuses it).
        descriptor = os.open(Path(path).expanduser(), os.O_RDONLY | os.O_NONBLOCK)
    except RuntimeError:  # ~user for a user there is not
        raise UserFileError(what, shown, "no such user") from None
    except OSError as error:
        raise UserFileError(what, shown, error.strerror or str(error)) from None
    with os.fdopen(descriptor, "rb") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise UserFileError(what, shown, f"it is {file_kind(mode)}, not a regular file")
        try:
            data = handle.read(max_bytes + 1)  # a file that grows as it is read stops here
        except OSError as error:
            raise UserFileError(what, shown, error.strerror or str(error)) from None
    if len(data) > max_bytes:
        why = f": {too_big}" if too_big else ""
        raise UserFileError(what, shown, f"it is over {max_bytes} bytes{why}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserFileError(what, shown, f"it is not UTF-8 text (byte {error.start})") from None
