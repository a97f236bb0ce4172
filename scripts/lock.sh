#!/usr/bin/env bash
# The newest releases the package metadata allows, tested: make test-latest, and make lock.
#
#   scripts/lock.sh VENV [--write LOCKFILE]
#
# Installs (or upgrades) VENV with every dev and docs extra at the newest versions, ignoring the lock, runs the
# default test suite there, and with --write replaces LOCKFILE with that environment's versions, but
# only if the suite passed. torch is left out of the lock: set-up installs it on its own (the CPU
# build where there is no torch and no GPU, an existing torch left alone).
set -euo pipefail
VENV=${1:?usage: scripts/lock.sh VENV [--write LOCKFILE]}
WRITE=${3:-}
[ "${2:-}" = --write ] && [ -z "$WRITE" ] && { echo "lock: --write needs a file" >&2; exit 2; }
LOCK=none UPGRADE=1 bash scripts/setup_venv.sh "$VENV" dev,docs
"$VENV/bin/python" -m pip --disable-pip-version-check list --format=freeze 2>/dev/null \
  | grep -iE '^(transformers|accelerate|trl|datasets|tokenizers|torch|numpy|numba)=' | sed 's/^/lock: newest /'
echo "lock: running the default test suite on the newest releases"
HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest ${PYTEST_ARGS:-}
if [ -n "$WRITE" ]; then
  tmp=$(mktemp)
  {
    echo "# The versions \`make venv\` / \`make venv-dev\` install (a pip constraints file: every package of"
    echo "# smart-batching[dev,docs], transitive ones included). Written by \`make lock\` after the default test"
    echo "# suite passed on them; do not edit by hand. torch is not here: set-up installs it on its own."
    echo "# Resolved with $("$VENV/bin/python" -c 'import platform,sys; print(f"Python {sys.version.split()[0]} on {platform.system()} {platform.machine()}")') on $(date -u +%Y-%m-%d)."
    "$VENV/bin/python" -m pip --disable-pip-version-check freeze --exclude-editable 2>/dev/null \
      | grep -viE '^(torch|triton|nvidia-[a-z0-9_-]+|smart-batching)==' | LC_ALL=C sort -f
  } > "$tmp"
  mv "$tmp" "$WRITE"
  echo "lock: wrote $WRITE ($(grep -vc '^#' "$WRITE") packages)"
fi
