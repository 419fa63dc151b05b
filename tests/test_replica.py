"""quant.replica: a replica keeps the real file's header exactly, loads, and holds no NaN/Inf."""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize

from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from quant.gguf import GGML_TYPES, GGUFError, HeaderIncomplete, read_header
from quant.partfiles import partial_path
from quant.replica import (
    BUILD_BYTES,
    REPLICA_KEY,
    TEMPLATE_ROWS,
    _template,
    replica_bytes,
    replica_of,
    write_replica,
)


def replicate(source: Path, dest: Path, name: str = "the source") -> Path:
    prefix = source.read_bytes()[: read_header(source).data_start]
    write_replica(prefix, dest, name)
    assert dest.stat().st_size == replica_bytes(prefix, name)
    return dest


def check_replica(source: Path, replica: Path, name: str) -> None:
    arrays = read_header(source).array_lengths  # every array read too: the tokenizer's
    real, copy = read_header(source, arrays), read_header(replica, arrays)
    assert copy.tensors == real.tensors  # names, shapes, types and offsets
    assert copy.fields == {**real.fields, REPLICA_KEY: name}
    assert replica_of(copy) == name and replica_of(real) is None
    reader = GGUFReader(replica)
    seen: dict[int, int] = {}
    for tensor in sorted(reader.tensors, key=lambda t: t.n_bytes):  # the 3 smallest of each type
        if seen.setdefault(tensor.tensor_type, 0) < 3:
            seen[tensor.tensor_type] += 1
            values = dequantize(tensor.data, tensor.tensor_type)
            assert np.isfinite(values).all(), tensor.name
            assert values.std() > 0 or "norm" in tensor.name, tensor.name
    with Engine(replica, LoadOptions(n_ctx=128, threads=1)) as engine:
        steps = list(engine.stream_generate([1, 2, 3], 4, SamplingParams(temperature=0.0)))
    assert steps[-1].generation_tokens >= 1


def test_a_replica_of_the_tiny_model_has_its_header_and_loads(tiny_path: Path, tmp_path: Path):
    check_replica(tiny_path, replicate(tiny_path, tmp_path / "r.gguf", "tiny"), "tiny")


def test_a_replica_of_smollm2_has_its_header_and_loads(smollm2_path: Path, tmp_path: Path):
    replica = replicate(smollm2_path, tmp_path / "r.gguf", "smollm2-135m:q4_1")
    grown = read_header(replica).data_start - read_header(smollm2_path).data_start
    assert replica.stat().st_size == smollm2_path.stat().st_size + grown  # the key, padded
    check_replica(smollm2_path, replica, "smollm2-135m:q4_1")


# ggml builds the 1-2 bit types' search tables on first use: 1-11 s each on 2 cores.
SLOW_TO_INIT = {16, 17, 19, 22, 29}


@pytest.mark.parametrize(
    "type_id",
    [
        pytest.param(t, marks=[pytest.mark.slow] if t in SLOW_TO_INIT else [])
        for t, (_, block, _) in GGML_TYPES.items()
        if block > 1
    ],
)
def test_blocks_of_every_type_are_valid(type_id: int):
    """Each quantized type's template (ggml's quantizer on random rows) is finite when dequantized;
    Q8_1 and Q8_K, which ggml cannot quantize to (it would abort), are refused."""
    if type_id in (9, 15):
        with pytest.raises(GGUFError, match="cannot make Q8_"):
            _template(type_id, 256, "matrix")
        return
    rows = np.frombuffer(_template(type_id, 256, "matrix"), np.uint8).reshape(TEMPLATE_ROWS, -1)
    try:
        values = dequantize(rows, GGMLQuantizationType(type_id))
    except (ValueError, NotImplementedError):  # a type newer than this gguf-py; ggml made it
        pytest.skip(f"gguf-py cannot dequantize {GGML_TYPES[type_id][0]} to check its blocks")
    assert np.isfinite(values).all() and 0.03 < values.std() < 0.1  # about 256 ** -0.5


def test_a_prefix_short_of_the_header_is_incomplete(tiny_path: Path, tmp_path: Path):
    header = read_header(tiny_path)
    prefix = tiny_path.read_bytes()[: header.infos_end - 1]
    with pytest.raises(HeaderIncomplete):
        replica_bytes(prefix)
    with pytest.raises(HeaderIncomplete):
        write_replica(prefix, tmp_path / "r.gguf", "tiny")
    assert not (tmp_path / "r.gguf").exists()


