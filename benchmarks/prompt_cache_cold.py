"""What the automatic prompt cache costs a run that misses it, and what it saves one that hits.

Usage (inside quill's venv, OpenMP as users have it, the lock held):
  flock /work/notes/bench.lock python -m benchmarks.prompt_cache_cold \
      [--model /work/shapes/llama-3.2-1b-shape.Q4_K_M.gguf] [--rounds 7] [--words 720] \
      [--baseline DIR] [--json FILE] [--md FILE]

Each round pipes a document into `quill run` (its chat template, greedy, 16 tokens, --ignore-eos)
on one QUILL_HOME whose model hash is already remembered, as a pipeline's later runs find it:
  cold      a document no earlier run sent (the cache misses, then keeps its state);
  no-cache  the same document with --no-cache;
  warm      the cold run's document again (the cache loads it).
cold and no-cache (and the baseline's cold) take turns going first. Per run: seconds from the
spawn to the reply's last byte on the pipe, and to the process's exit. --baseline DIR (a source
tree of quill: `git archive COMMIT cli quant models.yaml | tar -x -C DIR`) adds that tree's cold
and warm runs to each round, on a QUILL_HOME of its own. Then, in this process, each step a save
takes (--steps-only: just that). Medians throughout; the cold cost is
median(cold) / median(no-cache) - 1.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp as llama

from benchmarks.harness import QUILL, median_ms
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.store.promptcache import PromptCacheStore, cache_dir, engine_key, model_sha256
from quant.partfiles import write_replacing

MODEL = "/work/shapes/llama-3.2-1b-shape.Q4_K_M.gguf"

QUESTION = "Summarize the text above."
FIRST, BASELINE = 1_000_000, 2_000_000  # the seeds of the first run's and the baseline's texts


def document(seed: int, words: int) -> str:
    """Sentences drawn from seed (>= 0: Random takes -n as n): two seeds differ from the first
    sentence on."""
    rng = random.Random(seed)
    names = ["Alice", "Bruno", "Chen", "Dalia", "Emeka", "Freya", "Goran", "Hana", "Ines", "Jun"]
    places = ["harbour", "market", "library", "bridge", "orchard", "station", "mill", "school"]
    sentences = [
        f"{rng.choice(names)} met {rng.choice(names)} at the {rng.choice(places)} in "
        f"{rng.randint(1700, 2020)}."
        for _ in range(words // 8 + 1)
    ]
    return " ".join(sentences)


def run(model: str, text: str, home: Path, threads: int, *extra: str, source: str = "") -> dict:
    """One `quill run`: seconds to its reply's last byte and to its exit, and its stats."""
    env = dict(os.environ, QUILL_HOME=str(home))
    if source:
        env["PYTHONPATH"] = source  # ahead of the editable install's path
    command = [QUILL, "run", "-m", model, "-n", "16", "--ignore-eos", "--temperature", "0",
               "-t", str(threads), *extra, QUESTION]  # fmt: skip
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stderr:
        stdin.write(text.encode())
        stdin.seek(0)
        started = time.perf_counter()
        process = subprocess.Popen(
            command, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr, env=env
        )
        last_byte = started
        while os.read(process.stdout.fileno(), 1 << 16):
            last_byte = time.perf_counter()
        code = process.wait()
        exited = time.perf_counter()
        stderr.seek(0)
        said = stderr.read().decode(errors="replace")
    if code != 0:
        raise SystemExit(f"quill run failed ({code}): {said[-2000:]}")
    prefill = re.search(r"prefill (\d+) tok", said)
    cached = re.search(r"(\d+) tokens from cache in (\d+) ms", said)
    return {
        "last_byte_s": last_byte - started,
        "exit_s": exited - started,
        "after_s": exited - last_byte,  # where the save is: after the reply
        "prefilled_tokens": int(prefill[1]) if prefill else None,
        "cached_tokens": int(cached[1]) if cached else 0,
        "restore_ms": int(cached[2]) if cached else None,
        "warnings": [line for line in said.splitlines() if "warning" in line],
    }


def rounds(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="quill-cold-"))
    homes = {"new": work / "new", "base": work / "base"}
    kinds = ["cold", "no-cache", "warm"] + (["base cold", "base warm"] if args.baseline else [])
    samples: dict[str, list[dict]] = {kind: [] for kind in kinds}
    first = {}
    try:
        # The first run with a model file hashes it (the cache's key): timed apart, once.
        first["new"] = run(args.model, document(FIRST, args.words), homes["new"], args.threads)
        if args.baseline:
            first["base"] = run(
                args.model, document(FIRST, args.words), homes["base"], args.threads,
                source=args.baseline,
            )  # fmt: skip
        for n in range(args.rounds):
            text = document(n, args.words)
            plan = {
                "cold": (text, homes["new"], ()),
                "no-cache": (text, homes["new"], ("--no-cache",)),
            }
            if args.baseline:
                plan["base cold"] = (document(BASELINE + n, args.words), homes["base"], ())
            order = list(plan)[n % len(plan) :] + list(plan)[: n % len(plan)]
            order += ["warm"] + (["base warm"] if args.baseline else [])
            plan["warm"], plan["base warm"] = plan["cold"], plan.get("base cold")
            for kind in order:
                text, home, extra = plan[kind]
                source = args.baseline if kind.startswith("base") else ""
                samples[kind].append(
                    run(args.model, text, home, args.threads, *extra, source=source)
                )
            print(f"round {n + 1}: " + ", ".join(
                f"{kind} {samples[kind][-1]['exit_s']:.2f} s" for kind in kinds
            ), file=sys.stderr, flush=True)  # fmt: skip
        files_kept = len(list(cache_dir(homes["new"]).glob("*.kv")))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"first": first, "samples": samples, "files_kept": files_kept}


