"""How a model is loaded: the options, importable without loading llama.cpp."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quant.memory import MemoryPlan, ModelShape

ALL_LAYERS = -1  # offload every layer
DEFAULT_CTX = 4096
DEFAULT_BATCH = 512  # llama.cpp's n_batch default: the most tokens one decode takes


def context_size(requested: int | None, trained_ctx: int | None) -> int:
    """The context a model is opened with: the size asked for, else DEFAULT_CTX or the model's
    trained context if that is less (0 or None: unknown)."""
    return requested or min(DEFAULT_CTX, trained_ctx or DEFAULT_CTX)


@dataclass(frozen=True)
class LoadOptions:
    n_ctx: int | None = None  # None: context_size's default
    n_batch: int = DEFAULT_BATCH
    threads: int | None = None  # None: physical cores that other work leaves free
    gpu_layers: int = 0  # ALL_LAYERS offloads every layer
    kv_type_k: str = "f16"
    kv_type_v: str = "f16"
    parallel: int = 1  # sequences sharing the context (quill serve); each gets n_ctx tokens
    repack: bool = True  # repacked weight layouts for faster CPU kernels (engine/loading.py)
    # Where each repackable weight type's matrices go: ((type, "repacked" or "plain"), ...),
    # types by quant/gguf.py's names (e.g. "Q4_K"), as cli/measure/paths.py chose; the plain ones
    # stay so though repack is on. Empty: llama.cpp's rule (all repacked).
    placement: tuple[tuple[str, str], ...] = ()

    @property
    def plain_types(self) -> frozenset[str]:
        return frozenset(kind for kind, where in self.placement if where == "plain")

    @property
    def placement_shown(self) -> str:
        """The stats line's words: "Q4_K repacked", "Q4_0 plain, Q6_K repacked"; "" for none."""
        return ", ".join(f"{kind} {where}" for kind, where in sorted(self.placement))

    avoid_amx: bool | None = None  # None: when the CPU has AMX; True forces that path anywhere
    rpc: tuple[str, ...] = ()  # HOST:PORT of llama.cpp RPC servers that take the offloaded layers


def memory_plan(
    shape: ModelShape, options: LoadOptions, draft: ModelShape | None = None, parked_bytes: int = 0
) -> MemoryPlan:
    """What a model takes opened with options (the one context rule, every slot's cells), with a
    draft model at the same context and KV types, and parked prompt caches, where given."""
    from quant.memory import plan

    n_ctx = context_size(options.n_ctx, shape.trained_ctx) * options.parallel
    kv = (options.kv_type_k, options.kv_type_v)
    return plan(shape, n_ctx, *kv, draft=draft, parked_bytes=parked_bytes)
