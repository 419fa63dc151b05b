"""Replicas kept under QUILL_HOME/cache/replicas: a folder per source header (a changed source
makes a new one; another name for the same file finds the same one) holding the replica's files
(a split's, named as its parts), which quant/replica.py writes from the header alone. Their text
is noise: they measure a model's speed and memory before its weights are downloaded. The prompt
caches' size limit counts them (promptcache.py evicts both, least recently used first)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from cli.errors import DoesNotFitError, ModelLoadError
from cli.store.header import ModelHeader
from cli.store.home import quill_home
from cli.units import human_bytes
from quant.gguf import GGUFError, read_header
from quant.memory import MemoryPlan

DISK_MARGIN = 256 * 2**20  # a full disk breaks more than the replica
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # EFBIG: a file size limit (ulimit -f)


@dataclass(frozen=True)
class Replica:
    folder: Path
    of: str | None  # the model it replicates; None: its first file is missing or unreadable
    size: int
    used: float  # built or last used (the folder's mtime)

    @property
    def path(self) -> Path:
        """Its first file: what llama.cpp opens (a split's other files beside it)."""
        return min(self.folder.glob("*.gguf"))


def replicas_dir(home: Path | None = None) -> Path:
    return (home or quill_home()) / "cache" / "replicas"


def replica_folder(model: ModelHeader, of: str, home: Path | None = None) -> Path:
    """The folder of model's replica: named after the first name it was built under, found by
    its header alone, so that a path and an alias of one file share one replica."""
    digest = hashlib.sha256()
    for prefix in model.prefixes:
        digest.update(prefix)
    tag = digest.hexdigest()[:12]
    with contextlib.suppress(OSError):
        for folder in replicas_dir(home).glob(f"*-{tag}"):
            return folder
    slug = re.sub(r"[^\w.-]+", "_", of)[:48].lstrip(".")  # ../m.gguf: no hidden folder
    return replicas_dir(home) / f"{slug}-{tag}"


def check_memory(of: str, memory: MemoryPlan, available: list[tuple[str, int]]) -> None:
    """DoesNotFitError when the plan fits none of the memories (RAM, each GPU's)."""
    where, room = max(available, key=lambda memory_free: memory_free[1])
    if memory.total_bytes > room:
        buffers = human_bytes(memory.compute_bytes + memory.output_bytes)
        detail = (
            f" at a context of {memory.n_ctx} (weights {human_bytes(memory.weights_bytes)}, "
            f"KV cache {human_bytes(memory.kv_bytes)}, buffers {buffers})"
        )
        raise DoesNotFitError(of, "memory", memory.total_bytes, room, where, detail)


def obtain_replica(model: ModelHeader, of: str, home: Path | None = None) -> tuple[Replica, float]:
    """The replica of model (ModelHeader.prefixes read), named of, and the seconds its files took
    to write (0: all were there); DoesNotFitError before writing when the disk lacks room, or
    when it fills meanwhile. A build that fails or is interrupted leaves nothing it made."""
    from quant.replica import replica_bytes, write_replica

    folder = replica_folder(model, of, home)
    names = model.names
    kept = sorted(p.name for p in folder.glob("*.gguf")) if folder.is_dir() else []
    if len(kept) == len(names):
        names = kept  # built under another name of the same file: its parts keep their names
    elif not set(kept) <= set(names):
        shutil.rmtree(folder, ignore_errors=True)  # part-built under another name: start again
    missing = [(p, name) for p, name in zip(model.prefixes, names, strict=True)
               if not (folder / name).is_file()]  # fmt: skip
    start = time.perf_counter()
    above = _existing(folder)
    written: list[Path] = []
    needs = 0
    try:
        needs = sum(replica_bytes(prefix, of) for prefix, _ in missing)
        room = shutil.disk_usage(above).free
        if missing and needs + DISK_MARGIN > room:
            raise DoesNotFitError(of, "disk", needs, room, str(above), "")
        for prefix, name in missing:
            write_replica(prefix, folder / name, of)
            written.append(folder / name)
    except BaseException as error:  # Ctrl-C too: a replica is whole or not there
        _remove(written, folder, above)
        if isinstance(error, GGUFError):  # a type quill cannot make, a corrupt tensor table
            raise ModelLoadError(f"cannot make a replica of {of}: {error}") from None
        if isinstance(error, OSError) and error.errno in _DISK_FULL:
            room = shutil.disk_usage(above).free
            detail = f" (writing it failed: {error.strerror})"
            raise DoesNotFitError(of, "disk", needs, room, str(above), detail) from None
        if isinstance(error, OSError):
            raise ModelLoadError(
                f"cannot make a replica of {of} in {folder}: {error.strerror or error}; "
                "set QUILL_HOME to a folder quill can write"
            ) from None
        raise
    took = time.perf_counter() - start if missing else 0.0
    os.utime(folder)  # used now: the last to be evicted
    return _replica(folder), took


def _remove(written: list[Path], folder: Path, above: Path) -> None:
    """Undo a build that failed: the files it finished (its part files remove themselves), then
    the folders it made, each only if empty (another process may be building the same replica)."""
    for path in written:
        path.unlink(missing_ok=True)
    for each in (folder, *folder.parents):
        if each == above or not each.is_relative_to(above):
            return
        with contextlib.suppress(OSError):
            each.rmdir()


def _existing(folder: Path) -> Path:
    """The folder, or the nearest one above it that exists (where it will be made)."""
    return next(p for p in (folder, *folder.parents) if p.exists())


def _replica(folder: Path) -> Replica:
    from quant.replica import REPLICA_KEY  # numpy comes with it: only where replicas are

    files = [p for p in folder.iterdir() if p.is_file()]
    first, of = min((p for p in files if p.suffix == ".gguf"), default=None), None
    if first is not None:
        with contextlib.suppress(GGUFError, OSError):
            of = read_header(first, tensors=False, only=[REPLICA_KEY]).get(REPLICA_KEY)
    size = sum(p.stat().st_size for p in files)
    return Replica(folder, of, size, folder.stat().st_mtime)


def list_replicas(folder: Path | None = None) -> list[Replica]:
    """Every replica in folder (replicas_dir()), least recently used first."""
    found = []
    try:
        folders = [p for p in (folder or replicas_dir()).iterdir() if p.is_dir()]
    except OSError:
        return []
    for each in folders:
        try:
            found.append(_replica(each))
        except FileNotFoundError:  # evicted by another process meanwhile
            continue
    return sorted(found, key=lambda replica: replica.used)
