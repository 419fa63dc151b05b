"""quill embed and quill rerank: vectors for texts, relevance scores for documents against a
query, from an embedding or reranker model (cli/engine/embedding.py does the work)."""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO

import typer

from cli.commands import options as shared
from cli.errors import UsageError

if TYPE_CHECKING:
    from cli.engine.embedding import Embedder, Embedding

NORMALIZE = {"l2": 2, "l1": 1, "max": 0, "none": -1}  # llama.cpp's --embd-normalize numbers
CHUNK = 512  # lines read ahead (and checked against a collection) at a time

Pooling = Annotated[
    str | None,
    typer.Option(
        "--pooling",
        help="How token vectors become one: mean, cls or last (default: as the model declares).",
    ),
]
Truncate = Annotated[
    bool,
    typer.Option("--truncate", help="Cut a text longer than the model reads, instead of failing."),
]
Batch = Annotated[
    int | None,
    typer.Option(
        "--batch",
        "-b",
        min=16,
        help="Tokens per decode, several texts to one (default: the model's context, 512 for "
        "MiniLM).",
    ),
]


@dataclass(frozen=True)
class Text:
    id: Any  # the line number, or the --jsonl line's id
    text: str


@dataclass
class Tally:
    texts: int = 0
    tokens: int = 0
    skipped: int = 0


def embed(
    model: shared.ModelArgument = None,
    text: Annotated[
        str | None, typer.Argument(help="The text; without it, one text per line of stdin.")
    ] = None,
    jsonl: Annotated[
        bool,
        typer.Option(
            "--jsonl",
            help='Stdin lines are JSON objects: {"id": ..., "text": ...} ("content" too).',
        ),
    ] = False,
    output_format: Annotated[
        str,
        typer.Option(
            "--format",
            help="jsonl: one {id, tokens, vector} per line, as they come; npy: one float32 "
            "matrix, a row per text, written at the end.",
        ),
    ] = "jsonl",
    into: Annotated[
        str | None,
        typer.Option(
            "--into",
            metavar="NAME",
            help="Store the vectors in collection NAME (for quill similar) instead of printing "
            "them; items whose id and text are already there are skipped.",
        ),
    ] = None,
    pooling: Pooling = None,
    normalize: Annotated[
        str, typer.Option("--normalize", help="l2, l1, max (int16 range) or none.")
    ] = "l2",
    truncate: Truncate = False,
    batch: Batch = None,
    threads: shared.Threads = None,
    no_stats: shared.NoStats = False,
    offline: shared.Offline = False,
    verbose: shared.Verbose = False,
) -> None:
    """Embed texts: one vector per text, as JSON lines on stdout (or a .npy matrix, or into a
    collection quill similar searches)."""
    from cli.ui import render

    norm = _choice("--normalize", normalize, NORMALIZE)
    _choice("--format", output_format, {"jsonl": 0, "npy": 1})
    if into is not None and pooling is not None:
        raise UsageError(
            "--into keeps the vectors for quill similar, which embeds its query with the "
            "model's own pooling: drop --pooling"
        )
    texts = _texts(text, jsonl)
    label, embedder = open_embedder(model, pooling, batch, threads, offline, verbose, "embedding")
    with embedder:
        started, tally = time.perf_counter(), Tally()
        items = _embedded(embedder, texts, truncate, norm, tally, into, label)
        if into is not None:
            _store(items, into, label, embedder)
        elif output_format == "npy":
            _write_npy([result.vector for _, result in items], embedder.dimensions)
        else:
            for item, result in items:
                line = {"id": item.id, "tokens": result.tokens, "vector": result.vector.tolist()}
                render.write_stdout(json.dumps(line) + "\n")
        if not no_stats:
            render.info_line(_stats_line(tally, time.perf_counter() - started, embedder))


