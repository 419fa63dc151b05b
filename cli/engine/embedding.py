"""Embeddings and rerank scores: a model whose output is a vector per text (or a relevance score
per query and document) instead of a next token. Embedder.embed packs many texts into each
llama_decode, one sequence each, as llama.cpp's llama-embedding does, and yields each text's
pooled vector in input order. Nothing here prints or exits."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as llama
import numpy as np

from cli.engine.freecores import ThreadJudge, measure_free_cores
from cli.engine.llamalog import llama_log
from cli.engine.loading import load_failure, model_meta, refuse_non_gguf
from cli.engine.options import LoadOptions
from cli.engine.shelf import open_model
from cli.engine.vocabulary import Vocabulary
from cli.errors import QuillError, TextTooLongError
from quant.gguf import POOLING_TYPES, file_kind, model_kind

POOLING = {name: value for value, name in POOLING_TYPES.items()}
# The longest text an embedder reads, whatever the model was trained on: one decode holds a
# whole text (non-causal attention), and its compute buffer grows with the square of the decode.
MAX_TEXT_TOKENS = 8192
EUCLIDEAN = 2  # llama.cpp's --embd-normalize values: -1 none, 0 max-abs int16, 1 taxicab, 2 L2


class EmbeddingError(QuillError):
    """llama.cpp failed to compute a batch's embeddings."""


@dataclass(frozen=True)
class Embedding:
    index: int  # the text's place in the input
    vector: np.ndarray  # float32; a rerank model's: [score]
    tokens: int


def normalized(vector: np.ndarray, norm: int) -> np.ndarray:
    """llama.cpp's common_embd_normalize: -1 none, 0 scaled to int16's range by the largest
    absolute value, 1 taxicab, 2 euclidean, above 2 that p-norm."""
    if norm < 0:
        return vector
    if norm == 0:
        total = float(np.abs(vector).max()) / 32760.0
    elif norm == 2:
        total = float(np.sqrt(np.dot(vector.astype(np.float64), vector)))
    else:
        total = float(np.sum(np.abs(vector.astype(np.float64)) ** norm) ** (1.0 / norm))
    return vector * np.float32(1.0 / total) if total > 0 else vector


