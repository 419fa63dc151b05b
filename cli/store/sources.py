"""A source of a model file says whether the file is on disk already and, if not, fetches it:
the Hub (hub.py), wheels on the package index (wheels.py) and a file on disk (here) each answer
for themselves, so the store walks its sources without asking which kind it holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cli.errors import ModelNotFoundError

Report = Callable[[str], None]


@dataclass(frozen=True)
class Fetch:
    """How to fetch: offline means no network at all; progress is a tqdm class for a byte
    counter (None: no bar); verbose shows what pip says."""

    offline: bool = False
    report: Report = lambda _line: None
    progress: type | None = None
    verbose: bool = False


@dataclass(frozen=True)
class Fetched:
    path: Path
    file: str  # as the source names it
    source: str  # the manifest's word for where it came from: "hf" or "pypi"
    repo: str | None = None
    sha256: str | None = None  # what the source itself vouches for (the Hub's LFS hash)


class SourceFailed(ModelNotFoundError):
    """One source could not give the file; the store tries the next."""

    def __init__(self, where: str, reason: str):
        self.where, self.reason = where, reason
        super().__init__(f"{where}: {reason}")


class Source(Protocol):
    def cached(self, home: Path) -> Path | None: ...  # never touches the network
    def fetch(self, home: Path, how: Fetch) -> Fetched: ...  # or raises SourceFailed
    def describe(self) -> str: ...


@dataclass(frozen=True)
class LocalFile:
    """A file the user named by its path, or one `quill quantize` made."""

    path: Path

    def cached(self, home: Path) -> Path | None:
        return self.path if self.path.is_file() else None

    def fetch(self, home: Path, how: Fetch) -> Fetched:
        raise SourceFailed(self.describe(), "no such file")

    def describe(self) -> str:
        return str(self.path)
