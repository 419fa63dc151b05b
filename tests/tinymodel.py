"""A tiny llama with random weights, written with gguf's writer, for fast tests.

By default it carries a tokenizer of its own (tiny_vocabulary below), so the fast tests need no
downloaded model; it can instead borrow a real tokenizer (and chat template) from another GGUF,
where a test needs that vocabulary (a draft model for SmolLM2 must share SmolLM2's tokens).
Either way each forward pass costs next to nothing.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, TokenType

# The text the tiny vocabulary is fitted to, so that English, JSON and chat templates cost about as
# many tokens as with SmolLM2: the GPL-3 text the quality tests read, the published chat templates
# the template tests render, and the words and JSON punctuation of the tests' prompts and schemas.
DATA = Path(__file__).parent / "data"
FITTED_TO = [DATA / "gpl-3.txt", *sorted((DATA / "templates").glob("*.jinja"))]
PROMPT_WORDS = (  # one string, split where it is read
    "hello hi there word words river merchant old bridge neighbour library remembers carries "
    "watches describes forgets winter market quiet harbour seven green lanterns long road year "
    "short record records please count write story about dragon capital france paris answer one "
    "sentence why first token slow weather city thanks name age point points tell me what how "
    "yes no ok okay good morning night day reply only value matches schema json object string "
    "integer number boolean array null type properties items required minimum maximum minLength "
    "maxLength minItems maxItems exclusiveMinimum exclusiveMaximum enum const format pattern date "
    "uuid defs ref anyOf oneOf allOf additionalProperties place floor home score born code tags "
    "nickname where kind red blue true false get function arguments tool tools call "
    "description parameters content role user assistant system think"
)
JSON_PIECES = (  # as the pre-tokenizer cuts JSON: a space only in front; split at |
    '{"|":|",|"}|"]|["|}}|}]|},|"},| {"| "| [|[{|":{|":[|":"|"}}'
)
# SmolLM2's ChatML template, with a default system line of the tiny model's own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # unknown, BOS, EOS: as SmolLM2


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 bytes (its bytes_to_unicode table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[byte] for byte in range(256)]


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-level BPE as GPT-2 applies it: the best-ranked adjacent pair first, until none."""
    while len(symbols) > 1:
        pairs = [
            (ranks.get(pair, len(ranks)), i) for i, pair in enumerate(itertools.pairwise(symbols))
        ]
        rank, at = min(pairs)
        if rank == len(ranks):
            break
        symbols = [*symbols[:at], symbols[at] + symbols[at + 1], *symbols[at + 2 :]]
    return symbols


@functools.cache
def tiny_vocabulary() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A GPT-2-style byte-level BPE vocabulary and its merges, laid out as SmolLM2's is (the
    ChatML tokens at 0-2, no BOS added), but some 10,000 tokens instead of 49,152.

    Every byte is a token, so any text tokenizes and detokenizes back to itself. The commonest
    pieces of the fitted text (words with and without the space before them, JSON punctuation)
    come first; each is made one token by adding, after all earlier merges, the merges its
    tokenization still lacks, joining from the left. A merge added last never changes an earlier
    piece's tokenization (BPE always takes the best-ranked pair), so each listed piece is one token.
    """
    to_symbol = _byte_symbols()
    counts: Counter[str] = Counter()
    for source in FITTED_TO:
        text = source.read_text(encoding="utf-8")
        counts.update(re.findall(r" ?[A-Za-z]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)", text))
    for width in range(1, 33):  # indentation, as JSON and templates are written
        counts[" " * width] += 1
        counts["\n" + " " * (width - 1)] += 1
    for word in PROMPT_WORDS.split():
        for piece in (word, " " + word, word.capitalize(), " " + word.capitalize()):
            counts[piece] += 1
    for piece in JSON_PIECES.split("|"):
        counts[piece] += 1
    tokens = [*SPECIAL_TOKENS, *to_symbol]
    known = set(tokens)
    ranks: dict[tuple[str, str], int] = {}
    for piece in sorted(counts, key=lambda piece: (-counts[piece], piece)):
        parts = _bpe([to_symbol[byte] for byte in piece.encode("utf-8")], ranks)
        while len(parts) > 1:
            ranks[parts[0], parts[1]] = len(ranks)
            if parts[0] + parts[1] not in known:  # two merges may spell one token
                known.add(parts[0] + parts[1])
                tokens.append(parts[0] + parts[1])
            parts = _bpe(parts, ranks)
    if len(tokens) % 2:  # an even vocabulary: tests flip a token's lowest bit for another token
        space = to_symbol[ord(" ")]
        wider = next(space * n for n in itertools.count(2) if space * n not in known)
        tokens.append(wider)
        ranks[wider[:-1], space] = len(ranks)
    return tuple(tokens), tuple(f"{left} {right}" for left, right in ranks)


def _own_tokenizer_fields() -> tuple[tuple[str, Any, GGUFValueType, Any], ...]:
    tokens, merges = tiny_vocabulary()
    types = [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    types += [TokenType.NORMAL] * (len(tokens) - len(SPECIAL_TOKENS))
    array, string, integer = GGUFValueType.ARRAY, GGUFValueType.STRING, GGUFValueType.INT32
    return (
        ("tokenizer.ggml.model", "gpt2", string, None),
        ("tokenizer.ggml.pre", "smollm", string, None),  # digits one by one, as SmolLM2's
        ("tokenizer.ggml.tokens", list(tokens), array, string),
        ("tokenizer.ggml.token_type", [int(t) for t in types], array, integer),
        ("tokenizer.ggml.merges", list(merges), array, string),
        ("tokenizer.ggml.bos_token_id", 1, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.eos_token_id", 2, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.unknown_token_id", 0, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.padding_token_id", 2, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.add_bos_token", False, GGUFValueType.BOOL, None),
        ("tokenizer.ggml.add_space_prefix", False, GGUFValueType.BOOL, None),
        ("tokenizer.chat_template", CHATML_TEMPLATE, string, None),
    )


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
    tokenizer_from: Path | None = None,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 4096,
    seed: int = 0,
    chat_template: str | list[dict[str, str]] | None = None,
    reverse_tokens_from: int | None = None,
) -> Path:
    """tokenizer_from: a GGUF whose tokenizer (and template) to borrow; None writes the tiny
    vocabulary; chat_template: one to write instead of the tokenizer's ("" writes none);
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
    fields = (
        _own_tokenizer_fields() if tokenizer_from is None else _tokenizer_fields(tokenizer_from)
    )
    for name, value, value_type, sub_type in fields:
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
