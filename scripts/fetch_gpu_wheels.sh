#!/usr/bin/env bash
# Download the pure-Python wheels that the GPU check needs and a bare GPU machine may lack
# (Python 3.12, x86-64, no internet there) into .whl/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pytest==9.2.0 pluggy iniconfig packaging scipy==1.17.1 tqdm==4.70.1 matplotlib==3.11.2 contourpy cycler \
  fonttools kiwisolver pillow pyparsing python-dateutil six
ls .whl
