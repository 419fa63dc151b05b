"""The Hugging Face Hub as a source: where its cache keeps a file, which file of a repository a
quant names, a download into the standard cache, a file's header alone by HTTP range requests, and
its typed errors as the phrase a user reads. huggingface-hub is imported only when the Hub is
really asked.

The library deletes its per-process temporary file when a download fails, so a download stopped
by Ctrl-C, a kill or a reboot would start from zero; quill keeps it at blobs/<etag>.incomplete
and continues it with an HTTP Range request through the library's own metadata call and http_get.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from cli.errors import DiskSpaceError
from cli.store.header import FIRST_READ, ModelHeader, grown_header
from cli.store.sources import Fetch, Fetched, SourceFailed
from cli.units import human_bytes
from quant.gguf import SPLIT_NAME, GGUFHeader, joined, split_parts

RESUME_CHUNK = 2**20
DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's -hf takes when a repository is named alone
FIRST_RANGE = FIRST_READ  # a header's first request


@dataclass(frozen=True)
class HubSource:
    """A file of a Hub repository; with no file named, the one single-file GGUF whose name
    carries the quant (OWNER/REPO:QUANT, as llama.cpp's -hf)."""

    repo: str
    file: str | None = None
    revision: str | None = None
    quant: str = DEFAULT_QUANT
    # False: OWNER/REPO alone (quill pull chooses by fit; run takes DEFAULT_QUANT)
    quant_named: bool = True

    def describe(self) -> str:
        return f"Hugging Face {self.repo}"

    def cached(self, home: Path) -> Path | None:
        """The file in the Hugging Face cache, found as huggingface-hub's try_to_load_from_cache
        does (refs/REVISION names the snapshot) without importing it, which `quill list` cannot
        afford."""
        folder = _repo_folder(self.repo)
        revision = self.revision or "main"
        ref = folder / "refs" / revision
        try:
            listed = (p.name for p in folder.glob("snapshots/*/*") if p.is_file())
            file = self.file or self._file_for_quant(sorted(set(listed)))
            commit = ref.read_text().strip() if ref.is_file() else revision
        except (SourceFailed, OSError):
            return None
        found = folder / "snapshots" / commit / file
        return found if found.is_file() else None

    def fetch(self, home: Path, how: Fetch) -> Fetched:
        """Download into the Hugging Face cache."""
        remote = self.ask(how)
        file = remote.filename
        try:
            done = remote.resumable
            os.makedirs(cache_root(), exist_ok=True)
            check_free_space(Path(cache_root()), remote.size - done, f"{self.repo}/{file}")
            resuming = f", resuming at {human_bytes(done)}" if done else ""
            how.report(
                f"downloading {file} ({human_bytes(remote.size)}{resuming}) from {self.describe()}"
            )
            path = remote.download(how.progress)
        except _hub_errors() as error:
            raise SourceFailed(self.describe(), _hub_failure(error, file, self.revision)) from None
        # A large file's etag is its sha256: the Hub vouches for the bytes with it.
        sha256 = remote.etag if re.fullmatch(r"[0-9a-f]{64}", remote.etag) else None
        return Fetched(path, file, "hf", self.repo, sha256)

    def ask(self, how: Fetch, file: str | None = None, splits: bool = False) -> HubFile:
        """The Hub's facts on the file (or on another file of the repository); splits: a quant
        may name the first file of a split GGUF."""
        from huggingface_hub import HfApi
        from huggingface_hub.utils import logging

        self._check_reachable(how)
        # Its retry warnings are noise next to quill's own summary unless asked for.
        logging.set_verbosity_info() if how.verbose else logging.set_verbosity_error()
        file = file or self.file or ""
        try:
            file = file or self._file_for_quant(HfApi().list_repo_files(self.repo), splits)
            return HubFile.ask(self.repo, file, self.revision)
        except _hub_errors() as error:
            raise SourceFailed(self.describe(), _hub_failure(error, file, self.revision)) from None

    def _check_reachable(self, how: Fetch) -> None:
        # HF_HUB_OFFLINE is the Hub's own switch; offline means no network at all.
        if how.offline or hub_offline():
            raise SourceFailed(self.describe(), "skipped, offline")
        unresolvable = _hub_unresolvable()
        if unresolvable is not None:
            raise SourceFailed(self.describe(), unresolvable)

    def gguf_files(self, how: Fetch) -> list[str]:
        """The repository's models: each single-file GGUF, and the first file of each split one."""
        from huggingface_hub import HfApi

        self._check_reachable(how)
        try:
            files = HfApi().list_repo_files(self.repo, revision=self.revision)
        except _hub_errors() as error:
            raise SourceFailed(self.describe(), _hub_failure(error, "", self.revision)) from None
        return _models(files, splits=True)

    def header(self, how: Fetch) -> ModelHeader:
        """The file's header (a split's files joined) by HTTP range requests; no weights."""
        files = [self.ask(how, splits=True)]
        where = f"hf://{self.repo}/{files[0].filename}"
        try:
            parts = [files[0].read_header()]
            for name in split_parts(files[0].filename, parts[0][0]):
                files.append(self.ask(how, name))
                parts.append(files[-1].read_header())
            header = joined([part for part, _, _ in parts], where)
        except _hub_errors() as error:
            failure = _hub_failure(error, files[-1].filename, self.revision)
            raise SourceFailed(self.describe(), failure) from None
        prefixes, read = tuple(data for _, data, _ in parts), sum(n for _, _, n in parts)
        return ModelHeader(header, where, sum(f.size for f in files), read, prefixes)

    def _file_for_quant(self, files: list[str], splits: bool = False) -> str:
        """The one single-file GGUF in the repository with this quantization (or, with splits,
        the first file of a split one: pull fetches one file, a header needs only that)."""
        ggufs = _models(files, splits)
        wanted = re.compile(rf"(^|[-._/]){re.escape(self.quant)}([-._]|$)", re.IGNORECASE)
        matches = [f for f in ggufs if wanted.search(f.removesuffix(".gguf"))]
        if len(matches) == 1:
            return matches[0]
        if not ggufs:
            raise SourceFailed(self.repo, "holds no single-file GGUF model")
        if matches:
            raise SourceFailed(f"{self.repo}:{self.quant}", f"ambiguous: {', '.join(matches)}")
        quants = (re.split(r"[-.]", SPLIT_NAME.sub("", f).removesuffix(".gguf"))[-1] for f in ggufs)
        listing = ", ".join(f"{self.repo}:{quant}" for quant in quants)
        raise SourceFailed(self.repo, f"has no {self.quant} file; available: {listing}")


def _models(files: list[str], splits: bool) -> list[str]:
    """The GGUF files that are a model each (with splits: a split model's first file)."""
    parts = {f: SPLIT_NAME.search(f) for f in files if f.endswith(".gguf")}
    return sorted(f for f, at in parts.items() if not at or (splits and at[1] == "00001"))


@dataclass(frozen=True)
class HubFile:
    """One file of a Hub repository, as its metadata request describes it."""

    repo: str
    filename: str
    revision: str
    commit: str
    etag: str  # the sha256 for large (LFS) files, the git blob id for small ones
    size: int
    location: str  # where the bytes are (the CDN, for large files)

    @classmethod
    def ask(cls, repo: str, filename: str, revision: str | None) -> HubFile:
        """Ask the Hub about one file (a HEAD request); raises huggingface-hub's typed errors."""
        from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

        revision = revision or constants.DEFAULT_REVISION
        meta = get_hf_file_metadata(hf_hub_url(repo, filename, revision=revision))
        if meta.commit_hash is None or meta.etag is None or meta.size is None:
            raise OSError(f"the Hub's answer for {repo}/{filename} lacks its commit, etag or size")
        return cls(repo, filename, revision, meta.commit_hash, meta.etag, meta.size, meta.location)

    @property
    def blob(self) -> Path:
        return _repo_folder(self.repo) / "blobs" / self.etag

    @property
    def partial(self) -> Path:
        return self.blob.with_name(self.etag + ".incomplete")

    @property
    def resumable(self) -> int:
        return self.partial.stat().st_size if self.partial.exists() else 0

    def read_header(self) -> tuple[GGUFHeader, bytes, int]:
        """The header, its bytes, and the bytes read for it, by growing range requests."""
        from huggingface_hub import constants
        from huggingface_hub.utils import hf_raise_for_status, http_stream_backoff

        def read(start: int, end: int) -> bytes:
            headers = {**self._token(), "Range": f"bytes={start}-{end - 1}"}
            timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
            with http_stream_backoff("GET", self.location, headers=headers, timeout=timeout) as got:
                hf_raise_for_status(got)
                if got.status_code != 206:  # the whole file would follow
                    raise OSError(f"{urlparse(self.location).netloc} ignored a byte range")
                return got.read()

        return grown_header(f"hf://{self.repo}/{self.filename}", self.size, read, FIRST_RANGE)

    def _token(self) -> dict[str, str]:
        """The token goes to the Hub only, never to the CDN a large file redirects to."""
        from huggingface_hub import constants
        from huggingface_hub.utils import build_hf_headers

        same_host = urlparse(self.location).netloc == urlparse(constants.ENDPOINT).netloc
        return build_hf_headers() if same_host else {}

    def download(self, tqdm_class: type | None = None) -> Path:
        """Fetch the file into the cache (continuing a partial one); its snapshot path."""
        from filelock import FileLock
        from huggingface_hub import constants
        from huggingface_hub.file_download import http_get

        pointer = _repo_folder(self.repo) / "snapshots" / self.commit / self.filename
        # Where huggingface-hub keeps its own locks, so both tools exclude each other.
        lock = Path(cache_root()) / ".locks" / _repo_folder(self.repo).name / f"{self.etag}.lock"
        self.blob.parent.mkdir(parents=True, exist_ok=True)
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(lock):
            if not self.blob.exists():
                resume = self.resumable
                if resume > self.size:  # not a prefix of this file after all
                    self.partial.unlink()
                    resume = 0
                # The client writes (and reports) a chunk at a time, 10 MB by default: a resume
                # restarts at the last whole chunk. 1 MiB loses less and moves the bar smoothly.
                constants.DOWNLOAD_CHUNK_SIZE = RESUME_CHUNK
                with self.partial.open("ab") as out:
                    http_get(
                        self.location,
                        out,
                        resume_size=resume,
                        headers=self._token(),
                        expected_size=self.size,
                        displayed_filename=self.filename,
                        tqdm_class=tqdm_class,
                    )
                self.partial.replace(self.blob)
            pointer.parent.mkdir(parents=True, exist_ok=True)
            if not pointer.exists():
                pointer.unlink(missing_ok=True)  # a dangling link to a blob moved aside
                os.symlink(os.path.relpath(self.blob, pointer.parent), pointer)
            if self.revision != self.commit:
                ref = _repo_folder(self.repo) / "refs" / self.revision
                ref.parent.mkdir(parents=True, exist_ok=True)
                ref.write_text(self.commit)
        return pointer


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now: huggingface-hub reads it once, when first imported."""
    from huggingface_hub import constants

    live = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return live or bool(constants.HF_HUB_OFFLINE)


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
    """Why the Hub's host cannot be resolved, or None if it can: huggingface-hub retries a failed
    connection for some 20 s, but a name that does not resolve means no network, at once."""
    import socket

    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname or ""
    try:
        socket.getaddrinfo(host, endpoint.port or (443 if endpoint.scheme == "https" else 80))
    except socket.gaierror as error:
        return f"cannot resolve {host} ({error.strerror or error}); no network?"
    except UnicodeError as error:  # IDNA refuses the name (a label over 63 characters): no lookup
        return f"cannot resolve {host} (not a valid host name: {error})"
    return None


def _hub_failure(error: Exception, file: str, revision: str | None) -> str:
    """One phrase for what the Hub answered: huggingface-hub's typed errors mapped once (a
    subclass before its base)."""
    from huggingface_hub import errors as hub

    phrases: list[tuple[type[Exception], str]] = [
        (hub.GatedRepoError, "gated; accept its terms on the Hub, then put a token in HF_TOKEN "
         "or run `hf auth login`"),
        (hub.RepositoryNotFoundError, "no such repository, or a private one and your token "
         "(HF_TOKEN or `hf auth login`) is missing or wrong"),
        (hub.RevisionNotFoundError, f"no revision {revision}"),
        (hub.EntryNotFoundError, f"has no file {file}"),
        (hub.OfflineModeIsEnabled, "skipped, offline"),
        (hub.LocalEntryNotFoundError, "cannot reach the Hub (no network?)"),
        (hub.HfHubHTTPError, str(error).partition("\n")[0]),
    ]  # fmt: skip
    return next((phrase for kind, phrase in phrases if isinstance(error, kind)), str(error))


def _hub_errors() -> tuple[type[Exception], ...]:
    import httpx2
    from huggingface_hub import errors as hub_errors

    return (hub_errors.HfHubHTTPError, httpx2.HTTPError, OSError, ValueError)


def _repo_folder(repo: str) -> Path:
    return Path(cache_root()) / f"models--{repo.replace('/', '--')}"


def check_free_space(folder: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    # Leave a margin: a full disk breaks more than the download.
    if needed and free < needed + 256 * 2**20:
        raise DiskSpaceError(
            f"not enough disk space for {what}: it needs {human_bytes(needed)}, {folder} has "
            f"{human_bytes(free)} free; free some space or set HF_HOME to a larger disk"
        )
