"""Weight and KV-cache quantization and the GGUF size arithmetic, usable without the CLI."""

from quant.kv import KV_CACHE_TYPES, kv_bytes_per_element, kv_cache_bytes

__all__ = ["KV_CACHE_TYPES", "kv_bytes_per_element", "kv_cache_bytes"]
