"""A multi-turn conversation over the OpenAI API, streamed: time to first token turn by turn, for
quill serve with its prefix cache, quill serve told not to reuse it ("cache_prompt": false, what
every request cost before), and llama-server built from the same sdist, with its defaults.

Usage (inside quill's venv; the machine otherwise idle):
  python -m benchmarks.serve_multiturn --model PATH.gguf [--turns 8] [--words 220] [--threads 2]
      [--rounds 3] [--skip-no-reuse]
      [--llama-server benchmarks/.build/llama-cpp-python-0.3.36/build/bin/llama-server]

Each turn sends the whole history plus a new user message of about --words words (~300 tokens
with the template) and asks for --reply tokens, greedy, through the official openai client with
stream=True; TTFT is from sending the request to the first content chunk, as the client sees
it. Prints a Markdown table; --json FILE writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import openai

from benchmarks.harness import QUILL, TOOLS, serving, turned

DEFAULT_LLAMA_SERVER = TOOLS / "llama-server"
TOPICS = ["harbours", "lighthouses", "tides", "ferries", "storms", "fishing", "maps", "islands"]


def message(turn: int, words: int) -> str:
    """A user message of about `words` words, different each turn."""
    topic = TOPICS[turn % len(TOPICS)]
    filler = " ".join(
        f"Note {i} on {topic}: the {topic} of the northern coast changed in year {1700 + i * 7}."
        for i in range(words // 14 + 1)
    )
    return f"Here are my notes about {topic}. {filler} Summarize them in two sentences."


def conversation(
    url: str, turns: int, words: int, reply: int, extra: dict, system: str
) -> list[dict]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    history = [{"role": "system", "content": system}]
    rows = []
    for turn in range(turns):
        history.append({"role": "user", "content": message(turn, words)})
        started = time.perf_counter()
        ttft = None
        pieces = []
        usage = None
        stream = client.chat.completions.create(
            model="quill", messages=history, max_tokens=reply, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - started
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        rows.append({
            "turn": turn + 1,
            "ttft_ms": (ttft or 0.0) * 1000,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
        })  # fmt: skip
        history.append({"role": "assistant", "content": "".join(pieces)})
    return rows


def measure(command: list[str], env: dict[str, str] | None, args, extra: dict) -> list[dict]:
    with serving(command, env) as (_, url):
        # Warm-up: another conversation (its system prompt differs from the first token on).
        conversation(url, 2, args.words, args.reply, extra, "Warm up.")
        return conversation(
            url, args.turns, args.words, args.reply, extra, "You are a concise assistant."
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a .gguf path (both servers load it)")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--words", type=int, default=220, help="words per user message")
    parser.add_argument("--reply", type=int, default=64, help="max tokens per reply")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--llama-server", default=str(DEFAULT_LLAMA_SERVER))
    parser.add_argument("--skip-llama-server", action="store_true")
    parser.add_argument("--skip-no-reuse", action="store_true", help="leave out cache_prompt false")
    parser.add_argument("--rounds", type=int, default=1, help="conversations per server: medians")
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="quill-bench-home-")
    quill = [QUILL, "serve", "-m", args.model, "--parallel", "1", "--ctx", str(args.ctx),
             "--threads", str(args.threads)]  # fmt: skip
    quill_env = dict(os.environ, QUILL_HOME=home)
    servers = {"quill serve": (quill, quill_env, {})}
    if not args.skip_no_reuse:
        servers["quill serve, no reuse"] = (quill, quill_env, {"cache_prompt": False})
    if not args.skip_llama_server and Path(args.llama_server).exists():
        llama_server = [args.llama_server, "-m", args.model, "-t", str(args.threads),
                        "-c", str(args.ctx), "-np", "1"]  # fmt: skip
        servers["llama-server"] = (llama_server, None, {})
    rounds: dict[str, list[list[dict]]] = {name: [] for name in servers}
    for round_number in range(args.rounds):
        # Interleaved, the order turned each round: a slow spell of the machine hits each.
        for name in turned(list(servers), round_number):
            command, env, extra = servers[name]
            rounds[name].append(measure(command, env, args, extra))
    runs = {name: median_rows(conversations) for name, conversations in rounds.items()}
    names = list(runs)
    print(f"median of {args.rounds} conversation(s) per server")
    print("| turn | prompt tokens | " + " | ".join(f"{n}: TTFT ms (cached)" for n in names) + " |")
    print("|---" * (2 + len(names)) + "|")
    for i in range(args.turns):
        cells = []
        for name in names:
            row = runs[name][i]
            cells.append(f"{row['ttft_ms']:.0f} ({row['cached_tokens']})")
        print(f"| {i + 1} | {runs[names[0]][i]['prompt_tokens']} | " + " | ".join(cells) + " |")
    for name in names:
        rows = runs[name]
        print(f"{name}: turn {args.turns} TTFT / turn 1 TTFT = "
              f"{rows[-1]['ttft_ms'] / rows[0]['ttft_ms']:.2f}")  # fmt: skip
    if "llama-server" in runs:
        ratios = [
            ours["ttft_ms"] / theirs["ttft_ms"]
            for ours, theirs in zip(runs["quill serve"], runs["llama-server"], strict=True)
        ]
        print("quill serve / llama-server, turn by turn: " + ", ".join(f"{r:.2f}" for r in ratios))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"median": runs, "rounds": rounds}, indent=1))


def median_rows(conversations: list[list[dict]]) -> list[dict]:
    """Turn by turn, the median TTFT over the conversations (tokens are the same in each)."""
    rows = []
    for turn_rows in zip(*conversations, strict=True):
        times = sorted(row["ttft_ms"] for row in turn_rows)
        rows.append({**turn_rows[0], "ttft_ms": times[len(times) // 2]})
    return rows


if __name__ == "__main__":
    main()