def test_a_failed_write_leaves_no_file(tmp_path: Path):
    source = tmp_path / "ints.gguf"
    writer = GGUFWriter(source, "llama")
    writer.add_tensor("a.weight", np.ones((4, 64), np.float32))
    # I32 weights: no kind of block quill can make, found only after a.weight is written
    writer.add_tensor("b.weight", np.ones((4, 64), np.int32), raw_dtype=GGMLQuantizationType.I32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dest = tmp_path / "r.gguf"
    with pytest.raises(GGUFError, match="I32"):
        write_replica(source.read_bytes(), dest, "ints")
    assert not dest.exists() and not partial_path(dest).exists()


def test_a_replica_is_not_replicated_again(tiny_path: Path, tmp_path: Path):
    replica = replicate(tiny_path, tmp_path / "r.gguf", "tiny")
    with pytest.raises(GGUFError, match="a replica itself: replicate tiny instead"):
        write_replica(replica.read_bytes(), tmp_path / "rr.gguf", "r")


def header_only(target: Path, tensors: dict[str, tuple[tuple[int, ...], int, int]]) -> bytes:
    """The header of a GGUF of tensors {name: (ggml shape, type, bytes)} and no data: a plan."""
    writer = GGUFWriter(None, "llama")
    for name, (shape, type_id, n_bytes) in tensors.items():
        writer.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), n_bytes,
                               raw_dtype=GGMLQuantizationType(type_id))  # fmt: skip
    writer.write_header_to_file(target)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return target.read_bytes()


def test_a_large_tensor_is_written_in_bounded_chunks(tmp_path: Path):
    """256 MiB of F32 in rows of 2M values: before, a template of 61 whole rows held 512 MiB of
    floats (1.5 GiB at the peak); now writing holds at most BUILD_BYTES (28 MiB), whatever the
    shape, and the file takes no more disk than its plan."""
    shape = (2**21, 32)
    prefix = header_only(tmp_path / "plan.gguf", {"big.weight": (shape, 0, 4 * 2**26)})
    dest = tmp_path / "r.gguf"
    _template(0, 64, "scale")  # numpy and its generator loaded: not the writer's to count
    tracemalloc.start()
    try:
        write_replica(prefix, dest, "big")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BUILD_BYTES + 2 * len(prefix) + 2**20, f"{peak / 2**20:.1f} MiB"
    planned = replica_bytes(prefix, "big")
    assert dest.stat().st_size == planned > 2**28
    assert dest.stat().st_blocks * 512 <= planned + 2**16  # and the file system's extent blocks
    values = np.fromfile(dest, np.float32, 2**20, offset=read_header(dest).data_start)
    assert np.isfinite(values).all() and 0 < values.std() < 4 * shape[0] ** -0.5


def replace_offset(prefix: bytes, offset: int) -> bytes:
    """prefix with its last tensor's offset (the infos' last 8 bytes) set to offset."""
    end = read_header("prefix", whole=False, data=prefix).infos_end
    return prefix[: end - 8] + struct.pack("<Q", offset) + prefix[end:]


@pytest.mark.parametrize(
    "offset", [2**35, 4096 + 1, 4096 + 32, 4096 - 32, 0], ids=["far", "odd", "gap", "over", "same"]
)
def test_a_tensor_not_where_a_gguf_puts_it_is_refused(tmp_path: Path, offset: int):
    """Before, a tensor at 32 GiB passed, and its replica was a 32 GiB file (sparse on ext4)."""
    tensors = {"a.weight": ((64, 16), 0, 4096), "b.weight": ((64, 16), 0, 4096)}
    prefix = header_only(tmp_path / "plan.gguf", tensors)
    dest = tmp_path / "r.gguf"
    with pytest.raises(GGUFError, match=rf"tensor b\.weight is at offset {offset}, not 4096"):
        write_replica(replace_offset(prefix, offset), dest, "moved")
    assert not dest.exists() and not list(tmp_path.glob(".r.gguf.*"))


def test_an_alignment_not_a_power_of_2_is_refused(tmp_path: Path):
    """llama.cpp loads none: general.alignment 64 written, then made 48 (gguf-py writes none)."""
    writer = GGUFWriter(tmp_path / "odd.gguf", "llama")
    writer.add_custom_alignment(64)
    writer.add_tensor("a.weight", np.ones((4, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    key = struct.pack("<Q17sI", 17, b"general.alignment", 4)
    written = (tmp_path / "odd.gguf").read_bytes()
    odd = written.replace(key + struct.pack("<I", 64), key + struct.pack("<I", 48))
    with pytest.raises(GGUFError, match=r"general\.alignment is 48, not a power of 2"):
        write_replica(odd, tmp_path / "r.gguf", "odd")
    assert not (tmp_path / "r.gguf").exists()
