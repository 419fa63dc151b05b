"""Embedding collections on disk, as llm's `llm embed --store` keeps them: named sets of texts'
vectors, all made by one model, that `quill similar` searches by cosine similarity.

One SQLite database, QUILL_HOME/collections.db, holds every collection, rather than a file per
collection: listing them is one query; a name is a key, not a file name, so "Docs" and "docs"
stay two collections on a case-insensitive file system too; and dropping one is a transaction,
safe while another process has the database open, where removing a file would leave its WAL and
that process's handle behind (the pages freed go back by an incremental vacuum).

A row holds an item's id, the sha256 of its text (to skip texts embedded before), its token
count, and its vector as little-endian float32 bytes. The database runs in WAL mode with a busy
timeout, and each put() is one write transaction begun at once (BEGIN IMMEDIATE): two processes
filling one collection take turns instead of failing, and a process killed mid-way loses the
batch in flight and nothing more, never half a row. Standard library sqlite3 and numpy only.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cli.errors import UsageError
from cli.store.home import quill_home

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DATABASE = "collections.db"
SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 60.0  # a writer waits this long for another's transaction before failing
WAL_LIMIT = 32 << 20  # bytes of write-ahead log kept once it was checkpointed
_VECTOR = np.dtype("<f4")  # on disk: little-endian float32, whatever the machine
_IN_CHUNK = 500  # ids per IN (...) query: under SQLite's limit on bound parameters
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS collections (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    model TEXT NOT NULL,
    model_sha256 TEXT,
    dimensions INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS items (
    collection_id INTEGER NOT NULL REFERENCES collections(id) ON DELETE CASCADE,
    id TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    vector BLOB NOT NULL,
    updated_at TEXT NOT NULL,
    UNIQUE (collection_id, id)
)""",
    # A collection's rows in rowid order, read page after page: rows found through the unique
    # index come in id order, scattered over the file (twice the time at 100k vectors).
    "CREATE INDEX IF NOT EXISTS items_by_collection ON items (collection_id)",
)


class CollectionError(UsageError):
    """A collection that cannot be used as asked: no such collection, a name not allowed, another
    model's or dimension count's vectors, or a database that is not one."""


@dataclass(frozen=True)
class Item:
    """One text to store: its id, the sha256 of its UTF-8 bytes, its vector, its token count."""

    id: str
    content_hash: str
    vector: np.ndarray  # float32, 1-D
    tokens: int


class CollectionInfo(NamedTuple):
    """A collection as `quill collections` lists it."""

    name: str
    model: str
    items: int  # how many the collection holds
    dimensions: int
    updated_at: str  # ISO 8601, UTC


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def collections_path(home: Path | None = None) -> Path:
    return (home or quill_home()) / DATABASE


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        shown = repr(name) if len(name) <= 80 else repr(name[:77] + "...")
        raise CollectionError(
            f"{shown} is not a collection name: letters, digits, '.', '_' and '-', up to 64, "
            "starting with a letter or digit"
        )
    return name


def _connect(path: Path) -> sqlite3.Connection:
    """The database at path, made if missing, in WAL mode and with its tables."""
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        connection.execute("PRAGMA auto_vacuum = INCREMENTAL")  # takes only on a new database
        connection.execute("PRAGMA journal_mode = WAL")
        connection.execute("PRAGMA synchronous = NORMAL")  # WAL: a killed process loses nothing
        connection.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT}")
        connection.execute("PRAGMA foreign_keys = ON")
        if _schema_version(connection, path) < SCHEMA_VERSION:
            with _writing(connection):  # again under the lock: another process may have made it
                if _schema_version(connection, path) < SCHEMA_VERSION:
                    for statement in _SCHEMA:
                        connection.execute(statement)
                    connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except sqlite3.DatabaseError as error:
        connection.close()
        raise CollectionError(f"{path} is not a collections database ({error})") from None
    except BaseException:
        connection.close()
        raise
    return connection


