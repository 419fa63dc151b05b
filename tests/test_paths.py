"""The path table (cli/measure/paths.py): each repackable weight type's prefill and decode speed
repacked and plain, measured by the real llama.cpp on a synthetic model, once per CPU, threads
and build, kept, measured again when the key changes, not kept beside busy processes; the
choice it makes for a load's work; loads that keep a type plain; `quill run`, `quill bench` and
`quill bench --paths` through the CLI runner.

The synthetic models are shrunk here (a few MB, short rounds) so that a measurement takes about
a second: the rule is the same, the numbers are not worth keeping."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import httpx2 as httpx
import pytest
from typer.testing import CliRunner

from cli.app import app
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from cli.errors import ModelLoadError
from cli.measure import paths, predict
from cli.measure.paths import (
    PathTable,
    TypePaths,
    Workload,
    cache_path,
    choose,
    path_table,
    repackable_types,
    table_key,
)
from quant.quantize import quantize

from conftest import start_server
from neartie import assert_near
from reference import Reference

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def small(monkeypatch, tmp_path):
    """A home of the test's own and small measurements; the types measured, in order."""
    monkeypatch.setenv("QUILL_HOME", str(tmp_path))
    monkeypatch.setattr(paths, "BUSY_SHARE", float("inf"))  # kept however busy the machine
    monkeypatch.setattr(paths, "AGAIN_BUSY", float("inf"))  # and each measurement taken once
    monkeypatch.setattr(paths, "wide_bytes", lambda: 2 << 20)
    monkeypatch.setattr(paths, "WIDE", replace(paths.WIDE, width=1024, ffn=1024, heads=16))
    monkeypatch.setattr(paths, "PREFILL_TOKENS", 32)
    monkeypatch.setattr(paths, "DECODE_TOKENS", 4)
    monkeypatch.setattr(paths, "ROUNDS", 1)
    measured: list[str] = []
    measure = paths.measure_type

    def counted(kind, threads):
        measured.append(kind)
        return measure(kind, threads)

    monkeypatch.setattr(paths, "measure_type", counted)
    return measured


def q4_0_repackable() -> None:
    if not repackable_types([("Q4_0", 4096)]):
        pytest.skip("this CPU's llama.cpp build has no repacked Q4_0 layout")


def test_the_table_is_measured_once_then_read_from_the_cache(small):
    q4_0_repackable()
    first = path_table(1, {"Q4_0"})
    assert small == ["Q4_0"] and first.seconds > 0 and first.kept
    measured = first.types["Q4_0"]
    assert measured.layout.startswith("q4_0_")
    for speeds in (measured.prefill_tokens_per_s, measured.decode_tokens_per_s):
        assert set(speeds) == {"repacked", "plain"} and min(speeds.values()) > 0
    kept = json.loads(cache_path().read_text())[table_key(1)]
    assert TypePaths.from_dict(kept["Q4_0"]) == measured
    again = path_table(1, {"Q4_0"})
    assert small == ["Q4_0"] and again.seconds == 0 and again.types == first.types
    # A type it cannot repack here is not measured: there is nothing to choose.
    assert path_table(1, set()).types == first.types and small == ["Q4_0"]


def test_another_build_cpu_or_thread_count_is_measured_again(small, monkeypatch):
    q4_0_repackable()
    path_table(1, {"Q4_0"})
    key = table_key(1)
    assert "llama-cpp-python" in key and "features" in key and "1 threads" in key
    path_table(2, {"Q4_0"})  # another thread count: its own entry
    assert small == ["Q4_0", "Q4_0"]
    monkeypatch.setattr(predict, "llama_build", lambda: "llama-cpp-python 9.9.9 (rebuilt)")
    assert table_key(1) != key
    assert path_table(1, {"Q4_0"}).seconds > 0 and small == ["Q4_0"] * 3
    assert len(json.loads(cache_path().read_text())) == 3  # the old entries stay for the old build


