"""quill rpc-server: this machine's CPU (or GPUs) lent to other machines' quill or llama.cpp
through llama.cpp's RPC backend, for models too big for one box (docs/scale.md). quill listens
on the user's address and hands each client that says hello in time to llama.cpp's server,
refusing requests larger than it serves (cli/engine/rpcrelay.py)."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading
from typing import Annotated

import typer

from cli.commands import options as shared
from cli.errors import EXIT_OK, RpcError, UsageError

RPC_EPILOG = (
    "The protocol has no authentication: whoever reaches the port can use this machine. It "
    "listens on 127.0.0.1 unless --host says otherwise; across machines use a private network "
    "or an SSH tunnel (docs/scale.md)."
)


def rpc_server(
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on (another than loopback: warned).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", min=1, max=65535)] = 50052,
    threads: shared.Threads = None,
    mem: Annotated[
        str | None,
        typer.Option(
            "--mem",
            help="Memory to offer (e.g. 8GiB): clients split layers by it. Default: all of "
            "this machine's (CPU) or each GPU's free memory.",
        ),
    ] = None,
    verbose: shared.Verbose = False,
) -> None:
    """Serve this machine's CPU (or GPUs) to quill and llama.cpp clients over llama.cpp's RPC
    protocol, one client at a time, until Ctrl-C or SIGTERM."""
    from cli.engine import rpc, rpcrelay
    from cli.engine.freecores import measure_free_cores
    from cli.engine.llamalog import llama_log
    from cli.ui import render
    from cli.units import human_bytes

    memory = shared.size_option("--mem", mem) if mem is not None else None
    if memory == 0:
        raise UsageError("--mem 0 would offer nothing: give a size such as 8GiB, or leave it out")
    shared.check_threads(threads)
    if not rpc.supports_rpc():
        raise RpcError("", rpc.NO_RPC_BUILD)
    endpoint = rpcrelay.join_endpoint(host, port)
    listener = _listen(host, port, endpoint)
    if not _is_loopback(host):
        render.warning_line(
            f"listening on {host}: llama.cpp's RPC protocol has no authentication, so anyone who "
            "reaches this port can use this machine; keep it on a private network or reach it "
            "through an SSH tunnel (docs/scale.md)"
        )
    threads = threads or measure_free_cores().threads
    llama_log().verbose = verbose
    devices = rpc.local_devices()
    if memory is not None and any(device.name != "CPU" for device in devices):
        raise UsageError("--mem sets what this machine's CPU offers; its GPUs report their own")
    offered = ", ".join(d.description or d.name for d in devices)
    if memory is not None:
        offered += f", offering {human_bytes(memory)}"
    render.info_line(
        f"quill rpc-server: {offered}, {threads} thread{'s' * (threads != 1)}, at {endpoint} "
        f"(RPC protocol {rpc.PROTOCOL[0]}.{rpc.PROTOCOL[1]}); Ctrl-C stops it"
    )
    # llama.cpp's loop runs on the main thread (in another thread it computed ~5% slower:
    # benchmarks/rpc_split.py) and never returns to Python, whose handlers run only there. But
    # Python's C-level handler, whichever thread a signal lands on, writes its number to the
    # wakeup fd: a thread reads it and ends the process (a server has nothing to save).
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, lambda _number, _frame: None)
        signal.siginterrupt(stop, False)  # llama.cpp's accept() would fail on EINTR and return

    def stop_on_signal() -> None:
        number = os.read(wake_read, 1)[0]
        render.info_line(f"quill rpc-server: stopped ({signal.Signals(number).name})")
        sys.stderr.flush()
        os._exit(EXIT_OK)

    threading.Thread(target=stop_on_signal, name="stop-signals", daemon=True).start()
    inside = ("127.0.0.1", _free_loopback_port())
    doorway = rpc.doorway(inside, rpc.max_request_bytes(memory), _report_client)
    guard = (listener, doorway, _report_client)
    threading.Thread(target=rpcrelay.guard, args=guard, name="rpc-guard", daemon=True).start()
    rpc.serve(rpcrelay.join_endpoint(*inside), threads, memory, quiet=not verbose)
    raise RpcError(endpoint, "could not start (llama.cpp's server returned; --verbose says why)")


def _report_client(line: str) -> None:
    from cli.ui import render

    render.info_line(f"quill rpc-server: {line}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen(host: str, port: int, endpoint: str) -> socket.socket:
    """The user's address, listening. A name's IPv4 address first: llama.cpp's clients dial
    IPv4 only."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise UsageError(f"--host {host!r} is not an address here ({error.strerror})") from None
    family, kind, proto, _, address = min(infos, key=lambda info: info[0] != socket.AF_INET)
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
        listener.listen(64)
    except OSError as error:
        listener.close()
        raise RpcError(
            endpoint, f"cannot listen there ({error.strerror}): choose another --port"
        ) from None
    return listener


def _free_loopback_port() -> int:
    """For llama.cpp's own server, which binds by itself."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
