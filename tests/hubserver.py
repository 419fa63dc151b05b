"""A local stand-in for the part of the Hugging Face Hub protocol that huggingface-hub uses to
download one file: HEAD and GET on /{repo}/resolve/{revision}/{file}, with X-Repo-Commit, ETag,
Content-Length and Range. It counts every request, so a test can prove that none was made."""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<file>.+)$")


@dataclass
class Hub:
    files: dict[tuple[str, str], Path]  # (repo, filename) -> file served
    gated: set[str] = field(default_factory=set)
    requests: list[str] = field(default_factory=list)
    url: str = ""


@contextmanager
def serve_hub(hub: Hub) -> Iterator[Hub]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            hub.requests.append(f"{self.command} {self.path}")
            match = RESOLVE.match(self.path.split("?")[0])
            if match is None:
                return self._error(404, "RepoNotFound")
            repo, name = match["repo"], match["file"]
            if repo in hub.gated:
                return self._error(401, "GatedRepo", "Access to this repo is restricted.")
            path = hub.files.get((repo, name))
            if path is None:
                known = any(r == repo for r, _ in hub.files)
                return self._error(404, "EntryNotFound" if known else "RepoNotFound")
            data = path.read_bytes()
            start, end = 0, len(data) - 1
            ranged = self.headers.get("Range")
            if ranged and body:
                first, _, last = ranged.removeprefix("bytes=").partition("-")
                start, end = int(first), int(last) if last else len(data) - 1
            self.send_response(206 if ranged and body else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start + 1))
            if ranged and body:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.end_headers()
            if body:
                self.wfile.write(data[start : end + 1])

        def _error(self, status: int, code: str, message: str = "") -> None:
            payload = f'{{"error": "{message or code}"}}'.encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            if message:
                self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
