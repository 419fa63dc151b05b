"""Automatic threads when a core gets busy after `quill chat` began or `quill serve` started
(issue 30 item 2), against each fixed count -t 1 .. -t <physical cores>.

Each round, for every thread setting (in a rotating order): a chat is started and sent its first
message on the machine as it is; then `yes > /dev/null` starts (one busy core), and after a pause
(a person typing, --pause) the next messages are sent through stdin; decode tokens and tokens/s
come from each turn's stats line. The same for a server: a first request, then `yes`, then the
next requests at once, one after another (HTTP, ignore_eos, so each decodes its max_tokens);
decode numbers from each reply's timings. The figure per setting is the decode tokens over decode
seconds of all turns after the busy process started; its median over the rounds is shown, and the
median over the rounds of auto's figure over the best fixed count's of the same round (other
sessions' load on a shared machine changes from round to round). quill runs with the environment
as a user has it (OMP_WAIT_POLICY unset).

    python -m benchmarks.threads_busy                 # 5 rounds, about 10 minutes on 2 cores
    python -m benchmarks.threads_busy -r 3 -n 200

Bounded: every chat and server has a timeout, and `yes` is killed when each one ends.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from benchmarks.harness import (
    QUILL,
    RESULTS,
    busy_core,
    command_line,
    machine_load,
    serving,
    turned,
    users_env,
)

MESSAGES = [
    "Write a long story about a lighthouse keeper and the sea.",
    "Tell the same story again from the point of view of the sea.",
    "Now write a long poem about the harbour at night.",
    "Describe, at length, the town where the keeper buys bread.",
    "Write a long letter from the keeper to his sister.",
]
TURN = re.compile(r"decode (\d+) tok, ([\d.]+) tok/s .* threads (\d+)")
TIMEOUT_S = 300
LOAD_FIGURES = (("cpu_percent", 0), ("loadavg", 2))  # machine_load's, and the digits shown


def chat_turns(model: str, threads: int | None, tokens: int, pause_s: float) -> list[dict]:
    """The first turn, then those after the busy core started: decode tokens, seconds, threads."""
    with tempfile.TemporaryDirectory() as folder:
        command = [QUILL, "chat", model, "--temperature", "0", "-n", str(tokens)]
        command += ["--transcript", f"{folder}/chat.json"]
        command += ["-t", str(threads)] if threads else []
        chat = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=users_env(),
        )
        deadline = time.monotonic() + TIMEOUT_S
        assert chat.stdin is not None and chat.stderr is not None

        def turn(message: str) -> dict:
            chat.stdin.write(message + "\n")
            chat.stdin.flush()
            while time.monotonic() < deadline:
                line = chat.stderr.readline()
                if not line:
                    raise SystemExit(f"quill chat ended early (exit {chat.wait()})")
                found = TURN.search(line)
                if found:
                    n, rate, used = int(found[1]), float(found[2]), int(found[3])
                    return {"tokens": n, "seconds": n / rate if rate else 0.0, "threads": used}
            raise SystemExit("quill chat took too long")

        try:
            first = turn(MESSAGES[0])
            with busy_core():
                time.sleep(pause_s)
                return [first, *(turn(message) for message in MESSAGES[1:])]
        finally:
            chat.kill()
            chat.wait()


def serve_turns(model: str, threads: int | None, tokens: int) -> list[dict]:
    """The first request, then those after the busy core started (one after another, no pause)."""
    command = [QUILL, "serve", model, *(["-t", str(threads)] if threads else [])]
    with serving(command, users_env(), stderr=subprocess.DEVNULL, timeout=60) as (_, url):

        def request(message: str) -> dict:
            body = {
                "messages": [{"role": "user", "content": message}],
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            timings = fetch(f"{url}/v1/chat/completions", body)["timings"]
            used = fetch(f"{url}/health")["threads"]
            seconds = timings["predicted_ms"] / 1000
            return {"tokens": timings["predicted_n"], "seconds": seconds, "threads": used}

        first = request(MESSAGES[0])
        with busy_core():
            return [first, *(request(message) for message in MESSAGES[1:])]


def fetch(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return json.loads(response.read())


def rate(turns: list[dict]) -> float:
    """Decode tokens/s of the turns after the busy core started (all but the first)."""
    turns = turns[1:]
    return sum(t["tokens"] for t in turns) / sum(t["seconds"] for t in turns)


def load_now() -> dict:
    """How busy other sessions kept the machine (it is shared), as the results files name it."""
    cpu_percent, loadavg = machine_load()
    return {"cpu_percent": cpu_percent, "loadavg": loadavg[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default="smollm2-135m")
    parser.add_argument("-n", "--tokens", type=int, default=160, help="per turn")
    parser.add_argument("-r", "--rounds", type=int, default=5)
    parser.add_argument("--pause", type=float, default=1.0, help="chat: seconds before typing")
    parser.add_argument("-o", "--output", type=Path, default=RESULTS / "threads-busy")
    args = parser.parse_args()

    physical = psutil.cpu_count(logical=False) or 1
    settings: list[int | None] = [None, *range(1, physical + 1)]
    before = load_now()
    samples: dict[str, dict[str, list[dict]]] = {"chat": {}, "serve": {}}
    for round_number in range(args.rounds):
        for threads in turned(settings, round_number):
            label = f"-t {threads}" if threads else "auto"
            for kind in ("chat", "serve"):
                if kind == "chat":
                    turns = chat_turns(args.model, threads, args.tokens, args.pause)
                else:
                    turns = serve_turns(args.model, threads, args.tokens)
                samples[kind].setdefault(label, []).append({"rate": rate(turns), "turns": turns})
                used = [t["threads"] for t in turns]
                print(
                    f"round {round_number + 1} {kind:5} {label:5} {rate(turns):6.1f} tok/s, "
                    f"threads per turn {used}",
                    file=sys.stderr,
                )
    report = {
        "command": command_line("benchmarks.threads_busy"),
        "model": args.model,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "pause_s": args.pause,
        "cpus": psutil.cpu_count(logical=True),
        "physical_cores": physical,
        "load_before": before,
        "load_after": load_now(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "samples": samples,
    }
    markdown = render(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(report, indent=1) + "\n"), (".md", markdown)):
        args.output.with_suffix(suffix).write_text(text)
    print(markdown)


def render(report: dict) -> str:
    fixed = [f"-t {n}" for n in range(1, report["physical_cores"] + 1)]
    load = [report[f"load_{when}"] for when in ("before", "after")]
    cpu, average = ([f"{at[key]:.{digits}f}" for at in load] for key, digits in LOAD_FIGURES)
    lines = [
        f"# Automatic threads beside a core taken after the start ({report['date']})",
        "",
        f"`{report['command']}`: {report['model']}, {report['cpus']} CPUs "
        f"({report['physical_cores']} physical), {report['tokens']} tokens a turn, median over "
        f"{report['rounds']} rounds of the decode tok/s of the {len(MESSAGES) - 1} turns after "
        f"`yes` started (chat: after a {report['pause_s']:g} s pause; serve: at once). Other "
        f"sessions' load before and after: {' and '.join(cpu)}% CPU, load average "
        f"{' and '.join(average)}.",
        "",
        f"| | auto | {' | '.join(fixed)} | auto's threads: first turn, then | auto / best fixed, "
        "by round |",
        "|---|---|" + "---|" * len(fixed) + "---|---|",
    ]
    for kind, by_setting in report["samples"].items():
        medians = {
            label: statistics.median(s["rate"] for s in runs) for label, runs in by_setting.items()
        }
        ratios = [
            auto["rate"] / max(by_setting[label][round_]["rate"] for label in fixed)
            for round_, auto in enumerate(by_setting["auto"])
        ]
        first = sorted({s["turns"][0]["threads"] for s in by_setting["auto"]})
        then = sorted({t["threads"] for s in by_setting["auto"] for t in s["turns"][1:]})
        cells = " | ".join(f"{medians[label]:.1f}" for label in fixed)
        lines.append(
            f"| {kind} | {medians['auto']:.1f} | {cells} | {first} then {then} | "
            f"{statistics.median(ratios):.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
