"""Does a pasted example still say what quill prints, on a CPU unlike the one it was pasted from?

Greedy decoding is not bit-identical across CPUs: AVX2, AVX-512, AMX and NEON kernels sum in
different orders, so logits differ in their last bits, and where the two best tokens are nearly
tied the pick flips and the rest of the text follows another path. A doc example is therefore
checked by teacher forcing: the documented text is fed to the model token by token, after the
same prompt prefilled the same way, and at every step the documented token must be the one this
machine picks, or lose to it by a near-tie:
- greedy: its logit is within NEAR_TIE_LOGITS of the best logit;
- seeded sampling: the seeded sampler's one draw per step fell on the boundary between the two,
  i.e. they are neighbours in the sampler's candidate order (the draw is the same on every CPU;
  only the boundary moves with the logits).
Anywhere else the documented token must be exactly what this machine picks, so an edited example
still fails.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp as llama
import numpy as np

from cli.engine.engine import sampler_chain
from cli.engine.sampling import SamplingParams

from reference import Reference

# Two logits this close (natural-log units; a probability ratio of e^0.5 ~ 1.65) count as tied.
# Measured flips between CPUs were far closer (under 0.1); an edit to a word the model would
# not print loses by several units.
NEAR_TIE_LOGITS = 0.5

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


def forced_mismatch(
    reference: Reference,
    prompt_tokens: Sequence[int],
    documented: Sequence[int],
    sampling: SamplingParams,
) -> str | None:
    """None when every documented token is this machine's pick or a near-tie; else why not."""
    ctx = reference.ctx
    llama.llama_memory_clear(llama.llama_get_memory(ctx), True)
    prompt = (llama.llama_token * len(prompt_tokens))(*prompt_tokens)
    assert llama.llama_decode(ctx, llama.llama_batch_get_one(prompt, len(prompt_tokens))) == 0
    greedy = sampling.temperature <= 0
    chain = sampler_chain(sampling, sampling.seed or 0, prompt_tokens, (), reference.n_vocab)
    try:
        for step, token in enumerate(documented):
            logits = np.ctypeslib.as_array(
                llama.llama_get_logits_ith(ctx, -1), (reference.n_vocab,)
            ).copy()
            if greedy:
                best = int(np.argmax(logits))
                gap = float(logits[best] - logits[token])
                if best != token and gap > NEAR_TIE_LOGITS:
                    return _why(reference, step, token, best, f"{gap:.2f} logits below the best")
            else:
                picked, rank_gap = _sample_with_candidates(chain, logits, token)
                if picked != token and rank_gap != 1:
                    where = "not a candidate" if rank_gap is None else f"{rank_gap} places away"
                    return _why(reference, step, token, picked, f"the sampler's pick; {where}")
            one = (llama.llama_token * 1)(token)
            assert llama.llama_decode(ctx, llama.llama_batch_get_one(one, 1)) == 0
    finally:
        llama.llama_sampler_free(chain)
    return None


def _sample_with_candidates(chain, logits: np.ndarray, documented: int) -> tuple[int, int | None]:
    """(the token the seeded chain picks here, how many places the documented token stands from
    it in the chain's candidate order, None if the chain dropped it). Draws once, as quill does."""
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
    candidates = data[: array.size]["id"]
    picked = int(candidates[array.selected])
    llama.llama_sampler_accept(chain, picked)
    where = np.flatnonzero(candidates == documented)
    return picked, (abs(int(where[0]) - array.selected) if len(where) else None)


def _why(reference: Reference, step: int, documented: int, picked: int, detail: str) -> str:
    shown, chosen = reference.piece(documented), reference.piece(picked)
    return f"token {step}: the docs show {shown!r}, this machine picks {chosen!r} ({detail})"
