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

Adaptive by default: k is the number of guesses that yields most tokens per second, from what
this reply measured (a plain step's cost, a checking batch's cost at each size it tried, how
often a first guess held and how often a run of held guesses went on), and grows while every
guess holds (which is also how larger batches get measured: on a CPU their cost rises far
slower than their size where the weights' memory traffic dominates, F16 say, and nearly in
step with it where dequantizing does, Q4_1).
When no k beats a plain step, speculation pauses, and resumes when the reply changes, as it
does: a rewrite's preamble guesses badly and its copied body well. Prompt lookup guesses for
free, so while paused it keeps guessing and follows each would-be check against the tokens
plain decoding yields (WouldBeCheck): speculation resumes when what those checks would have
held makes some k beat a plain step again, and no check is paid for on the way. (Under
sampling a guess matches the sampled token with the chain's probability of it, which is
exactly the chance a check would accept it.) A draft model's guesses cost decodes, so with
one the pause lasts 32 tokens, then 64, and so on. --draft-tokens K fixes k and keeps
speculation on (for benchmarks).
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import llama_cpp as llama
import numpy as np

from cli.engine.events import StreamEvent
from cli.engine.sampling import SamplingParams
from cli.errors import UsageError

if TYPE_CHECKING:
    from cli.engine.engine import Engine, SequenceStep

SPEC_MODES = ("off", "ngram", "draft")
NGRAM_LONGEST = 4  # n-grams looked up, longest first: a longer match predicts better
NGRAM_SHORTEST = 2  # single tokens match everywhere and mostly predict wrong
START_TOKENS = {"ngram": 2, "draft": 2}  # k at the start of a reply
MOST_TOKENS = {"ngram": 16, "draft": 8}  # a draft model's guesses cost a decode each
PLAIN_PROBES = 2  # plain steps at the start of a reply: the cost speculation must beat
JUDGE_AFTER_STEPS = 6  # verification steps before the off-switch may judge
JUDGE_AGAIN_STEPS = 8  # after a pause: checks restart from one guess, where little can pay
FIRST_PAUSE = 32  # a draft model's pause when speculation measures slower; doubles each time
WATCH_BEFORE_RESUME = 3  # would-be checks that judge whether to resume, the latest ones
RECENT_WEIGHT = 0.25  # how much the latest step moves the running cost of drafting a guess
COST_SAMPLES = 5  # a step's cost is the least of its latest samples, per batch size
NOTHING_HELD_CHECKS = 3  # checks in a row that held no guess: enough to pause early
RECENT_CHECKS = 16  # the verification steps whose held guesses predict the next ones
VOCAB_SIZE_SLACK = 128  # padded vocabularies of one family differ at the end (llama.cpp's rule)


@dataclass(frozen=True)
class SpecOptions:
    mode: str = "off"  # off, ngram or draft
    draft_tokens: int | None = None  # None: adaptive (and the off-switch); K: always K

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES:
            raise UsageError(f"--spec takes {', '.join(SPEC_MODES)}, not {self.mode!r}")
        if self.draft_tokens is not None and self.draft_tokens < 1:
            raise UsageError(f"--draft-tokens must be at least 1, not {self.draft_tokens}")


@dataclass
class SpecStats:
    """What speculation did in one reply."""

    mode: str
    drafted: int = 0  # tokens guessed and verified
    accepted: int = 0  # guesses the model agreed with
    verify_steps: int = 0  # batched passes that checked guesses
    plain_steps: int = 0  # one-token passes (probes, nothing to guess, or switched off)
    spec_tokens: int = 0  # tokens that verification passes yielded
    spec_s: float = 0.0  # time of drafting and verification passes
    plain_s: float = 0.0  # time of one-token passes
    first_paused_at: int | None = None  # tokens generated when it first paused itself
    pauses: int = 0  # times it measured slower than plain steps and paused
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
    """A small model with the target's vocabulary drafts greedily in its own context; its KV
    cache keeps the common prefix with the target's history from one step to the next."""

    free = False

    def __init__(self, draft: Engine) -> None:
        self.engine = draft
        self._greedy = llama.llama_sampler_init_greedy()

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
        for i in range(k):
            token = draft.sample(self._greedy, output)
            guesses.append(token)
            if i == k - 1 or draft.is_end_of_generation(token):
                break
            output = draft.decode([(0, token, True)])[0]
        return guesses

    def close(self) -> None:
        if self._greedy is not None:
            llama.llama_sampler_free(self._greedy)
            self._greedy = None
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


