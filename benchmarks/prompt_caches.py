"""Caches that outlive a process: what they save and what they take.

Usage (inside quill's venv; the machine otherwise idle):
  python -m benchmarks.prompt_caches --model PATH.gguf [--tokens 3000] [--threads 2]

1. Repeated pipeline: the same ~3,000-token file piped into `quill run` twice (a fresh
   QUILL_HOME): TTFT of each run from `--json`, and the second's share of the first.
2. Resume: a ~3,000-token conversation, prefilled from nothing against loaded from the state a
   chat saved beside its transcript (what `quill chat --resume` does), then one new message.
3. Disk: the cache file's size against the KV formula (quant.kv) for the tokens it holds.
Prints Markdown; --json FILE writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from cli.store.promptcache import PromptCacheStore, files
from quant.kv import kv_cache_bytes

GREEDY = SamplingParams(temperature=0)


def long_text(words: int) -> str:
    names = ["Alice", "Bruno", "Chen", "Dalia", "Emeka", "Freya", "Goran", "Hana"]
    places = ["harbour", "market", "library", "bridge", "orchard", "station"]
    return " ".join(
        f"{names[i % 8]} met {names[(i * 3 + 1) % 8]} at the {places[i % 6]} in {1900 + i}."
        for i in range(words // 9 + 1)
    )


def pipeline(model: str, text: str, threads: int) -> dict:
    home = tempfile.mkdtemp(prefix="quill-bench-home-")
    quill = str(Path(sys.executable).with_name("quill"))
    runs = []
    for _ in range(2):
        result = subprocess.run(
            [quill, "run", "-m", model, "--json", "--temperature", "0", "-n", "16",
             "--threads", str(threads), "Summarize the text above."],
            input=text, capture_output=True, text=True, check=True,
            env=dict(os.environ, QUILL_HOME=home),
        )  # fmt: skip
        runs.append(json.loads(result.stdout))
    cache = files(Path(home) / "cache" / "prompts")
    return {
        "prompt_tokens": runs[0]["prompt_tokens"],
        "first_ttft_ms": runs[0]["ttft_s"] * 1000,
        "second_ttft_ms": runs[1]["ttft_s"] * 1000,
        "second_cached_tokens": runs[1]["cached_prompt_tokens"],
        "same_text": runs[0]["text"] == runs[1]["text"],
        "cache_file_bytes": sum(p.stat().st_size for p in cache),
    }


def resume(model: str, text: str, threads: int) -> dict:
    options = LoadOptions(n_ctx=8192, threads=threads)
    folder = Path(tempfile.mkdtemp(prefix="quill-bench-chat-"))
    history = [("user", text + "\n\nWho met whom most often?"), ("assistant", "Alice and Chen.")]
    follow_up = [*history, ("user", "And at the library?")]
    with Engine(Path(model), options) as engine:
        key = {"bench": True}
        store = PromptCacheStore(folder, key, min_tokens=64, exact=False)
        conversation = engine.tokenize(engine.conversation_text(history)[0])
        started = time.perf_counter()
        next(engine.stream_generate(conversation, 1, GREEDY))
        prefill_s = time.perf_counter() - started
        engine.prompt_cache = store
        engine.keep_prompt_cache(always=True)
        n_cells = engine.cached_count(0)
    with Engine(Path(model), options) as engine:
        engine.prompt_cache = PromptCacheStore(folder, key, min_tokens=64, exact=False)
        prompt = engine.tokenize(engine.conversation_text(follow_up)[0])
        started = time.perf_counter()
        first = next(engine.stream_generate(prompt, 1, GREEDY))
        resumed_s = time.perf_counter() - started
        restore_s = engine.restore_s
    with Engine(Path(model), options) as engine:
        started = time.perf_counter()
        next(engine.stream_generate(prompt, 1, GREEDY))
        cold_s = time.perf_counter() - started
    (state,) = files(folder)
    return {
        "conversation_tokens": len(conversation),
        "prefill_ms": prefill_s * 1000,
        "restore_ms": restore_s * 1000,
        "resumed_turn_ttft_ms": resumed_s * 1000,
        "cold_turn_ttft_ms": cold_s * 1000,
        "resumed_cached_tokens": first.cached_prompt_tokens,
        "state_file_bytes": state.stat().st_size,
        "cells": n_cells,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=3000, help="about this many prompt tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    text = long_text(int(args.tokens * 0.62))  # ~1.6 tokens a word in this text
    piped = pipeline(args.model, text, args.threads)
    resumed = resume(args.model, text, args.threads)
    from quant.memory import ModelShape

    shape = ModelShape.from_gguf(Path(args.model))
    per_token = kv_cache_bytes(shape.n_layers, shape.kv_heads, shape.head_dim_k, 1, "f16")
    print("## Repeated pipeline (same file, two runs)\n")
    print("| prompt tokens | run 1 TTFT ms | run 2 TTFT ms | run 2 / run 1 | cached | same text |")
    print("|---|---|---|---|---|---|")
    print(f"| {piped['prompt_tokens']} | {piped['first_ttft_ms']:.0f} | "
          f"{piped['second_ttft_ms']:.0f} | "
          f"{piped['second_ttft_ms'] / piped['first_ttft_ms']:.1%} | "
          f"{piped['second_cached_tokens']} | {piped['same_text']} |")  # fmt: skip
    print("\n## Resume vs prefill of a conversation\n")
    print("| tokens | prefill ms | restore ms | restore / prefill | resumed turn TTFT ms "
          "| cold turn TTFT ms |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    print(f"| {resumed['conversation_tokens']} | {resumed['prefill_ms']:.0f} | "
          f"{resumed['restore_ms']:.0f} | {resumed['restore_ms'] / resumed['prefill_ms']:.1%} | "
          f"{resumed['resumed_turn_ttft_ms']:.0f} | "
          f"{resumed['cold_turn_ttft_ms']:.0f} |")  # fmt: skip
    print("\n## Disk against the KV formula (f16)\n")
    cells = resumed["cells"]
    print(f"state file {resumed['state_file_bytes'] / 2**20:.1f} MiB for {cells} cells; formula "
          f"{per_token * cells / 2**20:.1f} MiB ({per_token} bytes a token); pipeline cache "
          f"{piped['cache_file_bytes'] / 2**20:.1f} MiB")  # fmt: skip
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"pipeline": piped, "resume": resumed}, indent=1))


if __name__ == "__main__":
    main()
