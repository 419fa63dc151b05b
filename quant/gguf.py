"""The one GGUF header reader: key-value fields and tensor infos (name, shape, type), no
weights, from a file or from the first bytes of one (a download's start, an HTTP range). The
tokenizer's arrays (49,152 strings for SmolLM2) are most of a header and are skipped unless asked
for by name, so what `quill list` and `quill inspect` show takes milliseconds, with neither numpy
nor the gguf package imported.
"""

from __future__ import annotations

import functools
import math
import mmap
import re
import struct
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, overload


class GGUFError(ValueError):
    """Not a GGUF file, or a truncated or corrupt one: the message says which and what to do."""


class HeaderIncomplete(GGUFError):
    """A file's first bytes that end inside its header; needed: a length that will not be enough
    either (where the field being read ends)."""

    def __init__(self, where: str, have: int, needed: int):
        self.needed = needed
        super().__init__(
            f"{where} holds the first {have:,} bytes of a GGUF file, and its header goes on past "
            f"byte {needed:,}: let its download go further"
        )


# ggml tensor types: id -> (name, values per block, bytes per block), as ggml defines them.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18), 42: ("Q2_0", 64, 18),
}  # fmt: skip
# general.file_type: llama.cpp's llama_ftype, by the name llama-quantize gives it.
LLAMA_FILE_TYPES: dict[str, int] = {
    "f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9,
    "q2_k": 10, "q3_k_s": 11, "q3_k_m": 12, "q3_k_l": 13, "q4_k_s": 14, "q4_k_m": 15,
    "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18, "iq4_nl": 25, "iq4_xs": 30, "iq3_xxs": 23,
    "iq3_s": 26, "iq3_m": 27, "iq2_xxs": 19, "iq2_xs": 20, "iq2_s": 28, "iq2_m": 29,
    "iq1_s": 24, "iq1_m": 31, "q2_k_s": 21, "tq1_0": 36, "tq2_0": 37,
    "iq3_xs": 22, "mxfp4_moe": 38,
}  # fmt: skip
FILE_TYPES: dict[int, str] = {number: name.upper() for name, number in LLAMA_FILE_TYPES.items()}

# GGUF value types: id -> struct format (8: string, 9: array, read by hand).
_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY = 8, 9
_TYPE_NAMES = dict(enumerate([
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string", "array",
    "uint64", "int64", "float64",
]))  # fmt: skip
_U64 = struct.Struct("<Q")
# llama.cpp's split files (llama_split_path): the first holds the metadata, each its own tensors.
SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# Arrays of numbers up to this length (per-layer head counts, window patterns) are always read;
# longer ones and arrays of strings (the tokenizer's) only when asked for by name.
SMALL_ARRAY = 4096
# Strings longer than this (an embedded tokenizer.json) are skipped unless asked for by name, as
# large arrays are; a chat template is tens of KB.
LONG_STRING = 1 << 20

# llama.cpp's own limits (the version quill ships with), so that no number in a header drives a
# loop or an allocation past what llama.cpp would accept: a header it refuses is refused here.
GGUF_VERSIONS = (2, 3)  # gguf.cpp: version 1 is no longer read, GGUF_VERSION is 3
MAX_DIMS = 4  # GGML_MAX_DIMS (ggml.h): gguf.cpp refuses a tensor of more dimensions
MAX_TENSOR_NAME = 64  # GGML_MAX_NAME (ggml.h): gguf.cpp refuses a name of 64 bytes or more
MAX_ELEMENTS = 2**63 - 1  # INT64_MAX: gguf.cpp refuses a shape whose element count overflows
# The least bytes a field (a key of one byte, a type, a uint8) and a tensor info (a name of one
# byte, no dimensions, its type and offset) take: gguf.cpp refuses counts the bytes left cannot
# hold (gguf_reader's nbytes_remain), and so does this reader, before looping over them.
_LEAST_FIELD, _LEAST_TENSOR = 8 + 1 + 4 + 1, 8 + 1 + 4 + 4 + 8


@dataclass(frozen=True)
class Limit:
    most: int
    says: str  # the message's words for it


UINT32 = Limit(2**32 - 1, "4294967295, the most a uint32 holds (llama.cpp reads it as one)")
# LLAMA_MAX_LAYERS (src/llama-hparams.h): llama_model's load asserts block_count <= it, and every
# per-layer array (head counts, sliding-window patterns) is at most that long.
LAYERS = Limit(512, "llama.cpp's 512 layers")
# llama_model_loader reads split.count as a uint16, and llama_split_path writes %05d.
SPLITS = Limit(65535, "the 65535 files llama.cpp splits a model into at most")


