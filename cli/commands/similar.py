"""quill similar and quill collections: the items of an embedding collection nearest a text or a
stored item, and the collections on disk (cli/store/collections.py keeps them; quill embed
--into fills them)."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Annotated

import typer

from cli.commands import options as shared
from cli.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

    from cli.store.collections import Collection


def similar(
    name: Annotated[str, typer.Argument(help="The collection, as `quill collections` lists it.")],
    query: Annotated[
        str | None,
        typer.Argument(
            help="The text to match (default: stdin), embedded with the collection's model."
        ),
    ] = None,
    number: Annotated[
        int, typer.Option("-n", "--number", min=1, help="How many items to show.")
    ] = 10,
    item_id: Annotated[
        str | None,
        typer.Option("--id", metavar="ID", help="Match this stored item's vector, not a text."),
    ] = None,
    truncate: Annotated[
        bool,
        typer.Option("--truncate", help="Cut a query longer than the model reads, not fail."),
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help='One JSON object a line: {"id": ..., "score": ...}.')
    ] = False,
    threads: shared.Threads = None,
    offline: shared.Offline = False,
    verbose: shared.Verbose = False,
) -> None:
    """Show the items of a collection nearest a text, best first, by cosine similarity."""
    from cli.store.collections import Collection
    from cli.ui import render

    started = time.perf_counter()
    text = _query_text(query, item_id)
    with Collection.existing(name) as collection:
        if item_id is not None:
            vector = collection.vector(item_id)
        else:
            assert text is not None
            shared.check_threads(threads)
            vector = _embedded_query(collection, text, truncate, threads, offline, verbose)
        searched = time.perf_counter()
        hits = collection.nearest(vector, number, exclude=item_id)
        search_s = time.perf_counter() - searched
        count = collection.count()
    for hit, score in hits:
        if json_output:
            render.write_stdout(json.dumps({"id": hit, "score": score}, ensure_ascii=False) + "\n")
        else:
            render.write_stdout(f"{score:.4f} {hit}\n")
    render.info_line(
        f"{len(hits)} of {count} items in {name}: search {search_s * 1000:.1f} ms, "
        f"total {time.perf_counter() - started:.2f} s"
    )


def _query_text(query: str | None, item_id: str | None) -> str | None:
    """The text to match: the argument, else stdin's; None with --id, which takes neither."""
    piped = None if query is not None or sys.stdin.isatty() else sys.stdin.buffer.read()
    if item_id is not None:
        if query is not None or (piped is not None and piped.strip()):
            raise UsageError("give a query text or --id, not both")
        return None
    text = query if piped is None else piped.decode("utf-8", errors="replace").rstrip("\n")
    if text is None or not text.strip():
        raise UsageError(
            'no query: give a text (quill similar NAME "...") or a stored item (--id ID)'
        )
    return text


def _embedded_query(
    collection: Collection,
    text: str,
    truncate: bool,
    threads: int | None,
    offline: bool,
    verbose: bool,
) -> np.ndarray:
    """text's vector by the model the collection was made with: the same file (by sha256, where
    the collection knows it) and the same number of dimensions, or a CollectionError."""
    from cli.engine.embedding import Embedder
    from cli.engine.options import LoadOptions

    _, path = shared.obtain_model(collection.model, offline, verbose)
    sha256 = None
    if collection.model_sha256 is not None:
        from cli.store.promptcache import cache_dir, model_sha256

        sha256 = model_sha256(path, cache_dir())
    with Embedder(path, LoadOptions(threads=threads), verbose=verbose) as embedder:
        collection.check_model(collection.model, embedder.dimensions, sha256)
        tokens = embedder.fit(embedder.tokenize(text), truncate, "the query")
        return next(iter(embedder.embed([tokens]))).vector


def collections(
    json_output: Annotated[bool, typer.Option("--json", help="One JSON array on stdout.")] = False,
) -> None:
    """List the embedding collections: name, model, items, dimensions, last update."""
    from cli.store.collections import list_collections
    from cli.ui import render

    found = list_collections()
    if json_output:
        rows = [
            {
                "name": c.name,
                "model": c.model,
                "items": c.items,
                "dimensions": c.dimensions,
                "updated": c.updated_at,
            }
            for c in found
        ]
        render.write_stdout(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")
    elif not found:
        render.info_line("no collections yet: `quill embed MODEL --into NAME` makes one")
    else:
        headers = ["name", "model", "items", "dimensions", "updated"]
        rows_text = [
            [c.name, c.model, str(c.items), str(c.dimensions), c.updated_at] for c in found
        ]
        render.write_stdout(render.columns(headers, rows_text, right=(2, 3)))
