"""The one engine: load a GGUF through llama.cpp's C API, prefill, decode, stream events.

Every consumer (run, and later chat, bench, serve) iterates `Engine.stream_generate` and renders
what it yields. Nothing here prints, exits or imports a terminal library.
"""

from __future__ import annotations

import ctypes
import functools
import random
import resource
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as llama
import numpy as np

from cli.engine.hardware import cpu_has_amx, physical_cores
from cli.engine.llamalog import llama_log
from cli.engine.sampling import SamplingParams
from cli.engine.textstream import TextStream
from cli.errors import ModelLoadError, UsageError
from cli.gguf_info import check_gguf_magic
from quant.kv import QUANTIZED_KV_TYPES, kv_cache_bytes

ALL_LAYERS = -1
_LLAMA_ALL_LAYERS = 0x7FFFFFFF
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


@dataclass(frozen=True)
class LoadOptions:
    n_ctx: int | None = None  # None: min(DEFAULT_CTX, the model's trained context)
    n_batch: int = 512
    threads: int | None = None  # None: physical cores
    gpu_layers: int = 0  # ALL_LAYERS offloads every layer
    kv_type_k: str = "f16"
    kv_type_v: str = "f16"
    parallel: int = 1  # sequences sharing the context (quill serve); each gets n_ctx tokens


DEFAULT_CTX = 4096
DEFAULT_SAMPLING = SamplingParams()


@dataclass(frozen=True)
class StreamEvent:
    """One step of generation. The last event has finish_reason set."""

    text: str  # text released by this step ("" while a possible stop string is held back)
    token: int | None  # the token sampled at this step
    prompt_tokens: int
    cached_prompt_tokens: int  # prompt tokens whose KV cache was reused, not prefilled again
    prefill_s: float
    generation_tokens: int
    decode_s: float  # from the first sampled token to this one
    finish_reason: str | None  # "stop" (end of generation or a stop string) or "length"
    stop_string: str | None
    seed: int
    peak_rss_bytes: int

    @property
    def prefill_tokens_per_s(self) -> float:
        new = self.prompt_tokens - self.cached_prompt_tokens
        return new / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes from the prefill's logits; each later one costs one decode step.
        steps = self.generation_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