def refused(where: str, problem: str) -> GGUFError:
    """A header llama.cpp would not load either, in one line: the file, then the field."""
    return GGUFError(
        f"{where} is not a model llama.cpp can load: {problem}; download it again or pick "
        "another file"
    )


def shown(name: str) -> str:
    """A key or tensor name as a message shows it: printable, and not a page long."""
    if not name:
        return "''"
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in name[:80])
    return text + ("…" if len(name) > 80 else "")


def described(value: Any) -> str:
    """A field's value, as a message names it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"the string {value[:40]!r}" + ("…" if len(value) > 40 else "")
    if isinstance(value, list):
        return f"an array of {len(value)} items" if value else "an empty array"
    return f"the number {value}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int = 0  # where its data starts, from the start of the file's tensor data

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.type_id, (f"type {self.type_id}", 1, 0))[0]

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def n_bytes(self) -> int:
        _, block, size = GGML_TYPES.get(self.type_id, ("", 1, 0))
        return self.n_elements // block * size


@dataclass
class GGUFHeader:
    version: int
    fields: dict[str, Any]
    array_lengths: dict[str, int]  # every array field, read or skipped: its number of items
    tensors: list[TensorInfo]
    size: int = 0  # the file's length by its tensor table (when it was read)
    kv_end: int = 0  # byte offsets: where the key-value fields end,
    infos_end: int = 0  # where the tensor infos end,
    data_start: int = 0  # and where tensor data begins (aligned)
    where: str = "the file"  # its path, for messages
    string_lengths: dict[str, int] = field(default_factory=dict)  # strings skipped: their bytes

    def get(self, key: str, default: Any = None) -> Any:
        """A field as it is in the file, of any type; integer, text and per_layer check it."""
        value = self.fields.get(key)
        return default if value is None else value

    def _present(self, key: str, wanted: str) -> Any:
        """The field's value; GGUFError for one skipped (a large array, a long string)."""
        value = self.fields.get(key)
        if value is None and key in self.array_lengths:
            length = self.array_lengths[key]
            raise refused(self.where, f"{key} is an array of {length} items, not {wanted}")
        if value is None and key in self.string_lengths:
            length = self.string_lengths[key]
            raise refused(self.where, f"{key} is a string of {length} bytes, past quill's 1 MiB")
        return value

    @overload
    def integer(self, key: str, default: int, limit: Limit = UINT32) -> int: ...
    @overload
    def integer(self, key: str, default: None = None, limit: Limit = UINT32) -> int | None: ...
    def integer(self, key: str, default: int | None = None, limit: Limit = UINT32) -> int | None:
        """A whole number from 0 to limit.most (default where absent); GGUFError naming the field
        for a value of another type or out of range."""
        value = self._present(key, "a whole number")
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise refused(self.where, f"{key} is {described(value)}, not a whole number")
        if value < 0:
            raise refused(self.where, f"{key} is {value}, less than 0")
        if value > limit.most:
            raise refused(self.where, f"{key} is {value}, more than {limit.says}")
        return value

    def text(self, key: str, default: str | None = None) -> str | None:
        value = self._present(key, "a string")
        if value is None:
            return default
        if not isinstance(value, str):
            raise refused(self.where, f"{key} is {described(value)}, not a string")
        return value

    def per_layer(self, key: str, n_layers: int, default: int | None) -> int | list[int] | None:
        """A count for every layer, or a list of one per layer (llama.cpp's get_key_or_arr:
        an array as long as block_count, of whole numbers)."""
        value = self._present(key, f"one count a layer, {n_layers}")
        if not isinstance(value, list):
            return self.integer(key, default)
        if len(value) != n_layers or not value:
            layers = f"{n_layers} layers" if n_layers else "no layers (no block_count)"
            raise refused(self.where, f"{key} is {described(value)}, for {layers}")
        wrong = [v for v in value if not isinstance(v, int) or not 0 <= v <= UINT32.most]
        if wrong:
            raise refused(self.where, f"{key} holds {described(wrong[0])}, not a count")
        return value


