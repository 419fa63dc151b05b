"""SamplingParams as llama.cpp's sampler chain. Apart from sampling.py because every command
imports the params at start-up, and building a chain needs llama.cpp loaded."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp as llama
import numpy as np

from cli.engine.sampling import SamplingParams

# llama_token_data as numpy lays it out: candidate arrays filled without a Python loop.
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert TOKEN_DATA.itemsize == ctypes.sizeof(llama.llama_token_data)


def sampler_chain(
    sampling: SamplingParams,
    seed: int,
    prompt_tokens: Sequence[int],
    banned: Sequence[int],
    n_vocab: int,
):
    chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())

    def add(sampler) -> None:
        llama.llama_sampler_chain_add(chain, sampler)

    biased = [*sampling.logit_bias, *((token, float("-inf")) for token in banned)]
    if biased:
        biases = (llama.llama_logit_bias * len(biased))()
        for slot, (token, bias) in zip(biases, biased, strict=True):
            slot.token, slot.bias = token, bias
        add(llama.llama_sampler_init_logit_bias(n_vocab, len(biased), biases))

    if sampling.penalizes:
        add(penalties_sampler(sampling, n_vocab))
        # The penalty also looks back into the prompt, as llama.cpp's own tools do.
        for token in prompt_tokens[-sampling.repeat_last_n :]:
            llama.llama_sampler_accept(chain, token)
    if sampling.temperature <= 0:
        add(llama.llama_sampler_init_greedy())
        return chain
    if sampling.top_k > 0:
        add(llama.llama_sampler_init_top_k(sampling.top_k))
    if sampling.top_p < 1.0:
        add(llama.llama_sampler_init_top_p(sampling.top_p, 1))
    if sampling.min_p > 0.0:
        add(llama.llama_sampler_init_min_p(sampling.min_p, 1))
    add(llama.llama_sampler_init_temp(sampling.temperature))
    add(llama.llama_sampler_init_dist(seed))
    return chain


def kept_after_mask(sampling: SamplingParams) -> int | None:
    """How many top tokens the chain keeps (greedy: 1); None where it may keep any number or
    penalties reorder the logits (the grammar then masks the whole vocabulary)."""
    if sampling.penalizes or sampling.ignore_eos or sampling.logit_bias:
        return None  # they move logits before the cut: any token may come out on top
    if sampling.temperature <= 0:
        return 1
    return sampling.top_k if sampling.top_k > 0 else None


def penalties_sampler(sampling: SamplingParams, n_vocab: int):  # all three, one sampler
    args = (
        sampling.repeat_last_n,
        sampling.repeat_penalty,
        sampling.frequency_penalty,
        sampling.presence_penalty,
    )
    # The pinned llama-cpp-python's llama.cpp takes the vocabulary size first; later ones do not.
    if len(llama.llama_sampler_init_penalties.argtypes) == 5:
        return llama.llama_sampler_init_penalties(n_vocab, *args)
    return llama.llama_sampler_init_penalties(*args)


class ChainDistribution:
    """The probabilities a sampler chain draws its next token from: every sampler but the last
    (the draw: dist, or greedy) applied to a step's logits, then the softmax of the logits they
    kept (greedy: all on the best one). Those samplers' apply changes none of their state, so
    reading the distribution leaves the chain as it was."""

    def __init__(self, chain: object, n_vocab: int) -> None:
        count = llama.llama_sampler_chain_n(chain)
        samplers = [llama.llama_sampler_chain_get(chain, i) for i in range(count)]
        self.greedy = llama.llama_sampler_name(samplers[-1]) == b"greedy"
        self._shapers = samplers[:-1]
        self._data = np.zeros(n_vocab, dtype=TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)

    def probabilities(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidate tokens, their probabilities): the tokens the chain may draw."""
        data = self._data
        data["id"], data["logit"], data["p"] = self._ids, logits, 0.0
        array = llama.llama_token_data_array(
            data=data.ctypes.data_as(ctypes.POINTER(llama.llama_token_data)),
            size=len(data),
            selected=-1,
            sorted=False,
        )
        for shaper in self._shapers:
            llama.llama_sampler_apply(shaper, ctypes.byref(array))
        kept = np.ctypeslib.as_array(array.data, (array.size,))
        ids, kept_logits = kept["id"].copy(), kept["logit"].astype(np.float64)
        if self.greedy:
            return ids[[int(kept_logits.argmax())]], np.ones(1)
        shifted = np.exp(kept_logits - kept_logits.max())
        return ids, shifted / shifted.sum()
