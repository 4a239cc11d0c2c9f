#!/usr/bin/env bash
# The command behind the numbers in docs/benchmarks.md: kvtier put/get throughput
# (64 KiB..8 MiB, batches of 32, 1 and 2 client processes) vs single-thread memcpy
# and Redis, and RPC latency vs an empty gRPC call, all measured in one run.
#
# Needs (not installed here, see docs/benchmarks.md):
#   redis-server on PATH   apt-get install -y redis-server
#   redis-py in the venv   .venv/bin/pip install 'redis>=5'   (the kvtier[bench] extra)
# Without them the Redis columns are skipped (pass --require-redis to fail instead).
#
# Starts its own kvtierd on temp sockets and /dev/shm/kvtier-bench-*, and Redis on
# a Unix socket; stops both and removes their files at the end.  Extra arguments
# are passed on, e.g. bench/run_core.sh --sizes 2MiB --seconds 3.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
exec "$venv/bin/kvtier" bench --json bench/results-core.json "$@"