class _Cursor:
    def __init__(self, data: Any, where: str, whole: bool) -> None:
        self.data, self.at, self.where, self.whole = data, 0, where, whole
        self.size = 0  # the last string's length

    def need(self, size: int, what: str = "") -> None:
        """Refuse to read past the data's end: a truncated file, a length or count in it that is
        corrupt (what names it), or a download's start that needs more bytes."""
        if self.at + size <= len(self.data):
            return
        if not self.whole:
            raise HeaderIncomplete(self.where, len(self.data), self.at + size)
        short = (
            f"{what} at byte {self.at} needs {size} bytes"
            if what
            else (f"its header ends at byte {self.at}")
        )
        raise GGUFError(
            f"{self.where} is not a readable GGUF file (truncated or corrupt: {short}, and the "
            f"file has {len(self.data)}); download it again"
        )

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += size
        return value

    def count(self, n: int, least: int, what: str) -> None:
        """Refuse a count (signed, as gguf.cpp reads it) that the bytes left cannot hold."""
        if n < 0:
            raise refused(self.where, f"its {what} is {n}")
        if self.whole and n * least > len(self.data) - self.at:
            raise refused(
                self.where,
                f"its {what} is {n}, more than its {len(self.data) - self.at} bytes left can hold",
            )

    def string(self, what: str, longest: int | None = LONG_STRING) -> str | None:
        """A string, or None when it is longer than longest (skipped, its length in self.size)."""
        self.size = size = self.take("Q")
        self.need(size, f"{what}, a string")
        text = None
        if longest is None or size <= longest:
            text = bytes(self.data[self.at : self.at + size]).decode("utf-8", errors="replace")
        self.at += size
        return text

    def value(self, kind: int, key: str, keep: bool) -> tuple[Any, int | None]:
        """(the value, or None when an array or a long string is skipped; an array's length or a
        string's, else None)."""
        if kind in _SCALARS:
            return self.take(_SCALARS[kind]), None
        named = shown(key)
        if kind == _STRING:
            text = self.string(named, None if keep else LONG_STRING)
            return text, self.size
        if kind != _ARRAY:
            raise refused(self.where, f"{named} has value type {kind}, which GGUF does not define")
        item, count = self.take("I"), self.take("Q")
        if item not in _SCALARS and item != _STRING:
            kind_name = _TYPE_NAMES.get(item, f"type {item}")
            raise refused(self.where, f"{named} is an array of {kind_name}s, which GGUF lacks")
        each = 8 if item == _STRING else struct.calcsize(_SCALARS[item])
        self.need(count * each, f"{named}, an array of {count} {_TYPE_NAMES[item]}s")
        if keep or (item in _SCALARS and count <= SMALL_ARRAY):
            return [self.value(item, key, True)[0] for _ in range(count)], count
        if item in _SCALARS:
            self.at += count * each
        else:
            at, data, length = self.at, self.data, _U64.unpack_from
            end = len(data)
            for _ in range(count):
                if at + 8 > end:
                    at = end + 1
                    break
                at += 8 + length(data, at)[0]
            if at > end:
                self.need(at - self.at, f"{named}, an array of {count} strings")
            self.at = at
        return None, count

    def tensor(self, index: int) -> TensorInfo:
        """One tensor info, with gguf.cpp's checks on its name, shape and type."""
        name = self.string(f"tensor {index}'s name", MAX_TENSOR_NAME - 1)
        name = shown(name) if name is not None else None
        if name is None:
            problem = f"tensor {index}'s name is {self.size} bytes long"
            raise refused(self.where, f"{problem}, and ggml's are shorter than {MAX_TENSOR_NAME}")
        n_dims = self.take("I")
        if n_dims > MAX_DIMS:
            problem = f"tensor {name} has {n_dims} dimensions"
            raise refused(self.where, f"{problem}, and ggml's have at most {MAX_DIMS}")
        self.need(8 * n_dims, f"tensor {name}'s shape")
        shape = tuple(self.take("q") for _ in range(n_dims))
        if any(n < 0 for n in shape):
            raise refused(self.where, f"tensor {name} has the shape {shape}")
        if math.prod(shape) > MAX_ELEMENTS:
            raise refused(self.where, f"tensor {name}'s shape {shape} holds over 2**63 values")
        type_id = self.take("I")
        if type_id not in GGML_TYPES:
            raise refused(self.where, f"tensor {name} is of ggml type {type_id}, which ggml lacks")
        type_name, block, _ = GGML_TYPES[type_id]
        row = shape[0] if shape else 1
        if row % block:
            problem = f"tensor {name}'s rows of {row} values are not whole {type_name} blocks"
            raise refused(self.where, f"{problem} ({block} values)")
        return TensorInfo(name, shape, type_id, self.take("Q"))


