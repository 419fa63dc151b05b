"""`quill run` through Typer's CLI runner, on the real SmolLM2 and the tiny model."""

from __future__ import annotations

import json
import re

import pytest

from cli.app import app

from neartie import assert_near
from reference import Reference

GREEDY = ["--temperature", "0"]


@pytest.fixture(scope="module")
def reference(smollm2_path):
    ref = Reference(smollm2_path)
    yield ref
    ref.close()


def run_json(runner, *args, input=None):
    result = runner.invoke(app, ["run", "--json", *args], input=input)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_greedy_run_matches_the_independent_decoder(runner, smollm2_path, reference):
    result = runner.invoke(app, ["run", *GREEDY, "-n", "48", "Name three primary colors."])
    assert result.exit_code == 0, result.stderr
    tokens = reference.tokenize(reference.chat([("user", "Name three primary colors.")]), True)
    # A reply is a line: stdout ends with a newline, as llm and ollama write it.
    assert result.stdout.endswith("\n")
    assert_near(reference, tokens, result.stdout.removesuffix("\n"))


def test_raw_prompt_skips_the_template(runner, smollm2_path, reference):
    prompt = "The three primary colors are"
    out = run_json(runner, *GREEDY, "--raw", "-n", "16", prompt)
    tokens = reference.tokenize(prompt, True)
    assert out["prompt_tokens"] == len(tokens)
    assert_near(reference, tokens, out["text"])


def test_system_prompt_goes_through_the_template(runner, smollm2_path, reference):
    out = run_json(runner, *GREEDY, "-n", "24", "-s", "Answer in French.", "Say hello.")
    messages = [("system", "Answer in French."), ("user", "Say hello.")]
    tokens = reference.tokenize(reference.chat(messages), True)
    assert out["prompt_tokens"] == len(tokens)
    assert_near(reference, tokens, out["text"])


def test_prompt_from_stdin_alone_and_before_the_argument(runner, smollm2_path):
    """Piped text comes first, the argument after a blank line (as llm joins them)."""
    whole = "Cats sleep a lot.\n\nSummarize that."
    pinned = [*GREEDY, "-t", "1", "-n", "12"]  # one thread count: one compute path for all three
    from_arg = run_json(runner, *pinned, whole)
    from_stdin = run_json(runner, *pinned, input=whole + "\n")
    both = run_json(runner, *pinned, "Summarize that.", input="Cats sleep a lot.\n")
    # same path: one prompt, one engine setup; only where the prompt came from differs
    assert from_arg["text"] == from_stdin["text"] == both["text"]
    assert from_arg["prompt_tokens"] == from_stdin["prompt_tokens"] == both["prompt_tokens"]


def test_json_object_has_text_and_every_metric(runner, smollm2_path):
    out = run_json(runner, "-n", "5", "--seed", "7", "Write a long story about a dragon.")
    assert out["model"] == "smollm2-135m" and out["path"].endswith(".gguf")
    assert out["finish_reason"] == "length" and out["generation_tokens"] == 5
    assert out["seed"] == 7 and out["threads"] >= 1 and out["gpu_layers"] == 0
    assert out["kv_cache_type"] == "f16" and out["n_ctx"] == 4096
    assert out["kv_cache_bytes"] == 90 * 2**20
    for key in ("load_s", "ttft_s", "prefill_s", "prefill_tokens_per_s", "decode_s", "total_s"):
        assert out[key] > 0, key
    assert out["decode_tokens_per_s"] > 0
    assert 0 < out["inter_token_latency_p50_ms"] <= out["inter_token_latency_p95_ms"]
    assert out["ttft_s"] <= out["total_s"]
    assert isinstance(out["text"], str)


def test_stats_line_goes_to_stderr_plain_and_no_stats_hides_it(runner, smollm2_path):
    shown = runner.invoke(app, ["run", "-n", "4", "Write a long story about a dragon."])
    assert shown.exit_code == 0
    assert (
        "TTFT" in shown.stderr
        and "decode 4 tok" in shown.stderr
        and "finish length" in shown.stderr
    )
    assert "\x1b[" not in shown.stderr and "TTFT" not in shown.stdout
    hidden = runner.invoke(app, ["run", "-n", "4", "--no-stats", "Hi"])
    assert hidden.exit_code == 0 and hidden.stderr == ""


def test_stop_string_is_reported(runner, smollm2_path):
    full = run_json(runner, *GREEDY, "-n", "40", "Write two sentences about the sea.")
    word = full["text"].split()[3]
    out = run_json(
        runner, *GREEDY, "-n", "40", "--stop", word, "Write two sentences about the sea."
    )
    assert out["finish_reason"] == "stop" and out["stop_string"] == word
    assert out["text"] == full["text"][: full["text"].index(word)]


