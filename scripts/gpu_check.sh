#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU and no internet (torch, triton, nvcc and ninja
# installed; our other Python dependencies may be missing), in one call of at most 6 minutes,
# set-up included: build the CUDA extension; the CUDA compaction's parity tests and a sample of
# the Triton parity tests on CUDA, the engine's steps with CUDA graphs against its eager steps
# (tests/engine/test_graphs_cuda.py); compute-sanitizer over a small driver of the compaction;
# the kernel benchmark at decode shapes (every op at B 1/8/64 and V 49152/128256: eager, host
# and CUDA-graph replay without an L2 flush, bytes and % of copy bandwidth); ours beside FlashInfer; the engine's verify/decode cost; a whole
# verification step at Llama-3-8B dimensions (4 layers), eager against CUDA-graph replay.  Every step
# prints its figures as it makes them and writes logs, JSON and plots to OUT_DIR; summary.txt
# and failures.log are the ones to read first.
#
#   bash scripts/gpu_check.sh OUT_DIR
#   bash scripts/gpu_check.sh --dry-run OUT_DIR    # no GPU needed: every step's command exists,
#                                                  # the limits add up (CI runs this)
#
# Budget: the steps' limits (STEPS below) add up to BUDGET_S = 320 s, under the 360 s a device
# call should be given (6 minutes); the rest is the wheel install and nvidia-smi.  Give the
# device call about 420 s so that a rerun still fits a 15-minute lease.
#
# FlashInfer travels as wheels in .whl/ (scripts/fetch_gpu_wheels.sh); they are installed into
# /tmp/specdec_site.
set -uo pipefail
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY=1
  shift
fi
OUT="${1:?usage: scripts/gpu_check.sh [--dry-run] OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
BUDGET_S=320
OUTER_S=360
PY="${PYTHON:-python3}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

# name, limit in seconds, command (run with bash -c from the repository root)
STEPS=(
  "build|75|$PY setup.py build_ext --inplace"
  "cuda_tests|50|$PY -m pytest -q -p no:cacheprovider \$($PY -c 'import xdist' 2>/dev/null && printf -- '-n 8') --junitxml=$OUT/pytest.xml -rfE tests/ops/compact_kv_cache tests/ops/verify_greedy tests/ops/rejection_sample tests/engine/test_graphs_cuda.py -k '(native and not emulat) or triton or cuda_graph or synchronises'"
  "sanitizer|60|bash scripts/compute_sanitizer.sh $OUT"
  "bench_kernels|50|$PY -m specdec_kernels.bench.kernels --decode --out $OUT"
  "flashinfer|45|$PY -m specdec_kernels.bench.flashinfer_side --out $OUT"
  "step_cost|15|$PY -m specdec_kernels.bench.step_cost --models llama3-8b --sizes 4,16,64 --out $OUT"
  "step_graphs|25|$PY -m specdec_kernels.bench.step_graphs --steps 20 --out $OUT"
)

total=0
for s in "${STEPS[@]}"; do
  IFS='|' read -r _ limit _ <<<"$s"
  total=$((total + limit))
done

if [ "$DRY" -eq 1 ]; then
  # Every step's command exists: python modules answer --help, scripts parse, pytest selections
  # collect at least one test; and the limits add up to the budget, under the outer limit.
  status=0
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<<"$s"
    case "$name" in
      build) check="$PY setup.py --name" ;;
      cuda_tests) check="${cmd/ -q / --collect-only -q }" ;;
      sanitizer) check="bash -n scripts/compute_sanitizer.sh && $PY -c 'import ast; ast.parse(open(\"scripts/sanitizer_driver.py\").read())'" ;;
      *) check="$(echo "$cmd" | sed -E 's/ --(quick|out) .*//') --help" ;;
    esac
    if bash -c "$check" >"$OUT/dry_$name.log" 2>&1; then
      note "$(printf 'dry-run %-14s limit %4ss  ok' "$name" "$limit")"
    else
      note "$(printf 'dry-run %-14s limit %4ss  FAILED: %s (log %s)' "$name" "$limit" "$check" "$OUT/dry_$name.log")"
      status=1
    fi
  done
  if [ "$total" -ne "$BUDGET_S" ] || [ "$total" -ge "$OUTER_S" ]; then
    note "dry-run: the limits add up to ${total}s, not BUDGET_S=${BUDGET_S}s under ${OUTER_S}s"
    status=1
  fi
  note "dry-run: ${#STEPS[@]} steps, limits ${total}s of ${OUTER_S}s, status $status"
  exit $status
fi

# SPECDEC_REQUIRE_NATIVE=1: a CUDA extension that did not build fails its tests instead of skipping them
export PYTHONUNBUFFERED=1 SPECDEC_TEST_LARGE=1 SPECDEC_FAILURE_LOG="$OUT/failures.log" SPECDEC_REQUIRE_NATIVE=1
unset TRITON_INTERPRET
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}"
if ls .whl/*.whl >/dev/null 2>&1; then
  timeout 20 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/specdec_site .whl/*.whl \
    && export PYTHONPATH="/tmp/specdec_site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
note "== $(date -u +%FT%TZ) $(timeout 20 "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name())' 2>&1)"
note "== ${#STEPS[@]} steps, limits ${total}s"
for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  t0=$SECONDS
  # each step's output as it comes (its figures), and into OUT/NAME.log
  timeout "$limit" bash -c "$cmd" 2>&1 | tee "$OUT/$name.log" | grep --line-buffered -vE '^\.+ *\[|^\s*$'
  rc=${PIPESTATUS[0]}
  note "$(printf '%-14s rc=%-3s %4ss of %4ss' "$name" "$rc" "$((SECONDS - t0))" "$limit")"
  if [ "$name" = build ]; then
    "$PY" -c "import specdec_kernels._native as n; print('native cuda compact_kv_cache:', n.has_kernel('compact_kv_cache', 'cuda'))" 2>&1 | tee -a "$SUMMARY"
  fi
done
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cuda_tests.log" | tail -n 20 >>"$SUMMARY"
grep -v '^#' "$OUT/bench_kernels.log" | tail -n 120 >>"$SUMMARY"
grep -E '^(# ours|op |rejection|sampling|tree_att|# .*(rows|FAILED))' "$OUT/flashinfer.log" >>"$SUMMARY"
grep -v '^#' "$OUT/step_cost.log" | tail -n 40 >>"$SUMMARY"
note "== done in ${SECONDS}s"