def test_a_table_measured_beside_busy_processes_is_not_kept(small, monkeypatch):
    q4_0_repackable()
    monkeypatch.setattr(paths, "BUSY_SHARE", -1.0)  # any other work at all counts as busy
    monkeypatch.setattr(paths, "AGAIN_BUSY", -1.0)
    busy = path_table(1, {"Q4_0"})
    assert busy.seconds > 0 and not busy.kept and not cache_path().exists()
    assert "not kept" in busy.describe()
    reused = path_table(1, {"Q4_0"})  # used again by this process, not measured again
    assert small == ["Q4_0"] and reused.types == busy.types


def speeds(prefill_plain: float, decode_plain: float) -> TypePaths:
    """A type whose repacked kernels run 100 tok/s prefill and 20 tok/s decode."""
    return TypePaths(
        "Q4_K", "q4_K_8x8", {"repacked": 100.0, "plain": prefill_plain},
        {"repacked": 20.0, "plain": decode_plain},
    )  # fmt: skip


def test_the_choice_weighs_prefill_and_decode_by_the_work():
    # Zen 4's Q4_K: plain prefill 1.7x faster, repacked decode 5% faster.
    zen4 = PathTable(2, "key", {"Q4_K": speeds(170.0, 19.0)})
    long_prompt = Workload("a long prompt", 4000, 200)
    short_prompt = Workload("a short prompt", 20, 500)
    assert choose({"Q4_K"}, zen4, long_prompt).plain == ("Q4_K",)
    assert choose({"Q4_K"}, zen4, short_prompt).repacked == ("Q4_K",)
    # Where plain loses both ways, it is never chosen; where it wins both, always.
    assert (
        choose({"Q4_K"}, PathTable(2, "k", {"Q4_K": speeds(90.0, 19.0)}), long_prompt).plain == ()
    )
    faster = PathTable(2, "k", {"Q4_K": speeds(120.0, 21.0)})
    assert choose({"Q4_K"}, faster, short_prompt).plain == ("Q4_K",)
    # A type the table lacks is repacked, as llama.cpp would; on and off override the table.
    assert choose({"Q4_0"}, zen4, long_prompt).placement == (("Q4_0", "repacked"),)
    assert choose({"Q4_K"}, zen4, long_prompt, "on").placement == (("Q4_K", "repacked"),)
    assert choose({"Q4_K"}, zen4, short_prompt, "off").placement == (("Q4_K", "plain"),)
    assert choose({"Q4_K"}, zen4, long_prompt).why == "the path table, for a long prompt"
    assert zen4.types["Q4_K"].faster("prefill") == ("plain", pytest.approx(1.7))
    assert Workload.of_run("x" * 400, 64).prompt_tokens == 100 + paths.TEMPLATE_TOKENS


