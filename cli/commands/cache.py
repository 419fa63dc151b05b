"""Prompt caches across runs: the options run takes, the glue that gives a local engine its
cache directory, and `quill cache` (list / clear)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cli.errors import UsageError

if TYPE_CHECKING:
    from cli.engine.backend import Backend
    from cli.engine.engine import Engine
    from cli.engine.settings import ModelSettings

DEFAULT_CACHE_MAX = "2GiB"

NoCache = Annotated[
    bool,
    typer.Option(
        "--no-cache",
        help="Neither load nor keep a prompt cache (prompts of 512+ tokens are cached by "
        "default under QUILL_HOME/cache/prompts).",
    ),
]
CacheMax = Annotated[
    str,
    typer.Option(
        "--cache-max",
        help="Most disk the prompt caches may take (e.g. 500MiB, 2GiB); the least recently "
        "used go first.",
    ),
]


def cache_key(engine: Engine) -> dict:
    """What makes a saved state valid for this engine: the model file's sha256, the context
    size, the KV types and the llama.cpp build."""
    from cli.store.models import quill_home
    from cli.store.promptcache import cache_dir, model_sha256

    return {
        "model_sha256": model_sha256(engine.path, cache_dir(quill_home())),
        "n_ctx": engine.n_ctx,
        "kv_type_k": engine.kv_type_k,
        "kv_type_v": engine.kv_type_v,
        "llama": engine.llama_version,
    }


def prompt_cache_settings(settings: ModelSettings, max_bytes: int | None) -> ModelSettings:
    """settings with the prompt cache under QUILL_HOME/cache/prompts (None: no cache)."""
    if max_bytes is None:
        return settings
    from cli.store.models import quill_home
    from cli.store.promptcache import PromptCacheStore, cache_dir

    def store(engine: Engine) -> PromptCacheStore:
        return PromptCacheStore(cache_dir(quill_home()), lambda: cache_key(engine), max_bytes)

    return dataclasses.replace(settings, prompt_cache=store)


def finish_prompt_cache(backend: Backend, show: bool, keep: bool = True) -> None:
    """Keep the state of a long prompt just prefilled; say what the cache saved this run; one
    warning line for each file that was refused or could not be written."""
    from cli.ui import render

    store = backend.prompt_cache
    if store is None:
        return
    if keep:
        backend.keep_prompt_cache()
    if show and backend.restored_tokens:
        render.info_line(
            f"prompt cache: {backend.restored_tokens} tokens from cache in "
            f"{backend.restore_s * 1000:.0f} ms"
        )
    for warning in dict.fromkeys(store.warnings):
        render.warning_line(warning)


def cache(
    action: Annotated[
        str, typer.Argument(help="list: the cached prompts; clear: remove them all.")
    ] = "list",
) -> None:
    """The prompt caches quill keeps under QUILL_HOME/cache/prompts: list or clear them."""
    import time

    from cli.store.models import quill_home
    from cli.store.promptcache import CacheEntry, cache_dir, clear, list_entries
    from cli.ui import render
    from cli.units import human_bytes

    folder = cache_dir(quill_home())
    if action == "clear":
        cleared = clear(folder)
        removed = f"removed {cleared.count} prompt caches, {human_bytes(cleared.bytes)}"
        if cleared.failed:
            path, why = cleared.failed[0]
            raise UsageError(
                f"{removed}, but could not remove {len(cleared.failed)} in {folder} "
                f"({path.name}: {why}): check the directory's permissions"
            )
        render.info_line(f"{removed}, from {folder}")
        return
    if action != "list":
        shown = repr(action) if len(action) <= 40 else repr(action[:37] + "...")
        raise UsageError(f"quill cache takes list or clear, not {shown}")
    entries = list_entries(folder)
    if not entries:
        render.info_line(f"no prompt caches in {folder}")
        return
    lines = [f"{'file':<35} {'tokens':>7} {'size':>10}  {'ctx':>6}  {'KV':<10} last used"]
    total = 0
    for entry in entries:
        if not isinstance(entry, CacheEntry):
            path, why = entry
            lines.append(f"{path.name:<35} unreadable: {why}")
            continue
        total += entry.size
        key = entry.key
        kv = f"{key.get('kv_type_k')}/{key.get('kv_type_v')}"
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.used))
        lines.append(
            f"{entry.path.name:<35} {len(entry.tokens):>7} {human_bytes(entry.size):>10}  "
            f"{key.get('n_ctx', '?'):>6}  {kv:<10} {used}"
        )
    lines.append(f"{len(entries)} files, {human_bytes(total)} in {folder}")
    render.write_stdout("\n".join(lines) + "\n")


# --- chat: the KV state beside the transcript ------------------------------------------------

CHAT_CACHE_MIN_TOKENS = 64  # shorter conversations prefill faster than a file loads


def resolve_resume(value: str) -> Path:
    """The transcript --resume names: last, an ID from QUILL_HOME/chats, or a path."""
    from cli.store.chats import find_transcript
    from cli.store.models import quill_home

    return find_transcript(value, quill_home() / "chats")


def chat_cache_folder(transcript: Path) -> Path:
    return transcript.with_name(transcript.stem + ".kvcache")


def chat_cache_settings(settings: ModelSettings, transcript: Path) -> ModelSettings:
    """settings with the KV state saved beside the transcript: one file, loaded by the first
    turn of a resumed chat, rewritten when the chat ends."""
    from cli.store.promptcache import PromptCacheStore

    def store(engine: Engine) -> PromptCacheStore:
        return PromptCacheStore(
            chat_cache_folder(transcript),
            lambda: cache_key(engine),
            min_tokens=CHAT_CACHE_MIN_TOKENS,
            max_files=1,
            exact=False,  # a resumed chat goes on as the process that kept its cells would have
        )

    return dataclasses.replace(settings, prompt_cache=store)


class ChatCacheReport:
    """Says once, after the first turn of a resumed chat, what the saved KV state gave."""

    def __init__(self, backend: Backend, resumed: bool) -> None:
        from cli.store.promptcache import files

        store = backend.prompt_cache
        self.backend = backend
        self.store = store
        self.had_state = store is not None and bool(files(store.folder))
        self.pending = resumed and store is not None
        self.turns = 0

    def after_turn(self) -> None:
        from cli.ui import render

        self.turns += 1
        if not self.pending or self.store is None:
            return
        self.pending = False
        for warning in dict.fromkeys(self.store.warnings):
            render.warning_line(warning)
        self.store.warnings.clear()
        restored = self.backend.restored_tokens
        if restored:
            render.info_line(
                f"resumed: {restored} tokens of KV cache loaded in "
                f"{self.backend.restore_s * 1000:.0f} ms"
            )
        elif self.had_state:
            render.info_line(
                "the saved KV cache does not fit this chat (another model, context size, KV "
                "type or llama.cpp build, or an edited transcript): the conversation was "
                "prefilled again"
            )

    def finish(self, backend: Backend) -> None:
        """Save the conversation's KV state beside the transcript, if this process added to
        it with the engine the state was attached to."""
        from cli.ui import render

        if self.store is None or backend is not self.backend or not self.turns:
            return
        backend.keep_prompt_cache(always=True)
        for warning in dict.fromkeys(self.store.warnings):
            render.warning_line(warning)
