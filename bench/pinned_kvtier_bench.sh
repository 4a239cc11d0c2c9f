#!/bin/bash
# kvtier bench (64 KiB, 1 client, no Redis) against a kvtierd on CPU 1 of its own, the
# bench on CPU 0: the deployment docs/deployment.md recommends for server.busy_poll
# (docs/benchmarks.d/busy-poll.md).  Run from the repository root.
#
# Usage: bench/pinned_kvtier_bench.sh BUSY_POLL JSON     (BUSY_POLL: 0s, 2ms, ...)
set -euo pipefail
busy=$1
out=$2
venv=${VENV:-.venv}
dir=$(mktemp -d /tmp/kvt-pb-XXXXXX)
shm=/dev/shm/kvt-pb-$$
taskset -c 1 "$venv/bin/python" -m kvtierd --set "server.socket_dir=$dir/sock" \
    --set "dram.shm_dir=$shm" --set metrics.address= --set spill.ssd_dir= \
    --set dram.capacity=1GiB --set dram.extent_size=256MiB \
    --set "server.busy_poll=$busy" > "$dir/kvtierd.log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null; rm -rf "$dir" "$shm"' EXIT
for _ in $(seq 100); do
    [ -S "$dir/sock/kvtier.sock" ] && break
    sleep 0.1
done
taskset -c 0 "$venv/bin/kvtier" bench --socket "$dir/sock" --no-redis --sizes 64KiB \
    --clients 1 --json "$out"
