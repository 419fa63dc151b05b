"""llama-bench's tg test from a bare Python process: llama-cpp-python's low-level API running
llama-bench's own `test_gen` loop (a 1-token warm-up, the cells cleared, then N decodes of one
random token each, no sampling), with quill's AMX-guarded load and nothing else of quill's. Set
beside `quill run` and `llama-bench -p 0 -n 128` in interleaved rounds, it tells a gap in quill's
loop from one that any Python process driving llama.cpp has
(benchmarks/results/log-at-scale-2026-12-02.md).

  python -m benchmarks.bare_python_tg /work/shapes/llama-3-8b-shape.Q4_K_M.gguf -t 2
prints decode tokens/s.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import llama_cpp as llama

from cli.engine.llamalog import llama_log
from cli.engine.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("-n", type=int, default=128, help="tokens decoded (llama-bench's -n)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    llama_log()  # llama.cpp's log lines are kept, as quill keeps them, not printed
    loaded = load_model(args.model)
    params = llama.llama_context_default_params()
    params.n_ctx = args.n  # llama-bench's context for a tg test: n_prompt + n_gen
    params.n_batch = params.n_ubatch = min(512, args.n)
    params.n_threads = params.n_threads_batch = args.threads
    params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_AUTO
    context = llama.llama_init_from_model(loaded.model, params)
    vocab = llama.llama_model_get_vocab(loaded.model)
    n_vocab = llama.llama_vocab_n_tokens(vocab)
    token = (llama.llama_token * 1)()

    def generate(n: int) -> None:  # llama-bench's test_gen
        token[0] = llama.llama_vocab_bos(vocab)
        for _ in range(n):
            llama.llama_decode(context, llama.llama_batch_get_one(token, 1))
            llama.llama_synchronize(context)
            token[0] = random.randrange(n_vocab)

    generate(1)  # llama-bench's warm-up
    llama.llama_memory_clear(llama.llama_get_memory(context), False)
    started = time.perf_counter()
    generate(args.n)
    print(f"{args.n / (time.perf_counter() - started):.3f}")
    llama.llama_free(context)
    llama.llama_model_free(loaded.model)


if __name__ == "__main__":
    main()
