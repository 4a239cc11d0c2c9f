#!/usr/bin/env bash
# Install kvtier and its dev tools into a virtual environment (default .venv).
# Used by the Makefile, CI (.ci/run) and the Docker build: one install path.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
python="${PYTHON:-python3}"
extras="${EXTRAS:-dev}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
# Editable so the tests and the CLIs run the checkout itself; the build compiles csrc/.
"$venv/bin/python" -m pip install --quiet --editable ".[${extras}]"
"$venv/bin/python" -c "import kvtier._native, kvtierd.app; print('kvtier installed in $venv (native helpers built)')"
