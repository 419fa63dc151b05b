"""The KV store (issue 43): what loading a kept sequence from disk costs against prefilling it
again, and what a conversation through quill serve costs when its model leaves memory between
turns.

Usage (inside quill's venv; the machine otherwise idle):
  python -m benchmarks.kv_store --model PATH.gguf [--prefix 64 1024 4096] [--threads 2]
      [--turns 8] [--words 60] [--reply-tokens 16] [--rounds 3] [--json FILE]
      [--llama-server benchmarks/.build/llama-cpp-python-0.3.36/build/bin/llama-server]

Part 1, in process: a prefix of N tokens is prefilled (the cost of recomputing it), its state
kept in a KV store in a temporary folder (the write), then found and restored into a fresh
context (the read: the file's header and state checked, llama.cpp's restore); the page cache is
warm, as it is for a state just written. Part 2, through `quill serve --max-models 1` serving
the model and a copy of it under another name (a request to the copy evicts the model): a
conversation of --turns turns, each turn's TTFT as the client sees it (1) with the model kept
loaded, (2) evicted before every turn (the turn's TTFT includes loading the model again), (3)
with the server restarted before every turn (its start apart: TTFT from the first request).
With --llama-server, (4) llama-server's router (--models-dir, --models-max 1) serving the same
two files, the model evicted before every turn: it loads the model again and prefills the whole
conversation, which is what the KV store spares quill. Each turn's user message is about --words
words; replies are greedy, at most --reply-tokens tokens (16 cuts every reply short; a model
that ends its one-sentence summary, as SmolLM2 does, stops sooner than 128). Each mode has
--rounds conversations, in turns (harness.py's interleave), and each turn's ratio (2 and 3 over
1, 2 over 4) is the median over the rounds of the same round's ratio: one conversation's prefill
alone varies by 25% from run to run here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

from benchmarks.harness import (
    QUILL,
    interleave,
    machine_line,
    start_server,
    stop_server,
    users_env,
)
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from cli.store.promptcache import PromptCacheStore

GREEDY = SamplingParams(temperature=0.0)


def restore_vs_prefill(model: Path, n_tokens: int, threads: int) -> dict:
    options = LoadOptions(n_ctx=max(1024, n_tokens + 64), threads=threads)
    folder = Path(tempfile.mkdtemp(prefix="quill-kv-bench-"))
    try:
        with Engine(model, options) as engine:
            words = " ".join(f"w{n % 997}" for n in range(n_tokens * 2))
            tokens = engine.tokenize(words)[:n_tokens]
            started = time.perf_counter()
            next(engine.stream_generate(tokens, 1, GREEDY))
            prefill_s = time.perf_counter() - started
            store = PromptCacheStore(folder, {"bench": 1}, max_bytes=1 << 40, min_tokens=1)
            started = time.perf_counter()
            kept = engine.kv.cached(0)
            store.keep(kept, engine.kv.sequence_state(0))
            write_s = time.perf_counter() - started
            size = sum(p.stat().st_size for p in folder.glob("*.kv"))
        with Engine(model, options) as engine:
            store = PromptCacheStore(folder, {"bench": 1}, max_bytes=1 << 40, min_tokens=1)
            started = time.perf_counter()
            found = store.find(kept, capacity=engine.n_ctx)
            assert found is not None
            assert engine.kv.restore_sequence(0, found[1], found[0])
            restore_s = time.perf_counter() - started
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "tokens": n_tokens,
        "prefill_s": prefill_s,
        "write_s": write_s,
        "restore_s": restore_s,
        "file_bytes": size,
        "restore_over_prefill": restore_s / prefill_s,
    }


def message(turn: int, words: int) -> str:
    filler = " ".join(
        f"Note {turn}.{i}: the tide rose in year {1700 + i * 7}." for i in range(words // 8)
    )
    return f"{filler} Summarize turn {turn} in one sentence."


def ask(url: str, model: str, history: list[dict], reply_tokens: int = 16) -> tuple[float, dict]:
    """(TTFT as the client sees it, the last chunk's timings) for a streamed reply."""
    body = {"model": model, "messages": history, "max_tokens": reply_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    started, ttft, text = time.perf_counter(), None, []
    timings: dict = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    ttft = ttft or time.perf_counter() - started
                    text.append(choice["delta"]["content"])
    history.append({"role": "assistant", "content": "".join(text)})
    return ttft or 0.0, timings


def model_pair(model: Path) -> Path:
    """A folder holding a copy of model and another named other.gguf, written to disk before any
    server starts: a copy made just before a conversation was still being written back while it
    ran (800 MB of a 1B model, the kernel's writeback on the same 2 cores)."""
    folder = Path(tempfile.mkdtemp(prefix="quill-kv-models-"))
    for name in (model.name, "other.gguf"):
        shutil.copyfile(model, folder / name)
        with open(folder / name, "rb+") as copy:
            os.fsync(copy.fileno())
    return folder


def server_command(model: Path, threads: int, llama_server: Path | None) -> list:
    """quill serve, or llama-server's router, serving model and other.gguf beside it (model_pair),
    one model loaded at a time, one slot of 8,192 tokens."""
    if llama_server is None:
        return [str(QUILL), "serve", str(model), str(model.with_name("other.gguf")),
                "--max-models", "1", "--parallel", "1", "--ctx", "8192",
                "--threads", str(threads)]  # fmt: skip
    return [str(llama_server), "--models-dir", str(model.parent), "--models-max", "1", "-np",
            "1", "-c", "8192", "-t", str(threads), "--jinja"]  # fmt: skip


def conversation(
    model: Path, mode: str, settings: argparse.Namespace, llama_server: Path | None = None
) -> list[dict]:
    """Each turn's TTFT and timings; mode: kept (the model stays loaded), evicted (a request to
    the other model before each turn), restarted (the server started again before each)."""
    home = Path(tempfile.mkdtemp(prefix="quill-kv-home-"))
    command = server_command(model, settings.threads, llama_server)
    env = users_env(QUILL_HOME=str(home))
    history: list[dict] = [{"role": "system", "content": "You summarize notes briefly."}]
    rows = []
    process, url = start_server(command, env, stderr=subprocess.DEVNULL)
    try:
        for turn in range(settings.turns):
            if mode == "evicted" and turn:
                ask(url, "other", [{"role": "user", "content": "Hello."}])
            if mode == "restarted" and turn:
                stop_server(process)
                process, url = start_server(command, env, stderr=subprocess.DEVNULL)
            history.append({"role": "user", "content": message(turn, settings.words)})
            ttft, timings = ask(url, model.stem, history, settings.reply_tokens)
            rows.append({"turn": turn + 1, "mode": mode, "ttft_s": ttft, **timings})
    finally:
        stop_server(process)
        shutil.rmtree(home, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prefix", type=int, nargs="*", default=[64, 1024, 4096])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--words", type=int, default=60)
    parser.add_argument("--reply-tokens", type=int, default=16, help="most tokens of a reply")
    parser.add_argument("--rounds", type=int, default=3, help="conversations of each mode")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--llama-server", type=Path, help="also llama-server's router, which recomputes"
    )
    args = parser.parse_args()
    print(machine_line())
    costs = [restore_vs_prefill(args.model, n, args.threads) for n in args.prefix]
    print("| prefix tokens | prefill s | write s | restore s | file MiB | restore / prefill |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c in costs:
        print(f"| {c['tokens']} | {c['prefill_s']:.3f} | {c['write_s']:.3f} | {c['restore_s']:.3f} "
              f"| {c['file_bytes'] / 2**20:.1f} | {c['restore_over_prefill']:.3f} |")  # fmt: skip
    pair = model_pair(args.model)
    served = pair / args.model.name
    contenders = {
        mode: (lambda _, mode=mode: {"rows": conversation(served, mode, args)})
        for mode in ("kept", "evicted", "restarted")
    }
    if args.llama_server is not None:
        server = args.llama_server
        contenders["router"] = lambda _: {"rows": conversation(served, "evicted", args, server)}
    try:
        rounds = interleave(contenders, args.rounds)
    finally:
        shutil.rmtree(pair, ignore_errors=True)
    report_turns(rounds)
    if args.json:
        settings = {"turns": args.turns, "words": args.words, "reply_tokens": args.reply_tokens}
        report = {"machine": machine_line(), "settings": settings, "costs": costs, "rounds": rounds}
        args.json.write_text(json.dumps(report, indent=1))


def report_turns(rounds: list[dict[str, dict]]) -> None:
    """Per turn: the kept TTFT's median, and the medians over rounds of each mode's TTFT over the
    same round's kept one, and of quill's evicted TTFT over the same round's router's."""
    print(
        "| turn | prompt tokens | TTFT kept ms (median) | evicted / kept (min-max) "
        "| restarted / kept (min-max) | quill evicted / llama-server router |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    pairs = [("evicted", "kept"), ("restarted", "kept")]
    if "router" in rounds[0]:
        pairs.append(("evicted", "router"))
    for n, first in enumerate(rounds[0]["kept"]["rows"]):
        kept = [r["kept"]["rows"][n]["ttft_s"] for r in rounds]
        cells = []
        for mode, reference in pairs:
            ratios = [
                r[mode]["rows"][n]["ttft_s"] / r[reference]["rows"][n]["ttft_s"] for r in rounds
            ]
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        prompt = first.get("cache_n", 0) + first.get("prompt_n", 0)
        print(
            f"| {n + 1} | {prompt} | {statistics.median(kept) * 1000:.0f} | {' | '.join(cells)} |"
        )


if __name__ == "__main__":
    main()
