"""A loaded model's vocabulary: text to tokens and back (pieces), its end-of-generation and
special tokens; and the glue between it and the chat templates (cli/engine/templates.py): which
template a model's conversations go through, rendered with its BOS and EOS texts."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import llama_cpp as llama

from cli.engine.templates import (
    ChatTemplate,
    Message,
    Rendered,
    TemplateNote,
    choose_template,
    file_template,
    render_conversation,
    role_content,
    template_notes,
)
from cli.sequence import common_prefix


class Vocabulary:
    """The tokens of one loaded model (the handle lives as long as the model)."""

    def __init__(self, model: Any) -> None:
        self.handle = handle = llama.llama_model_get_vocab(model)
        self.n_vocab = llama.llama_vocab_n_tokens(handle)
        self.add_bos = bool(llama.llama_vocab_get_add_bos(handle))
        self.bos_token = llama.llama_vocab_bos(handle)
        self.eos_token = llama.llama_vocab_eos(handle)
        self._pieces: dict[int, bytes] = {}

    @functools.cached_property
    def eog_tokens(self) -> tuple[int, ...]:
        return tuple(t for t in range(self.n_vocab) if llama.llama_vocab_is_eog(self.handle, t))

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama.llama_vocab_is_eog(self.handle, token))

    def is_special_token(self, text: str) -> bool:
        """Whether text is one control or user-defined token of the vocabulary."""
        data = text.encode()
        tokens = (llama.llama_token * 4)()
        n = llama.llama_tokenize(self.handle, data, len(data), tokens, 4, False, True)
        return n == 1 and self.piece(tokens[0], special=True) == data

    def special_text(self, token: int) -> str:
        return self.piece(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        bos = self.bos_token
        # A chat template may already start with the BOS text; never add a second one.
        add_bos = self.add_bos and not (bos >= 0 and data.startswith(self.piece(bos, True)))
        return self.tokenize_bytes(data, add_bos)

    def tokenize_bytes(self, data: bytes, add_bos: bool) -> list[int]:
        capacity = len(data) + 8
        tokens = (llama.llama_token * capacity)()
        n = llama.llama_tokenize(self.handle, data, len(data), tokens, capacity, add_bos, True)
        if n < 0:
            capacity = -n
            tokens = (llama.llama_token * capacity)()
            n = llama.llama_tokenize(self.handle, data, len(data), tokens, capacity, add_bos, True)
        return list(tokens[:n])

    def respell(self, tokens: Sequence[int], like: Sequence[int]) -> list[int]:
        """tokens (of a text) led by as many of like as spell the same bytes, the rest tokenized
        again: a reply kept as the tokens it was sampled as (" ra" "is" "se", which its text
        tokenizes back to as " ra" "isse") keeps its KV cells, as llama-cli keeps them."""
        same = common_prefix(like, tokens)
        if same in (len(like), len(tokens)):
            return list(tokens)
        text = b"".join(map(self._spelling, tokens[same:]))
        kept, offset = same, 0
        for token in like[same:]:
            piece = self._spelling(token)
            if not piece or not text.startswith(piece, offset):
                break
            kept, offset = kept + 1, offset + len(piece)
        while kept > same and offset < len(text) and 0x80 <= text[offset] < 0xC0:
            kept -= 1  # the rest must start on a character
            offset -= len(self._spelling(like[kept]))
        rest = self.tokenize_bytes(text[offset:], add_bos=False)
        if kept == same or b"".join(map(self._spelling, rest)) != text[offset:]:
            return list(tokens)  # a tokenizer that adds a space at the start (SentencePiece)
        return [*like[:kept], *rest]

    def _spelling(self, token: int) -> bytes:
        return self.piece(token) or self.piece(token, special=True)

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token, whatever their length (llama-cpp-python's helper cuts at 32)."""
        if not special and token in self._pieces:
            return self._pieces[token]
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama.llama_token_to_piece(self.handle, token, buf, size, 0, special)
            if n < 0:
                size = -n
                continue
            data = buf.raw[:n]
            if not special:
                self._pieces[token] = data
            return data


def model_template(
    vocabulary: Vocabulary,
    meta: Callable[[str], str | None],
    architecture: str,
    chosen: ChatTemplate | None,
    family: str | None,
    think: bool | None,
) -> tuple[ChatTemplate | None, list[TemplateNote]]:
    """The template a model's conversations go through (chosen: a file the user named; family:
    the one models.yaml names), and the lines to tell the user about it."""
    own = file_template(meta, architecture, vocabulary.is_special_token)
    template, fallback = choose_template(own, chosen, family)
    return template, [*([fallback] if fallback else []), *template_notes(template, think)]


def render_chat(
    vocabulary: Vocabulary,
    template: ChatTemplate,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    enable_thinking: bool | None,
) -> Rendered:
    return render_conversation(
        template,
        messages,
        bos_token=vocabulary.special_text(vocabulary.bos_token),
        eos_token=vocabulary.special_text(vocabulary.eos_token),
        tools=tools,
        enable_thinking=enable_thinking,
    )


def plain_conversation(messages: Sequence[Message]) -> str:
    """A conversation without a chat template: a 'role: text' line per message and
    'assistant: ' (base models continue text)."""
    lines = role_content(messages)
    return "".join(f"{role}: {text}\n" for role, text in lines) + "assistant: "


def may_open_with_reasoning(template: ChatTemplate | None) -> bool:
    """Whether a reply may start with a reasoning block (a grammar then holds the answer)."""
    return template is not None and template.supports_thinking and template.family != "gpt-oss"
