"""Prompt caches across runs: the options run takes, what run and chat say about the cache,
and `quill cache` (list / clear). The caches and their rules are the store's
(cli/store/promptcache.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from cli.errors import UsageError

if TYPE_CHECKING:
    from cli.engine.backend import Backend
    from cli.engine.settings import PromptCache

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


def _say_warnings(store: PromptCache) -> None:
    """One warning line for each cache file refused or not written, once."""
    from cli.ui import render

    for warning in dict.fromkeys(store.warnings):
        render.warning_line(warning)
    store.warnings.clear()


def finish_prompt_cache(backend: Backend, show: bool, keep: bool = True) -> None:
    """Keep the state of a long prompt just prefilled, and say what the cache saved this run."""
    from cli.ui import render

    if backend.prompt_cache is None:
        return
    if keep:
        backend.keep_prompt_cache()
    if show and backend.restored_tokens:
        render.info_line(
            f"prompt cache: {backend.restored_tokens} tokens from cache in "
            f"{backend.restore_s * 1000:.0f} ms"
        )
    _say_warnings(backend.prompt_cache)


def cache(
    action: Annotated[
        str,
        typer.Argument(help="list: the cached prompts and replicas; clear: remove them all."),
    ] = "list",
) -> None:
    """The KV store (the prompt caches quill run, chat and serve keep) and the replicas under
    QUILL_HOME/cache: list or clear them. Replicas are quill bench --replica's; they count
    against --cache-max, the least recently used going first."""
    import time

    from cli.store.promptcache import CacheEntry, cache_dir, clear, headers
    from cli.store.replicas import list_replicas, replicas_dir
    from cli.ui import render
    from cli.units import human_bytes

    folder = cache_dir()
    if action == "clear":
        cleared = clear(folder, replicas_dir())
        also = f" and {cleared.replicas} replicas" if cleared.replicas else ""
        removed = f"removed {cleared.count} prompt caches{also}, {human_bytes(cleared.bytes)}"
        if cleared.failed:
            path, why = cleared.failed[0]
            raise UsageError(
                f"{removed}, but could not remove {len(cleared.failed)} in {path.parent} "
                f"({path.name}: {why}): check the directory's permissions"
            )
        render.info_line(f"{removed}, from {folder.parent}")
        return
    if action != "list":
        from cli.commands.options import shown_text

        raise UsageError(f"quill cache takes list or clear, not {shown_text(action, 40)}")

    def when(used: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(used))

    entries, lines = list(headers(folder)), []
    if not entries:
        render.info_line(f"no prompt caches in {folder}")
    else:
        lines.append(f"{'file':<35} {'tokens':>7} {'size':>10}  {'KV':<10} last used")
        for entry in entries:
            if not isinstance(entry, CacheEntry):
                lines.append(f"{entry[0].name:<35} unreadable: {entry[1]}")
                continue
            lines.append(
                f"{entry.path.name:<35} {len(entry.tokens):>7} {human_bytes(entry.size):>10}  "
                f"{entry.kv_types:<10} {when(entry.used)}"
            )
        total = sum(entry.size for entry in entries if isinstance(entry, CacheEntry))
        lines.append(f"{len(entries)} files, {human_bytes(total)} in {folder}")
    if replicas := list_replicas():
        lines.append(f"{'replica of':<35} {'size':>10}  {'last used':<16}  folder")
        for replica in reversed(replicas):  # the most recently used first
            of, size = replica.of or "? (incomplete or unreadable)", human_bytes(replica.size)
            lines.append(f"{of:<35} {size:>10}  {when(replica.used):<16}  {replica.folder.name}")
        total = sum(replica.size for replica in replicas)
        lines.append(f"{len(replicas)} replicas, {human_bytes(total)} in {replicas_dir()}")
    if lines:
        render.write_stdout("\n".join(lines) + "\n")


class ChatCacheReport:
    """Says once, after the first turn of a resumed chat, what the saved KV state gave."""

    def __init__(self, backend: Backend, resumed: bool) -> None:
        self.backend = backend
        self.store = backend.prompt_cache
        self.had_state = self.store is not None and self.store.saved()
        self.pending = resumed and self.store is not None
        self.turns = 0

    def after_turn(self) -> None:
        from cli.ui import render

        self.turns += 1
        if not self.pending or self.store is None:
            return
        self.pending = False
        _say_warnings(self.store)
        if self.backend.restored_tokens:
            render.info_line(
                f"resumed: {self.backend.restored_tokens} tokens of KV cache loaded in "
                f"{self.backend.restore_s * 1000:.0f} ms"
            )
        elif self.had_state:
            render.info_line(
                "the saved KV cache does not fit this chat (another model, KV type or "
                "llama.cpp build, a smaller context, or an edited transcript): the conversation "
                "was prefilled again"
            )

    def finish(self, backend: Backend) -> None:
        """Save the conversation's KV state to the store, if this process added to it with the
        engine the state was attached to."""
        if self.store is None or backend is not self.backend or not self.turns:
            return
        backend.keep_prompt_cache(always=True)
        _say_warnings(self.store)
