"""The KV cache, sequence by sequence: the one record of which tokens each sequence's cells hold,
kept by the operations here (decode, keep_prefix, restore_sequence, forget), through which every
change goes; and the prompt cache's use of it (a saved state looked up before a prefill, kept
after one)."""

from __future__ import annotations

import ctypes
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp as llama

from cli.engine.llamalog import llama_log
from cli.engine.settings import PromptCache
from cli.sequence import common_prefix

# llama.cpp's CPU backend computes batches of fewer rows with other kernels: a token's logits
# differ (up to 0.44 on SmolLM2 Q4_1) between a batch of 32 and one of 64, and are bit-identical
# between any two of 64 or more. So a state loaded from a prompt cache decodes this many prompt
# tokens again, and a prefill never ends on a shorter chunk: cached runs give uncached logits.
EXACT_BATCH = 64


_U32 = struct.Struct("<I")


class DecodeError(RuntimeError):
    """llama_decode refused a batch (out of KV cells, or a backend failure)."""


class KvCache:
    """The cells of a context's sequences (0 to parallel - 1), each holding n_ctx positions."""

    def __init__(
        self,
        ctx: Any,
        parallel: int,
        n_ctx: int,
        n_batch: int,
        before_decode: Callable[[], None],
        portable: bool = False,
    ) -> None:
        """before_decode: called just before each llama_decode (the thread count's check);
        portable: the model's memory is one plain KV cache, whose states are framed alike in
        any context (below)."""
        self._ctx = ctx
        self.portable = portable and parallel > 1
        # The stream count the states of this context are framed for: 1 for portable ones.
        self.state_streams = 1 if portable else parallel
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self._before_decode = before_decode
        self._cached: list[list[int]] = [[] for _ in range(parallel)]
        self._batch: Any = None  # one llama_batch of n_batch tokens, made at the first decode

    def cached(self, seq: int = 0) -> list[int]:
        """The tokens whose KV cells sequence seq holds, in position order (a copy)."""
        return list(self._cached[seq])

    def cached_count(self, seq: int = 0) -> int:
        return len(self._cached[seq])

    def common_prefix(self, seq: int, tokens: Sequence[int]) -> int:
        """How many leading tokens of tokens sequence seq already holds (nothing changes)."""
        return common_prefix(self._cached[seq], tokens)

    def keep_prefix(self, seq: int, n: int) -> None:
        """Keep sequence seq's first n KV cells and free the rest (the one place cells go)."""
        if n < 0:
            raise ValueError(f"cannot keep {n} positions")
        # Removed even when the record holds no more than n: a Ctrl-C that lands just after a
        # llama_decode returns leaves a cell the record never saw, and it must go too.
        llama.llama_memory_seq_rm(llama.llama_get_memory(self._ctx), seq, n, -1)
        del self._cached[seq][n:]

    def reuse_prefix(self, seq: int, tokens: Sequence[int], decode_at_least: int = 1) -> int:
        """Keep seq's common prefix with tokens, but the last decode_at_least (one at least, for
        logits to sample); the number kept."""
        common = max(0, min(self.common_prefix(seq, tokens), len(tokens) - decode_at_least))
        self.keep_prefix(seq, common)
        return common

    def sequence_state(self, seq: int = 0) -> bytearray:
        """Sequence seq's KV cells as llama.cpp serializes them (for restore_sequence), written
        straight into the bytearray returned (no second copy of tens of MB)."""
        size = llama.llama_state_seq_get_size(self._ctx, seq)
        state = bytearray(size)
        buffer = (ctypes.c_uint8 * size).from_buffer(state)
        written = llama.llama_state_seq_get_data(self._ctx, buffer, size, seq)
        del buffer  # a bytearray with a live export cannot be resized
        del state[written:]
        return self._one_stream(state, seq) if self.portable else state

    # A sequence's state, as llama.cpp writes it, is framed by the context's KV streams (one per
    # sequence): after a magic number and the sequence's id, the stream count, then each
    # stream's cells (a count of 0 for all but the sequence's own). For a plain KV cache the
    # states kept are framed as a one-stream context's, whatever --parallel made them, and
    # framed again for the context loading them: quill run, chat and a server of any --parallel
    # load each other's. (Models with sliding-window or recurrent memory write several such
    # parts, not told apart here: their states are kept under their stream count, in the
    # store's key.)
    def _one_stream(self, state: bytearray, seq: int) -> bytearray:
        streams = len(self._cached)
        head, tail = 12 + 4 * seq, 4 * (streams - seq - 1)
        expected = _U32.pack(seq) + _U32.pack(streams) + bytes(4 * seq)
        if bytes(state[4:head]) != expected or (tail and any(state[len(state) - tail :])):
            raise DecodeError(f"sequence {seq}'s state is not framed for {streams} streams")
        one = bytearray(state[:4])  # the magic number
        one += _U32.pack(0) + _U32.pack(1)
        one += memoryview(state)[head : len(state) - tail]
        return one

    def _framed(self, state: bytes | bytearray, seq: int) -> bytes | bytearray:
        """A one-stream state, framed for this context's streams at sequence seq."""
        streams = len(self._cached)
        if not self.portable or bytes(state[4:12]) != _U32.pack(0) + _U32.pack(1):
            return state
        framed = _U32.pack(seq) + _U32.pack(streams) + bytes(4 * seq)
        tail = bytes(4 * (streams - seq - 1))
        return b"".join((bytes(state[:4]), framed, memoryview(state)[12:], tail))

    def restore_sequence(self, seq: int, state: bytes | bytearray, tokens: Sequence[int]) -> bool:
        """Replace sequence seq's cells with a saved state of tokens; False (seq empty) when
        llama.cpp refuses it or it holds other than len(tokens) positions."""
        self.forget(seq)
        if not tokens or len(tokens) > self.n_ctx:
            return False
        state = self._framed(state, seq)
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if llama.llama_state_seq_set_data(self._ctx, buffer, len(state), seq) == 0:
            self.forget(seq)
            return False
        memory = llama.llama_get_memory(self._ctx)
        if (
            llama.llama_memory_seq_pos_min(memory, seq) != 0
            or llama.llama_memory_seq_pos_max(memory, seq) != len(tokens) - 1
        ):
            self.forget(seq)
            return False
        self._cached[seq] = list(tokens)
        return True

    def forget(self, seq: int) -> None:
        llama.llama_memory_seq_rm(llama.llama_get_memory(self._ctx), seq, -1, -1)
        self._cached[seq].clear()

    def clear(self) -> None:
        llama.llama_memory_clear(llama.llama_get_memory(self._ctx), True)
        for tokens in self._cached:
            tokens.clear()

    def decode(self, items: Sequence[tuple[int, int, bool]]) -> list[int]:
        """One llama_decode of (sequence, token, wants logits) items, each at its sequence's next
        position; each item's output index (-1: none). On DecodeError the sequences are empty."""
        if len(items) > self.n_batch:
            raise ValueError(f"{len(items)} tokens exceed the batch of {self.n_batch}")
        if self._batch is None:
            self._batch = llama.llama_batch_init(self.n_batch, 0, 1)
        batch = self._batch
        outputs = []
        positions = {seq: len(self._cached[seq]) for seq, _, _ in items}
        for n, (seq, token, wants_logits) in enumerate(items):
            batch.token[n] = token
            batch.pos[n] = positions[seq]
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = seq
            batch.logits[n] = wants_logits
            positions[seq] += 1
            outputs.append(n if wants_logits else -1)
        batch.n_tokens = len(items)
        self._before_decode()
        status = llama.llama_decode(self._ctx, batch)
        if status != 0:
            problems = "; ".join(llama_log().drain()[-2:])
            for seq in positions:
                self.forget(seq)
            raise DecodeError(f"llama_decode failed with status {status}: {problems}")
        for seq, token, _ in items:
            self._cached[seq].append(token)
        return outputs

    def close(self) -> None:
        """Free the batch; the context is its owner's to free, after this."""
        if self._batch is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None


