#!/usr/bin/env bash
# The lint checks, changing no file: ruff's linter and formatter over the Python code
# (settings in pyproject.toml) and clang-format over csrc/ (settings in .clang-format).  Each
# check runs even when an earlier one failed; the exit status is non-zero when any found
# something, 2 when a tool is missing.
#
# Tools: those of the virtual environment (SPECDEC_VENV, default .venv, where
# scripts/setup_env.sh installs the versions pinned in requirements/dev.txt), else those on
# PATH; a version other than the pinned one is named in a warning, since formatters differ
# between versions.  To apply the fixes instead:
#   ruff check --fix . && ruff format . && clang-format -i csrc/*.{h,cuh,cpp,cu}
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${SPECDEC_VENV:-.venv}"

# tool NAME: the path of NAME's executable, the environment's first
tool() {
  if [ -x "$VENV/bin/$1" ]; then
    echo "$VENV/bin/$1"
  elif command -v "$1" >/dev/null; then
    command -v "$1"
  else
    echo "lint: $1 is neither in $VENV/bin nor on PATH (pip install -r requirements/dev.txt)" >&2
    return 1
  fi
}

# check_version NAME PATH: warn when PATH's version is not the one pinned for NAME
check_version() {
  local pinned version
  pinned="$(sed -n "s/^$1==//p" requirements/dev.txt)"
  version="$("$2" --version)"
  case "$version" in
    *" $pinned"*) ;;
    *) echo "lint: warning: $2 is $version, requirements/dev.txt pins $1==$pinned" >&2 ;;
  esac
}

RUFF="$(tool ruff)" || exit 2
CLANG_FORMAT="$(tool clang-format)" || exit 2
check_version ruff "$RUFF"
check_version clang-format "$CLANG_FORMAT"
shopt -s nullglob
CSRC=(csrc/*.h csrc/*.cuh csrc/*.cpp csrc/*.cu)

rc=0
echo "== ruff check ."
"$RUFF" check . || rc=1
echo "== ruff format --check ."
"$RUFF" format --check . || rc=1
echo "== clang-format --dry-run -Werror csrc/ (${#CSRC[@]} files)"
"$CLANG_FORMAT" --dry-run -Werror "${CSRC[@]}" || rc=1
[ "$rc" = 0 ] && echo "== lint: clean"
exit "$rc"
