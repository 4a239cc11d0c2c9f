#!/usr/bin/env bash
# Install kvtier into a virtual environment.
# Used by the Makefile, CI (.ci/run) and the Docker build: one install path.
#   VENV=DIR       the virtual environment (default .venv), created if missing
#   PYTHON=EXE     the interpreter that creates it (default python3)
#   EXTRAS=LIST    optional dependencies, e.g. dev or dev,bench (default dev);
#                  EXTRAS= (empty) installs none
#   MODE=editable  (default) the venv runs this checkout: tests, development
#   MODE=wheel     a regular install: the venv is self-contained and the
#                  checkout can go (Docker image, /opt/kvtier on a host)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
python="${PYTHON:-python3}"
extras="${EXTRAS-dev}"
mode="${MODE:-editable}"
spec="."
if [ -n "$extras" ]; then
    spec=".[${extras}]"
fi
case "$mode" in
    editable | wheel) ;;
    *) echo "install.sh: MODE must be editable or wheel, not '$mode'" >&2; exit 2 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
# Both modes compile csrc/.  Editable: the tests and the CLIs run the checkout itself.
if [ "$mode" = wheel ]; then
    "$venv/bin/python" -m pip install --quiet "$spec"
else
    "$venv/bin/python" -m pip install --quiet --editable "$spec"
fi
"$venv/bin/python" -c "import kvtier._native, kvtierd.app; print('kvtier installed in $venv ($mode, native helpers built)')"
