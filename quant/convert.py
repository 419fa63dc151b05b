"""A BERT-family model folder as sentence-transformers and the Hub keep it (config.json, model
*.safetensors, a WordPiece tokenizer, 1_Pooling/) to one GGUF file, without torch.

llama.cpp's own convert_hf_to_gguf.py imports torch at module level, and torch is not on every
package index quill's users reach. This module writes the file that converter writes for the same
folder (its BertModel class, conversion/bert.py, and the base classes in conversion/base.py): arch
"bert", the same metadata keys and values in the same order, the same tokenizer arrays, the same
tensor names, shapes and types, with names from the gguf package's own map and its writer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import string
import struct
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from quant.partfiles import check_replaceable, partial_path, remove_stale_parts


class ConversionError(ValueError):
    """A folder that cannot be converted (not a BERT model, files missing or unreadable), or an
    output that cannot be written; the message says which and why."""


# config.json "architectures" the converter's BertModel class is registered for, less
# CamembertModel, whose SentencePiece tokenizer is another converter path.
ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification")

# --outtype: the file type recorded in general.file_type and the type of the 2-D weights.
_T = gguf.GGMLQuantizationType
OUTTYPES: dict[str, tuple[gguf.LlamaFileType, gguf.GGMLQuantizationType]] = {
    "f32": (gguf.LlamaFileType.ALL_F32, _T.F32),
    "f16": (gguf.LlamaFileType.MOSTLY_F16, _T.F16),
    "bf16": (gguf.LlamaFileType.MOSTLY_BF16, _T.BF16),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, _T.Q8_0),
}

# The converter names the tokenizer's pre-tokenizer by hashing the ids its tokenizer gives this
# text (get_vocab_base_pre); llama.cpp reads the name back. The text is copied from it verbatim.
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multipl"
    "e emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3."
    ".3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE "
    "you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
# The converter's hashes of WordPiece tokenizers. It tests 0876d13b... twice, as "bert-bge" and
# later as "jina-v2-en", and the later test wins: its files for bge-small and all-MiniLM say
# "jina-v2-en" (llama.cpp treats every WordPiece vocabulary alike whatever the name).
PRE_TOKENIZERS = {
    "0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f": "jina-v2-en",
    "8e62295832751ca1e8f92f2226f403dea30dc5165e448b5bfa05af5340c64ec7": "bert-bge-large",
}


def convert_bert(folder: Path, out: Path, *, outtype: str = "f16") -> None:
    """Write folder's model to out as GGUF, through a part file renamed over out only once the
    file is complete (an interrupted conversion leaves no out). The folder's name takes part in
    the metadata (general.basename, version) as it does for the converter."""
    if outtype not in OUTTYPES:
        raise ConversionError(f"unknown outtype {outtype!r}: choose one of {', '.join(OUTTYPES)}")
    folder = Path(folder)
    config = read_config(folder)
    file_type, weight_type = OUTTYPES[outtype]
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])
    add_tensors(writer, folder, config, weight_type)
    add_metadata(writer, folder, config, file_type)
    add_vocab(writer, folder, config)
    write_replacing_gguf(writer, Path(out))


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversionError(f"{path.parent} has no {path.name}") from None
    except (OSError, ValueError) as error:
        raise ConversionError(f"cannot read {path}: {error}") from error


def read_config(folder: Path) -> dict[str, Any]:
    """config.json, checked to be a BERT model this converter knows."""
    if not folder.is_dir():
        raise ConversionError(f"{folder} is not a folder")
    config = _json(folder / "config.json")
    if not isinstance(config, dict):
        raise ConversionError(f"{folder / 'config.json'}: expected a JSON object")
    architectures = config.get("architectures") or [None]
    if architectures[0] not in ARCHITECTURES:
        raise ConversionError(
            f"{folder} holds a {architectures[0] or config.get('model_type') or 'unnamed'} "
            f"model; this converter takes BERT models only ({', '.join(ARCHITECTURES)})"
        )
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        if not isinstance(config.get(key), int):
            raise ConversionError(f"{folder / 'config.json'}: {key} is missing")
    return config


def classifier_labels(config: dict[str, Any]) -> list[str] | None:
    """A sequence classifier's output labels, or None where they are the two placeholders that
    transformers' AutoConfig invents for a config without any (the converter's test)."""
    id2label = config.get("id2label")
    if id2label is None:  # AutoConfig's default: num_labels placeholders
        id2label = {i: f"LABEL_{i}" for i in range(config.get("num_labels", 2))}
    labels = {int(k): v for k, v in id2label.items()}
    if len(labels) == 2 and labels.get(0) == "LABEL_0":
        return None
    return [v for _, v in sorted(labels.items())] or None


# ---- tensors ----------------------------------------------------------------------------------


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files in the converter's order: the index's files sorted, else every
    model*.safetensors sorted."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{index}: no weight_map")
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in folder.glob("model*.safetensors"))
    if not names:
        bins = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
        why = f" ({bins[0]} is a torch pickle, which needs torch)" if bins else ""
        raise ConversionError(f"{folder} has no model.safetensors{why}")
    return [folder / name for name in names]


def _read_bf16(path: Path, name: str) -> np.ndarray:
    """A BF16 tensor as F32 (numpy has no bfloat16, so safetensors' numpy API refuses it): read
    from the file's layout, an 8-byte header length, a JSON header, then the data."""
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        entry = json.loads(file.read(length))[name]
        start, end = entry["data_offsets"]
        file.seek(8 + length + start)
        raw = np.frombuffer(file.read(end - start), dtype="<u2")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def read_tensors(folder: Path) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(name, loader) for every tensor, file by file and by name within a file (the order the
    converter adds them in, so the tensors lie in the same order in both files)."""
    from safetensors import safe_open

    for path in _weight_files(folder):
        try:
            with safe_open(str(path), framework="np") as weights:
                kinds = {name: weights.get_slice(name).get_dtype() for name in weights.keys()}  # noqa: SIM118
        except Exception as error:  # safetensors raises its own SafetensorError and OSError
            raise ConversionError(f"cannot read {path}: {error}") from error
        for name, kind in kinds.items():
            yield name, _loader(path, name, kind)


def _loader(path: Path, name: str, kind: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        if kind == "BF16":
            return _read_bf16(path, name)
        from safetensors import safe_open

        with safe_open(str(path), framework="np") as weights:
            data = weights.get_tensor(name)
        # The converter turns anything but F16 and F32 into F32 before choosing a type.
        return data if data.dtype in (np.float16, np.float32) else data.astype(np.float32)

    return load


def hf_tensor_name(name: str, labels: list[str] | None) -> str | None:
    """The converter's BertModel.filter_tensors and modify_tensors: the name the tensor map
    knows, or None for a tensor it drops (the pooler and the masked-LM and next-sentence heads,
    which an embedding model does not run)."""
    name = name.removeprefix("bert.")
    if name.endswith(".gamma"):  # old TensorFlow-era LayerNorm names
        name = name[: -len(".gamma")] + ".weight"
    if name.endswith(".beta"):
        name = name[: -len(".beta")] + ".bias"
    if name in ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"):
        return None
    if name.startswith(("cls.predictions", "cls.seq_relationship")):
        return None
    if name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")):
        return None
    if labels and name in ("classifier.weight", "classifier.bias"):
        # a sequence classifier's single projection is llama.cpp's cls.output (the rank head)
        name = name.replace("classifier.", "classifier.out_proj.")
    return name


def tensor_type(gguf_name: str, n_dims: int, weights: gguf.GGMLQuantizationType) -> Any:
    """The converter's choice: F32 for 1-D tensors, norms and biases (ggml's kernels for them
    take F32), and for the position and token-type embeddings (llama.cpp's quantizer keeps them
    in F32 too); the outtype for every other weight matrix."""
    kept = (gguf.MODEL_TENSOR.POS_EMBD, gguf.MODEL_TENSOR.TOKEN_TYPES)
    if n_dims <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return _T.F32
    if gguf_name in {gguf.TENSOR_NAMES[k] + ".weight" for k in kept}:
        return _T.F32
    return weights


def add_tensors(writer: Any, folder: Path, config: dict[str, Any], weights: Any) -> None:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, config["num_hidden_layers"])
    labels = classifier_labels(config)
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    for name, load in read_tensors(folder):
        renamed = hf_tensor_name(name, labels)
        if renamed is not None:
            loaders[renamed] = load
    for name, load in loaders.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ConversionError(f"{folder}: tensor {name!r} is not part of a BERT model")
        data = load()
        kind = tensor_type(gguf_name, data.ndim, weights)
        try:
            data = gguf.quants.quantize(data, kind)
        except gguf.QuantError:  # rows not a multiple of the block: F16, as the converter does
            kind = _T.F16
            data = gguf.quants.quantize(data, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
    if not loaders:
        raise ConversionError(f"{folder}: the weight files hold no tensors")


# ---- metadata ---------------------------------------------------------------------------------


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """The converter's find_hparam: the value of the first of keys the config has."""
    return next((config[k] for k in keys if k in config), None)


