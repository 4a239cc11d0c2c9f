"""Puts against their copy ceilings, and a fill against the steady state, for one or
several source trees in the same run (rounds alternate between trees).

Per tree and round, two kinds of child process (``PYTHONPATH`` = that tree):

* ``put``: a kvtierd per block size (64 KiB and 512 KiB; 512 MiB pool, 64 MiB
  extents, filled first so every claim evicts), then short slices alternating:
  the copy of 32 blocks into successive windows of a pre-faulted shared-memory
  file ("moving slots": a put's copy with no control plane), a memcpy of 32
  blocks into 32 fixed pre-faulted blocks (``numpy.copyto``), ``Client.put`` of
  32 blocks in a loop, the same with the put kept in one batch
  (``put_batch_bytes`` huge: no overlap inside a put), and ``Client.put_many``
  of a stream of such batches (where the tree has it).  GB/s of each (median of
  the slices), and the daemon's user and system CPU per block during the puts.
* ``fill``: a fresh kvtierd (``--fill-pool``, 64 MiB extents) for
  ``dram.grow_ahead`` true and false; 4 KiB blocks put in batches of 4096 until
  the pool is full (the fill: every extent made and pre-faulted), then as many
  more (the steady state: every claim evicts).  Per phase: blocks/s, the
  slowest put, and the daemon's CPU per block from ``/proc/PID/stat`` split
  into user time and system time (the kernel's share: zeroing and mapping the
  new extents' pages, the futex and pipe wake-ups).

Usage::

    .venv/bin/python bench/put_overlap.py [--tree DIR ...] [--rounds N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tree_runs  # noqa: E402 -- bench/ is not a package

KiB = 1 << 10
MiB = 1 << 20
BATCH = 32
#: The moving-slots file: successive batch-sized windows of it, as slots move through a pool.
MOVING_BYTES = 256 * MiB


def _p50(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _cpu(pid: int) -> tuple[int, int]:
    """(user, system) clock ticks of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


# ------------------------------------------------------------------ put vs copy
def _put_mode(seconds: float) -> dict[str, Any]:
    return {f"{block // KiB}KiB": _put_size(block, seconds) for block in (64 * KiB, 512 * KiB)}


