"""Index scale benchmark: the daemon's memory per block, big lookups,
and warm restarts, with millions of small blocks.

For each block count N: start a fresh kvtierd with a pool just big enough for N
blocks of --block bytes (4 KiB by default), fill it in batches of 4096 keys, and
measure

* the daemon's anonymous memory (RssAnon, /proc) before and after the fill, per
  committed block: the index, the LRU and the per-block Python objects; and the
  bytes of the namespace's shared index table per block (a memfd, counted apart:
  it is shared memory, not anonymous);
* a lookup of 4096 present keys, p50 of --rounds, from a client answering from
  the shared index (fast path) and from a client calling Lookup over gRPC, with
  the empty gRPC call (Health/Check) as the floor;
* the daemon's CPU (user + system, /proc) per committed block, filling in batches
  of 4096 keys and then committing SMALL_BLOCKS more in batches of 32;
* a warm restart after SIGKILL: process start to READY=1 (a real NOTIFY_SOCKET),
  every block re-adopted; and, as a user sees it, process start until a client has
  found every block again (lookups of 4096 keys), against an empty daemon's start to
  its first answer, measured in the same run (``found_after_empty_s``: how much later
  than an empty daemon a warm one serves all of its cache).

The table ends with what a host of 16M blocks would need, extrapolated linearly from
the largest two runs.

    .venv/bin/python bench/index_scale.py --blocks 1M,4M --json bench/results/x.json

Needs free /dev/shm and RAM for N * block bytes plus the daemon's index.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from warm_restart import clean_up, notify_socket, start  # (bench/, the script dir, is on sys.path)

import kvtier
from kvtier._admin import fetch_stats
from kvtier.bench.common import write_json
from kvtier.units import parse_size

BATCH = 4096  # keys per reserve/commit and per lookup (the default max_keys_per_call)


def rss_anon_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("no RssAnon")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: Blocks committed in batches of 32 after the fill (the small-batch CPU figure).
SMALL_BLOCKS = 32768


def keys_of(start: int, n: int) -> list[bytes]:
    return [b"%016d" % i for i in range(start, start + n)]  # 16 bytes, as block_keys makes


def client(sock_dir: str, block: int, fast: bool) -> kvtier.Client:
    return kvtier.Client(sock_dir, namespace="bench/index", block_bytes=block, model_uid="b",
                         fast_path=fast, timeout=60)


def p50_us(fn: object, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def fill(c: kvtier.Client, start: int, n: int, batch: int, data: np.ndarray) -> None:
    for at in range(start, start + n, batch):
        keys = keys_of(at, min(batch, start + n - at))
        with c.reserve(keys) as r:
            for i in r.reserved:
                buf = r.buffers[i]
                assert buf is not None
                buf[: len(data)] = data
            r.commit()


def found_all(sock_dir: str, block: int, batches: list[list[bytes]]) -> float:
    """The time (``perf_counter``) a new client has found every key of ``batches``
    (retrying while the daemon is not serving yet); the client closes after it.  The
    keys are made before the clock starts: a client coming back after a restart has
    its keys already (hashed from its tokens), and making them is the same work against
    an empty daemon."""
    while True:
        try:
            with client(sock_dir, block, True) as c:
                for keys in batches:
                    while c.lookup(keys) != len(keys):
                        time.sleep(0.001)
                return time.perf_counter()
        except kvtier.errors.KVTierError:
            time.sleep(0.01)


def run_one(n: int, block: int, rounds: int, restarts: int = 1) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="kvt-index-", dir="/tmp")
    shm_dir = f"/dev/shm/kvtier-bench-index-{uuid.uuid4().hex[:8]}"
    notify, notify_path = notify_socket(tmp)
    sock_dir = os.path.join(tmp, "sock")
    slot = -(-block // 4096) * 4096
    # The pool: N + SMALL_BLOCKS slots plus the slot tables (<= 256 B per slot) and a
    # spare extent.
    total = n + SMALL_BLOCKS
    capacity = -(-(total * (slot + 256) + (256 << 20)) // (1 << 20)) << 20
    procs: list[subprocess.Popen[bytes]] = []
    row: dict[str, Any] = {"blocks": n, "block_bytes": block, "pool_bytes": capacity}
    try:
        proc, _ = start(sock_dir, shm_dir, capacity, notify, notify_path)
        procs.append(proc)
        data = np.frombuffer(bytes(range(256)) * (block // 256) or b"x" * block, np.uint8)
        with client(sock_dir, block, True) as c:
            c.lookup([b"warmup"])  # the namespace exists: its fixed costs are in the baseline
            before = rss_anon_kib(proc.pid)
            cpu0 = cpu_seconds(proc.pid)
            t0 = time.perf_counter()
            fill(c, 0, n, BATCH, data)
            row["fill_s"] = time.perf_counter() - t0
            row["cpu_us_per_block_4096"] = (cpu_seconds(proc.pid) - cpu0) / n * 1e6
            time.sleep(1.0)
            after = rss_anon_kib(proc.pid)
            st = fetch_stats(sock_dir)
            (ns,) = [x for x in st.namespaces if x.name == "bench/index"]
            committed = ns.committed_blocks
            assert committed == n, (committed, n)
            row["anon_bytes_per_block"] = (after - before) * 1024 / committed
            cpu0 = cpu_seconds(proc.pid)
            fill(c, n, SMALL_BLOCKS, 32, data)
            row["cpu_us_per_block_32"] = (cpu_seconds(proc.pid) - cpu0) / SMALL_BLOCKS * 1e6
            n = total
            probe = keys_of(n - BATCH, BATCH) if n >= BATCH else keys_of(0, n)
            assert c.lookup(probe) == len(probe)  # (and maps the table's latest version)
            index = c._maps.index
            assert index is not None
            row["table_bytes_per_block"] = len(index._table) / committed
            row["lookup_4096_fast_us"] = p50_us(lambda: c.lookup(probe), rounds)
        with client(sock_dir, block, False) as g:
            assert g.lookup(probe) == len(probe)
            row["lookup_4096_grpc_us"] = p50_us(lambda: g.lookup(probe), rounds)
        with grpc.insecure_channel(f"unix:{os.path.join(sock_dir, 'kvtier.sock')}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            req = health_pb2.HealthCheckRequest()
            health.Check(req)
            row["empty_grpc_call_us"] = p50_us(lambda: health.Check(req), rounds)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        batches = [keys_of(at, min(BATCH, n - at)) for at in range(0, n, BATCH)]
        pairs: list[dict[str, float]] = []
        for r in range(restarts):
            if r:  # the last warm daemon, killed as the first was
                proc.send_signal(signal.SIGKILL)
                proc.wait(60)
            pair: dict[str, float] = {}
            # An empty daemon (its own pool directory) as the baseline: start to first answer.
            empty_shm = shm_dir + "-empty"
            t0 = time.perf_counter()
            empty, pair["empty_start_to_ready_s"] = start(sock_dir, empty_shm, capacity, notify,
                                                          notify_path)
            try:
                # a session opened: it serves
                pair["empty_start_to_serving_s"] = found_all(sock_dir, block, []) - t0
            finally:
                empty.terminate()
                empty.wait(60)
                shutil.rmtree(empty_shm, ignore_errors=True)
            t0 = time.perf_counter()
            proc, pair["warm_start_to_ready_s"] = start(sock_dir, shm_dir, capacity, notify,
                                                        notify_path)
            procs.append(proc)
            pair["warm_start_to_all_found_s"] = found_all(sock_dir, block, batches) - t0
            pair["found_after_empty_s"] = (pair["warm_start_to_all_found_s"]
                                           - pair["empty_start_to_serving_s"])
            st = fetch_stats(sock_dir)
            assert st.recovered_blocks == n, (st.recovered_blocks, n)
            pair["warm_recovery_s"] = st.recovery_seconds
            pairs.append(pair)
            print(f"  restart {r + 1}: {json.dumps(pair)}", file=sys.stderr, flush=True)
        # The medians of the restarts (each one pair: an empty daemon, then the warm one).
        for name in pairs[0]:
            row[name] = statistics.median(p[name] for p in pairs)
        if restarts > 1:
            row["restarts"] = restarts
            row["found_after_empty_s_each"] = [p["found_after_empty_s"] for p in pairs]
        # All of the restarted daemon's anonymous memory (its baseline included), per block.
        row["anon_bytes_per_block_after_restart"] = rss_anon_kib(proc.pid) * 1024 / n
        return row
    finally:
        clean_up(procs, notify, tmp, shm_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", default="1M", help="block counts, comma-separated (256K = 2**18, 1M = 2**20)")
    p.add_argument("--block", default="4KiB", help="bytes per block")
    p.add_argument("--rounds", type=int, default=200, help="lookups per p50")
    p.add_argument("--restarts", type=int, default=1,
                   help="warm restarts after the fill, each against an empty daemon started "
                        "just before it; the figures are their medians (one run on a small VM "
                        "spreads by +-0.1 s)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    block = parse_size(args.block)
    rows = []
    for count in args.blocks.split(","):
        shift = {"K": 10, "M": 20}.get(count[-1:], 0)
        n = int(count[:-1] if shift else count) << shift
        print(f"{n} blocks of {block} bytes: filling ...", file=sys.stderr, flush=True)
        rows.append(run_one(n, block, args.rounds, args.restarts))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{'blocks':>9} {'anon B/blk':>10} {'table B/blk':>11} {'cpu us/blk 4096':>15} "
          f"{'cpu us/blk 32':>13} {'lookup4096 fast us':>18} {'grpc us':>9} "
          f"{'empty call us':>13} {'warm READY s':>12} {'all found s':>11} "
          f"{'after empty s':>13}")
    for r in rows:
        print(f"{r['blocks']:>9.0f} {r['anon_bytes_per_block']:>10.0f} "
              f"{r['table_bytes_per_block']:>11.1f} {r['cpu_us_per_block_4096']:>15.1f} "
              f"{r['cpu_us_per_block_32']:>13.1f} {r['lookup_4096_fast_us']:>18.0f} "
              f"{r['lookup_4096_grpc_us']:>9.0f} {r['empty_grpc_call_us']:>13.0f} "
              f"{r['warm_start_to_ready_s']:>12.3f} {r['warm_start_to_all_found_s']:>11.3f} "
              f"{r['found_after_empty_s']:>13.3f}")
    if len(rows) >= 2:  # a 16M-block host, extrapolated from the largest two runs
        a, b = sorted(rows, key=lambda r: r["blocks"])[-2:]
        big = 16 << 20

        def at(name: str) -> float:
            slope = (b[name] - a[name]) / (b["blocks"] - a["blocks"])
            return float(b[name] + slope * (big - b["blocks"]))

        extra = {"blocks": big, "anon_bytes": b["anon_bytes_per_block"] * big,
                 "warm_start_to_all_found_s": at("warm_start_to_all_found_s"),
                 "found_after_empty_s": at("found_after_empty_s")}
        print(f"16M blocks (extrapolated): daemon heap {extra['anon_bytes'] / 2**30:.1f} GiB, "
              f"all found {extra['warm_start_to_all_found_s']:.1f} s after start "
              f"({extra['found_after_empty_s']:.1f} s after an empty daemon serves)")
        rows.append({"extrapolated": 1.0, **extra})
    write_json(args.json, {"command": " ".join(["bench/index_scale.py", *sys.argv[1:]]),
                           "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
