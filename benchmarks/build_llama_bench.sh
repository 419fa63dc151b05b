#!/usr/bin/env bash
# Build llama.cpp's own tools (llama-bench, llama-perplexity, llama-batched-bench, llama-server,
# llama-completion, llama-lookup, llama-speculative-simple, ggml-rpc-server) from the very
# llama-cpp-python sdist quill runs on: both sides of every ratio share one source and flags.
# GGML_RPC is on, as in quill's install (issue 28): llama-bench --rpc is the reference client.
# Usage: benchmarks/build_llama_bench.sh   (inside the venv quill is installed in; ~5 min on 2 cores)
# Prints the path of the llama-bench binary on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
work="$here/.build/llama-cpp-python-$version"
mkdir -p "$work"
if [ ! -d "$work/src" ]; then
  pip download --quiet --no-deps --no-binary :all: --dest "$work" "llama-cpp-python==$version" >&2
  mkdir -p "$work/src"
  tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work/src" --strip-components=1
fi
tools="llama-bench llama-embedding llama-perplexity llama-batched-bench llama-server llama-completion llama-lookup llama-speculative-simple ggml-rpc-server"
missing=0
for tool in $tools; do [ -x "$work/build/bin/$tool" ] || missing=1; done
# A build dir configured before RPC was added lacks ggml-rpc-server: the test above reruns cmake with
# the flag (an existing cache keeps its other settings), and every tool relinks against RPC-enabled ggml.
if [ "$missing" = 1 ]; then
  cmake -S "$work/src/vendor/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DGGML_RPC=ON >&2
  cmake --build "$work/build" --target $tools -j "$(nproc)" >&2
fi
echo "$work/build/bin/llama-bench"
