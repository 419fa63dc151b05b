"""Decode speed predicted from a header (cli/measure/predict.py) against `quill bench --replica`'s
measured decode: SmolLM2-135M Q4_1 and Llama-3.2-1B-, 3B- and Llama-3-8B-class Q4_K_M replicas.

Each round starts from nothing: a QUILL_HOME of its own with no bandwidth.json and no
predict.json, so the read bandwidth and the calibration are measured in the round (timed: the
calibration's seconds are part of the result), for every weight type the four models have.
Then, for each model, the prediction from its header alone (tg64 at depth 0: a mean of 33
positions in the cache), and a `quill bench MODEL --replica -n 64 -p 16 -r 3 -t 2 --json` in a
process of its own, which reads the same calibration from the cache and puts its own prediction
beside its measurement; the two predictions must agree. Each bench waits (at most two minutes)
for a quiet machine and records the CPU other processes took beside it; a calibration or a bench
beside more than QUIET_CORES is run again (ATTEMPTS in all at most; of the benches the quietest
is kept, of the calibrations the last, which the benches read from the cache).

    flock /work/notes/bench.lock python -m benchmarks.predict_decode --rounds 3

The 3B and 8B shapes are header-only files (python -m benchmarks.shapes llama-3.2-3b-shape
llama-3-8b-shape --header-only): their replicas are built from them, as from a Hub header.
Results: benchmarks/results/predict-decode-2026-12-03.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.harness import (
    QUILL,
    RESULTS,
    busy_seconds,
    command_line,
    machine_line,
    quill_commit,
    refuse_omp_wait_policy,
    users_env,
    wait_quiet,
)

STAMP = "2026-12-03"
JSON_OUT, MD_OUT = (RESULTS / f"predict-decode-{STAMP}.{ext}" for ext in ("json", "md"))
SHAPES = Path("/work/shapes")
MODELS = {  # name: the file whose header the replica is built from
    "SmolLM2-135M Q4_1": Path("/work/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "Llama-3.2-1B-class Q4_K_M": SHAPES / "llama-3.2-1b-shape.Q4_K_M.gguf",
    "Llama-3.2-3B-class Q4_K_M": SHAPES / "llama-3.2-3b-shape.Q4_K_M.gguf.part",
    "Llama-3-8B-class Q4_K_M": SHAPES / "llama-3-8b-shape.Q4_K_M.gguf.part",
}
GRID = ["-p", "16", "-n", "64", "-r", "3"]
TARGET = 0.15  # measured / predicted within 1 ± this
QUIET_CORES = 0.05  # other processes' cores beside a measurement that make it be run again
ATTEMPTS = 3  # at most, the quietest kept


def header_of(path: Path):
    from quant.gguf import read_header

    return read_header(path, whole=not path.name.endswith(".part"))


def calibrate(home: Path, threads: int) -> dict:
    """The round's bandwidth and calibration, measured now in home, for the four models' types."""
    from cli.measure.predict import VECTORS, decode_calibration, weights_read_by_type

    os.environ["QUILL_HOME"] = str(home)
    types = sorted(
        {kind for path in MODELS.values() for kind in weights_read_by_type(header_of(path))}
        - {VECTORS}
    )
    tries = []
    for _ in range(ATTEMPTS):
        for stale in ("bandwidth.json", "predict.json"):
            (home / stale).unlink(missing_ok=True)
        wait_quiet(limit=120)
        before, started = busy_seconds(), time.perf_counter()
        calibration = decode_calibration(threads, types, ("f16",))
        took = time.perf_counter() - started
        tries.append(((busy_seconds() - before) / took, took, calibration))
        if tries[-1][0] < QUIET_CORES:
            break
    others, took, calibration = tries[-1]  # the one the cache holds, which the benches read
    return {
        "calibration": asdict(calibration),
        "describe": calibration.describe(),
        "seconds_with_bandwidth": round(took, 2),
        "others_cores": round(others, 3),
        "attempts": len(tries),
        "object": calibration,
    }


def bench(home: Path, path: Path, threads: int) -> dict:
    """quill bench --replica's tg64 row for the model at path, and the CPU others took meanwhile
    (the quietest of up to ATTEMPTS runs)."""
    command = [QUILL, "bench", str(path), "--replica", *GRID, "-t", str(threads), "--json"]
    tries = []
    for _ in range(ATTEMPTS):
        wait_quiet(limit=120)
        before, started = busy_seconds(), time.perf_counter()
        done = subprocess.run(
            command, capture_output=True, text=True, env=users_env(QUILL_HOME=str(home))
        )
        took = time.perf_counter() - started
        if done.returncode:
            raise SystemExit(f"{' '.join(command)} failed: {done.stderr}")
        tries.append(((busy_seconds() - before) / took, took, done.stdout))
        if tries[-1][0] < QUIET_CORES:
            break
    others, took, stdout = min(tries, key=lambda one: one[0])
    (row,) = [row for row in json.loads(stdout)["rows"] if row["test"] == "tg64"]
    return {"row": row, "seconds": round(took, 1), "others_cores": round(others, 3),
            "attempts": len(tries)}  # fmt: skip


def one_round(home: Path, threads: int) -> dict:
    from cli.measure.predict import predict_decode

    calibrated = calibrate(home, threads)
    calibration = calibrated.pop("object")
    models = {}
    for name, path in MODELS.items():
        predicted = predict_decode(header_of(path), threads, 1 + 64 / 2, "f16", calibration)
        measured = bench(home, path, threads)
        row = measured.pop("row")
        models[name] = {
            "predicted_tokens_per_s": round(predicted.tokens_per_s, 2),
            "bench_predicted_tokens_per_s": round(row["predicted_tokens_per_s"], 2),
            "measured_tokens_per_s": round(row["tokens_per_s"], 2),
            "measured_sd": round(row["tokens_per_s_sd"], 2),
            "measured_over_predicted": round(row["tokens_per_s"] / predicted.tokens_per_s, 3),
            "bytes_per_token": predicted.bytes_per_token,
            "limited_by": predicted.limited_by,
            "prediction": predicted.as_dict(),
            "bench_seconds": measured["seconds"],
            "others_cores": measured["others_cores"],
            "attempts": measured["attempts"],
        }
    return {"calibration": calibrated, "models": models}


def table(rounds: list[dict]) -> str:
    """The markdown table: one line a model, each round's ratio, the median."""
    lines = [
        "| model | bytes/token | predicted tok/s | measured tok/s | measured / predicted "
        "(each round) | median | rounds within 15% | bound by | others' cores |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in MODELS:
        cells = [one["models"][name] for one in rounds]
        ratios = [cell["measured_over_predicted"] for cell in cells]
        median = statistics.median(ratios)
        predicted = ", ".join(f"{cell['predicted_tokens_per_s']:.1f}" for cell in cells)
        measured = ", ".join(f"{cell['measured_tokens_per_s']:.1f}" for cell in cells)
        others = ", ".join(f"{max(0.0, cell['others_cores']):.2f}" for cell in cells)
        inside = len([ratio for ratio in ratios if abs(ratio - 1) <= TARGET])
        lines.append(
            f"| {name} | {cells[0]['bytes_per_token'] / 1e6:.1f} MB | {predicted} | {measured} "
            f"| {', '.join(f'{r:.3f}' for r in ratios)} | {median:.3f} | "
            f"{inside} of {len(ratios)} | {cells[0]['limited_by']} | {others} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--home", type=Path, default=Path("/tmp/quill-predict-decode"))
    args = parser.parse_args()
    refuse_omp_wait_policy()
    commit = quill_commit()
    args.home.mkdir(parents=True, exist_ok=True)
    rounds = []
    for number in range(args.rounds):
        rounds.append(one_round(args.home, args.threads))
        print(json.dumps({"round": number + 1, **rounds[-1]["models"]}, indent=1), flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_line(),
        "commit": commit,
        "command": command_line("benchmarks.predict_decode"),
        "grid": GRID,
        "threads": args.threads,
        "models": {name: str(path) for name, path in MODELS.items()},
        "rounds": rounds,
        "table": table(rounds),
    }
    JSON_OUT.write_text(json.dumps(result, indent=1) + "\n")
    MD_OUT.write_text(markdown(result))
    print(result["table"])


def markdown(result: dict) -> str:
    calibrations = "\n".join(
        f"- round {n}: {one['calibration']['describe']} (with the bandwidth: "
        f"{one['calibration']['seconds_with_bandwidth']} s, others' cores "
        f"{one['calibration']['others_cores']})"
        for n, one in enumerate(result["rounds"], 1)
    )
    return (
        f"# Decode speed predicted from the header against quill bench, {result['date']}\n\n"
        f"`{result['command']}` on {result['machine']}, quill {result['commit']}, "
        f"{result['threads']} threads; each model's `quill bench --replica {' '.join(GRID)}` tg64 "
        "row against the prediction from its header alone, the bandwidth and the calibration "
        "measured afresh in each round.\n\n"
        f"{result['table']}\n\n## Calibrations\n\n{calibrations}\n"
    )


if __name__ == "__main__":
    main()
