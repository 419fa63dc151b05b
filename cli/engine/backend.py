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
    # Read-only to the commands (properties: an implementation may compute them).
    @property
    def location(self) -> str: ...  # the model file, or the server's URL

    # What this process does for the model, asked one at a time (a server does these itself).
    @property
    def server_url(self) -> str | None: ...  # the server that runs the model; None: this process

    @property
    def manages_window(self) -> bool: ...  # conversations are fitted to n_ctx here

    @property
    def samples_here(self) -> bool: ...  # every sampling setting is applied here (top_k, min_p)

    @property
    def reports_runtime(self) -> bool: ...  # load time, KV cache, threads are this process's

    @property
    def load_s(self) -> float: ...

    @property
    def n_ctx(self) -> int: ...  # positions one conversation may hold (0: the server's own)

    @property
    def kv_type_k(self) -> str | None: ...  # None for a server's model

    @property
    def kv_type_v(self) -> str | None: ...

    @property
    def kv_cache_bytes(self) -> int: ...

    @property
    def threads(self) -> int: ...

    @property
    def gpu_layers(self) -> int: ...

    @property
    def rpc(self) -> tuple[str, ...]: ...  # RPC servers holding offloaded layers (server: none)

    @property
    def weights_placement(self) -> str: ...  # "Q4_K plain": the path table's choice ("": none)

    @property
    def core_load(self) -> CoreLoad | None: ...  # cores others kept busy at the last count

    @property
    def prompt_cache(self) -> PromptCache | None: ...  # states kept across runs; None: none here

    @property
    def restored_tokens(self) -> int: ...  # prompt tokens of the last request from prompt_cache

    @property
    def restore_s(self) -> float: ...

    def set_threads(self, threads: int | None) -> None: ...  # None: automatic

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
