"""The near-tie rule (tests/neartie.py) accepts a reply that took the other side of a real near-tie,
as another CPU may, and refuses one that took a token this machine clearly would not."""

from __future__ import annotations

import llama_cpp as llama
import numpy as np
import pytest

from cli.engine.sampling import SamplingParams

from neartie import NEAR_TIE_LOGITS, forced_mismatch
from reference import Reference

GREEDY = SamplingParams(temperature=0)
PROMPTS = ["Write a haiku about the sea.", "Explain in one sentence what a KV cache is.",
           "Name three primary colors.", "Tell me a story about a dog."]  # fmt: skip


@pytest.fixture(scope="module")
def reference(smollm2_path):
    decoder = Reference(smollm2_path, n_ctx=512, threads=2)
    yield decoder
    decoder.close()


def greedy_with_gaps(reference: Reference, prompt: list[int], steps: int, forced=()):
    """After the prompt (one batch) and the forced tokens (one at a time, as generation decodes
    them), this machine's greedy tokens and, at each step, (second-best token, its logit gap)."""
    llama.llama_memory_clear(llama.llama_get_memory(reference.ctx), True)
    array = (llama.llama_token * len(prompt))(*prompt)
    assert llama.llama_decode(reference.ctx, llama.llama_batch_get_one(array, len(prompt))) == 0
    for token in forced:
        one = (llama.llama_token * 1)(token)
        assert llama.llama_decode(reference.ctx, llama.llama_batch_get_one(one, 1)) == 0
    tokens, runners_up = [], []
    for _ in range(steps):
        logits = np.ctypeslib.as_array(
            llama.llama_get_logits_ith(reference.ctx, -1), (reference.n_vocab,)
        )
        second, best = np.argsort(logits)[-2:]
        tokens.append(int(best))
        runners_up.append((int(second), float(logits[best] - logits[second])))
        one = (llama.llama_token * 1)(int(best))
        assert llama.llama_decode(reference.ctx, llama.llama_batch_get_one(one, 1)) == 0
    return tokens, runners_up


def test_the_other_side_of_a_near_tie_passes_and_a_clear_loser_fails(reference):
    for text in PROMPTS:
        prompt = reference.tokenize(reference.chat([("user", text)]), add_special=True)
        tokens, runners_up = greedy_with_gaps(reference, prompt, 40)
        ties = [i for i, (_, gap) in enumerate(runners_up) if gap < NEAR_TIE_LOGITS / 2]
        clear = [i for i, (_, gap) in enumerate(runners_up) if gap > 3 * NEAR_TIE_LOGITS]
        if ties and clear:
            break
    else:
        pytest.skip("no near-tie in these prompts on this machine")
    assert forced_mismatch(reference, prompt, tokens, GREEDY) is None

    # Another CPU took the runner-up at the near-tie and followed its own greedy path after it.
    step = ties[0]
    flipped = [*tokens[:step], runners_up[step][0]]
    other_cpu = flipped + greedy_with_gaps(reference, prompt, 8, forced=flipped)[0]
    assert forced_mismatch(reference, prompt, other_cpu, GREEDY) is None

    # A runner-up several logits behind is not a near-tie: that text is not what quill prints.
    step = clear[0]
    wrong = [*tokens[:step], runners_up[step][0], *tokens[step + 1 : step + 4]]
    problem = forced_mismatch(reference, prompt, wrong, GREEDY)
    assert problem is not None and f"token {step}:" in problem
