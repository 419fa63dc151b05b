"""Perplexity over a text, scored the way llama.cpp's llama-perplexity scores it.

The text is tokenized once and cut into windows of n_ctx tokens. Each window is evaluated from an
empty cache (its first token replaced by BOS when the model adds one) and only its second half is
scored, so every scored token has at least n_ctx/2 tokens of context. Perplexity is
exp(mean negative log-likelihood); its ± is the standard error of that mean, carried through exp.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from cli.engine.engine import Engine
from cli.engine.logprobs import log_softmax
from cli.errors import TextTooShortError


@dataclass(frozen=True)
class PerplexityProgress:
    """The running estimate after one more window."""

    windows_done: int
    windows: int
    tokens_scored: int
    perplexity: float
    error: float  # one standard error of the perplexity
    window: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:  # evaluated, scored or not
        evaluated = self.windows_done * self.window
        return evaluated / self.seconds if self.seconds > 0 else 0.0


def negative_log_likelihoods(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64 as llama-perplexity computes it."""
    return -log_softmax(logits)[np.arange(len(targets)), np.asarray(targets)]


def estimate(nll_sum: float, nll_squares: float, count: int) -> tuple[float, float]:
    """(perplexity, its standard error) from the sum and sum of squares of token NLLs."""
    mean = nll_sum / count
    variance = nll_squares / count - mean * mean
    perplexity = math.exp(mean)
    if count < 2 or variance <= 0:
        return perplexity, 0.0
    return perplexity, perplexity * math.sqrt(variance / (count - 1))


def windows_in(tokens: int, window: int) -> int:
    """The windows of window tokens a text of tokens holds: at least two (llama-perplexity's
    rule too), or TextTooShortError."""
    if tokens < 2 * window:
        raise TextTooShortError(tokens, window)
    return tokens // window


def perplexity(
    engine: Engine, tokens: Sequence[int], window: int, max_windows: int | None = None
) -> Iterator[PerplexityProgress]:
    """Yields the running estimate after each window; the last one is the result."""
    available = windows_in(len(tokens), window)
    windows = min(available, max_windows) if max_windows else available
    first_scored = window // 2
    nll_sum = nll_squares = 0.0
    count = 0
    started = time.perf_counter()
    for index in range(windows):
        chunk = list(tokens[index * window : (index + 1) * window])
        if engine.add_bos:
            chunk[0] = engine.bos_token
        logits = engine.window_logits(chunk, first_scored)
        # The logits after position j predict the token at j + 1; the last one predicts nothing.
        targets = tokens[index * window + first_scored + 1 : (index + 1) * window]
        nll = negative_log_likelihoods(logits[: len(targets)], targets)
        nll_sum += float(nll.sum())
        nll_squares += float((nll * nll).sum())
        count += len(targets)
        value, error = estimate(nll_sum, nll_squares, count)
        yield PerplexityProgress(
            windows_done=index + 1,
            windows=windows,
            tokens_scored=count,
            perplexity=value,
            error=error,
            seconds=time.perf_counter() - started,
            window=window,
        )
