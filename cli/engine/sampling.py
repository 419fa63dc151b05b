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
    # OpenAI's: subtract frequency x (times seen) and presence x (seen at all) from a logit.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None  # None: a random seed, reported so the run can be repeated
    ignore_eos: bool = False  # never sample an end-of-generation token (benchmarks)
    grammar: str | None = None  # GBNF (root rule "root") the output must follow
    # OpenAI's logit_bias: (token, bias) added to those tokens' logits (-inf: never sampled)
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def penalizes(self) -> bool:
        """Whether any penalty is on (llama.cpp's penalties sampler costs time per token)."""
        return (self.repeat_penalty, self.frequency_penalty, self.presence_penalty) != (1, 0, 0)
