#!/usr/bin/env bash
# Build the C++/CUDA extension as the GPU machine builds it, on a machine with nvcc and no GPU:
# a CUDA build of torch (PyPI's default wheel for Linux x86-64, CUDA libraries included, about
# 3 GB) in its own virtual environment, then `setup.py build_ext` on a copy of the committed
# tree with SPECDEC_REQUIRE_NATIVE=1, then a check that the CUDA kernels are registered.
# Before spending device time (scripts/gpu_check.sh), this catches what a CPU build cannot see:
# the CUDA sources, the CUDA bindings and the link against torch's CUDA libraries.
#
#   bash scripts/cuda_build_check.sh            # torch 2.11.0 (the GPU machine's), sm_80 and sm_90
#   TORCH_VERSION=2.10.0 bash scripts/cuda_build_check.sh
#
# The environment is kept in build/venv-cuda (reused by later runs); the copy in build/cuda-check.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.11.0}"
PY="${PYTHON:-python3}"
VENV=build/venv-cuda
NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -z "$NVCC" ]; then
  echo "cuda_build_check: nvcc not found (install the CUDA toolkit or set CUDA_HOME)" >&2
  exit 2
fi
mkdir -p build
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION' or torch.version.cuda is None)" 2>/dev/null; then
  echo "== a CUDA build of torch $TORCH_VERSION in $VENV"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" setuptools ninja numpy
fi
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
rm -rf build/cuda-check
mkdir -p build/cuda-check
git archive HEAD | tar -x -C build/cuda-check
cd build/cuda-check
echo "== setup.py build_ext (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0}, nvcc $NVCC)"
SPECDEC_REQUIRE_NATIVE=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
  "../venv-cuda/bin/python" setup.py build_ext --inplace >../cuda-check.log 2>&1 || {
  tail -n 40 ../cuda-check.log
  echo "cuda_build_check: the extension did not build (log: build/cuda-check.log)" >&2
  exit 1
}
"../venv-cuda/bin/python" - <<'PY'
import sys

from specdec_kernels import _native

want = {"compact_kv_cache": "cuda", "paged_compact_kv_cache": "cuda", "verify_greedy": "cpu"}
missing = [f"{op} ({dev})" for op, dev in want.items() if not _native.has_kernel(op, dev)]
print("cuda_build_check:", "missing kernels: " + ", ".join(missing) if missing else "the extension builds, with its CUDA kernels")
sys.exit(1 if missing else 0)
PY
