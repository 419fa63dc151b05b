"""A path a user types that cannot be one is one line with the documented exit code: a directory
for a transcript, a device, a named pipe (refused at once, not waited on), a template of 1.5
million characters, a text that is not UTF-8, a name 5,000 characters long."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import QUILL, quill_env
from refusals import home as home
from refusals import one_short_error_line as one_error_line


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["chat", "--transcript", "/"], 2, "is a directory"),
        (["chat", "--transcript", "."], 2, "is a directory"),
        (["chat", "--resume", "a" * 5000 + ".json"], 2, "no saved chat"),
        (["run", "--chat-template", "/dev/zero", "hi"], 2, "it is a device, not a regular file"),
        (["run", "--chat-template", "big", "hi"], 2, "bytes: not a chat template"),
        # Every file named for its text is read one way (cli/userfiles.py): a device or a named
        # pipe is refused at once, without waiting for a writer or reading forever.
        (["perplexity", "-f", "/dev/zero"], 2, "the text /dev/zero: it is a device"),
        (["perplexity", "-f", "pipe"], 2, "it is a named pipe, not a regular file"),
        (["run", "--chat-template", "pipe", "hi"], 2, "it is a named pipe, not a regular file"),
        (["run", "--grammar", "pipe", "hi"], 2, "it is a named pipe, not a regular file"),
        (["perplexity", "-f", "latin1.txt"], 2, "it is not UTF-8 text (byte 3)"),
        (["run", "-m", "a" * 5000, "hi"], 3, "cannot be a model path"),
        (["cache", "x" * 5000], 2, "takes list or clear"),
    ],
)
def test_a_path_that_cannot_be_one_is_one_line(tiny_path, home, tmp_path, args, code, needle):
    (tmp_path / "big").write_text("{# a comment #}" * 100_000)  # 1.5 million characters
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    os.mkfifo(tmp_path / "pipe")
    if "-m" not in args and args[0] != "cache":
        args = [args[0], "-m", str(tiny_path), *args[1:]]
    result = subprocess.run(
        [QUILL, *args], capture_output=True, text=True, env=quill_env(home), timeout=120,
        stdin=subprocess.DEVNULL, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == code, result.stderr
    one_error_line(result.stderr, needle)