def test_gpu_layers_on_a_cpu_build_warns_once_and_runs(runner, tiny_path):
    result = runner.invoke(
        app, ["run", "-m", str(tiny_path), "--gpu-layers", "all", "--json", "-n", "2", "x"]
    )
    assert result.exit_code == 0
    assert result.stderr.count("cannot offload to a GPU") == 1
    assert "CMAKE_ARGS" in result.stderr
    assert json.loads(result.stdout)["gpu_layers"] == 0


def one_error_line(result, code: int, *needles: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("quill: error: ")
    assert "Traceback" not in result.stderr and result.stdout == ""
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_no_prompt_is_a_usage_error(runner):
    one_error_line(runner.invoke(app, ["run"]), 2, "no prompt")


def test_bad_gpu_layers_is_a_usage_error(runner):
    one_error_line(runner.invoke(app, ["run", "--gpu-layers", "many", "x"]), 2, "--gpu-layers")


def test_unknown_alias_lists_the_known_ones(runner):
    one_error_line(runner.invoke(app, ["run", "-m", "gpt-9", "x"]), 3, "gpt-9", "smollm2-135m")


def test_unknown_tag_lists_the_tags(runner):
    one_error_line(
        runner.invoke(app, ["run", "-m", "smollm2-135m:q9", "x"]), 3, "smollm2-135m:q4_1"
    )


def test_missing_file(runner, tmp_path):
    one_error_line(
        runner.invoke(app, ["run", "-m", str(tmp_path / "no.gguf"), "x"]), 3, "no model file"
    )


def test_hub_file_offline_is_not_obtainable(runner):
    result = runner.invoke(app, ["run", "-m", "hf://someone/repo/model.gguf", "x"])
    one_error_line(result, 3, "someone/repo", "offline")


def test_alias_not_cached_with_offline(runner):
    result = runner.invoke(app, ["run", "--offline", "-m", "qwen2.5-0.5b", "x"])
    one_error_line(result, 3, "qwen2.5-0.5b:q4_k_m", "skipped, offline")


def test_not_a_gguf_file(runner, tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("just some text")
    one_error_line(runner.invoke(app, ["run", "-m", str(path), "x"]), 5, "not a GGUF file")


def test_truncated_gguf_carries_llama_cpps_reason(runner, tmp_path, smollm2_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(smollm2_path.read_bytes()[: 3 * 2**20])
    one_error_line(runner.invoke(app, ["run", "-m", str(path), "x"]), 5, "corrupted or incomplete")


def test_unsupported_architecture_carries_llama_cpps_reason(runner, tmp_path, tiny_path):
    data = tiny_path.read_bytes()
    # Rename the architecture in the metadata, keeping every length the same.
    path = tmp_path / "alien.gguf"
    path.write_bytes(data.replace(b"llama", b"lxmxa", 1))
    one_error_line(runner.invoke(app, ["run", "-m", str(path), "x"]), 5, "lxmxa")


def test_context_overflow_gives_both_numbers_before_prefill(runner, tiny_path):
    prompt = "word " * 3000
    line = one_error_line(
        runner.invoke(app, ["run", "-m", str(tiny_path), "--raw", "--ctx", "1024", prompt]),
        4,
        "context window is 1024 tokens",
        "--max-tokens is 512",
        "--ctx",
    )
    prompt_tokens = int(re.search(r"prompt is (\d+) tokens", line).group(1))
    assert 2900 < prompt_tokens < 3100  # about one token per word
    assert f"{prompt_tokens + 512} in all" in line


def test_bigger_ctx_lets_the_same_prompt_run(runner, tiny_path):
    prompt = "word " * 700
    assert (
        runner.invoke(
            app, ["run", "-m", str(tiny_path), "--raw", "--ctx", "1024", prompt]
        ).exit_code
        == 4
    )
    out = run_json(runner, "-m", str(tiny_path), "--raw", "--ctx", "2048", "-n", "4", prompt)
    assert out["n_ctx"] == 2048 and out["prompt_tokens"] > 512


def test_every_command_that_runs_a_model_takes_dash_m(runner, tiny_path, tmp_path):
    """chat, bench (and serve, perplexity, quant-report) spell the model as run does: -m NAME,
    with their positional NAME kept; two different names are refused."""
    transcript = tmp_path / "chat.json"
    result = runner.invoke(
        app,
        ["chat", "-m", str(tiny_path), "-n", "4", "--transcript", str(transcript)],
        input="hello\n",
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(transcript.read_text())["messages"][0]["content"] == "hello"
    result = runner.invoke(
        app, ["bench", "-m", str(tiny_path), "-p", "16", "-n", "4", "-r", "1", "--json"]
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["model"] == str(tiny_path)
    result = runner.invoke(app, ["chat", "smollm2-135m", "-m", str(tiny_path)], input="hi\n")
    assert result.exit_code == 2 and "two models given" in result.stderr
