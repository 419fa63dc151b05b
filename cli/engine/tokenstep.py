"""One sampled token becomes one StreamEvent: a sequence's sampler chain and grammar, its stop
strings (TextStream) and logprobs, token by token. Engine.stream_generate and the batch
scheduler (cli/engine/batching.py) both step their sequences through SequenceStep, so there is
one place where an event is made from a token."""

from __future__ import annotations

import random
import resource
import time
from collections.abc import Sequence
from typing import Any, Protocol

import llama_cpp as llama
import numpy as np

from cli.engine.events import MAX_TOP_LOGPROBS, StreamEvent, TokenLogprobs
from cli.engine.grammar import GrammarGate
from cli.engine.logprobs import HeldLogprobs, drawn_logprobs
from cli.engine.reasoning import ReasoningWait
from cli.engine.samplerchain import ChainDistribution, kept_after_mask, sampler_chain
from cli.engine.sampling import SamplingParams
from cli.engine.textstream import TextStream


class StepEngine(Protocol):
    """What a step asks of the engine whose sequence it samples (cli/engine/engine.py's Engine,
    which imports this module: hence a protocol, not the class)."""

    n_vocab: int
    n_ctx: int
    vocab_handle: Any

    @property
    def eog_tokens(self) -> tuple[int, ...]: ...

    @property
    def reasoning_may_open(self) -> bool: ...

    def piece(self, token: int, special: bool = False) -> bytes: ...

    def is_end_of_generation(self, token: int) -> bool: ...

    def cached_count(self, seq: int = 0) -> int: ...

    def output_logits(self, output: int) -> np.ndarray: ...

    # Engine.sample: a GrammarGate and its free-token test, where given (typed there).
    def sample(
        self, sampler: object, output: int, grammar: Any = None, free: Any = None
    ) -> int: ...

    def token_logprobs(self, logits: np.ndarray, token: int, top: int) -> TokenLogprobs: ...


class SequenceStep:
    """One sequence's per-token step (stream_generate's and the batch scheduler's): its sampler
    chain, seed, text stream and counters, and the StreamEvent each token becomes."""

    def __init__(
        self,
        engine: StepEngine,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str],
        cached_prompt_tokens: int,
        started: float,
        seq: int = 0,
        logprobs: int | None = None,
        post_sampling: bool = False,
    ) -> None:
        """post_sampling: logprobs of the distribution the chain draws from, not of the raw
        logits (llama-server's post_sampling_probs)."""
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be 0 to {MAX_TOP_LOGPROBS}, not {logprobs}")
        self.engine = engine
        self.seq = seq
        self.logprobs = logprobs  # None: no work at all
        self._held = HeldLogprobs()
        self.prompt_tokens = len(prompt_tokens)
        self.cached_prompt_tokens = cached_prompt_tokens
        self.restored_prompt_tokens = 0  # of those cached, loaded from the KV store on disk
        self.max_tokens = max_tokens
        self.started = started
        # A seed is always chosen here and reported, so that any run can be repeated.
        self.seed = (
            sampling.seed if sampling.seed is not None else random.SystemRandom().randrange(2**31)
        )
        banned = engine.eog_tokens if sampling.ignore_eos else ()
        # The llama.cpp chain (speculation's acceptance test reads its probabilities too).
        self.sampler = sampler_chain(sampling, self.seed, prompt_tokens, banned, engine.n_vocab)
        self._drawn: ChainDistribution | None = None
        if post_sampling and logprobs is not None:
            self._drawn = ChainDistribution(self.sampler, engine.n_vocab)
        self._grammar: GrammarGate | None = None  # each sequence its own grammar state
        self._wait: ReasoningWait | None = None
        if sampling.grammar:
            try:  # the sampler chain and the grammar are freed if what follows them fails
                self._grammar = GrammarGate(
                    engine.vocab_handle, sampling.grammar, engine.n_vocab, kept_after_mask(sampling)
                )
                if engine.reasoning_may_open:
                    tail = b"".join(engine.piece(t, special=True) for t in prompt_tokens[-8:])
                    self._wait = ReasoningWait(tail.decode("utf-8", "replace"))
            except BaseException:
                self.close()
                raise
        self.text = TextStream(stop)
        self.generated = 0
        self.prefill_s: float | None = None  # None: until the first token, measured from started
        self.first_token_at = 0.0

    def sample(self, output: int) -> StreamEvent:
        """Sample from one output of the last decode into its event."""
        grammar = self._grammar
        # Copied before the samplers change the buffer: the distribution the token is drawn from.
        logits = self.engine.output_logits(output) if self.logprobs is not None else None
        drawn = self._drawn.probabilities(logits) if self._drawn and logits is not None else None
        if grammar is not None:
            wait = self._wait
            free = None if wait is None or wait.holding else self._free
            token = self.engine.sample(self.sampler, output, grammar, free)
        else:
            token = self.engine.sample(self.sampler, output)
        if logits is None:
            return self.event(token)
        top = self.logprobs or 0
        if drawn is not None:
            return self.event(token, drawn_logprobs(*drawn, token, top, self.engine.piece))
        return self.event(token, self.engine.token_logprobs(logits, token, top))

    def _free(self, token: int) -> bool:
        """Whether the grammar lets token through as reasoning (ReasoningWait)."""
        wait = self._wait
        if wait is None:
            return False
        if self.engine.is_end_of_generation(token):
            return wait.end()
        return wait.free(self.engine.piece(token).decode("utf-8", "replace"))

    def event(self, token: int, scored: TokenLogprobs | None = None) -> StreamEvent:
        """The event of a token chosen by sample, or by speculation's acceptance test (which has
        told the chain). finish_reason: "stop" at the end of generation or a stop string,
        "length" at the token limit or a full context."""
        engine = self.engine
        grammar = self._grammar
        now = time.perf_counter()
        self.generated += 1
        if self.generated == 1:
            self.first_token_at = now
            if self.prefill_s is None:
                self.prefill_s = now - self.started
        text = self.text
        end_of_generation = engine.is_end_of_generation(token)
        if end_of_generation:
            released, finish = text.finish(), "stop"
        else:
            released, finish = text.push(engine.piece(token)), None
            if text.matched_stop is not None:
                finish = "stop"
            elif self.generated >= self.max_tokens or engine.cached_count(self.seq) >= engine.n_ctx:
                released, finish = released + text.finish(), "length"
        logprobs = None
        if self.logprobs is not None:
            # The end-of-generation token is no text of the reply: it has no entry.
            entry = None if end_of_generation else scored
            logprobs = self._held.release(entry, released, finish, text.matched_stop is not None)
        return StreamEvent(
            text=released,
            token=token,
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            restored_prompt_tokens=self.restored_prompt_tokens,
            prefill_s=self.prefill_s or 0.0,
            generation_tokens=self.generated,
            decode_s=now - self.first_token_at,
            finish_reason=finish,
            stop_string=text.matched_stop,
            seed=self.seed,
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            grammar_s=grammar.seconds if grammar is not None else 0.0,
            grammar_resampled=grammar.resampled if grammar is not None else 0,
            logprobs=logprobs,
        )

    def close(self) -> None:
        grammar = getattr(self, "_grammar", None)  # unset where __init__ failed before it
        if grammar is not None:
            grammar.close()
            self._grammar = None
        if self.sampler is not None:
            llama.llama_sampler_free(self.sampler)
            self.sampler = None
