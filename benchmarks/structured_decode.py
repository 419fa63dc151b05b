"""Decode speed with a schema against without, in quill and in llama.cpp's own llama-completion.

Same prompt (the chat-templated text, with the schema told in the system prompt), same model and
threads. Each round: quill with a 6-field schema (greedy, so the reply and its token count are
fixed), then quill without the grammar for exactly that many tokens (--ignore-eos); then
llama-completion -j SCHEMA and llama-completion without it for the same count. Rounds alternate,
because speed on a shared machine drifts more than the effect measured. llama-completion's
decode speed is its eval runs over its eval time plus its sampling time: llama.cpp prints the
grammar's cost apart, in the sampler's time, where quill's decode figure holds it.

    . .venv/bin/activate
    python -m benchmarks.structured_decode --rounds 7 --threads 2

Targets (issue 17): quill's ratio (with / without) >= 0.9, and >= llama.cpp's ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
from pathlib import Path

from benchmarks.harness import TOOLS
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from cli.engine.structured import schema_constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string"},
        "invoice_number": {"type": "string"},
        "date": {"type": "string", "format": "date"},
        "total": {"type": "number"},
        "currency": {"enum": ["USD", "EUR", "GBP"]},
        "paid": {"type": "boolean"},
    },
    "required": ["vendor", "invoice_number", "date", "total", "currency", "paid"],
}
PROMPT = (
    "Extract the invoice: ACME Corporation, invoice INV-2024-0042, dated 5 March 2024, "
    "for 1,234.50 euros for 40 boxes of assorted widgets and gaskets, shipped by sea freight "
    "to the Rotterdam warehouse; payment received in full on 12 March 2024."
)


def quill_round(engine: Engine, messages, grammar: str | None, tokens: int) -> tuple[float, int]:
    sampling = SamplingParams(temperature=0, grammar=grammar, ignore_eos=grammar is None)
    events = list(engine.stream_chat(messages, tokens, sampling))
    last = events[-1]
    return last.decode_tokens_per_s, last.generation_tokens


def llama_completion(binary: Path, model: Path, prompt: str, threads: int, extra: list[str]):
    """(decode tok/s, tokens decoded) from llama-completion's own perf lines."""
    command = [str(binary), "-m", str(model), "-p", prompt, "-t", str(threads), "--temp", "0",
               "-no-cnv", "--no-display-prompt", "--perf", *extra]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )
    decode_lines = [line for line in done.stderr.splitlines() if "prompt eval" not in line]
    found = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs", "\n".join(decode_lines))
    sampling = re.search(r"sampling time =\s*([\d.]+) ms", done.stderr)
    if done.returncode != 0 or not found or not sampling:
        raise RuntimeError(f"llama-completion failed: {done.stderr[-2000:]}")
    # llama.cpp's "eval time" is llama_decode alone; the grammar runs in the sampler, whose time
    # it prints apart ("sampling time"). quill's decode figure holds both, so this one does too.
    runs = int(found.group(2))
    return runs / ((float(found.group(1)) + float(sampling.group(1))) / 1000), runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="GGUF (default: quill's smollm2-135m)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the raw samples as JSON here")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from cli.commands.options import obtain_model

        model = obtain_model(None, offline=False)[1]
    constraint = schema_constraint(SCHEMA)
    messages = [("system", constraint.describe_for_prompt()), ("user", PROMPT)]
    engine = Engine(model, LoadOptions(threads=args.threads))
    prompt_text, _ = engine.conversation_text(messages)
    completion = TOOLS / "llama-completion"
    schema_json = json.dumps(SCHEMA)
    samples: dict[str, list[float]] = {"quill_schema": [], "quill_plain": [],
                                       "llama_schema": [], "llama_plain": []}  # fmt: skip
    quill_round(engine, messages, constraint.grammar, 400)  # warm-up
    for index in range(args.rounds):
        speed, count = quill_round(engine, messages, constraint.grammar, 400)
        samples["quill_schema"].append(speed)
        samples["quill_plain"].append(quill_round(engine, messages, None, count)[0])
        line = f"round {index + 1}: quill {count} tokens, schema {speed:.1f} / plain " \
               f"{samples['quill_plain'][-1]:.1f} tok/s"  # fmt: skip
        if completion.exists():
            speed, n = llama_completion(completion, model, prompt_text, args.threads,
                                        ["-j", schema_json, "-n", "400"])  # fmt: skip
            samples["llama_schema"].append(speed)
            plain = llama_completion(completion, model, prompt_text, args.threads,
                                     ["-n", str(n + 1), "--ignore-eos"])[0]  # fmt: skip
            samples["llama_plain"].append(plain)
            line += f"; llama-completion {n} tokens, schema {speed:.1f} / plain {plain:.1f} tok/s"
        print(line, flush=True)
    engine.close()

    def ratio(name: str) -> str:
        with_schema, plain = samples[f"{name}_schema"], samples[f"{name}_plain"]
        if not with_schema:
            return f"{name}: not measured (no {completion})"
        per_round = [a / b for a, b in zip(with_schema, plain, strict=True)]
        return (
            f"{name}: schema {statistics.mean(with_schema):.1f} tok/s, plain "
            f"{statistics.mean(plain):.1f} tok/s, ratio of means "
            f"{statistics.mean(with_schema) / statistics.mean(plain):.3f}, per-round median "
            f"{statistics.median(per_round):.3f}"
        )

    print(ratio("quill"))
    print(ratio("llama"))
    if args.out:
        args.out.write_text(json.dumps({"threads": args.threads, "model": str(model),
                                        **samples}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
