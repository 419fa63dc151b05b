"""The Hugging Face Hub as a source: where its cache keeps a file, which file of a repository a
quant names, downloading one (resumable, through hubdownload), and its typed errors mapped once to
the phrase a user reads. huggingface-hub is imported only when the Hub is really asked.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from cli.errors import DiskSpaceError, ModelNotFoundError
from cli.store.registry import HubSource
from cli.units import human_bytes

Report = Callable[[str], None]
SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now: huggingface-hub reads it once, when first imported."""
    from huggingface_hub import constants

    live = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return live or bool(constants.HF_HUB_OFFLINE)


def cached_file(repo: str, file: str, revision: str | None) -> Path | None:
    """The file in the Hugging Face cache, looked up as huggingface-hub's try_to_load_from_cache
    does (refs/REVISION names the snapshot) but without importing it: importing it takes longer
    than `quill list` may."""
    folder = Path(cache_root()) / f"models--{repo.replace('/', '--')}"
    revision = revision or "main"
    ref = folder / "refs" / revision
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    found = folder / "snapshots" / commit / file
    return found if found.is_file() else None


def cache_root() -> str:
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
    from urllib.parse import urlparse

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


def download_file(
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
        check_free_space(Path(_hub_cache_dir()), remote.size - done, f"{source.repo}/{file}")
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


def check_free_space(folder: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    # Leave a margin: a full disk breaks more than the download.
    if needed and free < needed + 256 * 2**20:
        raise DiskSpaceError(
            f"not enough disk space for {what}: it needs {human_bytes(needed)}, {folder} has "
            f"{human_bytes(free)} free; free some space or set HF_HOME to a larger disk"
        )


def repo_file_for_quant(repo: str, quant: str, offline: bool) -> str:
    """OWNER/REPO:QUANT -> the one GGUF file in the repository with that quantization."""
    files = _repo_files(repo, offline)
    ggufs = sorted(f for f in files if f.endswith(".gguf") and not SPLIT_GGUF.search(f))
    wanted = re.compile(rf"(^|[-._/]){re.escape(quant)}([-._]|$)", re.IGNORECASE)
    matches = [f for f in ggufs if wanted.search(f.removesuffix(".gguf"))]
    if len(matches) == 1:
        return matches[0]
    if not ggufs:
        raise ModelNotFoundError(f"{repo} holds no single-file GGUF model")
    listing = ", ".join(f"{repo}:{_quant_of(f)}" for f in ggufs)
    if matches:
        raise ModelNotFoundError(f"{repo}:{quant} is ambiguous: {', '.join(matches)}")
    raise ModelNotFoundError(f"{repo} has no {quant} file; available: {listing}")
