#!/usr/bin/env bash
# The GPU check of issue 35 in one command, from the repository root of a machine with CUDA PyTorch
# (CONTRIBUTING.md, "GPU check"):
#
#     bash scripts/device_check.sh OUTDIR [--dry-run]
#
# Stages, each under its own `timeout` and the whole under DEADLINE seconds (default 480); a stage that
# fails is recorded (OUTDIR/stages.jsonl: stage, status, exit code, seconds, note) and the next runs:
#   wheels   install .device-bundle/wheels (make device-bundle) into a scratch folder, SB_SITE
#            (default /tmp/sb-site), put first on PYTHONPATH after src/ ("no bundle" where none)
#   env      versions (torch, CUDA, GPU, transformers, TRL, accelerate, flash-attn, torch varlen)
#            -> env.json
#   tests    the CUDA tier: pytest -m cuda tests/cuda (150 s) -> cuda_tests.xml, cuda_tests.log
#   cpu      beside it, on the other half of the cores with the GPU hidden: the tests whose result
#            depends on the CPU's bf16 ability (each under the three forced paths) on the host's CPU,
#            which may have native bf16 (issue 33) (150 s) -> its flags and closing line in the
#            stage's note, its log appended to cuda_tests.log
#   bench    benchmarks/gpu_train.py (300 s) -> gpu.jsonl, gpu_bench.log
#   summary  benchmarks/gpu_summary.py -> summary.md
# setup.log holds the wheel install's and the env stage's output. Eight files in all.
#
# --dry-run (no GPU, e.g. CI): the wheels go in with pip's --python-version 3.12 (they are cp312: not
# imported here), the tier is only collected (--collect-only), the benchmark runs its tiny model on CPU
# (--dry-run: two steps a row); without .device-bundle/lengths it uses the embedded default data set's
# lengths (scripts/device_lengths.py default).
set -uo pipefail
OUT="${1:?usage: scripts/device_check.sh OUTDIR [--dry-run]}"
DRY=0
[ "${2:-}" = "--dry-run" ] && DRY=1
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
SITE="${SB_SITE:-/tmp/sb-site}"
DEADLINE="${DEADLINE:-480}"
START=$(date +%s)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_HOME="${SB_HF_HOME:-/tmp/sb-hf-home}"  # datasets' cache: scratch, never the tree
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"  # less fragmentation between rows
: > "$OUT/stages.jsonl"
: > "$OUT/setup.log"

left() { echo $((DEADLINE - ($(date +%s) - START))); }

# record STAGE STATUS RC SECONDS NOTE
record() {
    "$PY" - "$OUT/stages.jsonl" "$@" <<'PYEOF'
import json, sys
path, stage, status, rc, seconds, note = sys.argv[1:7]
with open(path, "a") as f:
    f.write(json.dumps({"stage": stage, "status": status, "rc": int(rc), "seconds": int(seconds), "note": note}) + "\n")
PYEOF
}

# stage NAME BUDGET_S LOG COMMAND...: run under timeout min(BUDGET, what the deadline leaves - 15 s)
stage() {
    local name="$1" budget="$2" log="$3"
    shift 3
    local t=$(($(left) - 15))
    [ "$t" -gt "$budget" ] && t="$budget"
    if [ "$t" -le 5 ]; then
        record "$name" skipped 0 0 "deadline: $(left) s left of ${DEADLINE} s"
        return 0
    fi
    local t0=$(date +%s)
    timeout -k 10 "$t" "$@" >> "$log" 2>&1
    local rc=$?
    local secs=$(($(date +%s) - t0))
    local status=ok note=""
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status=timeout note="killed after ${t} s"
    elif [ "$rc" -ne 0 ]; then
        status=failed note="exit $rc; last line: $(tail -n 1 "$log" | tr -d '"\\' | cut -c1-200)"
    fi
    record "$name" "$status" "$rc" "$secs" "$note"
    return 0
}

