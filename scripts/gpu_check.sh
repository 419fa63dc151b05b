#!/usr/bin/env bash
# Check quill's GPU path on a machine with an NVIDIA GPU and the CUDA toolkit (nvcc).
#   scripts/gpu_check.sh [MODEL]
# Builds llama-cpp-python with CUDA into .venv-gpu (several minutes), then checks that:
#   1. the build reports GPU offload support;
#   2. `quill run` offloads every layer by default and with --gpu-layers all, and llama.cpp agrees;
#   3. --gpu-layers 0 stays on the CPU, and greedy text matches the CPU run's first tokens;
#   4. decode on the GPU is faster than on the CPU;
#   5. quill serve batches concurrent requests on the GPU (benchmarks/serve_load.py at 1 and 8);
#   6. on a host CPU with AMX (most GPU servers' Xeons), the AMX guard's tests pass there too.
# With no network on the GPU machine, set WHEELHOUSE to a folder holding the sdists and wheels that
# `pip download` gathered beforehand (llama-cpp-python's sdist and its build requirements, quill's
# dependencies) and a copy of the model file as MODEL.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2-135m}
python3 -m venv .venv-gpu
. .venv-gpu/bin/activate
pip_args=(--no-cache-dir)
[ -n "${WHEELHOUSE:-}" ] && pip_args+=(--no-index --find-links "$WHEELHOUSE")
CMAKE_ARGS="-DGGML_CUDA=on -DGGML_RPC=on" pip install "${pip_args[@]}" --force-reinstall llama-cpp-python >&2
pip install "${pip_args[@]}" . >&2

# Not llama_supports_gpu_offload(): an RPC build says yes to it without a GPU.
python -c 'import sys; from cli.engine.hardware import gpu_memory; sys.exit(0 if gpu_memory() else "no GPU device in this build")'
echo "ok: this llama-cpp-python build can offload to the GPU"

prompt="Name three primary colors."
run() { quill run -m "$model" --temperature 0 -n 64 --ignore-eos --json "$@" "$prompt"; }
field() { python -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }
default=$(run); all=$(run --gpu-layers all); cpu=$(run --gpu-layers 0)
layers=$(echo "$all" | field gpu_layers)
[ "$layers" -gt 0 ] && [ "$(echo "$default" | field gpu_layers)" = "$layers" ] \
  || { echo "FAIL: default or 'all' did not offload every layer" >&2; exit 1; }
[ "$(echo "$cpu" | field gpu_layers)" = 0 ] || { echo "FAIL: --gpu-layers 0 offloaded" >&2; exit 1; }
quill run -m "$model" -n 2 --verbose --gpu-layers all "$prompt" 2>&1 >/dev/null \
  | grep -E "offloaded [0-9]+/[0-9]+ layers to GPU" || { echo "FAIL: llama.cpp offloaded nothing" >&2; exit 1; }
echo "ok: $layers layers offloaded by default and with --gpu-layers all"
# Offloaded layers stay where llama.cpp puts them: no by-name CPU overrides with GPU layers.
quill run -m "$model" -n 2 --verbose --gpu-layers all "$prompt" 2>&1 >/dev/null | grep "CPU path:"

gpu_text=$(echo "$all" | field text); cpu_text=$(echo "$cpu" | field text)
# Different kernels round differently, so only the start of a greedy reply must agree.
[ "${gpu_text:0:20}" = "${cpu_text:0:20}" ] || echo "note: GPU and CPU greedy text differ early: '${gpu_text:0:40}' vs '${cpu_text:0:40}'"
gpu_tps=$(echo "$all" | field decode_tokens_per_s); cpu_tps=$(echo "$cpu" | field decode_tokens_per_s)
echo "decode tokens/s: GPU $gpu_tps, CPU $cpu_tps"
python -c "import sys; sys.exit(0 if $gpu_tps > $cpu_tps else 'FAIL: GPU decode is not faster than CPU')"
python benchmarks/serve_load.py --concurrency 1,8 --requests 16 --max-tokens 64
if grep -qw amx_int8 /proc/cpuinfo; then
  echo "this host CPU has AMX: running the guard's tests and the reference-decoder tests here"
  pip install "${pip_args[@]}" '.[test]' >&2
  pytest -q tests/test_hardware.py tests/test_cli_run.py tests/test_neartie.py
fi
echo "ok: the GPU path works"
