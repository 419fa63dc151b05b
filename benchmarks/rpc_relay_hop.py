"""What one relay hop costs an RPC round trip (issue 41): the round-trip time of small
RPC-shaped messages (a 9-byte header and 40 bytes, answered with 16), straight to an echo server,
through a plain relay written in C (benchmarks/c/plain_relay.c: poll, read, write; no checks),
and through the relay `quill rpc-server` uses where it cannot serve in place
(cli/engine/rpcrelay.py), each in a process of its own. The question it answers: is the guard's
cost on tg128 Python's, or the hop's?

Usage (inside quill's venv, the machine otherwise idle; needs gcc):
  python -m benchmarks.rpc_relay_hop [--rounds 5] [--messages 4000]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import machine_line
from cli.engine import rpcrelay

HERE = Path(__file__).parent
REQUEST = rpcrelay.HEADER.pack(8, 40) + b"x" * 40  # RPC_CMD_GET_TENSOR-sized
REPLY = 16


def echo() -> None:
    """An RPC server's shape: a hello, then one reply of REPLY bytes per request."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.recv(rpcrelay.HELLO_SIZE, socket.MSG_WAITALL)
        conn.sendall(b"\0" * 8)
        while len(header := conn.recv(rpcrelay.HEADER.size, socket.MSG_WAITALL)) == 9:
            _, size = rpcrelay.HEADER.unpack(header)
            conn.recv(size, socket.MSG_WAITALL)
            conn.sendall(b"\0" * REPLY)
        conn.close()


def guard(upstream: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    relay = rpcrelay.Relay(("127.0.0.1", upstream), 1 << 30, print)
    rpcrelay.guard(listener, relay, print)


def round_trip_us(port: int, messages: int) -> float:
    """The median round trip, in microseconds, of messages requests on one connection."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = rpcrelay.HEADER.pack(rpcrelay.HELLO, rpcrelay.CAPS_SIZE)
        conn.sendall(hello + b"\0" * rpcrelay.CAPS_SIZE)
        conn.recv(8, socket.MSG_WAITALL)
        times = []
        for _ in range(messages):
            started = time.perf_counter()
            conn.sendall(REQUEST)
            conn.recv(REPLY, socket.MSG_WAITALL)
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def started(command: list[str]) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=4000)
    args = parser.parse_args()
    binary = Path(tempfile.mkdtemp(prefix="quill-relay-")) / "plain_relay"
    subprocess.run(["gcc", "-O2", "-o", str(binary), str(HERE / "c" / "plain_relay.c")], check=True)
    me = [sys.executable, "-m", "benchmarks.rpc_relay_hop"]
    server, upstream = started([*me, "--serve", "echo"])
    relays = {
        "C relay": started([str(binary), str(upstream)]),
        "quill's guard": started([*me, "--serve", "guard", str(upstream)]),
    }
    print(machine_line())
    print("| round | direct us | " + " | ".join(f"{name} us (+hop)" for name in relays) + " |")
    print("|---:|---:|" + "---:|" * len(relays))
    try:
        for n in range(args.rounds):
            direct = round_trip_us(upstream, args.messages)
            cells = []
            for _, port in relays.values():
                through = round_trip_us(port, args.messages)
                cells.append(f"{through:.0f} (+{through - direct:.0f})")
            print(f"| {n + 1} | {direct:.0f} | " + " | ".join(cells) + " |", flush=True)
    finally:
        for process in [server, *(relay for relay, _ in relays.values())]:
            process.kill()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        echo() if sys.argv[2] == "echo" else guard(int(sys.argv[3]))
    else:
        main()
