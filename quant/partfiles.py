"""Writing a file safely: into a hidden part file beside it, renamed over the target only when
complete, and only over a target that is a regular file; part files that a killed process left
behind are removed by the next writer of the same target."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path


class UnsafeTargetError(Exception):
    """A target that a rename must not replace: a device, a directory, a link, the input."""


def partial_path(target: Path, pid: int | None = None) -> Path:
    """Where this process writes target before the rename: hidden, and unique to the process."""
    return target.with_name(f".{target.name}.{pid or os.getpid()}.part")


def write_replacing(target: Path, *chunks: str | bytes | bytearray, sync: bool = True) -> None:
    """Write chunks (text as UTF-8) one after another to target through this process's part
    file, synced, and a rename: a reader sees the old file or the new one, never half of one.
    Part files that dead writers left go first (OSError when the folder refuses). sync=False
    skips the fsync (tens of ms or more) for a file whose reader checks a checksum: after a
    crash the renamed file may be torn, and is refused."""
    remove_stale_parts(target)
    partial = partial_path(target)
    try:
        with partial.open("wb") as file:
            for chunk in chunks:
                file.write(chunk.encode() if isinstance(chunk, str) else chunk)
            if sync:
                file.flush()
                os.fsync(file.fileno())
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)


write_text_replacing = write_replacing  # the name chat transcripts are written with


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    except OverflowError:
        return False
    return True


def remove_stale_parts(target: Path) -> list[Path]:
    """Delete target's part files whose writing process is gone (SIGKILL, power loss); a part
    file of a live process is left alone. Returns what was removed."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.(\d+)\.part$")
    removed: list[Path] = []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return removed
    for name in names:
        match = pattern.match(name)
        if match is None or process_alive(int(match[1])):
            continue
        part = target.parent / name
        try:
            if part.is_file() and not part.is_symlink():
                part.unlink()
                removed.append(part)
        except OSError:
            pass  # not ours to remove (permissions): leave it
    return removed


def check_replaceable(
    target: Path, source: Path | None = None, error: type[Exception] = UnsafeTargetError
) -> None:
    """Refuse (with error) a target that renaming a finished part file over would damage:
    anything but a regular file (a device such as /dev/null, a directory, a FIFO, a symbolic
    link, whose target elsewhere the user may have meant), or the input file itself."""
    try:
        info = target.lstat()
    except OSError:  # nothing there (or a folder that is not one): the write itself will say
        return
    if stat.S_ISLNK(info.st_mode):
        raise error(
            f"{target} is a symbolic link (to {os.readlink(target)}); quill replaces only "
            "regular files: give the path it points to, or another one"
        )
    if not stat.S_ISREG(info.st_mode):
        kind = file_kind(info.st_mode)
        raise error(
            f"{target} is {kind}, not a regular file; quill will not replace it: choose a file path"
        )
    if source is not None and source.exists() and os.path.samefile(source, target):
        raise error(
            f"{target} is the input file itself; writing there would destroy the input: "
            "choose another output path"
        )


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words: "a directory", "a named pipe"..."""
    kinds = {"a directory": stat.S_ISDIR, "a device": lambda m: stat.S_ISCHR(m) or stat.S_ISBLK(m)}
    kinds |= {"a named pipe": stat.S_ISFIFO, "a socket": stat.S_ISSOCK}
    return next((kind for kind, test in kinds.items() if test(mode)), "a special file")
