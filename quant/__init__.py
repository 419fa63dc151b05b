"""Weight and KV-cache quantization and the GGUF size arithmetic, usable without the CLI."""

from quant.gguf import GGUFError, GGUFHeader, GGUFInfo, quant_type, read_gguf, read_header
from quant.kv import (
    KV_CACHE_TYPES,
    QUANTIZED_KV_TYPES,
    check_kv_types,
    ggml_type,
    kv_bytes_per_element,
    kv_cache_bytes,
)
from quant.memory import MemoryPlan, ModelShape, largest_context, parse_size, plan
from quant.quantize import QuantizeError, QuantizeResult, quantize, weight_type

__all__ = [
    "KV_CACHE_TYPES",
    "QUANTIZED_KV_TYPES",
    "GGUFError",
    "GGUFHeader",
    "GGUFInfo",
    "MemoryPlan",
    "ModelShape",
    "QuantizeError",
    "QuantizeResult",
    "check_kv_types",
    "ggml_type",
    "kv_bytes_per_element",
    "kv_cache_bytes",
    "largest_context",
    "parse_size",
    "plan",
    "quant_type",
    "quantize",
    "read_gguf",
    "read_header",
    "weight_type",
]
