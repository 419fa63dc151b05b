"""A local stand-in for the part of the Hugging Face Hub protocol that huggingface-hub uses to list
a repository and download a file, reached through HF_ENDPOINT by the real client.

  GET  /api/models/{repo}/tree/{revision}      the repository's files (JSON)
  HEAD /{repo}/resolve/{revision}/{file}       302 to the "CDN", with X-Repo-Commit, X-Linked-Etag
  GET  /{repo}/resolve/{revision}/{file}         (the sha256 of the file) and X-Linked-Size, as the
                                                 Hub answers for large (LFS) files
  HEAD/GET /cdn/{repo}/{file}                  the bytes, with Content-Length and Range

It counts every request and every byte sent, and can misbehave on purpose: send bytes slowly,
drop the connection halfway once, or serve corrupted bytes under the right checksum.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<file>.+)$")
CDN = re.compile(r"^/cdn/(?P<repo>[^/]+/[^/]+)/(?P<file>.+)$")
TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<revision>[^/?]+)")


@dataclass
class Transfer:
    path: str
    start: int  # first byte sent (from the Range header)
    sent: int  # bytes actually written
    end: int | None = None  # the last byte a range asked for (a header read); None: to the end


@dataclass
class Hub:
    files: dict[tuple[str, str], Path]  # (repo, filename) -> file served
    gated: set[str] = field(default_factory=set)
    cut_once: set[str] = field(default_factory=set)  # filenames whose first GET stops early
    cut_at: float = 0.5  # the fraction of the file sent before the connection drops
    corrupt: set[str] = field(default_factory=set)  # filenames served with one byte changed
    seconds_per_mib: float = 0.0  # throttle
    requests: list[str] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    url: str = ""
    cdn_url: str = ""  # another origin, as the Hub's CDN is: HEAD does not follow it

    # Checksums given rather than computed: a sparse file claiming tens of GB is never read whole.
    etags: dict[Path, str] = field(default_factory=dict)

    @property
    def downloads(self) -> list[Transfer]:
        """The transfers to the file's end: downloads, not the header's range reads."""
        return [transfer for transfer in self.transfers if transfer.end is None]

    def sha256(self, path: Path) -> str:
        if path not in self.etags:
            self.etags[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        return self.etags[path]


@contextmanager
def serve_hub(hub: Hub) -> Iterator[Hub]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._route(body=False)

        def do_GET(self) -> None:
            self._route(body=True)

        def _route(self, body: bool) -> None:
            hub.requests.append(f"{self.command} {self.path}")
            path = self.path.split("?")[0]
            if match := TREE.match(path):
                return self._tree(match["repo"])
            if match := RESOLVE.match(path):
                return self._resolve(match["repo"], match["file"])
            if match := CDN.match(path):
                return self._bytes(match["repo"], match["file"], body)
            return self._error(404, "RepoNotFound")

        def _known(self, repo: str, name: str) -> Path | None:
            if repo in hub.gated:
                self._error(401, "GatedRepo", "Access to this repo is restricted.")
                return None
            found = hub.files.get((repo, name))
            if found is None:
                known = any(r == repo for r, _ in hub.files)
                self._error(404, "EntryNotFound" if known else "RepoNotFound")
            return found

        def _tree(self, repo: str) -> None:
            entries = [
                {"type": "file", "path": name, "size": p.stat().st_size, "oid": COMMIT}
                for (r, name), p in hub.files.items()
                if r == repo
            ]
            if not entries:
                return self._error(404, "RepoNotFound")
            self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"})

        def _resolve(self, repo: str, name: str) -> None:
            path = self._known(repo, name)
            if path is None:
                return
            headers = {
                "Location": f"{hub.cdn_url}/cdn/{repo}/{name}",
                "X-Repo-Commit": COMMIT,
                "X-Linked-Etag": f'"{hub.sha256(path)}"',
                "X-Linked-Size": str(path.stat().st_size),
                "ETag": f'"{hub.sha256(path)}"',
            }
            self._send(302, b"", headers)

        def _bytes(self, repo: str, name: str, body: bool) -> None:
            path = self._known(repo, name)
            if path is None:
                return
            size = path.stat().st_size
            start, end = 0, size - 1
            ranged = self.headers.get("Range")
            if ranged:
                first, _, last = ranged.removeprefix("bytes=").partition("-")
                start, end = int(first), min(int(last), size - 1) if last else size - 1
            self.send_response(206 if ranged else 200)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start + 1))
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if not body:
                return
            named_end = ranged and not ranged.endswith("-")
            transfer = Transfer(name, start, 0, end if named_end else None)
            hub.transfers.append(transfer)
            stop = end + 1
            if name in hub.cut_once and not ranged:
                hub.cut_once.discard(name)
                stop = start + int((end + 1 - start) * hub.cut_at)
            chunk = 1 << 18
            with path.open("rb") as source:  # only the bytes asked for are read
                source.seek(start)
                for offset in range(start, stop, chunk):
                    piece = bytearray(source.read(min(chunk, stop - offset)))
                    if name in hub.corrupt and offset <= size // 2 < offset + len(piece):
                        piece[size // 2 - offset] ^= 0xFF
                    # Counted before the client can have it: once a request returns, its count
                    # is whole.
                    transfer.sent += len(piece)
                    try:
                        self.wfile.write(piece)
                        self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        transfer.sent -= len(piece)
                        return
                    if hub.seconds_per_mib:
                        time.sleep(hub.seconds_per_mib * len(piece) / 2**20)
            if stop <= end:
                self.close_connection = True  # the "dropped connection"

        def _send(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _error(self, status: int, code: str, message: str = "") -> None:
            headers = {"X-Error-Code": code, "Content-Type": "application/json"}
            if message:
                headers["X-Error-Message"] = message
            self._send(status, json.dumps({"error": message or code}).encode(), headers)

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(2)]
    for server in servers:
        server.daemon_threads = True
        # shutdown() waits for serve_forever's next poll: 0.5 s by default, at every test's end.
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    hub.url, hub.cdn_url = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
    try:
        yield hub
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
