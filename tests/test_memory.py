"""The memory plan against what llama.cpp really allocates, on SmolLM2 and on Gemma 3 (whose
sliding-window layers make it a case of its own)."""

from __future__ import annotations

import json
import re
import time

import pytest

from cli.app import app
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from quant.gguf import GGUFError, GGUFHeader
from quant.memory import ModelShape, largest_context, parse_size, plan


def allocated(log: str) -> dict[str, float]:
    """What llama.cpp reported allocating, in MiB."""
    kv = sum(float(x) for x in re.findall(r"llama_kv_cache: size =\s+([\d.]+) MiB", log))
    compute = re.search(r"CPU compute buffer size =\s+([\d.]+) MiB", log)
    output = re.search(r"CPU\s+output buffer size =\s+([\d.]+) MiB", log)
    assert kv and compute and output, log[-2000:]
    return {"kv": kv, "compute": float(compute.group(1)), "output": float(output.group(1))}


@pytest.mark.parametrize("model", ["smollm2", "gemma"])
@pytest.mark.parametrize("cache_type", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("n_ctx", [700, 4096])
def test_plan_matches_llama_cpps_allocation(
    model, cache_type, n_ctx, smollm2_path, gemma_path, capsys
):
    path = smollm2_path if model == "smollm2" else gemma_path
    memory = plan(ModelShape.from_gguf(path), n_ctx, cache_type)
    options = LoadOptions(n_ctx=n_ctx, threads=2, kv_type_k=cache_type, kv_type_v=cache_type)
    with Engine(path, options, verbose=True) as engine:
        assert engine.n_ctx == memory.n_ctx  # the same rounding
    real = allocated(capsys.readouterr().err)
    assert memory.kv_bytes / 2**20 == pytest.approx(real["kv"], rel=0.01, abs=0.005)
    assert memory.compute_bytes / 2**20 == pytest.approx(real["compute"], rel=0.05)  # an estimate
    assert memory.output_bytes / 2**20 == pytest.approx(real["output"], rel=0.01, abs=0.005)


def test_gemma_sliding_window_layers(gemma_path):
    shape = ModelShape.from_gguf(gemma_path)
    assert shape.sliding_window == 512
    assert sum(shape.swa_layers) == 15 and not shape.swa_layers[5]  # every sixth layer is global
    memory = plan(shape, 8192)
    # Windowed, 15 of 18 layers would keep 1024 cells (window 512 + one batch of 512).
    assert memory.kv_bytes_windowed == pytest.approx(
        memory.kv_bytes * (3 / 18 + 15 / 18 * 1024 / 8192)
    )


def test_largest_context_fits_and_one_step_more_does_not(smollm2_path):
    shape = ModelShape.from_gguf(smollm2_path)
    budget = parse_size("300MiB")
    largest = largest_context(shape, budget)
    assert largest % 256 == 0 and 0 < largest < shape.trained_ctx
    assert plan(shape, largest).total_bytes <= budget < plan(shape, largest + 256).total_bytes
    assert largest_context(shape, budget, "q4_0") > largest  # a smaller cache fits more context
    assert largest_context(shape, parse_size("100MiB")) == 0
    assert largest_context(shape, parse_size("64GiB")) == shape.trained_ctx


def test_parse_size():
    assert parse_size("4GiB") == 4 * 2**30 == parse_size("4G") == parse_size("4 gb")
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1.5K") == 1536
    assert parse_size("0") == 0 == parse_size("0GiB")  # none, for every option that takes a size
    for bad in ("lots", "-1G", "4XB", "nan", "inf", "1e3"):
        with pytest.raises(ValueError, match="write it like 4GiB"):
            parse_size(bad)
    with pytest.raises(ValueError, match="more than 1 EiB"):
        parse_size("9" * 400)


def test_inspect_shows_the_plan_and_the_budget(runner, smollm2_path):
    result = runner.invoke(
        app,
        [
            "inspect",
            "smollm2-135m",
            "--ctx",
            "2048",
            "--kv-type",
            "q8_0",
            "--mem",
            "300MiB",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["memory"]["n_ctx"] == 2048 and data["memory"]["type_k"] == "q8_0"
    assert data["memory"]["kv_bytes"] == int(2 * 30 * 3 * 64 * 2048 * 34 / 32)
    assert data["memory_budget"]["largest_context"] > 2048
    text = runner.invoke(app, ["inspect", "smollm2-135m", "--mem", "300MiB"])
    assert "memory at a context of 4096 tokens" in text.stdout
    assert "largest context that fits 300.0 MiB" in text.stdout


def test_inspect_counts_parked_caches_and_a_draft_model(
    runner, smollm2_path, tiny_smollm2_vocab_path
):
    """serve --cache-ram's parked caches and --spec draft's second model are in the plan, its
    total and the budget's largest context."""
    base = ["inspect", "smollm2-135m", "--ctx", "2048", "--mem", "600MiB", "--json"]
    alone = json.loads(runner.invoke(app, base).stdout)
    extras = ["--cache-ram", "200MiB", "--draft", str(tiny_smollm2_vocab_path)]
    result = runner.invoke(app, [*base, *extras])
    assert result.exit_code == 0, result.stderr
    both = json.loads(result.stdout)
    draft = json.loads(
        runner.invoke(
            app, ["inspect", str(tiny_smollm2_vocab_path), "--ctx", "2048", "--json"]
        ).stdout
    )
    memory = both["memory"]
    assert memory["parked_bytes"] == 200 * 2**20
    assert memory["draft_bytes"] == draft["memory"]["total_bytes"] > 0
    assert (
        memory["total_bytes"]
        == alone["memory"]["total_bytes"] + 200 * 2**20 + memory["draft_bytes"]
    )
    assert both["memory_budget"]["largest_context"] < alone["memory_budget"]["largest_context"]
    shape = ModelShape.from_gguf(smollm2_path)
    largest = both["memory_budget"]["largest_context"]
    draft_shape = ModelShape.from_gguf(tiny_smollm2_vocab_path)
    fits = plan(shape, largest, parked_bytes=200 * 2**20, draft=draft_shape).total_bytes
    more = plan(shape, largest + 256, parked_bytes=200 * 2**20, draft=draft_shape).total_bytes
    assert fits <= 600 * 2**20 < more
    text = runner.invoke(app, ["inspect", "smollm2-135m", *extras]).stdout
    assert re.search(r"parked caches\s+200\.0 MiB", text) and "draft model" in text


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--cache-ram", "lots"], "--cache-ram: not a size"),
        (["--kv-type", "q3_k"], "unknown K cache type 'q3_k'"),
        (["--kv-v", "int4"], "unknown V cache type 'int4'"),
        (["--mem", "lots"], "--mem: not a size"),
    ],
)
def test_bad_memory_options(runner, smollm2_path, args, needle):
    result = runner.invoke(app, ["inspect", "smollm2-135m", *args])
    assert result.exit_code == 2 and needle in result.stderr


def test_run_with_a_quantized_and_a_mixed_cache(runner, smollm2_path):
    for args, shown in (
        (["--kv-type", "q4_0"], "q4_0"),
        (["--kv-k", "q8_0", "--kv-v", "f16"], "q8_0/f16"),
    ):
        result = runner.invoke(app, ["run", "-n", "4", "--json", *args, "Hello"])
        assert result.exit_code == 0, result.stderr
        out = json.loads(result.stdout)
        assert out["kv_cache_type"] == shown and out["generation_tokens"] >= 1
    refused = runner.invoke(app, ["run", "--kv-type", "q3", "Hello"])
    assert refused.exit_code == 2 and "unknown K cache type 'q3'" in refused.stderr


def test_a_crafted_header_is_refused_by_its_field_at_once():
    """Numbers that drove the plan's loops (layers, per-layer arrays, window patterns) are
    checked as llama.cpp checks them, before any loop; at llama.cpp's limits the plan is quick."""

    def shape(**fields: object) -> ModelShape:
        named = {f"gemma3.{key}": value for key, value in fields.items()}
        fields = {"general.architecture": "gemma3", **named}
        return ModelShape.from_header(GGUFHeader(3, fields, {}, [], where="crafted.gguf"))

    refusals = {
        "gemma3.block_count is 100000, more than llama.cpp's 512 layers": {
            "block_count": 100_000,
            "attention.sliding_window": 512,
        },
        "gemma3.attention.head_count_kv is an empty array, for 2 layers": {
            "block_count": 2,
            "attention.head_count_kv": [],
        },
        "gemma3.embedding_length is the string '64', not a whole number": {
            "embedding_length": "64"
        },
        "sliding_window_pattern is an array of 513 items, not one flag a layer": {
            "block_count": 2,
            "attention.sliding_window": 512,
            "attention.sliding_window_pattern": [True] * 513,
        },
    }
    for message, fields in refusals.items():
        with pytest.raises(GGUFError, match=re.escape(message)) as refused:
            shape(**fields)
        assert str(refused.value).startswith("crafted.gguf is not a model llama.cpp can load: ")
    start = time.process_time()  # the plan's work, whatever else the machine runs
    most = shape(block_count=512, embedding_length=64, **{"attention.sliding_window": 512})
    assert sum(most.swa_layers) == 512 - 512 // 6 and plan(most, 2**20).kv_bytes > 0
    assert time.process_time() - start < 0.5
    # No layers, so no KV cache: every context costs the same, up to the trained one.
    assert largest_context(shape(context_length=8192), 2**30) == 8192
