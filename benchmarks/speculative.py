"""Speculative decoding: effective decode speed of `quill run --spec ...` against plain
`quill run`, llama-bench's tg, and llama.cpp's own llama-lookup / llama-speculative-simple.

Tasks (greedy, the same prompt text for every runner: quill's chat template applied once, then
sent raw everywhere):
  rewrite    a ~400-token piped text, rewritten with two small word edits
  extract    the names of the people in a ~300-token document
  summarise  the ~400-token text in three sentences
  chat       free-form writing with nothing to copy (speculation should switch itself off)

Pairs:
  ngram      prompt lookup on the target itself (default smollm2-135m, Q4_1) vs llama-lookup
  draft      smollm2-135m Q4_1 drafting for the same model in F16 (`quill quantize --to f16`,
             made here if missing) vs llama-speculative-simple -md

Rounds are interleaved: each round runs every runner once per task, in a rotated order, so drift
in the machine's speed hits all runners alike. quill's figure is its decode tok/s (tokens after
the first over the time since the first); the llama.cpp tools print theirs over their decode loop.
Every speculative quill reply is checked to be the plain reply's text (greedy output unchanged).

Usage (inside quill's venv, on an idle machine):
  python -m benchmarks.speculative [--rounds 3] [-n 200] [-t THREADS] [--tools DIR]
      [--tasks rewrite,extract,summarise,chat] [--pairs ngram,draft] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TEXT = (ROOT / "tests" / "data" / "gpl-3.txt").read_text(encoding="utf-8")
PIPED = TEXT[TEXT.index("  The licenses for most software") :][:1900]  # ~400 tokens of prose
PEOPLE = """\
Minutes of the harbour committee, 14 March.
Present: Margaret Okafor (chair), Tomas Lindqvist, Aiko Tanaka, and Rafael Duarte. Apologies were
received from Priya Raman, who is travelling to Lisbon with Henrik Mols.
Margaret Okafor opened the meeting and thanked Aiko Tanaka for the new tide tables. Tomas
Lindqvist reported that the north pier repairs will finish in May; the contractor, Jonas Weber,
has asked for access on two weekends. Rafael Duarte raised the question of the ferry timetable,
which Elena Popescu of the ferry company will present next month. The committee agreed that
Aiko Tanaka and Rafael Duarte would draft a letter to the council, to be signed by Margaret
Okafor. The meeting closed at nine; the next one will be chaired by Tomas Lindqvist.
"""
TASKS = {
    "rewrite": "Rewrite the text below with two small edits: write 'programs' instead of "
    "'software' and 'licence' instead of 'license'. Keep everything else exactly as it is.\n\n"
    + PIPED,
    "extract": "List the full name of every person mentioned in this document, one per line.\n\n"
    + PEOPLE,
    "summarise": "Summarise this text in three sentences.\n\n" + PIPED,
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")


def model_path(name: str) -> Path:
    from cli.store.models import obtain, parse_model_name
    from cli.store.registry import load_registry

    return obtain(parse_model_name(name, load_registry()), offline=True)


def f16_target(name: str) -> Path:
    from cli.errors import ModelNotFoundError

    try:
        return model_path(f"{name}:f16")
    except ModelNotFoundError:  # not made yet: make it, as a user would
        subprocess.run(["quill", "quantize", name, "--to", "f16"], check=True)
        return model_path(f"{name}:f16")


def templated(model: Path, prompt: str) -> str:
    from cli.engine.engine import Engine
    from cli.engine.options import LoadOptions

    with Engine(model, LoadOptions(n_ctx=2048, threads=1)) as engine:
        return engine.conversation_text([("user", prompt)])[0]


def quill_run(model: Path, text: str, n: int, threads: int | None, spec: list[str]) -> dict:
    command = ["quill", "run", "--json", "--raw", "--temperature", "0", "-n", str(n), "-m"]
    command += [str(model), *(["-t", str(threads)] if threads else []), *spec, text]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:12])} ...: {done.stderr.strip()}")
    result = json.loads(done.stdout)
    spec_stats = result.get("speculation") or {}
    return {
        "tokens_per_s": result["decode_tokens_per_s"],
        "tokens": result["generation_tokens"],
        "text": result["text"],
        "acceptance": spec_stats.get("acceptance_rate"),
        "first_paused_at": spec_stats.get("first_paused_at"),
    }


def llama_tool(binary: Path, args: list[str], text: str, n: int, threads: int) -> dict:
    command = [str(binary), *args, "-p", text, "-n", str(n), "-t", str(threads)]
    command += ["--temp", "0", "--top-k", "1", "-c", "4096"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    found = DECODED.search(done.stderr + done.stdout)
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{binary.name} failed ({done.returncode}): {' | '.join(tail)}")
    accepted = ACCEPT.search(done.stderr + done.stdout)
    return {
        "tokens_per_s": float(found.group(3)),
        "tokens": int(found.group(1)),
        "acceptance": float(accepted.group(1)) / 100 if accepted else None,
    }


def llama_bench_tg(binary: Path, model: Path, threads: int, n: int = 128) -> float:
    command = [str(binary), "-m", str(model), "-p", "0", "-n", str(n), "-t", str(threads)]
    done = subprocess.run([*command, "-r", "3", "-o", "json"], capture_output=True, text=True)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-n", "--tokens", type=int, default=200)
    parser.add_argument("-t", "--threads", type=int, default=None)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--pairs", default="ngram,draft")
    parser.add_argument("--tools", type=Path, default=None, help="llama.cpp's bin folder")
    parser.add_argument("--json", type=Path, default=None, help="write every sample here")
    args = parser.parse_args()
    import llama_cpp

    from cli.engine.hardware import physical_cores

    threads = args.threads or physical_cores() or os.cpu_count() or 1
    version = llama_cpp.__version__
    tools = args.tools or HERE / ".build" / f"llama-cpp-python-{version}" / "build" / "bin"
    small = model_path(args.model)
    pairs = args.pairs.split(",")
    big = f16_target(args.model) if "draft" in pairs else None

    runners: dict[str, tuple] = {}  # name -> (kind, target, extra args)
    if "ngram" in pairs:
        runners["quill q4_1 plain"] = ("quill", small, [])
        runners["quill q4_1 --spec ngram"] = ("quill", small, ["--spec", "ngram"])
        if (tools / "llama-lookup").exists():
            runners["llama-lookup q4_1"] = ("tool", tools / "llama-lookup", ["-m", str(small)])
    if big is not None:
        runners["quill f16 plain"] = ("quill", big, [])
        draft = ["--spec", "draft", "--draft", str(small)]
        runners["quill f16 --spec draft q4_1"] = ("quill", big, draft)
        runners["quill f16 --spec ngram"] = ("quill", big, ["--spec", "ngram"])
        if (tools / "llama-speculative-simple").exists():
            tool_args = ["-m", str(big), "-md", str(small), "--spec-type", "draft-simple"]
            tool_args += ["--spec-draft-n-max", "8"]
            runners["llama-speculative-simple f16"] = (
                "tool",
                tools / "llama-speculative-simple",
                tool_args,
            )
    tasks = args.tasks.split(",")
    prompts = {task: templated(small, TASKS[task]) for task in tasks}
    samples: dict[tuple[str, str], list[dict]] = {}
    plain_texts: dict[tuple[str, str], str] = {}
    mismatches: list[str] = []
    names = list(runners)
    print(f"{threads} threads; {len(names)} runners x {len(tasks)} tasks x {args.rounds} rounds")
    for round_number in range(args.rounds):
        for task in tasks:
            shift = (round_number + tasks.index(task)) % len(names)
            for name in names[shift:] + names[:shift]:
                kind, target, extra = runners[name]
                if kind == "quill":
                    result = quill_run(target, prompts[task], args.tokens, threads, extra)
                    key = (str(target), task)
                    if not extra:
                        plain_texts.setdefault(key, result["text"])
                    elif key in plain_texts and result["text"] != plain_texts[key]:
                        # A batch sums in another order than single steps: where two tokens
                        # are nearly tied the pick can flip (tests/test_speculative.py checks
                        # by teacher forcing); shown here so that it can be checked.
                        plain = plain_texts[key]
                        pairs = enumerate(zip(plain, result["text"], strict=False))
                        at = next(
                            (i for i, (a, b) in pairs if a != b),
                            min(len(plain), len(result["text"])),
                        )
                        mismatches.append(
                            f"{name} on {task} (round {round_number + 1}): plain "
                            f"{plain[max(0, at - 40) : at + 20]!r}, "
                            f"speculative {result['text'][max(0, at - 40) : at + 20]!r}"
                        )
                else:
                    result = llama_tool(target, extra, prompts[task], args.tokens, threads)
                result.pop("text", None)
                samples.setdefault((name, task), []).append(result)
                print(
                    f"round {round_number + 1} {task:9s} {name:30s} "
                    f"{result['tokens_per_s']:7.1f} tok/s  {result['tokens']:4d} tok  "
                    f"acceptance {result['acceptance']}",
                    flush=True,
                )
    tg = {}
    if (tools / "llama-bench").exists():
        for label, path in (("q4_1", small), ("f16", big)):
            if path is not None:
                tg[label] = llama_bench_tg(tools / "llama-bench", path, threads)
    print()
    print("| task | runner | decode tok/s (median) | x plain quill | acceptance | tokens |")
    print("|---|---|---|---|---|---|")
    for task in tasks:
        for name in names:
            rows = samples[(name, task)]
            rate = statistics.median(r["tokens_per_s"] for r in rows)
            plain_name = "quill f16 plain" if "f16" in name else "quill q4_1 plain"
            plain = statistics.median(r["tokens_per_s"] for r in samples[(plain_name, task)])
            accepted = [r["acceptance"] for r in rows if r["acceptance"] is not None]
            acceptance = f"{statistics.mean(accepted):.0%}" if accepted else "-"
            print(
                f"| {task} | {name} | {rate:.1f} | {rate / plain:.2f}x | {acceptance} | "
                f"{rows[0]['tokens']} |"
            )
    for label, rate in tg.items():
        print(f"llama-bench tg128 {label}: {rate:.1f} tok/s ({threads} threads)")
    print("greedy text identical to plain quill run:", mismatches or "yes")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "when": time.strftime("%Y-%m-%d %H:%M"),
                    "threads": threads,
                    "tokens": args.tokens,
                    "llama_bench_tg128": tg,
                    "mismatches": mismatches,
                    "samples": {f"{n} | {t}": rows for (n, t), rows in samples.items()},
                },
                indent=1,
            )
        )
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