def _put_size(block: int, seconds: float) -> dict[str, Any]:
    import numpy as np

    import kvtier
    from kvtier import _accel
    from kvtier.bench.private_daemon import private_daemon as kvtierd

    tck = os.sysconf("SC_CLK_TCK")
    span = block * BATCH
    rng = np.random.default_rng(block)
    src = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(BATCH)]
    fixed = [np.ones(block, np.uint8) for _ in range(BATCH)]
    fd, path = tempfile.mkstemp(prefix="kvt-bench-moving-", dir="/dev/shm")
    os.unlink(path)
    os.ftruncate(fd, MOVING_BYTES)
    mm = mmap.mmap(fd, MOVING_BYTES)
    shm = np.frombuffer(mm, np.uint8)
    shm[::4096] = 1  # pre-faulted, as the daemon's extents are
    windows = MOVING_BYTES // span
    rates: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    n_key = [0]
    with kvtierd("po", "dram.capacity=512MiB", "dram.extent_size=64MiB",
                 "server.write_grant_bytes=64MiB") as d, \
            kvtier.Client(d.socket_dir, namespace="po", block_bytes=block,
                          model_uid="m") as c:
        split = c.put_batch_bytes if hasattr(c, "put_batch_bytes") else None

        def keys() -> list[bytes]:
            n_key[0] += 1
            return [b"k%08d-%02d" % (n_key[0], i) for i in range(BATCH)]

        for _ in range(512 * MiB // span + 4):  # fill: every later claim evicts
            c.put(keys(), src)

        def moving(t_end: float) -> int:
            w = 0
            while time.perf_counter() < t_end:
                base = (w % windows) * span
                for i in range(BATCH):
                    _accel.copy_into(shm[base + i * block: base + (i + 1) * block], src[i])
                w += 1
            return w

        def memcpy(t_end: float) -> int:
            w = 0
            while time.perf_counter() < t_end:
                for i in range(BATCH):
                    np.copyto(fixed[i], src[i])
                w += 1
            return w

        def put(t_end: float) -> int:
            w = 0
            while time.perf_counter() < t_end:
                c.put(keys(), src)
                w += 1
            return w

        def put_one_batch(t_end: float) -> int:
            if split is None:
                return put(t_end)
            c.put_batch_bytes = 1 << 50
            try:
                return put(t_end)
            finally:
                c.put_batch_bytes = split

        def put_many(t_end: float) -> int:
            w = [0]

            def items() -> Any:
                while time.perf_counter() < t_end:
                    w[0] += 1
                    yield keys(), src
            c.put_many(items())
            return w[0]

        modes = {"moving": moving, "memcpy": memcpy, "put": put,
                 "put_one_batch": put_one_batch}
        if hasattr(c, "put_many"):
            modes["put_many"] = put_many
        slices = max(3, int(seconds / 0.25))
        for s in range(slices):
            order = list(modes) if s % 2 == 0 else list(reversed(modes))
            for name in order:
                u0, s0 = _cpu(d.pid)
                t0 = time.perf_counter()
                w = modes[name](t0 + seconds / slices)
                el = time.perf_counter() - t0
                u1, s1 = _cpu(d.pid)
                rates.setdefault(name, []).append(w * span / el / 1e9)
                if name.startswith("put"):
                    c_ = cpu.setdefault(name, [0.0, 0.0, 0.0])
                    c_[0] += (u1 - u0) / tck
                    c_[1] += (s1 - s0) / tck
                    c_[2] += w * BATCH
    os.close(fd)  # (the mapping goes with the process)
    row: dict[str, Any] = {f"{k}_GBps": _p50(v) for k, v in rates.items()}
    for k, (u, s_, n) in cpu.items():
        row[f"{k}_daemon_user_us_per_block"] = u / n * 1e6
        row[f"{k}_daemon_sys_us_per_block"] = s_ / n * 1e6
    for k in modes:
        if k.startswith("put"):
            row[f"{k}_x_moving"] = row[f"{k}_GBps"] / row["moving_GBps"]
            row[f"{k}_x_memcpy"] = row[f"{k}_GBps"] / row["memcpy_GBps"]
    row["put_batch_bytes"] = split
    return row


# ------------------------------------------------------------------ fill vs steady
def _fill_mode(pool: int, grow_ahead: bool) -> dict[str, Any]:
    import numpy as np

    import kvtier
    from kvtier.bench.private_daemon import private_daemon as kvtierd

    block, batch = 4 * KiB, 4096
    tck = os.sysconf("SC_CLK_TCK")
    data = [np.full(block, 7, np.uint8)] * batch
    out: dict[str, Any] = {}
    with kvtierd("pf", f"dram.capacity={pool}", "dram.extent_size=64MiB",
                 f"dram.grow_ahead={str(grow_ahead).lower()}") as d, \
            kvtier.Client(d.socket_dir, namespace="pf", block_bytes=block, model_uid="m") as c:
        puts = pool // (block * batch)
        j = 0
        for phase in ("fill", "steady"):
            u0, s0 = _cpu(d.pid)
            lat = []
            t0 = time.perf_counter()
            for _ in range(puts):
                a = time.perf_counter()
                c.put([b"f%05d-%04d" % (j, i) for i in range(batch)], data)
                lat.append(time.perf_counter() - a)
                j += 1
            el = time.perf_counter() - t0
            u1, s1 = _cpu(d.pid)
            n = puts * batch
            out[phase] = {"blocks_per_s": n / el, "put_max_ms": max(lat) * 1e3,
                          "put_p50_ms": _p50(lat) * 1e3,
                          "daemon_user_us_per_block": (u1 - u0) / tck / n * 1e6,
                          "daemon_sys_us_per_block": (s1 - s0) / tck / n * 1e6,
                          "daemon_us_per_block": (u1 - u0 + s1 - s0) / tck / n * 1e6}
            if phase == "fill":
                dram = next(t for t in c.stats()["tiers"] if "DRAM" in t["tier"])
                out["fill"]["free_bytes_after"] = int(dram["free_bytes"])
        s = c.stats()
        out["evictions"] = int(s.get("evictions", 0))
    f, st = out["fill"], out["steady"]
    out["fill_x_steady_cpu"] = f["daemon_us_per_block"] / st["daemon_us_per_block"]
    out["fill_x_steady_user_cpu"] = f["daemon_user_us_per_block"] / st["daemon_user_us_per_block"]
    return out


# ------------------------------------------------------------------ the table
def summary(trees: list[Path], runs: dict[str, list[dict[str, Any]]]) -> str:
    """Medians over rounds, one column per tree."""
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, *path: str) -> None:
        vals = []
        for t in trees:
            got = []
            for r in runs[str(t)]:
                v: Any = r
                for p in path:
                    v = v.get(p) if isinstance(v, dict) else None
                if isinstance(v, (int, float)):
                    got.append(float(v))
            vals.append(f"{_p50(got):.3g}" if got else "-")
        rows.append((label, vals))

    for size in ("64KiB", "512KiB"):
        for m in ("moving", "memcpy", "put", "put_one_batch", "put_many"):
            row(f"{size} {m} GB/s", "put", size, f"{m}_GBps")
        for m in ("put", "put_one_batch", "put_many"):
            row(f"{size} {m} x moving", "put", size, f"{m}_x_moving")
            row(f"{size} {m} x memcpy", "put", size, f"{m}_x_memcpy")
            row(f"{size} {m} daemon user us/block", "put", size,
                f"{m}_daemon_user_us_per_block")
            row(f"{size} {m} daemon sys us/block", "put", size, f"{m}_daemon_sys_us_per_block")
    for ga in ("True", "False"):
        for ph in ("fill", "steady"):
            for k in ("blocks_per_s", "put_max_ms", "daemon_user_us_per_block",
                      "daemon_sys_us_per_block", "daemon_us_per_block"):
                row(f"grow_ahead={ga} {ph} {k}", f"fill_grow_ahead_{ga}", ph, k)
        row(f"grow_ahead={ga} fill x steady, daemon CPU", f"fill_grow_ahead_{ga}",
            "fill_x_steady_cpu")
        row(f"grow_ahead={ga} fill x steady, user CPU only", f"fill_grow_ahead_{ga}",
            "fill_x_steady_user_cpu")
    width = max(len(label) for label, _ in rows)
    out = [f"{'medians over rounds':{width}} | " + " | ".join(t.name for t in trees)]
    out += [f"{label:{width}} | " + " | ".join(vals) for label, vals in rows]
    return "\n".join(out)