class Policy(Protocol):
    """When to check how many guesses, for one reply: asked before each step, told after it."""

    def draft(self, drafter: Drafter, history: list[int], generated: int, room: int) -> list[int]:
        """The guesses to check now (none: a plain step); never more than room."""
        ...

    def observe(
        self, generated: int, token: int, guesses: int, held: int, draft_s: float, check_s: float
    ) -> None:
        """What a step did: the tokens generated after it and its last token, how many guesses
        it checked (0: a plain step) and held, and what drafting and checking cost."""
        ...


class Speculator:
    """Held by an Engine: drafts and verifies the decode loop of stream_generate."""

    def __init__(self, options: SpecOptions, drafter: Drafter) -> None:
        self.options = options
        self.drafter = drafter
        self.last_stats: SpecStats | None = None
        # What policies time steps by; benchmarks/speculative_bound.py replays a reply on a
        # clock that charges each batch its measured median cost, free of noise.
        self.clock: Callable[[], float] = time.perf_counter
        self.new_policy: Callable[[SpecStats], Policy] = self._default_policy

    def _default_policy(self, stats: SpecStats) -> Policy:
        if self.options.draft_tokens is not None:
            return GatedPolicy(stats, self.options.draft_tokens, self.drafter.free, gated=False)
        return AdaptivePolicy(stats, self.mode, self.drafter.free)

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
        policy = self.new_policy(stats)
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
            started = self.clock()  # draft
            guesses = policy.draft(
                self.drafter, [*engine.cached(seq), pending], step.generated, room
            )
            drafted_at = self.clock()  # check
            outputs = engine.decode([(seq, token, True) for token in (pending, *guesses)])
            checked_at = self.clock()
            spent, held = checked_at - started, 0
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
                draft_s, check_s = drafted_at - started, checked_at - drafted_at
                policy.observe(step.generated, event.token, len(guesses), held, draft_s, check_s)


class GatedPolicy:
    """A fixed number of guesses, gated as llama.cpp gates its drafts: a check needs at least
    `least` guesses (a draft model stops guessing below its probability floor), and after
    `empty_limit` checks in a row that held nothing speculation pauses. A free drafter keeps
    guessing while paused, and a would-be check (WouldBeCheck) that would have held
    `resume_held` guesses resumes it; a draft model's pause lasts `pause` tokens, doubling."""

    def __init__(
        self,
        stats: SpecStats,
        k: int,
        free: bool,
        gated: bool = True,
        least: int = 1,
        empty_limit: int = 3,
        resume_held: int = 2,
        pause: int = 32,
    ) -> None:
        self.stats, self.k, self.free, self.gated = stats, k, free, gated
        self.least, self.empty_limit, self.resume_held, self.pause = (
            least,
            empty_limit,
            resume_held,
            pause,
        )
        self.empty = 0  # checks in a row that held nothing
        self.resume_at: int | None = None  # paused: a draft model resumes at this count
        self.would_be: WouldBeCheck | None = None

    def draft(self, drafter: Drafter, history: list[int], generated: int, room: int) -> list[int]:
        if self.resume_at is not None:
            if not self.free and generated >= self.resume_at:
                self.resume_at = None
            else:
                if self.free and self.would_be is None:
                    guessed = drafter.propose(history, self.k)
                    self.would_be = WouldBeCheck(generated, guessed) if guessed else None
                return []
        guesses = drafter.propose(history, min(self.k, room)) if room > 0 else []
        return guesses if len(guesses) >= self.least else []

    def observe(
        self, generated: int, token: int, guesses: int, held: int, draft_s: float, check_s: float
    ) -> None:
        if self.would_be is not None:
            settled = self.would_be.settle(generated, token)
            if settled is not None:
                self.would_be, self.stats.watched = None, self.stats.watched + 1
                if settled >= min(self.resume_held, self.k):
                    self.resume_at = None
            return
        if not guesses or not self.gated:
            return
        self.empty = 0 if held else self.empty + 1
        if self.empty >= self.empty_limit:
            self.empty, self.resume_at = 0, generated + self.pause
            self.pause *= 2
            self.stats.pauses += 1
            if self.stats.first_paused_at is None:
                self.stats.first_paused_at = generated


