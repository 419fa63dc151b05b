"""llama.cpp's RPC backend (ggml-rpc), reached through libggml's backend registry as llama.cpp's
own `--rpc` and rpc-server do (llama-cpp-python binds none of it).

The C client aborts the process on any failure (a refused connection, a handshake from another
protocol version, a peer lost mid-run), so quill speaks the handshake itself first
(`probe`, plain sockets with a timeout): nothing reaches llama.cpp that did not answer as an RPC
server of this build's protocol. llama.cpp's client dials IPv4 only: an IPv6 server is
reached through a relay on a loopback port (rpcrelay.py). A peer lost later still ends in
GGML_ABORT; `on_abort` turns that into one line naming the peer and a documented exit code
instead of a C backtrace.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llama_cpp as llama

from cli.engine.elfhook import HookError
from cli.engine.hardware import ANY_GPU, GGML_DEVICE_CPU
from cli.engine.rpcrelay import (
    CAPS_SIZE,
    DEVICE_COUNT,
    GET_DEVICE_MEMORY,
    HELLO,
    Doorway,
    Relay,
    ServedInPlace,
    loopback_relay,
    split_endpoint,
)
from cli.errors import EXIT_RPC, RpcError
from quant.ggmllib import Signature, declare, ggml_library

# RPC_PROTO_MAJOR/MINOR_VERSION of ggml-rpc.h in the llama-cpp-python quill pins (0.3.36): the
# C client refuses a server whose major differs or whose minor is newer.
PROTOCOL = (7, 0)
PROBE_TIMEOUT_S = 5.0
NO_RPC_BUILD = (
    "this llama-cpp-python was built without RPC: reinstall quill as the README says (it builds "
    "llama-cpp-python with CMAKE_ARGS=-DGGML_RPC=on)"
)


@dataclass(frozen=True)
class RpcDevice:
    """One device an RPC server offers, as its handshake reported it."""

    endpoint: str
    index: int
    free_bytes: int
    total_bytes: int

    @property
    def name(self) -> str:  # as quill names it (llama.cpp's RPC0, RPC1... depend on order)
        return f"{self.endpoint}#{self.index}"


def supports_rpc() -> bool:
    """Whether this llama-cpp-python was built with GGML_RPC (the README's install does it)."""
    llama.llama_backend_init()
    return bool(llama.llama_supports_rpc())


def _exchange(conn: socket.socket, command: int, payload: bytes, reply_size: int) -> bytes:
    # Request: command (1 byte), payload size (u64), payload. Reply: size (u64), data.
    conn.sendall(struct.pack("<BQ", command, len(payload)) + payload)
    size = struct.unpack("<Q", _receive(conn, 8))[0]
    if size != reply_size:
        raise ValueError(f"a {size}-byte reply where {reply_size} were due")
    return _receive(conn, reply_size)


def _receive(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed the connection")
        data += chunk
    return data


def probe(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> list[RpcDevice]:
    """Connect, handshake and ask each device's memory, as llama.cpp's client would, but with
    a timeout and an error instead of an abort."""
    try:
        conn = socket.create_connection(split_endpoint(endpoint), timeout=timeout_s)
    except OSError as error:
        why = error.strerror or type(error).__name__
        raise RpcError(endpoint, f"cannot be reached ({why})") from None
    with conn:
        try:
            # capabilities all zero: plain TCP
            hello = _exchange(conn, HELLO, bytes(CAPS_SIZE), 4 + CAPS_SIZE)
            major, minor, patch = hello[0], hello[1], hello[2]
            if major != PROTOCOL[0] or minor > PROTOCOL[1]:
                raise RpcError(
                    endpoint,
                    f"speaks RPC protocol {major}.{minor}.{patch}, this build "
                    f"{PROTOCOL[0]}.{PROTOCOL[1]}: run the same quill (or llama.cpp) version there",
                )
            count = struct.unpack("<I", _exchange(conn, DEVICE_COUNT, b"", 4))[0]
            devices = []
            for index in range(count):
                reply = _exchange(conn, GET_DEVICE_MEMORY, struct.pack("<I", index), 16)
                free, total = struct.unpack("<QQ", reply)
                devices.append(RpcDevice(endpoint, index, free, total))
        except TimeoutError:
            raise RpcError(
                endpoint,
                f"accepted but did not answer the handshake within {timeout_s:g} s "
                "(an RPC server serves one client at a time: is another using it?)",
            ) from None
        except (OSError, ValueError) as error:
            raise RpcError(
                endpoint, f"is not a llama.cpp RPC server of protocol {PROTOCOL[0]}.x ({error})"
            ) from None
    if not devices:
        raise RpcError(endpoint, "offers no devices")
    return devices


@functools.cache
def _ggml() -> ctypes.CDLL:
    signatures: dict[str, Signature] = {
        "ggml_backend_reg_by_name": ([ctypes.c_char_p], ctypes.c_void_p),
        "ggml_backend_reg_get_proc_address": ([ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p),
        "ggml_backend_register": ([ctypes.c_void_p], None),
        "ggml_backend_reg_dev_count": ([ctypes.c_void_p], ctypes.c_size_t),
        "ggml_backend_reg_dev_get": ([ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p),
        "ggml_backend_dev_count": ([], ctypes.c_size_t),
        "ggml_backend_dev_get": ([ctypes.c_size_t], ctypes.c_void_p),
        "ggml_backend_dev_type": ([ctypes.c_void_p], ctypes.c_int),
        "ggml_backend_dev_name": ([ctypes.c_void_p], ctypes.c_char_p),
        "ggml_backend_dev_description": ([ctypes.c_void_p], ctypes.c_char_p),
        "ggml_backend_dev_by_type": ([ctypes.c_int], ctypes.c_void_p),
        "ggml_backend_dev_memory": (
            [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
            None,
        ),
    }
    return declare(ggml_library("ggml"), signatures)


def _rpc_address(name: str) -> int:
    lib = _ggml()
    registry = lib.ggml_backend_reg_by_name(b"RPC") if supports_rpc() else None
    address = registry and lib.ggml_backend_reg_get_proc_address(registry, name.encode())
    if not address:
        raise RpcError("", NO_RPC_BUILD)
    return address


def _rpc_function(name: str, prototype: type) -> Callable:
    return prototype(_rpc_address(name))


_registered: dict[str, list[int]] = {}  # endpoint -> its llama.cpp devices, once per process


def attach(endpoints: Sequence[str]) -> ctypes.Array | None:
    """Probe every endpoint, then hand them to llama.cpp: the NULL-terminated device list a
    model's parameters take (None for no endpoints). A process that once attached servers
    passes an explicit list on every later load, so a model opened without --rpc stays local."""
    for endpoint in endpoints:
        # One this process attached before is llama.cpp's already: its server, which serves one
        # client at a time, would not answer a second connection from here.
        if endpoint not in _registered:
            probe(endpoint)
    add_server = _rpc_function(
        "ggml_backend_rpc_add_server", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
    )
    lib = _ggml()
    for endpoint in endpoints:
        if endpoint not in _registered:
            host, port = split_endpoint(endpoint)
            dialed = loopback_relay((host, port)) if ":" in host else endpoint
            registry = add_server(dialed.encode())
            if not registry:
                raise RpcError(endpoint, "offers no devices")
            lib.ggml_backend_register(registry)
            count = lib.ggml_backend_reg_dev_count(registry)
            devices = [lib.ggml_backend_reg_dev_get(registry, i) for i in range(count)]
            _registered[endpoint] = devices
    if endpoints:
        on_abort(endpoints)
        devices = [device for endpoint in endpoints for device in _registered[endpoint]]
    elif _registered:
        rpc = {device for devices in _registered.values() for device in devices}
        devices = [
            device
            for i in range(lib.ggml_backend_dev_count())
            if (device := lib.ggml_backend_dev_get(i)) not in rpc
            and lib.ggml_backend_dev_type(device) in ANY_GPU
        ]
    else:
        return None
    return (ctypes.c_void_p * (len(devices) + 1))(*devices, None)


_abort_hook = None  # kept alive: llama.cpp holds the pointer


def on_abort(endpoints: Sequence[str]) -> None:
    """From now on, a GGML_ABORT (the RPC client's only way to fail) prints one line naming the
    server that is gone and exits with EXIT_RPC. Nothing else is saved here: a chat writes its
    transcript after every turn, and the reply cut short was never finished."""
    global _abort_hook
    watched = tuple(endpoints)

    def report(message: bytes | None) -> None:
        # A killed server's listening socket may outlive its connection by a moment.
        for _ in range(10):
            lost = [e for e in watched if not _reachable(e)]
            if lost:
                break
            time.sleep(0.1)
        text = (message or b"").decode(errors="replace").strip().splitlines()
        detail = text[0].split(": ", 1)[-1] if text else "llama.cpp aborted"
        if lost:
            line = f"quill: error: RPC server {', '.join(lost)} was lost mid-run ({detail})"
        else:
            line = (
                f"quill: error: llama.cpp aborted using RPC servers {', '.join(watched)}: {detail}"
            )
        sys.stdout.flush()
        if sys.stdout.isatty():  # the reply stopped mid-line: the error starts a line of its own
            sys.stdout.write("\n")
            sys.stdout.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os._exit(EXIT_RPC)

    prototype = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
    _abort_hook = prototype(report)
    base = ggml_library("ggml-base")
    base.ggml_set_abort_callback.argtypes = [prototype]
    base.ggml_set_abort_callback.restype = ctypes.c_void_p
    base.ggml_set_abort_callback(_abort_hook)


def _reachable(endpoint: str) -> bool:
    try:
        socket.create_connection(split_endpoint(endpoint), timeout=1.0).close()
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class ServedDevice:
    name: str
    description: str


def _served() -> list[int]:
    """The devices `quill rpc-server` offers: this machine's GPUs (integrated ones included)
    where it has any, else its CPU (as llama.cpp's rpc-server chooses)."""
    lib = _ggml()
    llama.llama_backend_init()
    handles = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    gpus = [d for d in handles if lib.ggml_backend_dev_type(d) in ANY_GPU]
    return gpus or [lib.ggml_backend_dev_by_type(GGML_DEVICE_CPU)]


def local_devices() -> list[ServedDevice]:
    """What `quill rpc-server` offers, by name ("CPU", "CUDA0", ...) and description."""
    lib = _ggml()
    return [
        ServedDevice(
            lib.ggml_backend_dev_name(d).decode(), lib.ggml_backend_dev_description(d).decode()
        )
        for d in _served()
    ]


# Beyond a tensor's bytes, a request carries descriptions of tensors (rpc_tensor, 296 bytes):
# 64 MiB holds a compute graph of over 200,000, far past the few thousand of a large model's.
REQUEST_SLACK_BYTES = 64 * 2**20


def max_request_bytes(memory_bytes: int | None) -> int:
    """The largest request `quill rpc-server` takes: what its largest device offers (--mem
    where given, else the device's total memory), which bounds any tensor a client sets there,
    plus REQUEST_SLACK_BYTES."""
    largest = memory_bytes or 0
    if memory_bytes is None:
        lib = _ggml()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        for device in _served():
            lib.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
            largest = max(largest, total.value)
    return largest + REQUEST_SLACK_BYTES


_memory_hook = None  # kept alive while the server runs


def _report_cpu_memory(limit_bytes: int) -> None:
    """Make the CPU device say it has limit_bytes (what clients split layers by): its get_memory
    slot (the third pointer of ggml_backend_device_i, a static struct in libggml-cpu) replaced
    in this process, which serves and does nothing else."""
    global _memory_hook
    lib = _ggml()
    device = lib.ggml_backend_dev_by_type(GGML_DEVICE_CPU)
    prototype = ctypes.CFUNCTYPE(
        None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)
    )

    def get_memory(_device: int, free: ctypes.Array, total: ctypes.Array) -> None:
        free[0] = total[0] = limit_bytes

    _memory_hook = prototype(get_memory)
    slot = ctypes.c_void_p.from_address(device + 2 * ctypes.sizeof(ctypes.c_void_p))
    slot.value = ctypes.cast(_memory_hook, ctypes.c_void_p).value


def doorway(inside: tuple[str, int], max_payload: int, report: Callable[[str], None]) -> Doorway:
    """Where `quill rpc-server`'s guard sends the clients it vetted: llama.cpp's server itself,
    its accept and recv replaced (rpcrelay.ServedInPlace), where this platform allows it and
    QUILL_RPC_RELAY is not 1; else a relay to it at inside."""
    if os.environ.get("QUILL_RPC_RELAY") != "1":
        try:
            start = _rpc_address("ggml_backend_rpc_start_server")
            return ServedInPlace(start, max_payload, report)
        except HookError:
            pass
    return Relay(inside, max_payload, report)


def serve(endpoint: str, threads: int, memory_bytes: int | None = None, quiet: bool = True) -> None:
    """Serve this machine's devices at endpoint until the process ends (blocks; llama.cpp's
    loop accepts one client at a time). Returns only if the server could not start. The C
    server prints to stdout: sent to stderr, or nowhere when quiet (the process serves, so its
    stdout carries nothing else)."""
    sys.stdout.flush()
    target = os.open(os.devnull, os.O_WRONLY) if quiet else 2
    os.dup2(target, 1)
    start = _rpc_function(
        "ggml_backend_rpc_start_server",
        ctypes.CFUNCTYPE(
            None,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_void_p),
        ),
    )
    chosen = _served()
    if memory_bytes is not None:  # the command refuses --mem for GPUs
        _report_cpu_memory(memory_bytes)
    devices = (ctypes.c_void_p * len(chosen))(*chosen)
    start(endpoint.encode(), None, threads, len(chosen), devices)
