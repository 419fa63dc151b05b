"""The type checker over cli/ and quant/, as pyproject.toml's [tool.mypy] configures it: the
protocols the commands hold (Backend, PromptCache, Drafter) are contracts it keeps.

mypy rather than pyright: it installs from the package index as a wheel, with no Node runtime to
fetch, so it runs on the offline machines the rest of the suite runs on; and it reads
pyproject.toml, where the rest of the tools' settings are."""

from __future__ import annotations

from pathlib import Path

from mypy import api as mypy_api

ROOT = Path(__file__).resolve().parent.parent


def type_check(*targets: str, cache: Path = ROOT / ".mypy_cache") -> tuple[int, str]:
    """(exit status, report) of mypy run from the checkout's root with its configuration."""
    config = str(ROOT / "pyproject.toml")
    arguments = ["--config-file", config, "--cache-dir", str(cache), *targets]
    report, errors, status = mypy_api.run(arguments)
    return status, report + errors


def test_cli_and_quant_type_check(monkeypatch):
    monkeypatch.chdir(ROOT)
    status, report = type_check()
    assert status == 0, report


def test_a_member_a_protocol_lacks_is_an_error(monkeypatch, tmp_path):
    """What the configuration must catch: a command calling what the Backend protocol does not
    declare (chat.py once called set_threads, which it lacked), in a function with annotations
    and in one without (check_untyped_defs)."""
    monkeypatch.chdir(ROOT)
    command = tmp_path / "uses_backend.py"
    command.write_text(
        "from cli.engine.backend import Backend\n\n\n"
        "def annotated(backend: Backend) -> None:\n"
        "    backend.set_threads(2)\n"
        "    backend.set_thread_count(2)\n\n\n"
        "def unannotated(backend):\n"
        "    held: Backend = backend\n"
        "    held.warm_up()\n"
    )
    # A cache of its own: mypy keeps a module's errors in its cache, with the path they had.
    status, report = type_check(str(command), cache=tmp_path / "cache")
    assert status == 1
    lines = [line for line in report.splitlines() if line.startswith(str(command))]
    assert len(lines) == 2, report
    assert '"Backend" has no attribute "set_thread_count"' in lines[0]
    assert '"Backend" has no attribute "warm_up"' in lines[1]