def rerank(
    model: Annotated[str, typer.Argument(help="The reranker, as -m takes a model.")],
    query: Annotated[str, typer.Argument(help="What the documents are ranked against.")],
    top: Annotated[
        int | None, typer.Option("--top", "-n", min=1, help="Only the best N (default: all).")
    ] = None,
    truncate: Truncate = False,
    batch: Batch = None,
    json_output: shared.JsonOutput = False,
    threads: shared.Threads = None,
    no_stats: shared.NoStats = False,
    offline: shared.Offline = False,
    verbose: shared.Verbose = False,
) -> None:
    """Rank documents (one per line of stdin) by relevance to QUERY with a reranker model: the
    best first, each with its score."""
    if not query.strip():
        raise UsageError("the query is empty: give what the documents are ranked against")
    from cli.ui import render

    documents = [item.text for item in _texts(None, False, "rank")]
    label, embedder = open_embedder(model, None, batch, threads, offline, verbose, "rerank")
    with embedder:
        started = time.perf_counter()
        scores = rank(embedder, query, documents, truncate)
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top]
        for index in order:
            if json_output:
                line = {"index": index, "score": scores[index], "document": documents[index]}
                render.write_stdout(json.dumps(line, ensure_ascii=False) + "\n")
            else:
                render.write_stdout(f"{scores[index]:9.4f}  {documents[index]}\n")
        if not no_stats:
            seconds = time.perf_counter() - started
            render.info_line(
                f"{len(documents)} documents ranked in {seconds:.2f} s "
                f"({len(documents) / seconds:.1f} documents/s), {label}, "
                f"{_threads(embedder.threads)}"
            )


def rank(embedder: Embedder, query: str, documents: list[str], truncate: bool) -> list[float]:
    """Each document's relevance score against query, in the documents' order."""
    pairs = (
        embedder.fit(embedder.pair_tokens(query, doc), truncate, f"document {n + 1}")
        for n, doc in enumerate(documents)
    )
    return [float(result.vector[0]) for result in embedder.embed(pairs)]


def open_embedder(
    name: str | None,
    pooling: str | None,
    batch: int | None,
    threads: int | None,
    offline: bool,
    verbose: bool,
    kind: str,
) -> tuple[str, Embedder]:
    """(label, embedder) of the model name, refused in one line if it is not of kind."""
    from cli.engine.embedding import POOLING, Embedder
    from cli.engine.options import LoadOptions

    if pooling is not None:
        _choice(
            "--pooling", pooling, {k: v for k, v in POOLING.items() if k in ("mean", "cls", "last")}
        )
    shared.check_threads(threads)
    label, path = shared.obtain_model(name, offline, verbose)
    options = LoadOptions(n_batch=batch or 0, threads=threads)  # 0: the model's context
    embedder = Embedder(path, options, pooling, verbose)
    if embedder.kind != kind:
        embedder.close()
        raise UsageError(_wrong_kind(label, embedder.kind, kind))
    return label, embedder


def _wrong_kind(label: str, found: str, wanted: str) -> str:
    if wanted == "rerank":
        what = "an embedding model" if found == "embedding" else "a generation model"
        return f"{label} is not a reranker ({what}): quill rerank needs one"
    return (
        f"{label} is a {'reranker' if found == 'rerank' else 'generation model'} with no "
        "pooling of its own: give --pooling mean (or cls, last) to embed with it anyway"
    )


def _choice(option: str, value: str, choices: dict[str, int]) -> int:
    if value not in choices:
        raise UsageError(f"{option} {value!r}: choose one of {', '.join(choices)}")
    return choices[value]


def _texts(argument: str | None, jsonl: bool, verb: str = "embed") -> Iterator[Text]:
    """The texts to embed: the argument, else stdin's lines (each --jsonl line an object)."""
    if argument is not None:
        if not argument.strip():
            raise UsageError("the text is empty: nothing to embed")
        return iter([Text(1, argument)])
    if sys.stdin.isatty():
        raise UsageError(f"nothing to {verb}: give texts one per line on stdin")
    return _stdin_texts(sys.stdin.buffer, jsonl, verb)


def _stdin_texts(stream: BinaryIO, jsonl: bool, verb: str) -> Iterator[Text]:
    count = 0
    for number, raw in enumerate(stream, start=1):
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as error:
            raise UsageError(
                f"line {number} is not UTF-8 (byte {error.start + 1}): fix or remove it"
            ) from None
        item = _json_text(line, number) if jsonl else Text(number, line)
        if not item.text.strip():
            raise UsageError(f"line {number} is empty: nothing to {verb} (drop it: grep .)")
        count += 1
        yield item
    if count == 0:
        raise UsageError(f"stdin held no text: nothing to {verb}")


