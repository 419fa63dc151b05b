"""Weight and KV-cache quantization and the GGUF size arithmetic, usable without the CLI."""

from quant.kv import KV_CACHE_TYPES, check_kv_types, kv_bytes_per_element, kv_cache_bytes
from quant.memory import MemoryPlan, ModelShape, largest_context, parse_size, plan

__all__ = [
    "KV_CACHE_TYPES",
    "MemoryPlan",
    "ModelShape",
    "check_kv_types",
    "kv_bytes_per_element",
    "kv_cache_bytes",
    "largest_context",
    "parse_size",
    "plan",
]
