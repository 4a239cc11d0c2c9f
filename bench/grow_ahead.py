"""A fresh kvtierd's put latency while its DRAM grows: ``dram.grow_ahead`` on and off.

Issue 27: a namespace's DRAM grows one extent (``dram.extent_size``, a /dev/shm file
made and pre-faulted) at a time; without growth ahead the put that needs the room
waits for it.  Each daemon here is fresh (a new shm dir); one client puts 31 blocks of
2 MiB (a 4k-token load of a decode server: one 64 MiB extent's worth) per round,
``--gap`` seconds apart (the engine's own work between two requests), until the DRAM
budget is full (every extent made; the next put would evict).  Daemons with growth
ahead on and off alternate, ``--daemons`` of each, in the same run.  Each put is timed
end to end (reserve, copy, commit) and checked to have made no eviction.

Usage: ``.venv/bin/python bench/grow_ahead.py [--dram 1GiB] [--gap 0.2] [--daemons 3]
[--json FILE]``
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import kvtier
from kvtier.bench.common import write_json
from kvtier.bench.private_daemon import private_daemon
from kvtier.units import parse_size

BLOCK = 2 << 20
BLOCKS = 31


def _p(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * q))]


def one_daemon(dram: int, extent: int, grow_ahead: bool, gap: float, seed: int
               ) -> dict[str, Any]:
    """Put rounds into a fresh daemon until its DRAM is full; the puts' seconds."""
    rng = np.random.default_rng(seed)
    blocks = [rng.integers(0, 255, BLOCK, dtype=np.uint8) for _ in range(BLOCKS)]
    puts: list[float] = []
    with private_daemon("ga", f"dram.capacity={dram}", f"dram.extent_size={extent}",
                 f"dram.grow_ahead={str(grow_ahead).lower()}") as daemon:
        with kvtier.Client(daemon.socket_dir, namespace="ga", block_bytes=BLOCK,
                           model_uid="m") as c:
            for r in range(10_000):
                dram_tier = next(t for t in c.stats()["tiers"] if "DRAM" in t["tier"])
                if int(dram_tier["free_bytes"]) < BLOCKS * BLOCK:
                    break  # the next put would evict: DRAM is full
                time.sleep(gap)
                ks = [f"r{r:04d}b{i:02d}".encode() for i in range(BLOCKS)]
                t0 = time.perf_counter()
                c.put(ks, blocks)
                puts.append(time.perf_counter() - t0)
            final = c.stats()
    log = daemon.final_log
    ns = next(n for n in final["namespaces"] if n["name"] == "ga")
    return {"grow_ahead": grow_ahead, "puts_s": puts, "extents": int(ns["segments"]),
            "evictions": int(final["evictions"]),
            "prefault_seconds": float(final["prefault_seconds"]),
            "log_errors": [line for line in log.splitlines() if "ERROR" in line]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dram", default="1GiB")
    ap.add_argument("--extent", default="64MiB")
    ap.add_argument("--gap", type=float, default=0.2,
                    help="seconds between two puts (default 0.2)")
    ap.add_argument("--daemons", type=int, default=3, help="fresh daemons per mode")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    dram, extent = parse_size(args.dram), parse_size(args.extent)
    out: dict[str, Any] = {"command": sys.argv, "dram": dram, "extent": extent,
                           "gap": args.gap, "blocks": BLOCKS, "block_bytes": BLOCK,
                           "runs": []}
    for i in range(args.daemons):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            run = one_daemon(dram, extent, on, args.gap, seed=i)
            out["runs"].append(run)
            ms = [round(p * 1e3, 1) for p in run["puts_s"]]
            print(f"grow_ahead={'on ' if on else 'off'} daemon {i}: {len(ms)} puts, "
                  f"extents {run['extents']}, evictions {run['evictions']}, pre-fault "
                  f"{run['prefault_seconds']:.2f} s; put ms {ms}", flush=True)
    out["summary"] = {}
    for on in (True, False):
        puts = [p for r in out["runs"] if r["grow_ahead"] is on for p in r["puts_s"]]
        # The first put of each daemon grows the namespace's first extent either way.
        later = [p for r in out["runs"] if r["grow_ahead"] is on for p in r["puts_s"][1:]]
        s = {"puts": len(puts), "p50_ms": _p(puts, 0.5) * 1e3, "p99_ms": _p(puts, 0.99) * 1e3,
             "max_ms": max(puts) * 1e3, "later_p50_ms": _p(later, 0.5) * 1e3,
             "later_p99_ms": _p(later, 0.99) * 1e3,
             "evictions": sum(r["evictions"] for r in out["runs"] if r["grow_ahead"] is on)}
        out["summary"]["on" if on else "off"] = s
        print(f"grow_ahead={'on ' if on else 'off'}: {s['puts']} puts of {BLOCKS} x 2 MiB, "
              f"p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms, max {s['max_ms']:.1f} ms; "
              f"without each daemon's first put: p50 {s['later_p50_ms']:.1f} ms, "
              f"p99 {s['later_p99_ms']:.1f} ms; evictions {s['evictions']}")
    write_json(args.json, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
