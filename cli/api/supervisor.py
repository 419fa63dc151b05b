"""`quill serve --rpc` as two processes: this one holds the user's port, a child `quill serve`
(the same command line) holds the models. llama.cpp's RPC client ends its process when a server
it uses is lost (GGML_ABORT, no way back), so the models split over RPC servers live in the
child. When it ends, each reply it was streaming ends with an error event and a request it had
not begun answering gets a 503; this process goes on listening, and the next request starts the
child again (its models load anew, from the RPC servers that are back, or the request gets the
child's reason in a 503). Requests and replies pass through unchanged: limits, keys, hosts and
routes are the child's, which runs with the same options. Nothing here loads llama.cpp.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import httpx2
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from cli.api.server import ApiError
from cli.errors import EXIT_INTERNAL, EXIT_OK

if TYPE_CHECKING:
    from cli.api.http import HttpLimits

CHILD_ENV = "QUILL_SERVE_CHILD"  # "FD:PORT": the child's listening socket, the user's port
START_WAIT_S = 600.0  # a child loads its first model before it answers (an RPC split is slow)
POLL_S = 0.05
STDERR_DRAIN_S = 2.0  # an ended child's last stderr lines, read before its reason is told
RETRY_S = 2.0  # after a start that failed, requests are refused this long before another
# Hop-by-hop headers (RFC 9110 7.6.1), and the lengths the two connections frame for themselves.
_NOT_PASSED = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
}
STREAMED = ("text/event-stream", "application/x-ndjson")


class ChildUnavailableError(Exception):
    """The child could not start serving (its reason, as it said it on stderr)."""


def child_socket() -> tuple[socket.socket, int] | None:
    """In the child: the listening socket its parent passed, and the port users reach. From
    then on the child ends itself (SIGTERM: it drains) if its parent is gone, killed or not."""
    passed = os.environ.get(CHILD_ENV)
    if not passed:
        return None
    fd, port = passed.split(":")
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return socket.socket(fileno=int(fd)), int(port)


@dataclass
class Child:
    """The child `quill serve`: started on demand, one at a time, its stderr passed through
    to ours (the last error line kept, to tell a refused request why)."""

    argv: list[str]
    user_port: int
    process: subprocess.Popen | None = None
    port: int = 0
    last_error: str = ""
    failed: bool = False  # the last start ended before it served
    retry_at: float = 0.0
    draining: bool = False
    stderr_passer: threading.Thread | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def start(self) -> None:
        inner = socket.create_server(("127.0.0.1", 0), backlog=1024)
        inner.set_inheritable(True)
        self.port = inner.getsockname()[1]
        env = os.environ | {CHILD_ENV: f"{inner.fileno()}:{self.user_port}"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cli", *self.argv],
            env=env,
            pass_fds=(inner.fileno(),),
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches this process, which passes it on
        )
        inner.close()
        self.stderr_passer = threading.Thread(
            target=self._pass_stderr, args=(self.process,), daemon=True
        )
        self.stderr_passer.start()

    def _pass_stderr(self, process: subprocess.Popen) -> None:
        assert process.stderr is not None
        for line in process.stderr:
            sys.stderr.buffer.write(line)
            sys.stderr.flush()
            text = line.decode(errors="replace").strip()
            if "error:" in text:
                self.last_error = text.split("error:", 1)[1].strip()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_serving(self, deadline: float) -> None:
        """Until the child answers /health (its first model loaded); ChildUnavailableError
        when it ends first or the deadline passes."""
        while time.monotonic() < deadline:
            if not self.alive:
                code = self.process.returncode if self.process else None
                if self.stderr_passer is not None:  # its last lines, the reason among them
                    self.stderr_passer.join(timeout=STDERR_DRAIN_S)
                why = self.last_error or f"it exited with code {code}"
                raise ChildUnavailableError(why)
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as probe:
                    probe.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    if probe.recv(12).startswith(b"HTTP/1.1 200"):
                        return
            except OSError:
                pass
            time.sleep(POLL_S)
        raise ChildUnavailableError(f"it did not start serving within {START_WAIT_S:g} s")

    async def serving(self) -> int:
        """The child's port, once it serves: started again if it ended, but not sooner than
        RETRY_S after a start that failed (a health check every second would start it every
        second); ChildUnavailableError meanwhile, with the reason it gave."""
        async with self.lock:
            if not self.alive:
                assert self.process is not None  # started before the server listens
                if self.failed and time.monotonic() < self.retry_at:
                    raise ChildUnavailableError(self.last_error)
                code = self.process.returncode
                sys.stderr.write(
                    f"quill serve: the model process ended (exit code {code}); starting it again\n"
                )
                self.last_error = ""
                self.start()
                try:
                    await asyncio.to_thread(self.wait_serving, time.monotonic() + START_WAIT_S)
                except ChildUnavailableError:
                    self.failed, self.retry_at = True, time.monotonic() + RETRY_S
                    raise
                self.failed = False
            return self.port

    def drain(self) -> None:
        """SIGTERM, once: the child drains its requests and exits (a second would cut them)."""
        if self.process is not None and not self.draining:
            self.draining = True
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        """The child's exit code, once it has drained."""
        if self.process is None:
            return 0
        self.drain()
        return self.process.wait()


