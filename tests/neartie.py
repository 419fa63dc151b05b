"""The one comparator for generated text that two compute paths produced.

Greedy decoding is not bit-identical across CPUs (AVX2, AVX-512, AMX and NEON kernels sum in
different orders), nor across batch shapes on one CPU (a prefix prefilled in one batch, or one
token at a time while an earlier reply decoded, goes through other kernels). Logits differ in
their last bits; where the two best tokens are nearly tied the pick flips and the rest of the text
follows another path. So no test compares two such texts with ==. Instead the text under test is
teacher-forced: fed to the independent reference decoder (tests/reference.py) after the same
prompt, and at every step the text's next bytes must be what this machine picks, or lose to the
pick only where this machine's logits leave the choice open:

- greedy: the token the text continues with has a logit within NEAR_TIE_LOGITS of the best;
- seeded sampling: the sampler draws one uniform number per token and walks the candidates'
  cumulative probability, in order of their logits, until it passes it. The draw is the same on
  every CPU (the seed fixes it); only the boundaries between candidates move with the logits, and
  the order of candidates whose logits are near-tied. The text's token is accepted when the draw
  lies within NEAR_TIE_PROBABILITY of the interval that token could hold (draw_distance), however
  many tiny candidates sit between it and this machine's pick.

Everywhere else the text must be exactly what this machine picks, so an edited reply, a broken
cache or a wrong batch still fails. The text is followed as quill prints it (token pieces through
an incremental UTF-8 decoder), not re-tokenized: the tokens a reply was generated as need not be
the tokens its text tokenizes to.

Each text is followed twice: after the reference decoder prefilled the prompt in one batch, as
quill does, and after it prefilled one token at a time, whose kernels may round otherwise, as
another CPU's would. A text passes only where both pass, so a test that holds here only because
this CPU rounds as quill's batch does fails here too, not first on another machine. Where the two
prefills leave the same cache bit for bit, the second follow would be the first and is skipped:
on the 2-core AVX-512 machine of these tests, SmolLM2 Q4_1's 41-token chat prompt did (at 1 and 2
threads); its 231-token one did not.

Strictness for a clear view of what the rule excuses: QUILL_TEST_STRICT=1 sets both margins to
zero (the comparator removed: only this machine's own pick passes).
"""

from __future__ import annotations

import codecs
import ctypes
import math
import os
from collections.abc import Sequence

import llama_cpp as llama
import numpy as np

from cli.engine.samplerchain import sampler_chain
from cli.engine.sampling import SamplingParams

from reference import Reference

STRICT = os.environ.get("QUILL_TEST_STRICT") == "1"
# Two logits this close (natural-log units; a probability ratio of e^0.5 ~ 1.65) count as tied.
# Flips measured between CPUs and batch shapes were far closer (under 0.1); an edit to a word the
# model would not print loses by several units.
NEAR_TIE_LOGITS = 0.0 if STRICT else 0.5
# A draw this close (in cumulative probability) to a token's interval could have fallen in it on
# another CPU: a logit moved by 0.1 moves a boundary by at most ~0.025.
NEAR_TIE_PROBABILITY = 0.0 if STRICT else 0.05
GREEDY = SamplingParams(temperature=0)
# Greedy: how many of the best tokens are looked at for one that continues the text.
_SHORTLIST = 64

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


def text_mismatch(
    reference: Reference,
    prompt_tokens: Sequence[int],
    text: str,
    sampling: SamplingParams = GREEDY,
    *,
    ended: bool = False,
) -> str | None:
    """None when this machine, after prompt_tokens, prints text (or a near-tie of it at every
    step where it differs); else which step differs and by how much. ended: the text was
    followed by an end-of-generation token (the reply stopped by itself), which is checked too.
    The text may end inside a token (a stop string cut it there)."""
    first_cache = None
    for one_at_a_time in (False, True):
        cache = reference.prefill(prompt_tokens, one_at_a_time)
        if cache == first_cache:
            return None  # both prefills rounded alike: the second follow would be the first
        first_cache = cache
        problem = _mismatch_after_prefill(reference, prompt_tokens, text, sampling, ended)
        if problem is not None:
            shape = "one token at a time" if one_at_a_time else "in one batch"
            return f"{problem} (the reference prefilled the prompt {shape})"
    return None


def _mismatch_after_prefill(
    reference: Reference,
    prompt_tokens: Sequence[int],
    text: str,
    sampling: SamplingParams,
    ended: bool,
) -> str | None:
    """text_mismatch after one prefill of the prompt."""
    greedy = sampling.temperature <= 0
    chain = sampler_chain(sampling, sampling.seed or 0, prompt_tokens, (), reference.n_vocab)
    draws = _Mt19937(sampling.seed or 0)
    follow = _Follow(reference, text)
    step = 0
    try:
        while not follow.done or ended:
            logits = reference.logits()
            if greedy:
                token, problem = _greedy_step(follow, logits)
            else:
                token, problem = _sampled_step(
                    follow, chain, logits, draws.canonical(), sampling.temperature
                )
            if problem is not None:
                return f"token {step}: {problem}"
            if follow.done:  # the end-of-generation token this machine also picks
                return None
            if not greedy:
                llama.llama_sampler_accept(chain, token)
            follow.take(token)
            step += 1
            reference.step(token)
    finally:
        llama.llama_sampler_free(chain)
    return None


