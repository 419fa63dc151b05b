"""Embedding collections on disk (cli/store/collections.py): made and found by name, refused for
another model, upserted, searched as numpy would, shared by two writing processes, and whole
after a kill; and quill similar and quill collections over them (no model: --id)."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from cli.commands.similar import collections, similar
from cli.errors import EXIT_USAGE
from cli.store.collections import (
    Collection,
    CollectionError,
    Item,
    collections_path,
    content_hash,
    list_collections,
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A QUILL_HOME of the test's own: each starts with no collections."""
    monkeypatch.setenv("QUILL_HOME", str(tmp_path))
    return tmp_path


def items(vectors: np.ndarray, prefix: str = "i", start: int = 0) -> list[Item]:
    return [
        Item(f"{prefix}{start + n}", content_hash(f"text {start + n}"), vector, 3)
        for n, vector in enumerate(vectors)
    ]


def brute_force(matrix: np.ndarray, query: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n best rows by cosine similarity, computed the long way in float64."""
    rows = matrix.astype(np.float64)
    scores = rows @ query / (np.linalg.norm(rows, axis=1) * np.linalg.norm(query))
    order = np.argsort(-scores)[:n]
    return [(int(row), float(scores[row])) for row in order]


def test_content_hash_is_the_sha256_of_the_utf8_bytes():
    text = "naïve café 漢字"
    # same path: a hash of the text, no model involved
    assert content_hash(text) == hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_open_makes_a_collection_that_existing_and_the_listing_find(home):
    assert list_collections() == []
    assert not collections_path().exists()  # listing makes nothing
    with pytest.raises(CollectionError, match="no collection docs; `quill collections` lists"):
        Collection.existing("docs")
    assert not collections_path().exists()
    with Collection.open("docs", "minilm:f16", 4) as made:
        assert (made.name, made.model, made.dimensions, made.count()) == (
            "docs",
            "minilm:f16",
            4,
            0,
        )
        made.put(items(np.eye(4, dtype=np.float32)))
    assert collections_path() == home / "collections.db"
    with Collection.existing("docs") as found:
        assert (found.model, found.dimensions, found.count()) == ("minilm:f16", 4, 4)
    [info] = list_collections()
    assert (info.name, info.model, info.items, info.dimensions) == ("docs", "minilm:f16", 4, 4)
    assert info.updated_at.endswith("+00:00")
    assert tuple(info)[:4] == ("docs", "minilm:f16", 4, 4)  # a plain tuple too


@pytest.mark.parametrize("name", ["", "-docs", ".docs", "a b", "a/b", "x" * 65, "é", "../x"])
def test_a_name_outside_the_rule_is_refused(home, name):
    with pytest.raises(CollectionError, match="is not a collection name") as caught:
        Collection.open(name, "m", 4)
    assert caught.value.exit_code == EXIT_USAGE
    with pytest.raises(CollectionError, match="is not a collection name"):
        Collection.existing(name)


def test_names_are_case_sensitive_keys(home):
    Collection.open("Docs", "m", 4).close()
    Collection.open("docs", "other", 8).close()
    assert [(c.name, c.model) for c in list_collections()] == [("Docs", "m"), ("docs", "other")]
    Collection.open("a." + "x" * 62, "m", 4).close()  # 64 characters: the longest allowed


def test_another_model_or_dimension_count_is_refused_and_says_what_to_do(home):
    sha_a, sha_b = "a" * 64, "b" * 64
    Collection.open("docs", "minilm", 384, sha_a).close()
    with pytest.raises(CollectionError) as caught:
        Collection.open("docs", "bge-small", 384)
    assert "holds vectors of minilm, not bge-small" in str(caught.value)
    assert "use minilm, or another collection name" in str(caught.value)
    with pytest.raises(CollectionError) as caught:
        Collection.open("docs", "minilm", 384, sha_b)  # same label, another file
    assert "another file named minilm (sha256 aaaaaaaaaaaa…; this one's is bbbbbbbbbbbb…)" in str(
        caught.value
    )
    with pytest.raises(CollectionError, match="holds vectors of minilm, not bge"):
        Collection.open("docs", "bge", 384, sha_b)
    with pytest.raises(CollectionError, match="384 dimensions, and minilm makes 768"):
        Collection.open("docs", "minilm", 768, sha_a)
    # The same file under another name (a path, an alias) is the same model.
    Collection.open("docs", "/models/minilm.gguf", 384, sha_a).close()
    Collection.open("docs", "minilm", 384).close()  # no sha256 given: the label decides


def test_a_sha256_learned_later_is_kept_and_then_checked(home):
    Collection.open("docs", "minilm", 384).close()
    with Collection.open("docs", "minilm", 384, "c" * 64) as collection:
        assert collection.model_sha256 == "c" * 64
    assert Collection.existing("docs").model_sha256 == "c" * 64
    with pytest.raises(CollectionError, match="another file named minilm"):
        Collection.open("docs", "minilm", 384, "d" * 64)


def test_unchanged_names_the_ids_stored_with_the_same_hash(home):
    rng = np.random.default_rng(1)
    with Collection.open("docs", "m", 8) as collection:
        collection.put(items(rng.standard_normal((1200, 8)).astype(np.float32)))
        pairs = [(f"i{n}", content_hash(f"text {n}")) for n in range(1200)]  # past one IN (...)
        pairs[7] = ("i7", content_hash("edited"))
        pairs.append(("new", content_hash("new")))
        same = collection.unchanged(iter(pairs))
    assert same == {f"i{n}" for n in range(1200)} - {"i7"}


def test_put_replaces_an_id_and_the_search_sees_it(home):
    with Collection.open("docs", "m", 3) as collection:
        collection.put([Item("a", "h1", np.array([1, 0, 0], np.float32), 2)])
        collection.put([Item("b", "h2", np.array([0, 1, 0], np.float32), 2)])
        assert collection.nearest(np.array([1, 0, 0], np.float32), 1)[0][0] == "a"
        collection.put([Item("a", "h3", np.array([0, 0, 5], np.float32), 7)])
        assert collection.count() == 2
        assert collection.unchanged([("a", "h3"), ("b", "h2")]) == {"a", "b"}
        assert np.array_equal(collection.vector("a"), [0, 0, 5])
        hits = collection.nearest(np.array([0, 0, 1], np.float32), 5)
        assert [hit for hit, _ in hits] == ["a", "b"] and hits[0][1] == pytest.approx(1.0)


def test_a_bad_vector_is_refused_and_the_batch_with_it(home):
    with Collection.open("docs", "m", 3) as collection:
        good = Item("ok", "h", np.ones(3, np.float32), 1)
        with pytest.raises(CollectionError, match="shape \\(4,\\)"):
            collection.put([good, Item("long", "h", np.ones(4, np.float32), 1)])
        with pytest.raises(CollectionError, match="NaN"):
            collection.put([good, Item("nan", "h", np.array([1, np.nan, 0], np.float32), 1)])
        assert collection.count() == 0
        with pytest.raises(CollectionError, match="has no item 'gone'"):
            collection.vector("gone")


def test_nearest_matches_a_brute_force_search(home):
    rng = np.random.default_rng(7)
    matrix = rng.standard_normal((3000, 48)).astype(np.float32) * rng.uniform(0.1, 9, (3000, 1))
    with Collection.open("docs", "m", 48) as collection:
        for start in range(0, 3000, 64):
            collection.put(items(matrix[start : start + 64], start=start))
        for query in rng.standard_normal((5, 48)).astype(np.float32):
            hits = collection.nearest(query * 3, 10)
            expected = brute_force(matrix, query, 10)
            assert [hit for hit, _ in hits] == [f"i{row}" for row, _ in expected]
            assert np.allclose([s for _, s in hits], [s for _, s in expected], atol=1e-5)
        assert len(collection.nearest(matrix[0], 5000)) == 3000  # n past the count: all
        by_id = collection.nearest(collection.vector("i42"), 3, exclude="i42")
        assert [hit for hit, _ in by_id] == [
            f"i{r}" for r, _ in brute_force(matrix, matrix[42], 4)[1:]
        ]
        zero = collection.nearest(np.zeros(48, np.float32), 2)  # no direction: every score 0
        assert [score for _, score in zero] == [0.0, 0.0]
        with pytest.raises(CollectionError, match="query vector of shape \\(3,\\)"):
            collection.nearest(np.ones(3, np.float32))


def test_the_search_sees_what_another_process_wrote_since(home):
    with Collection.open("docs", "m", 2) as reader, Collection.open("docs", "m", 2) as writer:
        writer.put([Item("x", "h", np.array([1, 0], np.float32), 1)])
        assert [hit for hit, _ in reader.nearest(np.array([0, 1], np.float32))] == ["x"]
        writer.put([Item("y", "h", np.array([0, 1], np.float32), 1)])
        assert reader.nearest(np.array([0, 1], np.float32))[0][0] == "y"


def test_delete_drops_the_collection_and_gives_the_space_back(home):
    rng = np.random.default_rng(3)
    with Collection.open("keep", "m", 64) as keep:
        keep.put(items(rng.standard_normal((10, 64)).astype(np.float32)))
    with Collection.open("docs", "m", 64) as collection:
        collection.put(items(rng.standard_normal((3000, 64)).astype(np.float32)))
        collection.delete()
        with pytest.raises(CollectionError, match="was deleted while in use"):
            collection.put(items(np.ones((1, 64), np.float32)))
    # Checkpointed and cut when the last connection closed: far less than the vectors took.
    assert collections_path().stat().st_size < 3000 * 64 * 4 // 4
    assert [c.name for c in list_collections()] == ["keep"]
    with pytest.raises(CollectionError, match="no collection docs"):
        Collection.existing("docs")
    Collection.open("docs", "another", 8).close()  # the name is free again


def test_a_file_that_is_not_a_database_is_one_error(home):
    collections_path().write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(CollectionError, match="is not a collections database"):
        list_collections()
    with pytest.raises(CollectionError, match="is not a collections database"):
        Collection.open("docs", "m", 4)


@pytest.mark.slow
def test_nearest_over_100k_vectors_of_384_dimensions(home):
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((100_000, 384)).astype(np.float32)
    with Collection.open("big", "m", 384) as collection:
        started = time.perf_counter()
        for start in range(0, len(matrix), 1000):
            collection.put(items(matrix[start : start + 1000], start=start))
        put_s = time.perf_counter() - started
    with Collection.existing("big") as collection:
        started = time.perf_counter()
        first = collection.nearest(matrix[123], 10)
        first_s = time.perf_counter() - started
        timings = []
        for query in rng.standard_normal((20, 384)).astype(np.float32):
            started = time.perf_counter()
            collection.nearest(query, 10)
            timings.append(time.perf_counter() - started)
    assert first[0][0] == "i123"
    print(
        f"\n100k x 384: put {put_s:.2f} s; first nearest (reads the vectors) {first_s * 1000:.0f}"
        f" ms; then median {np.median(timings) * 1000:.1f} ms, max {max(timings) * 1000:.1f} ms"
    )


WRITER = """
import sys, numpy as np
from cli.store.collections import Collection, Item
prefix, batches, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()  # the go, given to all writers at once
rng = np.random.default_rng(abs(hash(prefix)) % 1000)
with Collection.open("shared", "m", 32) as collection:
    for b in range(batches):
        vectors = rng.standard_normal((size, 32)).astype(np.float32)
        collection.put([Item(f"{prefix}-{b}-{n}", "h", v, 1) for n, v in enumerate(vectors)])
        print(b, flush=True)
"""


def writer(prefix: str, batches: int, size: int = 20) -> subprocess.Popen:
    """A process that puts batches into collection "shared" once go() says so (it has imported
    what it needs by then: the writers start together, not a Python start-up apart)."""
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, prefix, str(batches), str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    return process


def go(*processes: subprocess.Popen) -> None:
    for process in processes:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()


def test_two_processes_fill_one_collection_at_once(home):
    """Both start on a home with no database: they race to make it, then take turns to write."""
    first, second = writer("a", 300), writer("b", 300)
    go(first, second)
    for process in (first, second):
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr
    with Collection.existing("shared") as collection:
        assert collection.count() == 2 * 300 * 20
        wanted = {f"{p}-{b}-{n}" for p in "ab" for b in range(300) for n in range(20)}
        assert collection.unchanged((i, "h") for i in wanted) == wanted
    with sqlite3.connect(collections_path()) as connection:
        order = [row[0][0] for row in connection.execute("SELECT id FROM items ORDER BY rowid")]
    turns = sum(a != b for a, b in itertools.pairwise(order))
    assert turns > 2, "the two writers never wrote at the same time: the test tested nothing"


KILLED = """
import os, signal, sys, numpy as np
from cli.store.collections import Collection, Item
kill_at = int(sys.argv[1])
rows = 0
def trace(statement):  # run at each row an INSERT writes
    global rows
    rows += statement.startswith("INSERT INTO items")
    if rows == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
with Collection.open("shared", "m", 384) as collection:
    collection._connection.execute("PRAGMA cache_size = 8")  # spill pages before the commit
    collection._connection.set_trace_callback(trace)
    for b in range(100):
        vectors = np.full((200, 384), b + 1, np.float32)
        collection.put([Item(f"k-{b}-{n}", "h", v, 1) for n, v in enumerate(vectors)])
"""


def test_a_kill_mid_put_leaves_only_whole_batches(home):
    """SIGKILL inside the sixth put, its first 99 rows written and pages of them in the WAL: the
    database opens, holds the five batches before it whole, and takes writes again."""
    killed = subprocess.run(
        [sys.executable, "-c", KILLED, str(5 * 200 + 100)], capture_output=True, timeout=60
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert Path(f"{collections_path()}-wal").stat().st_size > 200 * 384 * 4  # frames left behind
    with Collection.existing("shared") as collection:
        assert collection.count() == 5 * 200
        ids = [hit for hit, _ in collection.nearest(np.ones(384, np.float32), 5000)]
        assert sorted(ids) == sorted(f"k-{b}-{n}" for b in range(5) for n in range(200))
        collection.put([Item("after", "h", np.ones(384, np.float32), 1)])
        assert collection.count() == 5 * 200 + 1
    with sqlite3.connect(collections_path()) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


def test_kills_at_random_moments_leave_only_whole_batches(home):
    for delay in (0.0, 0.011, 0.023, 0.037):
        process = writer(f"r{delay}", 1_000_000, size=200)
        go(process)
        assert process.stdout is not None
        process.stdout.readline()  # one batch committed
        time.sleep(delay)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    with Collection.existing("shared") as collection:
        count = collection.count()
        ids = [hit for hit, _ in collection.nearest(np.ones(32, np.float32), count)]
    batches = {id.rsplit("-", 1)[0] for id in ids}
    assert count >= 4 * 200 and len(batches) * 200 == count  # every batch there, there whole


def cli() -> typer.Typer:
    """The two commands in an app of their own (cli/app.py registers them)."""
    app = typer.Typer()
    app.command("similar")(similar)
    app.command("collections")(collections)
    return app


def test_similar_by_id_and_the_listing_through_the_cli(home):
    vectors = np.array([[1, 0, 0], [0.9, 0.1, 0], [0, 1, 0], [0, 0, 1]], np.float32)
    with Collection.open("docs", "minilm", 3) as collection:
        collection.put(items(vectors))
    runner = CliRunner()
    result = runner.invoke(cli(), ["similar", "docs", "--id", "i0", "-n", "2"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split()[1] for line in lines] == ["i1", "i2"]
    assert lines[0] == f"{vectors[1] @ vectors[0] / np.linalg.norm(vectors[1]):.4f} i1"
    assert "2 of 4 items in docs: search" in result.stderr and "total" in result.stderr
    result = runner.invoke(cli(), ["similar", "docs", "--id", "i3", "--json"])
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["id"] for row in rows] == ["i0", "i1", "i2"] and rows[0]["score"] == 0.0
    listing = runner.invoke(cli(), ["collections", "--json"])
    [row] = json.loads(listing.stdout)
    assert {k: row[k] for k in ("name", "model", "items", "dimensions")} == {
        "name": "docs",
        "model": "minilm",
        "items": 4,
        "dimensions": 3,
    }
    table = runner.invoke(cli(), ["collections"]).stdout.splitlines()
    assert table[0].split() == ["name", "model", "items", "dimensions", "updated"]
    assert table[1].split()[:4] == ["docs", "minilm", "4", "3"]


def test_similar_refuses_in_one_line(home):
    runner = CliRunner()
    empty = runner.invoke(cli(), ["collections"])
    assert empty.exit_code == 0 and empty.stdout == ""
    assert "no collections yet" in empty.stderr
    missing = runner.invoke(cli(), ["similar", "nope", "--id", "x"])
    assert isinstance(missing.exception, CollectionError)
    assert missing.exception.exit_code == EXIT_USAGE
    assert "no collection nope; `quill collections` lists them" in str(missing.exception)
    Collection.open("docs", "m", 3).close()
    both = runner.invoke(cli(), ["similar", "docs", "some text", "--id", "x"])
    assert "not both" in str(both.exception)
    neither = runner.invoke(cli(), ["similar", "docs"], input="")
    assert "no query" in str(neither.exception)
    unknown = runner.invoke(cli(), ["similar", "docs", "--id", "x"])
    assert "has no item 'x'" in str(unknown.exception)


def test_a_lock_held_past_the_busy_timeout_is_one_error_and_nothing_is_lost(home, monkeypatch):
    import cli.store.collections as store

    monkeypatch.setattr(store, "BUSY_TIMEOUT_S", 0.2)
    with Collection.open("docs", "m", 2) as collection:
        holder = sqlite3.connect(collections_path(), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another writer that does not let go
        with pytest.raises(CollectionError, match="could not be written: database is locked"):
            collection.put([Item("a", "h", np.ones(2, np.float32), 1)])
        holder.execute("ROLLBACK")
        holder.close()
        collection.put([Item("a", "h", np.ones(2, np.float32), 1)])
        assert collection.count() == 1
