#!/usr/bin/env bash
# compute-sanitizer over the CUDA KV-cache compaction tests (tests/ops/compact_kv_cache/test_kernels.py).
#
#   bash scripts/compute_sanitizer.sh [OUT_DIR] [extra pytest args...]
#
# Tools: memcheck (out-of-bounds and misaligned global accesses; the tests with out-of-range
# indices and validation off are the point of it), racecheck (shared-memory hazards; the kernel
# uses none, so it should stay silent), synccheck (barriers reached by part of a block).
# PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every tensor its own cudaMalloc, so memcheck sees an
# access past a tensor instead of landing silently in a pooled neighbour.
# Exits 0 when there is no compute-sanitizer or no GPU (says so), else non-zero if any tool
# reports an error or a test fails.  Logs go to OUT_DIR/sanitizer_<tool>.log.  Called by
# scripts/gpu_check.sh within a 90 s budget: the selections below are kept small.
set -uo pipefail
OUT="${1:-/tmp/specdec_sanitizer}"
shift || true
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
SAN="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}"
if [ ! -x "$SAN" ]; then
  echo "compute_sanitizer.sh: compute-sanitizer not found; nothing checked"
  exit 0
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "compute_sanitizer.sh: no CUDA device; nothing checked"
  exit 0
fi
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
TESTS=tests/ops/compact_kv_cache/test_kernels.py
# memcheck: every access-pattern case of the CUDA kernel (native tests only, not the host emulation).
MEMCHECK_K="native and (out_of_range or overlap_hazard or layouts or long_paths or misaligned or identity or index_dtypes or cuda_ or fp16-D67)"
# racecheck / synccheck: the cases with several chunks per block and the overlap hazard.
SYNC_K="native and (overlap_hazard or long_paths or out_of_range)"

status=0
run() {  # run TOOL SELECTION LIMIT
  local tool=$1 sel=$2 limit=$3 t0=$SECONDS
  timeout "$limit" "$SAN" --tool "$tool" --error-exitcode 86 --print-limit 20 \
    "$PY" -m pytest -q -x -p no:cacheprovider "$TESTS" -k "$sel" "${@:4}" >"$OUT/sanitizer_$tool.log" 2>&1
  local rc=$?
  local errors
  errors=$(grep -Eo "ERROR SUMMARY: [0-9]+ error" "$OUT/sanitizer_$tool.log" | tail -n 1)
  printf 'compute-sanitizer %-10s rc=%-3s %4ss  %s\n' "$tool" "$rc" "$((SECONDS - t0))" "${errors:-no summary}"
  tail -n 2 "$OUT/sanitizer_$tool.log"
  [ "$rc" -eq 0 ] || status=1
}
run memcheck "$MEMCHECK_K" 45 "$@"
run racecheck "$SYNC_K" 20 "$@"
run synccheck "$SYNC_K" 20 "$@"
exit $status
