"""How quill run saves a prompt cache: header and state written as they are (no joined copy, no
fsync: the state's sha256 catches a torn file), complete by the time the process exits; a write
cut short leaves no entry, and the next run writes one that a third run loads."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_promptcache import GREEDY, long_prompt

from cli.store.promptcache import cache_dir, files, read_header, read_state
from quant.partfiles import write_replacing

from conftest import QUILL, quill_env

# quill as its console script runs it, but with SIGXFSZ at its default (Python ignores it):
# a write past RLIMIT_FSIZE then kills the process where it stands, as a kill or a power cut would.
KILLED_BY_A_LARGE_WRITE = (
    "import signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_DFL); "
    "sys.argv[0] = 'quill'; from cli.app import main; main()"
)


def quill_run(
    home: Path, model: Path, *python: str, **popen: object
) -> subprocess.CompletedProcess:
    command = [*(python or [QUILL]), "run", "-m", str(model), *GREEDY, long_prompt()]
    return subprocess.run(
        command, capture_output=True, text=True, env=quill_env(home), timeout=300, **popen
    )


def test_the_cache_file_is_complete_when_the_process_exits(tmp_path, tiny_path):
    home = tmp_path / "home"
    first = quill_run(home, tiny_path)
    assert first.returncode == 0, first.stderr
    (path,) = files(cache_dir(home))
    entry = read_header(path)
    state = read_state(entry)  # its sha256 checked against the header
    assert len(state) == entry.state_bytes > 100_000  # the tiny model's ~170 KiB
    assert path.stat().st_size == entry.size > entry.state_bytes
    assert not [p.name for p in cache_dir(home).iterdir() if p.name.endswith(".part")]
    second = quill_run(home, tiny_path)
    assert second.returncode == 0 and "tokens from cache" in second.stderr


def _small_files_only() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))  # the tiny state: ~170 KiB


@pytest.mark.slow  # three runs in subprocesses
def test_a_write_cut_short_leaves_no_entry_and_the_next_run_writes_one(tmp_path, tiny_path):
    home = tmp_path / "home"
    python = (sys.executable, "-c", KILLED_BY_A_LARGE_WRITE)
    killed = quill_run(home, tiny_path, *python, preexec_fn=_small_files_only)
    assert killed.returncode == -signal.SIGXFSZ
    assert killed.stdout.strip()  # the reply was out before the save began
    parts = [p for p in cache_dir(home).iterdir() if p.name.endswith(".part")]
    assert len(parts) == 1 and parts[0].stat().st_size == 1 << 16  # half written
    assert files(cache_dir(home)) == []  # no entry: nothing a later run could load
    again = quill_run(home, tiny_path)
    assert again.returncode == 0 and "warning" not in again.stderr
    assert "tokens from cache" not in again.stderr
    (path,) = files(cache_dir(home))
    read_state(read_header(path))
    # The part file the killed writer left went with the next write of the same entry.
    assert not [p for p in cache_dir(home).iterdir() if p.name.endswith(".part")]
    third = quill_run(home, tiny_path)
    assert third.returncode == 0 and "tokens from cache" in third.stderr


def test_write_replacing_writes_chunks_in_order_with_or_without_sync(tmp_path):
    target = tmp_path / "out.bin"
    write_replacing(target, b"head", bytearray(b"-state-"), "tail", sync=False)
    assert target.read_bytes() == b"head-state-tail"
    write_replacing(target, "text, synced")
    assert target.read_text() == "text, synced"
    assert os.listdir(tmp_path) == ["out.bin"]
