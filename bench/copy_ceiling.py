"""The copy a put cannot avoid: 32 blocks into slots it has not touched lately.

``kvtier bench`` compares put and get with a single-thread memcpy of the same 32
blocks between two cache-resident buffers.  A put writes into the slots the
daemon hands out, which move through the pool: at 64 KiB x 32 (2 MiB per
batch) the destination is rarely in cache.  This measures, in one run and
alternating, the cache-resident memcpy the bench uses and the same copy into
successive 2 MiB windows of a pre-faulted shared-memory file (what a put's copy
phase does, with no control plane at all), so the ratio is the ceiling of put
vs memcpy at that size on this machine.

    .venv/bin/python bench/copy_ceiling.py --json bench/results/copy-ceiling-2026-12-03.json
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from kvtier import _accel
from kvtier.bench.common import write_json
from kvtier.units import format_bytes, parse_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64K,512K,2M", help="block sizes (32 blocks a batch)")
    p.add_argument("--pool", default="512M", help="shared-memory pool the windows move through")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    pool = parse_size(args.pool)
    fd, path = tempfile.mkstemp(prefix="kvt-copy-ceiling-", dir="/dev/shm")
    try:
        os.ftruncate(fd, pool)
        mm = mmap.mmap(fd, pool)
        shm = np.frombuffer(mm, np.uint8)
        shm[::4096] = 1  # pre-fault, as the daemon does
        rows = []
        for size in (parse_size(s) for s in args.sizes.split(",")):
            batch = 32 * size
            src = [np.random.default_rng(i).integers(0, 256, size, np.uint8) for i in range(32)]
            hot = [np.empty(size, np.uint8) for _ in range(32)]
            windows = pool // batch
            cached, streaming = [], []
            w = 0
            for r in range(args.rounds * 2):
                t0 = time.perf_counter()
                if r % 2 == 0:
                    for d, s in zip(hot, src, strict=True):
                        _accel.copy_into(d, s)
                    cached.append(time.perf_counter() - t0)
                else:
                    base = w * batch
                    w = (w + 1) % windows
                    for i, s in enumerate(src):
                        _accel.copy_into(shm[base + i * size: base + (i + 1) * size], s)
                    streaming.append(time.perf_counter() - t0)
            c, s = statistics.median(cached), statistics.median(streaming)
            rows.append({"block_bytes": size, "batch": 32, "memcpy_cached_gbps": batch / c / 1e9,
                         "copy_into_moving_slots_gbps": batch / s / 1e9, "ceiling_x_memcpy": c / s})
            print(f"{format_bytes(size):>8} x32: memcpy (cache-resident) {batch / c / 1e9:6.2f} GB/s, "
                  f"into moving shm slots {batch / s / 1e9:6.2f} GB/s: ceiling {c / s:.2f}x memcpy")
        del shm
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    write_json(args.json, {"rounds": args.rounds, "pool_bytes": pool, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
