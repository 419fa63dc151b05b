"""The near-tie comparator (tests/neartie.py) accepts a reply that took the other side of a real
near-tie on this machine, as another CPU may, and refuses one that took a token this machine
clearly would not: for greedy decoding and for seeded sampling."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import llama_cpp as llama
import numpy as np
import pytest

from cli.engine.samplerchain import sampler_chain
from cli.engine.sampling import SamplingParams

from neartie import (
    NEAR_TIE_LOGITS,
    NEAR_TIE_PROBABILITY,
    _Mt19937,
    apply_chain,
    draw_distance,
    text_mismatch,
    token_mismatch,
)
from reference import Reference

PROMPTS = ["Write a haiku about the sea.", "Explain in one sentence what a KV cache is.",
           "Name three primary colors.", "Tell me a story about a dog."]  # fmt: skip
SEEDED = SamplingParams(temperature=1.0, seed=8)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    decoder = Reference(smollm2_path, n_ctx=512, threads=2)
    yield decoder
    decoder.close()


def prompt_of(reference: Reference, text: str) -> list[int]:
    return reference.tokenize(reference.chat([("user", text)]), add_special=True)


def greedy_with_gaps(reference: Reference, prompt: list[int], steps: int, forced=()):
    """After the prompt and the forced tokens, this machine's greedy tokens and, at each step,
    (second-best token, its logit gap)."""
    reference.prefill(prompt)
    for token in forced:
        reference.step(token)
    tokens, runners_up = [], []
    for _ in range(steps):
        logits = reference.logits()
        second, best = np.argsort(logits)[-2:]
        tokens.append(int(best))
        runners_up.append((int(second), float(logits[best] - logits[second])))
        reference.step(int(best))
    return tokens, runners_up


# A step of seeded sampling: (candidate ids in the chain's order, how far the draw lies from
# where each could stand on another CPU (neartie.draw_distance), the index the chain picked).
Step = tuple[np.ndarray, np.ndarray, int]


def sample_walk(
    reference: Reference,
    prompt: list[int],
    sampling: SamplingParams,
    steps: int,
    choose: Callable[[int, Step], int] = lambda i, s: int(s[0][s[2]]),
) -> tuple[list[int], list[Step]]:
    """Seeded sampling on this machine, where choose(step, what the sampler saw) may take another
    token than the sampler's pick; the draws go on as llama.cpp's would."""
    reference.prefill(prompt)
    chain = sampler_chain(sampling, sampling.seed, prompt, (), reference.n_vocab)
    draws = _Mt19937(sampling.seed)
    tokens, seen = [], []
    try:
        for i in range(steps):
            candidates, selected = apply_chain(chain, reference.logits())
            draw = draws.canonical()
            distance = draw_distance(
                candidates["logit"], candidates["p"], draw, sampling.temperature
            )
            step = (candidates["id"], distance, selected)
            token = choose(i, step)
            tokens.append(token)
            seen.append(step)
            if reference.is_eog(token):
                break
            llama.llama_sampler_accept(chain, token)
            reference.step(token)
    finally:
        llama.llama_sampler_free(chain)
    return tokens, seen


def test_the_other_side_of_a_greedy_near_tie_passes_and_a_clear_loser_fails(reference):
    for text in PROMPTS:
        prompt = prompt_of(reference, text)
        tokens, runners_up = greedy_with_gaps(reference, prompt, 40)
        ties = [i for i, (_, gap) in enumerate(runners_up) if gap < NEAR_TIE_LOGITS / 2]
        clear = [i for i, (_, gap) in enumerate(runners_up) if gap > 3 * NEAR_TIE_LOGITS]
        if ties and clear:
            break
    else:
        pytest.fail("no near-tie in these prompts on this machine")
    assert token_mismatch(reference, prompt, tokens) is None

    # Another CPU took the runner-up at the near-tie and followed its own greedy path after it.
    step = ties[0]
    flipped = [*tokens[:step], runners_up[step][0]]
    other_cpu = flipped + greedy_with_gaps(reference, prompt, 8, forced=flipped)[0]
    assert token_mismatch(reference, prompt, other_cpu) is None

    # A runner-up several logits behind is not a near-tie: that text is not what quill prints.
    step = clear[0]
    wrong = [*tokens[:step], runners_up[step][0], *tokens[step + 1 : step + 4]]
    problem = token_mismatch(reference, prompt, wrong)
    assert problem is not None and f"token {step}:" in problem


def test_the_other_side_of_a_seeded_near_tie_passes_and_a_clear_loser_fails(reference):
    for text in PROMPTS:
        prompt = prompt_of(reference, text)
        tokens, seen = sample_walk(reference, prompt, SEEDED, 40)
        # (step, candidate index) of another candidate the draw nearly fell in, and of one far off
        ties = [(i, j) for i, (_, distance, picked) in enumerate(seen)
                for j in range(len(distance)) if j != picked
                and distance[j] < NEAR_TIE_PROBABILITY / 2]  # fmt: skip
        clear = [(i, j) for i, (_, distance, _) in enumerate(seen)
                 for j in range(len(distance))
                 if distance[j] > 3 * NEAR_TIE_PROBABILITY]  # fmt: skip
        if ties and clear:
            break
    else:
        pytest.fail("no seeded near-tie in these prompts on this machine")
    assert token_mismatch(reference, prompt, tokens, SEEDED) is None

    # Another CPU's boundary moved and the same draw fell in the neighbouring candidate (or one
    # across tiny ones); sampling went on from there with the same draws.
    at, index = ties[0]
    other_cpu, _ = sample_walk(
        reference, prompt, SEEDED, at + 8,
        choose=lambda i, s: int(s[0][index] if i == at else s[0][s[2]]),
    )  # fmt: skip
    assert token_mismatch(reference, prompt, other_cpu, SEEDED) is None

    # A candidate whose interval is far from the draw is not what the seed picks anywhere.
    at, index = clear[0]
    wrong = [*tokens[:at], int(seen[at][0][index])]
    problem = token_mismatch(reference, prompt, wrong, SEEDED)
    assert problem is not None and f"token {at}:" in problem


def test_an_end_of_reply_is_checked_when_the_reply_ended(reference):
    prompt = prompt_of(reference, "Name three primary colors.")
    tokens = reference.greedy(prompt, 200)
    assert reference.is_eog(tokens[-1]), "the reply should end by itself within 200 tokens"
    assert token_mismatch(reference, prompt, tokens) is None
    text = reference.text(tokens)
    # Cut short and said to have ended there: this machine would go on, and says so.
    problem = text_mismatch(reference, prompt, text[: len(text) // 2], ended=True)
    assert problem is not None and "this machine picks" in problem


def test_the_second_prefill_rounds_otherwise_and_only_slightly(smollm2_f16):
    """The comparator's second pass is worth its time only where prefilling one token at a time
    rounds otherwise than one batch: with F16 weights it does (other matrix kernels), by the
    size of difference near-ties excuse, far under an edited word's several units. Where the two
    leave the same cache bit for bit (Q4_1 on some CPUs), the digests say so and the comparator
    follows the text once."""
    reference = Reference(Path(smollm2_f16["output"]), n_ctx=512, threads=2)
    try:
        prompt = prompt_of(reference, PROMPTS[1])
        batch_cache = reference.prefill(prompt)
        batch = reference.logits()
        single_cache = reference.prefill(prompt, one_at_a_time=True)
        single = reference.logits()
    finally:
        reference.close()
    difference = float(np.abs(batch - single).max())
    assert single_cache != batch_cache and 0 < difference < NEAR_TIE_LOGITS / 4, difference