class Embedder:
    """A loaded embedding or rerank model and its context: up to n_batch tokens of up to
    n_seq_max texts per decode, each text at most n_ctx tokens."""

    parallel = 1  # one pass at a time (quill serve's slots)
    core_load = None  # threads are fixed at load, not judged again

    def __init__(
        self,
        path: Path,
        options: LoadOptions = LoadOptions(),
        pooling: str | None = None,
        verbose: bool = False,
    ):
        """Load path; pooling overrides the file's (None: as the model declares)."""
        log = llama_log()
        log.verbose = verbose
        log.drain()
        refuse_non_gguf(path)
        started = time.perf_counter()
        self.path = path
        self._ctx: Any = None
        self._batch: Any = None
        self._handle = open_model(path, options)
        self.from_shelf = self._handle.from_shelf
        self._model: Any = self._handle.loaded.model
        try:
            self._open(options, pooling)
        except BaseException:
            self.close()
            raise
        self.load_s = time.perf_counter() - started

    def _open(self, options: LoadOptions, pooling: str | None) -> None:
        model = self._model
        self.vocabulary = Vocabulary(model)
        self.n_ctx = min(llama.llama_model_n_ctx_train(model), MAX_TEXT_TOKENS)  # one text's
        # A text is never split over decodes. The model's context is the default: on MiniLM, 512
        # tokens a decode embedded 200 long texts 1.2x faster than 2,048 (attention over the whole
        # decode grows with its square) and short ones no slower (benchmarks/embed.py).
        self.n_batch = max(options.n_batch, self.n_ctx)
        self.n_seq_max = min(int(llama.llama_max_parallel_sequences()), self.n_batch)
        params = llama.llama_context_default_params()
        params.embeddings = True
        if pooling is None and file_kind(self.path) == "rerank":
            pooling = "rank"  # a reranker's file declares no pooling (quant/gguf.py model_kind)
        params.pooling_type = POOLING[pooling] if pooling else -1  # -1: the model's own
        params.n_ctx = self.n_batch
        params.n_batch = params.n_ubatch = self.n_batch  # non-causal attention: one ubatch
        params.n_seq_max = self.n_seq_max
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = self.threads = (
            options.threads or ThreadJudge(measure_free_cores()).threads
        )
        params.no_perf = False
        self._ctx = llama.llama_init_from_model(model, params)
        if not self._ctx:
            raise load_failure(self.path, llama_log().drain())
        pooling_type = llama.llama_pooling_type(self._ctx)  # the file's, or the one asked for
        self.pooling = POOLING_TYPES.get(pooling_type, "none")
        self.kind = model_kind(pooling_type)
        if self.kind == "rerank":
            # One pair a decode, as llama-server scores them: packed together, the same pairs
            # score up to 5e-3 apart (another kernel's rounding, amplified by the layers), and
            # users compare a reranker's scores across tools (benchmarks/rerank_vs_llama_server.py).
            self.n_seq_max = 1
        self.dimensions = (
            llama.llama_model_n_cls_out(model)
            if self.kind == "rerank"
            else llama.llama_model_n_embd_out(model)
        )
        self._batch = llama.llama_batch_init(self.n_batch, 0, 1)

    def meta(self, key: str) -> str | None:
        return model_meta(self._model, key)

    def tokenize(self, text: str) -> list[int]:
        """text as the model reads it, its special tokens ([CLS], [SEP], BOS) added."""
        return self.vocabulary.tokenize_bytes(text.encode("utf-8"), True)

    def pair_tokens(self, query: str, document: str) -> list[int]:
        """A query and a document as a reranker reads them, as llama-server formats them: the
        file's "rerank" template where it has one, else BOS query EOS SEP document EOS."""
        template = llama.llama_model_chat_template(self._model, b"rerank")
        vocab = self.vocabulary
        if template:
            prompt = template.decode("utf-8").replace("{query}", query)
            return vocab.tokenize_bytes(prompt.replace("{document}", document).encode(), False)
        handle = vocab.handle
        end = vocab.eos_token if vocab.eos_token >= 0 else llama.llama_vocab_sep(handle)
        add_eos = bool(llama.llama_vocab_get_add_eos(handle))
        tokens = [vocab.bos_token] if vocab.add_bos else []
        tokens += vocab.tokenize_bytes(query.encode("utf-8"), False)
        tokens += [end] if add_eos else []
        tokens += [llama.llama_vocab_sep(handle)] if llama.llama_vocab_get_add_sep(handle) else []
        tokens += vocab.tokenize_bytes(document.encode("utf-8"), False)
        return tokens + ([end] if add_eos else [])

    def fit(self, tokens: list[int], truncate: bool, label: str) -> list[int]:
        """tokens cut to the context where truncate (the model's closing token kept), else a
        TextTooLongError naming label and its length."""
        if len(tokens) <= self.n_ctx:
            return tokens
        if not truncate:
            raise TextTooLongError(label, len(tokens), self.n_ctx)
        last = tokens[-1]
        closing = llama.llama_vocab_is_control(self.vocabulary.handle, last)
        return [*tokens[: self.n_ctx - 1], last] if closing else tokens[: self.n_ctx]

    def embed(self, texts: Iterable[Sequence[int]], norm: int = EUCLIDEAN) -> Iterator[Embedding]:
        """Each token list's pooled vector (normalized by norm, llama.cpp's numbering) in input
        order, many lists to a decode. Every list must fit n_ctx (fit) and not be empty."""
        pending: list[Sequence[int]] = []
        used, first = 0, 0
        for tokens in texts:
            if not tokens or len(tokens) > self.n_ctx:
                raise ValueError(f"a text of {len(tokens)} tokens cannot be embedded")
            if used + len(tokens) > self.n_batch or len(pending) == self.n_seq_max:
                yield from self._decode(pending, first, norm)
                first, pending, used = first + len(pending), [], 0
            pending.append(tokens)
            used += len(tokens)
        if pending:
            yield from self._decode(pending, first, norm)

    def _decode(self, texts: list[Sequence[int]], first: int, norm: int) -> Iterator[Embedding]:
        batch, n = self._batch, 0
        for seq, tokens in enumerate(texts):
            for position, token in enumerate(tokens):
                batch.token[n], batch.pos[n] = token, position
                batch.n_seq_id[n], batch.seq_id[n][0], batch.logits[n] = 1, seq, True
                n += 1
        batch.n_tokens = n
        memory = llama.llama_get_memory(self._ctx)
        if memory:
            llama.llama_memory_clear(memory, True)
        status = llama.llama_decode(self._ctx, batch)
        if status != 0:
            problems = "; ".join(llama_log().drain()[-2:])
            raise EmbeddingError(f"llama.cpp could not embed a batch (status {status}): {problems}")
        vectors = [self._pooled(seq) for seq in range(len(texts))]
        for seq, (tokens, vector) in enumerate(zip(texts, vectors, strict=True)):
            vector = vector if self.kind == "rerank" else normalized(vector, norm)
            yield Embedding(first + seq, vector, len(tokens))

    def _pooled(self, seq: int) -> np.ndarray:
        pointer = llama.llama_get_embeddings_seq(self._ctx, seq)
        if not pointer:
            raise EmbeddingError("llama.cpp returned no embedding (is pooling none?)")
        return np.ctypeslib.as_array(pointer, shape=(self.dimensions,)).astype(np.float32)

    def close(self, shelve: bool = False) -> None:
        """Free the context and the model; shelve: as Engine.close."""
        if self._batch is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            llama.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            self._handle.close(shelve)
            self._model = None

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