def check_gguf_magic(path: Path) -> None:
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise GGUFError(f"cannot read {path}: {error.strerror}") from error
    _check_magic(magic, str(path))


def _check_magic(magic: bytes, where: str) -> None:
    if magic != b"GGUF":
        raise GGUFError(
            f"{where} is not a GGUF file (it starts with {magic!r}, not b'GGUF'): "
            "quill runs llama.cpp's GGUF format; convert the model or pick a .gguf file"
        )


def read_header(
    path: Path | str,
    arrays: Collection[str] = (),
    tensors: bool = True,
    only: Collection[str] | None = None,
    whole: bool = True,
    data: Any = None,
) -> GGUFHeader:
    """The header of a GGUF file, read from path or given as data: all its bytes, or with
    whole=False its first ones (running out of them then raises HeaderIncomplete instead of
    calling the file truncated). Large arrays and arrays of strings are read only when named in
    arrays (the others give their length); tensors=False skips the tensor infos; only=KEYS stops
    reading as soon as those fields are found (the header then holds what was read)."""
    if data is None:
        check_gguf_magic(Path(path))
        with Path(path).open("rb") as handle:
            try:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:
                raise GGUFError(f"{path} is empty; download it again") from None
        try:
            return read_header(path, arrays, tensors, only, whole, mapped)
        finally:
            mapped.close()
    where = str(path)
    _check_magic(bytes(data[:4]), where)
    cursor = _Cursor(data, where, whole)
    cursor.take("I")
    version = cursor.take("I")
    if version not in GGUF_VERSIONS:
        raise refused(where, f"it is GGUF version {version}, and llama.cpp reads versions 2 and 3")
    n_tensors, n_fields = cursor.take("q"), cursor.take("q")
    cursor.count(n_fields, _LEAST_FIELD, "field count")
    header = GGUFHeader(version, {}, {}, [], where=where)
    if not _read_fields(cursor, header, n_fields, arrays, only):
        return header  # every field asked for is read
    header.kv_end = cursor.at
    # gguf.cpp: general.alignment is a power of 2 (it reads it as a uint32).
    alignment = header.integer("general.alignment", 32)
    if alignment & (alignment - 1) or not alignment:
        raise refused(where, f"general.alignment is {alignment}, not a power of 2")
    data_end = 0  # where the last tensor's data ends, from the start of the data
    if tensors:
        cursor.count(n_tensors, _LEAST_TENSOR, "tensor count")
        data_end = _read_tensor_infos(cursor, header, n_tensors, alignment)
    header.infos_end = cursor.at
    header.data_start = aligned(cursor.at, alignment)
    header.size = header.data_start + data_end
    if tensors and whole and header.size > len(data):
        raise GGUFError(
            f"{where} is not a readable GGUF file (truncated or corrupt: its tensors need "
            f"{header.size} bytes, the file has {len(data)}); download it again"
        )
    return header


