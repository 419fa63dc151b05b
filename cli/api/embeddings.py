"""POST /v1/embeddings (OpenAI's shape) and POST /v1/rerank (llama-server's and Jina's): the
request read and checked, run on the model's EmbeddingScheduler, the reply built. Every input a
client can send that the model cannot take is a 400 naming the field, before any decode."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np

from cli.api.server import bad_request, is_token_id, text_field
from cli.engine.embedding import Embedder, Embedding
from cli.engine.embedqueue import EmbeddingJob, EmbeddingScheduler
from cli.errors import TextTooLongError

MAX_INPUTS = 2048  # texts in one request, as OpenAI's API takes at most


def embeddings(body: dict, scheduler: EmbeddingScheduler, label: str) -> dict[str, Any]:
    """The reply to an /v1/embeddings body: one vector per input, in order."""
    embedder = scheduler.engine
    if embedder.kind != "embedding":
        raise bad_request(f"{label} is a reranker: use /v1/rerank", "model", "wrong_model_kind")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad_request("'encoding_format' must be float or base64", "encoding_format")
    texts = _inputs(body.get("input"), embedder)
    results = scheduler.run(EmbeddingJob(texts))
    tokens = sum(result.tokens for result in results)
    return {
        "object": "list",
        "data": [_embedding(result, encoding) for result in results],
        "model": label,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _embedding(result: Embedding, encoding: str) -> dict[str, Any]:
    vector: Any = result.vector.tolist()
    if encoding == "base64":  # little-endian float32, as OpenAI's clients decode it
        vector = base64.b64encode(result.vector.astype("<f4").tobytes()).decode("ascii")
    return {"object": "embedding", "index": result.index, "embedding": vector}


def _inputs(value: Any, embedder: Embedder) -> list[list[int]]:
    """input as token lists: a string, an array of strings, an array of token ids, or an array
    of such arrays."""
    if isinstance(value, str):
        return [_tokens_of(value, embedder, "input")]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty array", "input")
    if len(value) > MAX_INPUTS:
        raise bad_request(
            f"'input' has {len(value)} items; send at most {MAX_INPUTS} per request", "input"
        )
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return [_checked_ids(value, embedder, "input")]
    texts = []
    for n, item in enumerate(value):
        where = f"input[{n}]"
        if isinstance(item, str):
            texts.append(_tokens_of(item, embedder, where))
        elif isinstance(item, list) and item:
            texts.append(_checked_ids(item, embedder, where))
        else:
            raise bad_request(f"'{where}' must be a non-empty string or array of token ids", where)
    return texts


def _tokens_of(text: str, embedder: Embedder, where: str) -> list[int]:
    if not text.strip():
        raise bad_request(f"'{where}' is empty: there is nothing to embed", where)
    return _fitting(embedder.tokenize(text_field(text, f"'{where}'", where)), embedder, where)


def _checked_ids(ids: Sequence[Any], embedder: Embedder, where: str) -> list[int]:
    n_vocab = embedder.vocabulary.n_vocab
    for token in ids:
        if not is_token_id(token, n_vocab):
            raise bad_request(
                f"'{where}' holds {token!r}, which is not a token id of this model "
                f"(0 to {n_vocab - 1})",
                where,
            )
    return _fitting(list(ids), embedder, where)


def _fitting(tokens: list[int], embedder: Embedder, where: str) -> list[int]:
    try:
        return embedder.fit(tokens, False, f"'{where}'")
    except TextTooLongError as error:
        raise bad_request(str(error), where, "context_length_exceeded") from None


def rerank(body: dict, scheduler: EmbeddingScheduler, label: str) -> dict[str, Any]:
    """The reply to a /v1/rerank body: the documents' indexes and scores, best first, top_n."""
    embedder = scheduler.engine
    if embedder.kind != "rerank":
        raise bad_request(
            f"{label} is not a reranker: /v1/rerank needs one", "model", "wrong_model_kind"
        )
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not query.strip():
        raise bad_request("'query' must be a non-empty string", "query")
    if not isinstance(documents, list) or not documents:
        raise bad_request("'documents' must be a non-empty array of strings", "documents")
    if len(documents) > MAX_INPUTS:
        raise bad_request(f"'documents' has {len(documents)} items; at most {MAX_INPUTS}")
    top_n = body.get("top_n", len(documents))
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1:
        raise bad_request("'top_n' must be a whole number of at least 1", "top_n")
    pairs = [_pair(query, doc, n, embedder) for n, doc in enumerate(documents)]
    results = scheduler.run(EmbeddingJob(pairs))
    order = np.argsort([-float(result.vector[0]) for result in results], kind="stable")
    tokens = sum(result.tokens for result in results)
    return {
        "model": label,
        "object": "list",
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": [_ranked(results[i], documents, body) for i in order[:top_n]],
    }


def _pair(query: str, document: Any, n: int, embedder: Embedder) -> list[int]:
    where = f"documents[{n}]"
    if not isinstance(document, str):
        raise bad_request(f"'{where}' must be a string", where)
    text_field(query, "'query'", "query")
    tokens = embedder.pair_tokens(query, text_field(document, f"'{where}'", where))
    return _fitting(tokens, embedder, where)


def _ranked(result: Embedding, documents: list[str], body: dict) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": result.index, "relevance_score": float(result.vector[0])}
    if body.get("return_documents") is True:
        entry["document"] = {"text": documents[result.index]}
    return entry
