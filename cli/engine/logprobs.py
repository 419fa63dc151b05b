"""Log-probabilities of generated tokens (quill run --logprobs, the server's logprobs): each
token's entry from its step's logits, and the entries held back until their text is released."""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Callable

import numpy as np

from cli.engine.events import Candidate, TokenLogprobs


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The log-probabilities the logits (of one step, or a row per step) give over the
    vocabulary, in float64: the exponentials of 150,000 logits then sum to 1 within 1e-9."""
    values = logits.astype(np.float64)
    peak = values.max(axis=-1, keepdims=True)
    return values - (peak + np.log(np.exp(values - peak).sum(axis=-1, keepdims=True)))


def token_logprobs(
    logits: np.ndarray, token: int, top: int, piece: Callable[[int], bytes]
) -> TokenLogprobs:
    """token's log-probability under logits, and the top most likely (ties by token id)."""
    logprobs = log_softmax(logits)
    top = min(top, len(logprobs))
    candidates: tuple[Candidate, ...] = ()
    if top > 0:
        best = np.argpartition(logprobs, len(logprobs) - top)[len(logprobs) - top :]
        best = best[np.lexsort((best, -logprobs[best]))]
        candidates = tuple(Candidate(int(t), piece(int(t)), float(logprobs[t])) for t in best)
    chosen = Candidate(token, piece(token), float(logprobs[token]))
    return TokenLogprobs(chosen, candidates)


def drawn_logprobs(
    ids: np.ndarray, probs: np.ndarray, token: int, top: int, piece: Callable[[int], bytes]
) -> TokenLogprobs:
    """token's log-probability in the distribution a sampler chain drew it from (ids, probs:
    ChainDistribution's), and the top most likely of the tokens it could draw."""
    drawable = probs > 0
    ids, logprobs = ids[drawable], np.log(probs[drawable])
    order = np.lexsort((ids, -logprobs))[: max(top, 0)]
    candidates = tuple(
        Candidate(int(ids[i]), piece(int(ids[i])), float(logprobs[i])) for i in order
    )
    where = np.flatnonzero(ids == token)
    chosen = float(logprobs[where[0]]) if len(where) else float("-inf")  # a grammar's pick
    return TokenLogprobs(Candidate(token, piece(token), chosen), candidates, post_sampling=True)


class HeldLogprobs:
    """One sequence's token entries, each kept as the (first char, end char) its piece decodes
    to in the reply, until the text stream releases that text (a possible stop string holds
    text back, and its tokens' entries with it)."""

    def __init__(self) -> None:
        self._unreleased: deque[tuple[int, int, TokenLogprobs]] = deque()
        self._chars = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._decoded_chars = 0
        self._released_chars = 0

    def release(
        self, scored: TokenLogprobs | None, released: str, finish: str | None, stopped: bool
    ) -> tuple[TokenLogprobs, ...]:
        """The entries of the tokens whose text is now out: once all of it is; at a stop string
        (stopped), those with any text before it; at any other finish, all."""
        if scored is not None:
            start = self._decoded_chars
            self._decoded_chars += len(self._chars.decode(scored.chosen.piece))
            self._unreleased.append((start, self._decoded_chars, scored))
        self._released_chars += len(released)
        out, pending, released_chars = [], self._unreleased, self._released_chars
        if finish is not None:
            out = [entry for start, _, entry in pending if not stopped or start < released_chars]
            pending.clear()
        while pending and pending[0][1] <= released_chars:
            out.append(pending.popleft()[2])
        return tuple(out)