class Engine:
    def __init__(self, path: Path, options: LoadOptions = LoadOptions(), verbose: bool = False):
        log = llama_log()
        log.verbose = verbose
        log.drain()
        check_gguf_magic(path)
        llama.llama_backend_init()
        started = time.perf_counter()

        model_params = llama.llama_model_default_params()
        gpu_layers = _LLAMA_ALL_LAYERS if options.gpu_layers == ALL_LAYERS else options.gpu_layers
        model_params.n_gpu_layers = gpu_layers
        # Repacked weight buffers include ggml's AMX kernels, which crash on AMX CPUs.
        self.repack = not cpu_has_amx()
        model_params.use_extra_bufts = self.repack
        self._model = llama.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise ModelLoadError(_load_failure(path, log.drain()))

        self._vocab = llama.llama_model_get_vocab(self._model)
        self.kv_type_k, self.kv_type_v = options.kv_type_k, options.kv_type_v
        self._refuse_impossible_kv_types()
        self.trained_ctx = llama.llama_model_n_ctx_train(self._model)
        n_ctx = options.n_ctx or min(DEFAULT_CTX, self.trained_ctx)
        self.threads = options.threads or physical_cores()

        context_params = llama.llama_context_default_params()
        context_params.n_ctx = n_ctx * options.parallel
        context_params.n_seq_max = options.parallel
        context_params.kv_unified = False  # each sequence owns n_ctx cells: no one starves another
        context_params.n_batch = min(options.n_batch, n_ctx)
        context_params.n_ubatch = min(options.n_batch, n_ctx)
        context_params.n_threads = self.threads
        context_params.n_threads_batch = self.threads
        context_params.no_perf = False
        context_params.type_k = GGML_TYPES[options.kv_type_k]
        context_params.type_v = GGML_TYPES[options.kv_type_v]
        # llama.cpp needs flash attention to store V quantized; otherwise let it decide.
        quantized_v = options.kv_type_v in QUANTIZED_KV_TYPES
        context_params.flash_attn_type = (
            llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if quantized_v else llama.LLAMA_FLASH_ATTN_TYPE_AUTO
        )
        self._ctx = llama.llama_init_from_model(self._model, context_params)
        if not self._ctx:
            llama.llama_model_free(self._model)
            self._model = None
            raise ModelLoadError(_load_failure(path, log.drain()))
        self.load_s = time.perf_counter() - started

        self.path = path
        self.parallel = options.parallel
        self.n_ctx = llama.llama_n_ctx_seq(self._ctx)  # positions one sequence can hold
        self.n_batch = context_params.n_batch
        self.gpu_layers = (
            min(options.gpu_layers, self.n_layers) if options.gpu_layers >= 0 else self.n_layers
        )
        self._pieces: dict[int, bytes] = {}
        self._evaluated: list[int] = []  # tokens whose KV cells are in the cache, in order

    def _refuse_impossible_kv_types(self) -> None:
        """Quantized KV caches store blocks of 32 values per head: the head size must divide."""
        for which, cache_type, head_dim in (
            ("K", self.kv_type_k, self.head_dims[0]),
            ("V", self.kv_type_v, self.head_dims[1]),
        ):
            if cache_type in QUANTIZED_KV_TYPES and head_dim % 32:
                llama.llama_model_free(self._model)
                self._model = None
                raise UsageError(
                    f"a {cache_type} {which} cache stores blocks of 32 values, but this model's "
                    f"heads have {head_dim}: use --kv-type f16 for it"
                )

    # --- what the model is ------------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        size = 256
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1

    @property
    def n_layers(self) -> int:
        return llama.llama_model_n_layer(self._model)

    @property
    def weights_bytes(self) -> int:
        """Bytes of all weight tensors: what one decode step reads at least once."""
        return llama.llama_model_size(self._model)

    @property
    def kv_bytes_per_position(self) -> float:
        return self.kv_cache_bytes / (self.n_ctx * self.parallel)

    @property
    def architecture(self) -> str:
        return self.meta("general.architecture") or "unknown"

    @property
    def head_dims(self) -> tuple[int, int]:
        """(K, V) values per attention head."""
        arch = self.architecture
        n_head = int(self.meta(f"{arch}.attention.head_count") or 1)
        n_embd = int(self.meta(f"{arch}.embedding_length") or 0)
        head_dim_k = int(self.meta(f"{arch}.attention.key_length") or n_embd // n_head)
        return head_dim_k, int(self.meta(f"{arch}.attention.value_length") or head_dim_k)

    @property
    def kv_cache_bytes(self) -> int:
        head_dim_k, head_dim_v = self.head_dims
        return kv_cache_bytes(
            self.n_layers,
            llama.llama_model_n_head_kv(self._model),
            head_dim_k,
            self.n_ctx * self.parallel,
            self.kv_type_k,
            self.kv_type_v,
            head_dim_v,
        )

    @property
    def n_vocab(self) -> int:
        return llama.llama_vocab_n_tokens(self._vocab)

    @functools.cached_property
    def eog_tokens(self) -> tuple[int, ...]:
        return tuple(t for t in range(self.n_vocab) if llama.llama_vocab_is_eog(self._vocab, t))

    # --- text <-> tokens --------------------------------------------------------------------

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> str | None:
        """The conversation rendered with the model's chat template; None if it has none
        that llama.cpp can apply."""
        template = llama.llama_model_chat_template(self._model, None)
        if not template:
            return None
        array = (llama.llama_chat_message * len(messages))()
        keep = [(role.encode(), content.encode()) for role, content in messages]
        for slot, (role, content) in zip(array, keep, strict=True):
            slot.role, slot.content = role, content
        size = 4 * sum(len(c) for _, c in keep) + 1024
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama.llama_chat_apply_template(template, array, len(keep), True, buf, size)
            if n < 0:
                return None
            if n <= size:
                return buf.raw[:n].decode("utf-8")
            size = n
        return None

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        add_bos = llama.llama_vocab_get_add_bos(self._vocab)
        bos = llama.llama_vocab_bos(self._vocab)
        # A chat template may already start with the BOS text; never add a second one.
        if add_bos and bos >= 0 and data.startswith(self.piece(bos, special=True)):
            add_bos = False
        capacity = len(data) + 8
        tokens = (llama.llama_token * capacity)()
        n = llama.llama_tokenize(self._vocab, data, len(data), tokens, capacity, add_bos, True)
        if n < 0:
            capacity = -n
            tokens = (llama.llama_token * capacity)()
            n = llama.llama_tokenize(self._vocab, data, len(data), tokens, capacity, add_bos, True)
        return list(tokens[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token, whatever their length (llama-cpp-python's own helper
        truncates pieces over 32 bytes)."""
        if not special and token in self._pieces:
            return self._pieces[token]
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama.llama_token_to_piece(self._vocab, token, buf, size, 0, special)
            if n < 0:
                size = -n
                continue
            data = buf.raw[:n]
            if not special:
                self._pieces[token] = data
            return data

    # --- generation -------------------------------------------------------------------------

    def stream_generate(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams = DEFAULT_SAMPLING,
        stop: Sequence[str] = (),
    ) -> Iterator[StreamEvent]:
        if not prompt_tokens:
            raise ValueError("the prompt has no tokens")
        seed = (
            sampling.seed if sampling.seed is not None else random.SystemRandom().randrange(2**31)
        )
        llama.llama_perf_context_reset(self._ctx)
        started = time.perf_counter()
        cached = self._reuse_prefix(prompt_tokens)
        for start in range(cached, len(prompt_tokens), self.n_batch):
            self._decode(prompt_tokens[start : start + self.n_batch])
        prefill_s = time.perf_counter() - started

        banned = self.eog_tokens if sampling.ignore_eos else ()
        sampler = sampler_chain(sampling, seed, prompt_tokens, banned, self.n_vocab)
        text = TextStream(stop)
        first_token_at = time.perf_counter()
        try:
            generated = 0
            while True:
                token = llama.llama_sampler_sample(sampler, self._ctx, -1)
                generated += 1
                now = time.perf_counter()
                if generated == 1:
                    first_token_at = now
                released, finish = self.accept(token, text, at_limit=generated >= max_tokens)
                yield StreamEvent(
                    text=released,
                    token=token,
                    prompt_tokens=len(prompt_tokens),
                    cached_prompt_tokens=cached,
                    prefill_s=prefill_s,
                    generation_tokens=generated,
                    decode_s=now - first_token_at,
                    finish_reason=finish,
                    stop_string=text.matched_stop,
                    seed=seed,
                    peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                )
                if finish is not None:
                    return
                self._decode([token])
        finally:
            llama.llama_sampler_free(sampler)

    def accept(self, token: int, text: TextStream, at_limit: bool) -> tuple[str, str | None]:
        """(text to release, finish reason or None) after sampling token: the end-of-generation
        token and a completed stop string finish with "stop", reaching the limit with "length"."""
        if llama.llama_vocab_is_eog(self._vocab, token):
            return text.finish(), "stop"
        released = text.push(self.piece(token))
        if text.matched_stop is not None:
            return released, "stop"
        if at_limit:
            return released + text.finish(), "length"
        return released, None

    @property
    def llama_context(self):
        """llama.cpp's context, for code that drives decode steps itself (the batch scheduler)."""
        return self._ctx

    def _reuse_prefix(self, tokens: Sequence[int]) -> int:
        """Keep the KV cells of the longest common prefix with what was evaluated before."""
        common = 0
        for old, new in zip(self._evaluated, tokens, strict=False):
            if old != new:
                break
            common += 1
        # At least one prompt token must be decoded to get logits to sample from.
        common = min(common, len(tokens) - 1)
        llama.llama_memory_seq_rm(llama.llama_get_memory(self._ctx), 0, common, -1)
        del self._evaluated[common:]
        return common

    def _decode(self, tokens: Sequence[int]) -> None:
        array = (llama.llama_token * len(tokens))(*tokens)
        status = llama.llama_decode(self._ctx, llama.llama_batch_get_one(array, len(tokens)))
        if status != 0:
            problems = "; ".join(llama_log().drain()[-2:])
            raise RuntimeError(f"llama_decode failed with status {status}: {problems}")
        self._evaluated.extend(tokens)

    def window_logits(self, tokens: Sequence[int], first_scored: int) -> np.ndarray:
        """Logits after each of tokens[first_scored:], from a fresh cache, as one window.

        Row i predicts tokens[first_scored + i + 1]; what perplexity scores.
        """
        if len(tokens) > self.n_ctx:
            raise ValueError(f"a window of {len(tokens)} tokens exceeds the context {self.n_ctx}")
        self.clear_cache()
        rows: list[np.ndarray] = []
        batch = llama.llama_batch_init(self.n_batch, 0, 1)
        try:
            for start in range(0, len(tokens), self.n_batch):
                chunk = tokens[start : start + self.n_batch]
                outputs = 0
                for i, token in enumerate(chunk):
                    position = start + i
                    batch.token[i] = token
                    batch.pos[i] = position
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = position >= first_scored
                    outputs += position >= first_scored
                batch.n_tokens = len(chunk)
                status = llama.llama_decode(self._ctx, batch)
                if status != 0:
                    problems = "; ".join(llama_log().drain()[-2:])
                    raise RuntimeError(f"llama_decode failed with status {status}: {problems}")
                if outputs:
                    pointer = llama.llama_get_logits(self._ctx)
                    rows.append(np.ctypeslib.as_array(pointer, (outputs, self.n_vocab)).copy())
        finally:
            llama.llama_batch_free(batch)
        self._evaluated.extend(tokens)
        return np.concatenate(rows)

    @property
    def cached_tokens(self) -> int:
        """Positions whose KV cells hold evaluated tokens (what a next prompt may reuse)."""
        return len(self._evaluated)

    def clear_cache(self) -> None:
        llama.llama_memory_clear(llama.llama_get_memory(self._ctx), True)
        self._evaluated.clear()

    @property
    def add_bos(self) -> bool:
        return bool(llama.llama_vocab_get_add_bos(self._vocab))

    @property
    def bos_token(self) -> int:
        return llama.llama_vocab_bos(self._vocab)

    def perf(self) -> dict[str, float]:
        """llama.cpp's own counters for the last request (prompt eval and eval times)."""
        data = llama.llama_perf_context(self._ctx)
        return {
            "t_load_ms": data.t_load_ms,
            "t_p_eval_ms": data.t_p_eval_ms,
            "t_eval_ms": data.t_eval_ms,
            "n_p_eval": data.n_p_eval,
            "n_eval": data.n_eval,
        }

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            llama.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            llama.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def sampler_chain(
    sampling: SamplingParams,
    seed: int,
    prompt_tokens: Sequence[int],
    banned: Sequence[int],
    n_vocab: int,
):
    chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())

    def add(sampler) -> None:
        llama.llama_sampler_chain_add(chain, sampler)

    if banned:
        biases = (llama.llama_logit_bias * len(banned))()
        for slot, token in zip(biases, banned, strict=True):
            slot.token, slot.bias = token, float("-inf")
        add(llama.llama_sampler_init_logit_bias(n_vocab, len(banned), biases))

    if sampling.repeat_penalty != 1.0:
        add(
            llama.llama_sampler_init_penalties(
                sampling.repeat_last_n, sampling.repeat_penalty, 0.0, 0.0
            )
        )
        # The penalty also looks back into the prompt, as llama.cpp's own tools do.
        for token in prompt_tokens[-sampling.repeat_last_n :]:
            llama.llama_sampler_accept(chain, token)
    if sampling.temperature <= 0:
        add(llama.llama_sampler_init_greedy())
        return chain
    if sampling.top_k > 0:
        add(llama.llama_sampler_init_top_k(sampling.top_k))
    if sampling.top_p < 1.0:
        add(llama.llama_sampler_init_top_p(sampling.top_p, 1))
    if sampling.min_p > 0.0:
        add(llama.llama_sampler_init_min_p(sampling.min_p, 1))
    add(llama.llama_sampler_init_temp(sampling.temperature))
    add(llama.llama_sampler_init_dist(seed))
    return chain


def _load_failure(path: Path, problems: list[str]) -> str:
    errors = [p for p in problems if "error" in p.lower() or "fail" in p.lower()] or problems
    reason = "; ".join(errors[-2:]) or "llama.cpp gave no reason (run with --verbose)"
    return f"llama.cpp cannot load {path}: {reason}"