def add_metadata(writer: Any, folder: Path, config: dict[str, Any], file_type: Any) -> None:
    """general.* from the folder (model card, config, name) as the converter's prepare_metadata
    gathers it, then the model's hyperparameters in its order (TextModel, then BertModel)."""
    total, shared, expert, experts = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, folder, None, total)
    if metadata.name is None:
        metadata.name = folder.name
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, experts)
    writer.add_type(gguf.GGUFType.MODEL)
    metadata.set_gguf_meta_model(writer)
    writer.add_block_count(config["num_hidden_layers"])
    context = ("max_position_embeddings", "n_ctx", "n_positions", "max_length")
    if (n_ctx := _first(config, (*context, "max_sequence_length", "model_max_length"))) is not None:
        writer.add_context_length(n_ctx)
    writer.add_embedding_length(config["hidden_size"])
    feed_forward = ("prefix_dense_intermediate_size", "dense_intermediate_size")
    if (n_ff := _first(config, (*feed_forward, "intermediate_size", "n_inner"))) is not None:
        writer.add_feed_forward_length(n_ff)
    writer.add_head_count(config["num_attention_heads"])
    if (n_kv := _first(config, ("num_key_value_heads", "n_kv_heads"))) is not None:
        writer.add_head_count_kv(n_kv)
    norm = ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")
    if (eps := _first(config, norm)) is not None:
        writer.add_layer_norm_eps(eps)
    writer.add_file_type(file_type)
    writer.add_causal_attention(False)  # BERT attends both ways
    if (pooling := pooling_type(folder)) is not None:
        writer.add_pooling_type(pooling)
    if labels := classifier_labels(config):
        writer.add_classifier_output_labels(labels)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def pooling_type(folder: Path) -> gguf.PoolingType | None:
    """The pooling of sentence-transformers' Pooling module (modules.json names its folder):
    what llama.cpp pools token vectors with unless told otherwise; None without such a module
    (a cross-encoder), as the converter leaves it."""
    if not (folder / "modules.json").is_file():
        return None
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConversionError(f"{folder / 'modules.json'}: expected a list of modules")
    path = next((m.get("path") for m in modules if str(m.get("type")).endswith("Pooling")), None)
    if path is None:
        return None
    pooling = _json(folder / path / "config.json")
    modes = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS}
    modes["lasttoken"] = gguf.PoolingType.LAST
    if pooling.get("pooling_mode_mean_tokens"):
        return gguf.PoolingType.MEAN
    if pooling.get("pooling_mode_cls_token"):
        return gguf.PoolingType.CLS
    if pooling.get("pooling_mode_lasttoken"):
        return gguf.PoolingType.LAST
    if pooling.get("pooling_mode") in modes:
        return modes[pooling["pooling_mode"]]
    raise ConversionError(f"{folder / path}: only mean, CLS and last-token pooling are supported")