@pytest.fixture(scope="module")
def smollm2_q4_0(smollm2_f16, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("q4_0") / "smollm2-q4_0.gguf"
    quantize(Path(smollm2_f16["output"]), target, "q4_0", threads=2)
    return target


def test_a_type_kept_plain_is_not_repacked_and_writes_the_same_text(
    smollm2_q4_0, smollm2_path, capsys
):
    """Both placements of SmolLM2 in Q4_0: the plain one's matrices never reach CPU_REPACK, and
    the two greedy texts are this machine's (the near-tie comparator)."""
    q4_0_repackable()
    texts, logs, described = {}, {}, {}
    for where in ("plain", "repacked"):
        options = LoadOptions(threads=2, n_ctx=256, placement=(("Q4_0", where),))
        with Engine(smollm2_q4_0, options, verbose=True) as engine:
            prompt = engine.tokenize("The sea is")
            texts[where] = "".join(e.text for e in engine.stream_generate(prompt, 24, GREEDY))
            assert engine.weights_placement == f"Q4_0 {where}"
            # same path: what the load did, not a text
            assert engine.cpu_path.kept_plain == (("Q4_0",) if where == "plain" else ())
            described[where] = engine.cpu_path.describe()
        logs[where] = capsys.readouterr().err
    assert "repack tensor" not in logs["plain"] and "repack tensor" in logs["repacked"]
    assert "Q4_0 kept plain" in described["plain"] and "plain" not in described["repacked"]
    reference = Reference(smollm2_q4_0, n_ctx=256)
    try:
        assert_near(reference, reference.tokenize("The sea is", add_special=True), *texts.values())
    finally:
        reference.close()


def seeded_table(threads: int, prefill_plain: float, decode_plain: float) -> None:
    """paths.json holding this machine's key with Q4_0's speeds as given (repacked: 100 tok/s
    prefill, 20 decode): the CLI then chooses from it without measuring."""
    table = {"Q4_0": {**speeds(prefill_plain, decode_plain).as_dict(), "weight_type": "Q4_0"}}
    cache_path().parent.mkdir(parents=True, exist_ok=True)
    cache_path().write_text(json.dumps({table_key(threads): table}))


def run_json(*args: str) -> tuple[dict, str]:
    result = CliRunner().invoke(app, ["run", "--json", "--threads", "1", "-n", "4", *args])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_run_places_the_weights_for_its_prompt_and_says_so(smollm2_q4_0, tmp_path, monkeypatch):
    q4_0_repackable()
    monkeypatch.setenv("QUILL_HOME", str(tmp_path))
    model = str(smollm2_q4_0)
    seeded_table(1, prefill_plain=170.0, decode_plain=19.0)  # plain: prefill; repacked: decode
    long_prompt = "Tell me about the sea. " * 60  # about 350 tokens in, 4 out: plain
    reply, said = run_json(model, long_prompt)
    assert reply["weights"] == "Q4_0 plain" and "measuring" not in said
    reply, _ = run_json(model, "Hi", "-n", "400")  # a few tokens in, up to 400 out: repacked
    assert reply["weights"] == "Q4_0 repacked"
    reply, _ = run_json(model, long_prompt, "--repack", "on")
    assert reply["weights"] == "Q4_0 repacked"
    result = CliRunner().invoke(app, ["run", model, "Hi", "-n", "2", "--repack", "off"])
    assert result.exit_code == 0 and re.search(r"· weights Q4_0 plain\b", result.stderr)
    result = CliRunner().invoke(app, ["run", model, "Hi", "--repack", "sometimes"])
    assert result.exit_code == 2 and "--repack takes auto, on or off" in result.stderr


def test_a_first_run_measures_the_table_and_says_so_before_the_reply(
    small, smollm2_q4_0, monkeypatch
):
    q4_0_repackable()
    reply, said = run_json(str(smollm2_q4_0), "Hi")
    assert small == ["Q4_0"] and reply["weights"] in ("Q4_0 plain", "Q4_0 repacked")
    assert "measuring this CPU's repacked and plain kernels for Q4_0" in said
    assert "quill bench --paths shows the table" in said
    _, said = run_json(str(smollm2_q4_0), "Hi")
    assert small == ["Q4_0"] and "measuring" not in said


def test_bench_paths_shows_the_table(small):
    q4_0_repackable()
    result = CliRunner().invoke(app, ["bench", "--paths", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    rows = {row["weight_type"]: row for row in shown["types"]}
    assert set(rows) == set(paths.TABLE_TYPES) and shown["threads"] == 1
    assert rows["Q4_0"]["layout"].startswith("q4_0_")
    assert rows["Q4_0"]["prefill_faster"]["placement"] in ("repacked", "plain")
    assert rows["F16"]["layout"] is None and "no repacked layout" in rows["F16"]["one_path"]
    measured = set(small)
    table = CliRunner().invoke(app, ["bench", "--paths", "--threads", "1", "--markdown"])
    assert table.exit_code == 0 and set(small) == measured  # the second time from the cache
    assert "| Q4_0 | q4_0_" in table.stdout and "no repacked layout" in table.stdout


def test_bench_places_each_row_for_its_own_work(smollm2_q4_0, tmp_path, monkeypatch):
    """pp rows placed for a prompt, tg rows for generation: two loads where the table says the
    two differ, each row naming its path."""
    q4_0_repackable()
    monkeypatch.setenv("QUILL_HOME", str(tmp_path))
    seeded_table(1, prefill_plain=170.0, decode_plain=19.0)
    args = ["bench", str(smollm2_q4_0), "-p", "32", "-n", "4", "-r", "1", "-t", "1", "--json"]
    result = CliRunner().invoke(app, [*args, "--no-predict"])
    assert result.exit_code == 0, result.stderr
    rows = {row["test"]: row for row in json.loads(result.stdout)["rows"]}
    assert "Q4_0 plain" in rows["pp32"]["cpu_path"] and "plain" not in rows["tg4"]["cpu_path"]
    result = CliRunner().invoke(app, [*args, "--repack", "auto,off", "--no-predict"])
    assert result.exit_code == 0, result.stderr
    assert len(json.loads(result.stdout)["rows"]) == 4


def test_chat_and_serve_take_repack(smollm2_q4_0, tmp_path, monkeypatch, quill_home):
    """chat --repack off: each turn's line says the type ran plain; serve --repack on: the load
    line says it ran repacked, and the server answers."""
    q4_0_repackable()
    model = str(smollm2_q4_0)
    args = ["chat", model, "--repack", "off", "-n", "2", "--seed", "1", "--threads", "1"]
    result = CliRunner().invoke(app, args, input="Hi\n")
    assert result.exit_code == 0, result.stderr
    assert "· weights Q4_0 plain" in result.stderr
    process, url = start_server(quill_home, tmp_path, model, "--repack", "on", "--threads", "1")
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200
    finally:
        process.terminate()
        said = process.communicate(timeout=30)[1]
    assert "weights Q4_0 repacked (--repack on)" in said


def test_bench_measures_a_missing_table_before_its_rows_and_says_so(small, smollm2_q4_0):
    q4_0_repackable()
    args = ["bench", str(smollm2_q4_0), "-p", "8", "-n", "2", "-r", "1", "-t", "1"]
    result = CliRunner().invoke(app, [*args, "--no-predict", "--json"])
    assert result.exit_code == 0, result.stderr
    said = result.stderr
    measuring = said.index("measuring this CPU's repacked and plain kernels for Q4_0")
    assert measuring < said.index("pp8 @ depth 0") and small == ["Q4_0"]


def test_a_damaged_table_is_measured_again_and_a_failed_measurement_falls_back(small, monkeypatch):
    """paths.json edited by hand or cut short: its bad entries are measured again, never divided
    by; a measurement llama.cpp cannot make leaves the type to llama.cpp's rule."""
    q4_0_repackable()
    key = table_key(1)
    good = speeds(170.0, 19.0).as_dict()
    bad = {"Q4_0": {**good, "prefill_tokens_per_s": {"repacked": 0, "plain": 1}}}
    for damaged in ("{not json", json.dumps({key: bad}), json.dumps({key: {"Q4_0": "fast"}})):
        cache_path().parent.mkdir(parents=True, exist_ok=True)
        cache_path().write_text(damaged)
        table = path_table(1, {"Q4_0"})
        assert min(table.types["Q4_0"].prefill_tokens_per_s.values()) > 0
    assert small == ["Q4_0"] * 3

    def fails(kind, threads):
        raise ModelLoadError("llama.cpp cannot load the synthetic model")

    cache_path().unlink()
    monkeypatch.setattr(paths, "measure_type", fails)
    table = path_table(1, {"Q4_0"})
    assert table.types == {} and table.unmade == ("Q4_0",)
    assert choose({"Q4_0"}, table, Workload("long", 5000, 1)).repacked == ("Q4_0",)
