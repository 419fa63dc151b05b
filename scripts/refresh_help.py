"""Paste today's `quill ... --help` into every docs block that shows it (width 100, no colour).

Usage: python scripts/refresh_help.py   (tests/test_docs.py fails when a pasted help is stale)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELP_LINE = re.compile(r"^\$ quill (.*)--help$")


def current_help(args: list[str]) -> list[str]:
    env = dict(os.environ, COLUMNS="100", NO_COLOR="1", TERM="dumb")
    quill = Path(sys.executable).with_name("quill")
    text = subprocess.run(
        [str(quill), *args, "--help"], capture_output=True, text=True, env=env, check=True
    ).stdout
    return [line.rstrip() for line in text.rstrip("\n").split("\n")]


def help_blocks(lines: list[str]) -> list[tuple[int, int, list[str]]]:
    """(first line of the pasted help, the line after it, the arguments before --help)."""
    blocks = []
    for index, line in enumerate(lines):
        match = HELP_LINE.match(line)
        if not match:
            continue
        end = index + 1
        while end < len(lines) and not lines[end].startswith(("```", "$ ")):
            end += 1
        blocks.append((index + 1, end, match[1].split()))
    return blocks


def main() -> None:
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        lines = path.read_text(encoding="utf-8").split("\n")
        for start, end, args in reversed(help_blocks(lines)):
            lines[start:end] = current_help(args)
        path.write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    main()