# ---- vocabulary -------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddedToken:
    id: int
    special: bool


def read_vocab(folder: Path) -> tuple[dict[str, int], dict[str, AddedToken], dict[str, Any]]:
    """(token -> id, added tokens, tokenizer.json or {}): what transformers' AutoTokenizer reads,
    tokenizer.json first (the fast tokenizer), else vocab.txt with the special tokens that
    tokenizer_config.json and special_tokens_map.json name."""
    if (folder / "tokenizer.json").is_file():
        data = _json(folder / "tokenizer.json")
        model = data.get("model") or {}
        if model.get("type") != "WordPiece":
            kind = model.get("type") or "unknown"
            raise ConversionError(f"{folder}: a {kind} tokenizer; BERT's is WordPiece")
        try:
            listed = data.get("added_tokens") or []
            added = {t["content"]: AddedToken(t["id"], t.get("special", False)) for t in listed}
            vocab = dict(model["vocab"]) | {token: a.id for token, a in added.items()}
        except (KeyError, TypeError, ValueError) as error:
            raise ConversionError(f"{folder / 'tokenizer.json'} is malformed: {error!r}") from None
        return vocab, added, data
    if not (folder / "vocab.txt").is_file():
        raise ConversionError(f"{folder} has no tokenizer (tokenizer.json or vocab.txt)")
    lines = (folder / "vocab.txt").read_text(encoding="utf-8").split("\n")
    lines = lines[:-1] if lines and lines[-1] == "" else lines
    vocab = {token: i for i, token in enumerate(lines)}  # a repeated line: its last id, as BERT's
    added = {t: AddedToken(vocab[t], True) for t in special_tokens(folder) if t in vocab}
    return vocab, added, {}


