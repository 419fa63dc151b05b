"""quill tokenize: how the model's tokenizer cuts a text, token by token."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from cli.commands.options import JsonOutput, ModelOption, Offline, obtain_model, read_prompt


def shown_piece(piece: bytes) -> str:
    """The token's text, with bytes that are not whole UTF-8 characters shown as \\xNN and
    line breaks and tabs escaped, so that each token stays on its line."""
    text = piece.decode("utf-8", errors="backslashreplace")
    return text.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def tokenize(
    text: Annotated[
        str | None, typer.Argument(help="The text. Text on stdin comes first, then this.")
    ] = None,
    model: ModelOption = None,
    json_output: JsonOutput = False,
    offline: Offline = False,
) -> None:
    """Show the tokens a text becomes: tokens, not characters, are what context, max_tokens and
    speed are counted in."""
    from cli.engine.engine import NO_SETTINGS
    from cli.engine.opening import open_engine
    from cli.engine.options import LoadOptions
    from cli.ui import render

    content = read_prompt(text)
    label, path = obtain_model(model, offline)
    with open_engine(path, LoadOptions(n_ctx=256), NO_SETTINGS) as engine:
        ids = engine.tokenize(content)
        pieces = [engine.piece(token, special=True) for token in ids]
    characters, size = len(content), len(content.encode("utf-8"))
    if json_output:
        result = {
            "model": label,
            "tokens": len(ids),
            "characters": characters,
            "bytes": size,
            "ids": ids,
            "pieces": [shown_piece(p) for p in pieces],
        }
        render.write_stdout(json.dumps(result, ensure_ascii=False, indent=1) + "\n")
        return
    for index, (token, piece) in enumerate(zip(ids, pieces, strict=True)):
        render.write_stdout(f'{index:>5} {token:>7}  "{shown_piece(piece)}"\n')
    render.info_line(
        f"{len(ids)} tokens for {characters} characters ({size} UTF-8 bytes), {label}'s tokenizer"
    )


EPILOG = "A piece shown with \\xNN is part of a character split over several tokens."
