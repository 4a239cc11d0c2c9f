#!/usr/bin/env bash
# Install kvtier into a virtual environment.
# Used by the Makefile, CI (.ci/run) and the Docker build: one install path.
#   VENV=DIR       the virtual environment (default .venv), created if missing
#   PYTHON=EXE     the interpreter that creates it (default python3)
#   EXTRAS=LIST    optional dependencies, e.g. dev or dev,bench (default dev,demo:
#                  the tests and `kvtier demo` need jax); EXTRAS= (empty) installs none
#   TORCH=VERSION  also install torch==VERSION (the torch adapter's tests); the
#                  Makefile passes 2.13.0, a CPU build; empty (default) skips it
#   MODE=editable  (default) the venv runs this checkout: tests, development
#   MODE=wheel     a regular install: the venv is self-contained and the
#                  checkout can go (Docker image, /opt/kvtier on a host)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
python="${PYTHON:-python3}"
extras="${EXTRAS-dev,demo}"
torch="${TORCH:-}"
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
if [ -n "$torch" ]; then
    "$venv/bin/python" -m pip install --quiet "torch==$torch"
fi
"$venv/bin/python" -c "import kvtier._native, kvtierd.app; print('kvtier installed in $venv ($mode, native helpers built)')"
