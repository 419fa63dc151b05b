"""quill's prefill and decode tokens/s against llama.cpp's own llama-bench.

Same llama.cpp source (llama-bench is built from the sdist quill's llama-cpp-python came from, by
build_llama_bench.sh), same model, same threads, same batch sizes, the same test shapes:
  pp512: 512 random tokens prefilled into an empty cache
  tg128: 128 tokens decoded one at a time from an empty cache
quill runs through its engine, so its numbers include everything `quill run` does per token
(sampling, detokenizing, stop-string handling); llama-bench's do not.

Usage (inside quill's venv):
  python benchmarks/bench_vs_llama_bench.py [--model PATH] [--threads N] [--repetitions 5]
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

from cli.engine import Engine, LoadOptions
from cli.hardware import cpu_model, physical_cores
from cli.registry import load_registry
from cli.sampling import SamplingParams
from cli.store import obtain, parse_model_name

HERE = Path(__file__).resolve().parent
GREEDY_NO_EOS = SamplingParams(temperature=0.0, ignore_eos=True)


def quill_pp(engine: Engine, n_prompt: int, rng: random.Random) -> float:
    prompt = [rng.randrange(engine.n_vocab) for _ in range(n_prompt)]
    return list(engine.stream_generate(prompt, 1, GREEDY_NO_EOS))[-1].prefill_tokens_per_s


def quill_tg(engine: Engine, n_gen: int, rng: random.Random) -> float:
    # One random prompt token, then n_gen decode steps: n_gen + 1 sampled tokens.
    one = [rng.randrange(engine.n_vocab)]
    final = list(engine.stream_generate(one, n_gen + 1, GREEDY_NO_EOS))[-1]
    assert final.generation_tokens == n_gen + 1
    return final.decode_tokens_per_s


def llama_bench(
    binary: Path,
    model: Path,
    threads: int,
    n_prompt: int,
    n_gen: int,
    repetitions: int,
    repack: bool,
) -> dict[str, dict[str, float]]:
    command = [
        str(binary),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-p",
        str(n_prompt),
        "-n",
        str(n_gen),
        "-r",
        str(repetitions),
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
    rows = json.loads(result.stdout)
    out = {}
    for row in rows:
        key = "pp" if row["n_prompt"] else "tg"
        out[key] = {"mean": row["avg_ts"], "sd": row["stddev_ts"], "build": row["build_commit"]}
    return out


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    cuts = statistics.quantiles(values, n=4, method="inclusive")
    return cuts[0], cuts[2]


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF path or quill model name (default: smollm2-135m)")
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--repetitions", "-r", type=int, default=15)
    parser.add_argument("--prompt-tokens", "-p", type=int, default=512)
    parser.add_argument("--gen-tokens", "-n", type=int, default=128)
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
    # The machine's speed drifts (other tenants, clocks), so the two run in alternation, one
    # round each at a time, and each round's ratio compares neighbours in time. Each test gets
    # the context size llama-bench gives it (prompt + generated tokens).
    quill: dict[str, list[float]] = {"pp": [], "tg": []}
    reference: dict[str, list[float]] = {"pp": [], "tg": []}
    rng = random.Random(0)
    p, n, threads = args.prompt_tokens, args.gen_tokens, args.threads
    with (
        Engine(model, LoadOptions(n_ctx=p, threads=threads)) as pp_engine,
        Engine(model, LoadOptions(n_ctx=n + 1, threads=threads)) as tg_engine,
    ):
        repack = pp_engine.repack
        quill_pp(pp_engine, p, rng), quill_tg(tg_engine, n, rng)  # warm-up, dropped
        for _ in range(args.repetitions):
            quill["pp"].append(quill_pp(pp_engine, p, rng))
            quill["tg"].append(quill_tg(tg_engine, n, rng))
            ref = llama_bench(binary, model, threads, p, n, 1, repack)
            for key in reference:
                reference[key].append(ref[key]["mean"])
                build = ref[key]["build"]

    pp_name, tg_name = f"pp{args.prompt_tokens}", f"tg{args.gen_tokens}"
    rows = []
    for key, name in (("pp", pp_name), ("tg", tg_name)):
        mean, sd = mean_sd(quill[key])
        ref_mean, ref_sd = mean_sd(reference[key])
        paired = [q / r for q, r in zip(quill[key], reference[key], strict=True)]
        rows.append(
            {
                "test": name,
                "quill": mean,
                "quill_sd": sd,
                "llama_bench": ref_mean,
                "llama_bench_sd": ref_sd,
                "ratio_of_means": mean / ref_mean,
                "ratio_median_paired": statistics.median(paired),
                "ratio_paired_iqr": quartiles(paired),
                "quill_samples": quill[key],
                "llama_bench_samples": reference[key],
            }
        )
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "model": model.name,
        "threads": args.threads,
        "repetitions": args.repetitions,
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_build": build,
        "weight_repacking": repack,
        "cpu": f"{cpu_model()}, {os.cpu_count()} CPUs",
        "rows": rows,
    }
    print(
        f"model {model.name}, threads {args.threads}, {args.repetitions} repetitions, "
        f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {record['llama_cpp_build']})"
    )
    print(
        "| test | quill tok/s | llama-bench tok/s | ratio of means | paired ratio: median (IQR) |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['test']} | {row['quill']:.1f} ± {row['quill_sd']:.1f} | "
            f"{row['llama_bench']:.1f} ± {row['llama_bench_sd']:.1f} | "
            f"{row['ratio_of_means']:.3f} | {row['ratio_median_paired']:.3f} "
            f"({row['ratio_paired_iqr'][0]:.3f}-{row['ratio_paired_iqr'][1]:.3f}) |"
        )
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / f"vs-llama-bench-{record['date']}.json").write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