def aligned(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _read_fields(
    cursor: _Cursor,
    header: GGUFHeader,
    n_fields: int,
    arrays: Collection[str],
    only: Collection[str] | None,
) -> bool:
    """The key-value fields into header; False where it stopped once the fields in only were
    read, True where it read them all."""
    where, fields = header.where, header.fields
    wanted = set(only) if only is not None else None
    for index in range(n_fields):
        key = cursor.string(f"the key of field {index}")
        if not key:
            what = "empty" if key == "" else f"{cursor.size} bytes long, past quill's 1 MiB"
            raise refused(where, f"the key of field {index} is {what}")
        if key in fields:
            raise refused(where, f"{shown(key)} is in its header twice")
        kind = cursor.take("I")
        fields[key], length = cursor.value(kind, key, key in arrays)
        if length is None:  # a scalar
            pass
        elif kind == _ARRAY:
            header.array_lengths[key] = length
        elif fields[key] is None:  # a string too long to keep
            header.string_lengths[key] = length
        if wanted is not None:
            wanted.discard(key)
            if not wanted:
                return False
    return True


def _read_tensor_infos(cursor: _Cursor, header: GGUFHeader, n_tensors: int, alignment: int) -> int:
    """The tensor table into header; where the last tensor's data ends, from the data's start."""
    where, names, data_end = header.where, set[str](), 0
    for index in range(n_tensors):
        info = cursor.tensor(index)
        if info.name in names:
            raise refused(where, f"tensor {info.name} is in its tensor table twice")
        # gguf.cpp: each tensor's data follows the one before, padded to the alignment.
        if info.offset != aligned(data_end, alignment):
            expected = aligned(data_end, alignment)
            problem = f"tensor {info.name} is at offset {info.offset}, not {expected}"
            raise refused(where, f"{problem} (where the tensor before it ends)")
        names.add(info.name)
        data_end = info.offset + info.n_bytes
        header.tensors.append(info)
    return data_end


def split_parts(name: str, header: GGUFHeader) -> list[str]:
    """The names of a split GGUF's other files (llama.cpp's NAME-00001-of-0000N.gguf), from its
    first file's name and header; none for a single file."""
    count = header.integer("split.count", 1, SPLITS)
    match = SPLIT_NAME.search(name)
    if count < 2:
        return []
    if header.integer("split.no", 0, SPLITS) != 0 or match is None:
        first = f"-00001-of-{count:05}.gguf"
        raise GGUFError(f"{name} is one part of a split GGUF: name its first part, …{first}")
    return [f"{name[: match.start()]}-{n:05}-of-{count:05}.gguf" for n in range(2, count + 1)]


def joined(parts: list[GGUFHeader], where: str) -> GGUFHeader:
    """A split GGUF's header: its first file's fields and every file's tensors."""
    first, tensors = parts[0], [t for part in parts for t in part.tensors]
    expected = first.integer("split.tensors.count", len(tensors))
    if len(tensors) != expected:
        raise GGUFError(
            f"{where}: its parts list {len(tensors)} tensors, its first part says {expected}; "
            "one is from another model or version: download them again"
        )
    size = sum(part.size for part in parts)
    return GGUFHeader(
        first.version, first.fields, first.array_lengths, tensors, size, where=first.where,
        string_lengths=first.string_lengths,
    )  # fmt: skip


def file_type_name(header: GGUFHeader) -> str | None:
    """The file's dominant quantization as llama-quantize names it, e.g. Q4_K_M."""
    number = header.integer("general.file_type")
    return None if number is None else FILE_TYPES.get(number, str(number))


def quant_type(path: Path) -> str | None:
    """Just the quantization, for listings: stops reading at general.file_type."""
    return file_type_name(read_header(path, tensors=False, only=("general.file_type",)))


# llama.h's enum llama_pooling_type: how an embedding model makes one vector of a text's tokens.
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


RANK_HEAD = "cls.output.weight"  # a sequence classifier's head: what makes BERT a reranker


def model_kind(pooling: int | None, rank_head: bool = False) -> str:
    """generation, embedding or rerank: a file that declares a pooling other than none is read as
    a whole text, into one vector; one with a classifier head (RANK_HEAD), into a relevance score.
    llama.cpp's converter writes no pooling for a reranker: its head is what says so, and
    llama-server's --rerank is what pools it."""
    if rank_head or POOLING_TYPES.get(pooling or 0) == "rank":
        return "rerank"
    return "embedding" if pooling else "generation"


def header_kind(header: GGUFHeader) -> str:
    """model_kind of a read header: its pooling field and whether a tensor is RANK_HEAD."""
    arch = header.text("general.architecture", "unknown") or "unknown"
    rank_head = any(tensor.name == RANK_HEAD for tensor in header.tensors)
    return model_kind(header.integer(f"{arch}.pooling_type"), rank_head)


FileState = tuple[str, int, int]


def file_state(path: Path | str) -> FileState:
    """The file as it is now: its path, size and modification time, what a memo of something
    read from it is keyed by (OSError where it is gone)."""
    stat = Path(path).stat()
    return str(path), stat.st_size, stat.st_mtime_ns


def file_kind(path: Path) -> str:
    """model_kind of a GGUF file, from its header's fields and tensor names (no arrays read),
    remembered for the file as it is (a server asks at every load: 70 ms a time for a
    128k-token vocabulary, whose strings are walked to be skipped)."""
    return _file_kind(file_state(path))


@functools.lru_cache(maxsize=64)
def _file_kind(state: FileState) -> str:
    return header_kind(read_header(state[0]))


@dataclass(frozen=True)
class Hyperparameters:
    """The model's numbers that quill plans with and shows, each checked as llama.cpp reads it
    (None where the header lacks one)."""

    architecture: str
    layers: int | None
    embedding_length: int | None
    heads: int | list[int] | None  # a list: one a layer
    kv_heads: int | list[int] | None
    key_length: int | None
    value_length: int | None
    context_length: int | None
    sliding_window: int | None
    pooling: int | None  # POOLING_TYPES; None: the file declares none


def hyperparameters(header: GGUFHeader) -> Hyperparameters:
    """GGUFError naming the first field of a wrong type or past llama.cpp's limits."""
    arch = header.text("general.architecture", "unknown") or "unknown"
    layers = header.integer(f"{arch}.block_count", None, LAYERS)
    heads = header.per_layer(f"{arch}.attention.head_count", layers or 0, None)
    return Hyperparameters(
        architecture=arch,
        layers=layers,
        embedding_length=header.integer(f"{arch}.embedding_length"),
        heads=heads,
        kv_heads=header.per_layer(f"{arch}.attention.head_count_kv", layers or 0, None),
        key_length=header.integer(f"{arch}.attention.key_length"),
        value_length=header.integer(f"{arch}.attention.value_length"),
        context_length=header.integer(f"{arch}.context_length"),
        sliding_window=header.integer(f"{arch}.attention.sliding_window"),
        pooling=header.integer(f"{arch}.pooling_type"),
    )


def head_dims(get: Callable[[str, Any], Any]) -> tuple[int, int]:
    """(K, V) values per attention head, with llama.cpp's fallback: embedding / heads. get reads
    a field with a default: a GGUFHeader's (after hyperparameters() checked it), or the loaded
    model's metadata (text)."""
    arch = get("general.architecture", "unknown")
    heads = get(f"{arch}.attention.head_count", 1)
    heads = max(heads) if isinstance(heads, list) else int(heads)
    n_embd = int(get(f"{arch}.embedding_length", 0))
    head_dim_k = int(get(f"{arch}.attention.key_length", n_embd // max(heads, 1)))
    return head_dim_k, int(get(f"{arch}.attention.value_length", head_dim_k))


@dataclass(frozen=True)
class TensorType:
    type: str
    tensors: int
    bytes: int


@dataclass(frozen=True)
class GGUFInfo:
    path: str
    file_size: int
    gguf_version: int
    name: str | None
    architecture: str
    file_type: str | None  # the dominant quantization, e.g. Q4_K_M
    parameters: int
    layers: int | None
    embedding_length: int | None
    heads: int | list[int] | None  # a list when layers differ
    kv_heads: int | list[int] | None
    head_dim: int | None
    context_length: int | None
    sliding_window: int | None
    vocab_size: int | None
    tokenizer: str | None
    chat_template: bool
    tensor_types: list[TensorType] = field(default_factory=list)
    kind: str = "generation"  # model_kind's
    pooling: str | None = None  # POOLING_TYPES' name, where the file declares one

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_gguf(
    path: Path | str, header: GGUFHeader | None = None, file_size: int | None = None
) -> GGUFInfo:
    """What `quill inspect` shows, from the header alone (read here unless given); file_size
    for a file that is not (all) at path."""
    header = header or read_header(Path(path))
    model = hyperparameters(header)
    head_dim = model.key_length
    if head_dim is None and isinstance(model.heads, int) and model.heads and model.embedding_length:
        head_dim = head_dims(header.get)[0]
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for tensor in header.tensors:
        counts[tensor.type_name] += 1
        sizes[tensor.type_name] += tensor.n_bytes
    template = header.text("tokenizer.chat_template")
    return GGUFInfo(
        path=str(path),
        file_size=Path(path).stat().st_size if file_size is None else file_size,
        gguf_version=header.version,
        name=header.text("general.name"),
        architecture=model.architecture,
        file_type=file_type_name(header),
        parameters=sum(t.n_elements for t in header.tensors),
        layers=model.layers,
        embedding_length=model.embedding_length,
        heads=model.heads,
        kv_heads=model.kv_heads,
        head_dim=head_dim,
        context_length=model.context_length,
        sliding_window=model.sliding_window,
        vocab_size=header.array_lengths.get("tokenizer.ggml.tokens"),
        tokenizer=header.text("tokenizer.ggml.model"),
        chat_template=template is not None,
        tensor_types=[
            TensorType(name, counts[name], sizes[name]) for name, _ in sizes.most_common()
        ],
        kind=header_kind(header),
        pooling=POOLING_TYPES.get(model.pooling) if model.pooling is not None else None,
    )
