"""A package index on loopback (PEP 503's simple API) serving wheels the tests build, and the pip
environment that sees that index and nothing else of the machine's.

A machine's pip may have a pip.conf (global, user or site), PIP_* variables (find-links, extra
indexes, constraints), and a cache: any of them can change what `pip download` finds, prints or
fetches. pip_environment() drops them all: PIP_CONFIG_FILE set to os.devnull makes pip load no
configuration file at all (a file of our own would still be read after /etc/pip.conf, whose keys
it does not name would stay), every inherited PIP_* variable is removed, and the few settings the
tests mean are given as variables.
"""

from __future__ import annotations

import base64
import hashlib
import os
import time
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest


def build_wheel(folder: Path, name: str, version: str, members: Mapping[str, Path]) -> Path:
    """A wheel of NAME==VERSION holding the given files (path in the wheel -> file on disk),
    stored uncompressed as model wheels are in effect (GGUF does not compress)."""
    project = name.replace("-", "_")
    info = f"{project}-{version}.dist-info"
    texts = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: quill-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    wheel = folder / f"{project}-{version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        for inside, path in members.items():
            archive.write(path, inside)
            record.append(f"{inside},{_record_hash(path.read_bytes())},{path.stat().st_size}")
        for inside, text in texts.items():
            archive.writestr(inside, text)
            record.append(f"{inside},{_record_hash(text.encode())},{len(text.encode())}")
        archive.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return wheel


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


@dataclass
class Index:
    wheels: list[Path]
    seconds_per_mib: float = 0.0  # throttle, so that a download lasts long enough to be seen
    requests: list[str] = field(default_factory=list)
    url: str = ""  # the simple API's root, for PIP_INDEX_URL


@contextmanager
def serve_index(index: Index) -> Iterator[Index]:
    by_file = {wheel.name: wheel for wheel in index.wheels}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            pass

        def do_GET(self) -> None:
            index.requests.append(self.path)
            parts = [part for part in self.path.split("/") if part]
            if len(parts) == 2 and parts[0] == "simple":
                self._project(parts[1])
            elif len(parts) == 2 and parts[0] == "files" and parts[1] in by_file:
                self._file(by_file[parts[1]])
            else:
                self._send(404, b"not found", "text/plain")

        def _project(self, project: str) -> None:
            wanted = project.lower().replace("_", "-")
            links = [
                f'<a href="/files/{w.name}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">'
                f"{w.name}</a>"
                for w in index.wheels
                if w.name.split("-")[0].lower().replace("_", "-") == wanted
            ]
            if not links:
                self._send(404, b"no such project", "text/plain")
                return
            page = "<!DOCTYPE html><html><body>" + "<br>".join(links) + "</body></html>"
            self._send(200, page.encode(), "text/html")

        def _file(self, wheel: Path) -> None:
            data = wheel.read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            piece = 1 << 20
            for start in range(0, len(data), piece):
                self.wfile.write(data[start : start + piece])
                if index.seconds_per_mib:
                    time.sleep(index.seconds_per_mib * min(piece, len(data) - start) / 2**20)

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    index.url = f"http://127.0.0.1:{server.server_address[1]}/simple/"
    # shutdown() waits for serve_forever's next poll: 0.5 s by default, at every test's end.
    thread = Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield index
    finally:
        server.shutdown()
        server.server_close()


def pip_environment(base: Mapping[str, str], index: Index | None) -> dict[str, str]:
    """base without the machine's pip settings, pip seeing only `index` (None: no index at all)."""
    env = {key: value for key, value in base.items() if not key.startswith("PIP_")}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_CACHE_DIR="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
    )
    if index is None:
        env["PIP_NO_INDEX"] = "1"
    else:
        env["PIP_INDEX_URL"] = index.url
    return env


def use_pip_environment(monkeypatch: pytest.MonkeyPatch, index: Index | None) -> None:
    """pip_environment() for the test's own process (quill's library calls run pip from it)."""
    for key in [key for key in os.environ if key.startswith("PIP_")]:
        monkeypatch.delenv(key)
    for key, value in pip_environment({}, index).items():
        monkeypatch.setenv(key, value)
