"""Throughput against single-request latency: quill serve under 1, 2, 4 and 8 concurrent clients.

Usage (inside quill's venv):
    python -m benchmarks.serve_load [--parallel 8] [--requests 16] [--max-tokens 64] [--model M]

Starts `quill serve --parallel N` on a free port, then for each concurrency C runs C client
threads that each send requests back to back (greedy, fixed length with ignore_eos, streaming)
until --requests have completed. Per request: TTFT (send to first content chunk) and decode
tokens/s (chunks after the first over the time they took), both from SSE arrival times as a
client sees them. Aggregate: all completion tokens over the wall time. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
from subprocess import DEVNULL

from benchmarks.harness import QUILL, chat_reply, send_concurrently, served_model, serving

PROMPTS = [
    "Write a short story about a lighthouse.",
    "Explain how rain forms.",
    "Describe a busy market in the morning.",
    "Write a letter to a friend about a trip.",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--model", default="smollm2-135m", help="as quill serve takes it")
    args = parser.parse_args()
    command = [QUILL, "serve", args.model, "-np", str(args.parallel), "-c", "512"]
    with serving(command, stderr=DEVNULL) as (_, url):
        model = served_model(url)
        chat_reply(url, PROMPTS[0], 8, model)  # warm-up
        print("| concurrency | requests | aggregate tok/s | TTFT p50 ms | TTFT p95 ms | "
              "per-request decode tok/s (median) |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            replies, wall = send_concurrently(
                url, model, concurrency, args.requests, PROMPTS, args.max_tokens
            )
            ttfts = sorted(r.ttft_s * 1000 for r in replies)
            p95 = ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))]
            print(
                f"| {concurrency} | {len(replies)} | {sum(r.chunks for r in replies) / wall:.1f} | "
                f"{statistics.median(ttfts):.0f} | {p95:.0f} | "
                f"{statistics.median(r.decode_tokens_per_s for r in replies):.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
