"""A tiny random BERT as a sentence-transformers folder (2 layers, 32 wide, a 28-token WordPiece
vocabulary), for the converter's tests and for fast tests of the embedding and rerank paths: the
folder quant/convert.py converts, made in milliseconds, no download."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from quant import convert
from quant.convert import CHKTXT, WordPiece, convert_bert

# ---- a tiny random BERT, written here --------------------------------------------------------

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "##s", "##ing", "run", "a", "."]
WORDS += [",", "!", "?", "cafe", "我", "1", "##2", "##3", "un", "##believ", "##able"]
VOCAB = SPECIALS + WORDS
TINY_TEXTS = ["hello world", "The cat sat on the mat!", "Café? 我 123, unbelievable running"]


def tiny_config(architecture: str = "BertModel", **extra: Any) -> dict[str, Any]:
    return {
        "architectures": [architecture], "model_type": "bert", "hidden_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
        "max_position_embeddings": 64, "type_vocab_size": 2, "vocab_size": len(VOCAB),
        "layer_norm_eps": 1e-12, "hidden_act": "gelu", "pad_token_id": 0, **extra,
    }  # fmt: skip


def tiny_weights(config: dict[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    h, ff, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    shapes = {
        "embeddings.word_embeddings.weight": (len(VOCAB), h),
        "embeddings.position_embeddings.weight": (config["max_position_embeddings"], h),
        "embeddings.token_type_embeddings.weight": (2, h),
        "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,),
        "pooler.dense.weight": (h, h), "pooler.dense.bias": (h,),
    }  # fmt: skip
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value"):
            shapes |= {f"{p}{name}.weight": (h, h), f"{p}{name}.bias": (h,)}
        shapes |= {f"{p}attention.output.dense.weight": (h, h), f"{p}attention.output.dense.bias": (h,)}  # fmt: skip  # noqa: E501
        shapes |= {f"{p}intermediate.dense.weight": (ff, h), f"{p}intermediate.dense.bias": (ff,)}
        shapes |= {f"{p}output.dense.weight": (h, ff), f"{p}output.dense.bias": (h,)}
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes |= {f"{p}{norm}.weight": (h,), f"{p}{norm}.bias": (h,)}
    weights = {prefix + k: rng.normal(0, 0.3, s).astype(np.float32) for k, s in shapes.items()}
    for name in [k for k in weights if "LayerNorm.weight" in k]:
        weights[name] = 1.0 + weights[name] / 3
    weights[prefix + "embeddings.position_ids"] = np.arange(64, dtype=np.int64)[None]
    return weights


def tokenizer_json() -> dict[str, Any]:
    """tokenizer.json as transformers saves a BERT tokenizer (the fields tokenizers reads)."""
    cls, sep = VOCAB.index("[CLS]"), VOCAB.index("[SEP]")
    template = {
        "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "[SEP]", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}},
                 {"SpecialToken": {"id": "[SEP]", "type_id": 1}}],
        "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [cls], "tokens": ["[CLS]"]},
                           "[SEP]": {"id": "[SEP]", "ids": [sep], "tokens": ["[SEP]"]}},
    }  # fmt: skip
    added = [
        {"id": VOCAB.index(t), "content": t, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for t in SPECIALS
    ]  # fmt: skip
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                       "strip_accents": None, "lowercase": True},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "TemplateProcessing", **template},
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": {t: i for i, t in enumerate(VOCAB)}},
    }  # fmt: skip


def tiny_bert(folder: Path, config: dict[str, Any] | None = None, *, vocab_txt: bool = False,
              pooling: bool = True, prefix: str = "") -> Path:  # fmt: skip
    """A sentence-transformers folder of a random 2-layer BERT with VOCAB as its tokenizer."""
    from safetensors.numpy import save_file

    config = config or tiny_config()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tiny_weights(config, prefix), str(folder / "model.safetensors"))
    specials = {f"{t[1:-1].lower()}_token": t for t in SPECIALS}
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, **specials}))
    if vocab_txt:
        (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    else:
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json()), encoding="utf-8")
    if pooling:
        kinds = {"": "Transformer", "1_Pooling": "Pooling"}
        modules = [
            {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
            for i, (path, kind) in enumerate(kinds.items())
        ]
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir()
        mean = json.dumps({"pooling_mode_mean_tokens": True})
        (folder / "1_Pooling/config.json").write_text(mean)
    return folder


def known_hash(monkeypatch: pytest.MonkeyPatch) -> str:
    """The tiny vocabulary's check hash, known for the test's length as llama.cpp's converter
    knows real BERT vocabularies' (its own would be refused, as the converter refuses it)."""
    ids = WordPiece({t: i for i, t in enumerate(VOCAB)}).encode(CHKTXT)
    digest = hashlib.sha256(str(ids).encode()).hexdigest()
    monkeypatch.setitem(convert.PRE_TOKENIZERS, digest, "jina-v2-en")
    return digest


def with_rank_head(folder: Path, bias: float = 0.25) -> dict[str, np.ndarray]:
    """A sequence classifier's head (one label) added to folder's weights: all of them."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(3)
    head = {"classifier.weight": rng.normal(0, 0.3, (1, 32)).astype(np.float32)}
    head["classifier.bias"] = np.array([bias], dtype=np.float32)
    weights = load_file(str(folder / "model.safetensors")) | head
    save_file(weights, str(folder / "model.safetensors"))
    return weights


def tiny_gguf(folder: Path, out: Path, reranker: bool = False) -> Path:
    """The tiny BERT converted: an embedding model (mean pooling), or with reranker a
    cross-encoder (BertForSequenceClassification with one label) as rerankers are."""
    with pytest.MonkeyPatch.context() as patch:
        known_hash(patch)
        if reranker:
            config = tiny_config("BertForSequenceClassification", id2label={"0": "LABEL_0"})
            with_rank_head(tiny_bert(folder, config, pooling=False, prefix="bert."))
        else:
            tiny_bert(folder)
        convert_bert(folder, out)
    return out
