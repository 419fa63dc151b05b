"""Replica fidelity (issue 27): does a replica built from a real file's header alone measure what
the real file does? pp512, tg128 and peak RSS of each real file against its replica.

Speed: one process loads both files through cli/engine/loading.py (Engine) and alternates them,
the order swapped every round (A,B then B,A), each round one pp512 (prefill tokens/s, as quill
bench reports it) and one tg128 (decode tokens/s as quill bench reports it, and the median
interval between tokens). Alternating every few seconds cancels the drift of a shared machine
that separate processes do not; the figures are medians over rounds and the median of the
per-round ratios replica / real. Each round waits (at most a minute) for a quiet machine;
rounds in which other processes took QUIET_CORES or more are set aside (all are kept if fewer
than half were quiet). The median token interval is the figure a burst of other work moves
least. Peak RSS: fresh processes, alternating, each loading one file
and running one pp512 and one tg128. Before the speed process both files are written again in
large writes so that they sit alike in the page cache (set_page_cache says why). OpenMP as users
have it (OMP_WAIT_POLICY unset), threads fixed.

    flock /work/notes/bench.lock python -m benchmarks.replica_fidelity smollm2-q4_1 -r 30

Models (real file, replica written beside it in --dir): smollm2-q4_1 (the registry's file),
smollm2-q4_0 and smollm2-f16 (made from it by quant.quantize), gemma3-q4_k_m (the registry's).
Results: benchmarks/results/replica-fidelity-2026-12-01.{json,md} (a model's run replaces its
entry; the md's notes come from the json's "notes").
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.harness import RESULTS, ROOT, busy_seconds, turned, users_env, wait_quiet

if TYPE_CHECKING:
    from cli.engine.engine import Engine

STAMP = "2026-12-01"
JSON_OUT, MD_OUT = (RESULTS / f"replica-fidelity-{STAMP}.{ext}" for ext in ("json", "md"))
MODELS = ("smollm2-q4_1", "smollm2-q4_0", "smollm2-f16", "gemma3-q4_k_m")
REGISTRY = {"smollm2-q4_1": "smollm2-135m:q4_1", "gemma3-q4_k_m": "gemma3-270m:q4_k_m"}
KINDS = ("real", "replica")
SPEEDS = ("pp512", "tg128", "tg128_token_median")
QUIET_CORES = 0.15
RSS_ROUNDS = 3


def one_round(engine: Engine, rng: random.Random) -> dict[str, float]:
    """One pp512 and one tg128 of a loaded engine, as cli.measure.bench times them."""
    from cli.measure.bench import GREEDY_NO_EOS

    prompt = [rng.randrange(engine.n_vocab) for _ in range(512)]
    first = next(iter(engine.stream_generate(prompt, 1, GREEDY_NO_EOS)))
    steps = engine.stream_generate([rng.randrange(engine.n_vocab)], 129, GREEDY_NO_EOS)
    timed = [(step, time.perf_counter()) for step in steps]
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(timed)]
    return {
        "pp512": first.prefill_tokens_per_s,
        "tg128": timed[-1][0].decode_tokens_per_s,
        "tg128_token_median": 1 / statistics.median(gaps),
    }


def speed(paths: dict[str, Path], threads: int, rounds: int) -> list[dict[str, dict]]:
    """Rounds of one_round for each file, alternating, with others_cores: the CPU that other
    processes took meanwhile."""
    from cli.engine.engine import Engine
    from cli.engine.options import LoadOptions

    rng = random.Random(0)
    options = LoadOptions(n_ctx=1024, n_batch=512, threads=threads, repack=True)
    engines = {kind: Engine(path, options) for kind, path in paths.items()}
    for engine in engines.values():
        one_round(engine, rng)  # warm-up
    results = []
    for round_ in range(rounds):
        # A round is a few seconds, and one taken beside another's burst is noise, not a ratio.
        wait_quiet(QUIET_CORES / 3, window=2.0, limit=60.0)
        figures = {}
        for kind in turned(KINDS, round_):
            busy, started = busy_seconds(), time.perf_counter()
            figures[kind] = one_round(engines[kind], rng)
            others = busy_seconds() - busy
            figures[kind]["others_cores"] = max(0.0, others / (time.perf_counter() - started))
        print(round_, figures, file=sys.stderr, flush=True)
        results.append(figures)
    for engine in engines.values():
        engine.close()
    return results


def peak_rss(path: Path, threads: int) -> float:
    """In this process: load path, one pp512 and one tg128; the process's peak RSS in MiB."""
    from cli.engine.engine import Engine
    from cli.engine.options import LoadOptions

    options = LoadOptions(n_ctx=1024, n_batch=512, threads=threads, repack=True)
    with Engine(path, options) as engine:
        one_round(engine, random.Random(0))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def set_page_cache(path: Path) -> None:
    """Write path again in large writes. How a file came into the page cache decides its
    physical layout there (large folios, or scattered 4 KiB pages as a download or pip's
    extraction may leave it), and a decode reads every weight through that mapping; written
    alike, real file and replica start alike."""
    fresh = path.with_name(path.name + ".fresh")
    with path.open("rb") as source, fresh.open("wb") as out:
        while block := source.read(16 << 20):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    fresh.replace(path)


