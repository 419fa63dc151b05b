"""An independent greedy decoder on llama-cpp-python's low-level API, sharing no code with quill
but the one model loader (cli/engine/loading.py), through which every load in the project passes
so that no process meets llama.cpp's AMX crash.

Tests compare quill's output with what this computes on the same tokens, through the near-tie
comparator (tests/neartie.py), which has this decoder prefill the prompt in one batch and again one
token at a time: the second's rounding differs from quill's, as another CPU's would.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp as llama
import numpy as np

from cli.engine.loading import load_model
from quant.kv import ggml_type


class Reference:
    def __init__(
        self,
        path: Path,
        n_ctx: int = 4096,
        threads: int = 2,
        avoid_amx: bool | None = None,
        kv_type: str = "f16",
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
        self._prefilled: dict[tuple[tuple[int, ...], bool], tuple[Any, np.ndarray, bytes]] = {}
        self._prompt_logits: np.ndarray | None = None
        if kv_type != "f16":  # a quantized V cache needs flash attention (as in quill's engine)
            cparams.type_k = cparams.type_v = ggml_type(kv_type)
            cparams.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
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

    def prefill(self, prompt: Sequence[int], one_at_a_time: bool = False) -> bytes:
        """An empty cache, then the prompt: in one batch, or one token at a time (other kernels,
        which may round otherwise: what another CPU's would be to this one's). Returns a digest
        of the cache and logits it left, equal for two prefills only where they agree bit for
        bit (then all that follows agrees too). The last prompts' caches are kept and restored:
        tests follow several texts after one prompt, each after both prefills."""
        llama.llama_memory_clear(llama.llama_get_memory(self.ctx), True)
        self._prompt_logits = None
        key = (tuple(prompt), one_at_a_time)
        if key in self._prefilled:
            state, self._prompt_logits, digest = self._prefilled[key]
            assert llama.llama_state_seq_set_data(self.ctx, state, len(state), 0) == len(state)
            return digest
        chunk = 1 if one_at_a_time else len(prompt)
        for start in range(0, len(prompt), chunk):
            part = prompt[start : start + chunk]
            batch = (llama.llama_token * len(part))(*part)
            assert llama.llama_decode(self.ctx, llama.llama_batch_get_one(batch, len(part))) == 0
        state = (ctypes.c_uint8 * llama.llama_state_seq_get_size(self.ctx, 0))()
        assert llama.llama_state_seq_get_data(self.ctx, state, len(state), 0) == len(state)
        logits = self.logits()
        digest = hashlib.sha256(bytes(state) + logits.tobytes()).digest()
        if len(self._prefilled) >= 4:  # two prompts' worth: bounded memory
            self._prefilled.clear()
        self._prefilled[key] = state, logits, digest
        self._prompt_logits = logits
        return digest

    def step(self, token: int) -> None:
        self._prompt_logits = None
        one = (llama.llama_token * 1)(token)
        assert llama.llama_decode(self.ctx, llama.llama_batch_get_one(one, 1)) == 0

    def logits(self) -> np.ndarray:
        """The last decoded position's logits (a copy: the next decode overwrites them); after a
        restored prefill, the prompt's."""
        if self._prompt_logits is not None:
            return self._prompt_logits.copy()
        row = llama.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(row, (self.n_vocab,)).copy()

    def is_eog(self, token: int) -> bool:
        return bool(llama.llama_vocab_is_eog(self.vocab, token))

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        self.prefill(prompt)
        out: list[int] = []
        while len(out) < max_tokens:
            token = int(np.argmax(self.logits()))
            out.append(token)
            if self.is_eog(token):
                break
            self.step(token)
        return out

    def step_logits(self, tokens: list[int]) -> np.ndarray:
        """Row i: the logits after tokens[: i + 1], decoding one token per call from an empty
        cache (no multi-output batches, unlike quill's perplexity)."""
        self._prompt_logits = None
        llama.llama_memory_clear(llama.llama_get_memory(self.ctx), True)
        rows = []
        for token in tokens:
            one = (llama.llama_token * 1)(token)
            assert llama.llama_decode(self.ctx, llama.llama_batch_get_one(one, 1)) == 0
            logits = llama.llama_get_logits_ith(self.ctx, -1)
            rows.append(np.ctypeslib.as_array(logits, (self.n_vocab,)).copy())
        return np.stack(rows)

    def text(self, tokens: list[int]) -> str:
        visible = [t for t in tokens if not self.is_eog(t)]
        return b"".join(self.piece(t) for t in visible).decode("utf-8", errors="replace")

    def close(self) -> None:
        llama.llama_free(self.ctx)
        llama.llama_model_free(self.model)
