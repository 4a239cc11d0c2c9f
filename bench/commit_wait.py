"""Where a put's commit runs: in parallel with the writer's next copy, or instead of it.

One kvtierd (512 MiB pool, filled first: every claim evicts), one client putting 32
blocks per batch through the session page, alternating ``Client.put`` in a loop (each
put waits for its commit before the next copy) and ``Client.put_many`` (the next
batch is copied while the commit before is in flight), ``--seconds`` each, twice.
``LocalWrites.publish`` and ``LocalWrites.wait`` are timed: the gap from a commit's
publish to its wait (the writer's own work meanwhile), and how long the wait then
blocks (the commit still running).  ``--pin`` puts the daemon's loop thread on CPU 1
and the client on CPU 0, so the daemon's wake-up cannot take the writer's CPU.

Usage: ``.venv/bin/python bench/commit_wait.py [--block 64KiB] [--pin] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

import kvtier
from kvtier import _index
from kvtier.bench.common import write_json
from kvtier.bench.private_daemon import private_daemon as kvtierd
from kvtier.units import parse_size

BATCH = 32


def _p50(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def _until(t_end: float, keys: Any, src: list[np.ndarray]) -> Any:
    """(keys, blocks) items until ``t_end``."""
    while time.perf_counter() < t_end:
        yield keys(), src


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", default="64KiB")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    block = parse_size(args.block)
    src = [np.random.default_rng(i).integers(0, 256, block, dtype=np.uint8)
           for i in range(BATCH)]
    n = [0]

    def keys() -> list[bytes]:
        n[0] += 1
        return [b"k%08d-%02d" % (n[0], i) for i in range(BATCH)]

    gaps: list[float] = []
    waits: list[float] = []
    published = [0.0]
    real_publish, real_wait = _index.LocalWrites.publish, _index.LocalWrites.wait

    def publish(self: _index.LocalWrites, records: Any) -> tuple[int, int]:
        published[0] = time.perf_counter()
        return real_publish(self, records)

    def wait(self: _index.LocalWrites, ticket: tuple[int, int], alive: Any,
             timeout: float) -> bytes:
        a = time.perf_counter()
        gaps.append(a - published[0])
        try:
            return real_wait(self, ticket, alive, timeout)
        finally:
            waits.append(time.perf_counter() - a)

    _index.LocalWrites.publish = publish  # type: ignore[method-assign]
    _index.LocalWrites.wait = wait  # type: ignore[method-assign]
    rows: list[dict[str, Any]] = []
    with kvtierd("cw", "dram.capacity=512MiB", "dram.extent_size=64MiB",
                 "server.write_grant_bytes=64MiB") as d, \
            kvtier.Client(d.socket_dir, namespace="cw", block_bytes=block, model_uid="m") as c:
        if args.pin:
            os.sched_setaffinity(d.pid, {1})  # the daemon's loop thread
            os.sched_setaffinity(0, {0})
        for _ in range(512 * 2**20 // (block * BATCH) + 4):
            c.put(keys(), src)
        c.put_batch_bytes = 1 << 50  # one batch per put: the overlap is between puts
        for mode in ("put", "put_many") * 2:
            gaps.clear()
            waits.clear()
            t0 = time.perf_counter()
            t_end = t0 + args.seconds
            if mode == "put":
                w = 0
                while time.perf_counter() < t_end:
                    c.put(keys(), src)
                    w += 1
            else:
                w = c.put_many(_until(t_end, keys, src)) // BATCH
            el = time.perf_counter() - t0
            row = {"mode": mode, "GBps": w * BATCH * block / el / 1e9,
                   "ms_per_batch": el / w * 1e3, "publish_to_wait_ms": _p50(gaps) * 1e3,
                   "wait_ms": _p50(waits) * 1e3}
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_json(args.json, {"command": sys.argv, "block": block, "pin": args.pin, "rows": rows},
               indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
