"""What a local model is opened with beside its load options (cli/engine/options.py): filled
from flags once by the commands, kept by chat across /model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cli.engine.templates import ChatTemplate


class PromptCache(Protocol):
    """Sequence states that outlive the process (cli.store.promptcache)."""

    min_tokens: int  # prompts shorter than this are neither looked up nor kept
    keep_after_prefill: int  # a request that prefilled this many tokens is kept when it ends
    exact: bool  # after loading, decode EXACT_BATCH prompt tokens again (the uncached logits)
    folder: Path  # where its files are
    warnings: list[str]  # files refused or not written, one line each, for the command to say

    # (the tokens a saved state holds, the state) sharing the longest prefix with tokens, among
    # those of at most capacity tokens
    def find(
        self, tokens: Sequence[int], capacity: int | None = None, least: int | None = None
    ) -> tuple[list[int], bytes] | None: ...

    def keep(self, tokens: Sequence[int], state: bytes | bytearray) -> object: ...

    def refused(self, tokens: Sequence[int]) -> None: ...  # llama.cpp would not take its state

    def saved(self) -> bool: ...  # a chat's: the state it kept last is still there

    # llama-server's slot save and restore, by name: the bytes written (0: not kept); (the
    # tokens named, those of the entry holding them, its state), None where there is none
    def keep_named(self, name: str, tokens: Sequence[int], state: bytes | bytearray) -> int: ...

    def find_named(self, name: str, capacity: int) -> tuple[list[int], list[int], bytes] | None: ...


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
