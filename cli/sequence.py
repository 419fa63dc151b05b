"""Token sequences: the one rule the engine (KV reuse, parked slots) and the store (saved
prompt states) share, importable by both layers."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import takewhile


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    return sum(1 for _ in takewhile(lambda pair: pair[0] == pair[1], zip(a, b, strict=False)))
