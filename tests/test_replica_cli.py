"""quill bench --replica and where a replica can be met: built once from a header (on disk, or from
the local Hub stand-in by range requests) and reused, every row saying what it replicates; listed
and cleared by `quill cache` and counted against its limit; refused before anything is written
where it cannot fit; said to be noise by run and inspect, and never listed as a model."""

from __future__ import annotations

import csv
import io
import json
import resource
import shutil
import struct
import subprocess
from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import test_header
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from test_header import tensor_table, write_split

from cli.app import app
from cli.store.header import header_on_disk
from cli.store.models import parse_model_name
from cli.store.promptcache import cache_dir
from cli.store.registry import load_registry
from cli.store.replicas import list_replicas, replicas_dir
from quant import replica
from quant.gguf import read_header

from conftest import QUILL, quill_env, share_measurements

# No decode prediction: its first calibration takes seconds (tests/test_predict.py has its own).
GRID = ["-p", "16", "-n", "8", "-r", "1", "-t", "1", "--no-predict"]
TiB = 2**40
hub_env = test_header.hub_env  # the local Hub stand-in, a fixture


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A quill home of this test's own: its replicas and prompt caches are the only ones. It
    starts with the session's measurements (conftest.share_measurements)."""
    home = tmp_path / "home"
    home.mkdir()
    share_measurements(home)
    monkeypatch.setenv("QUILL_HOME", str(home))
    return home


def bench(runner, name: str, *extra: str):
    return runner.invoke(app, ["bench", name, "--replica", *GRID, *extra])


def the_replica() -> Path:
    (replica,) = list_replicas()
    return replica.path


def test_smollm2s_replica_is_built_once_then_reused_and_every_row_says_so(
    runner, home, smollm2_path
):
    built = bench(runner, str(smollm2_path), "--json", "--predict")  # --replica's default
    assert built.exit_code == 0, built.stderr
    name = str(smollm2_path)
    assert f"replica of {name}: built " in built.stderr and "MiB/s" in built.stderr
    data = json.loads(built.stdout)
    assert data["model"] == f"replica of {name}"
    assert [row["replica_of"] for row in data["rows"]] == [name, name]
    assert all(row["tokens_per_s"] > 0 for row in data["rows"])
    # The tg row beside the decode speed predicted from SmolLM2's header alone.
    tg = data["rows"][1]
    assert tg["predicted_tokens_per_s"] > 0 and tg["calibration"]["shares"].keys() >= {"Q4_1"}
    assert "decode prediction with 1 threads:" in built.stderr
    path = the_replica()
    assert tensor_table(header_on_disk(path)) == tensor_table(header_on_disk(smollm2_path))
    stamp = path.stat().st_mtime_ns
    table = bench(runner, str(smollm2_path))
    assert table.exit_code == 0, table.stderr
    assert f"replica of {name}: reused" in table.stderr and path.stat().st_mtime_ns == stamp
    rows = [line for line in table.stdout.splitlines() if line.startswith(("pp16", "tg8"))]
    assert len(rows) == 2 and all(line.endswith(f"replica of {name}") for line in rows)
    as_csv = list(csv.DictReader(io.StringIO(bench(runner, str(smollm2_path), "--csv").stdout)))
    assert [row["replica_of"] for row in as_csv] == [name, name]
    assert the_replica() == path  # still the one replica


