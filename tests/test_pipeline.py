"""quill as a shell pipeline sees it: a real process, real pipes, real signals."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import QUILL, quill_env, run_quill

PROMPT = "Write an essay about the sea."


def quill(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    """`quill run ARGS`, its output as bytes (what a pipe carries)."""
    return run_quill(home, "run", *args, env=quill_env(home, **env), text=False)


def as_line(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


def test_stdout_is_only_the_text_and_stats_go_to_stderr(quill_home, smollm2_path):
    pinned = ("--temperature", "0", "-t", "1", "-n", "30")  # one thread count: one compute path
    plain = quill(quill_home, *pinned, PROMPT)
    as_json = quill(quill_home, *pinned, "--json", PROMPT)
    assert plain.returncode == as_json.returncode == 0
    # The text, ending with a newline as a line of output should (--json keeps it exact).
    # same path: one command, printed two ways
    assert plain.stdout.decode() == as_line(json.loads(as_json.stdout)["text"])
    stderr = plain.stderr.decode()
    assert stderr.count("\n") == 1 and "TTFT" in stderr  # one stats line, nothing else
    assert "\x1b[" not in stderr  # no colour when stderr is not a terminal
    assert "llama" not in stderr  # llama.cpp's own log stays silent
    assert as_json.stderr == b""


def test_verbose_shows_llama_cpps_log(quill_home, smollm2_path):
    result = quill(quill_home, "-n", "2", "--verbose", PROMPT)
    assert b"llama_model_loader" in result.stderr and result.returncode == 0
    # ...and names the CPU path the weights took (cli/engine/loading.py), whatever this CPU is.
    assert re.search(rb"CPU path: (llama.cpp's extra buffers|AMX avoided)", result.stderr)


def test_output_is_utf8_whatever_the_locale(quill_home, smollm2_path):
    # Plain ChatML, sent raw: SmolLM2's own template adds a default system prompt, after which
    # the model (greedy) no longer repeats the characters this test needs.
    chatml = "<|im_start|>user\nRepeat exactly: 你好,世界 🌍🚀<|im_end|>\n<|im_start|>assistant\n"
    args = ("--temperature", "0", "-t", "1", "-n", "30", "--raw", chatml)
    result = quill(quill_home, *args, LANG="C", LC_ALL="C", PYTHONIOENCODING="ascii")
    as_json = quill(quill_home, *args, "--json")
    assert result.returncode == 0, result.stderr
    # same path: one command (one thread count), printed two ways
    assert result.stdout.decode("utf-8") == as_line(json.loads(as_json.stdout)["text"])
    assert "你好" in result.stdout.decode("utf-8")


def test_head_closing_the_pipe_ends_quietly(quill_home, smollm2_path):
    script = f'"{QUILL}" run -n 200 "{PROMPT}" | head -c 20; echo "rc=${{PIPESTATUS[0]}}" >&2'
    result = subprocess.run(
        ["bash", "-c", script], capture_output=True, env=quill_env(quill_home), timeout=120
    )
    assert len(result.stdout) == 20
    assert result.stderr.decode().strip().splitlines() == ["rc=0"]


def test_ctrl_c_stops_prints_the_stats_so_far_and_exits_130(quill_home, tiny_path):
    process = subprocess.Popen(
        [QUILL, "run", "-m", str(tiny_path), "--temperature", "0", "-n", "4000", "hello"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=quill_env(quill_home),
    )
    assert process.stdout is not None
    process.stdout.read(64)  # generation has started
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    text = stderr.decode()
    assert "finish interrupted" in text and "Traceback" not in text
    decoded = int(text.split("decode ")[1].split(" tok")[0])
    assert 0 < decoded < 4000


def test_the_ctrl_c_test_passes_in_a_suite_started_with_signals_ignored(tmp_path):
    """A suite started as a background job (`pytest &` in a script), by nohup or by a CI runner
    inherits SIGINT and SIGQUIT, or SIGTERM, ignored; quill, started by it, would then rightly
    ignore Ctrl-C. conftest.py restores them, so the Ctrl-C test above passes there too."""
    ignore_then_run_pytest = (
        "import os, signal, sys\n"
        "for number in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM):\n"
        "    signal.signal(number, signal.SIG_IGN)\n"
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
    )
    test = "tests/test_pipeline.py::test_ctrl_c_stops_prints_the_stats_so_far_and_exits_130"
    inner = str(tmp_path / "inner")  # the inner run removes its --basetemp first
    pytest_args = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "--basetemp", inner, test]
    result = subprocess.run(
        [sys.executable, "-c", ignore_then_run_pytest, *pytest_args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=300,
    )
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout + result.stderr


def test_usage_errors_are_one_line_with_exit_2(quill_home):
    for args in (["--max-tokens", "0", "hi"], ["--bogus", "hi"], ["--temperature", "hot", "hi"]):
        result = quill(quill_home, *args)
        lines = result.stderr.decode().strip().splitlines()
        assert result.returncode == 2, args
        assert len(lines) == 1 and lines[0].startswith("quill: error: "), lines
        assert "quill run --help" in lines[0]