def in_subprocess(*args: str) -> str:
    command = [sys.executable, "-m", "benchmarks.replica_fidelity", *args]
    result = subprocess.run(command, env=users_env(), cwd=ROOT, capture_output=True, text=True,
                            timeout=1800)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]


def real_file(model: str, folder: Path) -> Path:
    """The real file: the registry's, or one quill's quantizer makes from SmolLM2 Q4_1."""
    from quant.quantize import quantize

    path = folder / f"{model}.gguf"
    if path.exists():
        return path
    if model in REGISTRY:
        from cli.store.models import obtain, parse_model_name
        from cli.store.registry import load_registry

        found = obtain(parse_model_name(REGISTRY[model], load_registry()))
        path.write_bytes(found.read_bytes())
    else:
        f16 = real_file("smollm2-f16", folder) if model != "smollm2-f16" else None
        source = f16 or real_file("smollm2-q4_1", folder)
        quantize(source, path, model.split("-")[1], threads=2)
    return path


def replica_file(real: Path, name: str, folder: Path) -> tuple[Path, float]:
    """The replica, built from the real file's header bytes only; (path, seconds to write)."""
    from quant.gguf import read_header
    from quant.replica import write_replica

    prefix = real.read_bytes()[: read_header(real).data_start]
    dest = folder / f"{real.stem}.replica.gguf"
    started = time.perf_counter()
    write_replica(prefix, dest, name)
    return dest, time.perf_counter() - started


def summarize(real: list[float], replica: list[float]) -> dict:
    ratios = [b / a for a, b in zip(real, replica, strict=True)]
    return {
        "real": statistics.median(real),
        "replica": statistics.median(replica),
        "median_paired_ratio": statistics.median(ratios),
        "paired_ratios": ratios,
    }


def compare(model: str, args: argparse.Namespace) -> dict:
    args.dir.mkdir(parents=True, exist_ok=True)
    real = real_file(model, args.dir)
    replica, write_s = replica_file(real, model, args.dir)
    paths = dict(zip(KINDS, (real, replica), strict=True))
    for path in paths.values():
        set_page_cache(path)
    rounds = json.loads(in_subprocess("--speed", str(real), str(replica), *_common(args)))
    quiet = [
        i
        for i, figures in enumerate(rounds)
        if max(f["others_cores"] for f in figures.values()) < QUIET_CORES
    ]
    used = quiet if 2 * len(quiet) >= len(rounds) else list(range(len(rounds)))
    summary = {
        metric: summarize(*([rounds[i][kind][metric] for i in used] for kind in KINDS))
        for metric in SPEEDS
    }
    rss: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for round_ in range(RSS_ROUNDS):
        for kind in turned(KINDS, round_):
            rss[kind].append(float(in_subprocess("--rss", str(paths[kind]), *_common(args))))
    summary["peak_rss_mib"] = summarize(rss["real"], rss["replica"])
    return {
        "real": str(real),
        "real_bytes": real.stat().st_size,
        "replica_bytes": replica.stat().st_size,
        "replica_write_s": write_s,
        "threads": args.threads,
        "rounds": len(rounds),
        "rounds_used": used,
        "speed_rounds": rounds,
        "peak_rss_runs": rss,
        "summary": summary,
    }


def _common(args: argparse.Namespace) -> list[str]:
    return ["-t", str(args.threads), "-r", str(args.rounds)]


def report(results: dict) -> str:
    lines = [
        f"# Replica fidelity ({STAMP})",
        "",
        "A replica built from the real file's header alone, against the real file (method: "
        "benchmarks/replica_fidelity.py's docstring). Figures are medians over rounds; the "
        "ratio is the median of the per-round ratios replica / real. Acceptance: pp512 and "
        "tg128 within 3%, peak RSS within 2%.",
        "",
        "| model | rounds used | metric | real | replica | replica / real |",
        "|---|---|---|---|---|---|",
    ]
    for model, result in results.get("models", {}).items():
        used = f"{len(result['rounds_used'])} of {result['rounds']}"
        for metric, s in result["summary"].items():
            cells = [model, used, metric, f"{s['real']:.1f}", f"{s['replica']:.1f}"]
            lines.append("| " + " | ".join([*cells, f"{s['median_paired_ratio']:.3f}"]) + " |")
    lines += ["", *results.get("notes", [])]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", help=", ".join(MODELS))
    parser.add_argument("-r", "--rounds", type=int, default=30)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path("/work/replica-bench"))
    parser.add_argument("--speed", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rss", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.speed:
        print(
            json.dumps(speed(dict(zip(KINDS, args.speed, strict=True)), args.threads, args.rounds))
        )
        return
    if args.rss:
        print(peak_rss(args.rss, args.threads))
        return
    if set(args.models) - set(MODELS):
        parser.error(f"models are {', '.join(MODELS)}")
    results = json.loads(JSON_OUT.read_text()) if JSON_OUT.exists() else {"models": {}}
    for model in args.models:
        results["models"][model] = compare(model, args)
        JSON_OUT.write_text(json.dumps(results, indent=1) + "\n")
    MD_OUT.write_text(report(results))
    print(MD_OUT.read_text())


if __name__ == "__main__":
    main()
