"""A GBNF grammar in front of a sequence's sampler chain (issue 16's tool_choice forcing).

The grammar sampler must see the candidates before the chain picks one, so it goes first in an
outer chain that holds the sequence's own chain (a chain is a sampler: llama.cpp applies and
accepts through both). Kept apart from sampler_chain so that structured output's grammar path
(issue 17) can replace it without a merge fight.
"""

from __future__ import annotations

import llama_cpp as llama

from cli.errors import UsageError


def with_grammar(chain: object, vocab: object, grammar: str | None) -> object:
    """chain, or an outer chain [grammar, chain] (owning chain) when there is a grammar."""
    if not grammar:
        return chain
    sampler = llama.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    if not sampler:
        llama.llama_sampler_free(chain)
        raise UsageError("the grammar does not parse (llama.cpp refused it)")
    outer = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
    llama.llama_sampler_chain_add(outer, sampler)
    llama.llama_sampler_chain_add(outer, chain)
    return outer
