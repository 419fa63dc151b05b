"""llama-server's POST /tokenize and /detokenize: a text's tokens under the model's tokenizer
(with each token's piece where asked), and the text of a list of tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cli.api.server import ServerLimits, bad_request, is_token_id, text_field, typed_field

if TYPE_CHECKING:
    from cli.engine.engine import Engine

# A token list longer than any context a model has is no request: bounded before it is read.
MAX_DETOKENIZE_TOKENS = 1 << 20


def tokenize(body: dict, engine: Engine, limits: ServerLimits) -> dict[str, Any]:
    """{"content", "add_special" (false), "parse_special" (true, the only way quill reads
    text), "with_pieces" (false)} -> {"tokens": ids, or [{"id", "piece"}] with pieces}: a
    piece is its text where its bytes are whole UTF-8, else the list of its bytes (as
    llama-server answers)."""
    content = body.get("content")
    if not isinstance(content, str):
        raise bad_request("'content' must be the text to tokenize", "content")
    content = text_field(content, "'content'", "content")
    add_special = typed_field(body, "add_special", bool, False)
    if not typed_field(body, "parse_special", bool, True):
        raise bad_request(
            "parse_special false is not supported: quill reads special tokens' text as the "
            "tokens (as templates write them)",
            "parse_special",
        )
    with_pieces = typed_field(body, "with_pieces", bool, False)
    ids = engine.vocabulary.tokenize_bytes(content.encode("utf-8"), add_special)
    if not with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": token, "piece": _piece(engine.piece(token, True))} for token in ids]}


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # part of a character: its bytes
        return list(data)


def detokenize(body: dict, engine: Engine, limits: ServerLimits) -> dict[str, Any]:
    """{"tokens": ids} -> {"content": their text}; a token id the vocabulary lacks is a 400."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request("'tokens' must be an array of token ids", "tokens")
    if len(tokens) > MAX_DETOKENIZE_TOKENS:
        raise bad_request(f"'tokens' has over {MAX_DETOKENIZE_TOKENS} ids", "tokens")
    size = engine.vocabulary.n_vocab
    for index, token in enumerate(tokens):
        if not is_token_id(token, size):
            raise bad_request(
                f"tokens[{index}] is not a token id of this model (0 to {size - 1})", "tokens"
            )
    text = b"".join(engine.piece(token, True) for token in tokens)
    return {"content": text.decode("utf-8", "replace")}
