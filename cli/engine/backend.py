"""What run, chat and bench hold: a model that streams replies. The local Engine and a model
behind an OpenAI-compatible server (cli.api.client.RemoteModel) both implement it, so the
commands never ask which one they have."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from cli.engine.events import StreamEvent
from cli.engine.freecores import CoreLoad
from cli.engine.sampling import SamplingParams
from cli.engine.settings import PromptCache


class Backend(Protocol):
    location: str  # the model file, or the server's URL
    # Whether the model runs in this process: its load time, context window, KV cache, threads
    # and sampler defaults are ours to report and manage (a server keeps its own).
    is_local: bool
    load_s: float
    n_ctx: int  # positions one conversation may hold (0 where the server keeps its own window)
    kv_type_k: str | None  # None for a server's model
    kv_type_v: str | None
    kv_cache_bytes: int
    threads: int
    gpu_layers: int
    rpc: tuple[str, ...]  # RPC servers holding the offloaded layers (a server's model: none)
    core_load: CoreLoad | None  # cores others kept busy when the threads were last counted
    prompt_cache: PromptCache | None  # saved states across runs; None: none kept here
    restored_tokens: int  # prompt tokens of the last request loaded from prompt_cache
    restore_s: float

    @property
    def speculation_stats(self) -> Any: ...  # SpecStats of the last reply; None without it

    def keep_prompt_cache(self, always: bool = False) -> None: ...  # where worth keeping

    @property
    def has_chat_template(self) -> bool: ...

    @property
    def cached_tokens(self) -> int: ...  # positions whose KV cells are kept here (server: 0)

    def count_tokens(self, messages: Sequence[tuple[str, str]]) -> int | None: ...  # server: None

    def stream_chat(
        self,
        messages: Sequence[tuple[str, str]],
        max_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str] = (),
    ) -> Iterator[StreamEvent]: ...  # one event per token; the last has finish_reason set

    def stream_text(
        self,
        text: str,
        max_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str] = (),
    ) -> Iterator[StreamEvent]: ...  # a reply to text as it is, without a chat template

    def perf_note(self) -> str: ...  # the backend's own counters of the last request ("": none)

    def clear_cache(self) -> None: ...

    def close(self) -> None: ...