def special_tokens(folder: Path) -> list[str]:
    """The special tokens a vocab.txt tokenizer is configured with."""
    names: list[str | None] = []
    for file in ("special_tokens_map.json", "tokenizer_config.json"):
        config = _json(folder / file) if (folder / file).is_file() else {}
        for key in ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
            names.append(_content(config.get(key)))
        names += map(_content, config.get("additional_special_tokens") or [])
        names += map(_content, (config.get("added_tokens_decoder") or {}).values())
    return [name for name in dict.fromkeys(names) if isinstance(name, str)]


def looks_special(token: str) -> bool:
    """The converter's does_token_look_special, for added tokens not marked special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def token_list(
    folder: Path, vocab: dict[str, int], added: dict[str, AddedToken], config: dict[str, Any]
) -> tuple[list[str], list[int]]:
    """(tokens, their types): the converter's get_vocab_base, then BertModel's phantom-space
    spelling: a word's first piece gets "▁" and a "##" continuation loses its prefix (llama.cpp's
    WordPiece tokenizer matches on that spelling)."""
    size = config.get("vocab_size", len(vocab))
    if not vocab or max(vocab.values()) >= size:
        raise ConversionError(f"{folder}: the tokenizer's ids do not fit vocab_size {size}")
    by_id = {i: token for token, i in vocab.items()}
    tokens, types = [], []
    for i in range(size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added and (added[token].special or looks_special(token)):
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL)
        elif token in added:
            tokens.append(token.replace("\u2581", " "))  # user-defined spaces, pre-normalized
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    spelled = [_phantom(token, kind) for token, kind in zip(tokens, types, strict=True)]
    return spelled, [int(kind) for kind in types]


def _phantom(token: str, kind: int) -> str:
    if kind == gguf.TokenType.CONTROL:
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def add_vocab(writer: Any, folder: Path, config: dict[str, Any]) -> None:
    """BertModel.set_vocab: token type count, tokenizer model and pre-tokenizer, tokens, types,
    then the special tokens gguf's SpecialVocab finds."""
    vocab, added, data = read_vocab(folder)
    tokens, types = token_list(folder, vocab, added, config)
    writer.add_token_type_count(config.get("type_vocab_size", 1))
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre(pre_tokenizer(folder, vocab, data))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, n_vocab=len(tokens))
    # gguf warns that its writer has no key for the cls token (neither has the converter's): a
    # line on stderr the user can do nothing about.
    quiet = logging.getLogger("gguf.vocab")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        special.add_to_gguf(writer, quiet=True)
    finally:
        quiet.setLevel(level)
    if not hasattr(special, "normalizer_lowercase"):
        add_normalizer(writer, data.get("normalizer") or {})


