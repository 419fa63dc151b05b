"""The default thread count on a shared machine: cores other processes keep busy are left out,
at load and again while a chat or a server decodes, and the stats line says so. Real busy
processes are spun for each case."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx2 as httpx
import pexpect
import psutil
import pytest
from test_chat import PROMPT, spawn

from cli.app import app
from cli.engine import freecores
from cli.engine.freecores import CONFIRM_S, CoreLoad, ThreadJudge
from cli.engine.hardware import physical_cores
from cli.engine.opening import open_engine
from cli.engine.options import LoadOptions
from cli.engine.settings import ModelSettings
from cli.engine.speculative import SpecOptions

from conftest import start_server

SPIN = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass\n"
LOGICAL, PHYSICAL = psutil.cpu_count(logical=True) or 1, physical_cores()
# Spinners that leave one physical core fewer free (on SMT machines the logical CPUs past the
# physical cores are taken first), and the count an automatic engine should then use at most.
SPINNERS, FEWER = LOGICAL - PHYSICAL + 1, PHYSICAL - 1
needs_two_cores = pytest.mark.skipif(PHYSICAL < 2, reason="needs two physical cores")
TURN_THREADS = re.compile(r"context \d+/\d+ · threads (\d+)")


@contextlib.contextmanager
def busy_cores(count: int = 1) -> Iterator[None]:
    """Other processes that keep count cores busy (bounded: each stops itself after 2 minutes)."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        time.sleep(0.3)  # let them reach full speed
        yield
    finally:
        for spinner in spinners:
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
    with busy_cores():
        freecores.restart_window()
        measured = freecores.measure_free_cores()
    assert measured.busy_elsewhere >= 0.8 and measured.busy_cores >= 1
    assert measured.threads < measured.physical_cores


@pytest.mark.skipif((psutil.cpu_count(logical=False) or 1) < 2, reason="needs two cores")
def test_the_stats_line_says_cores_were_busy(runner, tiny_path):
    with busy_cores():
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


@needs_two_cores
def test_a_judge_leaves_out_cores_that_got_busy_after_it_started():
    judge = ThreadJudge(CoreLoad(LOGICAL, PHYSICAL, 0.0, 1.0))  # as if loaded on an idle machine
    assert judge.threads == PHYSICAL
    with busy_cores(SPINNERS):
        deadline = time.monotonic() + 10
        while judge.threads > FEWER and time.monotonic() < deadline:
            judge.look()  # reads nothing until LOOK_EVERY_S has passed since the last look
            time.sleep(0.05)
    assert judge.threads <= FEWER and judge.load.busy_cores >= SPINNERS


def reply_threads(child: pexpect.spawn, text: str) -> int:
    """Send a message; the threads its stats line says the reply used."""
    child.sendline(text)
    child.expect(TURN_THREADS)
    threads = int(child.match.group(1))
    child.expect_exact(PROMPT)
    return threads


def skip_where_cores_are_busy_already(threads: int) -> None:
    if threads <= FEWER:  # nothing left to show: other work holds a core already
        pytest.skip(f"other work keeps cores busy: {threads} threads before the spinners")


@needs_two_cores
def test_set_threads_fixes_a_chats_count_and_auto_leaves_out_a_core_taken_later(
    tiny_path, quill_home, tmp_path
):
    child = spawn(quill_home, tmp_path / "chat.json", "-m", str(tiny_path), "-n", "8")
    child.sendline("/show")
    child.expect_exact("auto (judged again while replying)")
    child.sendline("/set threads 1")
    child.expect_exact("threads = 1")
    assert reply_threads(child, "hello") == 1
    child.sendline("/show")
    child.expect_exact("threads    1, fixed")
    child.sendline("/set threads 0")
    child.expect_exact("threads takes a whole number 1 to 512, or auto, not '0'")
    child.sendline("/set threads auto")
    child.expect(r"threads = auto \((\d+) now\)")
    assert 1 <= int(child.match.group(1)) <= PHYSICAL
    skip_where_cores_are_busy_already(reply_threads(child, "hello"))
    with busy_cores(SPINNERS):
        time.sleep(CONFIRM_S)  # the user types: the next reply's first look sees the busy cores
        assert reply_threads(child, "hello again") <= FEWER
    child.sendeof()
    child.expect(pexpect.EOF)


@needs_two_cores
def test_a_server_leaves_out_a_core_taken_after_it_started(tiny_path, quill_home, tmp_path):
    process, url = start_server(quill_home, tmp_path, "-m", str(tiny_path))
    try:
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["threads_auto"] is True
        skip_where_cores_are_busy_already(health["threads"])
        with busy_cores(SPINNERS):
            time.sleep(CONFIRM_S)
            body = {"prompt": "hello", "max_tokens": 8, "temperature": 0}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert httpx.get(f"{url}/health", timeout=10).json()["threads"] <= FEWER
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_draft_model_decodes_with_its_targets_threads(tiny_path):
    settings = ModelSettings(spec=SpecOptions("draft"))
    with open_engine(tiny_path, LoadOptions(), settings, draft=("tiny", tiny_path)) as engine:
        draft = engine.speculator.drafter.engine
        for threads in (1, 2):
            engine.set_threads(threads)
            assert (engine.threads, draft.threads) == (threads, threads)
            assert engine.core_load is None  # fixed: nothing judged
        engine.set_threads(None)
        assert engine.core_load is not None and draft.threads == engine.threads
