"""Puts and gets of batches of 32 blocks through kvtier against Mooncake Store's own
``batch_put_from`` / ``batch_get_into`` on the same host, in the same run.

* **kvtier**: a private kvtierd (its DRAM tier only), a namespace of that block size;
  ``Client.put`` of 32 new keys from 32 pre-faulted arrays (the fast path: slots
  granted ahead or a Reserve call, the copies into shared memory, the commit), then
  ``Client.get`` of them into 32 pre-faulted arrays (a lease, the copies out, the
  release).
* **Mooncake**: a real ``mooncake_master`` on loopback and a ``MooncakeDistributedStore``
  in this process lending its own segment (``global_segment_size``) over TCP:
  ``batch_put_from`` of 32 new keys from a registered, pre-faulted buffer, then
  ``batch_get_into`` of them into another. Both stay in this host's memory (its own
  segment), as kvtier's do.

A slice of 8 batches is put and got, then its keys are removed, outside the timed
region, in both systems (neither evicts). Mooncake's master runs with a lease of
200 ms on what a get read (10 s by default), so they can be. Rounds alternate between the two systems, a size at a time;
the figure is the median GB/s of each over the rounds and their ratio.

Usage::

    .venv/bin/python bench/put_vs_mooncake.py [--sizes 64K,512K,2M,8M] [--rounds 9]
                                              [--json FILE]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import kvtier  # noqa: E402
from kvtier.bench.common import write_json  # noqa: E402
from kvtier.bench.private_daemon import private_daemon  # noqa: E402
from kvtier.units import format_bytes, parse_size  # noqa: E402
from tests.fleet import Fleet  # noqa: E402

BATCH = 32
#: Batches per timed slice (a round of one system at one size).
SLICE = 8
#: The master's lease on what a get read (10 s by default): shorter here, so a
#: slice's batches can be removed, untimed, right after it.
LEASE_TTL_MS = 200


class Mooncake:
    """A Mooncake client lending its own segment, with a registered source and
    destination buffer of a batch's bytes each."""

    def __init__(self, fleet: Fleet, batch_bytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        meta = f"http://{fleet.addr_a}:{fleet.http_port}/metadata"
        # The segment holds a slice's batches and one more (each slice's are removed
        # after it), in whole 64 MiB (a smaller one is refused).
        segment = -(-(SLICE + 1) * batch_bytes // (64 << 20)) * (64 << 20)
        rc = self.store.setup(fleet.addr_a, meta, segment, 16 << 20, "tcp", "",
                              fleet.master_address)
        if rc != 0:
            raise RuntimeError(f"Mooncake setup failed: {rc}")
        self._maps = [mmap.mmap(-1, batch_bytes) for _ in range(2)]
        self.src, self.dst = (np.frombuffer(m, np.uint8) for m in self._maps)
        self.src[:] = 7  # (pre-faulted, and not zero pages)
        self.dst[:] = 1
        for a in (self.src, self.dst):
            if self.store.register_buffer(a.ctypes.data, a.nbytes) != 0:
                raise RuntimeError("Mooncake register_buffer failed")

    def put(self, names: list[str], size: int) -> None:
        base = self.src.ctypes.data
        rcs = self.store.batch_put_from(names, [base + i * size for i in range(len(names))],
                                        [size] * len(names))
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"batch_put_from: {rcs[:4]}")

    def get(self, names: list[str], size: int) -> None:
        base = self.dst.ctypes.data
        rcs = self.store.batch_get_into(names, [base + i * size for i in range(len(names))],
                                        [size] * len(names))
        if any(rc != size for rc in rcs):
            raise RuntimeError(f"batch_get_into: {rcs[:4]}")

    def remove(self, names: list[str]) -> None:
        time.sleep(LEASE_TTL_MS * 1.5 / 1000)  # (the gets' leases on them end first)
        rcs = self.store.batch_remove(names)
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"batch_remove: {rcs[:4]}")

    def close(self) -> None:
        self.store.unregister_buffer(self.src.ctypes.data)
        self.store.unregister_buffer(self.dst.ctypes.data)
        self.store.close()
        del self.src, self.dst  # (the arrays hold the maps' buffers)
        for m in self._maps:
            m.close()