def add_normalizer(writer: Any, normalizer: dict[str, Any]) -> None:
    """tokenizer.ggml.normalizer.*: llama.cpp's gguf-py reads them from tokenizer.json (lowercase
    only where said; strip_accents only where not null), the gguf package on PyPI does not yet."""
    flags = normalizer_flags(normalizer)
    if flags.get("lowercase") is not None:
        writer.add_bool("tokenizer.ggml.normalizer.lowercase", flags["lowercase"])
    if flags.get("strip_accents") is not None:
        writer.add_bool("tokenizer.ggml.normalizer.strip_accents", flags["strip_accents"])


def normalizer_flags(normalizer: dict[str, Any]) -> dict[str, Any]:
    kind = normalizer.get("type")
    if kind == "Lowercase":
        return {"lowercase": True}
    if kind == "StripAccents":
        return {"strip_accents": True}
    if kind == "BertNormalizer":
        return {k: normalizer[k] for k in ("lowercase", "strip_accents") if k in normalizer}
    flags: dict[str, Any] = {}
    for part in normalizer.get("normalizers", []) if kind == "Sequence" else []:
        flags |= normalizer_flags(part)
    return flags


# ---- the pre-tokenizer's name -----------------------------------------------------------------

# Rust's char::is_whitespace (Unicode White_Space), which Hugging Face's tokenizers split on.
_SPACES = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | frozenset(
    map(chr, range(0x2000, 0x200B))
)
_CJK = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)  # fmt: skip