def token_mismatch(
    reference: Reference,
    prompt_tokens: Sequence[int],
    tokens: Sequence[int],
    sampling: SamplingParams = GREEDY,
) -> str | None:
    """text_mismatch for a reply given as tokens (the first end-of-generation token ends it)."""
    ends = [i for i, token in enumerate(tokens) if reference.is_eog(token)]
    visible = tokens[: ends[0]] if ends else tokens
    text = _decoder().decode(b"".join(reference.piece(t) for t in visible), final=True)
    return text_mismatch(reference, prompt_tokens, text, sampling, ended=bool(ends))


def assert_near(
    reference: Reference,
    prompt_tokens: Sequence[int],
    *texts: str | bytes,
    sampling: SamplingParams = GREEDY,
    ended: bool = False,
) -> None:
    """Each text (two paths' replies to one prompt) is what this machine prints, up to
    near-ties: the assertion every cross-path test makes instead of ==."""
    for text in dict.fromkeys(texts):  # each distinct text once
        problem = text_mismatch(reference, prompt_tokens, text, sampling, ended=ended)
        assert problem is None, f"{problem}\nthe text: {text!r}"


def assert_near_tokens(
    reference: Reference,
    prompt_tokens: Sequence[int],
    *replies: Sequence[int],
    sampling: SamplingParams = GREEDY,
) -> None:
    """assert_near for replies given as tokens (an end-of-generation token ends one, and is
    checked as this machine's pick too)."""
    for reply in dict.fromkeys(tuple(r) for r in replies):
        problem = token_mismatch(reference, prompt_tokens, reply, sampling)
        assert problem is None, f"{problem}\nthe tokens: {list(reply)}"


def _decoder() -> codecs.IncrementalDecoder:
    # As quill streams text (cli/engine/textstream.py): bytes that are not UTF-8 become U+FFFD.
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


class _Follow:
    """Where the forced walk stands in the expected text, decoding token pieces as quill does."""

    def __init__(self, reference: Reference, text: str) -> None:
        self.reference = reference
        self.text = text
        self.at = 0  # characters of text printed so far
        self.decoder = _decoder()

    @property
    def done(self) -> bool:
        return self.at >= len(self.text)

    def _printed(self, token: int) -> str | None:
        """What the token would add to the text, or None for a token that prints nothing."""
        piece = self.reference.piece(token)
        if not piece:
            return None
        state = self.decoder.getstate()
        printed = self.decoder.decode(piece)
        self.decoder.setstate(state)
        return printed

    def continues(self, token: int) -> bool:
        """Whether the token goes on printing the text: its output is the text's next
        characters (or bytes of a character still incomplete), or the rest of the text is its
        output's start (the text was cut inside it); at the end, an end-of-generation token."""
        if self.done:
            return self.reference.is_eog(token)
        printed = self._printed(token)
        if printed is None:
            return False
        rest = self.text[self.at :]
        return rest.startswith(printed) or printed.startswith(rest)

    def take(self, token: int) -> None:
        self.at += len(self.decoder.decode(self.reference.piece(token)))

    def why(self, picked: int, detail: str) -> str:
        shown = repr(self.text[self.at : self.at + 24]) if not self.done else "<end of reply>"
        eog = self.reference.is_eog(picked)
        chosen = "<end of reply>" if eog else repr(self.reference.piece(picked))
        return f"the text goes on {shown}, this machine picks {chosen} ({detail})"


def _greedy_step(follow: _Follow, logits: np.ndarray) -> tuple[int, str | None]:
    best = int(np.argmax(logits))
    if follow.continues(best):
        return best, None
    shortlist = np.argpartition(logits, -_SHORTLIST)[-_SHORTLIST:]
    for token in sorted(shortlist.tolist(), key=lambda t: -logits[t]):
        gap = float(logits[best] - logits[token])
        if gap > NEAR_TIE_LOGITS:
            break
        if follow.continues(token):
            return token, None
    detail = f"no token that continues the text within {NEAR_TIE_LOGITS} logits of the best"
    return best, follow.why(best, detail)


def apply_chain(chain: object, logits: np.ndarray) -> tuple[np.ndarray, int]:
    """(the candidates the sampler chain keeps, in its order, with their probabilities; the index
    it picks): one draw of the chain, as quill's token step makes it."""
    data = np.zeros(len(logits), dtype=TOKEN_DATA)
    data["id"] = np.arange(len(logits))
    data["logit"] = logits
    array = llama.llama_token_data_array(
        data=data.ctypes.data_as(ctypes.POINTER(llama.llama_token_data)),
        size=len(logits),
        selected=-1,
        sorted=False,
    )
    llama.llama_sampler_apply(chain, ctypes.byref(array))
    return data[: array.size].copy(), int(array.selected)


