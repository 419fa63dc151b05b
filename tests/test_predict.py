"""Decode speed predicted from a header (cli/measure/predict.py): its calibration measured on
synthetic replicas by the real llama.cpp, once, kept, measured again when the CPU, the build or
the bandwidth changes and not kept beside busy processes; predictions that fall as the bytes a
token reads grow; quill bench's tg rows with the prediction beside the measurement.

The calibration's models are shrunk here (a few MB each, short rounds) so that a calibration
takes about a second: the rule is the same, the numbers are not worth keeping."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from dataclasses import asdict, replace

import pytest

from cli.app import app
from cli.engine.hardware import cpu_model
from cli.measure import predict
from cli.measure.bandwidth import Bandwidth, weights_read_per_token
from cli.measure.predict import (
    DecodeCalibration,
    Synthetic,
    cache_path,
    calibration_key,
    decode_calibration,
    predict_decode,
    weights_read_by_type,
)
from quant.gguf import GGUFHeader, TensorInfo, read_header

MEASURED = {"gb_per_s": 40.0, "threads": 1, "method": "a test's", "measured_on": "2026-12-03"}


@pytest.fixture
def small(monkeypatch, tmp_path):
    """A home of the test's own, its bandwidth known, and a calibration of small models; the
    synthetic models measured, by name, in measured."""
    monkeypatch.setenv("QUILL_HOME", str(tmp_path))
    monkeypatch.setattr(predict, "BUSY_SHARE", float("inf"))  # kept however busy the machine
    monkeypatch.setattr(predict, "AGAIN_BUSY", float("inf"))  # and each measurement taken once
    (tmp_path / "bandwidth.json").write_text(json.dumps({f"{cpu_model()}, 1 threads": MEASURED}))
    monkeypatch.setattr(predict, "wide_bytes", lambda: 2 << 20)
    monkeypatch.setattr(predict, "TOKENS", 4)
    monkeypatch.setattr(predict, "ROUNDS", 1)
    monkeypatch.setattr(predict, "ATTENTION_DEPTH", 32)
    monkeypatch.setattr(predict, "TINY_VOCAB", replace(predict.TINY_VOCAB, vocab=1024))
    monkeypatch.setattr(predict, "WIDE", replace(predict.WIDE, width=1024, ffn=1024, heads=16))
    monkeypatch.setattr(predict, "DEEP", replace(predict.DEEP, width=256, ffn=256, heads=4))
    measured: list[str] = []
    measure = predict.measure_synthetic

    def counted(cases, *args, **kwargs):
        measured.extend(f"{model.name} {model.weight_type}" for model, _ in cases)
        return measure(cases, *args, **kwargs)

    monkeypatch.setattr(predict, "measure_synthetic", counted)
    return measured


def test_a_calibration_is_measured_once_then_read_from_the_cache(small):
    first = decode_calibration(1, ["Q4_K"])
    assert first.seconds > 0 and first.kept and first.threads == 1
    assert small == [
        "tiny Q4_K", "tiny-vocab Q4_K", "deep Q4_K", "wide Q4_K", "attention Q4_K", "attention Q4_K"
    ]  # fmt: skip
    assert first.shares["Q4_K"] > 0 and first.per_layer_s["Q4_K"] >= 0
    assert first.bandwidth.gb_per_s == 40.0 and "calibrated now in" in first.describe()
    kept = json.loads(cache_path().read_text())[calibration_key(1)]
    assert kept["bandwidth_gb_per_s"] == 40.0 and set(kept["types"]) == {"Q4_K"}
    assert set(kept["attention_s"]) == {"f16"}
    again = decode_calibration(1, ["Q4_K"])
    assert len(small) == 6 and again.seconds == 0  # the second call measured nothing
    assert again.shares == first.shares and again.per_token_s == first.per_token_s
    assert f"calibrated {first.measured_on}, kept in {cache_path()}" in again.describe()
    # A type it has not met yet: that type's two models, and nothing else again.
    wider = decode_calibration(1, ["Q4_K", "Q8_0"], ["f16"])
    assert small[6:] == ["deep Q8_0", "wide Q8_0"] and set(wider.shares) == {"Q4_K", "Q8_0"}
    assert wider.per_token_s == first.per_token_s


def test_another_cpu_build_or_bandwidth_is_measured_again(small):
    decode_calibration(1)
    assert "llama-cpp-python" in calibration_key(1) and cpu_model() in calibration_key(1)
    known = json.loads(cache_path().read_text())
    # The file as another CPU (or another llama.cpp build) left it: its key is not ours.
    cache_path().write_text(
        json.dumps({"Another CPU, 1 threads, llama": known[calibration_key(1)]})
    )
    count = len(small)
    assert decode_calibration(1).seconds > 0 and len(small) == 2 * count
    assert set(json.loads(cache_path().read_text())) == {"Another CPU, 1 threads, llama",
                                                         calibration_key(1)}  # fmt: skip
    # The bandwidth measured again (bandwidth.json deleted, say): the shares were of the old one.
    measured = {**MEASURED, "gb_per_s": 30.0}
    (cache_path().parent / "bandwidth.json").write_text(
        json.dumps({f"{cpu_model()}, 1 threads": measured})
    )
    again = decode_calibration(1)
    assert again.seconds > 0 and again.bandwidth.gb_per_s == 30.0 and len(small) == 3 * count


def test_a_calibration_beside_busy_processes_is_not_kept(small, monkeypatch):
    monkeypatch.setattr(predict, "BUSY_SHARE", -1.0)  # any other work at all counts as busy
    monkeypatch.setattr(predict, "AGAIN_BUSY", -1.0)
    busy = decode_calibration(1)
    assert busy.seconds > 0 and not busy.kept and not cache_path().exists()
    assert "not kept, the next run measures again" in busy.describe()
    # Each measurement was taken again, ATTEMPTS times in all, before it was used.
    assert small[:6] == ["tiny Q4_K", "tiny-vocab Q4_K"] * predict.ATTEMPTS
    count = len(small)
    reused = decode_calibration(1)  # once a run: the same terms, said again to be busy ones
    assert len(small) == count and reused.shares == busy.shares and not reused.kept


def test_two_processes_that_need_the_terms_at_once_measure_them_once(small):
    """The second waits for the first's measurement and reads what it kept, instead of
    measuring beside it (each slowing the other's models: two pulls at once took 33 s each
    and kept neither, as measured busy)."""
    results: list[DecodeCalibration] = []
    both = [
        threading.Thread(target=lambda: results.append(decode_calibration(1, ["Q4_K"])))
        for _ in range(2)
    ]
    for thread in both:
        thread.start()
    for thread in both:
        thread.join()
    assert sorted(result.seconds > 0 for result in results) == [False, True]
    assert len(small) == 6 and results[0].shares == results[1].shares


def synthetic_header(model: Synthetic) -> GGUFHeader:
    """The header of model as llama.cpp would read it (tokens counted, not listed)."""
    kind = predict.type_id(model.weight_type)
    tensors = [
        TensorInfo(name, (cols, rows), kind) if cols else TensorInfo(name, (rows,), 0)
        for name, rows, cols in model.tensors()
    ]
    fields = {
        "general.architecture": "llama",
        "llama.block_count": model.layers,
        "llama.embedding_length": model.width,
        "llama.attention.head_count": model.heads,
        "llama.attention.head_count_kv": model.kv_heads,
    }
    return GGUFHeader(3, fields, {"tokenizer.ggml.tokens": model.vocab}, tensors)


CALIBRATION = DecodeCalibration(
    threads=2,
    build="a build",
    bandwidth=Bandwidth(40.0, 2, "a test's", "2026-12-03"),
    per_token_s=1e-4,
    per_vocab_entry_s=3e-9,
    shares={"Q4_K": 0.9, "Q6_K": 0.9, "Q8_0": 0.9, "F16": 0.9, "F32": 0.9},
    per_layer_s={"Q4_K": 5e-5, "Q6_K": 5e-5, "Q8_0": 5e-5, "F16": 5e-5, "F32": 5e-5},
    attention_s={"f16": 1e-8, "q8_0": 1.2e-8},
    measured_on="2026-12-03",
)
MODEL = Synthetic("model", layers=16, width=2048, ffn=8192, heads=32, kv_heads=8, vocab=128256)


def test_more_bytes_a_token_predict_fewer_tokens():
    """A bigger quantization of one shape, more layers, a deeper cache: each reads more bytes a
    token, and each is predicted slower."""
    speeds = []
    for kind in ("Q4_K", "Q6_K", "Q8_0", "F16", "F32"):
        header = synthetic_header(replace(MODEL, weight_type=kind))
        speeds.append(predict_decode(header, 2, 0, "f16", CALIBRATION))
    assert [p.bytes_per_token for p in speeds] == sorted(p.bytes_per_token for p in speeds)
    rates = [p.tokens_per_s for p in speeds]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == 5
    header = synthetic_header(MODEL)
    deeper = [predict_decode(header, 2, depth, "f16", CALIBRATION) for depth in (0, 1024, 8192)]
    assert [p.kv_bytes for p in deeper] == sorted(p.kv_bytes for p in deeper)
    assert deeper[0].tokens_per_s > deeper[1].tokens_per_s > deeper[2].tokens_per_s
    more = synthetic_header(replace(MODEL, layers=32))
    assert predict_decode(more, 2, calibration=CALIBRATION).tokens_per_s < speeds[0].tokens_per_s
    # The rule itself: the bytes at their shares of B, the layers, the call, attention.
    q4 = speeds[0]
    read = (q4.bytes_per_token - q4.bytes_by_type["vectors"]) / (40e9 * 0.9)
    read += q4.bytes_by_type["vectors"] / 40e9
    assert math.isclose(q4.read_s, read)
    assert math.isclose(q4.overhead_s, 1e-4 + 16 * 5e-5 + 128256 * 3e-9)
    assert math.isclose(q4.seconds_per_token, q4.read_s + q4.overhead_s + q4.attention_s)


def test_a_type_it_could_not_calibrate_takes_q4_ks_terms():
    header = synthetic_header(replace(MODEL, weight_type="Q5_K"))
    guessed = predict_decode(header, 2, 0, "f16", CALIBRATION)
    assert guessed.uncalibrated == ("Q5_K",) and guessed.shares == {"Q5_K": 0.9}


def test_the_bytes_by_type_add_up_to_the_bytes_a_token_reads(tiny_path):
    header = read_header(tiny_path)
    by_type = weights_read_by_type(header)
    assert set(by_type) == {"F16", "F32", "vectors"}  # the tiny model's tables, matrices, norms
    assert sum(by_type.values()) == weights_read_per_token(header)
    tied = synthetic_header(MODEL)  # no output.weight: the token table is read whole
    assert sum(weights_read_by_type(tied).values()) == weights_read_per_token(tied)
    experts = [TensorInfo("blk.0.ffn_up_exps.weight", (64, 8 * 32), 0)]
    experts.append(TensorInfo("blk.0.ffn_gate_inp.weight", (64, 8), 1))
    fields = {"general.architecture": "qwen3moe"}
    fields |= {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2}
    moe = GGUFHeader(3, fields, {}, experts)
    assert weights_read_by_type(moe) == {"F32": 64 * 8 * 32 * 4 * 2 // 8, "F16": 64 * 8 * 2}


def test_the_prediction_as_json():
    prediction = predict_decode(synthetic_header(MODEL), 2, 33.0, "q8_0", CALIBRATION)
    data = json.loads(json.dumps(prediction.as_dict()))
    assert data["tokens_per_s"] == prediction.tokens_per_s > 0
    assert data["bytes_by_type"].keys() == {"Q4_K", "vectors"}
    assert (data["depth"], data["kv_type"], data["threads"]) == (33.0, "q8_0", 2)
    assert data["limited_by"] == "memory" and data["bandwidth_gb_per_s"] == 40.0
    line = prediction.describe()
    assert (
        line.startswith(f"predicted decode {prediction.tokens_per_s:.1f} tok/s")
        and "\n" not in line
    )


def test_importing_and_predicting_load_no_llama_cpp(tmp_path, tiny_path):
    """Until a calibration runs: `quill pull` predicts for every file of a repository."""
    (tmp_path / "calibrated.json").write_text(json.dumps(asdict(CALIBRATION)))
    code = (
        "import json, sys\n"
        "from cli.measure.bandwidth import Bandwidth\n"
        "from cli.measure.predict import DecodeCalibration, predict_decode\n"
        "from quant.gguf import read_header\n"
        f"known = json.loads(open({str(tmp_path / 'calibrated.json')!r}).read())\n"
        "known['bandwidth'] = Bandwidth(**known['bandwidth'])\n"
        f"header = read_header({str(tiny_path)!r})\n"
        "predict_decode(header, 2, calibration=DecodeCalibration(**known))\n"
        "print(sorted(m for m in ('llama_cpp', 'numpy', 'gguf') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_bench_predicts_each_tg_row_and_says_how(small, runner, tiny_path):
    grid = [str(tiny_path), "-p", "8", "-n", "4", "-d", "0,16", "-t", "1", "-r", "1"]
    result = runner.invoke(app, ["bench", *grid, "--predict", "--json"])
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    for row in rows:
        if row["test"].startswith("pp"):
            assert row["predicted_tokens_per_s"] is None and row["prediction"] is None
            continue
        assert row["predicted_tokens_per_s"] > 0 and row["prediction"]["kv_type"] == "f16"
        ratio = row["tokens_per_s"] / row["predicted_tokens_per_s"]
        assert math.isclose(row["measured_over_predicted"], ratio)
        assert row["prediction"]["depth"] == row["depth"] + 1 + 4 / 2
        assert row["calibration"]["threads"] == 1 and "F32" in row["calibration"]["shares"]
    assert "decode prediction with 1 threads:" in result.stderr
    assert "tg4 @ depth 0, f16, 1 threads, batch 25: " in result.stderr
    assert "predicted " in result.stderr and "(measured/predicted " in result.stderr
    table = runner.invoke(app, ["bench", *grid, "--predict"])
    header = table.stdout.splitlines()[0].split()
    assert header[-2:] == ["predicted", "measured/pred"]
    plain = runner.invoke(app, ["bench", *grid, "--replica", "--no-predict", "--markdown"])
    assert plain.exit_code == 0 and "predicted" not in plain.stdout + plain.stderr
