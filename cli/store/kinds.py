"""What each model file on disk is for (generation, embedding or rerank), remembered in
QUILL_HOME/cache/kinds.json by the file's path, size and modification time. Telling a reranker
from its header means reading to the tensor table, past the vocabulary's strings: 30 ms a file
for SmolLM2's 49k tokens here, and `quill list` of ten models took 0.32 s of its 0.45 s doing it.
A file that changes is read again; the memo is only ever a shortcut, so one that cannot be read or
written is ignored."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from cli.store.home import quill_home
from quant.gguf import GGUFError, file_kind, file_state
from quant.partfiles import write_replacing

KINDS = ("generation", "embedding", "rerank")
KNOWN = [[kind] for kind in KINDS]  # what follows an entry's size and time


def memo_path() -> Path:
    return quill_home() / "cache" / "kinds.json"


def file_kinds(paths: Iterable[Path]) -> dict[str, str | None]:
    """Each path's kind (None where it is no readable GGUF), read from the file only where the
    memo has no entry for it as it is now."""
    memo = _read_memo()
    kinds: dict[str, str | None] = {}
    changed = False
    for path in paths:
        try:
            _, size, mtime = file_state(path)
        except OSError:
            kinds[str(path)] = None
            continue
        entry = memo.get(str(path))
        if isinstance(entry, list) and entry[:2] == [size, mtime] and entry[2:] in KNOWN:
            kinds[str(path)] = entry[2]
            continue
        try:
            kinds[str(path)] = kind = file_kind(path)
        except (GGUFError, OSError):
            kinds[str(path)] = None  # not remembered: the file may be a download still growing
            continue
        memo[str(path)] = [size, mtime, kind]
        changed = True
    if changed:
        _write_memo(memo)
    return kinds


def _read_memo() -> dict:
    try:
        memo = json.loads(memo_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _write_memo(memo: dict) -> None:
    """The memo less the files that are gone, replaced whole (two writers: the last one wins),
    unsynced: a memo torn by a crash fails to parse and is read as empty."""
    kept = {path: entry for path, entry in memo.items() if Path(path).exists()}
    try:
        memo_path().parent.mkdir(parents=True, exist_ok=True)
        write_replacing(memo_path(), json.dumps(kept), sync=False)
    except OSError:
        pass  # a read-only home: the next listing reads the headers again
