"""quill perplexity and quill quant-report on real models: quantization's cost, measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app
from cli.commands.quality import report_files

from conftest import PPL_TEXT
from reference import Reference


def ppl_json(runner: CliRunner, name: str, window: int = 256, windows: int = 6) -> dict:
    args = ["-f", str(PPL_TEXT), "--ctx", str(window), "--chunks", str(windows), "--json"]
    result = runner.invoke(app, ["perplexity", name, *args])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def smollm2_quants(smollm2_f16, quill_home) -> dict[str, dict]:
    made = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUILL_HOME", str(quill_home))
        patch.setenv("HF_HUB_OFFLINE", "1")
        for to in ("q8_0", "q4_0"):
            result = CliRunner().invoke(
                app, ["quantize", "smollm2-135m:f16", "--to", to, "--force", "--json"]
            )
            assert result.exit_code == 0, result.stderr
            made[to] = json.loads(result.stdout)
    return made


def test_q8_0_costs_under_one_percent_and_q4_0_costs_more(runner, smollm2_quants):
    f16 = ppl_json(runner, "smollm2-135m:f16")
    q8 = ppl_json(runner, "smollm2-135m:q8_0")
    q4 = ppl_json(runner, "smollm2-135m:q4_0")
    assert f16["tokens_scored"] == q8["tokens_scored"] == 6 * (128 - 1)
    assert 5 < f16["perplexity"] < 100  # a real model on English text, not noise (~49k vocab)
    assert abs(q8["perplexity"] / f16["perplexity"] - 1) < 0.01
    assert q4["perplexity"] > q8["perplexity"]
    assert 0 < f16["perplexity_error"] < f16["perplexity"] / 4


def test_perplexity_matches_an_independent_computation(runner, smollm2_f16):
    """The reference decoder feeds one token at a time and we take softmax in plain Python:
    the same windows and scoring rule must give the same perplexity.

    On F16 weights one-token and many-token matmuls agree to ~0.1 in the logits; on Q4_1 they
    differ by up to 2.5 (llama.cpp takes other kernels for batches), so F16 is compared here.
    """
    window, windows = 64, 2
    path = Path(smollm2_f16["output"])
    quill = ppl_json(runner, str(path), window, windows)
    reference = Reference(path, n_ctx=window)
    try:
        tokens = reference.tokenize(PPL_TEXT.read_text(), add_special=True)
        nll = []
        for index in range(windows):
            chunk = tokens[index * window : (index + 1) * window]
            logits = reference.step_logits(chunk)
            for position in range(window // 2, window - 1):
                row = [float(v) for v in logits[position]]
                peak = max(row)
                log_sum = peak + math.log(sum(math.exp(v - peak) for v in row))
                nll.append(log_sum - row[chunk[position + 1]])
    finally:
        reference.close()
    assert quill["tokens_scored"] == len(nll)
    assert quill["perplexity"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=5e-3)


def test_bad_inputs_get_one_line_and_exit_2(runner, smollm2_path, tmp_path):
    missing = runner.invoke(app, ["perplexity", "smollm2-135m", "-f", str(tmp_path / "nope.txt")])
    assert missing.exit_code == 2 and "cannot read" in missing.stderr
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.")
    too_short = runner.invoke(app, ["perplexity", "smollm2-135m", "-f", str(short)])
    assert too_short.exit_code == 2 and "needs at least 1024" in too_short.stderr
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\xff\xfe\x00binary")
    not_text = runner.invoke(app, ["perplexity", "smollm2-135m", "-f", str(binary)])
    assert not_text.exit_code == 2 and "not UTF-8" in not_text.stderr
    wide = runner.invoke(app, ["perplexity", "smollm2-135m", "-f", str(PPL_TEXT), "-c", "99999"])
    assert wide.exit_code == 2 and "8192 positions the model was trained for" in wide.stderr
    for result in (missing, too_short, not_text, wide):
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_quant_report_on_the_tiny_model(runner, tiny32_path):
    result = runner.invoke(
        app,
        [
            "quant-report", str(tiny32_path), "-f", str(PPL_TEXT), "--types", "f16,q8_0,q4_0",
            "--kv-types", "f16,q8_0", "--ctx", "128", "--chunks", "2", "-p", "32", "-n", "4",
            "-r", "1", "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    rows = {(row["weights"], row["kv_type"]): row for row in report["rows"]}
    assert list(rows) == [(w, k) for w in ("f16", "q8_0", "q4_0") for k in ("f16", "q8_0")]
    assert rows["f16", "f16"]["perplexity_change_pct"] == 0
    assert rows["q4_0", "f16"]["file_bytes"] < rows["q8_0", "f16"]["file_bytes"]
    assert rows["q8_0", "f16"]["file_bytes"] < rows["f16", "f16"]["file_bytes"]
    # q8_0 stores 34 bytes per 32 values, f16 64: the KV column is the plan's arithmetic.
    assert rows["f16", "q8_0"]["kv_bytes"] * 64 == rows["f16", "f16"]["kv_bytes"] * 34
    for row in rows.values():
        assert row["perplexity"] > 1 and row["prefill_tokens_per_s"] > 0
        assert row["decode_tokens_per_s"] > 0 and row["tokens_scored"] == 2 * 63


def test_quant_report_speeds_carry_their_spread_and_threads(runner, tiny32_path):
    """Like bench: each speed is a mean ± its spread over -r rounds, with the threads used."""
    args = [
        "quant-report", str(tiny32_path), "-f", str(PPL_TEXT), "--types", "f16,q8_0",
        "--kv-types", "f16", "--ctx", "128", "--chunks", "1", "-p", "32", "-n", "4", "-r", "3",
    ]  # fmt: skip
    as_json = runner.invoke(app, [*args, "-t", "1", "--json"])
    assert as_json.exit_code == 0, as_json.stderr
    # Three timed rounds never take the same nanoseconds, so the spread is above 0; the sample
    # SD of three positive speeds stays under sqrt(3) times their mean however unequal they are
    # (a round preempted on a busy machine can be far off the others), while a variance, or a
    # spread in other units, would not.
    for row in json.loads(as_json.stdout)["rows"]:
        assert row["threads"] == 1
        for speed in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            assert 0 < row[f"{speed}_sd"] < math.sqrt(3) * row[speed]
    table = runner.invoke(app, [*args, "--markdown"])
    lines = table.stdout.splitlines()
    headers = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert headers[5:8] == ["threads", "prefill tok/s", "decode tok/s"]
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert int(cells[5]) >= 1 and " ± " in cells[6] and " ± " in cells[7]


def test_quant_report_leaves_the_users_own_quantized_files(runner, tiny32_path, tmp_path):
    """The user quantized the model to q8_0 beside it; a report over q8_0 makes its own file."""
    source = tmp_path / "tiny32.gguf"
    source.write_bytes(tiny32_path.read_bytes())
    mine = tmp_path / "tiny32-q8_0.gguf"
    made = runner.invoke(app, ["quantize", str(source), "--to", "q8_0", "-o", str(mine)])
    assert made.exit_code == 0, made.stderr
    before = mine.read_bytes()
    mine.write_bytes(before + b"the user's own bytes")  # a file the report must not replace
    result = runner.invoke(
        app,
        ["quant-report", str(source), "-f", str(PPL_TEXT), "--types", "f16,q8_0",
         "--kv-types", "f16", "--ctx", "64", "--chunks", "1", "-p", "8", "-n", "2", "-r", "1",
         "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert mine.read_bytes() == before + b"the user's own bytes"
    assert (report_files() / "tiny32-q8_0.gguf").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny32-q8_0.gguf", "tiny32.gguf"]
