"""A get's copy by where its destination lies: ``_native.copy`` of 16 blocks from a
page-aligned source (as a slot is) into destinations ``d`` bytes past it modulo 4096,
for one or several source trees in the same run (rounds alternate between trees).

glibc copies a block of 2 KiB up to the L2 size (AMD) with ``rep movsb``, and AMD's
``rep movsb`` runs many times slower when the destination lies a few bytes past the
source modulo 4096 (glibc bug 30994).  A get copies from a page-aligned slot into a
numpy row, which malloc places 16 bytes past a page: ``d = 16``.  Each figure is us
per block (median of the repetitions) and its ratio to ``d = 0`` in the same child
process (the baseline: the copy glibc does best).  ``--glibc-avx2`` runs the children
with glibc's AVX-512 string functions turned off (``GLIBC_TUNABLES``), so an AVX-512
host copies as an AVX2-only one does.

Usage::

    .venv/bin/python bench/copy_alias.py [--tree DIR ...] [--rounds N] [--glibc-avx2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tree_runs  # noqa: E402 -- bench/ is not a package

#: Destination offsets past the source, modulo 4096 (0: the baseline).
DISTANCES = (0, 1, 8, 16, 32, 48, 64, 128, 2048, 4080, 4095)
BLOCKS = 16
#: glibc's tunable that hides AVX-512 from its ifunc selection (memcpy then picks the
#: AVX2 variant, as on an AVX2-only CPU).
GLIBC_AVX2 = "glibc.cpu.hwcaps=-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,-AVX512CD"


def _child(block: int, reps: int) -> dict[str, Any]:
    import numpy as np

    from kvtier import _native

    src_raw = np.empty(BLOCKS * block + 8192, np.uint8)
    dst_raw = np.empty(BLOCKS * block + 8192, np.uint8)
    src_raw[:] = 1
    dst_raw[:] = 2
    s0 = (-src_raw.ctypes.data) % 4096
    d0 = (-dst_raw.ctypes.data) % 4096

    def per_block(d: int) -> float:
        srcs = [src_raw[s0 + i * block: s0 + (i + 1) * block] for i in range(BLOCKS)]
        dsts = [dst_raw[d0 + d + i * block: d0 + d + (i + 1) * block] for i in range(BLOCKS)]
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for dst, src in zip(dsts, srcs, strict=True):
                _native.copy(dst, src, 1)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / BLOCKS * 1e6

    us: dict[str, float] = {}
    for _ in range(2):  # twice, interleaved: the better of the two per distance
        for d in DISTANCES:
            got = per_block(d)
            us[str(d)] = min(us.get(str(d), got), got)
    return {"block": block, "us_per_block": us,
            "x_d0": {d: v / us["0"] for d, v in us.items()},
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", type=Path,
                    help="a source tree to measure (repeatable; default: this checkout)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block", type=int, default=64 << 10)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--glibc-avx2", action="store_true",
                    help="children copy with glibc's AVX2 functions (GLIBC_TUNABLES)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.block, args.reps)))
        return 0
    if args.glibc_avx2:
        os.environ["GLIBC_TUNABLES"] = GLIBC_AVX2
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    runs = tree_runs.rounds(trees, args.rounds, lambda t, _: tree_runs.run_child(
        __file__, t, ["copy", "--block", str(args.block), "--reps", str(args.reps)], 300))
    print(f"\nus per {args.block}-byte block (x the d=0 copy of the same child), "
          "min..max over rounds")
    print(f"{'tree':<28}" + "".join(f"{'d=' + str(d):>16}" for d in DISTANCES))
    for t in trees:
        rows = runs[str(t)]
        line = f"{str(t)[-28:]:<28}"
        for d in DISTANCES:
            xs = [r["x_d0"][str(d)] for r in rows]
            line += f"{min(xs):>7.2f}-{max(xs):.2f}x".rjust(16)
        print(line)
    if args.json:
        tree_runs.save_runs(args.json, trees, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
