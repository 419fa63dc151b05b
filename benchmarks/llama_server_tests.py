"""llama.cpp's own server tests (tools/server/tests in the llama-cpp-python sdist quill builds
from) run against llama-server and against quill serve, on the same machine and model (issue 50;
the Anthropic, Responses and metrics files for issue 45).

Those tests start `llama-server` through utils.py's ServerProcess, whose binary
LLAMA_SERVER_BIN_PATH names. Here that is a shim (written to a scratch folder) that runs either
the real llama-server or `quill serve`. Both get the local SmolLM2-135M in place of the Hub's
tiny models (this machine reaches no Hub; --hf-repo and --hf-file are replaced by --model), so
the tests that check a text the Hub's model writes fail on both sides alike. For quill, the shim
passes a llama-server flag on as typed where quill serve is meant to take it (a llama-server
user types it), spells it quill's way where quill has the same option under its own name, and
drops the flags that ask for what quill always does (continuous batching, Jinja templates) or
that have no meaning for it (the web UI); its log line says which.

The tests' own Python environment (their requirements.txt) is made once in
benchmarks/.build/server-tests-venv.

Usage (inside quill's venv, after benchmarks/build_llama_bench.sh):
  python -m benchmarks.llama_server_tests [--files test_basic test_tokenize ...]
      [--servers llama quill] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.harness import QUILL, ROOT, TOOLS, machine_line, quill_commit

SDIST = TOOLS.parent.parent / "src" / "vendor" / "llama.cpp" / "tools" / "server" / "tests"
VENV = ROOT / "benchmarks" / ".build" / "server-tests-venv"
FILES = [
    "test_basic", "test_security", "test_chat_completion", "test_completion", "test_tokenize",
    "test_ctx_shift", "test_compat_anthropic", "test_compat_oai_responses", "test_metrics",
]  # fmt: skip
# Flags quill serve takes under another name: llama-server's -> quill's.
RENAMED = {"-ctk": "--kv-k", "-ctv": "--kv-v", "--cors-origins": "--cors",
           "--n-gpu-layers": "--gpu-layers"}  # fmt: skip
# Flags that ask for what quill always does, or mean nothing to it: dropped (with their value).
# (--embedding, --reranking: quill serves an embedding or reranker model's routes by its kind;
# --backend_sampling: quill samples on the CPU, whatever runs the model.)
DROPPED = {"--cont-batching": 0, "--jinja": 0, "--no-jinja": 0, "--no-ui": 0,
           "--ubatch-size": 1, "--embedding": 0,
           "--reranking": 0, "--kv-unified": 0, "--swa-full": 0, "-fa": 1,
           "--backend_sampling": 0}  # fmt: skip

SHIM = '''#!{python}
"""llama-server's command line, run as {target}: see benchmarks/llama_server_tests.py."""
import os, sys
args, model, target = sys.argv[1:], {model!r}, {target!r}
renamed, dropped = {renamed!r}, {dropped!r}
out, i, said = [], 0, []
while i < len(args):
    arg = args[i]
    if arg in ("--hf-repo", "--hf-file", "--model-url"):
        i += 2
        continue
    if target == "quill":
        if arg in dropped:
            said.append(" ".join(args[i : i + 1 + dropped[arg]]))
            i += 1 + dropped[arg]
            continue
        arg = renamed.get(arg, arg)
    out.append(arg)
    i += 1
if "--model" not in out and "-m" not in out:
    out += ["--model", model]
if target == "quill":
    command = [{quill!r}, "serve", *out]
    if said:
        print("shim: dropped " + ", ".join(said), file=sys.stderr, flush=True)
else:
    command = [{llama_server!r}, *out]
print("shim: " + " ".join(command), file=sys.stderr, flush=True)
os.execv(command[0], command)
'''


def tests_python() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r",
                        str(SDIST / "requirements.txt")], check=True)  # fmt: skip
    return python


def write_shim(folder: Path, target: str, model: Path) -> Path:
    shim = folder / f"llama-server-{target}"
    shim.write_text(SHIM.format(
        python=sys.executable, target=target, model=str(model), renamed=RENAMED, dropped=DROPPED,
        quill=QUILL, llama_server=str(TOOLS / "llama-server"),
    ))  # fmt: skip
    shim.chmod(0o755)
    return shim


def run_file(python: Path, tests: Path, shim: Path, name: str, report: Path) -> dict[str, str]:
    """Each test of unit/NAME.py: its outcome (passed, failed, skipped) against shim's server."""
    env = dict(os.environ, LLAMA_SERVER_BIN_PATH=str(shim), LLAMA_CACHE=str(tests / "tmp"))
    env.pop("VIRTUAL_ENV", None)
    subprocess.run(
        [str(python), "-m", "pytest", f"unit/{name}.py", "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}"],
        cwd=tests, env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    outcomes: dict[str, str] = {}
    if not report.exists():
        return outcomes
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = ("failed" if kinds & {"failure", "error"} else
                   "skipped" if "skipped" in kinds else "passed")  # fmt: skip
        outcomes[case.get("name", "?")] = outcome
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", default=FILES)
    parser.add_argument("--servers", nargs="+", default=["llama", "quill"])
    parser.add_argument("--model", type=Path,
                        default=Path.home() / ".cache/quill/models/smollm2-135m/q4_1/"
                        "SmolLM2-135M-Instruct.Q4_1.gguf")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    python = tests_python()
    results: dict = {"machine": machine_line(), "quill": quill_commit(), "model": str(args.model)}
    with tempfile.TemporaryDirectory(prefix="server-tests-") as scratch:
        folder = Path(scratch)
        tests = folder / "tests"
        shutil.copytree(SDIST, tests)
        for target in args.servers:
            shim = write_shim(folder, target, args.model)
            for name in args.files:
                report = folder / f"{target}-{name}.xml"
                results.setdefault(name, {})[target] = run_file(python, tests, shim, name, report)
                counts = _counts(results[name][target])
                print(f"{target:6} {name:28} {counts}", file=sys.stderr, flush=True)
    print(table(results, args.files, args.servers))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


def _counts(outcomes: dict[str, str]) -> str:
    passed = sum(o == "passed" for o in outcomes.values())
    failed = sum(o == "failed" for o in outcomes.values())
    return f"{passed} pass / {failed} fail"


def table(results: dict, files: list[str], servers: list[str]) -> str:
    names = {"llama": "llama-server", "quill": "quill"}
    lines = [f"| unit file | {' | '.join(names[s] for s in servers)} |",
             f"|---|{'---|' * len(servers)}"]  # fmt: skip
    for name in files:
        lines.append(f"| {name} | " + " | ".join(_counts(results[name][s]) for s in servers) + " |")
    if set(servers) == {"llama", "quill"}:
        lines.append("\nPassing against llama-server, failing against quill:")
        for name in files:
            llama, quill = results[name]["llama"], results[name]["quill"]
            for test, outcome in llama.items():
                if outcome == "passed" and quill.get(test) != "passed":
                    lines.append(f"- {name}::{test}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
