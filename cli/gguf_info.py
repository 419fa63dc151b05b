"""What a GGUF file holds, read from its header with the gguf package: no weights are loaded."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cli.errors import ModelLoadError


def check_gguf_magic(path: Path) -> None:
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise ModelLoadError(f"cannot read {path}: {error.strerror}") from error
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'): "
            "quill runs llama.cpp's GGUF format; convert the model or pick a .gguf file"
        )


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


def read_gguf(path: Path) -> GGUFInfo:
    from gguf import GGUFReader, LlamaFileType

    check_gguf_magic(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as error:
        # The gguf package fails on a short file with whatever numpy said; name the likely cause.
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (truncated or corrupt: {error}); download it again"
        ) from error

    def value(key: str) -> Any:
        found = reader.fields.get(key)
        return None if found is None else found.contents()

    arch = value("general.architecture") or "unknown"
    heads = value(f"{arch}.attention.head_count")
    kv_heads = value(f"{arch}.attention.head_count_kv")
    embedding = value(f"{arch}.embedding_length")
    head_dim = value(f"{arch}.attention.key_length")
    if head_dim is None and isinstance(heads, int) and heads and embedding:
        head_dim = embedding // heads
    file_type = value("general.file_type")
    try:
        file_type_name = None if file_type is None else LlamaFileType(file_type).name
    except ValueError:
        file_type_name = str(file_type)
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for tensor in reader.tensors:
        counts[tensor.tensor_type.name] += 1
        sizes[tensor.tensor_type.name] += int(tensor.n_bytes)
    tokens = value("tokenizer.ggml.tokens")
    return GGUFInfo(
        path=str(path),
        file_size=path.stat().st_size,
        gguf_version=int(value("GGUF.version") or 0),
        name=value("general.name"),
        architecture=arch,
        file_type=file_type_name.removeprefix("MOSTLY_") if file_type_name else None,
        parameters=sum(int(t.n_elements) for t in reader.tensors),
        layers=value(f"{arch}.block_count"),
        embedding_length=embedding,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        context_length=value(f"{arch}.context_length"),
        sliding_window=value(f"{arch}.attention.sliding_window"),
        vocab_size=len(tokens) if tokens is not None else None,
        tokenizer=value("tokenizer.ggml.model"),
        chat_template=value("tokenizer.chat_template") is not None,
        tensor_types=[
            TensorType(name, counts[name], sizes[name]) for name, _ in sizes.most_common()
        ],
    )
