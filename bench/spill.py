"""Spill-tier benchmark: SSD tier throughput vs dd, promotion latency, a 4x-DRAM
working set with and without the SSD tier, and re-adoption time of spill files.

Everything runs in this process on the daemon's own classes (no gRPC):

1. throughput  ``SsdTier.write`` (+ one ``sync`` per batch, as the demoter does)
               and ``SsdTier.read_into`` of 512 KiB / 2 MiB / 8 MiB blocks from / to
               a page-aligned mapping of a /dev/shm file (like DRAM slots), with 1
               thread and with the daemon's 4 spill I/O threads, against ``dd``
               with O_DIRECT on the same filesystem in the same run (ratio = tier /
               dd, medians over --reps).
2. promotion   p50/p99 of ``Tiering.acquire`` of one 2 MiB block held only by the
               SSD tier (promote + lease), then release and drop the DRAM copy;
               interleaved with a DRAM-hit acquire, a bare ``SsdTier.read_into`` and
               a bare O_DIRECT pread of the same 2 MiB (the baselines).
3. workload    a working set of 4x DRAM (DRAM 64 MiB, 128 x 2 MiB written), then
               random-order reads for several passes, with the SSD tier and
               without (DRAM only: a miss is "recomputed" = put again).
4. re-adoption a fresh ``SsdTier.open()`` of a directory holding 10k and 100k
               16 KiB blocks, after dropping the page cache (needs root).

    .venv/bin/python bench/spill.py                  # ~2-3 minutes
    .venv/bin/python bench/spill.py --quick          # smoke test, seconds

Prints tables to stdout (progress to stderr) and writes every raw number to
``--json`` (default bench/results/spill-<UTC date-time>.json).  Temp files live
in a fresh directory under ``--dir`` (default /var/tmp; must be a disk
filesystem for O_DIRECT) and in /dev/shm; both are removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import mmap
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvtier import _accel
from kvtier.bench.common import write_json
from kvtier.units import GiB, KiB, MiB, format_bytes
from kvtierd.config import parse_size
from kvtierd.segments import Segment, SegmentLayout
from kvtierd.spill import format as fmt
from kvtierd.spill.ssd import SsdTier
from kvtierd.store import Namespace, Peer, ReserveStatus, Store
from kvtierd.tiering import TIER_DRAM, TIER_SSD, SpillPolicy, Tiering

NS = "bench/spill"
MODEL = "bench-model"
MHASH = fmt.model_hash(MODEL)
#: The demoter's batch: at most this many blocks / bytes, then one fdatasync.
BATCH_BLOCKS = 64
BATCH_BYTES = 64 * MiB
IO_THREADS = 4  # spill.io_threads default
DEFAULT_FILE_BYTES = 1 * GiB  # spill.ssd_file_size default


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q))


def median(values: Sequence[float]) -> float:
    return float(np.median(np.asarray(values, dtype=float)))


# ====================================================================== machine load
class CpuMeter:
    """Share of all CPUs busy outside this process (and its children) over a region."""

    def __init__(self) -> None:
        self.other = 0.0
        self.own = 0.0

    @staticmethod
    def _stat() -> tuple[float, float]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        hz = os.sysconf("SC_CLK_TCK")
        return sum(fields[:8]) / hz, idle / hz

    @staticmethod
    def _own() -> float:
        t = os.times()  # children (dd) in clock ticks; this process to the ns
        return time.process_time() + t.children_user + t.children_system

    def __enter__(self) -> CpuMeter:
        self._t0 = time.perf_counter()
        self._s0 = self._stat()
        self._o0 = self._own()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        total, idle = self._stat()
        busy = (total - self._s0[0]) - (idle - self._s0[1])
        own = self._own() - self._o0
        cpus = os.cpu_count() or 1
        self.own = own / (wall * cpus)
        self.other = max(0.0, busy - own) / (wall * cpus)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        with open("/proc/loadavg") as f:
            return "loadavg " + f.read().strip()


# ====================================================================== shm "DRAM slots"
class ShmSlots:
    """``n`` page-aligned slots of ``slot`` bytes in a mapping of a /dev/shm file (unlinked)."""

    def __init__(self, slot: int, n: int, fill: bool) -> None:
        self.slot = slot
        self.n = n
        path = f"/dev/shm/kvt-bench-spill-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.unlink(path)  # the mapping keeps it; nothing to clean up on a crash
            os.posix_fallocate(fd, 0, slot * n)
            self.mm = mmap.mmap(fd, slot * n)
        finally:
            os.close(fd)
        arr = np.frombuffer(self.mm, dtype=np.uint8)
        if fill:
            rng = np.random.default_rng(1)
            arr[:] = rng.integers(0, 256, slot * n, dtype=np.uint8)
        else:
            arr[::4096] = 0  # fault every page in
        del arr
        self.view = memoryview(self.mm)

    def __getitem__(self, i: int) -> memoryview:
        j = i % self.n
        return self.view[j * self.slot : (j + 1) * self.slot]

    def close(self) -> None:
        try:
            self.view.release()
            self.mm.close()
        except BufferError:  # a slice is still referenced (an exception's traceback)
            pass


# ====================================================================== dd
_DD_RE = re.compile(r"^(\d+) bytes .* copied, ([0-9.eE+-]+) s", re.M)


def dd(args: list[str]) -> dict[str, Any]:
    cmd = ["dd", *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
    m = _DD_RE.search(p.stderr)
    if m is None:
        raise RuntimeError(f"cannot parse dd output: {p.stderr!r}")
    nbytes, secs = int(m.group(1)), float(m.group(2))
    return {"cmd": " ".join(cmd), "bytes": nbytes, "seconds": secs, "gibps": nbytes / secs / GiB}


def dd_bs(block: int) -> str:
    return f"{block // MiB}M" if block % MiB == 0 else f"{block // KiB}K"


# ====================================================================== 1. throughput
def new_tier(root: str, capacity: int, file_bytes: int) -> SsdTier:
    tier = SsdTier(root, capacity=capacity, file_bytes=file_bytes, direct="true")
    tier.open()
    return tier


def tier_write(tier: SsdTier, keys: list[bytes], src: ShmSlots, length: int,
               pool: concurrent.futures.ThreadPoolExecutor | None) -> float:
    """Write every key as the demoter does: a batch of writes, then one fdatasync."""
    per_batch = max(1, min(BATCH_BLOCKS, BATCH_BYTES // src.slot))

    def one(i: int) -> None:
        tier.write(NS, keys[i], src[i], length, None, length, MHASH)

    t0 = time.perf_counter()
    for start in range(0, len(keys), per_batch):
        idx = range(start, min(start + per_batch, len(keys)))
        if pool is None:
            for i in idx:
                one(i)
        else:
            list(pool.map(one, idx))
        tier.sync()
    return time.perf_counter() - t0


def raw_write(path: str, src: ShmSlots, n: int, size: int) -> float:
    """Bare O_DIRECT pwrites of the same shm slots over an existing file, fdatasync per
    batch: the tier's write minus checksum, slot table and bookkeeping."""
    per_batch = max(1, min(BATCH_BLOCKS, BATCH_BYTES // size))
    fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            _accel.pwrite_full(fd, src[i], i * size)
            if (i + 1) % per_batch == 0 or i == n - 1:
                os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def raw_read(path: str, dst: ShmSlots, n: int, size: int) -> float:
    """Bare O_DIRECT preads into the same shm slots: the tier's read minus verify."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            _accel.pread_full(fd, dst[i], i * size)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def tier_read(tier: SsdTier, keys: list[bytes], dst: ShmSlots, length: int,
              pool: concurrent.futures.ThreadPoolExecutor | None) -> float:
    entries = [tier.find(NS, k, length, MHASH) for k in keys]
    assert all(e is not None for e in entries)

    def one(i: int) -> None:
        e = entries[i]
        assert e is not None
        tier.read_into(e, dst[i])

    t0 = time.perf_counter()
    if pool is None:
        for i in range(len(entries)):
            one(i)
    else:
        list(pool.map(one, range(len(entries))))
    return time.perf_counter() - t0


def bench_throughput(root: str, sizes: list[int], data: int, reps: int,
                     file_bytes: int) -> dict[str, Any]:
    """Per size and rep: dd (write new file, overwrite, read), then two tiers.

    Tier A is sized to hold exactly the n blocks (files of <= ``file_bytes``):
    ``write`` fills it with 1 thread (file creation in the timed region), then
    ``overwrite`` (every write evicts the LRU block and reuses its slot) and
    ``read`` run with 1 thread, then again with 4 on fresh keys.  Tier B has the
    daemon's default budget (16 GiB) and is filled with 4 threads: concurrent
    writers that find no free slot each create a file (see the report), so a
    fresh tier with an exact budget would answer SpillFull to them.
    """
    out: dict[str, Any] = {"sizes": {}}
    pool = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="bench-io")
    try:
        for size in sizes:
            n = max(IO_THREADS, data // size)
            nfiles = -(-fmt.SpillLayout(size, n).file_bytes // file_bytes)
            per_file = -(-n // nfiles)
            n = nfiles * per_file
            fb = fmt.SpillLayout(size, per_file).file_bytes
            cap = nfiles * fb
            nslots = max(IO_THREADS * 2, min(n, 64 * MiB // size))
            src = ShmSlots(size, nslots, fill=True)
            dst = ShmSlots(size, nslots, fill=False)
            ops = ("write", "overwrite", "read")
            rows: dict[str, list[dict[str, Any]]] = {f"{w}_{op}": [] for w in (
                "dd", "tier1", f"tier{IO_THREADS}") for op in ops}
            rows["dd_overwrite2"] = []  # the baseline of the 4-thread overwrite
            rows["raw_overwrite"] = []  # bare pwrite loop from the same shm slots
            rows["raw_read"] = []
            files_b: list[int] = []
            nbytes = n * size
            log(f"throughput {format_bytes(size, exact=True)}: {n} blocks ({nbytes / GiB:.2f} GiB) per point, "
                f"{reps} reps, tier A files {nfiles} x {fb / MiB:.0f} MiB")

            def timed(key: str, fn: Callable[..., float], *a: Any,
                      rows: dict[str, list[dict[str, Any]]] = rows, nbytes: int = nbytes) -> None:
                cpu0 = time.process_time()
                with CpuMeter() as m:
                    secs = fn(*a)
                own = time.process_time() - cpu0
                rows[key].append({"bytes": nbytes, "seconds": secs,
                                  "gibps": nbytes / secs / GiB, "cpu_seconds": own,
                                  "other_cpu": m.other})

            try:
                for rep in range(reps):
                    # Each tier figure right after the dd figure it is compared with.
                    f = os.path.join(root, "dd.bin")
                    bs = dd_bs(size)
                    w = f"tier{IO_THREADS}"
                    k = {c: [f"{c}{rep}-{i:07d}".encode() for i in range(n)] for c in "abc"}

                    def run_dd(key: str, argv: list[str],
                               rows: dict[str, list[dict[str, Any]]] = rows) -> None:
                        with CpuMeter() as m:
                            r = dd(argv)
                        rows[key].append({**r, "other_cpu": m.other})

                    run_dd("dd_write", ["if=/dev/zero", f"of={f}", f"bs={bs}", f"count={n}",
                                        "oflag=direct"])
                    tdir_b = os.path.join(root, f"tierB-{size}-{rep}")
                    tier_b = new_tier(tdir_b, 16 * GiB, file_bytes)
                    try:
                        timed(f"{w}_write", tier_write, tier_b, k["a"], src, size, pool)
                        files_b.append(tier_b.stats()["files"])
                        assert tier_b.check() == []
                    finally:
                        tier_b.close()
                        shutil.rmtree(tdir_b, ignore_errors=True)
                    tdir = os.path.join(root, f"tierA-{size}-{rep}")
                    tier = new_tier(tdir, cap, fb)
                    try:
                        timed("tier1_write", tier_write, tier, k["a"], src, size, None)
                        run_dd("dd_overwrite", ["if=/dev/zero", f"of={f}", f"bs={bs}",
                                                f"count={n}", "oflag=direct", "conv=notrunc"])
                        timed("tier1_overwrite", tier_write, tier, k["b"], src, size, None)
                        run_dd("dd_overwrite2", ["if=/dev/zero", f"of={f}", f"bs={bs}",
                                                 f"count={n}", "oflag=direct", "conv=notrunc"])
                        timed("raw_overwrite", raw_write, f, src, n, size)
                        timed(f"{w}_overwrite", tier_write, tier, k["c"], src, size, pool)
                        # reads: dd first in even reps, last in odd ones
                        if rep % 2 == 0:
                            run_dd("dd_read", [f"if={f}", "of=/dev/null", f"bs={bs}",
                                               "iflag=direct"])
                            timed("raw_read", raw_read, f, dst, n, size)
                        timed("tier1_read", tier_read, tier, k["c"], dst, size, None)
                        timed(f"{w}_read", tier_read, tier, k["c"], dst, size, pool)
                        if rep % 2 == 1:
                            timed("raw_read", raw_read, f, dst, n, size)
                            run_dd("dd_read", [f"if={f}", "of=/dev/null", f"bs={bs}",
                                               "iflag=direct"])
                        assert tier.counters.evictions == 2 * n, (tier.counters.evictions, n)
                        assert tier.stats()["files"] == nfiles
                        assert tier.check() == []
                    finally:
                        tier.close()
                        shutil.rmtree(tdir, ignore_errors=True)
                        os.unlink(f)
                    log(f"  rep {rep + 1}: " + "  ".join(
                        f"{who} " + "/".join(f"{rows[f'{who}_{op}'][-1]['gibps']:.2f}" for op in ops)
                        for who in ("dd", "tier1", w))
                        + f" GiB/s (write/overwrite/read); tier B files {files_b[-1]}")
            finally:
                src.close()
                dst.close()
            med = {k: median([r["gibps"] for r in v]) for k, v in rows.items()}
            med["dd_overwrite"] = median([r["gibps"] for r in
                                          rows["dd_overwrite"] + rows["dd_overwrite2"]])
            # tier / dd within each rep, dd measured next to it (the disk's speed drifts)
            base = {f"{t}_{op}": f"dd_{op}" for t in ("tier1", f"tier{IO_THREADS}") for op in ops}
            base[f"tier{IO_THREADS}_overwrite"] = "dd_overwrite2"
            base["raw_overwrite"] = "dd_overwrite2"
            base["raw_read"] = "dd_read"
            ratios = {k: [a["gibps"] / b["gibps"] for a, b in zip(rows[k], rows[d], strict=True)]
                      for k, d in base.items()}
            # the tier's own overhead: tier / bare I/O from the same shm slots, same rep
            for op in ("overwrite", "read"):
                for t in ("tier1", f"tier{IO_THREADS}"):
                    ratios[f"{t}_{op}_vs_raw"] = [
                        a["gibps"] / b["gibps"] for a, b in zip(
                            rows[f"{t}_{op}"], rows[f"raw_{op}"], strict=True)]
            out["sizes"][str(size)] = {"block_bytes": size, "blocks": n, "bytes": nbytes,
                                       "tier_a_files": nfiles, "tier_a_file_bytes": fb,
                                       "tier_b_files": files_b, "median_gibps": med,
                                       "rep_ratios": ratios,
                                       "median_rep_ratio": {k: median(v)
                                                            for k, v in ratios.items()},
                                       "runs": rows}
    finally:
        pool.shutdown()
    return out


def bench_paired(root: str, sizes: list[int], rounds: int, file_bytes: int) -> dict[str, Any]:
    """Tier and dd interleaved one batch at a time, so both see the same disk.

    The VM disk's speed drifts up to 2x within seconds, which swamps whole-GiB
    figures taken a few seconds apart.  Here each round moves one demoter
    batch (min(64 blocks, 64 MiB)) three ways back to back, in an order that
    rotates every round: the tier (4 threads, full tier: every write evicts
    and reuses a slot, then one sync), ``dd oflag=direct conv=notrunc`` of the
    same bytes, and ``dd oflag=direct conv=notrunc,fdatasync`` (the same
    durability as the tier's batch: data on stable storage before it
    returns); then reads: the tier's ``read_into`` + verify vs ``dd
    iflag=direct`` of the same number of blocks.  Ratios are of the summed
    bytes/seconds over all rounds; dd's own timing excludes its process start.
    """
    out: dict[str, Any] = {"sizes": {}, "rounds": rounds}
    pool = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="bench-io")
    try:
        for size in sizes:
            out["sizes"][str(size)] = _paired_size(root, size, rounds, file_bytes, pool)
    finally:
        pool.shutdown()
    return out


def _paired_size(root: str, size: int, rounds: int, file_bytes: int,
                 pool: concurrent.futures.ThreadPoolExecutor) -> dict[str, Any]:
    per = max(1, min(BATCH_BLOCKS, BATCH_BYTES // size))
    n = per * rounds
    nfiles = -(-fmt.SpillLayout(size, n).file_bytes // file_bytes)
    fb = fmt.SpillLayout(size, -(-n // nfiles)).file_bytes
    src = ShmSlots(size, per, fill=True)
    dst = ShmSlots(size, per, fill=False)
    f = os.path.join(root, "paired-dd.bin")
    bs = dd_bs(size)
    tdir = os.path.join(root, f"paired-{size}")
    tier = new_tier(tdir, nfiles * fb, fb)
    secs = dict.fromkeys(("tier_overwrite", "dd", "dd_fdatasync", "tier_read", "dd_read"), 0.0)
    log(f"paired {format_bytes(size, exact=True)}: {rounds} rounds of {per} blocks")

    def step(what: str, r: int) -> float:
        keys = [f"r{r}-{i:05d}".encode() for i in range(per)]
        where = [f"bs={bs}", f"count={per}"]
        if what == "tier_overwrite":
            return tier_write(tier, keys, src, size, pool)
        if what == "tier_read":
            return tier_read(tier, keys, dst, size, pool)
        if what == "dd_read":
            return float(dd([f"if={f}", "of=/dev/null", *where, f"skip={r * per}",
                             "iflag=direct"])["seconds"])
        conv = "conv=notrunc,fdatasync" if what == "dd_fdatasync" else "conv=notrunc"
        return float(dd(["if=/dev/zero", f"of={f}", *where, f"seek={r * per}",
                         "oflag=direct", conv])["seconds"])

    try:
        dd(["if=/dev/zero", f"of={f}", f"bs={bs}", f"count={n}", "oflag=direct"])
        fill = [f"fill-{i:07d}".encode() for i in range(n)]
        for start in range(0, n, per):  # fill the tier: the rounds then overwrite
            tier_write(tier, fill[start:start + per], src, size, pool)
        writes = ["tier_overwrite", "dd", "dd_fdatasync"]
        for r in range(rounds):
            for what in writes[r % 3:] + writes[: r % 3]:
                secs[what] += step(what, r)
            for what in (["tier_read", "dd_read"] if r % 2 else ["dd_read", "tier_read"]):
                secs[what] += step(what, r)
        assert tier.check() == []
    finally:
        tier.close()
        shutil.rmtree(tdir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f)
        src.close()
        dst.close()
    nbytes = n * size
    gibps = {k: nbytes / v / GiB for k, v in secs.items()}
    log(f"  {format_bytes(size, exact=True)}: tier overwrite {gibps['tier_overwrite']:.2f} dd {gibps['dd']:.2f} "
        f"dd+fdatasync {gibps['dd_fdatasync']:.2f}; tier read {gibps['tier_read']:.2f} dd "
        f"{gibps['dd_read']:.2f} GiB/s")
    return {"block_bytes": size, "blocks_per_round": per, "bytes_per_side": nbytes,
            "seconds": secs, "gibps": gibps,
            "ratio": {"overwrite_vs_dd": gibps["tier_overwrite"] / gibps["dd"],
                      "overwrite_vs_dd_fdatasync": gibps["tier_overwrite"] / gibps["dd_fdatasync"],
                      "read_vs_dd": gibps["tier_read"] / gibps["dd_read"]}}


def print_paired(res: dict[str, Any]) -> None:
    print(f"\n== 1b. Paired: tier and dd interleaved one batch at a time ({res['rounds']} "
          f"rounds, {IO_THREADS} threads; ratios of summed throughput) ==")
    print("   overwrite: full tier, one sync per batch; dd: oflag=direct conv=notrunc; "
          "dd+fdatasync: the same with conv=fdatasync per batch (equal durability)")
    print(f"{'block':>8} {'tier ow':>8} {'dd':>6} {'dd+sync':>8} {'x dd':>6} {'x dd+sync':>9} "
          f"{'tier rd':>8} {'dd rd':>6} {'x dd':>6}")
    for s in res["sizes"].values():
        g, r = s["gibps"], s["ratio"]
        print(f"{format_bytes(s['block_bytes'], exact=True):>8} {g['tier_overwrite']:>8.2f} {g['dd']:>6.2f} "
              f"{g['dd_fdatasync']:>8.2f} {r['overwrite_vs_dd']:>5.2f}x "
              f"{r['overwrite_vs_dd_fdatasync']:>8.2f}x {g['tier_read']:>8.2f} "
              f"{g['dd_read']:>6.2f} {r['read_vs_dd']:>5.2f}x")


def print_throughput(res: dict[str, Any]) -> None:
    w = f"tier{IO_THREADS}"
    print("\n== 1. SSD tier throughput vs dd O_DIRECT (GiB/s: median of reps; x dd: median "
          "of the per-rep tier/dd ratios [min-max]) ==")
    print("   write     = fresh tier, file creation in the timed region (1 thr: budget = the "
          f"data; {IO_THREADS} thr: 16 GiB) vs `dd of=F oflag=direct` (new file)")
    print("   overwrite = full tier: every write evicts the LRU block and reuses its slot, "
          "vs dd conv=notrunc (run just before it)")
    print("   read      = read_into + xxh3 verify vs `dd if=F iflag=direct`.  Writes: one "
          f"fdatasync per min({BATCH_BLOCKS} blocks, {BATCH_BYTES // MiB} MiB), as the demoter")
    print("   bare      = a plain O_DIRECT pwrite/pread loop from/to the same shm slots (no "
          "checksum, no slot table); x bare = tier / bare: the tier's own cost")
    print(f"{'block':>8} {'op':>9} {'dd':>6} {'bare':>5} {'x dd':>5} {'tier 1thr':>9} "
          f"{'x dd':>17} {f'tier {IO_THREADS}thr':>9} {'x dd':>17} {'x bare 1/4thr':>13} "
          f"{'CPU s/GiB 1/4thr':>17} {'other CPU':>9}")
    for s in res["sizes"].values():
        med = s["median_gibps"]
        rr = s["rep_ratios"]

        def ratio(key: str, rr: dict[str, list[float]] = rr) -> str:
            v = rr[key]
            return f"{median(v):.2f}x [{min(v):.2f}-{max(v):.2f}]"

        for op in ("write", "overwrite", "read"):
            cpu = [median([r["cpu_seconds"] / (r["bytes"] / GiB) for r in s["runs"][f"{t}_{op}"]])
                   for t in ("tier1", w)]
            other = [r["other_cpu"] for k, v in s["runs"].items()
                     if k.split("_")[1].rstrip("2") == op for r in v]
            if f"raw_{op}" in med:
                bare = (f"{med[f'raw_{op}']:>5.2f} {median(rr[f'raw_{op}']):>4.2f}x")
                vs_raw = (f"{median(rr[f'tier1_{op}_vs_raw']):.2f}/"
                          f"{median(rr[f'{w}_{op}_vs_raw']):.2f}")
            else:
                bare, vs_raw = f"{'-':>5} {'-':>5}", "-"
            print(f"{format_bytes(s['block_bytes'], exact=True):>8} {op:>9} {med[f'dd_{op}']:>6.2f} {bare} "
                  f"{med[f'tier1_{op}']:>9.2f} {ratio(f'tier1_{op}'):>17} "
                  f"{med[f'{w}_{op}']:>9.2f} {ratio(f'{w}_{op}'):>17} {vs_raw:>13} "
                  f"{cpu[0]:>8.3f}/{cpu[1]:<8.3f} {median(other) * 100:>8.0f}%")
        print(f"{'':>8} ({IO_THREADS}-thread fresh fill, 16 GiB budget: files created per rep "
              f"{s['tier_b_files']}; {s['tier_a_files']} would hold the data)")


# ====================================================================== store helpers
def make_store(shm_dir: str, capacity: int, extent_size: int) -> Store:
    def create(ns: Namespace, index: int, layout: SegmentLayout, seg_id: int) -> Segment:
        return Segment.create(shm_dir, segment_id=seg_id, namespace=ns.name,
                              model_uid=ns.model_uid, index=index, layout=layout,
                              boot_epoch=1, mlock=False, prefault_threads=1)

    return Store(capacity=capacity, extent_size=extent_size, extent_factory=create,
                 lease_ttl=300.0, reservation_ttl=60.0, boot_epoch=1)


def slot_view(store: Store, ns: Namespace, segment_id: int, offset: int, length: int) -> memoryview:
    for ext in ns.extents:
        seg = ext.segment
        if seg.segment_id == segment_id:
            view: memoryview = seg.data_view(offset // seg.layout.slot_bytes, length)
            return view
    raise KeyError(segment_id)


def dram_for(block: int, slots_per_extent: int, extents: int) -> tuple[int, int]:
    """(capacity, extent_size) of a DRAM pool of exactly extents x slots_per_extent slots."""
    slot = fmt.round_up(block)
    layout = SegmentLayout.fit(block, slots_per_extent * slot + 64 * KiB)
    assert layout is not None and layout.n_slots == slots_per_extent, layout
    return extents * layout.file_bytes, layout.file_bytes


def stamp(view: memoryview, base: memoryview, key_index: int) -> None:
    """A distinct block per key: the base bytes with the key index in the first 8."""
    _accel.copy_into(view, base)
    view[:8] = key_index.to_bytes(8, "little")


# ====================================================================== 2. promotion
async def bench_promotion(root: str, shm_dir: str, rounds: int, warmup: int,
                          block: int) -> dict[str, Any]:
    cap, ext = dram_for(block, 8, 4)
    store = make_store(shm_dir, cap, ext)
    ssd = SsdTier(os.path.join(root, "promo"), capacity=256 * MiB, file_bytes=256 * MiB,
                  direct="true")
    t = Tiering(store, ssd=ssd, policy=SpillPolicy.with_defaults(), io_threads=IO_THREADS)
    await t.start()
    src = ShmSlots(block, 8, fill=True)
    raw = ShmSlots(block, 1, fill=False)
    try:
        s = store.open_session(NS, block, MODEL, Peer(os.getpid(), 0, 0))
        nkeys = 32
        keys = [f"p{i:05d}".encode() for i in range(nkeys)]
        for i, k in enumerate(keys):
            ssd.write(NS, k, src[i], block, None, block, MHASH)
        ssd.sync()
        # a DRAM-resident key for the acquire floor
        res = await t.reserve(s, [b"resident"])
        with slot_view(store, s.ns, res.slots[0].segment_id, res.slots[0].offset, block) as v:
            stamp(v, src[0], 999)
        t.commit(s, res.reservation_id, [block], None)
        samples: dict[str, list[float]] = {"promote_acquire": [], "release_and_drop": [],
                                           "dram_acquire_release": [], "ssd_read_into": [],
                                           "raw_pread": []}
        rng = random.Random(3)

        async def promote(r: int) -> None:
            key = keys[r % nkeys]
            t0 = time.perf_counter()
            result, tiers = await t.acquire(s, [key])
            t1 = time.perf_counter()
            assert tiers == [TIER_SSD] and len(result.slots) == 1, (tiers, result)
            store.release(s, result.lease_id)
            store.delete(s, [key])  # drop the DRAM copy; the SSD copy stays
            t2 = time.perf_counter()
            if r >= warmup:
                samples["promote_acquire"].append(t1 - t0)
                samples["release_and_drop"].append(t2 - t1)

        async def dram(r: int) -> None:
            t0 = time.perf_counter()
            result, tiers = await t.acquire(s, [b"resident"])
            store.release(s, result.lease_id)
            t1 = time.perf_counter()
            assert tiers == [TIER_DRAM]
            if r >= warmup:
                samples["dram_acquire_release"].append(t1 - t0)

        async def read_into(r: int) -> None:
            entry = ssd.find(NS, keys[(r + 11) % nkeys], block, MHASH)
            assert entry is not None
            t0 = time.perf_counter()
            ssd.read_into(entry, raw[0])
            t1 = time.perf_counter()
            if r >= warmup:
                samples["ssd_read_into"].append(t1 - t0)

        async def pread(r: int) -> None:
            entry = ssd.find(NS, keys[(r + 21) % nkeys], block, MHASH)
            assert entry is not None
            t0 = time.perf_counter()
            _accel.pread_full(entry.file.fd, raw[0], entry.file.data_offset(entry.slot))
            t1 = time.perf_counter()
            if r >= warmup:
                samples["raw_pread"].append(t1 - t0)

        ops = [promote, dram, read_into, pread]
        for r in range(warmup + rounds):
            rng.shuffle(ops)  # no measurement always follows another
            for op in ops:
                await op(r)
        promos = t.counters.promotions["ssd"]
        assert promos == warmup + rounds, promos
        problems = t.check()
        assert problems == [], problems
    finally:
        src.close()
        raw.close()
        await t.stop()
        await store.drain()
        store.close_all()
        shutil.rmtree(os.path.join(root, "promo"), ignore_errors=True)
    stats = {k: {"p50_ms": pct(v, 50) * 1e3, "p99_ms": pct(v, 99) * 1e3,
                 "mean_ms": float(np.mean(v)) * 1e3, "n": len(v)} for k, v in samples.items()}
    return {"block_bytes": block, "rounds": rounds, "warmup": warmup, "stats": stats,
            "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()}}


def print_promotion(res: dict[str, Any]) -> None:
    st = res["stats"]
    base = st["raw_pread"]
    print(f"\n== 2. Promotion of one {format_bytes(res['block_bytes'], exact=True)} block, in-process "
          f"Tiering.acquire (no gRPC), {res['rounds']} rounds, the 4 measurements of a round "
          "in random order ==")
    print(f"{'what':<46} {'p50 ms':>8} {'p99 ms':>8} {'p50 x pread':>12} {'p99 x pread':>12}")
    names = {"promote_acquire": "acquire, block on SSD only (= promotion)",
             "dram_acquire_release": "acquire+release, block in DRAM (floor)",
             "ssd_read_into": "SsdTier.read_into (O_DIRECT read + xxh3)",
             "raw_pread": "bare O_DIRECT pread of 2 MiB (baseline)",
             "release_and_drop": "release + drop DRAM copy (not in promotion)"}
    for k in ("promote_acquire", "ssd_read_into", "raw_pread", "dram_acquire_release",
              "release_and_drop"):
        v = st[k]
        print(f"{names[k]:<46} {v['p50_ms']:>8.3f} {v['p99_ms']:>8.3f} "
              f"{v['p50_ms'] / base['p50_ms']:>11.2f}x {v['p99_ms'] / base['p99_ms']:>11.2f}x")


# ====================================================================== 3. workload
async def bench_workload(root: str, shm_dir: str, block: int, dram_slots: int, factor: int,
                         passes: int, ssd_capacity: int | None, seed: int) -> dict[str, Any]:
    """``ssd_capacity`` None: DRAM only.  SSD files are the default 1 GiB."""
    with_ssd = ssd_capacity is not None
    per_ext = 8
    cap, ext = dram_for(block, per_ext, dram_slots // per_ext)
    sub = os.path.join(shm_dir, f"workload-{ssd_capacity}")
    os.mkdir(sub)
    store = make_store(sub, cap, ext)
    ssd_dir = os.path.join(root, "workload")
    ssd = (SsdTier(ssd_dir, capacity=ssd_capacity, file_bytes=DEFAULT_FILE_BYTES,
                   direct="true") if ssd_capacity is not None else None)
    t = Tiering(store, ssd=ssd, policy=SpillPolicy.with_defaults(), io_threads=IO_THREADS)
    await t.start()
    base = ShmSlots(block, 1, fill=True)
    out_buf = ShmSlots(block, 1, fill=False)
    nkeys = dram_slots * factor
    keys = [f"w{i:06d}".encode() for i in range(nkeys)]
    expect = []
    for i in range(nkeys):
        tmp = bytearray(base[0])
        tmp[:8] = i.to_bytes(8, "little")
        expect.append(_accel.checksum(tmp))
    try:
        s = store.open_session(NS, block, MODEL, Peer(os.getpid(), 0, 0))

        async def put(batch: list[int]) -> None:
            ks = [keys[i] for i in batch]
            res = await t.reserve(s, ks)
            new = [i for i, st in zip(batch, res.statuses, strict=True)
                   if st == ReserveStatus.RESERVED]
            for i, g in zip(new, res.slots, strict=True):
                with slot_view(store, s.ns, g.segment_id, g.offset, block) as v:
                    stamp(v, base[0], i)
            if new:
                t.commit(s, res.reservation_id, [block] * len(new), None)

        with CpuMeter() as m_fill:
            t0 = time.perf_counter()
            batch = 4
            for i in range(0, nkeys, batch):
                await put(list(range(i, min(i + batch, nkeys))))
            fill_s = time.perf_counter() - t0
        for _ in range(500):  # let the demoter finish what it planned
            await asyncio.sleep(0.01)
            if not t.queue_depth() and not t.demoter.plan():
                break
        rng = random.Random(seed)
        hits = {TIER_DRAM: 0, TIER_SSD: 0}
        misses = 0
        lat_hit: list[float] = []
        lat_miss: list[float] = []
        bad = 0
        with CpuMeter() as m_read:
            t_read = time.perf_counter()
            for _pass in range(passes):
                order = list(range(nkeys))
                rng.shuffle(order)
                for i in order:
                    t0 = time.perf_counter()
                    result, tiers = await t.acquire(s, [keys[i]])
                    if result.slots:
                        g = result.slots[0]
                        with slot_view(store, s.ns, g.segment_id, g.offset, g.length) as v:
                            _accel.copy_into(out_buf[0], v)
                        store.release(s, result.lease_id)
                        t1 = time.perf_counter()
                        hits[tiers[0]] += 1
                        lat_hit.append(t1 - t0)
                        if _accel.checksum(out_buf[0]) != expect[i]:  # outside the latency
                            bad += 1
                    else:  # a miss: "recompute" = put the block again
                        await put([i])
                        t1 = time.perf_counter()
                        misses += 1
                        lat_miss.append(t1 - t0)
            read_s = time.perf_counter() - t_read
        requests = passes * nkeys
        n_hits = sum(hits.values())
        problems = t.check()
        assert problems == [], problems
        res: dict[str, Any] = {
            "with_ssd": with_ssd, "ssd_capacity": ssd_capacity,
            "ssd_files": ssd.stats()["files"] if ssd is not None else 0,
            "ssd_spill_failures": dict(t.counters.spill_failures), "block_bytes": block, "dram_slots": dram_slots,
            "dram_bytes": cap, "keys": nkeys, "working_set_bytes": nkeys * block,
            "passes": passes, "requests": requests,
            "fill_seconds": fill_s, "fill_gibps": nkeys * block / fill_s / GiB,
            "fill_other_cpu": m_fill.other,
            "hits_dram": hits[TIER_DRAM], "hits_ssd": hits[TIER_SSD], "misses": misses,
            "hit_ratio": n_hits / requests, "corrupt": bad,
            "read_seconds": read_s, "read_other_cpu": m_read.other,
            "served_gibps": n_hits * block / read_s / GiB,
            "requests_per_s": requests / read_s,
            "hit_p50_ms": pct(lat_hit, 50) * 1e3 if lat_hit else None,
            "hit_p99_ms": pct(lat_hit, 99) * 1e3 if lat_hit else None,
            "miss_p50_ms": pct(lat_miss, 50) * 1e3 if lat_miss else None,
            "promotions": dict(t.counters.promotions), "demotions": dict(t.counters.demotions),
            "backpressure_waits": t.counters.backpressure_waits,
            "dram_evictions": store.evictions,
        }
        return res
    finally:
        base.close()
        out_buf.close()
        await t.stop()
        await store.drain()
        store.close_all()
        shutil.rmtree(ssd_dir, ignore_errors=True)
        shutil.rmtree(sub, ignore_errors=True)


def workload_label(r: dict[str, Any]) -> str:
    if not r["with_ssd"]:
        return "DRAM only"
    return f"DRAM+SSD cap {r['ssd_capacity'] // GiB} GiB"


def print_workload(rows: list[dict[str, Any]]) -> None:
    r0 = rows[0]
    print(f"\n== 3. Working set {r0['keys'] // r0['dram_slots']}x DRAM: "
          f"{r0['keys']} x {format_bytes(r0['block_bytes'], exact=True)} through {r0['dram_slots']} DRAM slots "
          f"({r0['dram_slots'] * r0['block_bytes'] // MiB} MiB), {r0['passes']} random passes "
          f"of acquire + copy out + release ==")
    print(f"{'tiers':<21} {'fill GiB/s':>10} {'hit ratio':>9} {'DRAM':>6} {'SSD':>6} {'miss':>6} "
          f"{'served GiB/s':>12} {'req/s':>7} {'hit p50 ms':>10} {'hit p99 ms':>10} "
          f"{'miss p50 ms':>11} {'corrupt':>7} {'other CPU':>9}")
    for r in rows:
        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.3f}"
        print(f"{workload_label(r):<21} {r['fill_gibps']:>10.2f} "
              f"{r['hit_ratio'] * 100:>8.1f}% {r['hits_dram']:>6} {r['hits_ssd']:>6} "
              f"{r['misses']:>6} {r['served_gibps']:>12.2f} {r['requests_per_s']:>7.0f} "
              f"{f(r['hit_p50_ms']):>10} {f(r['hit_p99_ms']):>10} {f(r['miss_p50_ms']):>11} "
              f"{r['corrupt']:>7} {r['read_other_cpu'] * 100:>8.0f}%")
    for r in rows:
        if r["with_ssd"]:
            print(f"   {workload_label(r)}: {r['ssd_files']} spill files of 1 GiB created; "
                  f"demotions {r['demotions']}, failed spills {r['ssd_spill_failures'] or 0}")
    ssd = next((r for r in rows if r["with_ssd"] and r["ssd_capacity"] >= 16 * GiB), None)
    dram = next((r for r in rows if not r["with_ssd"]), None)
    if ssd and dram and dram["misses"]:
        extra = (ssd["read_seconds"] - dram["read_seconds"]) / dram["misses"]
        print(f"   Break-even: the SSD tier finishes the passes sooner whenever recomputing a "
              f"{format_bytes(ssd['block_bytes'], exact=True)} block costs more than {extra * 1e3:.2f} ms "
              f"(= extra read time with SSD / misses without)")
    print("   (DRAM only: a miss is re-put = reserve + 2 MiB copy + commit; the recompute "
          "itself, a prefill on the GPU, is not modeled)")


# ====================================================================== 4. re-adoption
def drop_caches() -> str | None:
    """Drop the page cache, dentries and inodes; None when it worked, else why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as exc:
        return str(exc)


def bench_adoption(root: str, counts: list[int], block: int, file_bytes: int) -> dict[str, Any]:
    tdir = os.path.join(root, "adopt")
    src = ShmSlots(block, 64, fill=True)
    pool = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="bench-io")
    rows = []
    try:
        written = 0
        for target in sorted(counts):
            tier = SsdTier(tdir, capacity=64 * GiB, file_bytes=file_bytes, direct="true")
            tier.open()
            assert tier.counters.adopted == written, (tier.counters.adopted, written)
            keys = [f"r{i:08d}".encode() for i in range(written, target)]
            log(f"re-adoption: writing {len(keys)} x {format_bytes(block, exact=True)} (to {target} blocks) ...")
            t0 = time.perf_counter()
            tier_write(tier, keys, src, block, pool)
            write_s = time.perf_counter() - t0
            written = target
            nfiles = tier.stats()["files"]
            tier.close()
            cold_err = drop_caches()
            t0 = time.perf_counter()
            cold = SsdTier(tdir, capacity=64 * GiB, file_bytes=file_bytes, direct="true")
            cold.open()
            cold_s = time.perf_counter() - t0
            assert cold.counters.adopted == target, (cold.counters.adopted, target)
            cold_adopt = cold.counters.adopt_seconds
            table_bytes = sum(f.layout.table_bytes for fs in cold.files.values() for f in fs)
            cold.close()
            t0 = time.perf_counter()
            warm = SsdTier(tdir, capacity=64 * GiB, file_bytes=file_bytes, direct="true")
            warm.open()
            warm_s = time.perf_counter() - t0
            assert warm.counters.adopted == target
            warm.close()
            rows.append({"blocks": target, "block_bytes": block, "files": nfiles,
                         "file_bytes": file_bytes, "table_bytes": table_bytes,
                         "write_seconds": write_s, "written_now": len(keys),
                         "write_blocks_per_s": len(keys) / write_s,
                         "cold_open_seconds": cold_s, "cold_adopt_seconds": cold_adopt,
                         "drop_caches": "ok" if cold_err is None else f"failed: {cold_err}",
                         "warm_open_seconds": warm_s})
            log(f"  {target} blocks: cold open {cold_s:.3f} s, warm {warm_s:.3f} s")
    finally:
        pool.shutdown()
        src.close()
        shutil.rmtree(tdir, ignore_errors=True)
    return {"rows": rows}


def print_adoption(res: dict[str, Any]) -> None:
    print("\n== 4. Re-adoption: a fresh SsdTier.open() of existing spill files ==")
    print(f"{'blocks':>8} {'block':>7} {'files':>5} {'tables MiB':>10} {'cold open s':>11} "
          f"{'warm open s':>11} {'drop_caches':>11} {'fill blocks/s':>13}")
    for r in res["rows"]:
        print(f"{r['blocks']:>8} {format_bytes(r['block_bytes'], exact=True):>7} {r['files']:>5} "
              f"{r['table_bytes'] / MiB:>10.1f} {r['cold_open_seconds']:>11.3f} "
              f"{r['warm_open_seconds']:>11.3f} {r['drop_caches'][:11]:>11} "
              f"{r['write_blocks_per_s']:>13.0f}")


# ====================================================================== targets / main
def targets(result: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """Judged on the daemon's shape (4 spill I/O threads); the 1-thread figure is shown too."""
    rows = []
    thr = result.get("throughput")
    if thr and str(2 * MiB) in thr["sizes"]:
        rr = thr["sizes"][str(2 * MiB)]["median_rep_ratio"]
        for op, what in (("write", "write, fresh files"), ("overwrite", "write, full tier"),
                         ("read", "read")):
            x1, x4 = rr[f"tier1_{op}"], rr[f"tier{IO_THREADS}_{op}"]
            rows.append((f"SSD tier {what}, 2 MiB, vs dd O_DIRECT", ">= 0.8x",
                         f"{x4:.2f}x ({IO_THREADS} thr; 1 thr {x1:.2f}x)", x4 >= 0.8))
    paired = result.get("paired")
    if paired and str(2 * MiB) in paired["sizes"]:
        r = paired["sizes"][str(2 * MiB)]["ratio"]
        rows.append(("SSD tier write (full tier), 2 MiB, paired vs dd O_DIRECT", ">= 0.8x",
                     f"{r['overwrite_vs_dd']:.2f}x (vs dd+fdatasync "
                     f"{r['overwrite_vs_dd_fdatasync']:.2f}x)", r["overwrite_vs_dd"] >= 0.8))
        rows.append(("SSD tier read, 2 MiB, paired vs dd O_DIRECT", ">= 0.8x",
                     f"{r['read_vs_dd']:.2f}x", r["read_vs_dd"] >= 0.8))
    promo = result.get("promotion")
    if promo:
        st = promo["stats"]["promote_acquire"]
        rows.append(("promotion of one 2 MiB block (report)", "-",
                     f"p50 {st['p50_ms']:.2f} ms, p99 {st['p99_ms']:.2f} ms", True))
    for w in result.get("workload", []):
        if w["with_ssd"]:
            rows.append((f"4x-DRAM working set hit ratio, {workload_label(w)}", "100%",
                         f"{w['hit_ratio'] * 100:.1f}% ({w['corrupt']} corrupt)",
                         w["hit_ratio"] == 1.0 and w["corrupt"] == 0))
    for r in (result.get("adoption") or {}).get("rows", []):
        if r["blocks"] >= 100_000:
            rows.append((f"re-adoption of {r['blocks']} blocks (cold)", "< 5 s",
                         f"{r['cold_open_seconds']:.2f} s", r["cold_open_seconds"] < 5.0))
    return rows


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default="/var/tmp",
                   help="where the temp directory goes (a disk filesystem; default /var/tmp)")
    p.add_argument("--sizes", default="512KiB,2MiB,8MiB", help="throughput block sizes")
    p.add_argument("--data", default="1GiB", help="bytes per throughput point (default 1GiB)")
    p.add_argument("--reps", type=int, default=5, help="repetitions per throughput point")
    p.add_argument("--promotions", type=int, default=300, help="timed promotions (>= 200)")
    p.add_argument("--passes", type=int, default=4, help="random read passes of the workload")
    p.add_argument("--adopt", default="10000,100000", help="block counts for re-adoption")
    p.add_argument("--adopt-block", default="16KiB")
    p.add_argument("--sections", default="throughput,paired,promotion,workload,adoption")
    p.add_argument("--rounds", type=int, default=24, help="rounds of the paired section")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--json", metavar="FILE", help="default bench/results/spill-<UTC>.json")
    args = p.parse_args(argv)
    sizes = [parse_size(x, "--sizes") for x in args.sizes.split(",")]
    data = parse_size(args.data, "--data")
    adopt = [int(x) for x in args.adopt.split(",")]
    adopt_block = parse_size(args.adopt_block, "--adopt-block")
    promotions, passes, reps = args.promotions, args.passes, args.reps
    if args.quick:
        data, reps, promotions, passes, adopt = 64 * MiB, 1, 20, 1, [500, 2000]
    sections = set(args.sections.split(","))
    now = datetime.datetime.now(datetime.UTC)
    json_path = args.json or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        f"spill-{now:%Y-%m-%d-%H%M}.json")

    root = tempfile.mkdtemp(prefix="kvt-bench-spill-", dir=args.dir)
    shm_dir = tempfile.mkdtemp(prefix="kvt-bench-spill-", dir="/dev/shm")
    fs = subprocess.run(["df", "--output=fstype,source", root], capture_output=True,
                        text=True).stdout.splitlines()[-1]
    result: dict[str, Any] = {
        "started_utc": now.isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "uptime_before": uptime(), "dir": root, "filesystem": fs.strip(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "kernel": platform.release(), "numpy": np.__version__,
                    "native": _accel.NATIVE},
    }
    log(f"spill bench in {root} ({fs.strip()}); {result['uptime_before']}")
    t_start = time.perf_counter()
    try:
        with sigterm_as_exit():
            if "throughput" in sections:
                result["throughput"] = bench_throughput(root, sizes, data, reps,
                                                        DEFAULT_FILE_BYTES)
            if "paired" in sections:
                result["paired"] = bench_paired(root, sizes, 4 if args.quick else args.rounds,
                                                DEFAULT_FILE_BYTES)
            if "promotion" in sections:
                log("promotion latency ...")
                result["promotion"] = asyncio.run(bench_promotion(
                    root, shm_dir, promotions, max(5, promotions // 10), 2 * MiB))
            if "workload" in sections:
                result["workload"] = []
                for cap in (16 * GiB, None, 1 * GiB):
                    log(f"workload, SSD capacity {cap} ...")
                    result["workload"].append(asyncio.run(bench_workload(
                        root, shm_dir, 2 * MiB, 32, 4, passes, cap, seed=7)))
            if "adoption" in sections:
                result["adoption"] = bench_adoption(root, adopt, adopt_block,
                                                    DEFAULT_FILE_BYTES)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    result["seconds"] = time.perf_counter() - t_start
    result["uptime_after"] = uptime()

    print(f"kvtier spill bench: {result['started_utc']}, {os.cpu_count()} CPUs, "
          f"Python {result['machine']['python']}, kernel {result['machine']['kernel']}, "
          f"native {'on' if _accel.NATIVE else 'off'}; dir {args.dir} ({fs.strip()}); "
          f"run took {result['seconds']:.0f} s")
    print(f"load before: {result['uptime_before']}")
    print(f"load after:  {result['uptime_after']}")
    if "throughput" in result:
        print_throughput(result["throughput"])
    if "paired" in result:
        print_paired(result["paired"])
    if "promotion" in result:
        print_promotion(result["promotion"])
    if result.get("workload"):
        print_workload(result["workload"])
    if "adoption" in result:
        print_adoption(result["adoption"])
    tg = targets(result)
    result["targets"] = [{"target": a, "goal": b, "measured": c, "met": d} for a, b, c, d in tg]
    print("\n== Targets ==")
    w = max((len(a) for a, *_ in tg), default=10)
    print(f"{'target':<{w}} {'goal':>8}  {'measured':<32} met")
    for a, b, c, d in tg:
        print(f"{a:<{w}} {b:>8}  {c:<32} {'yes' if d else 'NO'}")
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    write_json(json_path, result, indent=1)
    log(f"raw numbers: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
