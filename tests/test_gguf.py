"""quant/gguf.py, the one header reader, against the gguf package's own full reader."""

from __future__ import annotations

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, LlamaFileType

from quant.gguf import FILE_TYPES, GGML_TYPES, GGUFError, quant_type, read_gguf, read_header
from quant.memory import ModelShape


def test_the_type_tables_agree_with_ggml():
    known = {kind.value for kind in GGMLQuantizationType}
    for number, (name, block, size) in GGML_TYPES.items():
        if number not in known:  # newer than the gguf package (Q2_0: ggml-common.h's block_q2_0)
            assert number > max(known), name
            continue
        kind = GGMLQuantizationType(number)
        assert kind.name == name and GGML_QUANT_SIZES[kind] == (block, size)
    for number, name in FILE_TYPES.items():
        assert LlamaFileType(number).name.removeprefix("MOSTLY_").removeprefix("ALL_") == name


@pytest.mark.parametrize("which", ["smollm2_path", "tiny32_path"])
def test_the_lazy_header_matches_the_full_reader(request, which):
    path = request.getfixturevalue(which)
    full = GGUFReader(path)
    header = read_header(path, arrays=("tokenizer.ggml.tokens",))
    # same path: one file's header, read two ways
    assert header.get("tokenizer.ggml.tokens") == full.fields["tokenizer.ggml.tokens"].contents()
    lazy = read_header(path)
    for key, field in full.fields.items():
        if key.startswith("GGUF."):
            continue
        if lazy.fields[key] is None:  # an array skipped unless asked for: its length is known
            assert lazy.array_lengths[key] == len(field.data), key
        else:
            assert lazy.fields[key] == field.contents(), key
    assert [(t.name, t.shape, t.type_id, t.n_bytes) for t in lazy.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.n_bytes))
        for t in full.tensors
    ]
    info = read_gguf(path)
    assert info.parameters == sum(int(t.n_elements) for t in full.tensors)
    assert info.vocab_size == len(full.fields["tokenizer.ggml.tokens"].data)
    assert quant_type(path) == info.file_type
    assert ModelShape.from_gguf(path).n_vocab == info.vocab_size


def test_a_truncated_or_foreign_file_is_refused(tmp_path, smollm2_path):
    truncated = tmp_path / "short.gguf"
    truncated.write_bytes(smollm2_path.read_bytes()[:100_000])
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        read_header(truncated)
    foreign = tmp_path / "model.bin"
    foreign.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_header(foreign)