# ------------------------------------------------------------------ the driver
def _child(tree: Path, args: list[str]) -> dict[str, Any]:
    return tree_runs.run_child(__file__, tree, args, timeout=900)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", type=Path,
                    help="a source tree to measure (repeatable; default: this checkout)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=6.0, help="per block size and mode")
    ap.add_argument("--fill-pool", default=str(1 << 30), help="bytes of the fill's pool")
    ap.add_argument("--modes", default="put,fill")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--summary", metavar="JSON", help="print the table of an earlier run's JSON")
    args = ap.parse_args()
    if args.summary:
        with open(args.summary) as f:
            saved = json.load(f)
        print(summary([Path(t) for t in saved["trees"]], saved["runs"]))
        return 0
    if args.child:
        if args.child[0] == "put":
            res = _put_mode(float(args.child[1]))
        else:
            res = _fill_mode(int(args.child[1]), args.child[2] == "1")
        print(json.dumps(res))
        return 0
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    modes = args.modes.split(",")

    def measure(t: Path, r: int) -> dict[str, Any]:
        row: dict[str, Any] = {}
        if "put" in modes:
            row["put"] = _child(t, ["put", str(args.seconds)])
        if "fill" in modes:
            for ga in ((True, False) if r % 2 == 0 else (False, True)):
                row[f"fill_grow_ahead_{ga}"] = _child(t, ["fill", args.fill_pool,
                                                          "1" if ga else "0"])
        return row

    runs = tree_runs.rounds(trees, args.rounds, measure)
    print()
    print(summary(trees, runs))
    if args.json:
        tree_runs.save_runs(args.json, trees, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
