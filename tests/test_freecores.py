"""The default thread count on a shared machine: cores other processes keep busy are left out,
and the stats line says so. A real busy process is spun for each case."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from cli.app import app
from cli.engine import freecores
from cli.engine.freecores import CoreLoad

SPIN = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass\n"


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """Another process that keeps one core busy (bounded: it stops itself after 2 minutes)."""
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.3)  # let it reach full speed
        yield
    finally:
        spinner.kill()
        spinner.wait()


def test_the_arithmetic_of_busy_and_free_cores():
    def load(busy: float, logical: int = 2, physical: int = 2) -> CoreLoad:
        return CoreLoad(logical, physical, busy, 0.2)

    assert (load(0.05).busy_cores, load(0.05).threads) == (0, 2)
    assert (load(1.0).busy_cores, load(1.0).threads) == (1, 1)
    assert (load(0.5).busy_cores, load(0.5).threads) == (1, 1)  # a half-busy core still stalls
    assert (load(2.0).busy_cores, load(2.0).threads) == (2, 1)  # never fewer than one thread
    assert load(1.0, logical=16, physical=8).threads == 8  # SMT: one per physical core, free
    assert load(9.0, logical=16, physical=8).threads == 7


@pytest.mark.skipif((psutil.cpu_count(logical=False) or 1) < 2, reason="needs two cores")
def test_a_busy_core_elsewhere_is_measured_and_left_out():
    with busy_core():
        freecores.restart_window()
        measured = freecores.measure_free_cores()
    assert measured.busy_elsewhere >= 0.8 and measured.busy_cores >= 1
    assert measured.threads < measured.physical_cores


@pytest.mark.skipif((psutil.cpu_count(logical=False) or 1) < 2, reason="needs two cores")
def test_the_stats_line_says_cores_were_busy(runner, tiny_path):
    with busy_core():
        freecores.restart_window()
        result = runner.invoke(app, ["run", "-m", str(tiny_path), "-n", "2", "--raw", "Hi"])
        assert result.exit_code == 0, result.stderr
        assert "busy elsewhere)" in result.stderr, result.stderr
        result = runner.invoke(app, ["run", "-m", str(tiny_path), "-n", "2", "--json", "Hi"])
    assert result.exit_code == 0, result.stderr
    numbers = json.loads(result.stdout)
    assert numbers["busy_cores"] >= 1 and numbers["threads"] < psutil.cpu_count(logical=False)
    args = ["run", "-m", str(tiny_path), "-n", "2", "-t", "2", "--json", "Hi"]
    explicit = runner.invoke(app, args)
    assert json.loads(explicit.stdout)["busy_cores"] is None  # --threads: nothing measured
