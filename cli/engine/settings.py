"""What a local model is opened with beside its load options (cli/engine/options.py): the chat
template and reasoning, speculative decoding, the prompt cache and logprobs. Commands fill them
from flags once; cli/engine/opening.py opens a model with them; chat keeps them across /model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cli.engine.templates import ChatTemplate


class PromptCache(Protocol):
    """Where stream_generate finds sequence states that outlive the process (a directory of
    files, or one file beside a chat transcript); cli.store.promptcache implements it."""

    min_tokens: int  # prompts shorter than this are neither looked up nor kept
    exact: bool  # after loading, decode EXACT_BATCH prompt tokens again (the uncached logits)

    def find(self, tokens: Sequence[int]) -> tuple[list[int], bytes] | None:
        """(the tokens a saved state holds, the state) sharing the longest prefix with tokens."""
        ...

    def keep(self, tokens: Sequence[int], state: bytes) -> object: ...

    def refused(self, tokens: Sequence[int]) -> None:
        """llama.cpp would not take the state saved for tokens."""
        ...


@dataclass(frozen=True)
class ModelSettings:
    chat_template: ChatTemplate | None = None  # a template file instead of the model's own
    think: bool | None = None  # the template's enable_thinking switch; None: its default
    think_budget: int | None = None  # reasoning tokens before the block is closed
    # cli/engine/speculative.py's SpecOptions, its draft model's name included (None: off),
    # typed loosely because that module reads the engine's types, and the engine this one's.
    spec: Any = None
    logprobs: int | None = None  # alternatives per generated token; None: none computed
    # Saved states that outlive the process, made for the engine just loaded (the store's key
    # needs its context size and KV types); None: no prompt cache.
    prompt_cache: Callable[[Any], PromptCache] | None = None
