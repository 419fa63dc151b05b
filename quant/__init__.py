"""Weight and KV-cache quantization and the GGUF size arithmetic, usable without the CLI.

The names below are loaded on first use (PEP 562): `import quant.partfiles` or `quant.kv` alone
stays cheap for the command line, while `from quant import plan` works as it always did.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "GGUFError": "quant.gguf",
    "GGUFHeader": "quant.gguf",
    "GGUFInfo": "quant.gguf",
    "quant_type": "quant.gguf",
    "read_gguf": "quant.gguf",
    "read_header": "quant.gguf",
    "KV_CACHE_TYPES": "quant.kv",
    "QUANTIZED_KV_TYPES": "quant.kv",
    "check_kv_types": "quant.kv",
    "ggml_type": "quant.kv",
    "kv_bytes_per_element": "quant.kv",
    "kv_cache_bytes": "quant.kv",
    "MemoryPlan": "quant.memory",
    "ModelShape": "quant.memory",
    "largest_context": "quant.memory",
    "parse_size": "quant.memory",
    "plan": "quant.memory",
    "QuantizeError": "quant.quantize",
    "QuantizeResult": "quant.quantize",
    "quantize": "quant.quantize",
    "weight_type": "quant.quantize",
}

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

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'quant' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
