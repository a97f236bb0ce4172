#!/usr/bin/env bash
# The default test suite under the machine settings a user's computer may have, one run each:
#
#   scripts/test_matrix.sh [RESULTS]          (make test-matrix)
#
#   one-core        taskset -c 0: one usable core (os.sched_getaffinity), torch's threads follow it
#   omp-1           OMP_NUM_THREADS=1: one intra-op thread
#   onednn-off      SMART_BATCHING_TEST_MKLDNN=0: torch.backends.mkldnn.enabled=False in the test session
#                   (bf16 products take ATen's reference GEMM, as on a CPU without AVX-512)
#   isa-avx512      ONEDNN_MAX_CPU_ISA=AVX512_CORE: oneDNN capped below AVX512-BF16 (bf16 emulated, as
#                   on a Skylake / Ice Lake Xeon; on a CPU without AVX-512 it changes nothing)
#   half-native     SMART_BATCHING_CPU_HALF=native     the library's CPU half-precision path forced
#   half-emulated   SMART_BATCHING_CPU_HALF=emulated   (smart_batching.compat.cpu_half_matmul); torch's
#   half-reference  SMART_BATCHING_CPU_HALF=reference  kernels stay this machine's
#
# MATRIX="omp-1 half-native" runs some of them; PYTEST_ARGS is passed to every run (test files, -k, ...;
# the default suite, -m 'not slow', where it names none). Each run's log goes to out/test-matrix/NAME.log,
# its closing pytest line to RESULTS (default out/test-matrix/results.tsv: name, exit status, seconds,
# line); a table of all of them is printed at the end. Exit status: 1 where any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-out/test-matrix}
RESULTS=${1:-$OUT/results.tsv}
ALL="one-core omp-1 onednn-off isa-avx512 half-native half-emulated half-reference"
MATRIX=${MATRIX:-$ALL}
read -r -a PYTEST_EXTRA <<< "${PYTEST_ARGS:-}"

setting() {  # NAME -> the command prefix that sets it up
  case "$1" in
    one-core) echo "taskset -c 0" ;;
    omp-1) echo "env OMP_NUM_THREADS=1" ;;
    onednn-off) echo "env SMART_BATCHING_TEST_MKLDNN=0" ;;
    isa-avx512) echo "env ONEDNN_MAX_CPU_ISA=AVX512_CORE" ;;
    half-native | half-emulated | half-reference) echo "env SMART_BATCHING_CPU_HALF=${1#half-}" ;;
    *) return 1 ;;
  esac
}

for name in $MATRIX; do
  setting "$name" >/dev/null || { echo "test-matrix: unknown run '$name' (one of: $ALL)" >&2; exit 2; }
done
if [[ " $MATRIX " == *" one-core "* ]] && ! command -v taskset >/dev/null; then
  echo "test-matrix: taskset not found (util-linux); leave one-core out: MATRIX=\"${ALL#one-core }\"" >&2
  exit 2
fi
mkdir -p "$OUT" "$(dirname "$RESULTS")"
: > "$RESULTS"
failed=0
for name in $MATRIX; do
  read -r -a prefix <<< "$(setting "$name")"
  log="$OUT/$name.log"
  echo "test-matrix: $name (${prefix[*]}) -> $log"
  start=$SECONDS
  HF_HUB_OFFLINE=1 "${prefix[@]}" "$PY" -m pytest -p no:cacheprovider "${PYTEST_EXTRA[@]}" > "$log" 2>&1
  rc=$?
  # pytest's closing line ("== 3 passed, 1 skipped in 9.87s ==", or without the rules under -q).
  line=$(grep -E '(passed|failed|error|skipped|deselected|no tests ran).* in [0-9.]+s' "$log" | tail -n 1 \
    | sed -E 's/^=+ //; s/ =+$//')
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "${line:-no summary line (see $log)}" >> "$RESULTS"
  [ "$rc" -eq 0 ] || failed=1
done
echo
printf '%-15s %-40s %4s %6s  %s\n' run setting rc wall "pytest's closing line"
while IFS=$'\t' read -r name rc seconds line; do
  printf '%-15s %-40s %4s %5ss  %s\n' "$name" "$(setting "$name")" "$rc" "$seconds" "$line"
done < "$RESULTS"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ //'), $(nproc --all) cores ($(nproc) usable here);" \
  "bf16 path detected: $(env -u SMART_BATCHING_CPU_HALF HF_HUB_OFFLINE=1 "$PY" -c 'import torch; from smart_batching import compat; print(compat.cpu_half_matmul(torch.bfloat16))' 2>/dev/null)"
exit $failed
