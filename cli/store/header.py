"""A model's GGUF header without its weights, from its file on disk: whole, a download's start, or
each file of a split (hub.py reads one from the Hub by range requests, models.py chooses). A
header is a few MB at the start of a file of GBs, and the memory plan needs nothing else."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cli.errors import ModelLoadError
from quant.gguf import (
    GGUFError,
    GGUFHeader,
    GGUFInfo,
    HeaderIncomplete,
    check_gguf_magic,
    joined,
    read_gguf,
    read_header,
    split_parts,
)
from quant.memory import ModelShape

# A download's start: huggingface-hub's blobs/ETAG.incomplete, a browser's or wget's NAME.part.
PARTIAL = re.compile(r"\.(incomplete|part)$")
FIRST_READ = 2**20  # a header's first read; doubled until the header parses


@dataclass(frozen=True)
class ModelHeader:
    header: GGUFHeader  # a split's: its first file's fields, every file's tensors
    where: str  # the path, or hf://OWNER/REPO/FILE
    size: int  # of the whole file (every file of a split)
    read: int | None = None  # the bytes read, when the weights are not all on disk
    # Each file's header bytes (what a replica is built from), where they were read: always
    # from the Hub, on disk when asked.
    prefixes: tuple[bytes, ...] = ()

    # Each raises ModelLoadError where a field it reads has the wrong type or is past
    # llama.cpp's limits (the header was read whole: its fields are checked where used).
    @property
    def info(self) -> GGUFInfo:
        with _load_error():
            return read_gguf(self.where, self.header, self.size)

    @property
    def shape(self) -> ModelShape:
        with _load_error():
            return ModelShape.from_header(self.header)

    @property
    def names(self) -> list[str]:
        """Its files' names, a split's in order."""
        first = PARTIAL.sub("", self.where.rpartition("/")[2])
        with _load_error():
            return [first, *split_parts(first, self.header)]


@contextlib.contextmanager
def _load_error() -> Iterator[None]:
    try:
        yield
    except GGUFError as error:
        raise ModelLoadError(str(error)) from None


def grown_header(
    where: str, size: int, read: Callable[[int, int], bytes], first: int, whole: bool = True
) -> tuple[GGUFHeader, bytes, int]:
    """The header, its bytes, and how many were read: read(start, end) gives the file's first
    bytes, then twice as many, and so on (or as far as the field being read needs), until it
    parses; whole: size is the file's, not a download's start."""
    data, end = bytearray(), min(first, size)
    while True:
        data += read(len(data), end)
        if len(data) != end:
            raise OSError(f"asked for {end} bytes of {where}, got {len(data)}")
        try:
            header = read_header(where, whole=whole and end == size, data=data)
            return header, bytes(data[: header.data_start]), end
        except HeaderIncomplete as short:
            if whole and short.needed > size:  # a corrupt length: not worth the file's GBs
                raise GGUFError(
                    f"{where} is not a readable GGUF file (truncated or corrupt: its header goes "
                    f"on past byte {short.needed:,}, and the file has {size:,}); download it again"
                ) from None
            if end == size:
                raise
            end = min(max(2 * end, short.needed), size)


def _on_disk(path: Path, whole: bool, prefix: bool) -> tuple[GGUFHeader, bytes]:
    if not prefix:
        return read_header(path, whole=whole), b""
    check_gguf_magic(path)
    with path.open("rb") as file:

        def read(start: int, end: int) -> bytes:
            file.seek(start)
            return file.read(end - start)

        return grown_header(str(path), path.stat().st_size, read, FIRST_READ, whole)[:2]


def header_on_disk(path: Path, prefixes: bool = False) -> ModelHeader:
    """ModelLoadError when a file is not a readable GGUF (a download's start may end anywhere
    after its header); prefixes: keep each file's first bytes, as ModelHeader.prefixes."""
    name = PARTIAL.sub("", path.name)
    whole = name == path.name
    with _load_error():
        first, prefix = _on_disk(path, whole, prefixes)
        names = split_parts(name, first)
        rest = [_on_disk(path.with_name(n), True, prefixes) for n in names]
        header = joined([first, *(part for part, _ in rest)], str(path))
    kept = (prefix, *(data for _, data in rest)) if prefixes else ()
    if not whole:
        return ModelHeader(header, str(path), header.size, path.stat().st_size, kept)
    size = sum(path.with_name(n).stat().st_size for n in [path.name, *names])
    return ModelHeader(header, str(path), size, prefixes=kept)
