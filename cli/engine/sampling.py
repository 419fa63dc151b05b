"""How the next token is picked: the knobs of llama.cpp's sampler chain, with its defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults; temperature 0 means greedy."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None  # None: a random seed, reported so the run can be repeated
    ignore_eos: bool = False  # never sample an end-of-generation token (benchmarks)
