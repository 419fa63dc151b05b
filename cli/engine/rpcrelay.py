"""llama.cpp's RPC wire format, and relays that pass it between sockets.

A request is a command (1 byte), its payload's size (u64) and the payload; llama.cpp's server
allocates what the size says before it reads a byte of it, and serves one connection at a time,
so one client that never speaks holds it for everyone. `guard` stands in front of it: it takes
the connections on the user's address, drops one that has not sent a whole hello within
HELLO_TIMEOUT_S, and relays each that has to llama.cpp's server on a loopback port, reading the
headers (never the payloads) and closing a connection whose declared size passes the bound
before that header goes on. `loopback_relay` lets llama.cpp's client, which dials IPv4 only,
reach a server over IPv6. Both pass the bytes unchanged, in chunks of up to CHUNK.

Sockets and llama.cpp's protocol only: nothing here loads llama.cpp.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cli.units import human_bytes

# enum rpc_cmd of ggml-rpc.cpp (llama-cpp-python 0.3.36): RPC_CMD_HELLO is fixed at 14 across
# protocol versions; RPC_CMD_COUNT bounds the commands the server knows.
HELLO, GET_DEVICE_MEMORY, DEVICE_COUNT, COMMANDS = 14, 11, 15, 19
CAPS_SIZE = 24  # RPC_CONN_CAPS_SIZE: the hello's payload (transport capabilities)
HEADER = struct.Struct("<BQ")  # command, payload size
HELLO_SIZE = HEADER.size + CAPS_SIZE
HELLO_TIMEOUT_S = 5.0
MAX_WAITING = 64  # connections waiting for their hello; past it the oldest is dropped
MAX_RELAYED = 16  # past their hello: one is served, the rest wait in llama.cpp's queue
CHUNK = 1 << 20
UPSTREAM_WAIT_S = 60.0  # llama.cpp's server starts listening after the guard does


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT, [IPV6]:PORT or IPV6:PORT as (host, port) for the socket module."""
    host, _, port = endpoint.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def join_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def guard(
    listener: socket.socket,
    upstream: tuple[str, int],
    max_payload: int,
    report: Callable[[str], None],
) -> None:
    """Accept on listener forever (blocks: run it in a thread). A connection that sends a
    whole hello in time is relayed to upstream on a thread of its own; report gets one line
    for each connection dropped or refused, naming its peer and why."""
    _Guard(listener, Upstream(upstream, max_payload, report)).run()


class _Guard:
    """The connections waiting for their hello, on one selector with the listener."""

    def __init__(self, listener: socket.socket, upstream: Upstream) -> None:
        self.listener, self.upstream = listener, upstream
        self.selector = selectors.DefaultSelector()
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ)
        self.waiting: dict[socket.socket, tuple[float, bytearray, str]] = {}  # oldest first
        self.relayed = threading.BoundedSemaphore(MAX_RELAYED)

    def run(self) -> None:
        while True:
            now = time.monotonic()
            for conn in [c for c, (deadline, _, _) in self.waiting.items() if deadline <= now]:
                self.drop(conn, f"no hello within {HELLO_TIMEOUT_S:g} s")
            timeout = min((d for d, _, _ in self.waiting.values()), default=now + 3600) - now
            for key, _ in self.selector.select(max(timeout, 0)):
                if key.fileobj is self.listener:
                    self.accept()
                else:
                    assert isinstance(key.fileobj, socket.socket)  # the listener's accepts
                    self.receive(key.fileobj)

    def drop(self, conn: socket.socket, why: str | None) -> None:
        _, _, peer = self.waiting.pop(conn)
        self.selector.unregister(conn)
        if why:  # before the peer sees the connection end
            self.upstream.report(f"dropped a connection from {peer}: {why}")
        conn.close()

    def accept(self) -> None:
        try:
            conn, address = self.listener.accept()
        except OSError:  # the peer gave up already, or out of descriptors for now
            time.sleep(0.01)
            return
        if len(self.waiting) >= MAX_WAITING:
            self.drop(next(iter(self.waiting)), f"{MAX_WAITING} connections waiting for a hello")
        conn.setblocking(False)
        peer = join_endpoint(*address[:2])
        self.waiting[conn] = (time.monotonic() + HELLO_TIMEOUT_S, bytearray(), peer)
        self.selector.register(conn, selectors.EVENT_READ)

    def receive(self, conn: socket.socket) -> None:
        """More of conn's hello; once it is whole and one, conn goes to a relay thread."""
        _, hello, peer = self.waiting[conn]
        try:
            data = conn.recv(HELLO_SIZE - len(hello))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.drop(conn, None)  # closed before its hello: a port check, or a client gone
            return
        hello += data
        if len(hello) >= HEADER.size and HEADER.unpack_from(hello) != (HELLO, CAPS_SIZE):
            self.drop(conn, "its first message is not an RPC hello of protocol 3 or later")
        elif len(hello) == HELLO_SIZE and not self.relayed.acquire(blocking=False):
            self.drop(conn, f"{MAX_RELAYED} clients already connected or waiting for the server")
        elif len(hello) == HELLO_SIZE:
            del self.waiting[conn]
            self.selector.unregister(conn)
            conn.setblocking(True)
            threading.Thread(
                target=_relay_checked,
                args=(conn, bytes(hello), peer, self.upstream, self.relayed),
                name=f"rpc-relay {peer}",
                daemon=True,
            ).start()


