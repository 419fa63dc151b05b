"""The physical limit in quill bench: the machine's read bandwidth (measured once, cached) and the
bytes a decode step reads, checked against the tensor tables as the gguf package reads them."""

from __future__ import annotations

import csv
import io
import json

import pytest
from gguf import GGUFReader

from cli.app import app
from cli.engine.hardware import cpu_model
from cli.measure import bandwidth
from cli.measure.bandwidth import (
    cache_path,
    kv_read_per_token,
    read_bandwidth,
    weights_read_per_token,
)
from quant.gguf import GGUFHeader, TensorInfo, read_header
from quant.memory import ModelShape

MIB = 1 << 20


def test_bandwidth_is_measured_once_then_read_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("QUILL_HOME", str(tmp_path))
    monkeypatch.setattr(bandwidth, "BUSY_SHARE", float("inf"))  # kept however busy the machine
    other = {"gb_per_s": 9.0, "threads": 7, "method": "another", "measured_on": "2026-01-02"}
    cache_path().write_text(json.dumps({f"{cpu_model()}, 7 threads": other}))
    first = read_bandwidth(2)
    assert first.gb_per_s > 0 and not first.cached and first.threads == 2
    kept = json.loads(cache_path().read_text())
    entry = kept[f"{cpu_model()}, 2 threads"]
    assert entry["method"] == first.method and "dot" in entry["method"]
    assert entry["gb_per_s"] == first.gb_per_s and entry["measured_on"] == first.measured_on
    again = read_bandwidth(2)
    assert again.cached and again.gb_per_s == first.gb_per_s
    # The second call took the file's number, not a new measurement.
    entry["gb_per_s"] = 123.0
    cache_path().write_text(json.dumps(kept))
    assert read_bandwidth(2).gb_per_s == 123.0
    # Another thread count is another measurement, kept beside this one.
    assert read_bandwidth(7).gb_per_s == 9.0 and read_bandwidth(7).method == "another"


def test_a_damaged_cache_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.setenv("QUILL_HOME", str(tmp_path))
    monkeypatch.setattr(bandwidth, "BUSY_SHARE", float("inf"))
    cache_path().write_text("[not the cache")
    assert not read_bandwidth(1).cached
    assert read_bandwidth(1).cached


def test_a_measurement_beside_busy_processes_is_not_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("QUILL_HOME", str(tmp_path))
    monkeypatch.setattr(bandwidth, "BUSY_SHARE", -1.0)  # any other work at all counts as busy
    measured = read_bandwidth(1)
    assert measured.gb_per_s > 0 and not cache_path().exists()
    assert "not kept, the next run measures again" in measured.describe()
    assert read_bandwidth(1) is measured  # measured once in a process, however many benches


def _tensor_bytes(path) -> dict[str, int]:
    return {tensor.name: int(tensor.n_bytes) for tensor in GGUFReader(path).tensors}


def test_tied_embeddings_are_read_whole(smollm2_path):
    sizes = _tensor_bytes(smollm2_path)
    assert "output.weight" not in sizes  # SmolLM2's output matrix is its token embeddings
    assert weights_read_per_token(read_header(smollm2_path)) == sum(sizes.values())


def test_a_separate_embedding_table_is_read_one_row_a_token(tiny_path):
    sizes = _tensor_bytes(tiny_path)
    n_vocab = len(GGUFReader(tiny_path).fields["tokenizer.ggml.tokens"].data)
    assert {"output.weight", "token_embd.weight"} <= set(sizes)
    row = sizes["token_embd.weight"] // n_vocab
    expected = sum(sizes.values()) - sizes["token_embd.weight"] + row
    assert weights_read_per_token(read_header(tiny_path)) == expected


