"""The KV store: sequences' KV states on disk, one store for quill run, quill chat and quill serve,
kept so that a later request or process whose prompt starts with the same tokens loads the state
instead of prefilling those tokens again.

A file holds a header (the key that makes the state valid: the model file's sha256, the KV types,
the llama.cpp build; the tokens; the state's size and sha256) and the state llama.cpp serialized
for one sequence. The context size is no part of the key: a sequence's state is the same bytes in
any context that holds its tokens (find() skips one that does not fit). A file is used only when
all of that checks out; a damaged one is removed with one warning. Files are written to a part
file and renamed under a lock that also guards eviction (least recently used first, beyond one
byte budget for the whole store); a state that holds another's tokens and more replaces it. No
llama.cpp here: the engine serializes and restores.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

from cli.sequence import common_prefix
from cli.store.home import quill_home
from cli.store.models import sha256_of
from cli.store.replicas import list_replicas, replicas_dir
from quant.partfiles import write_replacing

if TYPE_CHECKING:
    from cli.engine.engine import Engine

MAGIC = b"QUILLKV1"
SUFFIX = ".kv"
MIN_TOKENS = 512  # shorter prompts prefill in about a second on a laptop: not worth a file
# The least a kept state must spare to be loaded or kept. Loading is far cheaper than
# prefilling from the first tokens (64 tokens of SmolLM2 on 2 cores: 4 ms to load, 229 ms to
# prefill; 4096: 0.27 s against 16.7 s; benchmarks/kv_store.py): the floor is what a file and a
# lookup are worth, not the crossover.
CHAT_MIN_TOKENS = 64
DEFAULT_MAX_BYTES = 2 << 30
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 64 << 20  # some 5 million tokens of JSON: far past any context window
MAX_TOKEN = 2**31 - 1  # llama_token is an int32
MAX_FILE_BYTES = 1 << 60
_SHA256 = re.compile(r"[0-9a-f]{64}")
# A name llama-server's slot save and restore take (its filename): no folder, nothing hidden.
SLOT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


class CacheFileError(Exception):
    """A cache file that cannot be trusted: truncated, damaged, or not a quill cache."""


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    key: dict
    tokens: list[int]
    state_bytes: int
    state_sha256: str
    size: int  # of the whole file
    used: float  # last written or loaded (the file's mtime)

    @property
    def kv_types(self) -> str:
        return f"{self.key.get('kv_type_k')}/{self.key.get('kv_type_v')}"


def cache_dir(home: Path | None = None) -> Path:
    return (home or quill_home()) / "cache" / "prompts"


def engine_key(engine: Engine) -> dict:
    """What makes a saved state valid for this engine: the model file's sha256, the KV types and
    the llama.cpp build (the same for run, chat and serve: each loads what another kept)."""
    return {
        "model_sha256": model_sha256(engine.path, cache_dir()),
        "kv_streams": engine.kv.state_streams,
        "kv_type_k": engine.kv_type_k,
        "kv_type_v": engine.kv_type_v,
        "llama": engine.llama_version,
    }


def run_cache(max_bytes: int) -> Callable[[Engine], PromptCacheStore]:
    """The KV store as quill run uses it, under QUILL_HOME/cache/prompts, for an engine; the
    replicas beside it count against max_bytes."""
    return lambda engine: PromptCacheStore(
        cache_dir(), lambda: engine_key(engine), max_bytes, replicas=replicas_dir()
    )


def conversation_cache(
    max_bytes: int, pointer: Path | None = None
) -> Callable[[Engine], ConversationStore]:
    """The KV store as quill serve and quill chat use it: the same files as run's; a sequence is
    worth keeping from CHAT_MIN_TOKENS (a conversation), and loads as the process that kept its
    cells would go on (not exact). pointer: a file that names the entry kept last (a chat's)."""
    return lambda engine: ConversationStore(
        cache_dir(),
        lambda: engine_key(engine),
        max_bytes,
        min_tokens=CHAT_MIN_TOKENS,
        exact=False,
        replicas=replicas_dir(),
        pointer=pointer,
    )


def make_room(keep: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """After a replica is built: the least recently used prompt caches and replicas go beyond
    max_bytes, the new one (keep) stays."""
    store = PromptCacheStore(cache_dir(), {}, max_bytes, replicas=replicas_dir())
    with contextlib.suppress(OSError):  # a cache that cannot be evicted costs disk, not the run
        store.folder.mkdir(parents=True, exist_ok=True)
        with store._lock():
            store._evict(keep)


def chat_cache(
    transcript: Path, max_bytes: int = DEFAULT_MAX_BYTES
) -> Callable[[Engine], ConversationStore]:
    """A chat's KV state, in the one store, named by a pointer file beside its transcript
    (FILE.kvstate): loaded by the first turn of a resumed chat."""
    return conversation_cache(max_bytes, transcript.with_name(transcript.stem + ".kvstate"))


def entry_name(key: dict, tokens: Sequence[int]) -> str:
    """The file name: a digest of the key and the tokens, so the same prefix is kept once and a
    header edited after writing no longer matches its name."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode())
    digest.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return digest.hexdigest()[:32] + SUFFIX


def encode_header(key: dict, tokens: Sequence[int], state: bytes | bytearray) -> bytes:
    """What a cache file holds before the state (which follows it as it is, not copied)."""
    sha = hashlib.sha256(state).hexdigest()
    fields = {"key": key, "tokens": list(tokens), "state_bytes": len(state), "state_sha256": sha}
    header = json.dumps(fields, sort_keys=True).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header


def read_header(path: Path) -> CacheEntry:
    """The header of a cache file, not its state; CacheFileError if it is not one. Every field
    is checked here, so that nothing later can fail on a crafted header."""
    try:
        with path.open("rb") as file:
            stat = os.fstat(file.fileno())
            if file.read(len(MAGIC)) != MAGIC:
                raise CacheFileError("not a quill prompt cache")
            (length,) = _LENGTH.unpack(file.read(_LENGTH.size))
            if length > min(MAX_HEADER_BYTES, stat.st_size - len(MAGIC) - _LENGTH.size):
                raise CacheFileError(f"a header of {length} bytes in a file of {stat.st_size}")
            header = json.loads(file.read(length))
    except (struct.error, ValueError, RecursionError) as error:
        raise CacheFileError(f"a damaged header ({_short(error)})") from None
    if not isinstance(header, dict):
        raise CacheFileError("a damaged header (not a JSON object)")
    key, tokens = header.get("key"), header.get("tokens")
    state_bytes, state_sha256 = header.get("state_bytes"), header.get("state_sha256")
    if not _valid_key(key):
        raise CacheFileError("a header whose key is not a map of names to short values")
    if not isinstance(tokens, list) or not all(_int_in(t, 0, MAX_TOKEN) for t in tokens):
        raise CacheFileError(f"a header whose tokens are not token ids (0 to {MAX_TOKEN})")
    if not _int_in(state_bytes, 0, MAX_FILE_BYTES):
        raise CacheFileError("a header whose state_bytes is not a byte count")
    if not isinstance(state_sha256, str) or not _SHA256.fullmatch(state_sha256):
        raise CacheFileError("a header whose state_sha256 is not a sha256")
    if len(MAGIC) + _LENGTH.size + length + state_bytes != stat.st_size:
        raise CacheFileError(f"{stat.st_size} bytes, not the {state_bytes} of state it declares")
    return CacheEntry(path, key, tokens, state_bytes, state_sha256, stat.st_size, stat.st_mtime)


def _int_in(value: object, low: int, high: int) -> TypeGuard[int]:
    # bool is an int to Python, and JSON's 1.0 is a float: neither counts bytes or is a token.
    return type(value) is int and low <= value <= high


def _valid_key(key: object) -> TypeGuard[dict[str, int | str]]:
    """A key as engine_key writes one: a small map of short names to short values."""
    if not isinstance(key, dict) or len(key) > 64:
        return False
    return all(
        isinstance(name, str) and len(name) <= 64 and _short_value(v) for name, v in key.items()
    )


def _short_value(value: object) -> bool:
    return _int_in(value, -MAX_FILE_BYTES, MAX_FILE_BYTES) or (
        isinstance(value, str) and len(value) <= 256
    )


def _short(error: Exception) -> str:
    """An exception's text cut to one short line: a crafted file can make it long."""
    text = " ".join(str(error).split())
    return text if len(text) <= 120 else text[:117] + "..."


def read_state(entry: CacheEntry) -> bytes:
    """The state of a cache file, checked against its header's size and sha256."""
    with entry.path.open("rb") as file:
        data = file.read()
    state = data[len(data) - entry.state_bytes :] if entry.state_bytes else b""
    if len(data) != entry.size or hashlib.sha256(state).hexdigest() != entry.state_sha256:
        raise CacheFileError("its state does not match its checksum")
    return state


@dataclass
class PromptCacheStore:
    """One directory of cache files for one key. find() and keep() never raise for a bad file
    or a full disk: they note one line in warnings and the caller goes on without the cache."""

    folder: Path
    key_source: dict | Callable[[], dict]  # a function: the key is computed when first needed
    max_bytes: int = DEFAULT_MAX_BYTES
    min_tokens: int = MIN_TOKENS
    keep_after_prefill: int = MIN_TOKENS
    # True: a loaded state decodes its last prompt tokens again in one long batch, for the
    # logits a run without the cache gets; False: as few as a process that had kept its
    # cells would (a resumed chat continues exactly as if it had never stopped).
    exact: bool = True
    replicas: Path | None = None  # a folder of replicas counted against max_bytes, and evicted
    warnings: list[str] = field(default_factory=list)

    @functools.cached_property
    def key(self) -> dict:
        # Hashing the model takes a moment, and a short prompt never needs it.
        return self.key_source() if callable(self.key_source) else self.key_source

    def entries(self) -> Iterator[CacheEntry]:
        """The readable cache files for this key; damaged ones are reported and removed."""
        for found in headers(self.folder):
            if isinstance(found, tuple):
                self._discard(*found)
            elif found.key == self.key and found.path.name != entry_name(found.key, found.tokens):
                self._discard(found.path, "its header does not match its name")
            elif found.key == self.key:
                yield found

    def find(
        self, tokens: Sequence[int], capacity: int | None = None, least: int | None = None
    ) -> tuple[list[int], bytes] | None:
        """(the tokens a cache file holds, its state) for the file sharing the longest prefix
        with tokens, if at least least (default min_tokens), among those of at most capacity
        tokens (what one sequence of the context holds); None if there is none."""
        best, best_common = None, 0
        for entry in self.entries():
            if capacity is not None and len(entry.tokens) > capacity:
                continue  # kept by a larger context: another's to load
            common = common_prefix(entry.tokens, tokens)
            if common > best_common:
                best, best_common = entry, common
        if best is None or best_common < (self.min_tokens if least is None else least):
            return None
        try:
            state = read_state(best)
        except FileNotFoundError:
            return None
        except (CacheFileError, OSError) as error:
            self._discard(best.path, str(error))
            return None
        with contextlib.suppress(OSError):
            os.utime(best.path)  # used now: the last to be evicted
        return best.tokens, state

    def saved(self) -> bool:
        return False  # a chat's store knows (ConversationStore); this one names no entry of its own

    def keep_named(self, name: str, tokens: Sequence[int], state: bytes | bytearray) -> int:
        """Keep a state under a name (llama-server's slot save): the entry, and a file under
        slots/ naming its key and tokens; the bytes written, 0 where it was not kept (noted
        in warnings)."""
        kept = self.keep(tokens, state)
        if kept is None:
            return 0
        record = json.dumps({"key": self.key, "tokens": list(tokens)})
        try:
            (self.folder / "slots").mkdir(exist_ok=True)
            write_replacing(self.folder / "slots" / f"{name}.json", record)
        except OSError as error:
            self.warnings.append(f"slot {name} not named: {error.strerror or error}")
            return 0
        return kept.stat().st_size

    def find_named(self, name: str, capacity: int) -> tuple[list[int], list[int], bytes] | None:
        """What keep_named kept under name: (its tokens, the tokens of the entry that holds
        them, which a later state of the same sequence may have replaced, and that entry's
        state); None where the name is unknown, another model's, or its state has left the
        store."""
        try:
            record = json.loads((self.folder / "slots" / f"{name}.json").read_text("utf-8"))
        except (OSError, ValueError, RecursionError):
            return None
        if not isinstance(record, dict) or record.get("key") != self.key:
            return None
        tokens = record.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            return None
        if not all(_int_in(t, 0, MAX_TOKEN) for t in tokens):
            return None
        found = self.find(tokens, capacity, least=len(tokens))
        return None if found is None else (tokens, *found)

    def refused(self, tokens: Sequence[int]) -> None:
        """llama.cpp refused a state that passed every check here: drop the file."""
        self._discard(self.folder / entry_name(self.key, tokens), "llama.cpp refused its state")

    def keep(self, tokens: Sequence[int], state: bytes | bytearray) -> Path | None:
        """Write a cache file and evict the least recently used beyond max_bytes; the path, or
        None where it was not kept (too big, or the disk said no: noted in warnings)."""
        header = encode_header(self.key, tokens, state)
        if len(header) + len(state) > self.max_bytes:
            return None
        target = self.folder / entry_name(self.key, tokens)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with self._lock():
                if self._holds(target, tokens, len(state)):  # the same state, kept already
                    os.utime(target)
                    return target
                # Unsynced: a file torn by a crash fails its sha256 and is dropped on load; an
                # fsync of a 1B model's 37 MB state took 30 to 120 ms (median) more here.
                write_replacing(target, header, state, sync=False)
                self._supersede(target, tokens)
                self._evict(keep=target)
        except OSError as error:
            self.warnings.append(
                f"prompt cache not kept: {error.strerror or error} ({self.folder}); "
                "the run itself is unaffected"
            )
            return None
        return target

    def _holds(self, path: Path, tokens: Sequence[int], state_bytes: int) -> bool:
        """Whether path is this key's file of these tokens, whole (its header says so)."""
        try:
            entry = read_header(path)
        except (CacheFileError, OSError):
            return False
        return (
            entry.key == self.key
            and entry.tokens == list(tokens)
            and entry.state_bytes == state_bytes
        )

    def _supersede(self, kept: Path, tokens: Sequence[int]) -> None:
        """Remove this key's files whose tokens begin what kept holds: kept serves every prompt
        they served (a conversation's earlier turns, a slot's shorter past)."""
        for found in headers(self.folder):
            if (
                isinstance(found, CacheEntry)
                and found.path != kept
                and found.key == self.key
                and len(found.tokens) < len(tokens)
                and common_prefix(found.tokens, tokens) == len(found.tokens)
            ):
                found.path.unlink(missing_ok=True)

    def _evict(self, keep: Path) -> None:
        entries = []
        for path in files(self.folder):
            with contextlib.suppress(FileNotFoundError):  # evicted by another process meanwhile
                entries.append((path.stat().st_mtime, path.stat().st_size, path))
        if self.replicas is not None:
            entries += [(r.used, r.size, r.folder) for r in list_replicas(self.replicas)]
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            if path.is_dir():  # a replica
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            total -= size

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        with (self.folder / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _discard(self, path: Path, why: str) -> None:
        """Remove a file that cannot be trusted, and say so; where it cannot be removed (a
        read-only directory), say that instead: the next run will meet it again."""
        try:
            try:
                with self._lock():
                    path.unlink(missing_ok=True)
            except OSError:  # the lock file cannot be made: the unlink alone may still work
                path.unlink(missing_ok=True)
        except OSError as error:
            self.warnings.append(
                f"prompt cache {path.name} ignored: {why}; it could not be removed "
                f"({error.strerror or error}), so remove it from {self.folder} by hand"
            )
            return
        self.warnings.append(f"prompt cache {path.name} ignored and removed: {why}")


@dataclass
class ConversationStore(PromptCacheStore):
    """The store as serve and chat use it; a chat's names the entry it kept last in pointer, so
    that a resumed chat can say when its saved state no longer fits (another model, KV type or
    build)."""

    pointer: Path | None = None

    def keep(self, tokens: Sequence[int], state: bytes | bytearray) -> Path | None:
        kept = super().keep(tokens, state)
        if kept is not None and self.pointer is not None:
            with contextlib.suppress(OSError):  # unrecorded, the state is still found by prefix
                write_replacing(self.pointer, json.dumps({"entry": kept.name}))
        return kept

    def saved(self) -> bool:
        """Whether the state this chat kept last is still in the store."""
        if self.pointer is None:
            return False
        try:
            name = json.loads(self.pointer.read_text(encoding="utf-8")).get("entry")
        except (OSError, ValueError, RecursionError, AttributeError):
            return False
        return isinstance(name, str) and (self.folder / Path(name).name).is_file()


def files(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.suffix == SUFFIX and p.is_file())
    except OSError:
        return []


def headers(folder: Path) -> Iterator[CacheEntry | tuple[Path, str]]:
    """Every cache file, any key: its entry, or (its path, why it is unreadable)."""
    for path in files(folder):
        try:
            found: CacheEntry | tuple[Path, str] = read_header(path)
        except FileNotFoundError:  # evicted by another process meanwhile
            continue
        except (CacheFileError, OSError) as error:
            found = (path, str(error))
        yield found


@dataclass
class Cleared:
    """What quill cache clear did: the files, replicas and bytes it removed, and those it could
    not."""

    count: int = 0
    replicas: int = 0
    bytes: int = 0
    failed: list[tuple[Path, str]] = field(default_factory=list)


def clear(folder: Path, replicas: Path | None = None) -> Cleared:
    """Remove every cache file (and the replicas in replicas); one that cannot be removed is
    listed with why, not hidden."""
    cleared = Cleared()
    for replica in list_replicas(replicas) if replicas is not None else []:
        try:
            shutil.rmtree(replica.folder)
        except OSError as error:
            cleared.failed.append((replica.folder, error.strerror or str(error)))
            continue
        cleared.replicas += 1
        cleared.bytes += replica.size
    for path in files(folder):
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as error:
            cleared.failed.append((path, error.strerror or str(error)))
            continue
        cleared.count += 1
        cleared.bytes += size
    for name in sorted((folder / "slots").glob("*.json")):  # slot saves' names: nothing left
        try:
            name.unlink(missing_ok=True)
        except OSError as error:
            cleared.failed.append((name, error.strerror or str(error)))
    return cleared


SAMPLE_HEAD = 1 << 16  # the GGUF header and its metadata, where an in-place edit often lands
SAMPLE_BLOCK = 1 << 12
SAMPLE_BLOCKS = 64


def content_sample(path: Path) -> str:
    """A cheap fingerprint of what the file holds: a digest of its size, its first 64 KiB and
    64 blocks of 4 KiB spread evenly over the rest (some 320 KiB read, whatever the size)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        digest.update(str(size).encode())
        digest.update(file.read(SAMPLE_HEAD))
        span = max(size - SAMPLE_HEAD - SAMPLE_BLOCK, 0)
        for n in range(SAMPLE_BLOCKS):
            file.seek(SAMPLE_HEAD + span * n // (SAMPLE_BLOCKS - 1))
            digest.update(file.read(SAMPLE_BLOCK))
    return digest.hexdigest()


def model_sha256(path: Path, folder: Path) -> str:
    """The model file's sha256, remembered in folder against the file's size, times, inode and
    a sample of its content: a file replaced, or edited in place with its mtime set back, is
    hashed again (a stale prompt cache of the old weights would otherwise be loaded)."""
    stat = path.stat()
    stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, content_sample(path)]
    memo_path = folder / "models.json"
    where = str(path.resolve())
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # unreadable or damaged: hash again
        memo = {}
    memo = memo if isinstance(memo, dict) else {}
    known = memo.get(where)
    if isinstance(known, dict) and known.get("stamp") == stamp:
        remembered = known.get("sha256")
        if isinstance(remembered, str) and _SHA256.fullmatch(remembered):
            return remembered
    sha = sha256_of(path)
    memo[where] = {"stamp": stamp, "sha256": sha}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_replacing(memo_path, json.dumps(memo, indent=1))
    except OSError:
        pass  # remembering is an optimization: the next run hashes again
    return sha
