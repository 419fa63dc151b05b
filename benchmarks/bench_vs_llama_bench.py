"""quill bench against llama.cpp's own llama-bench, over the same grid.

Same llama.cpp source (llama-bench is built from the sdist quill's llama-cpp-python came from, by
build_llama_bench.sh), same model, threads, batch size, flash attention (auto), weight repacking,
KV-cache type and depth, and the same test shapes:
  ppP @ dD: P random tokens prefilled after D tokens already in the cache
  tgN @ dD: N tokens decoded one by one after D tokens already in the cache
quill is measured by cli.measure.bench, exactly as `quill bench` measures it, so its numbers include
everything `quill run` does per token (the sampler chain, detokenizing, stop strings); llama-bench's
do not. The machine's speed drifts, so the two alternate: each round measures quill once and then
runs `llama-bench -r 1`, and every round gives one paired ratio.

Usage (inside quill's venv):
  python -m benchmarks.bench_vs_llama_bench [--model NAME] [-d 0,1024] [--kv-type f16,q8_0] [-r 6]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp

from cli.engine.engine import Engine
from cli.engine.hardware import cpu_model, physical_cores
from cli.engine.options import LoadOptions
from cli.measure.bench import measure_generation, measure_prompt
from cli.store.models import obtain, parse_model_name
from cli.store.registry import load_registry

HERE = Path(__file__).resolve().parent


def llama_bench(
    binary: Path, model: Path, threads: int, p: int, n: int, depth: int, kv: str, repack: bool
) -> dict[str, dict[str, object]]:
    command = [
        str(binary),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-p",
        str(p),
        "-n",
        str(n),
        "-d",
        str(depth),
        "-ctk",
        kv,
        "-ctv",
        kv,
        "-r",
        "1",
        "-b",
        "512",
        "-ub",
        "512",
        # quill leaves flash attention to llama.cpp ("auto") and repacks weights unless the CPU
        # has AMX: llama-bench gets the same settings.
        "-fa",
        "auto",
        "--repack",
        "1" if repack else "0",
        "-o",
        "json",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return {
        ("pp" if row["n_prompt"] else "tg"): {"rate": row["avg_ts"], "build": row["build_commit"]}
        for row in json.loads(result.stdout)
    }


def summary(quill: list[float], reference: list[float]) -> dict[str, object]:
    paired = [q / r for q, r in zip(quill, reference, strict=True)]
    quartiles = (
        statistics.quantiles(paired, n=4, method="inclusive")
        if len(paired) > 1
        else [paired[0]] * 3
    )
    return {
        "quill": statistics.fmean(quill),
        "quill_sd": statistics.stdev(quill) if len(quill) > 1 else 0.0,
        "llama_bench": statistics.fmean(reference),
        "llama_bench_sd": statistics.stdev(reference) if len(reference) > 1 else 0.0,
        "ratio_of_means": statistics.fmean(quill) / statistics.fmean(reference),
        "ratio_median_paired": statistics.median(paired),
        "ratio_paired_iqr": (quartiles[0], quartiles[2]),
        "quill_samples": quill,
        "llama_bench_samples": reference,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="quill model name or GGUF path (default: smollm2-135m)")
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("-r", "--rounds", type=int, default=6)
    parser.add_argument("-p", "--prompt-tokens", type=int, default=512)
    parser.add_argument("-n", "--gen-tokens", type=int, default=128)
    parser.add_argument("-d", "--depth", default="0,1024")
    parser.add_argument("--kv-type", default="f16,q8_0")
    parser.add_argument("--llama-bench", type=Path, help="path to llama-bench (default: build it)")
    args = parser.parse_args()

    registry = load_registry()
    model = obtain(parse_model_name(args.model or registry.default, registry))
    binary = args.llama_bench or Path(
        subprocess.run(
            ["bash", str(HERE / "build_llama_bench.sh")], capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    depths = [int(d) for d in args.depth.split(",")]
    p, n, threads = args.prompt_tokens, args.gen_tokens, args.threads
    rng = random.Random(0)
    results = []
    build = "?"
    for kv in args.kv_type.split(","):
        options = LoadOptions(
            n_ctx=max(depths) + p + n + 2, threads=threads, kv_type_k=kv, kv_type_v=kv
        )
        with Engine(model, options) as engine:
            # llama-bench's --repack 1 is llama.cpp's extra buffers, quill's path off AMX CPUs.
            repack = engine.cpu_path.label == "extra"
            for depth in depths:
                context = [rng.randrange(engine.n_vocab) for _ in range(depth)]
                measure_prompt(engine, context, p, 1, rng)  # warm-up, dropped
                quill = {"pp": [], "tg": []}
                reference = {"pp": [], "tg": []}
                for _ in range(args.rounds):
                    quill["pp"] += measure_prompt(engine, context, p, 1, rng, warmup=False).samples
                    quill["tg"] += measure_generation(
                        engine, context, n, 1, rng, warmup=False
                    ).samples
                    ref = llama_bench(binary, model, threads, p, n, depth, kv, repack)
                    for key in reference:
                        reference[key].append(ref[key]["rate"])
                    build = ref["pp"]["build"]
                for key, test in (("pp", f"pp{p}"), ("tg", f"tg{n}")):
                    row = {
                        "test": test,
                        "depth": depth,
                        "kv_type": kv,
                        **summary(quill[key], reference[key]),
                    }
                    results.append(row)
                    print(
                        f"{test} @ d{depth} {kv}: quill {row['quill']:.1f}, llama-bench "
                        f"{row['llama_bench']:.1f}, ratio {row['ratio_of_means']:.3f}",
                        file=sys.stderr,
                    )

    record = {
        "date": time.strftime("%Y-%m-%d"),
        "model": model.name,
        "threads": threads,
        "rounds": args.rounds,
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_build": build,
        "weight_repacking": repack,
        "cpu": f"{cpu_model()}, {os.cpu_count()} CPUs",
        "rows": results,
    }
    print(
        f"model {model.name}, threads {threads}, {args.rounds} interleaved rounds, "
        f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {build})"
    )
    print(
        "| test | depth | KV | quill tok/s | llama-bench tok/s | ratio of means "
        "| paired ratio: median (IQR) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in results:
        low, high = row["ratio_paired_iqr"]
        print(
            f"| {row['test']} | {row['depth']} | {row['kv_type']} | {row['quill']:.1f} ± "
            f"{row['quill_sd']:.1f} | {row['llama_bench']:.1f} ± {row['llama_bench_sd']:.1f} | "
            f"{row['ratio_of_means']:.3f} | {row['ratio_median_paired']:.3f} "
            f"({low:.3f}-{high:.3f}) |"
        )
    results_dir = HERE / "results"
    results_dir.mkdir(exist_ok=True)
    (results_dir / f"grid-vs-llama-bench-{record['date']}.json").write_text(
        json.dumps(record, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
