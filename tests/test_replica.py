"""quant.replica: a replica keeps the real file's header exactly, loads, and holds no NaN/Inf."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize

from cli.engine.engine import Engine, LoadOptions
from cli.engine.sampling import SamplingParams
from quant.gguf import GGML_TYPES, GGUFError, HeaderIncomplete, read_header
from quant.partfiles import partial_path
from quant.replica import (
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
    values = dequantize(rows, GGMLQuantizationType(type_id))
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
