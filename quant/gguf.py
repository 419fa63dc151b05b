"""The one GGUF header reader: key-value fields and tensor infos (name, shape, type), no
weights, from a file or from the first bytes of one (a download's start, an HTTP range). The
tokenizer's arrays (49,152 strings for SmolLM2) are most of a header and are skipped unless asked
for by name, so what `quill list` and `quill inspect` show takes milliseconds, with neither numpy
nor the gguf package imported.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


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
_U64 = struct.Struct("<Q")
# llama.cpp's split files (llama_split_path): the first holds the metadata, each its own tensors.
SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# Arrays of numbers up to this length (per-layer head counts, window patterns) are always read;
# longer ones and arrays of strings (the tokenizer's) only when asked for by name.
SMALL_ARRAY = 4096


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

    def get(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value


class _Cursor:
    def __init__(self, data: Any, where: str, whole: bool) -> None:
        self.data, self.at, self.where, self.whole = data, 0, where, whole

    def take(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.data, self.at)
        except struct.error:
            if not self.whole:
                needed = self.at + struct.calcsize(fmt)
                raise HeaderIncomplete(self.where, len(self.data), needed) from None
            raise GGUFError(
                f"{self.where} is not a readable GGUF file (truncated or corrupt: its header ends "
                f"at byte {self.at}); download it again"
            ) from None
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.take("Q")
        if self.at + size > len(self.data):
            self.take(f"{size}s")  # raises the truncation error
        text = bytes(self.data[self.at : self.at + size]).decode("utf-8", errors="replace")
        self.at += size
        return text

    def value(self, kind: int, keep: bool) -> tuple[Any, int | None]:
        """(the value, or None when an array is skipped; the array's length, else None)."""
        if kind in _SCALARS:
            return self.take(_SCALARS[kind]), None
        if kind == _STRING:
            return self.string(), None
        if kind != _ARRAY:
            raise GGUFError(f"{self.where} is not a readable GGUF file (unknown value type {kind})")
        item, count = self.take("I"), self.take("Q")
        if keep or (item in _SCALARS and count <= SMALL_ARRAY):
            return [self.value(item, True)[0] for _ in range(count)], count
        if item in _SCALARS:
            self.at += count * struct.calcsize(_SCALARS[item])
        elif item == _STRING:
            at, data, length = self.at, self.data, _U64.unpack_from
            try:
                for _ in range(count):
                    at += 8 + length(data, at)[0]
            except struct.error:
                at = len(data) + 1  # past the end: reported as truncated below
            self.at = at
        else:
            for _ in range(count):
                self.value(item, False)
        if self.at > len(self.data):
            self.take("B")  # raises the truncation error
        return None, count


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
    n_tensors, n_fields = cursor.take("Q"), cursor.take("Q")
    fields: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    wanted = set(only) if only is not None else None
    for _ in range(n_fields):
        key = cursor.string()
        value, length = cursor.value(cursor.take("I"), key in arrays)
        fields[key] = value
        if length is not None:
            lengths[key] = length
        if wanted is not None:
            wanted.discard(key)
            if not wanted:
                return GGUFHeader(version, fields, lengths, [])
    kv_end = cursor.at
    infos: list[TensorInfo] = []
    data_end = 0  # where the last tensor's data ends, from the start of the data
    for _ in range(n_tensors if tensors else 0):
        name = cursor.string()
        shape = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
        info = TensorInfo(name, shape, cursor.take("I"), cursor.take("Q"))
        data_end = max(data_end, info.offset + info.n_bytes)
        infos.append(info)
    data_start = aligned(cursor.at, int(fields.get("general.alignment") or 32))
    size = data_start + data_end
    if tensors and whole and size > len(data):
        raise GGUFError(
            f"{where} is not a readable GGUF file (truncated or corrupt: its tensors need "
            f"{size} bytes, the file has {len(data)}); download it again"
        )
    return GGUFHeader(version, fields, lengths, infos, size, kv_end, cursor.at, data_start)


def aligned(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def split_parts(name: str, header: GGUFHeader) -> list[str]:
    """The names of a split GGUF's other files (llama.cpp's NAME-00001-of-0000N.gguf), from its
    first file's name and header; none for a single file."""
    count = int(header.get("split.count", 1))
    match = SPLIT_NAME.search(name)
    if count < 2:
        return []
    if int(header.get("split.no", 0)) != 0 or match is None:
        first = f"-00001-of-{count:05}.gguf"
        raise GGUFError(f"{name} is one part of a split GGUF: name its first part, …{first}")
    return [f"{name[: match.start()]}-{n:05}-of-{count:05}.gguf" for n in range(2, count + 1)]


def joined(parts: list[GGUFHeader], where: str) -> GGUFHeader:
    """A split GGUF's header: its first file's fields and every file's tensors."""
    first, tensors = parts[0], [t for part in parts for t in part.tensors]
    expected = int(first.get("split.tensors.count", len(tensors)))
    if len(tensors) != expected:
        raise GGUFError(
            f"{where}: its parts list {len(tensors)} tensors, its first part says {expected}; "
            "one is from another model or version: download them again"
        )
    size = sum(part.size for part in parts)
    return GGUFHeader(first.version, first.fields, first.array_lengths, tensors, size)


def file_type_name(header: GGUFHeader) -> str | None:
    """The file's dominant quantization as llama-quantize names it, e.g. Q4_K_M."""
    number = header.get("general.file_type")
    return None if number is None else FILE_TYPES.get(int(number), str(number))


def quant_type(path: Path) -> str | None:
    """Just the quantization, for listings: stops reading at general.file_type."""
    return file_type_name(read_header(path, tensors=False, only=("general.file_type",)))


def head_dims(get: Callable[[str, Any], Any]) -> tuple[int, int]:
    """(K, V) values per attention head, with llama.cpp's fallback: embedding / heads. get reads
    a field with a default: a GGUFHeader's, or the loaded model's metadata."""
    arch = get("general.architecture", "unknown")
    heads = get(f"{arch}.attention.head_count", 1)
    heads = int(heads) if isinstance(heads, (int, str)) else max(heads or [1])
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
    heads: int | None
    kv_heads: int | list[int] | None  # a list when layers differ
    head_dim: int | None
    context_length: int | None
    sliding_window: int | None
    vocab_size: int | None
    tokenizer: str | None
    chat_template: bool
    tensor_types: list[TensorType] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_gguf(
    path: Path | str, header: GGUFHeader | None = None, file_size: int | None = None
) -> GGUFInfo:
    """What `quill inspect` shows, from the header alone (read here unless given); file_size
    for a file that is not (all) at path."""
    header = header or read_header(Path(path))
    arch = header.get("general.architecture", "unknown")
    heads = header.get(f"{arch}.attention.head_count")
    embedding = header.get(f"{arch}.embedding_length")
    head_dim = header.get(f"{arch}.attention.key_length")
    if head_dim is None and isinstance(heads, int) and heads and embedding:
        head_dim = head_dims(header.get)[0]
    kv_heads = header.get(f"{arch}.attention.head_count_kv")
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for tensor in header.tensors:
        counts[tensor.type_name] += 1
        sizes[tensor.type_name] += tensor.n_bytes
    return GGUFInfo(
        path=str(path),
        file_size=Path(path).stat().st_size if file_size is None else file_size,
        gguf_version=header.version,
        name=header.get("general.name"),
        architecture=arch,
        file_type=file_type_name(header),
        parameters=sum(t.n_elements for t in header.tensors),
        layers=header.get(f"{arch}.block_count"),
        embedding_length=embedding,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        context_length=header.get(f"{arch}.context_length"),
        sliding_window=header.get(f"{arch}.attention.sliding_window"),
        vocab_size=header.array_lengths.get("tokenizer.ggml.tokens"),
        tokenizer=header.get("tokenizer.ggml.model"),
        chat_template=header.get("tokenizer.chat_template") is not None,
        tensor_types=[
            TensorType(name, counts[name], sizes[name]) for name, _ in sizes.most_common()
        ],
    )
