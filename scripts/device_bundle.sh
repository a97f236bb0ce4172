#!/usr/bin/env bash
# `make device-bundle`: what a GPU machine with CUDA PyTorch but no network needs beside this tree, in
# .device-bundle/ (ignored by git; carried to the machine with the tree, 64 MiB in all):
#   wheels/   the packages the device image lacks or has too old, at requirements/lock.txt's versions,
#             for CPython 3.12 on manylinux x86_64 (never torch, numpy or nvidia-*: the image's own stay)
#   lengths/  token lengths of GSM8K, LIMA and SGD (scripts/device_lengths.py), since the device has
#             neither ../shared nor tokenizer files
# scripts/device_check.sh installs the wheels into a scratch folder and reads the lengths.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || { echo "device-bundle: no $PY (make venv-dev, or PY=/path/to/python)" >&2; exit 1; }
BUNDLE=.device-bundle
LIMIT_MB="${LIMIT_MB:-55}"
# The device image (/work/.library/device/KINDS.md) has accelerate, numpy, numba, pandas, pyarrow,
# safetensors, xxhash, anyio, h11, idna, typer, jinja2, psutil, pyyaml, packaging, tqdm; these it lacks
# or holds at versions older than transformers 5.24 / TRL 1.16 / datasets 5.2 require (Requires-Dist).
PACKAGES=(transformers trl datasets huggingface_hub tokenizers hf-xet httpx2 httpcore2 truststore
          dill multiprocess fsspec click regex)
pins=()
for p in "${PACKAGES[@]}"; do
    line=$(grep -i -E "^${p//[-_]/[-_]}==" requirements/lock.txt || true)
    [ -n "$line" ] || { echo "device-bundle: $p is not in requirements/lock.txt" >&2; exit 1; }
    pins+=("$line")
done
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/wheels" "$BUNDLE/lengths"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$BUNDLE/wheels" "${pins[@]}"
printf '%s\n' "${pins[@]}" > "$BUNDLE/wheels/PINS.txt"
PYTHONPATH="$PWD/src" HF_HUB_OFFLINE=1 "$PY" scripts/device_lengths.py "$BUNDLE/lengths"
size_kb=$(du -sk "$BUNDLE" | cut -f1)
echo "device-bundle: $BUNDLE holds $(ls "$BUNDLE/wheels"/*.whl | wc -l) wheels and $(ls "$BUNDLE/lengths"/*.npy | wc -l) length arrays, $((size_kb / 1024)) MiB (limit ${LIMIT_MB} MiB)"
if [ "$size_kb" -gt $((LIMIT_MB * 1024)) ]; then
    echo "device-bundle: $BUNDLE is $((size_kb / 1024)) MiB, over the ${LIMIT_MB} MiB limit (the carry holds 64 MiB)" >&2
    exit 1
fi
