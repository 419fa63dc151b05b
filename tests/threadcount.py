"""A process's OS threads, llama.cpp's OpenMP workers among them, counted in a fresh process (the
pytest process holds the teams of every test before): the tests that keep compute threads from
piling up (test_engine.py, test_batching.py) run their scripts through run()."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
needs_proc = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts in /proc")


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settle(target: int, timeout_s: float = 10.0) -> int:
    """The count once it is target, or after timeout_s: an ended thread's OpenMP workers leave a
    moment after it."""
    deadline = time.monotonic() + timeout_s
    while threads() != target and time.monotonic() < deadline:
        time.sleep(0.05)
    return threads()


def run(script: str) -> list[tuple[int, int]]:
    """script in a fresh Python (this module importable as threadcount); the (before, after)
    pairs it prints, a line each."""
    preamble = f"import sys\nsys.path.insert(1, {str(HERE)!r})\n"
    done = subprocess.run([sys.executable, "-c", preamble + script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    pairs = [line.split() for line in done.stdout.splitlines()]
    return [(int(before), int(after)) for before, after in pairs]
