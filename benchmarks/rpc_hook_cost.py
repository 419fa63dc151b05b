"""What `quill rpc-server`'s in-place guard costs a generated token (issue 41), counted instead of
timed end to end (a layer split's tg128 moves 10-15% between rounds on a 2-CPU VM, more than
the cost looked for):

1. the time one read through the replaced recv (a ctypes callback running RequestReader) adds
   to a plain recv, over a socketpair: requests of a 9-byte header and 40 bytes, read as
   llama.cpp's server reads them (1, 8, then the payload);
2. how many reads llama.cpp's server makes per generated token: a `quill rpc-server` whose
   reads are counted serves `quill bench -p 0 -n N` for two N, and the difference in reads is
   divided by the difference in tokens.
Their product, against the time of a token, is the guard's share of decode.

Usage (inside quill's venv, the machine otherwise idle):
  python -m benchmarks.rpc_hook_cost [--model PATH] [--calls 20000]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import queue
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import QUILL, RESULTS, free_port, machine_line
from cli.engine.rpcrelay import _RECV, CAPS_SIZE, HEADER, HELLO, RequestReader, ServedInPlace

MODEL = Path("/work/shapes/llama-3.2-1b-shape.Q4_K_M.gguf")
REQUEST = HEADER.pack(6, 40) + b"x" * 40
READS = (1, 8, 40)  # command, size, payload: llama.cpp's recv_data calls for one request

# A `quill rpc-server` whose replaced recv counts its calls, written to COUNTS at each accept.
COUNTING_SERVER = """
import sys
from pathlib import Path
from cli.engine import rpcrelay
counts = Path(sys.argv[1])
read, accept = rpcrelay.ServedInPlace._read, rpcrelay.ServedInPlace._accept
calls = [0]
def counted(self, *args):
    calls[0] += 1
    return read(self, *args)
def accepted(self, *args):
    counts.write_text(str(calls[0]))
    return accept(self, *args)
rpcrelay.ServedInPlace._read, rpcrelay.ServedInPlace._accept = counted, accepted
from cli.launch import llama_bindings
llama_bindings()
from cli.app import main
sys.argv = ["quill", "rpc-server", "--port", sys.argv[2], "--threads", "1"]
main()
"""


def read_cost_us(calls: int) -> tuple[float, float]:
    """Microseconds a read takes, plain and through the replaced recv."""
    client, server = socket.socketpair()
    libc = ctypes.CDLL(None)
    recv = libc.recv
    recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    recv.restype = ctypes.c_ssize_t
    guard = object.__new__(ServedInPlace)  # its hooks, without replacing a library's imports
    guard.max_payload, guard.report, guard.waiting = 1 << 30, print, queue.Queue()
    guard.served = {server.fileno(): ("peer", RequestReader(1 << 30))}
    guard._recv = recv
    hooked = _RECV(guard._read)
    buffer = ctypes.create_string_buffer(64)

    def per_read(read: object) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            client.sendall(REQUEST)
            for size in READS:
                read(server.fileno(), buffer, size, 0)  # type: ignore[operator]
        return (time.perf_counter() - start) / calls / len(READS) * 1e6

    best = [min(per_read(read) for _ in range(3)) for read in (recv, hooked)]
    return best[0], best[1]


def hello_and_close(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(HEADER.pack(HELLO, CAPS_SIZE) + bytes(CAPS_SIZE))
        conn.recv(64)


def reads_per_token(model: Path, tokens: tuple[int, int]) -> tuple[float, float]:
    """Reads llama.cpp's server makes per generated token, and a token's time (s) on it."""
    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        counts = Path(scratch) / "counts"
        server = subprocess.Popen(
            [sys.executable, "-c", COUNTING_SERVER, str(counts), str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(3)
            reads, seconds = [], []
            for n in tokens:
                bench = subprocess.run(
                    [QUILL, "bench", str(model), "-t", "1", "-p", "0", "-n", str(n), "-r", "1",
                     "--rpc", f"127.0.0.1:{port}", "--json"],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                seconds.append(1 / json.loads(bench.stdout)["rows"][0]["tokens_per_s"])
                hello_and_close(port)  # its accept writes the count
                time.sleep(0.5)
                reads.append(int(counts.read_text()))
        finally:
            server.kill()
    # reads[i]: all reads before the connection after bench i (each bench's probes included)
    per_token = (reads[1] - 2 * reads[0]) / (tokens[1] - tokens[0])
    return per_token, seconds[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    plain, hooked = read_cost_us(args.calls)
    per_token, token_s = reads_per_token(args.model, (16, 80))
    share = per_token * (hooked - plain) * 1e-6 / token_s
    today = time.strftime("%Y-%m-%d")
    lines = [
        f"# The in-place RPC guard's cost per generated token (issue 41), {today}",
        "",
        f"Command: `python -m benchmarks.rpc_hook_cost --model {args.model} --calls {args.calls}`",
        "",
        machine_line(),
        "",
        f"- a read: {plain:.2f} us plain, {hooked:.2f} us through the replaced recv "
        f"(+{hooked - plain:.2f} us; best of 3 x {args.calls} requests of 3 reads)",
        f"- reads per generated token, one server holding every layer: {per_token:.1f}",
        f"- a token's time there: {token_s * 1000:.1f} ms",
        f"- the guard's share of decode: {share * 100:.2f}%",
    ]
    out = RESULTS / f"rpc-hook-cost-{today}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
