"""Random-weight GGUFs with the shapes, tokenizer and chat template of models people run, for
measuring at their scale (issue 27): speed and memory depend on shapes and weight types, not on
the trained values.

Usage (inside quill's venv):
  python -m benchmarks.shapes [NAME ...] [--out /work/shapes] [--type q4_k_m] [--threads 2]
  python -m benchmarks.shapes [NAME ...] --header-only

Each NAME (default: all, smallest first) is written as F16 with the gguf package's writer, one
tensor at a time (normal values scaled by 1/sqrt(row length), as a trained layer's are about;
norms ones), then quantized by quill's in-process quantizer (llama.cpp's own), so every tensor
gets the type llama-quantize gives the real model; the F16 is deleted after. The tokenizers come
from the llama-cpp-python sdist's vendor/llama.cpp/models/ggml-vocab-*.gguf (build_llama_bench.sh
unpacks it), the templates from its models/templates or as the model makers publish them.

--header-only writes no weights at all: the header llama-quantize would write for Q4_K_M (each
tensor's final type and size, by llama.cpp's llama_tensor_get_type rule for llama models, checked
against the quantized 1B file), named NAME.Q4_K_M.gguf.part as a download's start is, which
`quill bench --replica` turns into a replica in seconds (quantizing an 8B F16 takes many minutes
here). Seconds instead of an hour for the 8B shape; speed and memory are the same.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from quant.gguf import read_header
from quant.quantize import quantize

HERE = Path(__file__).resolve().parent
# Meta-Llama-3-8B-Instruct's tokenizer_config.json template (llama.cpp's test-chat-template.cpp
# carries it without the add_generation_prompt test).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    vocab: str  # ggml-vocab-VOCAB.gguf: the tokenizer, and any hyperparameter not given here
    template: str  # a file under the sdist's models/templates, or the template itself
    eos: int  # the instruct model's end of turn, as its published GGUFs carry it
    layers: int | None = None
    width: int | None = None
    ffn: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    context: int | None = None
    tied: bool = False  # no output.weight: the embedding matrix is reused
    rope_llama3: tuple[float, float, float, int] | None = None  # factor, low, high, old context


SHAPES = {
    # Llama-3.2-1B-Instruct's config.json (tie_word_embeddings, rope_type llama3).
    "llama-3.2-1b-shape": Shape(
        "llama-bpe",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        128009,
        layers=16,
        width=2048,
        ffn=8192,
        heads=32,
        kv_heads=8,
        context=131072,
        tied=True,
        rope_llama3=(32.0, 1.0, 4.0, 8192),
    ),
    # Llama-3.2-3B-Instruct's config.json: as the 1B, wider and deeper.
    "llama-3.2-3b-shape": Shape(
        "llama-bpe",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        128009,
        layers=28,
        width=3072,
        ffn=8192,
        heads=24,
        kv_heads=8,
        context=131072,
        tied=True,
        rope_llama3=(32.0, 1.0, 4.0, 8192),
    ),
    # Meta-Llama-3-8B: ggml-vocab-llama-bpe.gguf carries its hyperparameters.
    "llama-3-8b-shape": Shape("llama-bpe", LLAMA3_TEMPLATE, 128009),
}


def find_sdist() -> Path:
    candidates = [*sorted((HERE / ".build").glob("llama-cpp-python-*/src")), Path("/tmp/llama-src")]
    for candidate in candidates:
        if (candidate / "vendor/llama.cpp/models").is_dir():
            return candidate / "vendor/llama.cpp"
    raise SystemExit("no llama-cpp-python sdist: run benchmarks/build_llama_bench.sh first")


def sdist_name(llama_cpp_dir: Path) -> str:
    info = (llama_cpp_dir.parent.parent / "PKG-INFO").read_text()
    return "llama-cpp-python " + next(
        line.split()[1] for line in info.splitlines() if line.startswith("Version:")
    )


def rope_factors(base: float, dim: int, llama3: tuple[float, float, float, int]) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py rope_freqs for rope_type llama3 (conversion/llama.py)."""
    factor, low, high, old_context = llama3
    factors = []
    for freq in 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@dataclass(frozen=True)
class Dims:
    layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    n_vocab: int
    rope_base: float

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


