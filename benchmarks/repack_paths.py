"""Prefill and decode speed of each CPU path quill can load a model through (cli/engine/loading.py):

  extra       llama.cpp's extra buffer types on (its default; what quill does off AMX CPUs)
  amx-repack  extra buffer types off, repackable matrices sent to CPU_REPACK by name (quill's
              path on AMX CPUs, forced here so that it is measured on any CPU)
  plain       extra buffer types off, nothing repacked (llama.cpp's --no-repack)

Rounds are interleaved (one of each path, then again) so that a busy moment hits all paths.
Usage: python -m benchmarks.repack_paths MODEL.gguf [--rounds 5] [--threads 2] [-p 512] [-n 64]
MODEL should be Q4_0 or Q4_K (`quill quantize smollm2-135m:f16 --to q4_0`): Q4_1, the default
model's type, has no repacked layout, so all paths run the same kernels on it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from cli.engine.engine import Engine
from cli.engine.loading import cpu_backend_features
from cli.engine.options import LoadOptions
from cli.measure.bench import measure_generation, measure_prompt

PATHS = {
    "extra": LoadOptions(avoid_amx=False),
    "amx-repack": LoadOptions(avoid_amx=True),
    "plain": LoadOptions(repack=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-p", "--prompt-tokens", type=int, default=512)
    parser.add_argument("-n", "--gen-tokens", type=int, default=64)
    args = parser.parse_args()
    rng = random.Random(0)
    samples: dict[str, dict[str, list[float]]] = {name: {"pp": [], "tg": []} for name in PATHS}
    described = {}
    for round_number in range(args.rounds + 1):  # round 0 warms up and is dropped
        for name, base in PATHS.items():
            options = LoadOptions(
                n_ctx=args.prompt_tokens + args.gen_tokens + 8,
                threads=args.threads,
                repack=base.repack,
                avoid_amx=base.avoid_amx,
            )
            with Engine(args.model, options) as engine:
                described[name] = engine.cpu_path.describe()
                # measure_* run one warm-up round of their own before the measured one
                pp = measure_prompt(engine, [], args.prompt_tokens, 1, rng)
                tg = measure_generation(engine, [], args.gen_tokens, 1, rng)
            if round_number:
                samples[name]["pp"] += pp.samples
                samples[name]["tg"] += tg.samples
    features = cpu_backend_features()
    result = {
        "model": str(args.model),
        "threads": args.threads,
        "rounds": args.rounds,
        "cpu_backend": {k: v for k, v in features.items() if v not in ("0", "")},
        "paths": {
            name: {
                "described": described[name],
                f"pp{args.prompt_tokens}": statistics.median(values["pp"]),
                f"tg{args.gen_tokens}": statistics.median(values["tg"]),
            }
            for name, values in samples.items()
        },
    }
    plain = result["paths"]["plain"]
    for row in result["paths"].values():
        for test in (f"pp{args.prompt_tokens}", f"tg{args.gen_tokens}"):
            row[f"{test}_vs_plain"] = round(row[test] / plain[test], 3)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