@dataclass(frozen=True)
class Upstream:
    """llama.cpp's RPC server behind the guard, the bound on a request's payload, and where the
    guard reports a connection it drops or refuses."""

    address: tuple[str, int]
    max_payload: int
    report: Callable[[str], None]


def _relay_checked(
    client: socket.socket,
    hello: bytes,
    peer: str,
    upstream: Upstream,
    relayed: threading.BoundedSemaphore,
) -> None:
    try:
        _relay_to_server(client, hello, peer, upstream)
    finally:
        relayed.release()


def _relay_to_server(client: socket.socket, hello: bytes, peer: str, upstream: Upstream) -> None:
    report = upstream.report
    deadline = time.monotonic() + UPSTREAM_WAIT_S
    while True:
        try:
            server = socket.create_connection(upstream.address)
            break
        except OSError:
            if time.monotonic() > deadline:
                client.close()
                report(f"dropped a connection from {peer}: llama.cpp's server is not listening")
                return
            time.sleep(0.05)

    def requests() -> None:
        refused = _pass_requests(client, server, hello, upstream.max_payload)
        if refused:  # before the client sees the connection end
            report(f"refused {peer}: {refused}")

    _relay(client, server, requests)


def _relay(client: socket.socket, server: socket.socket, requests: Callable[[], None]) -> None:
    """requests() passes the client's bytes on, in this thread, while another copies the
    server's back; when either side ends, both sockets are shut and closed."""
    with client, server:
        for end in (client, server):
            end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        replies = threading.Thread(target=_copy, args=(server, client), daemon=True)
        replies.start()
        with contextlib.suppress(OSError):
            requests()
        _shut(client, server)
        replies.join()


def _pass_requests(
    client: socket.socket, server: socket.socket, hello: bytes, max_payload: int
) -> str | None:
    """The hello, then the client's requests, on to the server until either side closes; the
    reason, when a header breaks the bound (nothing of that header has reached the server
    then but, when it came in two reads, its first bytes, which the server cannot act on)."""
    server.sendall(hello)
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    header = bytearray()
    payload_left = 0
    while n := client.recv_into(buffer):
        at = 0
        while at < n:
            if payload_left:
                step = min(payload_left, n - at)
                at += step
                payload_left -= step
                continue
            take = min(HEADER.size - len(header), n - at)
            header += view[at : at + take]
            at += take
            if len(header) == HEADER.size:
                command, size = HEADER.unpack(header)
                header.clear()
                if command >= COMMANDS:
                    return f"unknown command {command}"
                if size > max_payload:
                    return (
                        f"a {human_bytes(size)} message (command {command}), more than the "
                        f"{human_bytes(max_payload)} this server takes in one"
                    )
                payload_left = size
        server.sendall(view[:n])
    return None


def _copy(source: socket.socket, target: socket.socket) -> None:
    """Everything source sends, to target, until either closes; then both are shut."""
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with contextlib.suppress(OSError):
        while n := source.recv_into(buffer):
            target.sendall(view[:n])
    _shut(source, target)


def _shut(*ends: socket.socket) -> None:
    for end in ends:
        with contextlib.suppress(OSError):
            end.shutdown(socket.SHUT_RDWR)


def loopback_relay(address: tuple[str, int]) -> str:
    """A 127.0.0.1 endpoint whose every connection is relayed to address, unchanged, for as long
    as this process lives: how llama.cpp's client (IPv4 only) reaches an IPv6 server."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            client, _ = listener.accept()
            threading.Thread(target=relay, args=(client,), daemon=True).start()

    def relay(client: socket.socket) -> None:
        try:
            server = socket.create_connection(address, timeout=HELLO_TIMEOUT_S)
        except OSError:
            client.close()  # llama.cpp's client reports the failed hello
            return
        server.settimeout(None)
        _relay(client, server, lambda: _copy(client, server))

    threading.Thread(target=accept, name=f"rpc-relay to {address[0]}", daemon=True).start()
    return join_endpoint(*listener.getsockname()[:2])
