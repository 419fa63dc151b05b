"""What the tests of refused input share: the one `quill: error:` line a refusal prints (never a
traceback), and a quill home of the test's own. A test file takes the fixture by its name,
`from refusals import home as home` (the alias tells ruff the name is used: pytest finds the
fixture in the module's names)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "home"
    monkeypatch.setenv("QUILL_HOME", str(folder))
    return folder


def one_error_line(stderr: str, needle: str) -> None:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("quill: error: ")]
    assert len(errors) == 1 and needle in errors[0], stderr


def one_short_error_line(stderr: str, needle: str) -> None:
    """one_error_line, and the line short: what the user typed is not echoed whole."""
    one_error_line(stderr, needle)
    errors = [line for line in stderr.splitlines() if line.startswith("quill: error: ")]
    assert len(errors[0]) < 400, errors[0]  # a 400-digit number is not echoed whole