def steps(args: argparse.Namespace) -> dict:
    """Each step of one save, timed in this process on a prefilled document (medians of 5)."""
    work = Path(tempfile.mkdtemp(prefix="quill-cold-steps-"))
    os.environ["QUILL_HOME"] = str(work)
    found: dict[str, float] = {}
    try:
        with Engine(Path(args.model), LoadOptions(n_ctx=4096, threads=args.threads)) as engine:
            tokens = engine.tokenize(document(0, args.words) + "\n" + QUESTION)
            engine.prefill(tokens)
            found["model sha256, first run of a model file"], _ = median_ms(
                lambda: model_sha256(engine.path, work / f"memo-{time.time_ns()}"), 1
            )
            store = PromptCacheStore(cache_dir(), engine_key(engine))
            found["key, the model's hash remembered"], _ = median_ms(lambda: engine_key(engine), 5)
            for seed in range(1, 6):  # some files to look through, as a pipeline's cache holds
                store.keep([*tokens[:-1], seed + 1], engine.sequence_state(0))
            found["find on a miss (5 files)"], _ = median_ms(lambda: store.find(tokens[::-1]), 5)

            def old_state() -> bytes:
                size = llama.llama_state_seq_get_size(engine._ctx, 0)
                buffer = (ctypes.c_uint8 * size)()
                written = llama.llama_state_seq_get_data(engine._ctx, buffer, size, 0)
                return ctypes.string_at(buffer, written)

            found["state out of llama.cpp, before (a zeroed buffer, copied)"], _ = median_ms(
                old_state, 5
            )
            found["state out of llama.cpp, now (sequence_state)"], state = median_ms(
                lambda: engine.sequence_state(0), 5
            )
            found["sha256 of the state"], _ = median_ms(
                lambda: hashlib.sha256(state).hexdigest(), 5
            )
            as_bytes = bytes(state)  # what the state was before: bytes, joined to its header
            found["header + state joined in one bytes (before)"], joined = median_ms(
                lambda: b"header" + as_bytes, 5
            )
            target = work / "timed.kv"
            found["write + fsync + rename (before)"], _ = median_ms(
                lambda: write_replacing(target, joined), 5
            )
            found["write + rename, no fsync (now)"], _ = median_ms(
                lambda: write_replacing(target, b"header", state, sync=False), 5
            )
            found["keep: the whole save, now"], _ = median_ms(
                lambda: store.keep(engine.cached(0), engine.sequence_state(0)), 5
            )
            found["state MB"] = len(state) / 1e6
            found["prompt tokens"] = len(tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return found


def markdown(result: dict) -> str:
    lines = [f"model {result['model']}, {result['threads']} threads, ~{result['words']} words"]
    if "samples" in result:
        samples = result["samples"]
        metrics = ("last_byte_s", "exit_s", "after_s")
        medians = {
            kind: {m: statistics.median([r[m] for r in runs]) for m in metrics}
            for kind, runs in samples.items()
        }
        base = medians["no-cache"]
        lines += [
            "",
            f"{len(samples['cold'])} rounds, prompt {samples['cold'][0]['prefilled_tokens']} "
            f"tokens (template included); {result['files_kept']} cache files kept at the end",
            "",
            "| run | last byte s | exit s | exit - last byte s | last byte vs no-cache | "
            "exit vs no-cache | tokens from cache |",
            "|---|---|---|---|---|---|---|",
        ]
        for kind, m in medians.items():
            cached = statistics.median([r["cached_tokens"] for r in samples[kind]])
            lines.append(
                f"| {kind} | {m['last_byte_s']:.3f} | {m['exit_s']:.3f} | {m['after_s']:.3f} | "
                f"{m['last_byte_s'] / base['last_byte_s'] - 1:+.1%} | "
                f"{m['exit_s'] / base['exit_s'] - 1:+.1%} | {cached:.0f} |"
            )
        for kind in ("cold", "base cold"):
            if kind in medians:
                save = medians[kind]["after_s"] - base["after_s"]
                lines.append(
                    f"\n{kind}: the save after the reply, median exit - last byte against "
                    f"no-cache's: {save * 1000:+.0f} ms, {save / base['exit_s']:+.1%} of "
                    "no-cache's exit"
                )
        for label, first in result["first"].items():
            lines.append(f"\nfirst run with the model file ({label}): exit {first['exit_s']:.3f} s")
    if "steps" in result:
        lines += ["", "| step of one save (in process, median) | ms |", "|---|---|"]
        lines += [f"| {name} | {value:.1f} |" for name, value in result["steps"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--words", type=int, default=720)  # ~1,000 tokens with Llama 3's
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", help="a source tree of quill to compare with")
    parser.add_argument("--steps-only", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args()
    result: dict = {"model": args.model, "threads": args.threads, "words": args.words}
    if not args.steps_only:
        result.update(rounds(args))
    result["steps"] = steps(args)
    text = markdown(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        args.md.write_text(text)


if __name__ == "__main__":
    main()