def _kvtier_slice(c: kvtier.Client, size: int, seq: int) -> tuple[float, float]:
    """Seconds of SLICE puts and of SLICE gets of BATCH new keys of ``size`` bytes."""
    src = [np.full(size, 7, np.uint8) for _ in range(BATCH)]
    dst = [np.ones(size, np.uint8) for _ in range(BATCH)]
    put = get = 0.0
    done: list[bytes] = []
    for b in range(SLICE):
        keys = [b"k%d-%d-%d" % (seq, b, i) for i in range(BATCH)]
        t0 = time.perf_counter()
        c.put(keys, src)
        t1 = time.perf_counter()
        c.get(keys, out=dst)
        t2 = time.perf_counter()
        done += keys
        put += t1 - t0
        get += t2 - t1
    c.delete(done)
    if not all((d == 7).all() for d in dst):
        raise RuntimeError("kvtier get returned other bytes")
    return put, get


def _mooncake_slice(m: Mooncake, size: int, seq: int) -> tuple[float, float]:
    put = get = 0.0
    done: list[str] = []
    for b in range(SLICE):
        names = [f"k{seq}-{b}-{i}" for i in range(BATCH)]
        t0 = time.perf_counter()
        m.put(names, size)
        t1 = time.perf_counter()
        m.get(names, size)
        t2 = time.perf_counter()
        done += names
        put += t1 - t0
        get += t2 - t1
    m.remove(done)
    if not (m.dst[: BATCH * size] == 7).all():
        raise RuntimeError("Mooncake get returned other bytes")
    return put, get


def run(sizes: list[int], rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": {}}
    biggest = max(sizes) * BATCH
    with tempfile.TemporaryDirectory(prefix="kvt-bench-mc-") as base:
        fleet = Fleet(base, netns=False)
        try:
            fleet.start_master(f"--default_kv_lease_ttl={LEASE_TTL_MS}")
            m = Mooncake(fleet, biggest)
            try:
                with private_daemon("pvm", f"dram.capacity={max(2 * (SLICE + 1) * biggest, 1 << 30)}",
                                    "spill.ssd_dir=") as d:
                    seq = 0
                    for size in sizes:
                        c = kvtier.Client(d.socket_dir, namespace=f"pvm{size}",
                                          block_bytes=size, model_uid="m")
                        rows: dict[str, list[float]] = {k: [] for k in (
                            "kvtier_put", "kvtier_get", "mooncake_put", "mooncake_get")}
                        nbytes = SLICE * BATCH * size
                        _kvtier_slice(c, size, seq)  # warm-up, untimed
                        _mooncake_slice(m, size, seq + 1)
                        seq += 2
                        for r in range(rounds):
                            order = ("kvtier", "mooncake") if r % 2 == 0 else ("mooncake", "kvtier")
                            for system in order:
                                p, g = (_kvtier_slice(c, size, seq) if system == "kvtier"
                                        else _mooncake_slice(m, size, seq))
                                seq += 1
                                rows[f"{system}_put"].append(nbytes / p / 1e9)
                                rows[f"{system}_get"].append(nbytes / g / 1e9)
                        med = {k: statistics.median(v) for k, v in rows.items()}
                        med["put_x_mooncake"] = med["kvtier_put"] / med["mooncake_put"]
                        med["get_x_mooncake"] = med["kvtier_get"] / med["mooncake_get"]
                        c.close()
                        out["sizes"][str(size)] = {"GBps_per_round": rows, "median": med}
                        print(f"{format_bytes(size):>8}: put kvtier {med['kvtier_put']:.2f} GB/s, "
                              f"Mooncake {med['mooncake_put']:.2f} ({med['put_x_mooncake']:.2f}x); "
                              f"get kvtier {med['kvtier_get']:.2f}, Mooncake "
                              f"{med['mooncake_get']:.2f} ({med['get_x_mooncake']:.2f}x)",
                              flush=True)
            finally:
                m.close()
        finally:
            fleet.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,512K,2M,8M",
                    type=lambda text: [parse_size(s) for s in text.split(",")])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    write_json(args.json, {**run(args.sizes, args.rounds), "command": sys.argv})
    return 0


if __name__ == "__main__":
    sys.exit(main())
