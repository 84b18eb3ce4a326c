#!/usr/bin/env bash
# The llama.cpp environment for bench.e2e's llamacpp-* methods and bench.step_cost's llama.cpp
# curve: llama-cpp-python (requirements/llamacpp.txt) built from source in a virtual
# environment of its own.  Run from the repository root: bash scripts/setup_llamacpp_env.sh
# The build compiles llama.cpp with cmake for this machine's CPU (GGML_NATIVE=ON): about 15
# minutes on 2 cores; run it in the background with a log.  Re-running it is cheap: it skips
# the build when the pinned version is already installed.
# Honours SPECDEC_LLAMACPP_VENV (default .venv-llamacpp), PYTHON, CMAKE_ARGS (default
# -DGGML_NATIVE=ON) and CMAKE_BUILD_PARALLEL_LEVEL (default 2).  Exits non-zero when
# llama-cpp-python cannot be built or imported; the benchmarks then report its methods as skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_lib.sh
VENV="${SPECDEC_LLAMACPP_VENV:-.venv-llamacpp}"
PIN="$(sed -n 's/^llama-cpp-python==//p' requirements/llamacpp.txt)"
PY="$(venv_python "$VENV")"
if ! has_version "$PY" llama-cpp-python "$PIN"; then
  echo "== building llama-cpp-python $PIN from source into $VENV (cmake; about 15 minutes on 2 cores)"
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    quiet "$PY" -m pip install -q --disable-pip-version-check --no-binary llama-cpp-python \
    -r requirements/llamacpp.txt
fi
(cd / && "$PY" -I - <<'PY'
import importlib.metadata as m
import llama_cpp  # fails here, not in the benchmarks, when the build cannot load
print("== llama-cpp-python", m.version("llama-cpp-python"), "| llama.cpp system info:",
      llama_cpp.llama_print_system_info().decode(errors="replace").strip())
PY
)