@pytest.mark.slow  # two long prompts and two replicas: 7 s
def test_cache_lists_and_clears_replicas_and_counts_them_against_its_limit(runner, home, tiny_path):
    assert bench(runner, str(tiny_path)).exit_code == 0
    (replica,) = list_replicas()
    listed = runner.invoke(app, ["cache"])
    assert listed.exit_code == 0 and "no prompt caches" in listed.stderr
    assert f"{tiny_path} " in listed.stdout and replica.folder.name in listed.stdout
    assert "1 replicas, " in listed.stdout and str(replicas_dir()) in listed.stdout
    # A long prompt's cache fits beside the replica under a large limit ...
    prompt = " ".join(["the old bridge carries the road"] * 150)
    run = ["run", "-m", str(tiny_path), "--temperature", "0", "-n", "2"]
    assert runner.invoke(app, [*run, "--cache-max", "1GiB", prompt]).exit_code == 0
    (kept,) = cache_dir().glob("*.kv")
    assert list_replicas() == [replica]
    # ... and under one that holds two prompts' caches but not the replica too, the replica,
    # least recently used, goes first.
    limit = str(2 * kept.stat().st_size + replica.size // 2)
    assert replica.size > kept.stat().st_size
    assert runner.invoke(app, [*run, "--cache-max", limit, "a river " + prompt]).exit_code == 0
    assert list_replicas() == [] and len(list(cache_dir().glob("*.kv"))) == 2
    assert bench(runner, str(tiny_path)).exit_code == 0
    cleared = runner.invoke(app, ["cache", "clear"])
    assert cleared.exit_code == 0
    assert "removed 2 prompt caches and 1 replicas" in cleared.stderr
    assert list_replicas() == [] and not list(cache_dir().glob("*.kv"))


def write_huge_header(
    source: Path,
    target: Path,
    extra: tuple[str, tuple[int, ...], GGMLQuantizationType, int] = (
        "huge.weight",
        (2**20, 2**19),
        GGMLQuantizationType.F16,
        TiB,
    ),
) -> None:
    """source's header with one more tensor (name, numpy shape, type, bytes), by default of 1 TiB:
    a download's start (a .part file) of a model no machine here can hold."""
    reader = GGUFReader(source)
    writer = GGUFWriter(None, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            item = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], item)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        writer.add_tensor_info(tensor.name, shape, np.dtype(np.float32), int(tensor.n_bytes),
                               raw_dtype=tensor.tensor_type)  # fmt: skip
    name, shape, kind, n_bytes = extra
    writer.add_tensor_info(name, shape, np.dtype(np.float32), n_bytes, raw_dtype=kind)
    writer.write_header_to_file(target)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def test_a_replica_that_cannot_fit_is_refused_before_anything_is_written(
    runner, home, tiny_path, tmp_path, monkeypatch
):
    huge = tmp_path / "huge.gguf.part"
    write_huge_header(tiny_path, huge)
    assert header_on_disk(huge).shape.weights_bytes > TiB
    refused = bench(runner, str(huge))
    assert refused.exit_code == 8 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert f"a replica of {huge} needs 1.0 TiB of memory at a context of 256" in refused.stderr
    assert "(weights 1.0 TiB, KV cache" in refused.stderr and "available; nothing" in refused.stderr
    assert not replicas_dir().exists()
    # The disk: the tiny model's replica, on a disk with 1 MiB free.
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(2**30, 2**30 - 2**20, 2**20))
    full = bench(runner, str(tiny_path))
    assert full.exit_code == 8 and full.stderr.count("\n") == 1, full.stderr
    assert "of disk, and " in full.stderr and "has 1.0 MiB available" in full.stderr
    assert "set QUILL_HOME to a larger disk" in full.stderr
    assert not replicas_dir().exists()


def test_a_replica_from_the_hub_reads_the_header_not_the_file(
    runner,
    home,
    hub_env,
    smollm2_path,
):
    spec = parse_model_name("smollm2-135m", load_registry()).spec
    hub = hub_env({(spec.sources[0].repo, spec.file): smollm2_path})
    result = bench(runner, "smollm2-135m", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "replica of smollm2-135m:q4_1"
    assert sum(t.sent for t in hub.transfers) == 2 * 2**20  # 1 MiB, then 2: of 94
    assert tensor_table(header_on_disk(the_replica())) == tensor_table(header_on_disk(smollm2_path))
    assert not list((home.parent / "hf").rglob("*.gguf*"))  # nothing was downloaded


def test_a_split_models_replica_is_split_alike(runner, home, tiny_path, tmp_path):
    parts = write_split(tiny_path, tmp_path, 2)
    result = bench(runner, str(parts[0]), "--json")
    assert result.exit_code == 0, result.stderr
    (replica,) = list_replicas()
    assert sorted(p.name for p in replica.folder.iterdir()) == [p.name for p in parts]
    assert tensor_table(header_on_disk(replica.path)) == tensor_table(header_on_disk(parts[0]))


def test_two_names_of_one_file_share_one_replica(runner, home, tiny_path, tmp_path):
    other = tmp_path / "another-name.gguf"
    other.symlink_to(tiny_path)
    assert bench(runner, str(tiny_path)).exit_code == 0
    (built,) = list_replicas()
    again = bench(runner, str(other))
    assert again.exit_code == 0, again.stderr
    assert f"replica of {other}: reused" in again.stderr
    assert list_replicas() == [replace(built, used=list_replicas()[0].used)]


def test_a_replica_larger_than_the_cache_limit_is_said_to_go_at_the_next_run(
    runner, home, tiny_path, monkeypatch
):
    assert "larger than the cache" not in bench(runner, str(tiny_path)).stderr
    monkeypatch.setattr("cli.store.promptcache.DEFAULT_MAX_BYTES", 2**20)
    again = bench(runner, str(tiny_path))
    assert again.exit_code == 0, again.stderr
    said = f"replica of {tiny_path} is larger than the cache's default limit (1.0 MiB)"
    assert said in again.stderr and "--cache-max" in again.stderr
    (replica,) = list_replicas()
    run = ["run", "-m", str(tiny_path), "-n", "2", "--cache-max", str(replica.size - 1)]
    prompt = " ".join(["the old bridge carries the road"] * 150)  # long enough to be kept
    assert runner.invoke(app, [*run, prompt]).exit_code == 0
    assert list_replicas() == [] and list(cache_dir().glob("*.kv"))  # as it said


def test_offline_or_unreachable_is_one_line_and_exit_3(runner, home, monkeypatch):
    offline = bench(runner, "hf://owner/tiny/tiny.gguf")
    assert offline.exit_code == 3 and offline.stderr.count("\n") == 1, offline.stderr
    assert "skipped, offline" in offline.stderr and "quill pull" in offline.stderr
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "https://hub.invalid")
    unreachable = bench(runner, "owner/tiny:Q4_K_M")
    assert unreachable.exit_code == 3 and unreachable.stderr.count("\n") == 1
    assert "cannot resolve hub.invalid" in unreachable.stderr
    assert not replicas_dir().exists()


