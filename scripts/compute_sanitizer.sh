#!/usr/bin/env bash
# compute-sanitizer over the CUDA KV-cache compaction: scripts/sanitizer_driver.py, a small driver
# of its access patterns (one buffer, separately allocated layers, paged NHD/HND, narrow words,
# out-of-range indices with validation off, overlapping moves), not pytest (whose start-up and
# collection under a sanitizer took most of the old budget).
#
#   bash scripts/compute_sanitizer.sh [OUT_DIR]
#
# Tools: memcheck (out-of-bounds and misaligned global accesses; the out-of-range case with
# validation off is the point of it), racecheck (shared-memory hazards; the kernel uses none, so
# it should stay silent), synccheck (barriers reached by part of a block).
# PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every tensor its own cudaMalloc, so memcheck sees an
# access past a tensor instead of landing silently in a pooled neighbour.
# Exits 0 when there is no compute-sanitizer or no GPU (says so), else non-zero if any tool
# reports an error or the driver finds a difference.  Logs go to OUT_DIR/sanitizer_<tool>.log.
# Called by scripts/gpu_check.sh within its budget (the limits below: 60 s in all).
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
status=0
run() {  # run TOOL LIMIT
  local tool=$1 limit=$2 t0=$SECONDS
  timeout "$limit" "$SAN" --tool "$tool" --error-exitcode 86 --print-limit 20 \
    "$PY" scripts/sanitizer_driver.py >"$OUT/sanitizer_$tool.log" 2>&1
  local rc=$?
  local errors
  errors=$(grep -Eo "ERROR SUMMARY: [0-9]+ error" "$OUT/sanitizer_$tool.log" | tail -n 1)
  printf 'compute-sanitizer %-10s rc=%-3s %4ss  %s\n' "$tool" "$rc" "$((SECONDS - t0))" "${errors:-no summary}"
  tail -n 2 "$OUT/sanitizer_$tool.log"
  [ "$rc" -eq 0 ] || status=1
}
run memcheck 25
run racecheck 20
run synccheck 15
exit $status
