#!/usr/bin/env bash
# Download the pure-Python wheels that the GPU check needs and a bare GPU machine may lack
# (Python 3.12, x86-64, no internet there) into .whl/ (ignored by git); everything that travels
# to the GPU machine (the repository and .whl/) must fit in 64 MiB, so matplotlib and its
# dependencies stay home (the benchmarks skip their plots without it).
#
# FlashInfer for the side-by-side (specdec_kernels/bench/flashinfer_side.py): flashinfer-python 0.5.3 (7 MB,
# its CUDA sources JIT-compiled on the GPU machine) and the small packages it imports;
# 0.7.x is a 101 MB wheel and does not fit.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pytest==9.2.0 pluggy iniconfig packaging scipy==1.17.1 tqdm==4.70.1 \
  flashinfer-python==0.5.3 "apache-tvm-ffi>=0.1,<0.2" click einops nvidia-ml-py tabulate
ls .whl
du -sh .whl
