"""Every number a user types is checked before use: one past its range (400 digits, 1e400, nan,
inf, a thread count that once ended in a segfault) is one line naming the option and exit 2, on
the command lines of run, chat, serve and inspect, and in a chat's /set, after which it chats on."""

from __future__ import annotations

import subprocess

import pytest

from cli.app import app

from conftest import QUILL, quill_env
from refusals import home as home
from refusals import one_short_error_line as one_error_line

HUGE = "9" * 400


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--cache-max", HUGE, "hi"], "--cache-max"),
        (["run", "--cache-max", "1e400", "hi"], "--cache-max"),
        (["run", "--seed", HUGE, "hi"], "--seed"),
        (["run", "--seed", "4294967295", "hi"], "--seed"),
        (["run", "--top-k", HUGE, "hi"], "--top-k"),
        (["run", "--ctx", HUGE, "hi"], "--ctx"),
        (["run", "--ctx", "99999999999", "hi"], "--ctx"),
        (["run", "--gpu-layers", HUGE, "hi"], "--gpu-layers"),
        (["run", "--threads", "513", "hi"], "--threads"),
        (["run", "--temperature", "nan", "hi"], "--temperature"),
        (["run", "--top-p", "nan", "hi"], "--top-p"),
        (["run", "--repeat-penalty", "inf", "hi"], "--repeat-penalty"),
        (["chat", "--ctx", HUGE], "--ctx"),
        (["chat", "--seed", HUGE], "--seed"),
        (["chat", "--threads", "99999"], "--threads"),
        (["serve", "--cache-ram", HUGE], "--cache-ram"),
        (["serve", "--threads", "1000"], "--threads"),
        (["run", "--endpoint", "http://127.0.0.1:9", "--threads", "513", "hi"], "--threads"),
        (["bench", "--threads", "1,600", "-p", "8", "-n", "0"], "--threads"),
        (["quantize", "--to", "q8_0", "--threads", "999"], "--threads"),
        (["quant-report", "--threads", "999", "-f", "/dev/null"], "--threads"),
        (["embed", "--threads", "999", "x"], "--threads"),
        (["inspect", "--mem", HUGE], "--mem"),
        (["inspect", "--mem", "inf"], "--mem"),
        (["inspect", "--cache-ram", HUGE], "--cache-ram"),
        (["inspect", "--ctx", HUGE], "--ctx"),
    ],
)
def test_a_number_past_its_range_is_one_line_and_exit_2(tiny_path, home, args, needle):
    # A real process: before the checks, --threads 99999 ended in a segfault.
    command, *rest = args
    positional = command in ("inspect", "embed", "quantize")
    model = [str(tiny_path)] if positional else ["-m", str(tiny_path)]
    result = subprocess.run(
        [QUILL, command, *model, *rest], capture_output=True, text=True,
        env=quill_env(home), timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    one_error_line(result.stderr, needle)
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("temperature nan", "temperature takes 0 to"),
        ("temperature -1", "temperature takes 0 to"),
        ("top_p 5", "top_p takes 0 to 1"),
        ("min_p -1", "min_p takes 0 to 1"),
        ("seed 99999999999999", "seed takes 0 to 4294967294"),
        ("top_k 99999999999", "top_k takes 0 to 2147483647"),
        ("repeat_penalty inf", "repeat_penalty takes 0 to"),
    ],
)
def test_chat_set_refuses_values_out_of_range(runner, home, tiny_path, setting, needle):
    result = runner.invoke(
        app, ["chat", "-m", str(tiny_path), "-n", "2", "--temperature", "0"],
        input=f"/set {setting}\n",
    )  # fmt: skip
    assert result.exit_code == 0, (result.stderr, result.exception)
    one_error_line(result.stderr, needle)
    key = setting.split()[0]
    assert f"{key} = " not in result.stderr  # not taken: no confirmation line