class ProxyApp:
    """Every request, to the child and back."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.client = httpx2.AsyncClient(timeout=httpx2.Timeout(None), trust_env=False)

    def begin_drain(self) -> None:
        """The child drains: this process's requests end as the child's do."""
        self.child.drain()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        try:
            port = await self.child.serving()
        except ChildUnavailableError as why:
            error = ApiError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"the model process could not start: {why}",
                "model_process_unavailable",
            )
            retry = {"retry-after": str(round(RETRY_S))}
            await _error(error, path, retry)(scope, receive, send)
            return
        response = await self._forward(scope, receive, port)
        if isinstance(response, ApiError):
            await _error(response, path)(scope, receive, send)
            return
        headers = {k: v for k, v in response.headers.items() if k.lower() not in _NOT_PASSED}
        streamed = response.headers.get("content-type", "").startswith(STREAMED)
        body = _passed(response, path if streamed else None)
        await StreamingResponse(body, response.status_code, headers)(scope, receive, send)

    async def _forward(self, scope: Scope, receive: Receive, port: int) -> Any:
        async def request_body() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                yield message.get("body", b"")
                if not message.get("more_body"):
                    return

        target = scope["raw_path"].decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() not in _NOT_PASSED
        ]
        request = self.client.build_request(
            scope["method"], f"http://127.0.0.1:{port}{target}", headers=headers,
            content=request_body(),
        )  # fmt: skip
        try:
            return await self.client.send(request, stream=True)
        except httpx2.TransportError:
            return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, _ENDED, "model_process_ended")


_ENDED = "the model process ended before this reply was finished (an RPC server lost?)"


async def _passed(response: httpx2.Response, stream_path: str | None) -> AsyncIterator[bytes]:
    """The child's reply as it comes; a stream the child stopped mid-way ends with an error
    event of its route's shape (stream_path: the path of a streamed reply, else None)."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx2.TransportError:
        if stream_path is not None:
            error = ApiError(HTTPStatus.SERVICE_UNAVAILABLE, _ENDED, "model_process_ended")
            yield _failure_frame(error, stream_path)
    finally:
        await response.aclose()


def _shaped(error: ApiError, path: str) -> dict[str, Any]:
    from cli.api.http import error_shape

    shape = error_shape(path)
    return shape(error) if shape is not None else error.body()


def _failure_frame(error: ApiError, path: str) -> bytes:
    body = _shaped(error, path)
    if path.startswith("/api/"):  # Ollama's streams: a JSON object a line
        return json.dumps({"error": error.message}).encode() + b"\n"
    if path.startswith("/v1/messages"):
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    return f"data: {json.dumps(body)}\n\n".encode()


def _error(error: ApiError, path: str, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(_shaped(error, path))
    return Response(body, error.status, headers, media_type="application/json")


def supervise(
    argv: list[str], socks: list[socket.socket], limits: HttpLimits, verbose: bool
) -> int:
    """Start the child (serve's own command line, argv), wait until it serves, then pass it
    requests until SIGTERM or Ctrl-C, when both drain. The exit code: the child's where it could
    not start (it said why on stderr), else 0."""
    from cli.api.http import run_server

    child = Child(argv, socks[0].getsockname()[1])
    child.start()
    try:
        child.wait_serving(time.monotonic() + START_WAIT_S)
    except ChildUnavailableError:
        code = child.stop()
        return code or EXIT_INTERNAL
    run_server(socks, ProxyApp(child), limits, verbose)
    child.stop()
    return EXIT_OK
