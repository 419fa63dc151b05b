"""Speculative decoding (docs/speculative.md): guess a few tokens cheaply (NgramDrafter: prompt
lookup; DraftModelDrafter: a small model of the same vocabulary), check them with the pending
token in one batched pass (on a CPU far cheaper than one pass each), keep the run the model
agrees with, and remove the rejected cells from the KV cache. Each position is sampled through
the request's own chain, so greedy output is plain greedy output by construction; under sampling
a guess stands with the chain's probability of it and a rejected one is redrawn without it
(RejectionSampler), which keeps the distribution exact. GatedPolicy decides when to guess and
how many (llama.cpp's gating; an adaptive k did no better in the replay over five weight types,
benchmarks/README.md, 2026-12-01).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import llama_cpp as llama
import numpy as np

from cli.engine.events import StreamEvent
from cli.engine.samplerchain import ChainDistribution
from cli.engine.sampling import SamplingParams
from cli.errors import SpecOptionError, UsageError

if TYPE_CHECKING:
    from cli.engine.engine import Engine
    from cli.engine.tokenstep import SequenceStep

SPEC_MODES = ("off", "ngram", "draft")
NGRAM_LONGEST = 4  # n-grams looked up, longest first: a longer match predicts better
NGRAM_SHORTEST = 2  # single tokens match everywhere and mostly predict wrong
DRAFT_TOKENS = {"ngram": 4, "draft": 8}  # guesses a check: the replay's best for prompt lookup
P_MIN = 0.75  # a draft model guesses on while its top token is at least this likely (llama.cpp)
EMPTY_CHECKS = 1  # checks in a row that held no guess: pause (the replay's best)
RESUME_HELD = 2  # guesses a would-be check must hold to resume
FIRST_PAUSE = 32  # a draft model's pause, in tokens; doubles each time
VOCAB_SIZE_SLACK = 128  # padded vocabularies of one family differ at the end (llama.cpp's rule)


@dataclass(frozen=True)
class SpecOptions:
    mode: str = "off"  # off, ngram or draft
    draft_tokens: int | None = None  # None: DRAFT_TOKENS, gated; K: always K, never paused
    draft: str | None = None  # mode draft's model as the user names it (the commands open it)

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES:
            raise SpecOptionError("mode", self.mode, ", ".join(SPEC_MODES))
        if self.draft_tokens is not None and self.draft_tokens < 1:
            raise SpecOptionError("draft_tokens", self.draft_tokens, "a count of at least 1")

    def need_draft(self, draft: object) -> None:
        """Refuse mode draft without its draft model (named, or loaded)."""
        if self.mode == "draft" and draft is None:
            raise SpecOptionError("draft", None, "a small model of the same family")


@dataclass
class SpecStats:
    """What speculation did in one reply."""

    mode: str
    drafted: int = 0  # tokens guessed and verified
    accepted: int = 0  # guesses the model agreed with
    verify_steps: int = 0  # batched passes that checked guesses
    plain_steps: int = 0  # one-token passes (nothing to guess, or paused)
    spec_tokens: int = 0  # tokens that verification passes yielded
    spec_s: float = 0.0  # time of drafting and verification passes
    plain_s: float = 0.0  # time of one-token passes
    first_paused_at: int | None = None  # tokens generated when it first paused itself
    pauses: int = 0  # times checks that held no guess paused it
    watched: int = 0  # would-be checks followed while paused (free guesses, no decode)
    bursts: list[int] = field(default_factory=list)  # tokens per verification pass
    guessed: list[int] = field(default_factory=list)  # numbers (from 1) of accepted guesses

    def count(self, guesses: int, held: int, tokens: int, seconds: float) -> None:
        """One step: a check of guesses that held some and yielded tokens, or a plain step."""
        if guesses:
            self.verify_steps += 1
            self.drafted += guesses
            self.accepted += held
            self.spec_tokens += tokens
            self.spec_s += seconds
            self.bursts.append(tokens)
        else:
            self.plain_steps += 1
            self.plain_s += seconds

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def plain_tokens_per_s(self) -> float | None:
        """One-token decode speed measured in this reply: the figure speculation must beat."""
        return self.plain_steps / self.plain_s if self.plain_steps and self.plain_s > 0 else None

    @property
    def spec_tokens_per_s(self) -> float | None:
        return self.spec_tokens / self.spec_s if self.spec_tokens and self.spec_s > 0 else None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["bursts"], data["guessed"]
        rates = ("acceptance_rate", "plain_tokens_per_s", "spec_tokens_per_s")
        return data | {name: getattr(self, name) for name in rates}


class Drafter(Protocol):
    free: bool  # whether guessing costs next to nothing beside a decode (prompt lookup)

    def prepare(self, prompt: Sequence[int]) -> None: ...  # before the reply starts

    def propose(self, history: Sequence[int], k: int) -> list[int]: ...  # up to k guesses

    def close(self) -> None: ...


class NgramDrafter:
    """Prompt lookup: an index from each n-gram to where its latest occurrence ended, over the
    prompt and the reply so far, grown incrementally (history only grows within a reply)."""

    free = True

    def __init__(self, longest: int = NGRAM_LONGEST, shortest: int = NGRAM_SHORTEST) -> None:
        self.longest, self.shortest = longest, shortest
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}

    def _sync(self, history: Sequence[int]) -> None:
        # Within a reply history extends what was indexed; a new reply starts over.
        if self._tokens != list(history[: len(self._tokens)]):
            self._tokens, self._index = [], {}
        tokens, index = self._tokens, self._index
        for position in range(len(tokens), len(history)):
            tokens.append(history[position])
            # The n-grams ending just before this token now have a continuation: this token.
            for n in range(self.shortest, self.longest + 1):
                if position - n >= 0:
                    index[tuple(tokens[position - n : position])] = position

    def prepare(self, prompt: Sequence[int]) -> None:
        self._sync(prompt)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        self._sync(history)
        tokens = self._tokens
        for n in range(min(self.longest, len(tokens)), self.shortest - 1, -1):
            start = self._index.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k]
        return []

    def close(self) -> None:
        pass


class DraftModelDrafter:
    """A small model with the target's vocabulary drafts greedily in its own context, while its
    top token is at least p_min likely (llama.cpp's floor: past a guess the draft doubts, the
    target rarely agrees); its KV cache keeps the common prefix with the target's history."""

    free = False

    def __init__(self, draft: Engine, p_min: float = P_MIN) -> None:
        self.engine, self.p_min = draft, p_min

    def prepare(self, prompt: Sequence[int]) -> None:
        self.engine.prefill(prompt)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        draft = self.engine
        _, output = draft.prefill(history)  # drops its rejected guesses of the last step
        guesses: list[int] = []
        while len(guesses) < k:
            logits = draft.output_logits(output).astype(np.float64)
            token = int(logits.argmax())
            if 1.0 / np.exp(logits - logits[token]).sum() < self.p_min:
                break
            guesses.append(token)
            if len(guesses) == k or draft.is_end_of_generation(token):
                break
            output = draft.decode([(0, token, True)])[0]
        return guesses

    def close(self) -> None:
        self.engine.close()


