"""What a second model's idle scheduler costs the busy one in a server: two engines over one file
in one process, each with its batch scheduler (as `quill serve` holds two loaded models); the
second serves one request, then sits idle while the first decodes 4 parallel requests.

OpenMP gives each thread that computes a team of workers; while the teams together outnumber the
cores, libgomp shortens its spin-wait and every barrier sleeps. The scheduler ends its thread when
idle (cli/engine/batching.py, IDLE_EXIT_S), taking its team along; `kept` turns that off for the
idle one (its thread stays, as before), `ended` keeps it. Interleaved rounds, the order turning;
the busy model's aggregate tokens/s, and the context switches of its compute thread.

Usage (inside quill's venv, under the benchmark lock, OMP_WAIT_POLICY unset):
  flock /work/notes/bench.lock python -m benchmarks.openmp_teams [--model FILE] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from cli.engine.batching import BatchRequest, BatchScheduler
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, ignore_eos=True)


def context_switches() -> int:
    """Of every thread of this process, voluntary ones: a thread that slept and was woken."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        status = Path(f"/proc/self/task/{tid}/status").read_text()
        total += sum(int(line.split()[1]) for line in status.splitlines()
                     if line.startswith("voluntary_ctxt_switches"))  # fmt: skip
    return total


def measure(model: Path, threads: int, idle_exit_s: float, tokens: int) -> tuple[float, int]:
    options = LoadOptions(n_ctx=512, parallel=4, threads=threads)
    with Engine(model, options) as busy, Engine(model, options) as other:
        idle = BatchScheduler(other, idle_exit_s=idle_exit_s)
        work = BatchScheduler(busy)
        try:
            list(idle.submit(BatchRequest(other.tokenize("Hello"), 4, GREEDY)).stream())
            time.sleep(1.0)  # past the ended case's idle limit below
            prompts = [busy.tokenize(f"Request {i}: tell me about the sea.") for i in range(4)]
            switches, started = context_switches(), time.perf_counter()
            requests = [work.submit(BatchRequest(p, tokens, GREEDY)) for p in prompts]
            generated = sum(len(list(r.stream())) for r in requests)
            seconds = time.perf_counter() - started
            return generated / seconds, context_switches() - switches
        finally:
            work.close()
            idle.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path,
                        default=Path("/work/shapes/llama-3.2-1b-shape.Q4_K_M.gguf"))  # fmt: skip
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    if "OMP_WAIT_POLICY" in os.environ:
        raise SystemExit("unset OMP_WAIT_POLICY: benchmarks run with OpenMP as users have it")
    cases = {"ended": 0.5, "kept": 1e9}
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in cases}
    for number in range(args.rounds):
        names = list(cases)[number % 2 :] + list(cases)[: number % 2]
        for name in names:
            speed, switches = measure(args.model, args.threads, cases[name], args.tokens)
            results[name].append((speed, switches))
            print(f"round {number + 1}: {name} {speed:.2f} tok/s, {switches} context switches",
                  flush=True)  # fmt: skip
    ratios = [e[0] / k[0] for e, k in zip(results["ended"], results["kept"], strict=True)]
    print(f"{args.model.name}, {args.threads} threads, 4 requests of {args.tokens} tokens")
    for name, rows in results.items():
        print(f"{name}: median {statistics.median(r[0] for r in rows):.2f} tok/s, "
              f"{statistics.median(r[1] for r in rows):.0f} context switches")  # fmt: skip
    print(f"ended / kept, per-round median: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
