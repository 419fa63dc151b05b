"""SamplingParams as llama.cpp's sampler chain. Apart from sampling.py because every command
imports the params at start-up, and building a chain needs llama.cpp loaded."""

from __future__ import annotations

from collections.abc import Sequence

import llama_cpp as llama

from cli.engine.sampling import SamplingParams


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
