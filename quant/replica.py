"""Replicas: a GGUF with a real model's header (metadata, tensor names, shapes, types, offsets)
and weights that are valid blocks of each type but no trained values. It measures the model's
speed and memory before its weights are downloaded; its text is noise.

Each (type, row length) gets one template of TEMPLATE_ROWS rows quantized by ggml's own
quantizer from random floats, tiled over the tensor, so a replica is written at disk speed.
Whatever the header says, the writer holds at most BUILD_BYTES: a template has at most
TEMPLATE_VALUES values (a longer row is cut to whole blocks), the templates kept for reuse at
most TEMPLATE_CACHE_BYTES, and a tensor is written in chunks of at most CHUNK_BYTES.
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
# At most 4 MiB of F64: rows up to 8,594 values stay whole, and blocks are valid cut anywhere.
TEMPLATE_VALUES = 1 << 19
TEMPLATE_CACHE_BYTES = 16 << 20  # a model's few kinds of tensor all fit: each is made once
CHUNK_BYTES = 4 << 20
# The most writing holds, whatever the header: the cache, and a chunk or the making of one
# template (two arrays of float32 values, then a copy and the bytes, up to 8 a value for F64).
BUILD_BYTES = TEMPLATE_CACHE_BYTES + max(CHUNK_BYTES, TEMPLATE_VALUES * (4 + 4 + 8 + 8))
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
    # read_header has refused an alignment that is not a power of 2, and any tensor that does
    # not start where the one before ends, padded to it, as llama.cpp's loader does: so the data
    # is the tensors' sizes and their padding, and a replica never exceeds its plan.
    alignment = header.integer("general.alignment", 32)
    head += bytes(aligned(len(head), alignment) - len(head))
    return header, head, len(head) + aligned(header.size - header.data_start, alignment)


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
    templates = _Templates()
    try:
        with partial.open("wb") as file:
            file.write(head)
            for tensor in header.tensors:  # in the order of their offsets, as _layout checked
                if tensor.n_elements == 0:
                    continue
                file.seek(len(head) + tensor.offset)
                row = tensor.shape[0] if tensor.shape else 1
                template = templates.get(tensor.type_id, row, _kind(tensor))
                chunk = memoryview(
                    template * max(1, min(CHUNK_BYTES, tensor.n_bytes) // len(template))
                )
                for at in range(0, tensor.n_bytes, len(chunk)):
                    file.write(chunk[: tensor.n_bytes - at])
                del chunk  # before the next tensor's template is made: one chunk at a time
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


class _Templates:
    """Templates by (type, row, kind), made once each; the least recently used are dropped while
    those kept exceed TEMPLATE_CACHE_BYTES."""

    def __init__(self) -> None:
        self.kept: dict[tuple[int, int, str], bytes] = {}

    def get(self, type_id: int, row: int, kind: str) -> bytes:
        key = (type_id, row, kind)
        template = self.kept.pop(key, None) or _template(type_id, row, kind)
        self.kept[key] = template  # the newest last
        while sum(map(len, self.kept.values())) > TEMPLATE_CACHE_BYTES and len(self.kept) > 1:
            del self.kept[next(iter(self.kept))]
        return template


def _template(type_id: int, row: int, kind: str) -> bytes:
    """TEMPLATE_ROWS rows (one for a norm or a bias) of type_id's blocks, each row cut to whole
    blocks where the rows would hold more than TEMPLATE_VALUES values."""
    import numpy as np  # here: reading REPLICA_KEY or replica_of costs no numpy import

    name, block, size = GGML_TYPES.get(type_id, (f"type {type_id}", 1, 0))
    quantized = type_id not in _FLOATS and type_id != 30
    if size == 0 or row % block or (quantized and (block == 1 or type_id in _ACTIVATION_ONLY)):
        raise GGUFError(
            f"quill cannot make {name} weights (rows of {row}) for a replica of this model: "
            "measure the model itself"
        )
    rows = TEMPLATE_ROWS if kind == "matrix" else 1
    width = min(row, max(block, TEMPLATE_VALUES // rows // block * block))
    rng = np.random.default_rng(type_id * 1_000_003 + row)
    floats = {
        "matrix": lambda: rng.standard_normal((rows, width), np.float32) * np.float32(row**-0.5),
        "bias": lambda: np.zeros((rows, width), np.float32),
        "scale": lambda: np.ones((rows, width), np.float32),
    }[kind]()
    if type_id in _FLOATS:
        return floats.astype(_FLOATS[type_id]).tobytes()
    if type_id == 30:  # BF16: the high half of each float32
        return (floats.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    out = ctypes.create_string_buffer(rows * width // block * size)
    importance = np.ones(width, np.float32)  # the 1-2 bit types need one; all-equal weighs nothing
    _ggml().ggml_quantize_chunk(
        type_id, floats.ctypes.data, out, 0, rows, width, importance.ctypes.data
    )
    return out.raw


@functools.cache
def _ggml() -> ctypes.CDLL:
    from quant.ggmllib import declare, ggml_library  # loads llama.cpp: only when quantizing

    argtypes: list[type] = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]  # fmt: skip
    return declare(ggml_library("ggml-base"), {"ggml_quantize_chunk": (argtypes, ctypes.c_size_t)})
