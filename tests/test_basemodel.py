"""A base model (models.yaml `base: true`) is named as such by list, inspect and pull, and run and
chat warn before templating a chat for it; an instruction model gets none of it. A test registry
names the tiny random-weight model twice, once marked base, so nothing is downloaded."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from cli.app import app
from cli.store.models import Download, record
from cli.store.registry import parse_registry

from conftest import share_measurements

WARNING = "is a base model, not instruction-tuned"


def _entry(base: bool) -> dict:
    entry = {
        "description": "a tiny test model",
        "template": "chatml",
        "default_tag": "t",
        "tags": {"t": {"file": "tiny.gguf", "sources": [{"pypi": "nothing==1", "member": "x"}]}},
    }
    return {**entry, "base": True} if base else entry


@pytest.fixture
def home(tmp_path: Path, tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A quill home holding `basey:t` (marked base) and `chatty:t` (not), both the tiny model."""
    registry = parse_registry(
        {"default": "chatty", "models": {"basey": _entry(True), "chatty": _entry(False)}}, "test"
    )
    monkeypatch.setattr("cli.store.registry.load_registry", lambda path=None: registry)
    monkeypatch.setenv("QUILL_HOME", str(tmp_path))
    share_measurements(tmp_path)  # a pull predicts decode speed: measured once a session
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    for alias in ("basey", "chatty"):
        path = tmp_path / "models" / alias / "t" / "tiny.gguf"
        path.parent.mkdir(parents=True)
        shutil.copy(tiny_path, path)
        size = path.stat().st_size
        record(
            tmp_path, Download(str(path), f"{alias}:t", "pypi", None, "tiny.gguf", size, None, 0)
        )
    return tmp_path


def test_list_marks_the_base_model(runner, home):
    table = runner.invoke(app, ["list"])
    assert table.exit_code == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "QUANT", "KIND"]
    kinds = {row.split()[0]: row.split()[2] for row in rows}
    assert kinds == {"basey:t": "base", "chatty:t": "instruct"}
    listed = runner.invoke(app, ["list", "--json"])
    assert {m["name"]: m["kind"] for m in json.loads(listed.stdout)} == kinds


def test_inspect_names_a_base_model_only(runner, home):
    base = runner.invoke(app, ["inspect", "basey"])
    assert base.exit_code == 0, base.stderr
    kind_lines = [line for line in base.stdout.splitlines() if line.startswith("kind ")]
    assert len(kind_lines) == 1 and "base model, not instruction-tuned" in kind_lines[0]
    chat = runner.invoke(app, ["inspect", "chatty"])
    assert chat.exit_code == 0, chat.stderr
    assert "base model" not in chat.stdout
    assert json.loads(runner.invoke(app, ["inspect", "basey", "--json"]).stdout)["kind"] == "base"


def test_inspect_by_path_knows_the_registry_file(runner, home):
    """A path to a file a base entry names is that base model."""
    path = home / "models" / "basey" / "t" / "tiny.gguf"
    assert "base model" in runner.invoke(app, ["inspect", str(path)]).stdout


def test_pull_says_base_in_its_last_line(runner, home):
    base = runner.invoke(app, ["pull", "basey", "--offline"])
    assert base.exit_code == 0, base.stderr
    assert "base model" in base.stderr.strip().splitlines()[-1]
    chat = runner.invoke(app, ["pull", "chatty", "--offline"])
    assert chat.exit_code == 0, chat.stderr
    assert "base model" not in chat.stderr


def test_run_warns_once_for_a_base_model_with_the_chat_template(runner, home):
    args = ["run", "--temperature", "0", "-n", "4", "--no-stats", "-t", "1"]
    base = runner.invoke(app, [*args, "-m", "basey", "hello"])
    assert base.exit_code == 0, base.stderr
    warnings = [line for line in base.stderr.splitlines() if WARNING in line]
    assert len(warnings) == 1, base.stderr
    assert "--raw" in warnings[0] and "such as chatty" in warnings[0]
    raw = runner.invoke(app, [*args, "-m", "basey", "--raw", "hello"])
    assert raw.exit_code == 0, raw.stderr
    assert WARNING not in raw.stderr  # --raw is the way to use a base model
    chat = runner.invoke(app, [*args, "-m", "chatty", "hello"])
    assert chat.exit_code == 0, chat.stderr
    assert WARNING not in chat.stderr


def test_chat_warns_at_start_and_at_model_switch(runner, home):
    args = ["chat", "--temperature", "0", "-n", "4", "--no-stats", "-t", "1"]
    transcript = ["--transcript", str(home / f"chat-{time.monotonic_ns()}.json")]
    base = runner.invoke(app, [*args, *transcript, "-m", "basey"], input="hello\n")
    assert base.exit_code == 0, base.stderr
    assert sum(WARNING in line for line in base.stderr.splitlines()) == 1, base.stderr
    transcript = ["--transcript", str(home / f"chat-{time.monotonic_ns()}.json")]
    switched = runner.invoke(
        app, [*args, *transcript, "-m", "chatty"], input="hello\n/model basey\nhello\n"
    )
    assert switched.exit_code == 0, switched.stderr
    before, _, after = switched.stderr.partition("now chatting with basey")
    assert WARNING not in before and WARNING in after, switched.stderr