def start_writer(
    name: str, shape: Shape, llama_cpp_dir: Path, path: Path, file_type: int
) -> tuple[GGUFWriter, Dims]:
    """A writer holding the model's metadata (hyperparameters, tokenizer, template), no tensors."""
    reader = GGUFReader(llama_cpp_dir / f"models/ggml-vocab-{shape.vocab}.gguf")
    arch = reader.fields["general.architecture"].contents()

    def given(value: int | None, key: str) -> int:
        return value if value is not None else reader.fields[f"{arch}.{key}"].contents()

    dims = Dims(
        given(shape.layers, "block_count"),
        given(shape.width, "embedding_length"),
        given(shape.ffn, "feed_forward_length"),
        given(shape.heads, "attention.head_count"),
        given(shape.kv_heads, "attention.head_count_kv"),
        len(reader.fields["tokenizer.ggml.tokens"].data),
        reader.fields[f"{arch}.rope.freq_base"].contents(),
    )
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"{name} (random weights)")
    writer.add_block_count(dims.layers)
    writer.add_context_length(given(shape.context, "context_length"))
    writer.add_embedding_length(dims.width)
    writer.add_feed_forward_length(dims.ffn)
    writer.add_head_count(dims.heads)
    writer.add_head_count_kv(dims.kv_heads)
    writer.add_rope_freq_base(dims.rope_base)
    writer.add_layer_norm_rms_eps(
        reader.fields[f"{arch}.attention.layer_norm_rms_epsilon"].contents()
    )
    writer.add_key_length(dims.head_dim)
    writer.add_value_length(dims.head_dim)
    writer.add_rope_dimension_count(dims.head_dim)
    writer.add_vocab_size(dims.n_vocab)
    writer.add_file_type(file_type)
    if file_type != 1:
        writer.add_quantization_version(2)  # as llama-quantize writes it
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            value = shape.eos if key == "tokenizer.ggml.eos_token_id" else field.contents()
            writer.add_key_value(key, value, field.types[0], sub_type)
    template = llama_cpp_dir / "models/templates" / shape.template
    writer.add_chat_template(
        template.read_text() if shape.template.endswith(".jinja") else shape.template
    )
    return writer, dims


def matrices(dims: Dims, tied: bool) -> list[tuple[str, int, int]]:
    """(name, rows, row length) of every tensor but rope_freqs; a norm's row length is 0."""
    kv_width = dims.kv_heads * dims.head_dim
    width, ffn = dims.width, dims.ffn
    found = [("token_embd.weight", dims.n_vocab, width)]
    for layer in range(dims.layers):
        block = f"blk.{layer}"
        found += [
            (f"{block}.attn_norm.weight", width, 0),
            (f"{block}.attn_q.weight", width, width),
            (f"{block}.attn_k.weight", kv_width, width),
            (f"{block}.attn_v.weight", kv_width, width),
            (f"{block}.attn_output.weight", width, width),
            (f"{block}.ffn_norm.weight", width, 0),
            (f"{block}.ffn_gate.weight", ffn, width),
            (f"{block}.ffn_up.weight", ffn, width),
            (f"{block}.ffn_down.weight", width, ffn),
        ]
    found.append(("output_norm.weight", width, 0))
    if not tied:
        found.append(("output.weight", dims.n_vocab, width))
    return found


