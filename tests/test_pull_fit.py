"""quill pull decides before the first weight byte (cli/measure/fit.py): the header by range
requests, the memory plan at the context run will use, RAM (or --mem) and the disk; a repository
named alone takes the largest of its GGUF files that fits with room to spare. The real
huggingface-hub client against the local Hub stand-in, whose log shows what was read."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from cli.store.models import parse_model_name
from cli.store.registry import load_registry
from quant.quantize import quantize

from conftest import QUILL, hub_env, run_quill
from hubserver import Hub, serve_hub
from tinymodel import _own_tokenizer_fields, write_tiny_llama

Q4_K = GGMLQuantizationType.Q4_K
QUANTS = ("Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
HUGE = "Huge-70B-Instruct-Q4_K_M.gguf"


@pytest.fixture(scope="module")
def quant_files(tmp_path_factory) -> dict[str, Path]:
    """The tiny model (rows of 256, as k-quants need) in five quantizations."""
    folder = tmp_path_factory.mktemp("quants")
    source = write_tiny_llama(folder / "tiny-f32.gguf", n_layer=2, n_embd=256, n_ff=512)
    files = {}
    for quant in QUANTS:
        files[quant] = folder / f"Tiny-{quant}.gguf"
        quantize(source, files[quant], quant.lower(), threads=2)
    return files


def write_claimed_70b(path: Path) -> Path:
    """A GGUF whose header describes a 70B-class Q4_K model (Llama-3-70B's shapes), its tensor
    data a hole: a sparse file of about 40 GB that only its first bytes are real of."""
    n_embd, n_ff, n_layer, kv = 8192, 28672, 80, 1024
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(8192)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(64)
    writer.add_head_count_kv(8)
    writer.add_rope_dimension_count(128)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(15)  # Q4_K_M
    n_vocab = 0
    for name, value, value_type, sub_type in _own_tokenizer_fields():
        writer.add_key_value(name, value, value_type, sub_type)
        n_vocab = len(value) if name == "tokenizer.ggml.tokens" else n_vocab

    data = 0

    def info(name: str, rows: int, cols: int) -> None:
        nonlocal data
        row_bytes = cols // 256 * 144  # Q4_K: 144 bytes a block of 256
        size = rows * row_bytes
        writer.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8), size, Q4_K)
        data += -(-size // 32) * 32  # each tensor aligned

    info("token_embd.weight", n_vocab, n_embd)
    for layer in range(n_layer):
        for name, rows, cols in (
            ("attn_q", n_embd, n_embd), ("attn_k", kv, n_embd), ("attn_v", kv, n_embd),
            ("attn_output", n_embd, n_embd), ("ffn_gate", n_ff, n_embd),
            ("ffn_up", n_ff, n_embd), ("ffn_down", n_embd, n_ff),
        ):  # fmt: skip
            info(f"blk.{layer}.{name}.weight", rows, cols)
    info("output.weight", n_vocab, n_embd)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with path.open("r+b") as out:
        out.truncate(out.seek(0, 2) + 32 + data)  # a hole where the weights would be
    return path


@pytest.fixture
def hub(quant_files, tmp_path_factory):
    files = {("owner/tiny-GGUF", path.name): path for path in quant_files.values()}
    huge = write_claimed_70b(tmp_path_factory.mktemp("huge") / HUGE)
    files[("owner/huge-GGUF", HUGE)] = huge
    with serve_hub(Hub(files=files, etags={huge: "0" * 64})) as served:
        yield served


@pytest.fixture
def pull(hub, tmp_path):
    """`quill pull ARGS` against the stand-in, in this test's home (which starts with the
    session's measurements: conftest.share_measurements)."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_quill(tmp_path, "pull", *args, env=hub_env(hub.url, tmp_path))

    return run


def hf_files(home: Path) -> list[Path]:
    return [p for p in (home / "hf").rglob("*") if p.is_file() and not p.name.endswith(".lock")]


def test_a_70b_header_is_refused_with_only_its_header_read(hub, tmp_path, pull):
    result = pull("owner/huge-GGUF:Q4_K_M")
    assert result.returncode == 8, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("quill: error: owner/huge-GGUF:Q4_K_M (Huge-70B-Instruct-Q4_K_M.gguf)")
    assert "GiB of memory at a context of 4096" in last and "nothing was downloaded" in last
    assert "--force" in last and "Traceback" not in result.stderr
    # The stand-in's log: range reads of the header's first MiBs, no download.
    assert hub.transfers and hub.downloads == []
    assert all(t.start == 0 and t.end is not None and t.sent <= 2**21 for t in hub.transfers)
    assert hf_files(tmp_path) == []
    # --dry-run --force says what would happen, and still fetches nothing.
    dry = pull("owner/huge-GGUF:Q4_K_M", "--dry-run", "--force", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["fits"] is False and plan["path"] is None
    assert plan["files"][0]["memory"]["weights_bytes"] > 35 * 2**30
    assert hub.downloads == []


def test_a_repository_alone_takes_the_largest_file_that_fits_with_room(hub, tmp_path, pull):
    listed = pull("owner/tiny-GGUF", "--dry-run", "--json", "--ctx", "512")
    assert listed.returncode == 0, listed.stderr
    plan = json.loads(listed.stdout)
    needs = {one["quant"]: one["memory"]["total_bytes"] for one in plan["files"]}
    assert set(needs) == set(QUANTS) and plan["chosen"] == "Tiny-Q8_0.gguf"  # all fit in RAM
    # Each file's decode speed, predicted here from its header alone (cli/measure/predict.py).
    assert all(one["predicted_decode_tokens_per_s"] > 0 for one in plan["files"])
    assert needs["Q8_0"] > needs["Q6_K"] > needs["Q4_K_M"]
    # A budget the Q6_K plan fits with room to spare (90%), and the Q8_0 does not.
    budget = int(needs["Q6_K"] / 0.9) + 1024
    assert needs["Q8_0"] > 0.9 * budget
    result = pull("owner/tiny-GGUF", "--mem", str(budget), "--ctx", "512")
    assert result.returncode == 0, result.stderr
    assert "* Tiny-Q6_K.gguf" in result.stderr  # the table marks the one taken
    assert "DECODE HERE" in result.stderr and "decode predicted here" in result.stderr
    assert all(f"Tiny-{quant}.gguf" in result.stderr for quant in QUANTS)
    assert "the largest of 5 files whose plan takes at most 90% of --mem" in result.stderr
    assert [t.path for t in hub.downloads] == ["Tiny-Q6_K.gguf"]
    # Too small for any: refused, the smallest's plan named.
    tight = pull("owner/tiny-GGUF", "--mem", str(needs["Q3_K_M"] // 2))
    assert tight.returncode == 8 and "Tiny-Q3_K_M.gguf" in tight.stderr.splitlines()[-1]


def test_repo_quant_takes_that_file(hub, tmp_path, pull):
    result = pull("owner/tiny-GGUF:Q8_0", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["chosen"] == "Tiny-Q8_0.gguf" and len(plan["files"]) == 1
    assert Path(plan["path"]).name == "Tiny-Q8_0.gguf" and Path(plan["path"]).is_file()
    assert [t.path for t in hub.downloads] == ["Tiny-Q8_0.gguf"]


def test_the_plan_pull_prints_is_the_one_run_reports_after_loading(hub, tmp_path, pull):
    pulled = pull("owner/tiny-GGUF:Q4_K_M", "--json", "--ctx", "1024")
    assert pulled.returncode == 0, pulled.stderr
    planned = json.loads(pulled.stdout)["files"][0]["memory"]
    ran = run_quill(
        tmp_path, "run", "-m", "owner/tiny-GGUF:Q4_K_M", "--ctx", "1024", "-n", "2", "--json",
        "hello", env=hub_env(hub.url, tmp_path),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    reported = json.loads(ran.stdout)
    assert reported["memory"] == planned
    assert reported["kv_cache_bytes"] == planned["kv_bytes"]  # the loaded model's own KV cache
    again = pull("owner/tiny-GGUF:Q4_K_M", "--json", "--ctx", "1024")
    assert (
        "already on disk" in again.stderr
        and json.loads(again.stdout)["files"][0]["memory"] == planned
    )


def test_a_full_disk_is_refused_before_the_download(hub, tmp_path):
    """The Hub's cache on a 64 MiB tmpfs, mounted in a private namespace: too small for the file
    and the margin pull keeps."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here to mount a private tmpfs")
    cache = tmp_path / "small-disk"
    cache.mkdir()
    env = hub_env(hub.url, tmp_path, HF_HOME=str(cache))
    script = (
        f'mount -t tmpfs -o size=64m none "{cache}" && exec "{QUILL}" pull owner/tiny-GGUF:Q8_0'
    )
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    if "mount" in result.stderr and result.returncode != 3:
        pytest.skip(f"this machine lets no private tmpfs be mounted: {result.stderr.strip()}")
    assert result.returncode == 3, result.stderr
    assert "not enough disk space" in result.stderr and "MiB free" in result.stderr
    assert hub.downloads == []


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("qwen2.5:0.5b", "qwen2.5-0.5b:q4_k_m"),
        ("qwen2.5:0.5b-q8_0", "qwen2.5-0.5b:q8_0"),
        ("llama3.2:1b", "llama3.2-1b:q4_k_m"),
        ("qwen2.5-0.5b:q8_0", "qwen2.5-0.5b:q8_0"),
    ],
)
def test_ollama_size_tags_name_the_registry_model(name, label):
    assert parse_model_name(name, load_registry()).label == label
