"""The llama_context a loaded model decodes in: its parameters from LoadOptions (the KV types
the model's heads can hold, each sequence its own cells), and the warm-up every load ends with."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import llama_cpp as llama

from cli.engine.options import LoadOptions
from cli.errors import KvCacheTypeError
from quant.kv import QUANTIZED_KV_TYPES, ggml_type


def refuse_impossible_kv_types(kv_type_k: str, kv_type_v: str, head_dims: tuple[int, int]) -> None:
    """Quantized KV caches store blocks of 32 values per head: the head size must divide."""
    for which, cache_type, head_dim in (
        ("K", kv_type_k, head_dims[0]),
        ("V", kv_type_v, head_dims[1]),
    ):
        if cache_type in QUANTIZED_KV_TYPES and head_dim % 32:
            raise KvCacheTypeError(cache_type, which, head_dim)


def context_params(options: LoadOptions, n_ctx: int, threads: int) -> Any:
    """llama.cpp's context parameters for options.parallel sequences of n_ctx positions."""
    params = llama.llama_context_default_params()
    params.n_ctx = n_ctx * options.parallel
    params.n_seq_max = options.parallel
    params.kv_unified = False  # each sequence owns n_ctx cells: no one starves another
    params.n_batch = min(options.n_batch, n_ctx)
    params.n_ubatch = min(options.n_batch, n_ctx)
    params.n_threads = threads
    params.n_threads_batch = threads
    params.no_perf = False
    params.type_k = ggml_type(options.kv_type_k)
    params.type_v = ggml_type(options.kv_type_v)
    # llama.cpp needs flash attention to store V quantized; otherwise let it decide.
    quantized_v = options.kv_type_v in QUANTIZED_KV_TYPES
    params.flash_attn_type = (
        llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if quantized_v else llama.LLAMA_FLASH_ATTN_TYPE_AUTO
    )
    return params


def warm_up(model: Any, ctx: Any, ends: Sequence[int]) -> None:
    """Decode the vocabulary's ends (BOS, EOS) once, and leave no trace of it.

    As llama.cpp's own tools do at load (common_init_from_params): the first compute of a
    process pays one-time costs (buffers and weights first touched) that the first prompt's TTFT
    and prefill speed would otherwise carry. The step adds about one decode step to the load:
    0.25-0.3 s on an 8B-class model here, milliseconds on a 135M one."""
    if llama.llama_model_has_encoder(model):
        return  # an encoder-decoder model decodes only after an encode
    tokens = [token for token in ends if token != llama.LLAMA_TOKEN_NULL] or [0]
    tokens = tokens[: llama.llama_n_batch(ctx)]  # more than a batch aborts llama.cpp
    array = (llama.llama_token * len(tokens))(*tokens)

    def decode() -> None:
        # As in llama.cpp, a failed warm-up is not an error: the first prompt's decode reports it.
        llama.llama_decode(ctx, llama.llama_batch_get_one(array, len(tokens)))
        llama.llama_synchronize(ctx)

    # On a thread of its own, which takes its OpenMP workers with it when it ends. OpenMP gives
    # each thread that computes a team of its own, and once the process holds more worker
    # threads than there are cores, every barrier sleeps instead of spinning: a warm-up on the
    # loading thread, then decoding on quill serve's scheduler thread, made each batch step wake
    # its threads ~150 times (6% of serve's throughput).
    thread = threading.Thread(target=decode, name="quill-warm-up")
    thread.start()
    thread.join()
    llama.llama_memory_clear(llama.llama_get_memory(ctx), True)
    llama.llama_perf_context_reset(ctx)
