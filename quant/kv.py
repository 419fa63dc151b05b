"""KV-cache size arithmetic: each layer keeps a key and a value vector per KV head for every
position, so bytes = layers x KV heads x (K head dim x K bytes + V head dim x V bytes) x context.
Quantized caches store blocks of 32 values: q8_0 34 bytes a block (32 int8 and an f16 scale),
q4_0 18 bytes (32 nibbles and an f16 scale).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

# The one table of KV-cache types: name -> (ggml type id, bytes per element).
KV_TYPES: dict[str, tuple[int, Fraction]] = {
    "f32": (0, Fraction(4)),
    "f16": (1, Fraction(2)),
    "bf16": (30, Fraction(2)),
    "q8_0": (8, Fraction(34, 32)),
    "q4_0": (2, Fraction(18, 32)),
    "q4_1": (3, Fraction(20, 32)),
    "q5_0": (6, Fraction(22, 32)),
    "q5_1": (7, Fraction(24, 32)),
}
KV_CACHE_TYPES: dict[str, Fraction] = {name: size for name, (_, size) in KV_TYPES.items()}
# Blocks of 32 values with a scale: a quantized V cache needs flash attention, and a head size
# must be a multiple of 32.
QUANTIZED_KV_TYPES = tuple(name for name in KV_CACHE_TYPES if name.startswith("q"))


def kv_bytes_per_element(cache_type: str) -> Fraction:
    check_kv_type(cache_type)
    return KV_TYPES[cache_type][1]


def kv_cache_bytes(
    n_layers: int,
    n_kv_heads: int | Sequence[int],
    head_dim_k: int,
    n_ctx: int,
    type_k: str = "f16",
    type_v: str | None = None,
    head_dim_v: int | None = None,
) -> int:
    """Bytes llama.cpp allocates for the K and V caches of one sequence of n_ctx positions;
    n_kv_heads may be a list, one a layer (models whose layers differ in KV heads)."""
    heads = [n_kv_heads] * n_layers if isinstance(n_kv_heads, int) else list(n_kv_heads)
    if len(heads) != n_layers:
        raise ValueError(f"{len(heads)} KV head counts given for {n_layers} layers")
    head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
    per_k = kv_bytes_per_element(type_k)
    per_v = kv_bytes_per_element(type_v or type_k)
    return int(sum(heads) * n_ctx * (head_dim_k * per_k + head_dim_v * per_v))


def ggml_type(cache_type: str) -> int:
    """The ggml type id llama.cpp's context parameters take for a KV-cache type."""
    check_kv_type(cache_type)
    return KV_TYPES[cache_type][0]


def check_kv_type(cache_type: str, what: str = "KV cache type") -> None:
    """Refuse a cache type llama.cpp cannot store, before anything is loaded; what names it in
    the message (a flag, or which cache)."""
    if cache_type not in KV_TYPES:
        raise ValueError(f"unknown {what} {cache_type!r}; known: {', '.join(KV_TYPES)}")


def check_kv_types(type_k: str, type_v: str) -> None:
    for which, cache_type in (("K", type_k), ("V", type_v)):
        check_kv_type(cache_type, f"{which} cache type")