def _schema_version(connection: sqlite3.Connection, path: Path) -> int:
    version = int(connection.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise CollectionError(f"{path} was written by a newer quill (schema {version})")
    return version


@contextlib.contextmanager
def _writing(connection: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction, holding the write lock from its start (a reader that became a
    writer could deadlock with another), committed whole or rolled back. SQLite's own failures
    (a lock held past the busy timeout, a full disk) are a CollectionError that says so."""
    try:
        connection.execute("BEGIN IMMEDIATE")
        try:
            yield connection
        except BaseException:
            if connection.in_transaction:  # SQLite may have rolled back already (a full disk)
                connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")
    except sqlite3.OperationalError as error:
        raise CollectionError(f"the collections database could not be written: {error}") from None


def list_collections(home: Path | None = None) -> list[CollectionInfo]:
    """Every collection, by name; none where no database was made yet (none is made here)."""
    path = collections_path(home)
    if not path.exists():
        return []
    connection = _connect(path)
    try:
        rows = connection.execute(
            "SELECT c.name, c.model, COUNT(i.id), c.dimensions, c.updated_at FROM collections c "
            "LEFT JOIN items i ON i.collection_id = c.id GROUP BY c.id ORDER BY c.name"
        ).fetchall()
    finally:
        connection.close()
    return [CollectionInfo(*row) for row in rows]


class Collection:
    """One collection, open on its own connection to the database (close() it, or use `with`)."""

    def __init__(self, connection: sqlite3.Connection, row: tuple) -> None:
        self._connection = connection
        self._key, self.name, self.model, self.model_sha256, self.dimensions = row
        self._matrix: np.ndarray | None = None  # every vector, normalized, one per row
        self._ids: list[str] = []
        self._version = -1  # PRAGMA data_version when the matrix was read

    _COLUMNS = "id, name, model, model_sha256, dimensions"

    @classmethod
    def open(
        cls, name: str, model: str, dimensions: int, model_sha256: str | None = None
    ) -> Collection:
        """The collection name, made for model if missing; CollectionError when it holds another
        model's vectors (by sha256 where both are known, else by label) or another dimension
        count's."""
        check_name(name)
        if dimensions < 1:
            raise ValueError(f"a vector of {dimensions} dimensions")
        connection = _connect(collections_path())
        try:
            with _writing(connection):
                row = cls._row(connection, name)
                if row is None:
                    now = _now()
                    connection.execute(
                        "INSERT INTO collections (name, model, model_sha256, dimensions, "
                        "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?)",
                        (name, model, model_sha256, dimensions, now, now),
                    )
                    row = cls._row(connection, name)
                    assert row is not None
                collection = cls(connection, row)
                collection.check_model(model, dimensions, model_sha256)
                if model_sha256 is not None and collection.model_sha256 is None:
                    collection._remember_sha256(model_sha256)
        except BaseException:
            connection.close()
            raise
        return collection

    @classmethod
    def existing(cls, name: str) -> Collection:
        """The collection name; CollectionError when there is none."""
        check_name(name)
        missing = CollectionError(f"no collection {name}; `quill collections` lists them")
        path = collections_path()
        if not path.exists():
            raise missing
        connection = _connect(path)
        row = cls._row(connection, name)
        if row is None:
            connection.close()
            raise missing
        return cls(connection, row)

    @classmethod
    def _row(cls, connection: sqlite3.Connection, name: str) -> tuple | None:
        query = f"SELECT {cls._COLUMNS} FROM collections WHERE name = ?"
        return connection.execute(query, (name,)).fetchone()

    def check_model(self, model: str, dimensions: int, model_sha256: str | None = None) -> None:
        """CollectionError unless model (its sha256 where both are known, else its label) and
        dimensions are the ones this collection's vectors were made with."""
        both = model_sha256 is not None and self.model_sha256 is not None
        if both and model_sha256 != self.model_sha256 and model == self.model:
            raise CollectionError(
                f"collection {self.name} holds vectors of another file named {model} (sha256 "
                f"{self.model_sha256:.12}…; this one's is {model_sha256:.12}…), and vectors of "
                "two models do not compare: use another collection name"
            )
        same = model_sha256 == self.model_sha256 if both else model == self.model
        if not same:
            raise CollectionError(
                f"collection {self.name} holds vectors of {self.model}, not {model}, and vectors "
                f"of two models do not compare: use {self.model}, or another collection name"
            )
        if dimensions != self.dimensions:
            raise CollectionError(
                f"collection {self.name} holds vectors of {self.dimensions} dimensions, and "
                f"{model} makes {dimensions}: use another collection name"
            )

    def _remember_sha256(self, sha256: str) -> None:
        self._connection.execute(
            "UPDATE collections SET model_sha256 = ? WHERE id = ?", (sha256, self._key)
        )
        self.model_sha256 = sha256

    def unchanged(self, pairs: Iterable[tuple[str, str]]) -> set[str]:
        """The ids of (id, content_hash) pairs stored with that same hash: texts already
        embedded, which need not be again."""
        wanted = dict(pairs)
        ids = list(wanted)
        same: set[str] = set()
        for start in range(0, len(ids), _IN_CHUNK):
            chunk = ids[start : start + _IN_CHUNK]
            marks = ", ".join("?" * len(chunk))
            rows = self._connection.execute(
                f"SELECT id, content_hash FROM items WHERE collection_id = ? AND id IN ({marks})",
                (self._key, *chunk),
            )
            same.update(item_id for item_id, stored in rows if wanted[item_id] == stored)
        return same

    def _blob(self, item: Item) -> bytes:
        vector = np.asarray(item.vector, dtype=_VECTOR)
        if vector.shape != (self.dimensions,):
            raise CollectionError(
                f"item {item.id!r} has a vector of shape {vector.shape}; collection "
                f"{self.name} holds vectors of {self.dimensions} dimensions"
            )
        if not np.isfinite(vector).all():
            raise CollectionError(f"item {item.id!r} has a vector with NaN or infinite values")
        return vector.tobytes()

    def put(self, items: Sequence[Item]) -> None:
        """Store items (an id stored before is replaced) in one transaction: all or none."""
        if not items:
            return
        now = _now()
        rows = [(self._key, i.id, i.content_hash, int(i.tokens), self._blob(i), now) for i in items]
        with _writing(self._connection) as connection:
            touched = connection.execute(
                "UPDATE collections SET updated_at = ? WHERE id = ?", (now, self._key)
            )
            if touched.rowcount == 0:
                raise CollectionError(f"collection {self.name} was deleted while in use")
            connection.executemany(
                "INSERT INTO items (collection_id, id, content_hash, tokens, vector, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (collection_id, id) DO UPDATE SET "
                "content_hash = excluded.content_hash, tokens = excluded.tokens, "
                "vector = excluded.vector, updated_at = excluded.updated_at",
                rows,
            )
        self._matrix = None

    def count(self) -> int:
        query = "SELECT COUNT(*) FROM items WHERE collection_id = ?"
        return int(self._connection.execute(query, (self._key,)).fetchone()[0])

    def vector(self, item_id: str) -> np.ndarray:
        """The stored vector of item_id; CollectionError when the collection has no such item."""
        row = self._connection.execute(
            "SELECT vector FROM items WHERE collection_id = ? AND id = ?", (self._key, item_id)
        ).fetchone()
        if row is None:
            raise CollectionError(f"collection {self.name} has no item {item_id!r}")
        return np.frombuffer(row[0], dtype=_VECTOR).astype(np.float32)

    def _vectors(self) -> tuple[np.ndarray, list[str]]:
        """Every vector as one float32 matrix, each row of length 1 (0 for a zero vector), and
        the ids in row order: read once, and again only after a write, here or elsewhere."""
        version = self._connection.execute("PRAGMA data_version").fetchone()[0]
        if self._matrix is not None and version == self._version:
            return self._matrix, self._ids
        rows = self._connection.execute(
            "SELECT id, vector FROM items WHERE collection_id = ? ORDER BY rowid", (self._key,)
        ).fetchall()
        data = b"".join(row[1] for row in rows)
        if len(data) != len(rows) * self.dimensions * _VECTOR.itemsize:
            raise CollectionError(f"collection {self.name} holds vectors of the wrong length")
        matrix = np.frombuffer(data, dtype=_VECTOR).reshape(len(rows), self.dimensions)
        matrix = matrix.astype(np.float32)  # a writable copy, in this machine's byte order
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        matrix /= np.where(norms > 0, norms, 1)
        self._matrix, self._ids, self._version = matrix, [row[0] for row in rows], version
        return matrix, self._ids

    def nearest(
        self, vector: np.ndarray, n: int = 10, exclude: str | None = None
    ) -> list[tuple[str, float]]:
        """The n items most like vector, by cosine similarity, best first, as (id, score); the
        item exclude (a query by a stored item's own vector) left out."""
        query = np.asarray(vector, dtype=np.float32)
        if query.shape != (self.dimensions,):
            raise CollectionError(
                f"a query vector of shape {query.shape}; collection {self.name} holds vectors "
                f"of {self.dimensions} dimensions"
            )
        matrix, ids = self._vectors()
        length = float(np.linalg.norm(query))
        scores = matrix @ (query / length if length > 0 else query)
        most = min(n + (exclude is not None), len(ids))  # one more, for the one left out
        if most == 0:
            return []
        top = np.argpartition(-scores, most - 1)[:most]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(ids[row], float(scores[row])) for row in top if ids[row] != exclude][:n]

    def delete(self) -> None:
        """Drop this collection and its items, and give their pages back to the file system."""
        with _writing(self._connection) as connection:
            connection.execute("DELETE FROM items WHERE collection_id = ?", (self._key,))
            connection.execute("DELETE FROM collections WHERE id = ?", (self._key,))
        # executescript steps the pragma to its end; execute would free one page and stop
        self._connection.executescript("PRAGMA incremental_vacuum; PRAGMA wal_checkpoint(PASSIVE);")
        self._matrix, self._ids = None, []

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> Collection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
