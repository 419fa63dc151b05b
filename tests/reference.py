"""An independent greedy decoder on llama-cpp-python's low-level API, sharing no code with quill
but the one model loader (cli/engine/loading.py), through which every load in the project passes
so that no process meets llama.cpp's AMX crash.

Tests compare quill's output with what this computes on the same tokens.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp as llama
import numpy as np

from cli.engine.loading import load_model


class Reference:
    def __init__(
        self, path: Path, n_ctx: int = 4096, threads: int = 2, avoid_amx: bool | None = None
    ):
        self.loaded = load_model(path, avoid_amx=avoid_amx)
        self.model = self.loaded.model
        assert self.model, f"reference could not load {path}"
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.n_vocab = llama.llama_vocab_n_tokens(self.vocab)
        cparams = llama.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_ctx
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.ctx = llama.llama_init_from_model(self.model, cparams)
        assert self.ctx

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        data = text.encode()
        buf = (llama.llama_token * (len(data) + 16))()
        n = llama.llama_tokenize(self.vocab, data, len(data), buf, len(buf), add_special, True)
        assert n >= 0
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(1024)
        n = llama.llama_token_to_piece(self.vocab, token, buf, 1024, 0, False)
        assert n >= 0
        return buf.raw[:n]

    def chat(self, messages: list[tuple[str, str]]) -> str:
        """The model's own template rendered by transformers' renderer (what the template's
        authors test against), with the file's BOS and EOS text."""
        from transformers.utils.chat_template_utils import render_jinja_template

        template = llama.llama_model_chat_template(self.model, None).decode("utf-8")
        rendered, _ = render_jinja_template(
            [[{"role": role, "content": content} for role, content in messages]],
            chat_template=template,
            add_generation_prompt=True,
            bos_token=self.special(llama.llama_vocab_bos(self.vocab)),
            eos_token=self.special(llama.llama_vocab_eos(self.vocab)),
        )
        return rendered[0]

    def special(self, token: int) -> str:
        buf = ctypes.create_string_buffer(1024)
        n = llama.llama_token_to_piece(self.vocab, token, buf, 1024, 0, True)
        return buf.raw[:n].decode()

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        llama.llama_memory_clear(llama.llama_get_memory(self.ctx), True)
        out: list[int] = []
        batch = (llama.llama_token * len(prompt))(*prompt)
        assert llama.llama_decode(self.ctx, llama.llama_batch_get_one(batch, len(prompt))) == 0
        while len(out) < max_tokens:
            logits = np.ctypeslib.as_array(
                llama.llama_get_logits_ith(self.ctx, -1), (self.n_vocab,)
            )
            token = int(np.argmax(logits))
            out.append(token)
            if llama.llama_vocab_is_eog(self.vocab, token):
                break
            one = (llama.llama_token * 1)(token)
            assert llama.llama_decode(self.ctx, llama.llama_batch_get_one(one, 1)) == 0
        return out

    def step_logits(self, tokens: list[int]) -> np.ndarray:
        """Row i: the logits after tokens[: i + 1], decoding one token per call from an empty
        cache (no multi-output batches, unlike quill's perplexity)."""
        llama.llama_memory_clear(llama.llama_get_memory(self.ctx), True)
        rows = []
        for token in tokens:
            one = (llama.llama_token * 1)(token)
            assert llama.llama_decode(self.ctx, llama.llama_batch_get_one(one, 1)) == 0
            logits = llama.llama_get_logits_ith(self.ctx, -1)
            rows.append(np.ctypeslib.as_array(logits, (self.n_vocab,)).copy())
        return np.stack(rows)

    def text(self, tokens: list[int]) -> str:
        visible = [t for t in tokens if not llama.llama_vocab_is_eog(self.vocab, t)]
        return b"".join(self.piece(t) for t in visible).decode("utf-8", errors="replace")

    def close(self) -> None:
        llama.llama_free(self.ctx)
        llama.llama_model_free(self.model)
