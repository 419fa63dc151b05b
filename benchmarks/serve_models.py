"""One server, two models, loaded on demand: time to first token for a cold model (its load
included) and for a warm one, quill serve --any-model against llama-server's router mode
(--models-dir) built from the same sdist, over the same two files.

Usage (inside quill's venv, under the benchmark lock, OMP_WAIT_POLICY unset):
  flock /work/notes/bench.lock python -m benchmarks.serve_models --home QUILL_HOME [--rounds 8]
      [--threads 2] [--ctx 4096] [--out benchmarks/results/serve-models-DATE.md]

--home is a quill home whose store holds smollm2-135m:q4_1 and smollm2-135m:q8_0 (made with
`quill quantize smollm2-135m --to q8_0 --allow-requantize`); llama-server reads the same two files
through links in a folder of its own. Both servers get one slot of --ctx tokens and --threads.
Each round starts each server afresh (the order turned every round), and for each model in turn
sends a cold request (the model not loaded: it loads), then a warm one (a new prompt, so that
neither reuses the other's cache), through the official openai client with stream=True; TTFT is
from sending to the first content chunk. Medians over the rounds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import openai

from benchmarks.harness import QUILL, command_line, machine_line, serving, turned
from benchmarks.serve_multiturn import DEFAULT_LLAMA_SERVER

MODELS = {"q4_1": "smollm2-135m:q4_1", "q8_0": "smollm2-135m:q8_0"}  # quill's names
QUESTIONS = ["Name a large city in Europe and say why it is known.",
             "What is the tallest mountain in Africa? Answer briefly.",
             "Give one reason the sea is salty.", "What does a lighthouse do?"]  # fmt: skip


def quill_files(home: Path) -> dict[str, Path]:
    os.environ["QUILL_HOME"] = str(home)
    from cli.store.models import list_local
    from cli.store.registry import load_registry

    found = {m.name: m.path for m in list_local(load_registry(), home)}
    missing = [name for name in MODELS.values() if name not in found]
    if missing:
        raise SystemExit(f"{home} lacks {missing}: quill quantize smollm2-135m --to q8_0 ...")
    return {short: found[name] for short, name in MODELS.items()}


def quill_server(home: Path, args) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """quill serve --any-model: its command, environment and the names it knows the models by."""
    command = [QUILL, "serve", "--any-model", "--parallel", "1", "--ctx", str(args.ctx),
               "--threads", str(args.threads)]  # fmt: skip
    return command, dict(os.environ, QUILL_HOME=str(home)), MODELS


def router(folder: Path, args) -> tuple[list[str], None, dict[str, str]]:
    """llama-server in router mode over folder (a process per model), as quill_server."""
    command = [args.llama_server, "--models-dir", str(folder), "--models-max", "2",
               "-t", str(args.threads), "-c", str(args.ctx), "-np", "1"]  # fmt: skip
    return command, None, {short: f"smollm2-{short}" for short in MODELS}


def ttft(url: str, model: str, question: str) -> float:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=8,
        temperature=0, stream=True,
    )  # fmt: skip
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
    if first is None:
        raise SystemExit(f"{url}: {model} sent no content")
    return first


def one_round(server: tuple, round_number: int) -> dict[str, float]:
    command, env, names = server
    with serving(command, env, stderr=subprocess.DEVNULL) as (_, url):
        times = {}
        for index, (short, name) in enumerate(names.items()):
            base = (round_number + index) % len(QUESTIONS)
            times[f"{short} cold"] = ttft(url, name, QUESTIONS[base])
            times[f"{short} warm"] = ttft(url, name, QUESTIONS[(base + 2) % len(QUESTIONS)])
        return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--home", required=True, help="a quill home with both models")
    parser.add_argument("--llama-server", default=str(DEFAULT_LLAMA_SERVER))
    today = datetime.date.today().isoformat()
    parser.add_argument("--out", default=f"benchmarks/results/serve-models-{today}.md")
    args = parser.parse_args()
    home = Path(args.home)
    files = quill_files(home)
    folder = Path(tempfile.mkdtemp(prefix="router-models-"))
    for short, path in files.items():
        (folder / f"smollm2-{short}.gguf").symlink_to(path)
    servers = {
        "quill serve": quill_server(home, args),
        "llama-server router": router(folder, args),
    }
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    for round_number in range(args.rounds):
        for name in turned(list(servers), round_number):
            rounds[name].append(one_round(servers[name], round_number))
            print(name, {k: f"{v * 1000:.0f}" for k, v in rounds[name][-1].items()}, flush=True)
    keys = list(rounds["quill serve"][0])
    median = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in rounds.items()}
    lines = [
        f"# Two models on one server: cold and warm time to first token ({today})",
        "",
        f"`{command_line('benchmarks.serve_models')}` under the benchmark lock, "
        f"OMP_WAIT_POLICY unset; {machine_line()}. SmolLM2-135M "
        "Instruct Q4_1 and a Q8_0 quantized from it, the same files for both servers; one slot of "
        f"{args.ctx} tokens, {args.threads} threads; quill serve --any-model against llama-server "
        "--models-dir (router mode, a process per model). Each round starts each server afresh "
        "(order turned every round); per model a cold request (it loads) then a warm one, "
        "streamed through the openai client, 8 tokens. Medians of the rounds, ms.",
        "",
        "| request | quill serve | llama-server router | quill / llama-server |",
        "|---|---|---|---|",
    ]
    for key in keys:
        ours, theirs = median["quill serve"][key], median["llama-server router"][key]
        lines.append(f"| {key} | {ours * 1000:.0f} | {theirs * 1000:.0f} | {ours / theirs:.2f} |")
    lines += ["", "Every round, ms:", ""]
    for name, runs in rounds.items():
        for key in keys:
            lines.append(f"- {name}, {key}: " + ", ".join(f"{r[key] * 1000:.0f}" for r in runs))
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