# 1. wheels
WHEELS=(.device-bundle/wheels/*.whl)
if [ -e "${WHEELS[0]}" ]; then
    rm -rf "$SITE"
    PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE")
    if [ "$DRY" = 1 ]; then
        PIP+=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    fi
    stage wheels 120 "$OUT/setup.log" "${PIP[@]}" "${WHEELS[@]}"
    [ "$DRY" = 1 ] || export PYTHONPATH="$PWD/src:$SITE"
    if [ "$DRY" = 1 ]; then
        echo "wheels in $SITE: $(ls "$SITE" | grep -c dist-info) dist-info folders (cp312: not imported by the dry run)" >> "$OUT/setup.log"
    fi
else
    record wheels skipped 0 0 "no bundle: .device-bundle/wheels/*.whl absent (make device-bundle); the installed packages are used"
fi
[ -n "${PYTHONPATH:-}" ] || export PYTHONPATH="$PWD/src"

# 2. env
stage env 60 "$OUT/setup.log" "$PY" benchmarks/gpu_train.py --env "$OUT/env.json"

# 3. the CUDA tier, and beside it the CPU tier on the host's CPU
CPU_TESTS=(tests/test_precision.py tests/conformance/test_precision_vs_trl.py
           tests/conformance/test_upstream_options.py tests/test_attention.py tests/test_bench.py tests/test_compat.py)
cpu_tier() {
    local log="$OUT/.cpu_tests.log" t0 rc status note flags model cores pin=() xdist=()
    t0=$(date +%s)
    flags=$(grep -o -w -E 'avx512_bf16|amx_bf16|amx_tile|avx512f|avx2' /proc/cpuinfo 2>/dev/null | sort -u | tr '\n' ' ')
    model=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//' | tr -d '"\\')
    cores=$(nproc)
    [ "$cores" -ge 4 ] && pin=(taskset -c "$((cores / 2))-$((cores - 1))")
    "$PY" -c "import xdist" 2>/dev/null && [ "$cores" -ge 8 ] && xdist=(-n 4)
    local args=(-p no:cacheprovider -q "${CPU_TESTS[@]}")
    [ "$DRY" = 1 ] && args+=(--collect-only) && xdist=()
    CUDA_VISIBLE_DEVICES="" timeout -k 10 "$1" "${pin[@]}" "$PY" -m pytest "${xdist[@]}" "${args[@]}" > "$log" 2>&1
    rc=$?
    status=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=timeout; elif [ "$rc" -ne 0 ]; then status=failed; fi
    note="host CPU: ${model:-unknown}, ${cores} cores; flags: ${flags:-none}; $(grep -E '(passed|failed|error|tests? collected)' "$log" | tail -n 1 | tr -d '"\\=' | sed 's/^ *//' | cut -c1-200)"
    record cpu "$status" "$rc" $(($(date +%s) - t0)) "$note"
}
CPU_BUDGET=$(( $(left) - 15 ))
[ "$CPU_BUDGET" -gt 150 ] && CPU_BUDGET=150
if [ "$CPU_BUDGET" -gt 5 ]; then
    cpu_tier "$CPU_BUDGET" &
    CPU_PID=$!
else
    record cpu skipped 0 0 "deadline: $(left) s left of ${DEADLINE} s"
    CPU_PID=""
fi
if [ -d tests/cuda ]; then
    if [ "$DRY" = 1 ]; then
        stage tests 150 "$OUT/cuda_tests.log" "$PY" -m pytest -m cuda tests/cuda -rA -p no:cacheprovider \
            --collect-only -q --junitxml="$OUT/cuda_tests.xml"
    else
        stage tests 150 "$OUT/cuda_tests.log" "$PY" -m pytest -m cuda tests/cuda -rA -p no:cacheprovider \
            --junitxml="$OUT/cuda_tests.xml"
    fi
else
    record tests skipped 0 0 "no tier: tests/cuda absent in this tree"
fi

[ -n "$CPU_PID" ] && wait "$CPU_PID"
if [ -e "$OUT/.cpu_tests.log" ]; then  # at most eight files come back: the CPU tier's log joins the CUDA tier's
    { echo; echo "== CPU tier on the host CPU (CUDA_VISIBLE_DEVICES=''): ${CPU_TESTS[*]}"; cat "$OUT/.cpu_tests.log"; } >> "$OUT/cuda_tests.log"
    rm -f "$OUT/.cpu_tests.log"
fi

# 4. the GPU benchmark
LENGTHS=.device-bundle/lengths
BENCH=("$PY" benchmarks/gpu_train.py --json)
if [ "$DRY" = 1 ]; then
    BENCH+=(--dry-run)
    if [ ! -e "$LENGTHS/lima_lengths.npy" ]; then
        LENGTHS="$OUT/.lengths"
        stage lengths 60 "$OUT/gpu_bench.log" "$PY" scripts/device_lengths.py "$LENGTHS" default
        BENCH+=(--data default)
    else
        BENCH+=(--data lima)
    fi
fi
BUDGET=$(( $(left) - 25 ))
[ "$BUDGET" -gt 300 ] && BUDGET=300
# A row starts only while at least 45 s of the stage are left; later ones are recorded as skipped.
BENCH+=(--lengths "$LENGTHS" --deadline-s $((BUDGET > 45 ? BUDGET - 45 : 0)))
t0=$(date +%s)
t=$BUDGET
if [ "$t" -le 5 ]; then
    record bench skipped 0 0 "deadline: $(left) s left"
else
    timeout -k 10 "$t" "${BENCH[@]}" > "$OUT/gpu.jsonl" 2>> "$OUT/gpu_bench.log"
    rc=$?
    secs=$(($(date +%s) - t0))
    n=$(grep -c '^{' "$OUT/gpu.jsonl" || true)
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        record bench timeout "$rc" "$secs" "killed after ${t} s with $n records"
    elif [ "$rc" -ne 0 ]; then
        record bench failed "$rc" "$secs" "exit $rc with $n records; last line: $(tail -n 1 "$OUT/gpu_bench.log" | tr -d '"\\' | cut -c1-200)"
    else
        record bench ok 0 "$secs" "$n records"
    fi
fi
rm -rf "$OUT/.lengths"

# 5. the summary; logs cut to their last 4 MiB (what comes back is at most 16 MiB a file)
for f in "$OUT"/*.log; do
    if [ "$(stat -c %s "$f")" -gt 4194304 ]; then
        tail -c 4194304 "$f" > "$f.tmp" && mv "$f.tmp" "$f"
    fi
done
"$PY" benchmarks/gpu_summary.py "$OUT" || echo "# GPU check: summary failed, see stages.jsonl" > "$OUT/summary.md"
echo "device_check: $(( $(date +%s) - START )) s; $OUT:"
ls -la "$OUT"
cat "$OUT/summary.md"
