"""A model's GGUF header without its weights, from its file on disk: whole, a download's start, or
each file of a split (hub.py reads one from the Hub by range requests, models.py chooses). A
header is a few MB at the start of a file of GBs, and the memory plan needs nothing else."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from cli.errors import ModelLoadError
from quant.gguf import GGUFError, GGUFHeader, GGUFInfo, joined, read_gguf, read_header, split_parts
from quant.memory import ModelShape

# A download's start: huggingface-hub's blobs/ETAG.incomplete, a browser's or wget's NAME.part.
PARTIAL = re.compile(r"\.(incomplete|part)$")


@dataclass(frozen=True)
class ModelHeader:
    header: GGUFHeader  # a split's: its first file's fields, every file's tensors
    where: str  # the path, or hf://OWNER/REPO/FILE
    size: int  # of the whole file (every file of a split)
    read: int | None = None  # the bytes read, when the weights are not all on disk

    @property
    def info(self) -> GGUFInfo:
        return read_gguf(self.where, self.header, self.size)

    @property
    def shape(self) -> ModelShape:
        return ModelShape.from_header(self.header)


def header_on_disk(path: Path) -> ModelHeader:
    """ModelLoadError when a file is not a readable GGUF (a download's start may end anywhere
    after its header)."""
    name = PARTIAL.sub("", path.name)
    whole = name == path.name
    try:
        first = read_header(path, whole=whole)
        names = split_parts(name, first)
        header = joined([first, *(read_header(path.with_name(n)) for n in names)], str(path))
    except GGUFError as error:
        raise ModelLoadError(str(error)) from None
    if not whole:
        return ModelHeader(header, str(path), header.size, path.stat().st_size)
    size = sum(path.with_name(n).stat().st_size for n in [path.name, *names])
    return ModelHeader(header, str(path), size)
