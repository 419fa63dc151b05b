"""Download one file from the Hugging Face Hub into the standard cache, resumably.

huggingface-hub 2.4 downloads into a temporary file unique to each process and deletes it when the
download fails, so a download stopped by Ctrl-C, a killed process or a reboot starts again from
zero. quill keeps the partial file at a stable place, blobs/<etag>.incomplete in the usual cache
layout, and continues it with an HTTP Range request. Everything else is the library's own: the
metadata request (authentication, redirects, typed errors) and http_get (the byte transfer, with
retries that resume within one run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from filelock import FileLock
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.file_download import http_get, repo_folder_name
from huggingface_hub.utils import build_hf_headers

RESUME_CHUNK = 2**20


@dataclass(frozen=True)
class HubFile:
    repo: str
    filename: str
    revision: str
    commit: str
    etag: str  # the sha256 for large (LFS) files, the git blob id for small ones
    size: int
    location: str  # where the bytes are (the CDN, for large files)

    @property
    def storage(self) -> Path:
        return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=self.repo, repo_type="model")

    @property
    def blob(self) -> Path:
        return self.storage / "blobs" / self.etag

    @property
    def partial(self) -> Path:
        return self.blob.with_name(self.etag + ".incomplete")

    @property
    def lock(self) -> Path:
        # Where huggingface-hub keeps its own locks, so both tools exclude each other.
        folder = repo_folder_name(repo_id=self.repo, repo_type="model")
        return Path(constants.HF_HUB_CACHE) / ".locks" / folder / f"{self.etag}.lock"

    @property
    def pointer(self) -> Path:
        return self.storage / "snapshots" / self.commit / self.filename


def hub_file(repo: str, filename: str, revision: str | None) -> HubFile:
    """Ask the Hub about one file (a HEAD request). Raises huggingface-hub's typed errors."""
    revision = revision or constants.DEFAULT_REVISION
    metadata = get_hf_file_metadata(hf_hub_url(repo, filename, revision=revision))
    if metadata.commit_hash is None or metadata.etag is None or metadata.size is None:
        raise OSError(f"the Hub's answer for {repo}/{filename} lacks its commit, etag or size")
    return HubFile(
        repo=repo,
        filename=filename,
        revision=revision,
        commit=metadata.commit_hash,
        etag=metadata.etag,
        size=metadata.size,
        location=metadata.location,
    )


def resumable_bytes(file: HubFile) -> int:
    return file.partial.stat().st_size if file.partial.exists() else 0


def download(file: HubFile, tqdm_class: type | None = None) -> Path:
    """Fetch the file into the cache (continuing a partial one) and return its snapshot path."""
    file.blob.parent.mkdir(parents=True, exist_ok=True)
    file.lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(file.lock):
        if not file.blob.exists():
            resume = resumable_bytes(file)
            if resume > file.size:  # not a prefix of this file after all
                file.partial.unlink()
                resume = 0
            # The token goes to the Hub only, never to the CDN a large file redirects to.
            same_host = urlparse(file.location).netloc == urlparse(constants.ENDPOINT).netloc
            headers = build_hf_headers() if same_host else {}
            # The client writes (and reports progress) a chunk at a time, 10 MB by default: a
            # resume restarts at the last whole chunk. 1 MiB loses less and moves the bar smoothly.
            constants.DOWNLOAD_CHUNK_SIZE = RESUME_CHUNK
            with file.partial.open("ab") as out:
                http_get(
                    file.location,
                    out,
                    resume_size=resume,
                    headers=headers,
                    expected_size=file.size,
                    displayed_filename=file.filename,
                    tqdm_class=tqdm_class,
                )
            file.partial.replace(file.blob)
        file.pointer.parent.mkdir(parents=True, exist_ok=True)
        if not file.pointer.exists():
            file.pointer.unlink(missing_ok=True)  # a dangling link to a blob moved aside
            os.symlink(os.path.relpath(file.blob, file.pointer.parent), file.pointer)
        if file.revision != file.commit:
            ref = file.storage / "refs" / file.revision
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(file.commit)
    return file.pointer
