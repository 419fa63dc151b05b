"""`quill chat --endpoint` against `quill serve`: the TTFT of each turn of an 8-turn
conversation, as chat's own stats line reports it (from sending the request to the first
streamed token), to show that a conversation held by quill's chat client through quill's server
stays flat: the server reuses the conversation's cached prefix, and the client sends the history
exactly as it received it.

Usage (inside quill's venv; the machine otherwise idle):
  python -m benchmarks.chat_endpoint --model PATH.gguf [--turns 8] [--words 220] [--threads 2]

The user messages are serve_multiturn.py's (~300 tokens each with the template); replies are
greedy, up to --reply tokens. Prints a Markdown table; --json FILE writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

from benchmarks.harness import QUILL, serving
from benchmarks.serve_multiturn import message

TTFT = re.compile(r"TTFT (\d+) ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a .gguf path")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--words", type=int, default=220)
    parser.add_argument("--reply", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="quill-bench-home-")
    server = [QUILL, "serve", "-m", args.model, "--parallel", "1", "--ctx", str(args.ctx),
              "--threads", str(args.threads)]  # fmt: skip
    with serving(server, dict(os.environ, QUILL_HOME=home)) as (_, url):
        lines = "".join(message(turn, args.words) + "\n" for turn in range(args.turns))
        done = subprocess.run(
            [QUILL, "chat", "--endpoint", f"{url}/v1", "-n", str(args.reply), "--temperature", "0",
             "-s", "You are a concise assistant."],
            input=lines, capture_output=True, text=True,
            env=dict(os.environ, QUILL_HOME=home), check=False,
        )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"quill chat failed ({done.returncode}): {done.stderr[-2000:]}")
    ttfts = [int(found) for found in TTFT.findall(done.stderr)]
    if len(ttfts) != args.turns:
        raise SystemExit(f"expected {args.turns} stats lines, found {len(ttfts)}: {done.stderr}")
    print("| turn | quill chat --endpoint: TTFT ms |")
    print("|---|---|")
    for turn, ttft in enumerate(ttfts, 1):
        print(f"| {turn} | {ttft} |")
    print(f"turn {args.turns} TTFT / turn 1 TTFT = {ttfts[-1] / ttfts[0]:.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"ttft_ms": ttfts}, indent=1))


if __name__ == "__main__":
    main()
