#!/usr/bin/env bash
# The README's test command: set-up included, then the nvcc compile check (where nvcc exists)
# and the whole pytest suite.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -n "$NVCC" ]; then
  echo "== nvcc compile check of csrc/*.cu for sm_80 and sm_90 ($NVCC)"
  mkdir -p build
  cmake -S . -B build/cmake -G Ninja -DCMAKE_CUDA_COMPILER="$NVCC" >build/cmake.log 2>&1 || { cat build/cmake.log; exit 1; }
  cmake --build build/cmake
else
  echo "== nvcc not found: skipping the CUDA compile check"
fi
# vLLM's own environment for the plugin's tests (tests/test_vllm_plugin.py): they fail, never
# skip, without it.  SPECDEC_SKIP_VLLM=1 skips this set-up; then deselect them: -m "not vllm".
if [ "${SPECDEC_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/setup_vllm_env.sh
fi
echo "== pytest"
python -m pytest -q "$@"
