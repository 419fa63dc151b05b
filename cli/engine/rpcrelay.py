"""llama.cpp's RPC wire format; the guard that vets each client before llama.cpp's server
serves it; relays that pass the protocol between sockets.

A request is a command (1 byte), its payload's size (u64) and the payload; llama.cpp's server
allocates what the size says before it reads a byte of it, and serves one connection at a time,
so one client that never speaks holds it for everyone. `guard` takes the connections on the
user's address and drops one that has not sent a whole hello within HELLO_TIMEOUT_S (it peeks:
the hello stays for llama.cpp to read); each that has goes on to a `Doorway`, which bounds every
header's declared size (`RequestReader`) as llama.cpp reads it:

- `ServedInPlace` (Linux): llama.cpp's server runs in this process, its `accept` and `recv`
  replaced for libggml-rpc alone (elfhook.py): accept takes the next vetted connection and recv
  closes one whose header breaks the bound before llama.cpp sees that header. llama.cpp reads
  the client's own socket: nothing stands between them, so a request costs what it did without
  the guard (a relay's extra hop, even one written in C, cost decode 5-8% on a 2-CPU machine:
  benchmarks/results/rpc-relay-hop-2026-12-03.md).
- `Relay` (elsewhere, or with QUILL_RPC_RELAY=1): each connection relayed to llama.cpp's server
  on a loopback port, the headers read on the way (never the payloads).

`loopback_relay` lets llama.cpp's client, which dials IPv4 only, reach a server over IPv6.
Relays pass the bytes unchanged, in chunks of up to CHUNK. Sockets, llama.cpp's protocol and
its library's imports: nothing here loads llama.cpp.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from cli.engine.elfhook import replace_import
from cli.units import human_bytes

# enum rpc_cmd of ggml-rpc.cpp (llama-cpp-python 0.3.36): RPC_CMD_HELLO is fixed at 14 across
# protocol versions; RPC_CMD_COUNT bounds the commands the server knows.
HELLO, GET_DEVICE_MEMORY, DEVICE_COUNT, COMMANDS = 14, 11, 15, 19
CAPS_SIZE = 24  # RPC_CONN_CAPS_SIZE: the hello's payload (transport capabilities)
HEADER = struct.Struct("<BQ")  # command, payload size
HELLO_SIZE = HEADER.size + CAPS_SIZE
HELLO_TIMEOUT_S = 5.0
PARTIAL_HELLO_POLL_S = 0.05  # a hello that came in pieces is peeked at again after this
MAX_WAITING = 64  # connections waiting for their hello; past it the oldest is dropped
MAX_QUEUED = 16  # past their hello: one is served, the rest wait their turn
CHUNK = 1 << 20
UPSTREAM_WAIT_S = 60.0  # llama.cpp's server starts listening after the guard does


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT, [IPV6]:PORT or IPV6:PORT as (host, port) for the socket module."""
    host, _, port = endpoint.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def join_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Doorway(Protocol):
    """Where the guard sends a connection whose hello came in time (the hello not yet read)."""

    def admit(self, conn: socket.socket, peer: str) -> str | None:
        """Take conn on, or say why not (the guard then drops it with that reason)."""
        ...


def guard(listener: socket.socket, doorway: Doorway, report: Callable[[str], None]) -> None:
    """Accept on listener forever (blocks: run it in a thread). A connection that sends a
    whole hello in time goes to doorway; report gets one line for each connection dropped,
    naming its peer and why."""
    _Guard(listener, doorway, report).run()


