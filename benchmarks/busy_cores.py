"""quill's default thread count beside a busy core, against -t 1 and -t 2 (issue 14).

Each round runs `quill run --json` with the default threads, with -t 1 and with -t 2 (in a
rotating order), once on the machine as it is and once beside a process this script starts that
keeps one core busy (a Python spin loop, which stops itself after a deadline and is killed when
the script ends). Decode tokens/s come from quill's own JSON; the medians over the rounds are
compared. Target: beside the busy core, the default >= 0.9x the better of -t 1 and -t 2; idle,
the default unchanged (it picks every physical core, as before).

    python -m benchmarks.busy_cores                 # 5 rounds, about 2 minutes on 2 cores
    python -m benchmarks.busy_cores -r 3 -n 96

Bounded: every quill run has a timeout, the spinner a deadline of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from benchmarks.harness import QUILL, RESULTS, busy_core, machine_load, turned

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def quill_run(model: str, tokens: int, threads: int | None) -> dict:
    command = [QUILL, "run", "-m", model, "--json", "--temp", "0", "--ignore-eos"]
    command += ["-n", str(tokens)]
    if threads is not None:
        command += ["-t", str(threads)]
    done = subprocess.run(
        [*command, PROMPT], capture_output=True, text=True, timeout=180, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"quill run failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def load_now() -> dict:
    """How busy the machine was (other sessions share it), as the results files name it."""
    cpu_percent, loadavg = machine_load()
    return {"cpu_percent_over_2s": cpu_percent, "loadavg_1_5_15": loadavg}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default="smollm2-135m")
    parser.add_argument("-n", "--tokens", type=int, default=128)
    parser.add_argument("-r", "--rounds", type=int, default=5)
    parser.add_argument("-o", "--output", type=Path, default=RESULTS / "busy_cores")
    parser.add_argument("--render", type=Path, help="Only redo the table from a results JSON.")
    args = parser.parse_args()
    if args.render:
        report = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(render(report))
        print(render(report))
        return

    configs: list[tuple[str, int | None]] = [("default", None), ("-t 1", 1), ("-t 2", 2)]
    before = load_now()
    samples: dict[str, dict[str, list[dict]]] = {"idle": {}, "busy": {}}
    quill_run(args.model, 8, None)  # warm the page cache: the model file is read once
    for condition in ("idle", "busy"):
        context = (
            busy_core(deadline_s=120 * args.rounds)
            if condition == "busy"
            else contextlib.nullcontext()
        )
        with context:
            for round_number in range(args.rounds):
                for label, threads in turned(configs, round_number):
                    result = quill_run(args.model, args.tokens, threads)
                    samples[condition].setdefault(label, []).append(
                        {
                            "decode_tokens_per_s": result["decode_tokens_per_s"],
                            "threads": result["threads"],
                            "busy_cores": result["busy_cores"],
                        }
                    )
                    print(
                        f"{condition:4} round {round_number + 1} {label:7} "
                        f"{result['decode_tokens_per_s']:6.1f} tok/s, threads {result['threads']}, "
                        f"busy cores {result['busy_cores']}",
                        file=sys.stderr,
                    )
    after = load_now()

    summary: dict[str, dict] = {}
    for condition, by_config in samples.items():
        medians = {
            label: statistics.median(s["decode_tokens_per_s"] for s in runs)
            for label, runs in by_config.items()
        }
        best = max(medians["-t 1"], medians["-t 2"])
        summary[condition] = {
            "median_decode_tokens_per_s": medians,
            "default_threads": [s["threads"] for s in by_config["default"]],
            "default_busy_cores": [s["busy_cores"] for s in by_config["default"]],
            "default_vs_best": medians["default"] / best,
            "default_vs_t2": medians["default"] / medians["-t 2"],
        }
    report = {
        "model": args.model,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "cpu": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "load_before": before,
        "load_after": after,
        "summary": summary,
        "samples": samples,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    markdown = render(report)
    args.output.with_suffix(".md").write_text(markdown)
    print(markdown)


def render(report: dict) -> str:
    """The results as a Markdown table (also: --render FILE.json, to redo it from the samples)."""
    before, after = report["load_before"], report["load_after"]
    lines = [
        f"# Default threads beside a busy core ({report['date']})",
        "",
        f"`python -m benchmarks.busy_cores -r {report['rounds']} -n {report['tokens']}`: "
        f"{report['model']}, {report['cpu']} CPUs ({report['physical_cores']} physical), median "
        f"decode tokens/s over {report['rounds']} rounds. Machine load before: "
        f"{before['cpu_percent_over_2s']:.0f}% CPU, load average "
        f"{before['loadavg_1_5_15'][0]:.2f}; after: {after['cpu_percent_over_2s']:.0f}%, "
        f'{after["loadavg_1_5_15"][0]:.2f}. "idle" is the machine as it was, without the '
        'spinner; "busy" adds the one busy core.',
        "",
        "| condition | default | -t 1 | -t 2 | default threads | default / best | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for condition, row in report["summary"].items():
        medians = row["median_decode_tokens_per_s"]
        if condition == "busy":
            target = "≥ 0.90 of best: " + ("met" if row["default_vs_best"] >= 0.9 else "MISSED")
        else:
            target = "≥ 0.90 of -t 2: " + ("met" if row["default_vs_t2"] >= 0.9 else "MISSED")
        lines.append(
            f"| {condition} | {medians['default']:.1f} | {medians['-t 1']:.1f} | "
            f"{medians['-t 2']:.1f} | {row['default_threads']} | {row['default_vs_best']:.2f} | "
            f"{target} |"
        )
    if before["cpu_percent_over_2s"] > 20:
        lines += [
            "",
            f"The machine was not idle ({before['cpu_percent_over_2s']:.0f}% of all CPUs busy "
            "before the first run, from other processes): the default counted those cores as "
            'busy too, so "idle" here does not show the default on an idle machine.',
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
