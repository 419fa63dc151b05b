"""quill tokenize against the reference tokenizer call: same ids, pieces that rebuild the text."""

from __future__ import annotations

import json

from cli.app import app

from reference import Reference

TEXT = 'Tokens are not characters: 一个常用汉字, {"a": 1}, 🦙'


def test_tokenize_matches_llama_cpp_and_rebuilds_the_text(runner, smollm2_path):
    result = runner.invoke(app, ["tokenize", TEXT, "--json"])
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    reference = Reference(smollm2_path, n_ctx=256)
    try:
        ids = reference.tokenize(TEXT, add_special=True)
        rebuilt = b"".join(reference.piece(t) for t in ids)
    finally:
        reference.close()
    assert shown["ids"] == ids
    assert rebuilt == TEXT.encode("utf-8")
    assert shown["characters"] == len(TEXT) and shown["bytes"] == len(TEXT.encode())
    # The llama is one character but three tokens of bytes: each shown as \xNN.
    assert sum(piece.count("\\x") for piece in shown["pieces"]) >= 4


def test_tokenize_plain_output_is_one_token_per_line(runner, smollm2_path):
    result = runner.invoke(app, ["tokenize", "a\nb"])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[-1] for line in lines] == ['"a"', '"\\n"', '"b"']
    assert "3 tokens for 3 characters" in result.stderr
