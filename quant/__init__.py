"""Weight and KV-cache quantization and the GGUF size arithmetic, usable without the CLI.

The names below are loaded on first use (PEP 562): `import quant.partfiles` or `quant.kv` alone
stays cheap for the command line, while `from quant import plan` works as it always did.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "KV_CACHE_TYPES",
    "QUANTIZED_KV_TYPES",
    "REPLICA_KEY",
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
    "replica_bytes",
    "replica_of",
    "weight_type",
    "write_replica",
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
    from quant.replica import REPLICA_KEY, replica_bytes, replica_of, write_replica


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'quant' has no attribute {name!r}")
    # In this order the first module that has the name defines it (the later ones import it).
    for module in ("quant.gguf", "quant.kv", "quant.memory", "quant.quantize", "quant.replica"):
        value = getattr(importlib.import_module(module), name, None)
        if value is not None:
            globals()[name] = value
            return value
    raise AttributeError(f"module 'quant' lost {name!r}")


def __dir__() -> list[str]:
    return __all__
