"""Speculative decoding: guess a few tokens cheaply, check them in one batched pass, keep the
longest run the model agrees with.

On a CPU a forward pass over k+1 tokens costs far less than k+1 passes, so when the guesses are
good each pass yields several tokens. Two drafters guess:

- NgramDrafter (prompt lookup): the tokens that followed the latest earlier occurrence of the
  reply's last n-gram, in the prompt or the reply so far. Free, and strong exactly when the reply
  copies from its input (rewriting, extracting, summarising a piped file).
- DraftModelDrafter: a small model with the same vocabulary, in its own context, drafting
  greedily.

Verification decodes [last sampled token, draft 1..k] in one llama_decode with logits for every
position, then samples through the request's own sampler chain position by position, exactly as
plain decoding would, stopping at the first disagreement. The token sampled there replaces the
rejected draft, and the rejected cells are removed from the KV cache (Engine.keep_prefix). So
greedy output is the plain greedy output, token for token, by construction; stop strings,
max_tokens, end of generation and text streaming see one event per token, as always.

Sampling at temperature > 0 stays distribution-exact through rejection sampling: a guess stands
with the probability the full sampler chain gives it, and a rejected guess is replaced by a draw
from the chain's distribution without it (RejectionSampler). Accepting a guess whenever the
sampled token happened to equal it would skew the distribution toward the guesses.

By default each check holds a fixed number of guesses (DRAFT_TOKENS), gated as llama.cpp gates
its drafts (GatedPolicy): a draft model guesses only while its own top token is at least P_MIN
likely, and EMPTY_CHECKS checks in a row that held no guess pause speculation. It resumes when
the reply changes, as it does: a rewrite's preamble guesses badly and its copied body well.
Prompt lookup guesses for free, so while paused it keeps guessing and follows each would-be
check against the tokens plain decoding yields (WouldBeCheck), and resumes once one would have
held RESUME_HELD guesses; no check is paid for on the way. (Under sampling a guess matches the
sampled token with the chain's probability of it, exactly the chance a check would accept it.)
A draft model's guesses cost decodes, so with one the pause lasts FIRST_PAUSE tokens, then
twice that, and so on. --draft-tokens K checks K guesses at every step (for benchmarks). An
adaptive k, from costs and hold rates measured as the reply went, did no better in the replay
over five weight types and was removed (benchmarks/README.md, 2026-12-01).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import llama_cpp as llama
import numpy as np

from cli.engine.events import StreamEvent
from cli.engine.sampling import SamplingParams
from cli.errors import SpecOptionError, UsageError

if TYPE_CHECKING:
    from cli.engine.engine import Engine, SequenceStep

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
        data["acceptance_rate"] = self.acceptance_rate
        data["plain_tokens_per_s"] = self.plain_tokens_per_s
        data["spec_tokens_per_s"] = self.spec_tokens_per_s
        return data


class Drafter(Protocol):
    free: bool  # whether guessing costs next to nothing beside a decode (prompt lookup)

    def prepare(self, prompt: Sequence[int]) -> None:
        """Read the prompt before the reply starts."""
        ...

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens guessed to follow history."""
        ...

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
        tokens = self._tokens
        common = 0
        limit = min(len(tokens), len(history))
        # Within a reply history extends what was indexed; a new reply starts over.
        if limit and tokens[limit - 1] == history[limit - 1] and tokens[:limit] == history[:limit]:
            common = limit
        if common < len(tokens):
            self._tokens, self._index = [], {}
            tokens, common = self._tokens, 0
        index = self._index
        for position in range(common, len(history)):
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
        for n in range(self.longest, self.shortest - 1, -1):
            if len(tokens) < n:
                continue
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
        self._catch_up(prompt)

    def _catch_up(self, history: Sequence[int]) -> int:
        """Decode what the draft's cache lacks of history; the output of its last token."""
        draft = self.engine
        kept = draft.reuse_prefix(0, history)  # drops its rejected guesses of the last step
        pending = list(history[kept:])
        output = -1
        while pending:
            chunk, pending = pending[: draft.n_batch], pending[draft.n_batch :]
            last = len(chunk) - 1
            items = [(0, token, not pending and i == last) for i, token in enumerate(chunk)]
            output = draft.decode(items)[0]
        return output

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        draft = self.engine
        output = self._catch_up(history)
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


def check_same_vocabulary(target: Engine, draft: Engine, draft_name: str) -> None:
    """Refuse a draft model whose tokens mean something else: its guesses would be noise, and a
    token id past the target's vocabulary would crash llama.cpp."""
    problem = vocabulary_difference(target, draft)
    if problem:
        raise UsageError(
            f"the draft model {draft_name} has another vocabulary than the model ({problem}): "
            "choose a draft of the same family (same tokenizer)"
        )


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


TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class RejectionSampler:
    """Speculative sampling for a guess that is one fixed token (both drafters guess greedily):
    the guess stands with probability p(guess) under the full sampler chain (biases, penalties,
    top-k, top-p, min-p, temperature); otherwise the token is drawn from p without the guess,
    renormalised. Every token then has exactly probability p, as plain sampling gives it
    (Leviathan et al. 2023, with a draft distribution that puts all its mass on the guess)."""

    def __init__(self, step: SequenceStep, n_vocab: int) -> None:
        chain = step.sampler
        count = llama.llama_sampler_chain_n(chain)
        samplers = [llama.llama_sampler_chain_get(chain, i) for i in range(count)]
        # The chain ends with the sampler that draws (dist); the ones before shape p.
        assert llama.llama_sampler_name(samplers[-1]) == b"dist", "a sampling chain ends in dist"
        self._chain = chain
        self._shapers = samplers[:-1]
        self._data = np.zeros(n_vocab, dtype=TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._rng = np.random.default_rng(step.seed)  # a seeded run repeats

    def probabilities(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidate tokens, their probabilities) as the chain would draw from them."""
        data = self._data
        data["id"] = self._ids
        data["logit"] = logits
        data["p"] = 0.0
        array = llama.llama_token_data_array(
            data=data.ctypes.data_as(ctypes.POINTER(llama.llama_token_data)),
            size=len(data),
            selected=-1,
            sorted=False,
        )
        for shaper in self._shapers:
            llama.llama_sampler_apply(shaper, ctypes.byref(array))
        kept = np.ctypeslib.as_array(array.data, (array.size,))
        ids = kept["id"].copy()
        shifted = np.exp(kept["logit"].astype(np.float64) - kept["logit"].max())
        return ids, shifted / shifted.sum()

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
    """Guesses made while speculation pauses, followed against the tokens plain decoding yields:
    how many a check would have held, learnt for free. It settles as a check would have, at
    the first miss or when every guess held."""

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

    @property
    def mode(self) -> str:
        return self.options.mode

    def close(self) -> None:
        self.drafter.close()

    def decode(
        self, engine: Engine, step: SequenceStep, output: int, sampling: SamplingParams
    ) -> Iterator[StreamEvent]:
        """The events of one reply from the prefill's logits on: each step drafts the guesses
        the policy asks for (none: a plain step), checks them with the pending token in one
        batch, and yields one event per token the model confirms."""
        stats = self.last_stats = SpecStats(self.mode)
        fixed = self.options.draft_tokens
        k = fixed or DRAFT_TOKENS[self.mode]
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
            pending, cached = event.token, engine.cached_count(seq)
            assert pending is not None
            # Never past max_tokens, and never so far that a full-context check fires early.
            room = min(step.max_tokens - step.generated - 1, engine.n_ctx - cached - 2)
            started = time.perf_counter()  # draft
            guesses = policy.draft(
                self.drafter, [*engine.cached(seq), pending], step.generated, room
            )
            outputs = engine.decode([(seq, token, True) for token in (pending, *guesses)])  # check
            spent, held = time.perf_counter() - started, 0
            for position, index in enumerate(outputs):  # accept
                if chooser is None or not guesses:
                    event = step.sample(index)
                else:
                    guess = guesses[position] if position < len(guesses) else None
                    event = step.event(chooser.choose(engine, index, guess))
                if position == len(guesses) or event.token != guesses[position]:
                    break
                held += 1
                stats.guessed.append(step.generated)
                if event.finish_reason is not None:
                    break
                yield event
            stats.count(len(guesses), held, position + 1, spent)
            # Plain decoding would hold every token but the last sampled one: the rejected
            # guesses' cells go (and, at the finish, the confirmed ones past the last token).
            engine.keep_prefix(seq, cached + position + 1)
            if event.finish_reason is None:
                policy.observe(step.generated, event.token, len(guesses), held)


class GatedPolicy:
    """k guesses a check, gated as llama.cpp gates drafts: after EMPTY_CHECKS checks in a row
    that held no guess, speculation pauses. A free drafter keeps guessing while paused, and a
    would-be check (WouldBeCheck) that would have held RESUME_HELD guesses resumes it; a draft
    model's pause lasts FIRST_PAUSE tokens, then twice that, and so on. Ungated (--draft-tokens
    K) it checks k guesses wherever it can."""

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
        """What a step did: the tokens generated after it, its last token, and how many guesses
        it checked (0: a plain step) and held."""
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
    """Give engine a Speculator for options (mode off: none). A draft engine must already be
    loaded (through the same loader as every model) with the target's context size; a draft of
    another vocabulary is refused, and closed."""
    if engine.speculator is not None:  # one at a time: the old one's draft model goes
        engine.speculator.close()
        engine.speculator = None
    if options.mode == "off":
        if draft is not None:
            draft.close()
        return
    if engine.is_recurrent:
        if draft is not None:
            draft.close()
        why = "off on a recurrent model (its cache cannot drop rejected guesses)"
        raise SpecOptionError("mode", options.mode, why)
    if options.mode == "ngram":
        engine.speculator = Speculator(options, NgramDrafter())
        return
    options.need_draft(draft)
    try:
        check_same_vocabulary(engine, draft, name or draft.location)
    except UsageError:
        draft.close()
        raise
    p_min = P_MIN if options.draft_tokens is None else 0.0  # a fixed k guesses k
    engine.speculator = Speculator(options, DraftModelDrafter(draft, p_min))
