"""KV-cache size arithmetic.

Each layer stores a key and a value vector per KV head for every position of the context, so
bytes = 2 x layers x KV heads x head dim x context x bytes per element. Quantized caches store
blocks of 32 elements: q8_0 takes 34 bytes a block (32 int8 plus an f16 scale), q4_0 18 bytes
(32 nibbles plus an f16 scale).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

KV_CACHE_TYPES: dict[str, Fraction] = {
    "f32": Fraction(4),
    "f16": Fraction(2),
    "bf16": Fraction(2),
    "q8_0": Fraction(34, 32),
    "q4_0": Fraction(18, 32),
    "q4_1": Fraction(20, 32),
    "q5_0": Fraction(22, 32),
    "q5_1": Fraction(24, 32),
}


# Types that store blocks of 32 values with a scale: a quantized V cache needs flash attention,
# and a head size must be a multiple of 32.
QUANTIZED_KV_TYPES = tuple(name for name in KV_CACHE_TYPES if name.startswith("q"))


def kv_bytes_per_element(cache_type: str) -> Fraction:
    try:
        return KV_CACHE_TYPES[cache_type]
    except KeyError:
        known = ", ".join(KV_CACHE_TYPES)
        raise ValueError(f"unknown KV cache type {cache_type!r}; known: {known}") from None


def kv_cache_bytes(
    n_layers: int,
    n_kv_heads: int | Sequence[int],
    head_dim_k: int,
    n_ctx: int,
    type_k: str = "f16",
    type_v: str | None = None,
    head_dim_v: int | None = None,
) -> int:
    """Bytes llama.cpp allocates for the K and V caches of one sequence of n_ctx positions.

    n_kv_heads may be a per-layer list (models whose layers differ in KV heads).
    """
    heads = [n_kv_heads] * n_layers if isinstance(n_kv_heads, int) else list(n_kv_heads)
    if len(heads) != n_layers:
        raise ValueError(f"{len(heads)} KV head counts given for {n_layers} layers")
    head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
    per_k = kv_bytes_per_element(type_k)
    per_v = kv_bytes_per_element(type_v or type_k)
    total = sum(h * n_ctx * (head_dim_k * per_k + head_dim_v * per_v) for h in heads)
    return int(total)


def check_kv_types(type_k: str, type_v: str) -> None:
    """Refuse cache types llama.cpp cannot store, before anything is loaded."""
    for which, cache_type in (("K", type_k), ("V", type_v)):
        if cache_type not in KV_CACHE_TYPES:
            known = ", ".join(KV_CACHE_TYPES)
            raise ValueError(f"unknown {which} cache type {cache_type!r}; llama.cpp takes {known}")