class AdaptivePolicy:
    """k from measured costs and held guesses (CostModel), paused when no k beats a plain step;
    a free drafter's would-be checks resume it, a draft model's pause is timed."""

    def __init__(self, stats: SpecStats, mode: str, free: bool) -> None:
        self.stats = stats
        self.k, self.most = START_TOKENS[mode], MOST_TOKENS[mode]
        self.costs = CostModel()
        self.speculating = True
        self.resume_at, self.pause, self.judge_after, self.judged = (
            0,
            FIRST_PAUSE,
            JUDGE_AFTER_STEPS,
            0,
        )
        self.watching = free
        self.would_be: WouldBeCheck | None = None
        self.watched = 0

    def draft(self, drafter: Drafter, history: list[int], generated: int, room: int) -> list[int]:
        if not self.speculating and self.watching and self.would_be is None:
            guessed = drafter.propose(history, self.most)
            self.would_be = WouldBeCheck(generated, guessed) if guessed else None
        if not self.speculating and not self.watching and generated >= self.resume_at:
            self.speculating, self.k, self.judge_after, self.judged = True, 1, JUDGE_AGAIN_STEPS, 0
            self.costs.forget_guesses()
        room = min(room, self.k)
        probing = self.stats.plain_steps < PLAIN_PROBES
        if self.speculating and not probing and room > 0:
            return drafter.propose(history, room)
        return []

    def observe(
        self, generated: int, token: int, guesses: int, held: int, draft_s: float, check_s: float
    ) -> None:
        costs, stats = self.costs, self.stats
        if guesses:
            costs.observe_verify(guesses, held, draft_s, check_s)
        else:
            costs.observe_plain(draft_s + check_s)
        if self.would_be is not None:
            settled = self.would_be.settle(generated, token)
            if settled is not None:
                costs.observe_would_be(len(self.would_be.guesses), settled)
                self.would_be, self.watched, stats.watched = (
                    None,
                    self.watched + 1,
                    stats.watched + 1,
                )
                best = costs.best_k(self.most)
                if best and self.watched >= WATCH_BEFORE_RESUME:
                    self.speculating, self.k, self.judge_after, self.judged = (
                        True,
                        best,
                        JUDGE_AGAIN_STEPS,
                        0,
                    )
                    costs.keep_checks(RECENT_CHECKS)
        if not guesses:
            return
        self.judged += 1
        best = costs.best_k(self.most)
        all_held = held == guesses and guesses >= self.k
        if best is None:
            self.k = _next_k(self.k, guesses, held, self.most)
        elif best > 0:
            self.k = max(best, min(2 * self.k, self.most)) if all_held else best
        elif self.judged >= self.judge_after or costs.nothing_held(NOTHING_HELD_CHECKS):
            self.speculating, self.resume_at = False, generated + self.pause
            self.pause *= 2
            stats.pauses += 1
            if self.watching:
                costs.forget_guesses()
                costs.keep_checks(WATCH_BEFORE_RESUME)
                self.watched = 0
            if stats.first_paused_at is None:
                stats.first_paused_at = generated
        else:
            self.k = 1


