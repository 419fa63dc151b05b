"""What generation yields: one StreamEvent per token, from a local engine or a server alike."""

from __future__ import annotations

from dataclasses import dataclass

# OpenAI's bound on top_logprobs (chat) and logprobs (completions); quill run --logprobs too.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Candidate:  # one token and its log-probability at one step
    token: int  # the vocabulary id (-1 where a server did not say)
    piece: bytes  # the token's bytes (part of a UTF-8 character, for some)
    logprob: float

    @property
    def text(self) -> str:
        return self.piece.decode("utf-8", "replace")


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and its step's most likely tokens, most likely first:
    log-softmax of the raw logits (before penalties, temperature, top-k/p, min-p and grammar),
    as llama-server and vLLM report them."""

    chosen: Candidate
    top: tuple[Candidate, ...]
    # llama-server's post_sampling_probs: the logprobs are of the distribution the sampler chain
    # drew from (after penalties, top-k/p, min-p and temperature; before a grammar), and top
    # holds only tokens it could draw.
    post_sampling: bool = False


@dataclass(frozen=True)
class PromptProgress:
    """How far a request's prompt is prefilled (llama-server's prompt_progress): made when the
    scheduler admits it (processed == cached) and after each batch that decoded some of it,
    for the requests that ask (BatchRequest.progress)."""

    total: int  # the prompt's tokens
    cached: int  # of those, found in the cache
    processed: int  # cached ones included
    elapsed_s: float  # since the request was admitted


@dataclass(frozen=True)
class StreamEvent:  # one step of generation; the last has finish_reason set
    text: str  # text released by this step ("" while a possible stop string is held back)
    token: int | None  # the token sampled at this step
    prompt_tokens: int
    cached_prompt_tokens: int  # prompt tokens whose KV cache was reused, not prefilled again
    prefill_s: float
    generation_tokens: int
    decode_s: float  # from the first sampled token to this one
    finish_reason: str | None  # "stop" (end of generation or a stop string) or "length"
    stop_string: str | None
    seed: int
    peak_rss_bytes: int
    # Reasoning kept apart from the answer (cli/engine/reasoning.py): the reasoning text this step
    # released (text then holds only answer text), and whether its token was a thinking token.
    reasoning: str = ""
    thinking: bool = False
    grammar_s: float = 0.0  # time this sequence spent in its grammar (cli/engine/grammar.py)
    grammar_resampled: int = 0  # tokens the grammar rejected, sampled again under its mask
    # When logprobs were asked for (None otherwise): the tokens whose text this step released
    # (held-back text releases its tokens later; a stop string's tokens and the end-of-generation
    # token are never released), so that the logprobs follow the text event by event.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # Of cached_prompt_tokens, those loaded from the KV store on disk (the rest were in memory).
    restored_prompt_tokens: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        new = self.prompt_tokens - self.cached_prompt_tokens
        return new / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes from the prefill's logits; each later one costs one decode step.
        steps = self.generation_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0
