"""quill's default placement of the weights against llama-bench's default and its best flag set.

For each model (a replica: real shapes and types, weights of noise), each round measures, in an
order that turns from round to round:
  quill        `quill bench MODEL -p P -n N -r 1 -t T --json --no-predict`: --repack auto, so the
               ppP row is placed as `quill run` places a P-token prompt and the tgN row as it
               places N tokens out (cli/measure/paths.py's table, measured once before the rounds)
  llama-bench  `llama-bench -m MODEL -p P -n N -r 1 -t T -o json`, its default (--repack 1,
               -fa auto), and each of --repack 0/1 x -fa 0/1
The best flag set of a test is the one with the highest median over the rounds; the ratios are
quill's tok/s over that set's, and over the default's, per round (medians, and the quiet
rounds' where there are three or more).

Models: --model PATH (repeatable), or --make TYPE (repeatable: Q4_0, Q6_K, Q8_0, ...): a
Llama-3.2-1B-shaped model of that type made with cli/measure/predict.py's synthetic writer.

Usage: python -m benchmarks.paths_vs_llama_bench --model REPLICA.gguf --make Q4_0 [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from benchmarks.harness import (
    QUILL,
    TOOLS,
    add_quiet_wait,
    command_line,
    interleave,
    machine_line,
    paired,
    quiet,
    quill_commit,
    refuse_omp_wait_policy,
    users_env,
)
from cli.measure.predict import Synthetic, write_synthetic

FLAG_SETS = {
    "llama-bench default": [],
    "--repack 1 -fa 1": ["--repack", "1", "-fa", "1"],
    "--repack 1 -fa 0": ["--repack", "1", "-fa", "0"],
    "--repack 0 -fa 1": ["--repack", "0", "-fa", "1"],
    "--repack 0 -fa 0": ["--repack", "0", "-fa", "0"],
}
# Llama 3.2 1B's shape (tied embeddings), every matrix of one type.
ONE_B = Synthetic("llama-3.2-1b-class", 16, 2048, 8192, 32, 8, vocab=128256)
TARGET = 0.98


def llama_bench(model: Path, flags: list[str], args: argparse.Namespace) -> dict:
    command = [str(TOOLS / "llama-bench"), "-m", str(model), "-p", str(args.prompt_tokens),
               "-n", str(args.gen_tokens), "-r", "1", "-t", str(args.threads), "-o", "json",
               *flags]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    found = {}
    for record in json.loads(done.stdout):
        test = f"pp{record['n_prompt']}" if record["n_prompt"] else f"tg{record['n_gen']}"
        found[test] = record["avg_ts"]
    return found


def quill_bench(model: Path, args: argparse.Namespace, env: dict) -> dict:
    command = [QUILL, "bench", str(model), "-p", str(args.prompt_tokens), "-n",
               str(args.gen_tokens), "-r", "1", "-t", str(args.threads), "--json",
               "--no-predict"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    rows = json.loads(done.stdout)["rows"]
    found: dict = {row["test"]: row["tokens_per_s"] for row in rows}
    found["paths"] = {row["test"]: row["cpu_path"] for row in rows}
    return found


def measure(model: Path, args: argparse.Namespace, env: dict) -> dict:
    # Untimed first: the path table and the bandwidth quill bench reads, measured and kept.
    subprocess.run([QUILL, "bench", "--paths", "-t", str(args.threads)], env=env, check=True,
                   capture_output=True)  # fmt: skip
    subprocess.run([QUILL, "bench", str(model), "-p", "16", "-n", "4", "-r", "1", "-t",
                    str(args.threads), "--no-predict", "--json"], env=env, check=True,
                   capture_output=True)  # fmt: skip
    contenders = {"quill": lambda _n: quill_bench(model, args, env)}
    for name, flags in FLAG_SETS.items():
        contenders[name] = lambda _n, flags=flags: llama_bench(model, flags, args)
    rounds = interleave(contenders, args.rounds, quiet_limit=args.quiet_wait)
    tests = [f"pp{args.prompt_tokens}"] if args.prompt_tokens else []
    tests += [f"tg{args.gen_tokens}"] if args.gen_tokens else []
    summary = {}
    for test in tests:
        medians = {name: statistics.median(r[name][test] for r in rounds) for name in FLAG_SETS}
        best = max(medians, key=lambda name: medians[name])
        against_best = paired(rounds, test, "quill", best)
        against_default = paired(rounds, test, "quill", "llama-bench default")
        summary[test] = {
            "quill": statistics.median(r["quill"][test] for r in rounds),
            "llama_bench": medians,
            "best": best,
            "ratio_to_best": against_best.median,
            "ratio_to_best_judged": against_best.judged,
            "ratios_to_best": against_best.ratios,
            "ratio_to_default": against_default.median,
            "ratio_to_default_judged": against_default.judged,
            "quiet_rounds": sum(quiet(r["quill"]) and quiet(r[best]) for r in rounds),
            "quill_path": rounds[-1]["quill"]["paths"][test],
        }
    return {"model": str(model), "rounds": rounds, "summary": summary}


def report(record: dict) -> str:
    lines = [f"# quill's placement against llama-bench's flags ({record['date']})", "",
             f"{record['machine']}; quill {record['commit']}; {record['threads']} threads; "
             f"{record['rounds']} rounds, contenders in an order that turns each round "
             "(benchmarks/paths_vs_llama_bench.py). The best set is the one with the highest "
             "median; ratios are medians of per-round ratios (the quiet rounds' where three or "
             "more).", "", f"`{record['command']}`", "",
             "| model | test | quill tok/s | quill's path | llama-bench default | best set | best "
             f"tok/s | quill / best | quill / default | >= {TARGET} of best |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for measured in record["models"]:
        name = Path(measured["model"]).name
        for test, row in measured["summary"].items():
            default = row["llama_bench"]["llama-bench default"]
            best = row["llama_bench"][row["best"]]
            verdict = "met" if row["ratio_to_best_judged"] >= TARGET else "NOT met"
            lines.append(f"| {name} | {test} | {row['quill']:.1f} | {row['quill_path']} | "
                         f"{default:.1f} | {row['best']} | {best:.1f} | "
                         f"{row['ratio_to_best_judged']:.3f} | "
                         f"{row['ratio_to_default_judged']:.3f} | {verdict} |")  # fmt: skip
    lines += ["", "Every set's median tok/s:", ""]
    for measured in record["models"]:
        for test, row in measured["summary"].items():
            cells = ", ".join(f"{name} {value:.1f}" for name, value in row["llama_bench"].items())
            lines.append(f"- {Path(measured['model']).name} {test}: {cells}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append", default=[])
    parser.add_argument("--make", action="append", default=[], help="a 1B-class model of TYPE")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-p", "--prompt-tokens", type=int, default=512)
    parser.add_argument("-n", "--gen-tokens", type=int, default=128)
    add_quiet_wait(parser, 60.0)
    parser.add_argument("--home", type=Path, help="QUILL_HOME for quill (default: a new one)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    refuse_omp_wait_policy()
    home = args.home or Path(tempfile.mkdtemp(prefix="quill-paths-"))
    env = users_env(QUILL_HOME=str(home), HF_HUB_OFFLINE="1")
    models = list(args.model)
    made = home / "made"
    made.mkdir(parents=True, exist_ok=True)
    for kind in args.make:
        model = replace(ONE_B, name=f"{ONE_B.name}.{kind}", weight_type=kind)
        target = made / f"{model.name}.gguf"
        models.append(target if target.exists() else write_synthetic(model, made))
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_line(),
        "commit": quill_commit(),
        "command": command_line("benchmarks.paths_vs_llama_bench"),
        "threads": args.threads,
        "rounds": args.rounds,
        "models": [],
    }
    for model in models:
        print(f"== {model.name}", file=sys.stderr, flush=True)
        record["models"].append(measure(model, args, env))
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        args.json.with_suffix(".md").write_text(report(record))
    print(report(record))


if __name__ == "__main__":
    main()
