"""Throughput against single-request latency: quill serve under 1, 2, 4 and 8 concurrent clients.

Usage (inside quill's venv):
    python benchmarks/serve_load.py [--parallel 8] [--requests 16] [--max-tokens 64] [--model M]

Starts `quill serve --parallel N` on a free port, then for each concurrency C runs C client
threads that each send requests back to back (greedy, fixed length with ignore_eos, streaming)
until --requests have completed. Per request: TTFT (send to first content chunk) and decode
tokens/s (chunks after the first over the time they took), both from SSE arrival times as a
client sees them. Aggregate: all completion tokens over the wall time. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

PROMPTS = [
    "Write a short story about a lighthouse.",
    "Explain how rain forms.",
    "Describe a busy market in the morning.",
    "Write a letter to a friend about a trip.",
]


def one_request(url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), headers
    )
    started = time.perf_counter()
    arrivals = []
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["delta"].get("content"):
                arrivals.append(time.perf_counter())
    ttft = arrivals[0] - started
    decode = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else 0.0
    return ttft, decode, len(arrivals)


def measure(
    url: str, concurrency: int, requests: int, max_tokens: int
) -> tuple[list[tuple[float, float, int]], float]:
    """(ttft_s, decode tokens/s, tokens) per request, and the wall time of all of them."""
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def client() -> None:
        while True:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            outcome = one_request(url, PROMPTS[index % len(PROMPTS)], max_tokens)
            with lock:
                results.append(outcome)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--model", default="smollm2-135m", help="as quill serve takes it")
    args = parser.parse_args()
    ready = Path(tempfile.mkdtemp()) / "port"
    server = subprocess.Popen(
        ["quill", "serve", args.model, "--port", "0", "-np", str(args.parallel), "-c", "512"],
        env=dict(os.environ, QUILL_SERVE_READY_FILE=str(ready)),
        stderr=subprocess.DEVNULL,
    )
    try:
        while not ready.exists() or not ready.read_text():
            time.sleep(0.1)
        url = f"http://127.0.0.1:{ready.read_text()}"
        one_request(url, PROMPTS[0], 8)  # warm-up
        print("| concurrency | requests | aggregate tok/s | TTFT p50 ms | TTFT p95 ms | "
              "per-request decode tok/s (median) |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            results, wall = measure(url, concurrency, args.requests, args.max_tokens)
            ttfts = sorted(r[0] * 1000 for r in results)
            p95 = ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))]
            print(
                f"| {concurrency} | {len(results)} | {sum(r[2] for r in results) / wall:.1f} | "
                f"{statistics.median(ttfts):.0f} | {p95:.0f} | "
                f"{statistics.median(r[1] for r in results):.1f} |",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
