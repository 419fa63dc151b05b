"""Weight quantization through llama.cpp's quantizer: the real SmolLM2 (made F16 first, from its
Q4_1, offline) and the tiny model; sizes, loading, generation, registration, bad inputs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cli.app import app
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from quant.quantize import quantize, weight_type

from conftest import QUILL, quill_env
from hubserver import Hub, serve_hub


def quantize_cli(runner, *args):
    result = runner.invoke(app, ["quantize", *args, "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def generates(path: str | Path) -> int:
    with Engine(Path(path), LoadOptions(n_ctx=256, threads=2)) as engine:
        tokens = engine.tokenize("The three primary colors are")
        events = list(engine.stream_generate(tokens, 8, SamplingParams(temperature=0)))
    assert events[-1].finish_reason in ("stop", "length")
    return events[-1].generation_tokens


@pytest.mark.parametrize(("to", "low", "high"), [("int8", 0.50, 0.56), ("int4", 0.30, 0.42)])
def test_int8_and_int4_from_f16(runner, smollm2_f16, to, low, high):
    made = quantize_cli(runner, "smollm2-135m:f16", "--to", to, "--force")
    assert made["type"] == weight_type(to)
    # q8_0 is ~53% of F16; q4_k_m ~39% here, as 576-wide rows fall back to q5_0.
    assert low <= made["ratio"] <= high
    assert made["name"] == f"smollm2-135m:{made['type']}"
    assert generates(made["output"]) >= 1
    # The made file answers to its name everywhere, ahead of the registry's download of that tag.
    result = runner.invoke(app, ["run", "-m", made["name"], "-n", "4", "--json", "Hi"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["path"] == made["output"]


@pytest.mark.parametrize("to", ["q8_0", "q4_k_m", "q4_0"])
def test_tiny_model_quantizes_loads_and_generates(tiny_path, tmp_path, to):
    result = quantize(tiny_path, tmp_path / f"tiny-{to}.gguf", to, threads=2)
    assert result.output_bytes < result.source_bytes
    assert generates(result.output) >= 1
    assert not list(tmp_path.glob(".*.part"))


def one_line(result, code: int, needle: str) -> None:
    assert result.exit_code == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("quill: error: ") and needle in lines[-1], lines
    assert "Traceback" not in result.stderr


def test_bad_inputs(runner, smollm2_path, smollm2_f16, tiny_path, tmp_path):
    one_line(
        runner.invoke(app, ["quantize", str(tiny_path), "--to", "q3_x"]), 2, "unknown weight type"
    )
    one_line(
        runner.invoke(app, ["quantize", str(tiny_path), "--to", "iq2_xs"]), 2, "importance matrix"
    )
    refused = runner.invoke(
        app, ["quantize", "smollm2-135m:q4_1", "--to", "q4_0", "-o", str(tmp_path / "a.gguf")]
    )
    one_line(refused, 2, "already quantized (Q4_1)")
    assert "\nquantizing " not in "\n" + refused.stderr  # refused before it says it starts
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    one_line(runner.invoke(app, ["quantize", str(text), "--to", "q8_0"]), 5, "not a GGUF file")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_path.read_bytes()[: 2**20])
    one_line(runner.invoke(app, ["quantize", str(cut), "--to", "q8_0"]), 5, "truncated or corrupt")
    existing = tmp_path / "exists.gguf"
    existing.write_bytes(b"keep me")
    args = ["quantize", str(tiny_path), "--to", "q8_0", "-o", str(existing)]
    one_line(runner.invoke(app, args), 2, "pass --force")
    assert existing.read_bytes() == b"keep me"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["quantize", str(tiny_path), "--to", "q8_0", "-o", str(blocker / "out.gguf")]
    one_line(runner.invoke(app, args), 2, "cannot write")
    assert not list(tmp_path.rglob("*.part"))


def test_requantize_when_asked(runner, tiny_path, tmp_path):
    first = quantize(tiny_path, tmp_path / "q8.gguf", "q8_0", threads=2)
    result = runner.invoke(
        app, ["quantize", first.output, "--to", "q4_0", "--allow-requantize", "--json"]
    )
    assert result.exit_code == 0, result.stderr
    assert generates(json.loads(result.stdout)["output"]) >= 1


def test_the_readme_example_on_a_fresh_install(smollm2_f16, tmp_path):
    """`quill quantize smollm2-135m --to int8`, as the README shows it, with an empty store: the
    default file is Q4_1, so quill fetches the registry's F16 file of the model (from a local Hub
    through the real huggingface-hub client) and rounds its weights once."""
    files = {
        ("bartowski/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct-f16.gguf"): Path(
            smollm2_f16["output"]
        )
    }
    home = tmp_path / "fresh"
    with serve_hub(Hub(files=files)) as hub:
        environment = quill_env(home, HF_ENDPOINT=hub.url, HF_HOME=str(home / "hf"))
        environment.pop("HF_HUB_OFFLINE")
        result = subprocess.run(
            [QUILL, "quantize", "smollm2-135m", "--to", "int8", "--json"],
            capture_output=True, text=True, env=environment, timeout=300,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "quantizing from smollm2-135m:f16" in result.stderr
    made = json.loads(result.stdout)
    assert made["name"] == "smollm2-135m:q8_0" and 0.50 <= made["ratio"] <= 0.56
    assert not made["dequantized"] and Path(made["output"]).is_relative_to(home)
    assert generates(made["output"]) >= 1