def _json_text(line: str, number: int) -> Text:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise UsageError(f"line {number} is not JSON: {error.msg}") from None
    text = record.get("text", record.get("content")) if isinstance(record, dict) else None
    if not isinstance(text, str) or "id" not in record:
        raise UsageError(f'line {number}: expected {{"id": ..., "text": "..."}}')
    return Text(record["id"], text)


def _embedded(
    embedder: Embedder,
    texts: Iterator[Text],
    truncate: bool,
    norm: int,
    tally: Tally,
    into: str | None,
    label: str,
) -> Iterator[tuple[Text, Embedding]]:
    """(text, its embedding) in input order; texts a collection already
    holds unchanged are skipped. Lines are read CHUNK at a time: memory stays bounded."""
    from cli.ui.progress import StepProgress

    pending: deque[Text] = deque()

    def tokens() -> Iterator[list[int]]:
        for item in _new_texts(texts, into, label, embedder, tally):
            pending.append(item)
            yield embedder.fit(embedder.tokenize(item.text), truncate, f"text {item.id}")

    with StepProgress("embedding") as progress:
        for result in embedder.embed(tokens(), norm):
            item = pending.popleft()
            tally.texts += 1
            tally.tokens += result.tokens
            progress.update(tally.texts, 0, f"{tally.tokens} tokens")
            yield item, result


def _new_texts(
    texts: Iterator[Text], into: str | None, label: str, embedder: Embedder, tally: Tally
) -> Iterator[Text]:
    if into is None:
        yield from texts
        return
    from cli.store.collections import Collection, content_hash

    collection = Collection.open(into, label, embedder.dimensions, _sha256(embedder))
    try:
        for chunk in _chunks(texts, CHUNK):
            same = collection.unchanged((str(t.id), content_hash(t.text)) for t in chunk)
            tally.skipped += sum(1 for t in chunk if str(t.id) in same)
            yield from (t for t in chunk if str(t.id) not in same)
    finally:
        collection.close()


def _sha256(embedder: Embedder) -> str:
    """The model file's sha256 (remembered, so cheap after the first time): a collection knows
    the very file its vectors came from, whatever name it goes by."""
    from cli.store.promptcache import cache_dir, model_sha256

    return model_sha256(embedder.path, cache_dir())


def _chunks(items: Iterable[Text], size: int) -> Iterator[list[Text]]:
    chunk: list[Text] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _store(
    items: Iterator[tuple[Text, Embedding]], name: str, label: str, embedder: Embedder
) -> None:
    """Put items into collection name a few at a time: a kill loses only the batch in flight."""
    from cli.store.collections import Collection, Item, content_hash

    collection = Collection.open(name, label, embedder.dimensions, _sha256(embedder))
    try:
        batch: list[Item] = []
        for text, result in items:
            batch.append(Item(str(text.id), content_hash(text.text), result.vector, result.tokens))
            if len(batch) == 64:
                collection.put(batch)
                batch = []
        if batch:
            collection.put(batch)
    finally:
        collection.close()


def _write_npy(vectors: list[Any], dimensions: int) -> None:
    import io

    import numpy as np

    matrix = np.stack(vectors) if vectors else np.zeros((0, dimensions))
    out = io.BytesIO()
    np.save(out, matrix.astype(np.float32))
    sys.stdout.buffer.write(out.getvalue())
    sys.stdout.buffer.flush()


def _threads(count: int) -> str:
    return "1 thread" if count == 1 else f"{count} threads"


def _stats_line(tally: Tally, seconds: float, embedder: Embedder) -> str:
    texts = "1 text" if tally.texts == 1 else f"{tally.texts} texts"
    rate = f"{tally.texts / seconds:.1f} texts/s, {tally.tokens / seconds:.0f} tokens/s"
    skipped = f", {tally.skipped} unchanged skipped" if tally.skipped else ""
    return (
        f"{texts}, {tally.tokens} tokens in {seconds:.2f} s: {rate}{skipped}; "
        f"{embedder.dimensions} dimensions, {embedder.pooling} pooling, "
        f"{_threads(embedder.threads)}, load {embedder.load_s:.2f} s"
    )


EMBED_EPILOG = (
    "A text longer than the model reads (MiniLM: 512 tokens) fails with its length, exit 4, "
    "unless --truncate. Vectors are L2-normalized unless --normalize says otherwise: their dot "
    "product is then the cosine."
)
