"""Time to the first token of a long prompt: `quill serve` (its weights placed by the path table
for a server's request, cli/measure/paths.py) against `llama-server` with its default kernel
path (weights repacked, flash attention auto), on the same model, machine and threads.

Both servers get one slot of --ctx tokens (llama-server's -c is shared by its slots: -np 1 gives
the one slot the whole context, as quill's --ctx gives each). Each round sends each server, in an
order that turns each round, a streamed greedy chat request of about 1k and of about 4k prompt
tokens (a text new to both in every round, so that no prefix cache holds any of it) and 4 tokens
out; the TTFT is the client's, from sending to the first content chunk. Ratios are llama-server's
TTFT over quill's (above 1: quill answers sooner), medians of per-round ratios.

Usage: python -m benchmarks.paths_ttft --model REPLICA.gguf [--rounds 3] --json OUT.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.embed import sentence
from benchmarks.harness import (
    QUILL,
    TOOLS,
    add_quiet_wait,
    chat_reply,
    command_line,
    interleave,
    machine_line,
    paired,
    quill_commit,
    refuse_omp_wait_policy,
    served_model,
    serving,
    users_env,
)

CHARS_PER_TOKEN = 5.2  # the filler text's, Llama 3's vocabulary: the servers count real tokens


def prompt_of(tokens: int, rng: random.Random) -> str:
    text = ""
    while len(text) < tokens * CHARS_PER_TOKEN:
        text += sentence(rng) + " "
    return "Summarize this text in one line.\n\n" + text


def loaded_model(url: str, timeout: float = 300) -> str:
    """served_model, once the server has loaded it (llama-server answers 503 until then)."""
    from cli.errors import EndpointError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return served_model(url)
        except EndpointError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--lengths", default="1000,4000", help="prompt tokens, about")
    add_quiet_wait(parser, 60.0)
    parser.add_argument("--home", type=Path, help="QUILL_HOME for quill (default: a new one)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    refuse_omp_wait_policy()
    home = args.home or Path(tempfile.mkdtemp(prefix="quill-ttft-"))
    env = users_env(QUILL_HOME=str(home), HF_HUB_OFFLINE="1")
    threads, ctx = str(args.threads), str(args.ctx)
    commands = {
        "quill serve": [QUILL, "serve", str(args.model), "--threads", threads, "--ctx", ctx,
                        "--no-cache"],
        "llama-server": [str(TOOLS / "llama-server"), "-m", str(args.model), "-t", threads, "-c",
                         ctx, "-np", "1", "--no-cache-prompt"],
    }  # fmt: skip
    lengths = [int(part) for part in args.lengths.split(",")]
    rng = random.Random(0)
    prompts = [{length: prompt_of(length, rng) for length in lengths} for _ in range(args.rounds)]
    with (
        serving(commands["quill serve"], env) as (_, quill_url),
        serving(commands["llama-server"], env) as (_, llama_url),
    ):
        urls = {"quill serve": quill_url, "llama-server": llama_url}
        models = {name: loaded_model(url) for name, url in urls.items()}

        def contender(name: str):
            def measure(number: int) -> dict:
                found: dict = {}
                for length, prompt in prompts[number].items():
                    reply = chat_reply(urls[name], prompt, 4, models[name])
                    found[f"ttft_{length}"] = reply.ttft_s
                    found[f"prompt_tokens_{length}"] = reply.prompt_tokens
                return found

            return measure

        rounds = interleave({name: contender(name) for name in urls}, args.rounds,
                            quiet_limit=args.quiet_wait)  # fmt: skip
    summary = {}
    for length in lengths:
        ratio = paired(rounds, f"ttft_{length}", "llama-server", "quill serve")
        summary[length] = {
            "prompt_tokens": statistics.median(
                r["quill serve"][f"prompt_tokens_{length}"] for r in rounds
            ),
            "quill_ttft_s": ratio.reference,
            "llama_server_ttft_s": ratio.ours,
            "llama_server_over_quill": ratio.median,
            "judged": ratio.judged,
            "ratios": ratio.ratios,
        }
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_line(),
        "commit": quill_commit(),
        "command": command_line("benchmarks.paths_ttft"),
        "model": str(args.model),
        "commands": {name: " ".join(command) for name, command in commands.items()},
        "rounds": rounds,
        "summary": summary,
    }
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    args.json.with_suffix(".md").write_text(report(record))
    print(report(record))


def report(record: dict) -> str:
    lines = [f"# TTFT of a long prompt: quill serve against llama-server ({record['date']})", "",
             f"{record['machine']}; quill {record['commit']}; {Path(record['model']).name}; "
             f"{len(record['rounds'])} rounds (benchmarks/paths_ttft.py).", "",
             f"`{record['command']}`", "",
             "| prompt tokens | quill serve TTFT s | llama-server TTFT s | llama-server / quill "
             "(per-round median) | per round |", "|---|---|---|---|---|"]  # fmt: skip
    for row in record["summary"].values():
        rounds = ", ".join(f"{ratio:.2f}" for ratio in row["ratios"])
        lines.append(f"| {row['prompt_tokens']:.0f} | {row['quill_ttft_s']:.2f} | "
                     f"{row['llama_server_ttft_s']:.2f} | {row['judged']:.2f} | "
                     f"{rounds} |")  # fmt: skip
    lines += ["", "Commands:", ""]
    lines += [f"- {name}: `{command}`" for name, command in record["commands"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
