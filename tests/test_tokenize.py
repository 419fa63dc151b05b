"""quill tokenize against the reference tokenizer call: same ids, pieces that rebuild the text."""

from __future__ import annotations

import json

import pytest

from cli.app import app

from reference import Reference

TEXT = 'Tokens are not characters: 一个常用汉字, {"a": 1}, 🦙'


@pytest.mark.parametrize("model", ["tiny_path", "smollm2_path"])
def test_tokenize_matches_llama_cpp_and_rebuilds_the_text(runner, request, model):
    """On the tiny model (the fast tier) and on SmolLM2, which `quill tokenize` uses by default."""
    path = request.getfixturevalue(model)
    which = ["-m", str(path)] if model == "tiny_path" else []
    result = runner.invoke(app, ["tokenize", *which, TEXT, "--json"])
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    reference = Reference(path, n_ctx=256)
    try:
        ids = reference.tokenize(TEXT, add_special=True)
        rebuilt = b"".join(reference.piece(t) for t in ids)
    finally:
        reference.close()
    assert shown["ids"] == ids  # same path: one tokenizer, no decoding
    assert rebuilt == TEXT.encode("utf-8")
    assert shown["characters"] == len(TEXT) and shown["bytes"] == len(TEXT.encode())
    # The llama is one character but three tokens of bytes: each shown as \xNN.
    assert sum(piece.count("\\x") for piece in shown["pieces"]) >= 4
    plain = runner.invoke(app, ["tokenize", *which, "a\nb"])
    assert [line.split()[-1] for line in plain.stdout.splitlines()] == ['"a"', '"\\n"', '"b"']


def test_tokenize_plain_output_is_one_token_per_line(runner, smollm2_path):
    result = runner.invoke(app, ["tokenize", "a\nb"])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[-1] for line in lines] == ['"a"', '"\\n"', '"b"']
    assert "3 tokens for 3 characters" in result.stderr
