"""A tiny llama with random weights, written with gguf's writer, for fast tests.

It borrows a real tokenizer (and chat template) from another GGUF, so prompts tokenize as they
would for a real model while each forward pass costs next to nothing.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


@functools.cache
def _tokenizer_fields(path: Path) -> tuple[tuple[str, Any, GGUFValueType, Any], ...]:
    """The tokenizer.* fields of a GGUF, read once per process (parsing 49k token strings is
    slow, and tests write many tiny models from one tokenizer)."""
    reader = GGUFReader(path)
    fields = []
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            fields.append((name, field.contents(), field.types[0], sub_type))
    return tuple(fields)


def write_tiny_llama(
    path: Path,
    tokenizer_from: Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 4096,
    seed: int = 0,
    chat_template: str | None = None,
    reverse_tokens_from: int | None = None,
) -> Path:
    """chat_template: one to write instead of the tokenizer file's ("" writes none);
    reverse_tokens_from: reverse the vocabulary from that id on (another vocabulary, same size)."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-random-llama")
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(1)  # mostly F16
    n_vocab = 0
    for name, value, value_type, sub_type in _tokenizer_fields(tokenizer_from):
        if name == "tokenizer.chat_template" and chat_template is not None:
            continue
        if name == "tokenizer.ggml.tokens" and reverse_tokens_from is not None:
            # Another vocabulary of the same size: ids from there on name other tokens.
            value = value[:reverse_tokens_from] + value[reverse_tokens_from:][::-1]
        writer.add_key_value(name, value, value_type, sub_type)
        if name == "tokenizer.ggml.tokens":
            n_vocab = len(value)

    if chat_template:
        writer.add_chat_template(chat_template)

    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv

    def weight(rows: int, cols: int, dtype: type = np.float32) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(dtype)

    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd, np.float16))
    for layer in range(n_layer):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{block}.attn_q.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"{block}.attn_k.weight", weight(n_embd_kv, n_embd))
        writer.add_tensor(f"{block}.attn_v.weight", weight(n_embd_kv, n_embd))
        writer.add_tensor(f"{block}.attn_output.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"{block}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"{block}.ffn_down.weight", weight(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weight(n_vocab, n_embd, np.float16))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
