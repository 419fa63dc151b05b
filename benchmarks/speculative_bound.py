"""What prompt lookup can buy at most, and what quill's speculation policy gets of it, free of
the machine's noise.

benchmarks/speculative.py times real runs, and on a shared 2-core VM the same run moves by 10-20%:
as much as the effects under study. This script separates the two things a speculative speed-up
is made of, and measures each on its own:

1. What a checking batch costs: llama_decode of 1..17 positions at the task's depth, repeated
   in interleaved rounds, medians, as a multiple of a one-token step.
2. Which guesses hold: the plain greedy reply (real tokens, real model), and at each position the
   guesses quill's NgramDrafter makes there and how many of them the reply confirms.

From the two it computes:
- the bound: the fastest any policy could decode the reply with these guesses and these costs,
  knowing in advance how many guesses hold at each position (a shortest path over positions:
  a plain step, or a check of k <= held guesses that moves k + 1 tokens on);
- a replay of real policies (quill's default, a fixed k gated: paused after checks that held
  nothing; and fixed --draft-tokens k, never paused) through the real engine and the real
  Speculator, on a clock that charges each llama_decode its batch size's median cost. (The
  adaptive k this was judged against, removed 2026-12-01, replays at commit ac280a8.)
  The replay is teacher-forced: each position's token is the plain reply's, so every policy is
  judged on the same text (a batch sums in another order than a step, and where two tokens
  nearly tie the pick could flip and send a replay down another reply; tests/test_speculative.py
  checks that speculation keeps the plain text, benchmarks/speculative.py checks real runs).

Both are ratios to plain decoding's cost (the reply's tokens after the first, one step each). A
replay ratio is what the policy would measure on a machine without noise; benchmarks/
speculative.py measures the real thing.

Usage (inside quill's venv, on an idle machine):
  python -m benchmarks.speculative_bound [--model NAME] [--targets model,f16] [-n 120]
      [-t THREADS] [--tasks rewrite,extract,summarise,chat] [--json OUT] [--costs EARLIER.json]

--costs replays on the batch costs an earlier --json run measured (same targets and tasks), so
policies are compared on one cost table; only the replies are decoded again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.speculative import TASKS, f16_target, model_path

BATCH_SIZES = range(1, 18)
COST_ROUNDS = 9
FIXED_K = (1, 2, 3, 4, 6, 8)
MOST_GUESSES = max(BATCH_SIZES) - 1  # what the bound may check at once


def batch_costs(engine, prompt: Sequence[int]) -> dict[int, float]:
    """Median seconds of a llama_decode of each batch size after the prompt (interleaved)."""
    engine.keep_prefix(0, 0)
    for start in range(0, len(prompt), engine.n_batch):
        engine.decode([(0, token, False) for token in prompt[start : start + engine.n_batch]])
    depth = engine.cached_count(0)
    seconds: dict[int, list[float]] = {size: [] for size in BATCH_SIZES}
    for _ in range(COST_ROUNDS):
        for size in BATCH_SIZES:
            started = time.perf_counter()
            engine.decode([(0, 1000 + i, True) for i in range(size)])
            seconds[size].append(time.perf_counter() - started)
            engine.keep_prefix(0, depth)
    return {size: statistics.median(times) for size, times in seconds.items()}


def held_guesses(prompt: Sequence[int], reply: Sequence[int], most: int) -> list[int]:
    """At each position of the reply, how many of the drafter's guesses there the reply
    confirms (0 also where it has no guess)."""
    from cli.engine.speculative import NgramDrafter

    drafter = NgramDrafter()
    held = []
    for position in range(len(reply)):
        guesses = drafter.propose([*prompt, *reply[: position + 1]], most)
        following = reply[position + 1 :]
        count = 0
        while count < min(len(guesses), len(following)) and guesses[count] == following[count]:
            count += 1
        held.append(count)
    return held


def bound(held: Sequence[int], cost: dict[int, float]) -> float:
    """Plain decoding's cost over the least cost of decoding the reply with foresight."""
    steps = len(held) - 1  # tokens after the first: what decoding does
    least = [0.0] * (steps + 1)  # least[i]: from position i (its token sampled) to the end
    for position in range(steps - 1, -1, -1):
        options = [cost[1] + least[position + 1]]
        for k in range(1, min(held[position], steps - position - 1, max(cost) - 1) + 1):
            options.append(cost[k + 1] + least[position + k + 1])
        least[position] = min(options)
    return steps * cost[1] / least[0]


