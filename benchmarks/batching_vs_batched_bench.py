"""quill's continuous-batching scheduler against llama.cpp's llama-batched-bench.

Usage (inside quill's venv; builds llama-batched-bench from the same sdist on first use):
    python -m benchmarks.batching_vs_batched_bench [--npl 1,2,4,8] [--rounds 3]

The shape llama-batched-bench measures: B sequences, each a prompt of 32 tokens then 64
generated tokens, all started together; S t/s is all prompt and generated tokens over the wall
time. quill runs the same through BatchScheduler (random prompt tokens, greedy, ignore EOS), so
its per-token work (sampler chain, detokenizing, one event per token to a queue) is included.
Rounds alternate between the two; medians are compared. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import subprocess
import time
from pathlib import Path

from cli.engine.batching import BatchRequest, BatchScheduler
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from cli.store.models import obtain, parse_model_name
from cli.store.registry import load_registry

HERE = Path(__file__).resolve().parent
PROMPT, GENERATED = 32, 64


def quill_round(engine: Engine, scheduler: BatchScheduler, npl: int, rng: random.Random) -> float:
    sampling = SamplingParams(temperature=0, ignore_eos=True)
    started = time.perf_counter()
    prompts = [[rng.randrange(engine.n_vocab) for _ in range(PROMPT)] for _ in range(npl)]
    requests = [scheduler.submit(BatchRequest(p, GENERATED, sampling)) for p in prompts]
    for request in requests:
        for _ in request.stream():
            pass
    return npl * (PROMPT + GENERATED) / (time.perf_counter() - started)


def batched_bench_round(binary: Path, model: Path, npl: int, threads: int) -> float:
    out = subprocess.run(
        [str(binary), "-m", str(model), "-c", str(npl * (PROMPT + GENERATED) + 64), "-b", "512",
         "-ub", "512", "-npp", str(PROMPT), "-ntg", str(GENERATED), "-npl", str(npl),
         "-t", str(threads), "--no-repack"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    row = [line for line in out.splitlines() if re.match(rf"\|\s+{PROMPT}\s+\|", line)][-1]
    return float(row.strip("|").split("|")[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--npl", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    built = subprocess.run(
        ["bash", str(HERE / "build_llama_bench.sh")], capture_output=True, text=True, check=True
    )
    binary = Path(built.stdout.strip().splitlines()[-1]).with_name("llama-batched-bench")
    model = obtain(parse_model_name("smollm2-135m", load_registry()))
    rng = random.Random(0)
    print("| sequences | quill S tok/s | llama-batched-bench S tok/s | ratio |")
    print("|---|---|---|---|")
    for npl in (int(n) for n in args.npl.split(",")):
        options = LoadOptions(n_ctx=PROMPT + GENERATED + 8, threads=args.threads, parallel=npl)
        ours, theirs = [], []
        with Engine(model, options) as engine:
            scheduler = BatchScheduler(engine)
            quill_round(engine, scheduler, npl, rng)  # warm-up
            for _ in range(args.rounds):
                ours.append(quill_round(engine, scheduler, npl, rng))
                theirs.append(batched_bench_round(binary, model, npl, args.threads))
            scheduler.close()
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"| {npl} | {a:.1f} | {b:.1f} | {a / b:.3f} |", flush=True)


if __name__ == "__main__":
    main()