class _Guard:
    """The connections waiting for their hello, on one selector with the listener."""

    def __init__(
        self, listener: socket.socket, doorway: Doorway, report: Callable[[str], None]
    ) -> None:
        self.listener, self.doorway, self.report = listener, doorway, report
        self.selector = selectors.DefaultSelector()
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ)
        self.waiting: dict[socket.socket, tuple[float, str]] = {}  # oldest first
        self.partial: set[socket.socket] = set()  # part of a hello came: peeked at on a timer

    def run(self) -> None:
        while True:
            now = time.monotonic()
            for conn in [c for c, (deadline, _) in self.waiting.items() if deadline <= now]:
                self.drop(conn, f"no hello within {HELLO_TIMEOUT_S:g} s")
            for conn in list(self.partial):
                self.peek(conn)
            timeout = min((d for d, _ in self.waiting.values()), default=now + 3600) - now
            if self.partial:
                timeout = min(timeout, PARTIAL_HELLO_POLL_S)
            for key, _ in self.selector.select(max(timeout, 0)):
                if key.fileobj is self.listener:
                    self.accept()
                else:
                    assert isinstance(key.fileobj, socket.socket)  # the listener's accepts
                    self.peek(key.fileobj)

    def drop(self, conn: socket.socket, why: str | None) -> None:
        _, peer = self.waiting.pop(conn)
        self.forget(conn)
        if why:  # before the peer sees the connection end
            self.report(f"dropped a connection from {peer}: {why}")
        conn.close()

    def forget(self, conn: socket.socket) -> None:
        if conn in self.partial:
            self.partial.discard(conn)
        else:
            self.selector.unregister(conn)

    def accept(self) -> None:
        try:
            conn, address = self.listener.accept()
        except OSError:  # the peer gave up already, or out of descriptors for now
            time.sleep(0.01)
            return
        if len(self.waiting) >= MAX_WAITING:
            self.drop(next(iter(self.waiting)), f"{MAX_WAITING} connections waiting for a hello")
        conn.setblocking(False)
        # Readable once a whole hello is there (or the peer is gone), where the OS honours it;
        # where it refuses the option (Windows), a part of a hello is peeked at on a timer.
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, HELLO_SIZE)
        self.waiting[conn] = (time.monotonic() + HELLO_TIMEOUT_S, join_endpoint(*address[:2]))
        self.selector.register(conn, selectors.EVENT_READ)

    def peek(self, conn: socket.socket) -> None:
        """conn's hello so far, left unread; once it is whole and one, conn goes on."""
        try:
            hello = conn.recv(HELLO_SIZE, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            hello = b""
        if not hello:
            self.drop(conn, None)  # closed before its hello: a port check, or a client gone
        elif HEADER.pack(HELLO, CAPS_SIZE)[: len(hello)] != hello[: HEADER.size]:
            self.drop(conn, "its first message is not an RPC hello of protocol 3 or later")
        elif len(hello) < HELLO_SIZE:
            if conn not in self.partial:
                self.selector.unregister(conn)  # its bytes stay unread: select would spin
                self.partial.add(conn)
        else:
            self.forget(conn)
            _, peer = self.waiting.pop(conn)
            conn.setblocking(True)
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            refused = self.doorway.admit(conn, peer)
            if refused:
                self.report(f"dropped a connection from {peer}: {refused}")
                conn.close()


class RequestReader:
    """Where a client's stream of requests is, header or payload, fed its bytes in order as
    they arrive (read(at, size): size bytes from offset at of what came, asked only for header
    bytes, so payloads are counted and never copied); says why when a header breaks the bound."""

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self.header = bytearray()
        self.payload_left = 0

    def feed(self, count: int, read: Callable[[int, int], bytes]) -> str | None:
        at = 0
        while at < count:
            if self.payload_left:
                step = min(self.payload_left, count - at)
                at += step
                self.payload_left -= step
                continue
            take = min(HEADER.size - len(self.header), count - at)
            self.header += read(at, take)
            at += take
            if len(self.header) == HEADER.size:
                command, size = HEADER.unpack(self.header)
                self.header.clear()
                if command >= COMMANDS:
                    return f"unknown command {command}"
                if size > self.max_payload:
                    return (
                        f"a {human_bytes(size)} message (command {command}), more than the "
                        f"{human_bytes(self.max_payload)} this server takes in one"
                    )
                self.payload_left = size
        return None


_ACCEPT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_RECV = ctypes.CFUNCTYPE(
    ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
)


@dataclass
class ServedInPlace:
    """llama.cpp's server in this process (`library`: an address inside libggml-rpc), its
    accept taking the guard's connections in turn and its recv closing a connection whose
    header breaks the bound. Build it before llama.cpp's server starts; elfhook.HookError where
    this platform cannot."""

    library: int
    max_payload: int
    report: Callable[[str], None]
    waiting: queue.Queue[tuple[socket.socket, str]] = field(
        default_factory=lambda: queue.Queue(MAX_QUEUED)
    )
    served: dict[int, tuple[str, RequestReader]] = field(default_factory=dict)  # by fd

    def __post_init__(self) -> None:
        libc = ctypes.CDLL(None)
        self._recv = libc.recv
        self._recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._recv.restype = ctypes.c_ssize_t
        self._hooks = (_ACCEPT(self._accept), _RECV(self._read))  # alive while llama.cpp calls
        replace_import(self.library, "accept", self._hooks[0])
        replace_import(self.library, "recv", self._hooks[1])

    def admit(self, conn: socket.socket, peer: str) -> str | None:
        try:
            self.waiting.put_nowait((conn, peer))
        except queue.Full:
            return f"{MAX_QUEUED} clients already waiting for the server"
        return None

    def _accept(self, _listener: int, _address: int, _length: int) -> int:
        """llama.cpp's listening socket is never used: its clients come from the guard (the
        address arguments stay unset: llama.cpp passes NULL)."""
        conn, peer = self.waiting.get()
        self.served[conn.fileno()] = (peer, RequestReader(self.max_payload))
        return conn.detach()

    def _read(self, fd: int, buffer: int, size: int, flags: int) -> int:
        count = self._recv(fd, buffer, size, flags)
        served = self.served.get(fd)
        if served is not None and count > 0:
            peer, reader = served
            if reader.payload_left >= count:  # inside a payload, the most common read
                reader.payload_left -= count
                return count
            refused = reader.feed(count, lambda at, n: ctypes.string_at(buffer + at, n))
            if refused:
                del self.served[fd]
                self.report(f"refused {peer}: {refused}")
                return -1  # llama.cpp closes the connection before acting on that header
        return count


@dataclass
class Relay:
    """Each connection relayed to llama.cpp's server at upstream (a loopback address) on a
    thread of its own, its headers read on the way."""

    upstream: tuple[str, int]
    max_payload: int
    report: Callable[[str], None]
    relayed: threading.BoundedSemaphore = field(
        default_factory=lambda: threading.BoundedSemaphore(MAX_QUEUED)
    )

    def admit(self, conn: socket.socket, peer: str) -> str | None:
        if not self.relayed.acquire(blocking=False):
            return f"{MAX_QUEUED} clients already connected or waiting for the server"
        threading.Thread(
            target=self._relay_checked, args=(conn, peer), name=f"rpc-relay {peer}", daemon=True
        ).start()
        return None

    def _relay_checked(self, client: socket.socket, peer: str) -> None:
        try:
            self._relay_to_server(client, peer)
        finally:
            self.relayed.release()

    def _relay_to_server(self, client: socket.socket, peer: str) -> None:
        deadline = time.monotonic() + UPSTREAM_WAIT_S
        while True:
            try:
                server = socket.create_connection(self.upstream)
                break
            except OSError:
                if time.monotonic() > deadline:
                    client.close()
                    self.report(
                        f"dropped a connection from {peer}: llama.cpp's server is not listening"
                    )
                    return
                time.sleep(0.05)

        def requests() -> None:
            refused = _pass_requests(client, server, RequestReader(self.max_payload))
            if refused:  # before the client sees the connection end
                self.report(f"refused {peer}: {refused}")

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
    client: socket.socket, server: socket.socket, reader: RequestReader
) -> str | None:
    """The client's requests on to the server until either side closes; the reason, when a
    header breaks the bound (nothing of that header has reached the server then but, when it
    came in two reads, its first bytes, which the server cannot act on)."""
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    while n := client.recv_into(buffer):
        refused = reader.feed(n, lambda at, size: bytes(view[at : at + size]))
        if refused:
            return refused
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
