"""Options that other tests only reach by their short names or defaults, set by their long names
at non-default values, each with an effect that can be seen."""

from __future__ import annotations

import json

import httpx2 as httpx

from cli.app import app

from conftest import PPL_TEXT, start_server

PROMPT = "Name three primary colors."


def run_json(runner, *args: str) -> dict:
    result = runner.invoke(app, ["run", *args, "--json", PROMPT])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_sampling_filters_and_system_by_their_long_names(runner, smollm2_path):
    """--top-k 1 leaves one candidate, so temperature 1 must give the greedy text; --top-p and
    --min-p at non-default values run in the same chain; --ignore-eos runs to the limit."""
    system = ["--system", "Answer in French.", "-t", "1"]  # one thread count: one compute path
    greedy = run_json(runner, *system, "--temperature", "0", "-n", "12", "--ignore-eos")
    filtered = run_json(
        runner, *system, "--temperature", "1.0", "--seed", "5", "--top-k", "1",
        "--top-p", "0.5", "--min-p", "0.2", "-n", "12", "--ignore-eos",
    )  # fmt: skip
    # same path: the same logits; only the sampler chain after them differs
    assert filtered["text"] == greedy["text"]
    assert filtered["generation_tokens"] == greedy["generation_tokens"] == 12
    assert filtered["finish_reason"] == "length"
    plain = run_json(runner, "--temperature", "0", "-n", "12", "--ignore-eos")
    # same path: two prompts on one machine (the system prompt reached the model)
    assert plain["text"] != greedy["text"]


def test_bench_batch_and_gen_tokens_by_their_long_names(runner, tiny32_path):
    result = runner.invoke(
        app,
        ["bench", str(tiny32_path), "--prompt-tokens", "24", "--gen-tokens", "3",
         "--batch", "8", "-r", "1", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [row["test"] for row in rows] == ["pp24", "tg3"]
    assert {row["batch"] for row in rows} == {8}  # prefill in batches of 8 tokens


def test_quant_report_kv_ctx(runner, tiny32_path):
    args = ["quant-report", str(tiny32_path), "--file", str(PPL_TEXT), "--types", "f16",
            "--kv-types", "f16", "--ctx", "64", "--chunks", "1", "-p", "16",
            "--gen-tokens", "2", "-r", "1", "--json"]  # fmt: skip
    small = json.loads(runner.invoke(app, [*args, "--kv-ctx", "1024"]).stdout)
    large = json.loads(runner.invoke(app, [*args, "--kv-ctx", "4096"]).stdout)
    assert large["rows"][0]["kv_bytes"] == 4 * small["rows"][0]["kv_bytes"]


def test_serve_host_and_max_tokens_limit(smollm2_path, quill_home, tmp_path):
    process, url = start_server(
        quill_home, tmp_path, "--host", "127.0.0.1", "--max-tokens-limit", "4", "--ctx", "256",
        "--parallel", "1",
    )  # fmt: skip
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        too_many = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 5})
        assert too_many.status_code == 400 and "4" in too_many.json()["error"]["message"]
        unset = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert unset.status_code == 200
        assert unset.json()["usage"]["completion_tokens"] <= 4  # the default obeys the limit
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_quantize_output_by_its_long_name(runner, tiny_path, tmp_path):
    target = tmp_path / "tiny-q8_0.gguf"
    made = runner.invoke(app, ["quantize", str(tiny_path), "--to", "q8_0", "--output", str(target)])
    assert made.exit_code == 0, made.stderr
    assert 0 < target.stat().st_size < tiny_path.stat().st_size
