"""Where quantize writes: a target a rename would destroy (a named pipe, a directory, a symbolic
link, the input itself, a device) is refused in one line and left as it was, and the part file a
killed quantize left behind is removed by the next run, while a running one's is not touched."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

from cli.app import app

from conftest import QUILL, quill_env
from refusals import one_error_line


def test_quantize_refuses_targets_a_rename_would_destroy(runner, tiny_path, tmp_path):
    def refused(target: Path, needle: str) -> None:
        args = ["quantize", str(tiny_path), "--to", "q8_0", "-o", str(target), "--force"]
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.stderr
        one_error_line(result.stderr, needle)

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    refused(fifo, "is a named pipe, not a regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    folder = tmp_path / "folder"
    folder.mkdir()
    refused(folder, "is a directory")
    assert folder.is_dir()
    kept = tmp_path / "kept.gguf"
    kept.write_bytes(b"keep me")
    link = tmp_path / "link.gguf"
    link.symlink_to(kept)
    refused(link, "is a symbolic link")
    assert link.is_symlink() and kept.read_bytes() == b"keep me"
    source_copy = tmp_path / "source.gguf"
    source_copy.write_bytes(tiny_path.read_bytes())
    args = ["quantize", str(source_copy), "--to", "q8_0", "-o", str(source_copy), "--force"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    one_error_line(result.stderr, "is the input file itself")
    assert source_copy.read_bytes() == tiny_path.read_bytes()
    if os.geteuid() == 0:  # as root, /dev/null was replaced by a regular file: a device here
        device = tmp_path / "null"
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        refused(device, "is a device, not a regular file")
        assert stat.S_ISCHR(device.lstat().st_mode)
    assert not list(tmp_path.glob(".*.part"))


def test_a_killed_quantize_leaves_a_part_file_the_next_run_removes(smollm2_f16, tmp_path):
    output = tmp_path / "out.gguf"
    command = [QUILL, "quantize", smollm2_f16["output"], "--to", "q8_0", "-o", str(output)]
    # A home of its own: a store model's output would be recorded under its name in the shared one.
    env = quill_env(tmp_path / "home")
    killed = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    part = tmp_path / f".out.gguf.{killed.pid}.part"
    deadline = time.monotonic() + 60
    while not (part.exists() and part.stat().st_size > 0):
        assert time.monotonic() < deadline and killed.poll() is None, "no part file appeared"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert part.exists() and not output.exists()
    # A part file of a process that is still running is not touched.
    alive = subprocess.Popen(["sleep", "60"])
    live_part = tmp_path / f".out.gguf.{alive.pid}.part"
    live_part.write_bytes(b"in progress")
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert not part.exists() and output.is_file()
        assert live_part.read_bytes() == b"in progress"
    finally:
        alive.kill()
        alive.wait()
