#!/usr/bin/env bash
# The README's test command: set-up included, then the nvcc compile check (where nvcc exists)
# and the whole pytest suite.  Extra arguments go to one plain pytest run instead.
#
# Without arguments the suite runs in two parts: the tests not marked `serial` or `vllm` on
# one pytest-xdist worker per core (SPECDEC_TEST_WORKERS overrides), then the `serial` and
# `vllm` tests alone (they run processes and threads of their own: vLLM, the bench CLIs,
# compilers; beside other workers they oversubscribe the cores and take several times
# longer).  vLLM's environment is set up in the background meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
# vLLM's own environment for the plugin's tests (tests/integrations/test_vllm_plugin.py): they fail, never
# skip, without it.  SPECDEC_SKIP_VLLM=1 skips this set-up and those tests.
SKIP_VLLM="${SPECDEC_SKIP_VLLM:-0}"
# Disk first: the two environments take about 2.2 GB (.venv) and 3.5 GB (.venv-vllm), and pip
# unpacks wheels beside them.  Short of space, say so now rather than fail minutes later.
NEED_MB=0
[ -x "${SPECDEC_VENV:-.venv}/bin/python" ] || NEED_MB=$((NEED_MB + 3000))
[ "$SKIP_VLLM" = "1" ] || [ -x "${SPECDEC_VLLM_VENV:-.venv-vllm}/bin/vllm" ] || NEED_MB=$((NEED_MB + 4500))
FREE_MB=$(df -Pm . | awk 'NR == 2 {print $4}')
if [ -n "$FREE_MB" ] && [ "$FREE_MB" -lt "$NEED_MB" ]; then
  echo "== only $FREE_MB MB free in $(pwd); the set-up needs about $NEED_MB MB (.venv about 3 GB," \
    "vLLM's .venv-vllm about 4.5 GB; SPECDEC_SKIP_VLLM=1 skips the latter): free some space first" >&2
  exit 1
fi
VLLM_PID=""
if [ "$SKIP_VLLM" != "1" ]; then
  echo "== setting up vLLM's environment in the background (log: build/setup_vllm_env.log)"
  # in a session of its own (setsid keeps the pid: a background job is not a group leader),
  # so that an early exit stops the whole set-up, pip's children included
  if command -v setsid >/dev/null; then
    setsid bash scripts/setup_vllm_env.sh >build/setup_vllm_env.log 2>&1 &
  else
    bash scripts/setup_vllm_env.sh >build/setup_vllm_env.log 2>&1 &
  fi
  VLLM_PID=$!
fi
wait_vllm() {
  [ -z "$VLLM_PID" ] && return 0
  local rc=0
  wait "$VLLM_PID" || rc=$?
  VLLM_PID=""
  cat build/setup_vllm_env.log
  if [ "$rc" != 0 ]; then
    echo "== vLLM's environment could not be set up (rc $rc): its tests would fail" >&2
    return "$rc"
  fi
}
stop_vllm() {
  [ -z "$VLLM_PID" ] && return 0
  kill -- "-$VLLM_PID" 2>/dev/null || kill "$VLLM_PID" 2>/dev/null || true
}
trap stop_vllm EXIT
source scripts/setup_env.sh
echo "== set-up took $((SECONDS / 60)) min $((SECONDS % 60)) s"
echo "== lint (ruff, clang-format)"
bash scripts/lint.sh
NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -n "$NVCC" ]; then
  echo "== nvcc compile check of csrc/*.cu for sm_80 and sm_90 ($NVCC)"
  cmake -S . -B build/cmake -G Ninja -DCMAKE_CUDA_COMPILER="$NVCC" >build/cmake.log 2>&1 || { cat build/cmake.log; exit 1; }
  cmake --build build/cmake
else
  echo "== nvcc not found: skipping the CUDA compile check"
fi
if [ "$#" -gt 0 ]; then
  wait_vllm
  echo "== pytest $*"
  exec python -m pytest -q "$@"
fi
WORKERS="${SPECDEC_TEST_WORKERS:-$(nproc)}"
echo "== pytest, part 1 of 2: the tests not marked serial or vllm, $WORKERS workers"
rc1=0
python -m pytest -q -n "$WORKERS" --dist worksteal -m "not serial and not vllm" --durations=25 || rc1=$?
echo "== part 1 took $((SECONDS / 60)) min $((SECONDS % 60)) s since the start of this script"
wait_vllm
echo "== pytest, part 2 of 2: the serial and vllm tests, alone"
PART2="serial or vllm"
[ "$SKIP_VLLM" = "1" ] && PART2="serial and not vllm"
rc2=0
python -m pytest -q -m "$PART2" --durations=25 || rc2=$?
echo "== pytest: part 1 rc $rc1, part 2 rc $rc2; $((SECONDS / 60)) min $((SECONDS % 60)) s in all"
[ "$rc1" = 0 ] && [ "$rc2" = 0 ]