def test_moe_tensors_count_only_the_routed_experts():
    def tensor(name: str, rows: int) -> TensorInfo:
        return TensorInfo(name, (64, rows), 0)  # F32: 4 bytes a value

    tensors = [tensor("blk.0.ffn_up_exps.weight", 8 * 32), tensor("blk.0.ffn_gate_inp.weight", 8)]
    fields = {"general.architecture": "qwen3moe"}
    fields |= {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2}
    header = GGUFHeader(3, fields, {}, tensors)
    assert weights_read_per_token(header) == 64 * 8 * 32 * 4 * 2 // 8 + 64 * 8 * 4


def test_kv_read_matches_llamas_own_cache_sizes(smollm2_path):
    # llama.cpp reports SmolLM2's KV cache at 4096 cells as f16 90.00 MiB, q8_0 47.81 MiB.
    shape = ModelShape.from_gguf(smollm2_path)
    assert kv_read_per_token(shape, 4096, "f16") == 90 * MIB
    assert kv_read_per_token(shape, 4096, "q8_0") == int(47.8125 * MIB)
    assert kv_read_per_token(shape, 0, "f16") == 0


def test_sliding_window_layers_read_only_their_window():
    layers = 6  # five windowed layers, then one full, as Gemma 3's pattern
    shape = ModelShape("gemma3", layers, (1,) * layers, 64, 64, 64, 10, 0, 0, 512)
    shape = ModelShape(**{**shape.__dict__, "swa_layers": (True,) * 5 + (False,)})
    per_layer_position = 2 * 64 * 2  # K and V, f16
    expected = per_layer_position * (2048 + 5 * 512)
    assert kv_read_per_token(shape, 2048, "f16") == expected


@pytest.fixture(scope="module")
def bench_json(tiny32_path):
    from typer.testing import CliRunner

    grid = ["-p", "8", "-n", "4", "-d", "0,16", "--kv-type", "f16,q8_0", "-t", "1", "-r", "1"]
    result = CliRunner().invoke(app, ["bench", str(tiny32_path), *grid, "--json"])
    assert result.exit_code == 0, result.stderr
    assert "memory read bandwidth with 1 threads:" in result.stderr
    return json.loads(result.stdout)


def test_bench_decode_rows_show_the_bytes_and_their_share_of_the_limit(bench_json, tiny32_path):
    header = read_header(tiny32_path)
    shape = ModelShape.from_header(header)
    tg = [row for row in bench_json["rows"] if row["test"] == "tg4"]
    assert len(tg) == 4
    for row in tg:
        limit = row["read_bandwidth"]
        assert limit["threads"] == 1 and "dot" in limit["method"] and limit["gb_per_s"] > 0
        kv = kv_read_per_token(shape, row["depth"] + 1 + 4 / 2, row["kv_type"])
        # same path: byte counts from the tensor table, not generated text
        assert row["bytes_per_token"] == weights_read_per_token(header) + kv
        gb = row["bytes_per_token"] * row["tokens_per_s"] / 1e9
        assert row["weights_kv_gb_per_s"] == pytest.approx(gb)
        assert 0 < row["bandwidth_share"] == pytest.approx(gb / limit["gb_per_s"])
    for row in bench_json["rows"]:
        if row["test"].startswith("pp"):
            assert row["bandwidth_share"] is None and row["weights_kv_gb_per_s"] is None


def test_csv_and_markdown_carry_the_new_columns(runner, tiny32_path):
    small = ["bench", str(tiny32_path), "-p", "0", "-n", "4", "-t", "1", "-r", "1"]
    rows = list(csv.DictReader(io.StringIO(runner.invoke(app, [*small, "--csv"]).stdout)))
    decode = next(row for row in rows if row["test"] == "tg4")
    assert float(decode["weights_kv_gb_per_s"]) > 0 and float(decode["bandwidth_share"]) > 0
    table = runner.invoke(app, [*small, "--markdown"]).stdout
    assert "| read GB/s | of limit |" in table.splitlines()[0]
    assert table.splitlines()[-1].endswith("% |")
