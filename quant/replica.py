"""Replicas: a GGUF with a real model's header (metadata, tensor names, shapes, types, offsets)
and weights that are valid blocks of each type but no trained values. It measures the model's
speed and memory before its weights are downloaded; its text is noise.

Each (type, row length) gets one template of TEMPLATE_ROWS rows quantized by ggml's own
quantizer from random floats, tiled over the tensor, so a replica is written at disk speed.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from pathlib import Path

from quant.gguf import GGML_TYPES, GGUFError, GGUFHeader, TensorInfo, aligned, read_header
from quant.partfiles import check_replaceable, partial_path, remove_stale_parts

REPLICA_KEY = "quill.replica_of"
TEMPLATE_ROWS = 61  # prime: tiled rows do not line up with heads or layers of power-of-2 sizes
CHUNK_BYTES = 4 << 20
_GGUF_STRING = 8
_FLOATS = {0: "float32", 1: "float16", 28: "float64"}
_ACTIVATION_ONLY = {9, 15}  # Q8_1, Q8_K: ggml has no quantizer for them (it aborts)


def replica_of(header: GGUFHeader) -> str | None:
    value = header.get(REPLICA_KEY)
    return None if value is None else str(value)


def _layout(prefix: bytes, name: str) -> tuple[GGUFHeader, bytes, int]:
    """(the source header, the replica's header bytes padded to alignment, the file's size)."""
    header = read_header("the replica's source", whole=False, data=prefix)
    if REPLICA_KEY in header.fields:
        raise GGUFError(f"the source is a replica itself: replicate {replica_of(header)} instead")
    if header.version < 2:
        raise GGUFError(f"GGUF version {header.version} is too old to replicate: convert it again")
    n_tensors, n_kv = struct.unpack_from("<QQ", prefix, 8)
    text = [s.encode() for s in (REPLICA_KEY, name)]
    pair = struct.pack(f"<Q{len(text[0])}sIQ{len(text[1])}s", len(text[0]), text[0],
                       _GGUF_STRING, len(text[1]), text[1])  # fmt: skip
    head = b"".join(
        (prefix[:8], struct.pack("<QQ", n_tensors, n_kv + 1), prefix[24 : header.kv_end], pair,
         prefix[header.kv_end : header.infos_end])
    )  # fmt: skip
    alignment = int(header.get("general.alignment") or 32)
    head += bytes(aligned(len(head), alignment) - len(head))
    data_end = max((t.offset + t.n_bytes for t in header.tensors), default=0)
    return header, head, len(head) + aligned(data_end, alignment)


def replica_bytes(prefix: bytes, replica_of: str = "") -> int:
    """The size of the replica of the file that prefix starts: exact for this replica_of, and
    without it at most general.alignment (32) bytes short."""
    return _layout(prefix, replica_of)[2]


def write_replica(prefix: bytes, dest: Path, replica_of: str) -> None:
    """Write a replica of the GGUF whose first bytes (its whole header at least) are prefix,
    through a part file renamed to dest when complete."""
    header, head, size = _layout(prefix, replica_of)
    check_replaceable(dest)
    remove_stale_parts(dest)
    partial = partial_path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with partial.open("wb") as file:
            file.write(head)
            chunks: dict[tuple[int, int, str], memoryview] = {}
            for tensor in sorted(header.tensors, key=lambda t: t.offset):
                file.seek(len(head) + tensor.offset)
                key = (tensor.type_id, tensor.shape[0], _kind(tensor))
                chunk = chunks.get(key) or chunks.setdefault(key, memoryview(_chunk(*key)))
                for at in range(0, tensor.n_bytes, len(chunk)):
                    file.write(chunk[: tensor.n_bytes - at])
            file.truncate(size)
            file.flush()
            os.fsync(file.fileno())
        partial.replace(dest)
    finally:
        partial.unlink(missing_ok=True)


def _kind(tensor: TensorInfo) -> str:
    if len([n for n in tensor.shape if n > 1]) > 1:
        return "matrix"
    return "bias" if tensor.name.endswith(".bias") else "scale"  # norms, rope factors: ones


def _chunk(type_id: int, row: int, kind: str) -> bytes:
    """About CHUNK_BYTES of whole rows: the template repeated."""
    template = _template(type_id, row, kind)
    return template * max(1, CHUNK_BYTES // len(template))


def _template(type_id: int, row: int, kind: str) -> bytes:
    import numpy as np  # here: reading REPLICA_KEY or replica_of costs no numpy import

    rows = TEMPLATE_ROWS if kind == "matrix" else 1
    rng = np.random.default_rng(type_id * 1_000_003 + row)
    floats = {
        "matrix": lambda: rng.standard_normal((rows, row), np.float32) * np.float32(row**-0.5),
        "bias": lambda: np.zeros((rows, row), np.float32),
        "scale": lambda: np.ones((rows, row), np.float32),
    }[kind]()
    if type_id in _FLOATS:
        return floats.astype(_FLOATS[type_id]).tobytes()
    if type_id == 30:  # BF16: the high half of each float32
        return (floats.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    name, block, size = GGML_TYPES.get(type_id, (str(type_id), 1, 0))
    if size == 0 or block == 1 or row % block or type_id in _ACTIVATION_ONLY:
        raise GGUFError(
            f"quill cannot make {name} weights (rows of {row}) for a replica of this model: "
            "measure the model itself"
        )
    out = ctypes.create_string_buffer(rows * row // block * size)
    importance = np.ones(row, np.float32)  # needed by the 1-2 bit types; all-equal weighs nothing
    _ggml().ggml_quantize_chunk(
        type_id, floats.ctypes.data, out, 0, rows, row, importance.ctypes.data
    )
    return out.raw


@functools.cache
def _ggml() -> ctypes.CDLL:
    import llama_cpp
    from llama_cpp._ctypes_extensions import load_shared_library

    lib = load_shared_library("ggml-base", Path(llama_cpp.__file__).parent / "lib")
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]  # fmt: skip
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    return lib