def test_a_replica_is_said_to_be_noise_and_never_listed_as_a_model(runner, home, tiny_path):
    assert bench(runner, str(tiny_path)).exit_code == 0
    path = the_replica()
    run = runner.invoke(app, ["run", "-m", str(path), "-n", "4", "hi"])
    assert run.exit_code == 0, run.stderr
    (warning,) = [line for line in run.stderr.splitlines() if "replica" in line]
    assert f"{path.name} is a replica of {tiny_path}: its weights are noise" in warning
    shown = runner.invoke(app, ["inspect", str(path)])
    assert f"replica of {tiny_path}: its weights are noise" in shown.stdout
    facts = json.loads(runner.invoke(app, ["inspect", str(path), "--json"]).stdout)
    assert facts["kind"] == "replica" and facts["replica_of"] == str(tiny_path)
    listed = json.loads(runner.invoke(app, ["list", "--json"]).stdout)
    assert not [model for model in listed if "replicas" in model["path"]]
    assert (
        runner.invoke(app, ["run", "-m", str(tiny_path), "-n", "2", "hi"]).stderr.count("replica")
        == 0
    )


def test_a_tensor_at_a_corrupt_offset_is_one_line_and_exit_5(runner, home, tiny_path, tmp_path):
    """The last tensor's offset moved 32 GiB on: before, its replica was a 32 GiB file."""
    header = read_header(tiny_path)
    moved = tmp_path / "moved.gguf.part"  # a download's start: the header alone
    last = header.tensors[-1]
    prefix = tiny_path.read_bytes()[: header.data_start]
    offset = struct.pack("<Q", last.offset + 2**35)
    moved.write_bytes(prefix[: header.infos_end - 8] + offset + prefix[header.infos_end :])
    refused = bench(runner, str(moved))
    assert refused.exit_code == 5 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1, refused.stderr
    said = f"tensor {last.name} is at offset {last.offset + 2**35}, not {last.offset}"
    assert said in refused.stderr and str(moved) in refused.stderr
    assert not replicas_dir().exists()


def test_a_build_that_fails_or_is_interrupted_leaves_nothing(
    runner, home, tiny_path, tmp_path, monkeypatch
):
    """An I32 tensor after the tiny model's: refused when the writer reaches it, the rest of the
    file written; before, the replica's folder stayed. Ctrl-C in the middle of writing alike."""
    ints = tmp_path / "ints.gguf.part"
    extra = ("ints.weight", (4, 64), GGMLQuantizationType.I32, 1024)
    write_huge_header(tiny_path, ints, extra)
    refused = bench(runner, str(ints))
    assert refused.exit_code == 5 and refused.stderr.count("\n") == 1, refused.stderr
    assert "cannot make I32 weights (rows of 64)" in refused.stderr
    assert not replicas_dir().exists()
    (replicas_dir() / "kept").mkdir(parents=True)  # the folder exists: only the build's go
    made = replica._template

    def interrupted(type_id: int, row: int, kind: str) -> bytes:
        if kind == "scale":  # the first norm: after token_embd.weight is written
            raise KeyboardInterrupt
        return made(type_id, row, kind)

    monkeypatch.setattr(replica, "_template", interrupted)
    stopped = bench(runner, str(tiny_path))
    assert stopped.exit_code == 130 and "interrupted" in stopped.stderr
    assert [p.name for p in replicas_dir().rglob("*")] == ["kept"]


def test_a_disk_that_fills_while_writing_is_one_line_and_exit_8(home, tiny_path):
    """A file size limit (ulimit -f) of 1 MiB, under the tiny replica's 2.4 MiB: the write fails
    as on a full disk (EFBIG, as ENOSPC). Before, a traceback and the replica's folder stayed."""

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, resource.RLIM_INFINITY))

    full = subprocess.run(
        [QUILL, "bench", str(tiny_path), "--replica", *GRID],
        env=quill_env(home),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limited,
    )
    assert full.returncode == 8 and full.stderr.count("\n") == 1, full.stderr
    said = f"a replica of {tiny_path} needs 2.4 MiB of disk (writing it failed: File too large)"
    assert said in full.stderr
    assert "nothing was written: free some space" in full.stderr
    assert not (home / "cache" / "replicas").exists()


def test_a_relative_name_makes_no_hidden_folder(runner, home, tiny_path, tmp_path, monkeypatch):
    """../tiny.gguf once made the folder .._tiny.gguf-TAG, hidden from ls."""
    (tmp_path / "tiny.gguf").symlink_to(tiny_path)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    built = bench(runner, "../tiny.gguf")
    assert built.exit_code == 0, built.stderr
    (replica,) = list_replicas()
    assert replica.folder.name.startswith("_tiny.gguf-"), replica.folder.name
