#!/usr/bin/env bash
# Download the wheels the GPU check needs and the GPU machine lacks (Python 3.12, x86-64, no
# internet there) into .whl/ (ignored by git); everything that travels to the GPU machine (the
# repository and .whl/) must fit in 64 MiB.  The H200 machine's image already holds torch,
# triton, pytest (with xdist and timeout), scipy, tqdm, matplotlib, einops, click, tabulate and
# nvidia-ml-py (its package list), so only FlashInfer goes: flashinfer-python 0.5.3
# (7 MB, its CUDA sources JIT-compiled on the GPU machine; 0.7.x is a 101 MB wheel and does not
# fit) and apache-tvm-ffi.  Carrying another pytest would shadow the machine's plugins.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  flashinfer-python==0.5.3 "apache-tvm-ffi>=0.1,<0.2"
ls .whl
du -sh .whl
