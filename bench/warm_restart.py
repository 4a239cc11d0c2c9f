"""Warm-restart benchmark: process start -> READY=1 with a full pool, vs. pre-faulting it cold.

For each pool size and block size: start a fresh kvtierd, fill the pool with
blocks (which makes the daemon create and pre-fault every extent: the cold
cost, read from Stats.prefault_seconds), stop it (SIGTERM or SIGKILL), start
it again on the same shm directory and time from process start to the
systemd READY=1 datagram (a real NOTIFY_SOCKET).  The warm start must
re-adopt every block.

    .venv/bin/python bench/warm_restart.py --pools 1GiB,4GiB,16GiB --blocks 2MiB,64KiB

Needs free /dev/shm and RAM for the largest pool plus ~10%.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

import kvtier
from kvtier._admin import fetch_stats
from kvtier.bench.common import write_json
from kvtier.bench.private_daemon import daemon_args, daemon_env
from kvtierd.config import parse_size

BATCH_BYTES = 256 << 20  # bytes per put batch while filling


def notify_socket(tmp: str) -> tuple[socket.socket, str]:
    """A datagram socket bound in ``tmp`` for kvtierd's NOTIFY_SOCKET, and its path."""
    path = os.path.join(tmp, "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(path)
    return notify, path


def start(sock_dir: str, shm_dir: str, capacity: int, notify: socket.socket,
          notify_path: str) -> tuple[subprocess.Popen[bytes], float]:
    """Start kvtierd; return it and the seconds from spawn to READY=1."""
    # Not start_private_daemon: the time to READY=1 is the figure, read off NOTIFY_SOCKET.
    env = daemon_env({"NOTIFY_SOCKET": notify_path})
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        daemon_args(sock_dir, shm_dir, [f"dram.capacity={capacity}", "dram.extent_size=256MiB",
                                        "log.level=warning"]),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    notify.settimeout(600)
    while True:
        msg = notify.recv(4096).decode()
        if "READY=1" in msg.split("\n"):
            return proc, time.perf_counter() - t0


def fill(sock_dir: str, block: int, capacity: int) -> int:
    """Put blocks until the pool is full (no eviction yet); returns blocks stored."""
    slot = -(-block // 4096) * 4096
    per_batch = max(1, BATCH_BYTES // slot)
    target = int(capacity * 0.97) // (slot + 128)
    data = np.random.default_rng(0).integers(0, 256, block, dtype=np.uint8)
    stored = 0
    with kvtier.Client(sock_dir, namespace="bench/warm", block_bytes=block, model_uid="b") as c:
        while stored < target:
            n = min(per_batch, target - stored)
            keys = [f"{stored + i:012d}".encode() for i in range(n)]
            with c.reserve(keys) as r:
                for i in r.reserved:
                    buf = r.buffers[i]
                    assert buf is not None
                    buf[:] = data
                r.commit()
            stored += n
            if fetch_stats(sock_dir).evictions:
                break
    return stored


def run_one(pool: int, block: int, kill: bool) -> dict[str, float]:
    tmp = tempfile.mkdtemp(prefix="kvt-warm-", dir="/tmp")
    shm_dir = f"/dev/shm/kvtier-bench-warm-{uuid.uuid4().hex[:8]}"
    notify, notify_path = notify_socket(tmp)
    sock_dir = os.path.join(tmp, "sock")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        proc, cold_ready = start(sock_dir, shm_dir, pool, notify, notify_path)
        procs.append(proc)
        t0 = time.perf_counter()
        blocks = fill(sock_dir, block, pool)
        fill_s = time.perf_counter() - t0
        cold = fetch_stats(sock_dir)
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        proc.wait(60)
        proc, warm_ready = start(sock_dir, shm_dir, pool, notify, notify_path)
        procs.append(proc)
        warm = fetch_stats(sock_dir)
        assert warm.recovered_blocks == blocks, (warm.recovered_blocks, blocks)
        return {
            "pool_bytes": pool, "block_bytes": block, "blocks": blocks,
            "cold_start_to_ready_s": cold_ready, "cold_prefault_s": cold.prefault_seconds,
            "fill_s": fill_s, "warm_start_to_ready_s": warm_ready,
            "warm_recovery_s": warm.recovery_seconds,
            "cold_over_warm": cold.prefault_seconds / warm_ready,
        }
    finally:
        clean_up(procs, notify, tmp, shm_dir)


def clean_up(procs: list[subprocess.Popen[bytes]], notify: socket.socket, tmp: str,
             shm_dir: str) -> None:
    """Stop the daemons still running and remove what a run made."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    notify.close()
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(shm_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pools", default="1GiB,4GiB,16GiB")
    p.add_argument("--blocks", default="2MiB,64KiB")
    p.add_argument("--kill", action="store_true", help="SIGKILL instead of SIGTERM before restart")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    rows = []
    for pool_s in args.pools.split(","):
        for block_s in args.blocks.split(","):
            pool, block = parse_size(pool_s, "--pools"), parse_size(block_s, "--blocks")
            print(f"pool {pool_s}, blocks {block_s}: filling ...", file=sys.stderr, flush=True)
            row = run_one(pool, block, args.kill)
            rows.append(row)
            print(f"  {row['blocks']} blocks; cold pre-fault {row['cold_prefault_s']:.2f} s; "
                  f"warm start->READY {row['warm_start_to_ready_s']:.3f} s "
                  f"(recovery {row['warm_recovery_s']:.3f} s); "
                  f"{row['cold_over_warm']:.1f}x", file=sys.stderr, flush=True)
    print(f"{'pool':>8} {'block':>8} {'blocks':>8} {'cold prefault s':>16} "
          f"{'warm ready s':>13} {'recovery s':>11} {'cold/warm':>10}")
    for r in rows:
        print(f"{r['pool_bytes'] / 2**30:>6.0f}Gi {r['block_bytes'] / 1024:>6.0f}Ki "
              f"{r['blocks']:>8} {r['cold_prefault_s']:>16.2f} {r['warm_start_to_ready_s']:>13.3f} "
              f"{r['warm_recovery_s']:>11.3f} {r['cold_over_warm']:>9.1f}x")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
