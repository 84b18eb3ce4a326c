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
bash scripts/setup_vllm_env.sh
echo "== pytest"
python -m pytest -q "$@"
