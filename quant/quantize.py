"""Weight quantization with llama.cpp's own quantizer, run in process: every weight matrix of
an F32, F16 or BF16 GGUF in the chosen type (norms and small tensors stay in float), written to a
part file renamed only on success, and only over a regular file that is not the input.
"""

from __future__ import annotations

import ctypes
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quant.gguf import FILE_TYPES, LLAMA_FILE_TYPES, read_header
from quant.partfiles import check_replaceable, partial_path, remove_stale_parts

# The types llama.cpp's llama-quantize accepts, by name, with their llama_ftype numbers.
WEIGHT_TYPES: dict[str, int] = {
    name: number for name, number in LLAMA_FILE_TYPES.items() if name not in ("iq3_xs", "mxfp4_moe")
}
ALIASES = {"int8": "q8_0", "int4": "q4_k_m"}
# Too few bits to be usable without an importance matrix (llama-quantize refuses them too).
NEEDS_IMATRIX = frozenset({"iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m", "q2_k_s"})
FLOAT_FILE_TYPES = {0: "f32", 1: "f16", 32: "bf16"}


# llama.cpp's quantizer logs one line per tensor: "[  12/ 272] blk.1.attn_k.weight - [...]".
_TENSOR_LINE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")


def tensor_progress(log_line: str) -> tuple[int, int, str] | None:
    """(tensor number, tensors in all, tensor name) from a quantizer log line, else None."""
    match = _TENSOR_LINE.match(log_line)
    return (int(match[1]), int(match[2]), match[3]) if match else None


class QuantizeError(Exception):
    """A quantization that cannot be done, with the reason and what to do instead."""


class UnknownTypeError(QuantizeError): ...


class NeedsImatrixError(QuantizeError): ...


class AlreadyQuantizedError(QuantizeError):
    def __init__(self, source: Path, file_type: str):
        self.source, self.file_type = source, file_type
        super().__init__(
            f"{source} is already quantized ({file_type}); quantizing it again compounds the "
            "rounding errors"
        )


class OutputExistsError(QuantizeError):
    def __init__(self, output: Path):
        self.output = output
        super().__init__(f"{output} exists")


class QuantizeFailedError(QuantizeError): ...


class OutputNotWritableError(QuantizeError):
    def __init__(self, output: Path, reason: str):
        self.output = output
        super().__init__(f"cannot write {output}: {reason}")


class UnsafeOutputError(QuantizeError): ...


def weight_type(name: str) -> str:
    """int8/int4 or a llama.cpp type name -> the llama.cpp type; refuses what it cannot make."""
    chosen = ALIASES.get(name.lower(), name.lower())
    if chosen in NEEDS_IMATRIX:
        raise NeedsImatrixError(
            f"{chosen} packs weights into about 2 bits or less, which only works with an "
            "importance matrix (llama-imatrix), which quill does not make; choose q2_k, q3_k_m "
            "or a larger type"
        )
    if chosen not in WEIGHT_TYPES:
        known = ", ".join(["int8", "int4", *sorted(set(WEIGHT_TYPES) - NEEDS_IMATRIX)])
        raise UnknownTypeError(f"unknown weight type {name!r}; quill can make {known}")
    return chosen


@dataclass(frozen=True)
class QuantizeResult:
    source: str
    output: str
    type: str
    source_bytes: int
    output_bytes: int
    parameters: int
    seconds: float
    threads: int
    dequantized: bool  # a float copy of a quantized model: it holds only the rounded weights

    @property
    def ratio(self) -> float:
        return self.output_bytes / self.source_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.output_bytes / self.parameters

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "bits_per_weight": self.bits_per_weight}


def source_file_type(path: Path) -> tuple[int, int]:
    """(llama_ftype of the file, number of parameters), from its header."""
    header = read_header(path)
    return int(header.get("general.file_type", 1)), sum(t.n_elements for t in header.tensors)


def quantize(
    source: Path,
    output: Path,
    type_name: str,
    threads: int,
    allow_requantize: bool = False,
    force: bool = False,
    on_start: Callable[[], None] | None = None,
) -> QuantizeResult:
    """Quantize source into output; on_start is called once every check has passed, just before
    llama.cpp's quantizer starts."""
    import llama_cpp

    chosen = weight_type(type_name)
    file_type, parameters = source_file_type(source)
    # Asking a quantized model for f16/bf16/f32 expands it; that is not a second rounding.
    dequantize = chosen in FLOAT_FILE_TYPES.values() and file_type not in FLOAT_FILE_TYPES
    if file_type not in FLOAT_FILE_TYPES and not (allow_requantize or dequantize):
        raise AlreadyQuantizedError(source, FILE_TYPES.get(file_type, f"type {file_type}"))
    check_replaceable(output, source, UnsafeOutputError)
    if output.exists() and not force:
        raise OutputExistsError(output)
    remove_stale_parts(output)  # left by a quantize that was killed before it could clean up
    partial = partial_path(output)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        partial.touch()
    except OSError as error:
        raise OutputNotWritableError(output, error.strerror or str(error)) from None
    if on_start is not None:
        on_start()
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = WEIGHT_TYPES[chosen]
    params.allow_requantize = allow_requantize or dequantize
    started = time.perf_counter()
    try:
        status = llama_cpp.llama_model_quantize(
            str(source).encode(), str(partial).encode(), ctypes.byref(params)
        )
        if status != 0:
            raise QuantizeFailedError(f"llama.cpp's quantizer failed on {source} (status {status})")
        check_replaceable(output, source, UnsafeOutputError)  # again: the quantizer took a while
        partial.replace(output)
    finally:
        partial.unlink(missing_ok=True)
    return QuantizeResult(
        source=str(source),
        output=str(output),
        type=chosen,
        source_bytes=source.stat().st_size,
        output_bytes=output.stat().st_size,
        parameters=parameters,
        seconds=time.perf_counter() - started,
        threads=threads,
        dequantized=dequantize,
    )