def stored_state(
    cache: PromptCache | None, kv: KvCache, seq: int, tokens: Sequence[int]
) -> tuple[list[int], bytes] | None:
    """(its tokens, the state) of the kept state that covers the most of tokens, where it covers
    at least the store's min_tokens more than sequence seq holds (a shorter gain prefills faster
    than a file loads) and fits the sequence; None where there is none."""
    held = kv.common_prefix(seq, tokens)
    if cache is None or len(tokens) - 1 - held < cache.min_tokens:
        return None
    found = cache.find(tokens, capacity=kv.n_ctx)
    if found is None or common_prefix(found[0], tokens) - held < cache.min_tokens:
        return None
    return found


def named_state(
    cache: PromptCache | None, kv: KvCache, name: str
) -> tuple[list[int], list[int], bytes] | None:
    """What the store keeps under name (a slot save) that fits one of kv's sequences."""
    return None if cache is None else cache.find_named(name, kv.n_ctx)


def load_stored(cache: PromptCache, kv: KvCache, seq: int, found: tuple[list[int], bytes]) -> bool:
    """Load what stored_state found into sequence seq; a state llama.cpp refuses is dropped
    from the store (one warning), and seq is left empty."""
    tokens, state = found
    if kv.restore_sequence(seq, state, tokens):
        return True
    cache.refused(tokens)
    return False


def restore_from_prompt_cache(
    cache: PromptCache | None, kv: KvCache, tokens: Sequence[int]
) -> tuple[int, float]:
    """Load sequence 0 from the prompt cache where a saved state covers more of a long prompt
    than the cells already here; (prompt tokens loaded, seconds it took): (0, 0.0) if none."""
    started = time.perf_counter()
    found = stored_state(cache, kv, 0, tokens)
    if cache is None or found is None or not load_stored(cache, kv, 0, found):
        return 0, 0.0
    restored = min(kv.common_prefix(0, tokens), len(tokens) - 1)
    return restored, time.perf_counter() - started


def keep_in_prompt_cache(
    cache: PromptCache | None, kv: KvCache, prefilled: int, always: bool = False
) -> None:
    """Save sequence 0 to the prompt cache if the last request prefilled (prefilled tokens) a
    long prompt (or, always, if it holds one: a chat leaving)."""
    if cache is None or kv.cached_count(0) < cache.min_tokens:
        return
    if always or prefilled >= cache.keep_after_prefill:
        cache.keep(kv.cached(0), kv.sequence_state(0))
