"""Run every greedy or seeded `quill run` example in docs/ again and paste what it prints now
(the reply, then the stderr lines: the stats line and any warning).

Usage: python scripts/refresh_examples.py [--check]
Examples that tests/test_docs.py replays (plain `$ quill run ... --temperature 0` or with
--seed, the default model) are the ones refreshed. Run it after a change to what the model
reads (the chat template) or to the stats line; then read the prose around each example, which
may cite its numbers. --check lists the examples whose reply changed, and changes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_docs import GREEDY_RUNS, shown_reply  # noqa: E402


def run_example(command: str) -> tuple[str, list[str]]:
    """The documented command line, run by bash as a reader would type it ($'...' quoting
    included), with this environment's quill first on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, COLUMNS="100", NO_COLOR="1", TERM="dumb")
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{command} failed: {result.stderr}")
    stdout = result.stdout.rstrip("\n")
    if command.split()[:3] == ["quill", "run", "--temperature"] and "--json" in command:
        stdout = json.dumps(json.loads(stdout), indent=4, ensure_ascii=False)
    return stdout, result.stderr.rstrip("\n").splitlines()


def main() -> int:
    check = "--check" in sys.argv
    changed = []
    by_doc: dict[str, list[int]] = {}
    for doc, line, _argv, _shown in GREEDY_RUNS:
        by_doc.setdefault(doc, []).append(line)
    for doc, examples in by_doc.items():
        path = ROOT / "docs" / doc if (ROOT / "docs" / doc).exists() else ROOT / doc
        lines = path.read_text(encoding="utf-8").split("\n")
        for line in sorted(examples, reverse=True):  # from the bottom: numbers hold
            end = line
            while end < len(lines) and not lines[end].startswith(("$ ", "```")):
                end += 1
            stdout, stderr = run_example(lines[line - 1][2:])
            old = "\n".join(lines[line:end])
            if shown_reply(old) != shown_reply(stdout):
                changed.append(f"{doc}:{line}")
            lines[line:end] = [*stdout.split("\n"), *stderr] if stdout else stderr
        if not check:
            path.write_text("\n".join(lines), encoding="utf-8")
    for where in changed:
        print(f"changed: {where}")
    return 1 if check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