def _next_k(k: int, drafted: int, confirmed: int, most: int) -> int:
    """Grow k while every guess holds; halve it when most fail."""
    if confirmed == drafted and drafted >= k:
        return min(k * 2, most)
    if confirmed * 2 < drafted:
        return max(k // 2, 1)
    return k


@dataclass
class CostModel:
    """What steps cost and how many guesses hold, measured in this reply. The best k yields
    most tokens per second: a step of k guesses yields the model's own token plus the guesses
    that held before the first miss, and costs a checking batch of k + 1 positions plus k times
    drafting one guess; 0 when no k beats a plain step.

    How many guesses hold is read from the recent checks as two chances, the first guess's and
    a run's going on (hold_chances), not as one average chance per guess: guesses hold in runs
    (a copied passage holds all of them, a paraphrase none), and one average would undervalue
    every k larger than 1.

    A batch's cost is measured per size, because it is not linear: on a CPU it grows slowly
    while the weights' memory traffic dominates and in step with the size once computing does.
    A size not tried yet is estimated from the sizes that were. A cost is the least of the
    latest few samples of its size: a machine busy with other work only ever adds time to a
    step, and one slow sample read as the cost can keep speculation paused through a copy.
    (Replayed with injected stalls, the least of five against a running mean: 1.06-1.09x ->
    1.09-1.11x on the grounded tasks; benchmarks/README.md.)"""

    plain: float | None = None  # seconds of a one-token step
    batch: dict[int, float] = field(default_factory=dict)  # seconds of a checking batch, by size
    per_guess: float | None = None  # seconds of drafting one guess (next to 0 for prompt lookup)
    checks: deque[tuple[int, int]] = field(
        default_factory=lambda: deque(maxlen=RECENT_CHECKS)
    )  # (guesses, held) of recent verification steps
    samples: dict[int, deque[float]] = field(default_factory=dict)  # latest seconds, by size

    def _least_recent(self, size: int, seconds: float) -> float:
        latest = self.samples.setdefault(size, deque(maxlen=COST_SAMPLES))
        latest.append(seconds)
        return min(latest)

    def observe_plain(self, seconds: float) -> None:
        self.plain = self._least_recent(1, seconds)

    def observe_verify(self, guesses: int, held: int, draft_s: float, verify_s: float) -> None:
        self.batch[guesses + 1] = self._least_recent(guesses + 1, verify_s)
        self.per_guess = _recent(self.per_guess, draft_s / guesses)
        self.checks.append((guesses, held))

    def observe_would_be(self, guesses: int, held: int) -> None:
        """What a check that was not made would have held (WouldBeCheck)."""
        self.checks.append((guesses, held))

    def nothing_held(self, checks: int) -> bool:
        """Whether the last `checks` checks all held no guess."""
        recent = list(self.checks)[-checks:]
        return len(recent) == checks and not any(held for _, held in recent)

    def forget_guesses(self) -> None:
        self.checks.clear()

    def keep_checks(self, latest: int) -> None:
        """Judge guesses by the latest checks only: while paused, the last few would-be checks
        (a reply that turns to copying shows it in a few, and a long record of misses before
        it would hide that); speculating, the usual record."""
        self.checks = deque(self.checks, maxlen=latest)

    def hold_chances(self) -> tuple[float, float]:
        """The chance that a check's first guess holds, and that a guess holds once the ones
        before it did, from the recent checks. Two figures because guesses hold in runs: a
        copied passage holds the guess after a held one far more often than the first guess
        of a check. Counted where they were tried (a check of k guesses says nothing about
        guess k + 1), and smoothed by one held and one missed guess so that a run of a few
        checks that all held does not read as certainty."""
        first_tried = first_held = after_tried = after_held = 0
        for guesses, held in self.checks:
            first_tried += 1
            first_held += held > 0
            # Guesses 2.. were judged while every guess before them held: up to the first miss.
            judged = min(held + 1, guesses) - 1 if held else 0
            after_tried += judged
            after_held += max(held - 1, 0)
        first = (first_held + 1) / (first_tried + 2)
        after = (after_held + 1) / (after_tried + 2) if after_tried else first
        return first, after

    def expected_held(self, k: int) -> float:
        """Guesses expected to hold in a check of k: the first with its chance, each later one
        with the chance of a run going on."""
        first, after = self.hold_chances()
        return first * sum(after**n for n in range(k))

    def batch_cost(self, size: int) -> float:
        """Seconds of a checking batch of size positions: measured, else estimated: linearly
        between the sizes measured around it, and beyond the largest along the line through
        the two largest (a batch's cost grows by a fairly steady amount per position on a
        CPU). An estimate that errs low is soon corrected: the size is then tried and measured."""
        assert self.plain is not None
        known = {1: self.plain, **self.batch}
        if size in known:
            return known[size]
        below = max(n for n in known if n < size)
        above = [n for n in known if n > size]
        if above:
            upper = min(above)
            share = (size - below) / (upper - below)
            return known[below] + share * (known[upper] - known[below])
        if below == 1:  # no batch measured yet: as if each position cost a plain step
            return known[1] * size
        before = max(n for n in known if n < below)
        per_position = max((known[below] - known[before]) / (below - before), 0.0)
        return known[below] + (size - below) * per_position

    def best_k(self, most: int) -> int | None:
        """The k with most tokens per second (0: a plain step); None until measured."""
        if self.plain is None or not self.batch or self.per_guess is None or not self.checks:
            return None
        best, best_rate = 0, 1.0 / self.plain
        for k in range(1, most + 1):
            rate = (1 + self.expected_held(k)) / (self.batch_cost(k + 1) + k * self.per_guess)
            if rate > best_rate:
                best, best_rate = k, rate
        return best


def _recent(running: float | None, latest: float) -> float:
    return latest if running is None else running + RECENT_WEIGHT * (latest - running)


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
        raise UsageError(
            "speculative decoding needs a model whose rejected guesses can be removed from its "
            "cache; this one is recurrent: use --spec off"
        )
    if options.mode == "ngram":
        engine.speculator = Speculator(options, NgramDrafter())
        return
    if draft is None:
        raise UsageError("--spec draft needs --draft NAME (a small model of the same family)")
    try:
        check_same_vocabulary(engine, draft, name or draft.location)
    except UsageError:
        draft.close()
        raise
    engine.speculator = Speculator(options, DraftModelDrafter(draft))