def _sampled_step(
    follow: _Follow, chain: object, logits: np.ndarray, draw: float, temperature: float
) -> tuple[int, str | None]:
    """The token the seeded chain would pick with this draw, or the text's token if the draw could
    have fallen in its interval on another CPU (draw_distance)."""
    candidates, selected = apply_chain(chain, logits)
    picked = int(candidates["id"][selected])
    upper = np.cumsum(candidates["p"].astype(np.float64))
    lower = upper - candidates["p"]
    # The replayed draw must fall in the pick's interval (float sums aside), or the replay of
    # llama.cpp's generator is wrong and nothing below means anything.
    slack = 1e-6
    assert lower[selected] - slack <= draw <= upper[selected] + slack, (
        f"the replayed draw {draw:.6f} is not in the pick's interval "
        f"[{lower[selected]:.6f}, {upper[selected]:.6f}]"
    )
    if follow.continues(picked):
        return picked, None
    distance = draw_distance(candidates["logit"], candidates["p"], draw, temperature)
    for index in np.argsort(distance, kind="stable"):
        if distance[index] > NEAR_TIE_PROBABILITY:
            break
        token = int(candidates["id"][index])
        if follow.continues(token):
            return token, None
    detail = (
        f"the draw {draw:.4f} lies more than {NEAR_TIE_PROBABILITY} from where any candidate "
        "that continues the text could stand"
    )
    return picked, follow.why(picked, detail)


def draw_distance(
    scaled_logits: np.ndarray, probabilities: np.ndarray, draw: float, temperature: float
) -> np.ndarray:
    """For each candidate, how far the draw lies (in cumulative probability) from the interval
    the candidate could hold on another CPU. Candidates stand in order of their logits, so the
    interval moves in two ways: its boundaries shift a little with the probabilities, and a
    candidate whose logit is within NEAR_TIE_LOGITS of others may stand before or after them
    (the draw then lands on whichever of a near-tied pair comes first). So a candidate's
    interval can start as early as the mass of the candidates clearly above it and end as late
    as that plus the mass of its near-ties and its own."""
    tolerance = NEAR_TIE_LOGITS / temperature  # the chain's logits are divided by temperature
    p = probabilities.astype(np.float64)
    clearly_above = scaled_logits[None, :] > scaled_logits[:, None] + tolerance
    near = np.abs(scaled_logits[None, :] - scaled_logits[:, None]) <= tolerance
    earliest = (clearly_above * p[None, :]).sum(axis=1)
    latest = earliest + (near * p[None, :]).sum(axis=1)  # near includes the candidate itself
    return np.maximum(np.maximum(earliest - draw, draw - latest), 0.0)


class _Mt19937:
    """std::mt19937 with std::uniform_real_distribution<double>, as llama.cpp's dist sampler
    draws (libstdc++: generate_canonical<double, 53> takes two 32-bit outputs). Seeded the
    same, it gives the same draws on every CPU, which is what makes the seeded rule exact."""

    def __init__(self, seed: int) -> None:
        state = [seed & 0xFFFFFFFF]
        for i in range(1, 624):
            previous = state[-1]
            state.append((1812433253 * (previous ^ (previous >> 30)) + i) & 0xFFFFFFFF)
        self._state = state
        self._index = 624

    def _next(self) -> int:
        if self._index >= 624:
            state = self._state
            for i in range(624):
                y = (state[i] & 0x80000000) | (state[(i + 1) % 624] & 0x7FFFFFFF)
                state[i] = state[(i + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self._index = 0
        y = self._state[self._index]
        self._index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)

    def canonical(self) -> float:
        low, high = self._next(), self._next()
        value = (low + high * 2.0**32) / 2.0**64
        return value if value < 1.0 else math.nextafter(1.0, 0.0)


def uses_the_comparator(function: object, depth: int = 4) -> bool:
    """Whether a test (or fixture, or helper) reaches this module's functions or the reference
    decoder, directly or through the helpers it calls: a cross-path test. conftest marks such
    tests `crosspath` (`pytest -m crosspath` runs them alone)."""
    code = getattr(function, "__code__", None)
    if code is None or depth == 0:
        return False
    namespace = getattr(function, "__globals__", {})
    codes = [code]
    while codes:
        current = codes.pop()
        codes += [const for const in current.co_consts if hasattr(const, "co_names")]
        if {"neartie", "Reference"} & set(current.co_names):  # imported where it is used
            return True
        for name in current.co_names:
            target = namespace.get(name)
            if target is Reference or getattr(target, "__module__", None) == __name__:
                return True
            local = getattr(target, "__module__", None) == function.__module__
            if local and target is not function and uses_the_comparator(target, depth - 1):
                return True
    return False