@dataclass(frozen=True)
class WordPiece:
    """BERT's tokenizer (BertNormalizer, BertPreTokenizer, WordPiece, [CLS] ... [SEP]) as
    Hugging Face's tokenizers runs it, in plain Python: the ids the converter hashes come from
    it, so the pre-tokenizer is named without transformers or tokenizers installed."""

    vocab: dict[str, int]
    lowercase: bool = True
    strip_accents: bool | None = None  # None: as lowercase
    chinese_chars: bool = True
    clean_text: bool = True
    unk: str = "[UNK]"
    prefix: str = "##"
    max_chars: int = 100
    cls: str = "[CLS]"
    sep: str = "[SEP]"

    def encode(self, text: str) -> list[int]:
        pieces = [i for word in split_words(self.normalize(text)) for i in self.pieces(word)]
        return [self.vocab[self.cls], *pieces, self.vocab[self.sep]]

    def normalize(self, text: str) -> str:
        if self.clean_text:  # drop NUL, U+FFFD and control characters; any space is " "
            kept = (c for c in text if c not in "\0\ufffd" and not _is_control(c))
            text = "".join(" " if c in _SPACES else c for c in kept)
        if self.chinese_chars:  # each CJK ideograph a word of its own
            text = "".join(f" {c} " if _is_cjk(c) else c for c in text)
        if self.lowercase if self.strip_accents is None else self.strip_accents:
            decomposed = unicodedata.normalize("NFD", text)
            text = "".join(c for c in decomposed if unicodedata.category(c) != "Mn")
        if self.lowercase:  # character by character, as Rust does (no final-sigma rule)
            text = "".join(c.lower() for c in text)
        return text

    def pieces(self, word: str) -> list[int]:
        """Greedy longest-match-first; a word with any unmatched rest is [UNK] as a whole."""
        if len(word) > self.max_chars:
            return [self.vocab[self.unk]]
        ids, start = [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                if piece in self.vocab:
                    ids.append(self.vocab[piece])
                    start = end
                    break
            else:
                return [self.vocab[self.unk]]
        return ids


def _is_control(c: str) -> bool:
    return c not in "\t\n\r" and unicodedata.category(c).startswith("C")


def _is_cjk(c: str) -> bool:
    return any(low <= ord(c) <= high for low, high in _CJK)


def _is_punctuation(c: str) -> bool:
    return c in string.punctuation or unicodedata.category(c).startswith("P")


def split_words(text: str) -> list[str]:
    """BertPreTokenizer: split on spaces (dropped) and around each punctuation character."""
    words: list[str] = []
    for chunk in "".join(" " if c in _SPACES else c for c in text).split(" "):
        current = ""
        for c in chunk:
            if _is_punctuation(c):
                words += [current, c] if current else [c]
                current = ""
            else:
                current += c
        if current:
            words.append(current)
    return words


def wordpiece(folder: Path, vocab: dict[str, int], data: dict[str, Any]) -> WordPiece:
    """The tokenizer the folder describes: tokenizer.json's normalizer and model, else
    tokenizer_config.json's flags for a vocab.txt; the sentence marks it names either way."""
    path = folder / "tokenizer_config.json"
    config = _json(path) if path.is_file() else {}
    marks: dict[str, str] = {
        kind: _content(config.get(f"{kind}_token")) or f"[{kind.upper()}]"
        for kind in ("cls", "sep", "unk")
    }
    if not data:
        return WordPiece(
            vocab,
            lowercase=config.get("do_lower_case", True),
            strip_accents=config.get("strip_accents"),
            chinese_chars=config.get("tokenize_chinese_chars", True),
            unk=marks["unk"],
            cls=marks["cls"],
            sep=marks["sep"],
        )
    normalizer, model = data.get("normalizer") or {}, data["model"]
    pre = (data.get("pre_tokenizer") or {}).get("type")
    if normalizer.get("type") != "BertNormalizer" or pre != "BertPreTokenizer":
        raise ConversionError(f"{folder}: tokenizer.json is not BERT's (normalizer, pre-tokenizer)")
    return WordPiece(
        vocab,
        lowercase=normalizer.get("lowercase", True),
        strip_accents=normalizer.get("strip_accents"),
        chinese_chars=normalizer.get("handle_chinese_chars", True),
        clean_text=normalizer.get("clean_text", True),
        prefix=model.get("continuing_subword_prefix", "##"),
        max_chars=model.get("max_input_chars_per_word", 100),
        unk=model.get("unk_token", marks["unk"]),
        cls=marks["cls"],
        sep=marks["sep"],
    )


def _content(token: Any) -> str | None:
    """A token as tokenizer_config.json names it: a string, or an AddedToken's dict."""
    token = token.get("content") if isinstance(token, dict) else token
    return token if isinstance(token, str) else None


def pre_tokenizer(folder: Path, vocab: dict[str, int], data: dict[str, Any]) -> str:
    """tokenizer.ggml.pre: the name the converter gives the hash of CHKTXT's ids."""
    tokenizer = wordpiece(folder, vocab, data)
    try:
        ids = tokenizer.encode(CHKTXT)
    except KeyError as error:
        raise ConversionError(f"{folder}: the vocabulary has no {error.args[0]} token") from None
    digest = hashlib.sha256(str(ids).encode()).hexdigest()
    if digest not in PRE_TOKENIZERS:
        raise ConversionError(
            f"{folder}: a WordPiece tokenizer llama.cpp's converter does not know (its check "
            f"hash is {digest}); llama.cpp could not name its pre-tokenizer either"
        )
    return PRE_TOKENIZERS[digest]


# ---- the file ---------------------------------------------------------------------------------


def write_replacing_gguf(writer: Any, out: Path) -> None:
    """Write the file to out's part file, sync it and rename it over out: out is the complete
    old file or the complete new one, never half of one, whatever stops the conversion."""
    try:
        check_replaceable(out, error=ConversionError)
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_parts(out)
    except OSError as error:
        raise ConversionError(f"cannot write {out}: {error}") from error
    partial = partial_path(out)
    try:
        writer.write_header_to_file(path=partial)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
        with partial.open("rb+") as written:
            os.fsync(written.fileno())
        partial.replace(out)
    except OSError as error:
        raise ConversionError(f"cannot write {out}: {error}") from error
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
