#!/usr/bin/env bash
# Helpers shared by the setup_*_env.sh scripts; source it from the repository root.
#   venv_python DIR: creates the virtual environment DIR with $PYTHON (default python3) when
#     it has no python yet, and prints the absolute path of its python.
#   quiet CMD...: runs CMD with pip's "WARNING: Location ..." lines dropped from its stderr.
#   has_version PY DIST VERSION: whether PY's environment has distribution DIST at VERSION.

venv_python() {
  if [ ! -x "$1/bin/python" ]; then
    echo "== creating $1" >&2
    "${PYTHON:-python3}" -m venv "$1"
  fi
  echo "$(cd "$1" && pwd)/bin/python"
}

quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }

has_version() {
  "$1" -c "import importlib.metadata as m, sys; sys.exit(m.version('$2') != '$3')" 2>/dev/null
}
