"""quill perplexity against llama.cpp's llama-perplexity: same model files, text, window, threads.

Usage (inside quill's venv; builds llama-perplexity on first use, about 5 minutes):
    python -m benchmarks.ppl_vs_llama_perplexity [--text FILE] [--ctx 512] [--types f16,q8_0,q4_0]

Makes SmolLM2's F16 (dequantized from its Q4_1) and the other types with `quill quantize`, then
scores the text with both tools and prints a Markdown table: both perplexities, their ratio, and
the wall time of each (process start to exit).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def quill(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["quill", *args], capture_output=True, text=True, check=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--types", default="f16,q8_0,q4_0")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    built = subprocess.run(
        ["bash", str(HERE / "build_llama_bench.sh")], capture_output=True, text=True, check=True
    )
    llama_perplexity = Path(built.stdout.strip().splitlines()[-1]).with_name("llama-perplexity")

    quill("quantize", "smollm2-135m", "--to", "f16", "--force")
    rows = []
    for weight_type in args.types.split(","):
        if weight_type != "f16":
            quill("quantize", "smollm2-135m:f16", "--to", weight_type, "--force")
        path = json.loads(quill("inspect", f"smollm2-135m:{weight_type}", "--json").stdout)["path"]
        started = time.perf_counter()
        ours = json.loads(
            quill(
                "perplexity", f"smollm2-135m:{weight_type}", "-f", args.text,
                "--ctx", str(args.ctx), "-t", str(args.threads), "--json",
            ).stdout
        )  # fmt: skip
        quill_s = time.perf_counter() - started
        started = time.perf_counter()
        theirs = subprocess.run(
            [
                str(llama_perplexity), "-m", path, "-f", args.text, "-c", str(args.ctx),
                "-t", str(args.threads), "--no-repack",
            ],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        llama_s = time.perf_counter() - started
        final = re.search(r"PPL = ([\d.]+) \+/- ([\d.]+)", theirs.stderr + theirs.stdout)
        assert final, theirs.stderr[-2000:]
        rows.append(
            (weight_type, ours["perplexity"], ours["perplexity_error"], float(final[1]),
             float(final[2]), quill_s, llama_s, ours["tokens_scored"])
        )  # fmt: skip
        print(f"{weight_type}: done", file=sys.stderr)
    print("| weights | quill PPL | llama-perplexity PPL | ratio | tokens scored | quill s | "
          "llama-perplexity s | time ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, ppl, err, ref, ref_err, quill_s, llama_s, scored in rows:
        print(
            f"| {name} | {ppl:.4f} ± {err:.4f} | {ref:.4f} ± {ref_err:.4f} | {ppl / ref:.5f} | "
            f"{scored} | {quill_s:.1f} | {llama_s:.1f} | {quill_s / llama_s:.2f} |"
        )


if __name__ == "__main__":
    main()