def write_f16(name: str, shape: Shape, llama_cpp_dir: Path, path: Path, seed: int = 0) -> None:
    writer, dims = start_writer(name, shape, llama_cpp_dir, path, 1)  # mostly F16
    tensors = matrices(dims, shape.tied)
    extra = {}
    if shape.rope_llama3:
        extra["rope_freqs.weight"] = rope_factors(dims.rope_base, dims.head_dim, shape.rope_llama3)
    for tensor_name, values in extra.items():
        writer.add_tensor_info(tensor_name, values.shape, values.dtype, values.nbytes)
    for tensor_name, rows, cols in tensors:  # norms (cols 0) are F32 vectors, as converted
        dtype, shape_ = (
            (np.dtype(np.float16), (rows, cols)) if cols else (np.dtype(np.float32), (rows,))
        )
        writer.add_tensor_info(tensor_name, shape_, dtype, dtype.itemsize * rows * max(cols, 1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for values in extra.values():
        writer.write_tensor_data(values)
    rng = np.random.default_rng(seed)
    for _, rows, cols in tensors:
        if not cols:
            writer.write_tensor_data(np.ones(rows, dtype=np.float32))
            continue
        tensor = np.empty((rows, cols), dtype=np.float16)
        step = max(1, (1 << 22) // cols)  # 4M values at a time: a float32 draw of 16 MB
        for start in range(0, rows, step):
            chunk = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
            chunk *= 1 / math.sqrt(cols)
            tensor[start : start + len(chunk)] = chunk
        writer.write_tensor_data(tensor)
    writer.close()


def use_more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's choice of the layers that keep more bits (llama-quant.cpp)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(tensor_name: str, layers: int, tied: bool) -> GGMLQuantizationType:
    """The type llama-quantize gives a llama tensor in a Q4_K_M file: the output matrix (the
    token embeddings where tied) Q6_K, attn_v and ffn_down Q6_K in the layers that keep more
    bits, norms F32, every other matrix Q4_K."""
    kind = tensor_name.split(".")[-2]
    layer = int(tensor_name.split(".")[1]) if tensor_name.startswith("blk.") else -1
    if tensor_name == "output.weight" or (tied and tensor_name == "token_embd.weight"):
        return GGMLQuantizationType.Q6_K
    if kind in ("attn_v", "ffn_down") and use_more_bits(layer, layers):
        return GGMLQuantizationType.Q6_K
    return GGMLQuantizationType.Q4_K


def write_header_only(name: str, shape: Shape, llama_cpp_dir: Path, path: Path) -> None:
    """The header llama-quantize would write for Q4_K_M, without the weights."""
    writer, dims = start_writer(name, shape, llama_cpp_dir, path, 15)  # MOSTLY_Q4_K_M
    float32 = np.dtype(np.float32)
    if shape.rope_llama3:
        size = dims.head_dim // 2 * 4
        writer.add_tensor_info("rope_freqs.weight", (dims.head_dim // 2,), float32, size)
    for tensor_name, rows, cols in matrices(dims, shape.tied):
        if not cols:
            writer.add_tensor_info(tensor_name, (rows,), float32, rows * 4)
            continue
        kind = q4_k_m_type(tensor_name, dims.layers, shape.tied)
        block, size = GGML_QUANT_SIZES[kind]
        writer.add_tensor_info(
            tensor_name, (rows, cols), float32, rows * cols // block * size, raw_dtype=kind
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def make_header_only(name: str, out: Path) -> dict:
    llama_cpp_dir = find_sdist()
    final = out / f"{name}.Q4_K_M.gguf.part"
    write_header_only(name, SHAPES[name], llama_cpp_dir, final)
    header = read_header(final, whole=False)
    record = {
        "name": name,
        "path": str(final),
        "header_bytes": final.stat().st_size,
        "bytes": header.size,
        "parameters": sum(t.n_elements for t in header.tensors),
        "tensor_types": dict(Counter(t.type_name for t in header.tensors).most_common()),
        "header_only": True,
        "tokenizer": f"ggml-vocab-{SHAPES[name].vocab}.gguf of {sdist_name(llama_cpp_dir)}",
    }
    (out / f"{name}.Q4_K_M.header.json").write_text(json.dumps(record, indent=1))
    return record


def make(name: str, out: Path, weight_type: str, threads: int, keep_f16: bool) -> dict:
    llama_cpp_dir = find_sdist()
    f16 = out / f"{name}.F16.gguf"
    final = out / f"{name}.{weight_type.upper()}.gguf"
    started = time.perf_counter()
    if not f16.exists():
        write_f16(name, SHAPES[name], llama_cpp_dir, f16.with_suffix(".part"))
        f16.with_suffix(".part").replace(f16)
    written = time.perf_counter() - started
    result = quantize(f16, final, weight_type, threads, force=True)
    if not keep_f16:
        f16.unlink()
    header = read_header(final)
    record = {
        "name": name,
        "path": str(final),
        "bytes": final.stat().st_size,
        "parameters": result.parameters,
        "tensor_types": dict(Counter(t.type_name for t in header.tensors).most_common()),
        "f16_seconds": round(written, 1),
        "quantize_seconds": round(result.seconds, 1),
        "threads": threads,
        "tokenizer": f"ggml-vocab-{SHAPES[name].vocab}.gguf of {sdist_name(llama_cpp_dir)}",
    }
    (out / f"{final.stem}.json").write_text(json.dumps(record, indent=1))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"of {', '.join(SHAPES)} (default: all)")
    parser.add_argument("--out", type=Path, default=Path("/work/shapes"))
    parser.add_argument("--type", default="q4_k_m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-f16", action="store_true")
    parser.add_argument(
        "--header-only",
        action="store_true",
        help="only the Q4_K_M header, as NAME.Q4_K_M.gguf.part",
    )
    args = parser.parse_args()
    if unknown := set(args.names) - set(SHAPES):
        parser.error(f"unknown shape {', '.join(sorted(unknown))}; known: {', '.join(SHAPES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or list(SHAPES):
        if args.header_only:
            if args.type != "q4_k_m":
                parser.error("--header-only writes Q4_K_M headers only")
            print(json.dumps(make_header_only(name, args.out)), flush=True)
            continue
        print(json.dumps(make(name, args.out, args.type, args.threads, args.keep_f16)), flush=True)


if __name__ == "__main__":
    main()