def vocabulary_difference(target: Engine, draft: Engine) -> str | None:
    """What differs between two vocabularies (None: the same), as llama.cpp's speculative
    example checks: type, size within a small slack, BOS/EOS, and the text of every token."""
    a, b = target.vocab_handle, draft.vocab_handle
    if llama.llama_vocab_type(a) != llama.llama_vocab_type(b):
        return "another tokenizer type"
    n_a, n_b = target.n_vocab, draft.n_vocab
    if abs(n_a - n_b) > VOCAB_SIZE_SLACK:
        return f"{n_b} tokens against {n_a}"
    for what, get in (("BOS", llama.llama_vocab_bos), ("EOS", llama.llama_vocab_eos)):
        if get(a) != get(b):
            return f"another {what} token ({get(b)} against {get(a)})"
    for token in range(min(n_a, n_b)):
        if llama.llama_vocab_get_text(a, token) != llama.llama_vocab_get_text(b, token):
            return f"token {token} differs"
    return None


class RejectionSampler:
    """Speculative sampling of one fixed (greedy) guess: it stands with probability p(guess)
    under the whole sampler chain, else the token is drawn from p without it, renormalised; each
    token then has exactly probability p (Leviathan et al. 2023, all draft mass on the guess)."""

    def __init__(self, step: SequenceStep, n_vocab: int) -> None:
        chain = step.sampler
        self._chain = chain
        self._distribution = ChainDistribution(chain, n_vocab)
        # The chain ends with the sampler that draws (dist); the ones before shape p.
        assert not self._distribution.greedy, "a sampling chain ends in dist"
        self._rng = np.random.default_rng(step.seed)  # a seeded run repeats

    def probabilities(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidate tokens, their probabilities) as the chain would draw from them."""
        return self._distribution.probabilities(logits)

    def choose(self, engine: Engine, output: int, guess: int | None) -> int:
        ids, probs = self.probabilities(engine.output_logits(output))
        if guess is not None:
            held = float(probs[ids == guess].sum())
            if self._rng.random() < held:
                token = guess
            else:
                probs = np.where(ids == guess, 0.0, probs)
                token = int(self._rng.choice(ids, p=probs / probs.sum()))
        else:  # after every guess held: a plain draw
            token = int(self._rng.choice(ids, p=probs))
        llama.llama_sampler_accept(self._chain, token)  # penalties see the token, as in sample
        return token


class WouldBeCheck:
    """Guesses made while paused, followed against the tokens plain decoding yields: how many a
    check would have held, learnt for free (settled at the first miss or when all held)."""

    def __init__(self, generated: int, guesses: list[int]) -> None:
        self.generated = generated  # tokens generated when the guesses were made
        self.guesses = guesses

    def settle(self, generated: int, token: int) -> int | None:
        """The guesses that held, once the token at count generated settles it; else None."""
        index = generated - self.generated - 1
        if token != self.guesses[index]:
            return index
        return index + 1 if index + 1 == len(self.guesses) else None


class Speculator:
    """Held by an Engine: drafts and verifies the decode loop of stream_generate."""

    def __init__(self, options: SpecOptions, drafter: Drafter) -> None:
        self.options = options
        self.drafter = drafter
        self.last_stats: SpecStats | None = None

    def close(self) -> None:
        self.drafter.close()

    def set_threads(self, threads: int) -> None:
        if isinstance(self.drafter, DraftModelDrafter):  # a draft model decodes as its target
            self.drafter.engine.set_threads(threads)

    def decode(
        self, engine: Engine, step: SequenceStep, output: int, sampling: SamplingParams
    ) -> Iterator[StreamEvent]:
        """The events of one reply from the prefill's logits on: each step drafts the guesses
        the policy asks for (none: a plain step), checks them with the pending token in one
        batch, and accepts the run of tokens the model confirms, one event each."""
        stats = self.last_stats = SpecStats(self.options.mode)
        fixed = self.options.draft_tokens
        k = fixed or DRAFT_TOKENS[self.options.mode]
        policy = GatedPolicy(stats, k, self.drafter.free, gated=fixed is None)
        # Greedy: the chain's own pick at each position is the test. Sampling: a guess stands
        # with the probability the chain gives it (RejectionSampler), which keeps it exact.
        chooser = None if sampling.temperature <= 0 else RejectionSampler(step, engine.n_vocab)
        seq = step.seq
        self.drafter.prepare(engine.cached(seq))  # a draft model's prefill: part of the TTFT
        event = step.sample(output)
        while True:
            yield event
            if event.finish_reason is not None:
                return
            cached, generated = engine.cached_count(seq), step.generated
            # Never past max_tokens, and never so far that a full-context check fires early.
            room = min(step.max_tokens - generated - 1, engine.n_ctx - cached - 2)
            started = time.perf_counter()
            pending = event.token
            assert pending is not None
            guesses = policy.draft(self.drafter, [*engine.cached(seq), pending], generated, room)
            outputs = engine.decode([(seq, token, True) for token in (pending, *guesses)])
            spent = time.perf_counter() - started
            event, held = yield from accept(engine, step, chooser, guesses, outputs, stats)
            tokens = step.generated - generated
            stats.count(len(guesses), held, tokens, spent)
            # Plain decoding would hold every token but the last sampled one: the rejected
            # guesses' cells go (and, at the finish, the confirmed ones past the last token).
            engine.keep_prefix(seq, cached + tokens)
            if event.finish_reason is None:
                assert event.token is not None  # an unfinished reply's event carries its token
                policy.observe(step.generated, event.token, len(guesses), held)


def accept(
    engine: Engine,
    step: SequenceStep,
    chooser: RejectionSampler | None,
    guesses: list[int],
    outputs: list[int],
    stats: SpecStats,
) -> Generator[StreamEvent, None, tuple[StreamEvent, int]]:
    """Yield the event of each guess the model confirms; return the step's last event (the
    model's own token where it disagreed or after the last guess, or the finish) and how many
    guesses held."""

    def choose(output: int, guess: int | None) -> StreamEvent:
        if chooser is None or not guesses:
            return step.sample(output)
        return step.event(chooser.choose(engine, output, guess))

    for held, (guess, output) in enumerate(zip(guesses, outputs, strict=False)):
        event = choose(output, guess)
        if event.token != guess:
            return event, held
        stats.guessed.append(step.generated)
        if event.finish_reason is not None:
            return event, held + 1
        yield event
    return choose(outputs[-1], None), len(guesses)


class GatedPolicy:
    """When to draft and how many: k guesses a check; after EMPTY_CHECKS checks in a row that
    held none, a pause (a free drafter's lasts until a WouldBeCheck would hold RESUME_HELD; a
    draft model's FIRST_PAUSE tokens, doubling). Ungated (a fixed k) it never pauses."""

    def __init__(self, stats: SpecStats, k: int, free: bool, gated: bool = True) -> None:
        self.stats, self.k, self.free, self.gated = stats, k, free, gated
        self.empty = 0  # checks in a row that held no guess
        self.resume_at: int | None = None  # paused (a free drafter: until a would-be check holds)
        self.pause = FIRST_PAUSE
        self.would_be: WouldBeCheck | None = None

    def draft(self, drafter: Drafter, history: list[int], generated: int, room: int) -> list[int]:
        """The guesses to check now (none: a plain step), never more than room."""
        if self.resume_at is not None and (self.free or generated < self.resume_at):
            if self.free and self.would_be is None:
                guessed = drafter.propose(history, self.k)
                self.would_be = WouldBeCheck(generated, guessed) if guessed else None
            return []
        self.resume_at = None
        return drafter.propose(history, min(self.k, room)) if room > 0 else []

    def observe(self, generated: int, token: int, guesses: int, held: int) -> None:
        """What a step did: tokens generated after it, its last token, guesses checked, held."""
        stats = self.stats
        if self.would_be is not None:
            settled = self.would_be.settle(generated, token)
            if settled is not None:
                self.would_be, stats.watched = None, stats.watched + 1
                if settled >= min(RESUME_HELD, self.k):
                    self.resume_at = None
        elif guesses and self.gated:
            self.empty = 0 if held else self.empty + 1
            if self.empty == EMPTY_CHECKS:
                self.empty, self.resume_at = 0, generated + self.pause
                self.pause *= 2
                stats.pauses += 1
                if stats.first_paused_at is None:
                    stats.first_paused_at = generated


def attach(
    engine: Engine, options: SpecOptions, draft: Engine | None = None, name: str = ""
) -> None:
    """Give engine a Speculator for options (mode off: none). A draft engine, loaded with the
    target's context size, is closed if refused: its tokens must mean what the target's do
    (its guesses would be noise, and an id past the target's vocabulary crashes llama.cpp)."""
    if engine.speculator is not None:  # one at a time: the old one's draft model goes
        engine.speculator.close()
        engine.speculator = None
    if options.mode == "off" or engine.is_recurrent:
        if draft is not None:
            draft.close()
        if options.mode == "off":
            return
        why = "off on a recurrent model (its cache cannot drop rejected guesses)"
        raise SpecOptionError("mode", options.mode, why)
    if options.mode == "ngram":
        engine.speculator = Speculator(options, NgramDrafter())
        return
    options.need_draft(draft)
    assert draft is not None  # need_draft refused mode draft without one; ngram returned above
    problem = vocabulary_difference(engine, draft)
    if problem:
        draft.close()
        raise UsageError(
            f"the draft model {name or draft.location} has another vocabulary than the model "
            f"({problem}): choose a draft of the same family (same tokenizer)"
        )
    p_min = P_MIN if options.draft_tokens is None else 0.0  # a fixed k guesses k
    engine.speculator = Speculator(options, DraftModelDrafter(draft, p_min))