def replay(engine, prompt, reply, cost, options) -> tuple[float, dict]:
    """Decode the reply with speculation options on a clock charging each llama_decode its
    measured cost, each position's token forced to the reply's; the ratio to plain decoding
    and the speculation's stats."""
    from cli.engine.sampling import SamplingParams
    from cli.engine.speculative import attach
    from cli.engine.tokenstep import SequenceStep

    now = [0.0]
    decoding = [False]  # the prefill before the first token is not charged: it is not timed
    real_decode = engine.decode

    def charged_decode(items):
        if decoding[0]:
            now[0] += cost[len(items)]
        return real_decode(items)

    attach(engine, options)
    engine.keep_prefix(0, 0)
    engine.decode = charged_decode
    greedy_sample = SequenceStep.sample
    SequenceStep.sample = lambda step, output: step.event(reply[step.generated])
    try:
        tokens = []
        for event in engine.stream_generate(prompt, len(reply), SamplingParams(temperature=0)):
            decoding[0] = True
            tokens.append(event.token)
    finally:
        del engine.decode  # the instance attribute goes; the method shows again
        SequenceStep.sample = greedy_sample
    stats = engine.speculator.last_stats.as_dict()
    assert tokens == list(reply), "a forced replay yields the reply"
    ratio = (len(tokens) - 1) * cost[1] / now[0]
    return ratio, stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--targets", default="model,f16", help="the model as given, and F16")
    parser.add_argument("-n", "--tokens", type=int, default=120)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--costs", type=Path, default=None, help="an earlier --json's costs")
    args = parser.parse_args()
    measured = {}
    if args.costs:
        for row in json.loads(args.costs.read_text(encoding="utf-8")):
            measured[row["target"], row["task"]] = row

    from cli.engine.engine import Engine
    from cli.engine.options import LoadOptions
    from cli.engine.sampling import SamplingParams
    from cli.engine.speculative import SpecOptions, attach

    targets: dict[str, Callable[[], Path]] = {
        "model": lambda: model_path(args.model),
        "f16": lambda: f16_target(args.model),
    }
    policies = {"default": SpecOptions("ngram")}
    policies |= {f"k={k}": SpecOptions("ngram", k) for k in FIXED_K}
    results = []
    print(f"{args.threads} threads; ratios to plain decoding on the measured batch costs")
    for target in args.targets.split(","):
        path = targets[target]()
        label = path.parent.name  # the store keeps models/NAME/QUANT/FILE: the weights' type
        with Engine(path, LoadOptions(n_ctx=4096, threads=args.threads)) as engine:
            for task in args.tasks.split(","):
                prompt = engine.tokenize(engine.conversation_text([("user", TASKS[task])])[0])
                attach(engine, SpecOptions("off"))
                engine.keep_prefix(0, 0)
                greedy = SamplingParams(temperature=0)
                reply = [e.token for e in engine.stream_generate(prompt, args.tokens, greedy)]
                if len(reply) < 2:  # ended at once (a coarse quantization may): nothing to decode
                    print(f"{label:6s} {task:9s} the reply ended after {len(reply)} token(s)")
                    continue
                if (label, task) in measured:
                    earlier = measured[label, task]
                    cost = {int(size): c for size, c in earlier["batch_cost"].items()}
                    seconds = {1: earlier["step_ms"] / 1000}
                else:
                    seconds = batch_costs(engine, prompt)
                    cost = {size: seconds[size] / seconds[1] for size in seconds}
                held = held_guesses(prompt, reply, MOST_GUESSES)
                row = {
                    "target": label,
                    "task": task,
                    "reply_tokens": len(reply),
                    "step_ms": round(seconds[1] * 1000, 2),
                    "batch_cost": {size: round(c, 3) for size, c in cost.items()},
                    "bound": round(bound(held, cost), 3),
                    "replay": {},
                }
                for name, options in policies.items():
                    ratio, stats = replay(engine, prompt, reply, cost, options)
                    row["replay"][name] = {"ratio": round(ratio, 3), "stats": stats}
                results.append(row)
                cheap = ", ".join(f"{n}:{cost[n]:.2f}" for n in (2, 3, 5, 9, 17))
                fixed = " ".join(f"{name} {row['replay'][name]['ratio']:.2f}" for name in policies)
                print(
                    f"{label:6s} {task:9s} bound {row['bound']:.2f}x | {fixed} | "
                    f"batch cost in steps {cheap}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
