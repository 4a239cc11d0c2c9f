"""The write path's fixed costs: a commit of 1 and of 32 blocks through the
session page, in the store alone and through a daemon, for one or several source trees
in the same run (rounds alternate between trees, so a before / after pair sees the
same machine).

Per tree and round:

* ``store``: in-process, no daemon, no wire -- the page commits a writer's ring brings
  (``Store.commit_from_page``: the native take and check, the commit transition, the
  grant refill), the writer's half included (taking grants, writing records); 64 KiB
  blocks in a 256 MiB pool in steady state (every claim evicts), the writer asking for
  1 or 32 grants.  CPU microseconds per commit and per block, of the whole and of the
  daemon's half alone (the thread's CPU inside ``commit_from_page``).
* ``calls``: in-process, Reserve + Commit calls (``Store.reserve`` / ``Store.commit``)
  of 4096 keys of 4 KiB in a 64 MiB pool kept full (every claim evicts): the store's
  CPU per block on the call path, which puts larger than a page's grants take: the
  process's (the calls and the driver's making of the keys) and the thread's inside
  the two calls alone (``store_us_per_block``).
* ``daemon``: a kvtierd of that tree (fast path, writes without a call); an empty gRPC
  call (health Check, the baseline), then reserve + commit of 1 key back to back (p50,
  and its ratio to the empty call's p50), then puts of 32 x 64 KiB (blocks/s), all
  with the 512 MiB pool full (every claim evicts); the
  daemon's CPU per commit and per block from ``/proc/PID/stat`` (utime + stime).
* ``daemon_pinned``: ``daemon`` with the daemon's threads on the last CPU and the client
  on the others; ``daemon_busy``: the same with ``server.busy_poll`` on (``BUSY_POLL``),
  the loop polling instead of sleeping right after each commit and call (the deployment
  docs/deployment.md recommends for it).
* ``daemon4096``: a kvtierd of that tree with a 64 MiB pool kept full; puts of 4096 x
  4 KiB (Reserve + Commit calls on the session socket): blocks/s and the daemon's CPU
  per block.
* ``ssd32``: a kvtierd of that tree with 256 MiB of DRAM kept full and an SSD tier (as
  the default configuration has): puts of 32 x 64 KiB, each block demoted before its
  slot can be reused; blocks/s, the daemon's CPU per block, and MB/s against ``dd``
  (O_DIRECT, 64 KiB, one fdatasync) into the same directory just before.
* ``writers``: a kvtierd of that tree with its 512 MiB pool kept full; 1, then N writer
  processes (N = the machine's cores, at least 2) put 32 x 64 KiB each, started together
  through a barrier: the aggregate blocks/s of each, and N writers' against N times one
  (the daemon's CPU per block for each); before each, as many processes copying the
  same blocks into memory of their own (the machine's own scaling: memory bandwidth,
  shared cores), and kvtier's scaling against theirs.
* ``after``: a kvtierd of that tree as ``daemon`` (its pool full); 1-key reserve +
  commit on the fast path, each right after one of ``AFTER``: nothing (back to back),
  an empty gRPC call, a lookup (read from the shared index, no call) or a 1-key delete
  (a FastCall) of the key committed before: the commit's p50 alone, and the daemon's
  CPU per round.  What a round of ``kvtier bench`` does to the commit that follows.
* ``delete``: a kvtierd of that tree with an SSD tier (as the default configuration
  has); 1-key deletes of keys it holds in DRAM alone, then of keys with an SSD copy
  too (p50, its ratio to the empty gRPC call, the daemon's CPU per delete; for the
  second also its ratio to the disk's floor: a 4 KiB O_DIRECT write and an fdatasync).
  First the session channel's own floor: a FastCall the daemon answers without a
  handler (an unknown method), p50 and its ratio to the empty gRPC call.

Usage::

    .venv/bin/python bench/commit_path.py [--tree DIR ...] [--rounds N] [--modes M ...]
                                          [--json FILE]

``--tree`` defaults to this checkout; give an older checkout (a ``git worktree`` with
its native module built) first to compare.  Each measurement runs in a child process
with ``PYTHONPATH`` set to that tree's ``client`` and ``daemon``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tree_runs  # noqa: E402 -- bench/ is not a package

BLOCK = 64 << 10
#: The measurements, each in a child process (``--modes``).
MODES = ("store1", "store32", "calls4096", "daemon", "daemon_pinned", "daemon_busy",
         "daemon4096", "ssd32", "delete", "writers", "after")
#: What the ``after`` mode makes the client do before each 1-key reserve + commit.
AFTER = ("nothing", "empty_call", "lookup", "delete")
#: ``server.busy_poll`` of the ``daemon_busy`` mode.
BUSY_POLL = "2ms"
#: The kvtierd of the ``daemon``-like and ``writers`` modes: a 512 MiB pool that
#: ``_fill_pool`` fills (every claim then evicts).
POOL_SETTINGS = ("dram.capacity=512MiB", "dram.extent_size=64MiB",
                 "server.write_grant_bytes=64MiB")


def _p50(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


# ------------------------------------------------------------------ store, in-process
def _private_store(capacity: int, extent: int, **kwargs: Any) -> tuple[str, Any]:
    """A store of its own /dev/shm directory (returned, for the caller to remove), with
    no growth ahead (the fill is what is measured)."""
    from kvtierd.segments import Segment
    from kvtierd.store import Store, StoreOptions

    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="kvt-bench-cp-")

    def factory(ns: Any, index: int, layout: Any, seg_id: int) -> Segment:
        return Segment.create(shm, segment_id=seg_id, namespace=ns.name, model_uid=ns.model_uid,
                              index=index, layout=layout, boot_epoch=7, mlock=False,
                              prefault_threads=1)

    store = Store(capacity=capacity, extent_size=extent, extent_factory=factory,
                  lease_ttl=30.0, reservation_ttl=60.0, boot_epoch=7, publish=True,
                  options=StoreOptions(grow_ahead=False), **kwargs)
    return shm, store


def _store_mode(batch: int, seconds: float) -> dict[str, float]:
    import asyncio

    from kvtier import _native, _page
    from kvtier._index import LocalWrites
    from kvtierd.shared_index import SessionPage
    from kvtierd.store.types import Peer

    shm, store = _private_store(256 << 20, 64 << 20, grant_bytes=256 * BLOCK)
    store.attach_tiering(spill=False, commit_handles=False)  # as kvtierd without a write-through tier
    s = store.open_session("bench", BLOCK, "m", Peer(1, 0, 0))
    filled = 0

    async def fill(n: int) -> None:  # the pool's extents, made by Reserve calls
        nonlocal filled
        res = await store.reserve(s, [b"fill%09d" % (filled + i) for i in range(n)])
        filled += n
        if res.reservation_id:
            store.commit(s, res.reservation_id, [BLOCK] * len(res.statuses), None)
        await store.drain()

    for _ in range(5):
        asyncio.run(fill(1000))
    page = SessionPage("bench", writes=True)
    store.attach_page(s, page)
    bell = os.eventfd(0, os.EFD_NONBLOCK)
    writes = LocalWrites(page.mapping, bell)
    struct.pack_into("<Q", page.mapping, _page.W_WANT, batch)
    head = struct.unpack_from("<Q", page.mapping, _page.W_HEAD)[0]
    key = 0
    daemon_ns = 0  # the daemon's half alone: CPU in commit_from_page

    def one() -> None:
        nonlocal head, key
        got = writes.take(batch)
        while got is None:
            if store.refill_grants(s, 4 * batch) == -1:
                asyncio.run(fill(batch))
            got = writes.take(batch)
        records = [(g.entry, g.word, b"k%011d" % (key + i), BLOCK, None)
                   for i, g in enumerate(got)]
        key += batch
        head = _native.commits_put(page.mapping, head, records)
        nonlocal daemon_ns
        d0 = time.thread_time_ns()
        out = store.commit_from_page(s, page)
        daemon_ns += time.thread_time_ns() - d0
        assert out.committed == batch, out

    for _ in range(max(200, 4000 // batch)):  # warm: the pool full, claims evict
        one()
    n = 0
    daemon_ns = 0
    c0, t0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        one()
        n += 1
    cpu = time.process_time() - c0
    problems = store.check()
    writes.close()
    os.close(bell)
    store.close_session(s)
    page.close()
    store.close_all()
    shutil.rmtree(shm, ignore_errors=True)
    if problems:
        raise RuntimeError(f"check() after the run: {problems[:3]}")
    return {"commits": n, "us_per_commit": cpu / n * 1e6, "us_per_block": cpu / n / batch * 1e6,
            "daemon_us_per_commit": daemon_ns / n / 1e3,
            "daemon_us_per_block": daemon_ns / n / batch / 1e3}


def _calls_mode(batch: int, seconds: float, block: int = 4 << 10) -> dict[str, float]:
    """Reserve + Commit calls of ``batch`` keys of ``block`` bytes, in-process, in a
    64 MiB pool kept full (every claim evicts): the store's CPU per block (no wire, no
    writer: the calls alone)."""
    import asyncio

    from kvtierd.store.types import Peer

    shm, store = _private_store(64 << 20, 16 << 20)
    store.attach_tiering(spill=False, commit_handles=False)
    s = store.open_session("bench", block, "m", Peer(1, 0, 0))
    lengths = [block] * batch
    key = 0
    inside = 0  # the thread's CPU inside the two calls (the keys made outside them)

    async def put() -> None:
        nonlocal key, inside
        keys = [b"c%011d" % (key + i) for i in range(batch)]
        key += batch
        c0 = time.thread_time_ns()
        res = await store.reserve(s, keys)
        store.commit(s, res.reservation_id, lengths, None)
        inside += time.thread_time_ns() - c0

    async def run() -> tuple[int, float]:
        nonlocal inside
        for _ in range(3 * (64 << 20) // (block * batch)):  # filled, then every claim evicts
            await put()
        n, c0, t0, inside = 0, time.process_time(), time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            await put()
            n += 1
        return n, time.process_time() - c0

    n, cpu = asyncio.run(run())
    problems = store.check()
    store.close_session(s)
    store.close_all()
    shutil.rmtree(shm, ignore_errors=True)
    if problems:
        raise RuntimeError(f"check() after the run: {problems[:3]}")
    return {"puts": n, "us_per_block": cpu / n / batch * 1e6,
            "store_us_per_block": inside / n / batch / 1e3}


# ------------------------------------------------------------------ through a daemon
def _unix_round_trip_ms() -> float:
    """p50 ms of a raw round trip between two processes over a Unix socket pair
    (``ipc_round_trip_us``): the wake-ups any answer from the daemon costs on this
    machine, the floor of a call on the session socket or a ring of the doorbell."""
    from kvtier.bench.common import ipc_round_trip_us

    return ipc_round_trip_us(3000) / 1e3


def _fill_pool(c: Any) -> None:
    """Fill the ``POOL_SETTINGS`` pool through client ``c`` (its extents made, every
    claim then evicts)."""
    import numpy as np

    data = [np.zeros(BLOCK, np.uint8)] * 32
    for j in range(300):
        c.put([b"f%06d-%02d" % (j, b) for b in range(32)], data)


def _pin_apart(pid: int) -> None:
    """Every thread of process ``pid`` on the last CPU, this process on the others (what
    docs/deployment.md recommends for ``server.busy_poll``: a core of the daemon's own)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {cpus[-1]})
    os.sched_setaffinity(0, set(cpus[:-1]))


def _daemon_mode(seconds: float, *settings: str, pin: bool = False) -> dict[str, float]:
    import grpc
    import numpy as np
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    import kvtier
    from kvtier._core import grpc_options
    from kvtier.bench.private_daemon import private_daemon

    out: dict[str, float] = {"unix_rtt_p50_ms": _unix_round_trip_ms()}
    with private_daemon("cp", *POOL_SETTINGS, *settings) as daemon:
        if pin:
            _pin_apart(daemon.pid)
        channel = grpc.insecure_channel(f"unix://{daemon.grpc_path}", options=grpc_options())
        health = health_pb2_grpc.HealthStub(channel)
        req = health_pb2.HealthCheckRequest()
        with kvtier.Client(daemon.socket_dir, namespace="cp", block_bytes=BLOCK, model_uid="m") as c:
            _fill_pool(c)
            data = [np.zeros(BLOCK, np.uint8)] * 32
            for _ in range(200):
                health.Check(req, timeout=10)
            empty = []
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds / 4:
                a = time.perf_counter()
                health.Check(req, timeout=10)
                empty.append(time.perf_counter() - a)
            out["empty_call_p50_ms"] = _p50(empty) * 1e3
            # Reserve + commit of 1 key, back to back.
            lat: list[float] = []
            i = 0
            k0 = daemon.cpu_ticks()
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                a = time.perf_counter()
                with c.reserve([b"one%09d" % i]) as r:
                    r.write(0, b"x")
                    r.commit()
                lat.append(time.perf_counter() - a)
                i += 1
            ticks = daemon.cpu_ticks() - k0
            out["one_key_p50_ms"] = _p50(lat) * 1e3
            out["one_key_x_empty"] = out["one_key_p50_ms"] / out["empty_call_p50_ms"]
            out["one_key_x_rtt"] = out["one_key_p50_ms"] / out["unix_rtt_p50_ms"]
            out["one_key_daemon_cpu_us"] = ticks / os.sysconf("SC_CLK_TCK") / len(lat) * 1e6
            out["one_key_ticks"] = ticks
            # Puts of 32 x 64 KiB.
            n = 0
            k0 = daemon.cpu_ticks()
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                c.put([b"p%06d-%02d" % (n, b) for b in range(32)], data)
                n += 1
            el = time.perf_counter() - t0
            ticks = daemon.cpu_ticks() - k0
            out["put32_blocks_per_s"] = n * 32 / el
            out["put32_daemon_cpu_us_per_block"] = ticks / os.sysconf("SC_CLK_TCK") / (n * 32) * 1e6
            out["put32_ticks"] = ticks
        channel.close()
    return out


def _steady_puts(c: Any, daemon: Any, block: int, batch: int, fill_bytes: int,
                 seconds: float) -> tuple[int, float, int]:
    """Puts of ``batch`` new keys of ``block`` bytes through client ``c``: ``fill_bytes``
    of them first, then for ``seconds``; (blocks put, seconds taken, the daemon's CPU
    ticks) of the timed part."""
    import numpy as np

    data = [np.zeros(block, np.uint8)] * batch
    n = 0

    def put() -> None:
        nonlocal n
        c.put([b"q%07d-%04d" % (n, b) for b in range(batch)], data)
        n += 1

    for _ in range(fill_bytes // (block * batch)):
        put()
    n0, k0, t0 = n, daemon.cpu_ticks(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        put()
    return (n - n0) * batch, time.perf_counter() - t0, daemon.cpu_ticks() - k0


def _daemon4096_mode(seconds: float) -> dict[str, float]:
    """Puts of 4096 x 4 KiB through a kvtierd with a 64 MiB pool kept full (every claim
    evicts; the put goes by Reserve + Commit calls on the session socket, too large for
    a page's grants): blocks/s and the daemon's CPU per block (``/proc``)."""

    import kvtier
    from kvtier.bench.private_daemon import private_daemon

    block, batch = 4 << 10, 4096
    out: dict[str, float] = {}
    with private_daemon("cp4k", "dram.capacity=64MiB", "dram.extent_size=16MiB") as daemon, \
            kvtier.Client(daemon.socket_dir, namespace="cp4k", block_bytes=block,
                          model_uid="m") as c:
        # (filled three times over: every claim evicts)
        blocks, el, ticks = _steady_puts(c, daemon, block, batch, 3 * (64 << 20), seconds)
    out["put4096_blocks_per_s"] = blocks / el
    out["put4096_daemon_cpu_us_per_block"] = ticks / os.sysconf("SC_CLK_TCK") / blocks * 1e6
    out["put4096_ticks"] = ticks
    return out


def _dd_direct_mb_s(directory: str, block: int, nbytes: int) -> float:
    """``dd`` writing ``nbytes`` in blocks of ``block`` with O_DIRECT and one fdatasync at
    the end, into ``directory``: MB/s (the SSD tier's baseline in the same run)."""
    import subprocess

    path = os.path.join(directory, "dd.out")
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={block}",
                    f"count={nbytes // block}", "oflag=direct", "conv=fdatasync"],
                   check=True, capture_output=True)
    el = time.perf_counter() - t0
    os.unlink(path)
    return nbytes / el / 1e6


def _ssd32_mode(seconds: float) -> dict[str, float]:
    """Puts of 32 x 64 KiB into a kvtierd whose 256 MiB of DRAM is full, with an SSD tier
    (as the default configuration has): every block is demoted (written to the SSD tier
    and fdatasync'd by batch) before a claim can evict it.  Blocks/s, the daemon's CPU
    per block, and MB/s against ``dd`` with O_DIRECT (64 KiB, one fdatasync) into the
    same directory, measured just before."""

    import kvtier
    from kvtier.bench.private_daemon import private_daemon

    out: dict[str, float] = {}
    ssd = tempfile.mkdtemp(prefix="kvt-bench-ssd32-", dir="/var/tmp")
    try:
        out["dd_direct_mb_s"] = _dd_direct_mb_s(ssd, BLOCK, 512 << 20)
        with private_daemon("cps", "dram.capacity=256MiB", "dram.extent_size=64MiB",
                            f"spill.ssd_dir={ssd}", "spill.ssd_capacity=4GiB") as daemon, \
                kvtier.Client(daemon.socket_dir, namespace="cps", block_bytes=BLOCK,
                              model_uid="m") as c:
            # (filled twice over: every block demoted before its slot is reused)
            blocks, el, ticks = _steady_puts(c, daemon, BLOCK, 32, 2 * (256 << 20), seconds)
    finally:
        shutil.rmtree(ssd, ignore_errors=True)
    out["ssd32_blocks_per_s"] = blocks / el
    out["ssd32_mb_s"] = blocks * BLOCK / el / 1e6
    out["ssd32_x_dd"] = out["ssd32_mb_s"] / out["dd_direct_mb_s"]
    out["ssd32_daemon_cpu_us_per_block"] = ticks / os.sysconf("SC_CLK_TCK") / blocks * 1e6
    out["ssd32_ticks"] = ticks
    return out


def _disk_floor_ms(directory: str, n: int = 500) -> float:
    """p50 of what a durable delete of a block with an SSD copy cannot avoid: one 4 KiB
    table page written with O_DIRECT and one fdatasync, into ``directory``."""
    import mmap

    path = os.path.join(directory, "floor.probe")
    fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_DIRECT", 0), 0o600)
    buf = mmap.mmap(-1, 4096)
    try:
        os.ftruncate(fd, 64 * 4096)
        lat = []
        for i in range(n):
            a = time.perf_counter()
            os.pwrite(fd, buf, 4096 * (i % 64))
            os.fdatasync(fd)
            lat.append(time.perf_counter() - a)
    finally:
        buf.close()
        os.close(fd)
        os.unlink(path)
    return _p50(lat) * 1e3


def _delete_mode(seconds: float) -> dict[str, float]:
    """1-key deletes through a kvtierd with an SSD tier (as the default configuration
    has), nothing spilled ahead (``spill.clean_ahead=0``): first of keys it holds in DRAM
    alone, then, after a drain, of keys with a copy on the SSD too (the delete is
    durable before its answer: the freed table page and an fdatasync).  For each, p50,
    its ratio to the empty gRPC call, and the daemon's CPU per delete; for the second
    also its ratio to the disk's floor (a 4 KiB O_DIRECT page write and an fdatasync
    in the same directory, this round)."""
    import grpc
    import numpy as np
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    import kvtier
    from kvtier._core import grpc_options
    from kvtier.bench.private_daemon import private_daemon
    from kvtier.cli import run_drain

    out: dict[str, float] = {"unix_rtt_p50_ms": _unix_round_trip_ms()}
    ssd = tempfile.mkdtemp(prefix="kvt-bench-ssd-", dir="/var/tmp")
    try:
        with private_daemon("cpd", "dram.capacity=256MiB", f"spill.ssd_dir={ssd}",
                            "spill.ssd_capacity=256MiB", "spill.clean_ahead=0") as daemon:
            channel = grpc.insecure_channel(f"unix://{daemon.grpc_path}",
                                            options=grpc_options())
            health = health_pb2_grpc.HealthStub(channel)
            req = health_pb2.HealthCheckRequest()
            with kvtier.Client(daemon.socket_dir, namespace="cpd", block_bytes=4096,
                               model_uid="m") as c:
                data = [np.zeros(4096, np.uint8)] * 64
                keys = [b"d%09d" % i for i in range(64 * 400)]
                for j in range(0, len(keys), 64):
                    c.put(keys[j:j + 64], data)
                empty = []
                for _ in range(2000):
                    a = time.perf_counter()
                    health.Check(req, timeout=10)
                    empty.append(time.perf_counter() - a)
                out["empty_call_p50_ms"] = _p50(empty) * 1e3
                # The session channel's own floor: a FastCall the daemon answers with no
                # handler (an unknown method's error frame), the wake-ups and framing
                # every call on it pays.
                nop: list[float] = []
                for _ in range(2000):
                    a = time.perf_counter()
                    with contextlib.suppress(kvtier.errors.InvalidArgument):
                        c._link.call("NoSuchMethod", health_pb2.HealthCheckRequest(), 10)
                    nop.append(time.perf_counter() - a)
                out["noop_fastcall_p50_ms"] = _p50(nop) * 1e3
                out["noop_fastcall_x_empty"] = out["noop_fastcall_p50_ms"] / out["empty_call_p50_ms"]
                left = keys
                for case in ("delete", "delete_ssd"):
                    if case == "delete_ssd":  # every block left gets its SSD copy
                        assert run_drain(daemon.socket_dir, 120) == 0, "the drain failed"
                    lat: list[float] = []
                    k0 = daemon.cpu_ticks()
                    t0 = time.perf_counter()
                    for n, key in enumerate(left):
                        a = time.perf_counter()
                        c.delete([key])
                        lat.append(time.perf_counter() - a)
                        if a - t0 > seconds / 2 or (case == "delete" and n + 1 >= len(keys) // 2):
                            break
                    ticks = daemon.cpu_ticks() - k0
                    left = left[len(lat):]
                    out[f"{case}_p50_ms"] = _p50(lat) * 1e3
                    out[f"{case}_x_empty"] = out[f"{case}_p50_ms"] / out["empty_call_p50_ms"]
                    out[f"{case}_x_rtt"] = out[f"{case}_p50_ms"] / out["unix_rtt_p50_ms"]
                    out[f"{case}_daemon_cpu_us"] = ticks / os.sysconf("SC_CLK_TCK") / len(lat) * 1e6
                    out[f"{case}_ticks"] = ticks
            channel.close()
        out["disk_floor_p50_ms"] = _disk_floor_ms(ssd)
        out["delete_ssd_x_floor"] = out["delete_ssd_p50_ms"] / out["disk_floor_p50_ms"]
    finally:
        shutil.rmtree(ssd, ignore_errors=True)
    return out


def _after_mode(seconds: float) -> dict[str, float]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    import kvtier
    from kvtier._core import grpc_options
    from kvtier.bench.private_daemon import private_daemon

    out: dict[str, float] = {}
    with private_daemon("cpa", *POOL_SETTINGS) as daemon:
        channel = grpc.insecure_channel(f"unix://{daemon.grpc_path}", options=grpc_options())
        health = health_pb2_grpc.HealthStub(channel)
        req = health_pb2.HealthCheckRequest()
        with kvtier.Client(daemon.socket_dir, namespace="cp", block_bytes=BLOCK, model_uid="m") as c:
            _fill_pool(c)
            before = {"nothing": lambda key: None,
                      "empty_call": lambda key: health.Check(req, timeout=10),
                      "lookup": lambda key: c.lookup([key]),
                      "delete": lambda key: c.delete([key])}
            n = 0
            for what in AFTER:
                lat: list[float] = []
                k0 = daemon.cpu_ticks()
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    before[what](b"a%09d" % n)
                    n += 1
                    r = c.reserve([b"a%09d" % n])
                    a = time.perf_counter()
                    r.commit()
                    lat.append(time.perf_counter() - a)
                ticks = daemon.cpu_ticks() - k0
                out[f"commit_after_{what}_p50_us"] = _p50(lat) * 1e6
                out[f"round_after_{what}_daemon_cpu_us"] = (
                    ticks / os.sysconf("SC_CLK_TCK") / len(lat) * 1e6)
        channel.close()
    for what in AFTER[1:]:
        out[f"commit_after_{what}_x_nothing"] = (out[f"commit_after_{what}_p50_us"]
                                                 / out["commit_after_nothing_p50_us"])
    return out


def _writer(socket_dir: str | None, me: int, barrier: Any, seconds: float,
            results: Any) -> None:
    """One writer process of ``writers``: fill its share, meet the others at ``barrier``,
    then put 32 x 64 KiB for ``seconds``; (blocks, seconds) to ``results``.  Without
    ``socket_dir``, the baseline: the same 32 blocks copied into successive windows of a
    pre-faulted 256 MiB buffer of its own (no kvtier)."""
    import numpy as np

    import kvtier

    data = [np.zeros(BLOCK, np.uint8)] * 32
    stack = contextlib.ExitStack()
    if socket_dir is None:
        room = np.ones(256 << 20, np.uint8)  # pre-faulted
        windows = len(room) // (32 * BLOCK)

        def put(n: int) -> None:
            at = n % windows * 32 * BLOCK
            for b, src in enumerate(data):
                np.copyto(room[at + b * BLOCK:at + (b + 1) * BLOCK], src)
    else:
        c = stack.enter_context(kvtier.Client(socket_dir, namespace="cp", block_bytes=BLOCK,
                                              model_uid="m"))

        def put(n: int) -> None:
            c.put([b"w%d-%06d-%02d" % (me, n, b) for b in range(32)], data)
    with stack:
        n = 0
        for _ in range(40):  # warm: its grants and maps
            put(n)
            n += 1
        barrier.wait(timeout=120)
        n0, t0 = n, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            put(n)
            n += 1
        results.put(((n - n0) * 32, time.perf_counter() - t0))


def _writers_mode(seconds: float) -> dict[str, float]:
    """Aggregate puts of 32 x 64 KiB by 1 and by N writer processes into one kvtierd with
    its pool kept full (every claim evicts): blocks/s of each, the ratio of N writers to
    N x one, and the daemon's CPU per block; and the same for N processes that only copy
    the blocks into memory of their own (the machine's own scaling, the baseline)."""
    import multiprocessing as mp

    import kvtier
    from kvtier.bench.private_daemon import private_daemon

    most = max(2, os.cpu_count() or 1)
    out: dict[str, float] = {"writers": float(most)}
    ctx = mp.get_context("spawn")

    def run(socket_dir: str | None, n: int) -> tuple[float, int]:
        barrier, results = ctx.Barrier(n + 1), ctx.Queue()
        procs = [ctx.Process(target=_writer, args=(socket_dir, w, barrier, seconds, results))
                 for w in range(n)]
        for p in procs:
            p.start()
        barrier.wait(timeout=120)
        got = [results.get(timeout=seconds + 120) for _ in procs]
        for p in procs:
            p.join(30)
        return sum(b / el for b, el in got), sum(b for b, _ in got)

    with private_daemon("cp", *POOL_SETTINGS) as daemon:
        with kvtier.Client(daemon.socket_dir, namespace="cp", block_bytes=BLOCK,
                           model_uid="m") as c:
            _fill_pool(c)
        for n in (1, most):
            name = "writers1" if n == 1 else "writersN"
            out[f"copy{name[7:]}_blocks_per_s"], _ = run(None, n)
            k0 = daemon.cpu_ticks()
            out[f"{name}_blocks_per_s"], blocks = run(daemon.socket_dir, n)
            out[f"{name}_daemon_cpu_us_per_block"] = (
                (daemon.cpu_ticks() - k0) / os.sysconf("SC_CLK_TCK") / blocks * 1e6)
    out["writers_x_n_one"] = out["writersN_blocks_per_s"] / (most * out["writers1_blocks_per_s"])
    out["copy_x_n_one"] = out["copyN_blocks_per_s"] / (most * out["copy1_blocks_per_s"])
    out["writers_scaling_x_copy"] = out["writers_x_n_one"] / out["copy_x_n_one"]
    return out


# ------------------------------------------------------------------ the driver
def _daemon_rows(mode: str, title: str) -> list[tuple[str, str, str]]:
    """The summary's rows of a ``daemon``-like mode (label, mode, key)."""
    rows = [(f"{title}empty gRPC call p50 ms", mode, "empty_call_p50_ms")]
    if not title:
        rows.append(("raw Unix socket round trip p50 ms", mode, "unix_rtt_p50_ms"))
    lead = "  " if title else ""
    return rows + [
        (f"{lead}reserve+commit 1 key p50 ms", mode, "one_key_p50_ms"),
        ("  x empty call", mode, "one_key_x_empty"),
        ("  x a raw Unix round trip", mode, "one_key_x_rtt"),
        ("  daemon CPU us per commit", mode, "one_key_daemon_cpu_us"),
        (f"{lead}put 32 x 64 KiB, blocks/s", mode, "put32_blocks_per_s"),
        ("  daemon CPU us per block", mode, "put32_daemon_cpu_us_per_block")]


def _child(tree: Path, mode: str, seconds: float) -> dict[str, Any]:
    return tree_runs.run_child(__file__, tree, [mode, "--seconds", str(seconds)], timeout=600)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", type=Path,
                    help="a source tree to measure (repeatable; default: this checkout)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                    help="what to measure (default: all)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.child == "daemon":
            res = _daemon_mode(args.seconds)
        elif args.child == "daemon_pinned":
            res = _daemon_mode(args.seconds, pin=True)
        elif args.child == "daemon_busy":
            res = _daemon_mode(args.seconds, f"server.busy_poll={BUSY_POLL}", pin=True)
        elif args.child == "daemon4096":
            res = _daemon4096_mode(args.seconds)
        elif args.child == "ssd32":
            res = _ssd32_mode(args.seconds)
        elif args.child == "delete":
            res = _delete_mode(args.seconds)
        elif args.child == "writers":
            res = _writers_mode(args.seconds)
        elif args.child == "after":
            res = _after_mode(args.seconds)
        elif args.child.startswith("calls"):
            res = _calls_mode(int(args.child.removeprefix("calls")), args.seconds)
        else:
            res = _store_mode(int(args.child.removeprefix("store")), args.seconds)
        print(json.dumps(res))
        return 0
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    runs = tree_runs.rounds(trees, args.rounds, lambda t, _: {
        m: _child(t, m, args.seconds) for m in args.modes})
    print()
    cols = [("store, 1 key: CPU us/commit", "store1", "us_per_commit"),
            ("  the daemon's half (commit_from_page)", "store1", "daemon_us_per_commit"),
            ("store, 32 keys: CPU us/block", "store32", "us_per_block"),
            ("  the daemon's half (commit_from_page)", "store32", "daemon_us_per_block"),
            ("store, calls of 4096 x 4 KiB: CPU us/block", "calls4096", "us_per_block"),
            ("  inside the calls (no key making)", "calls4096", "store_us_per_block"),
            *_daemon_rows("daemon", ""),
            *_daemon_rows("daemon_pinned", "daemon on a CPU of its own: "),
            *_daemon_rows("daemon_busy", f"the same + busy_poll={BUSY_POLL}: "),
            ("put 4096 x 4 KiB, blocks/s", "daemon4096", "put4096_blocks_per_s"),
            ("  daemon CPU us per block", "daemon4096", "put4096_daemon_cpu_us_per_block"),
            ("SSD tier, DRAM full: put 32 x 64 KiB, blocks/s", "ssd32", "ssd32_blocks_per_s"),
            ("  MB/s x dd O_DIRECT 64 KiB", "ssd32", "ssd32_x_dd"),
            ("  dd O_DIRECT 64 KiB, MB/s", "ssd32", "dd_direct_mb_s"),
            ("  daemon CPU us per block", "ssd32", "ssd32_daemon_cpu_us_per_block"),
            ("1 writer: put 32 x 64 KiB, blocks/s", "writers", "writers1_blocks_per_s"),
            ("  daemon CPU us per block", "writers", "writers1_daemon_cpu_us_per_block"),
            ("N writers (N = cores, >= 2): blocks/s", "writers", "writersN_blocks_per_s"),
            ("  daemon CPU us per block", "writers", "writersN_daemon_cpu_us_per_block"),
            ("  x N x one writer", "writers", "writers_x_n_one"),
            ("the same, copies alone (no kvtier): 1 process, blocks/s", "writers",
             "copy1_blocks_per_s"),
            ("  N processes, blocks/s", "writers", "copyN_blocks_per_s"),
            ("  x N x one process", "writers", "copy_x_n_one"),
            ("kvtier's scaling x the copies' scaling", "writers", "writers_scaling_x_copy"),
            ("session channel floor: a FastCall with no handler p50 ms", "delete",
             "noop_fastcall_p50_ms"),
            ("  x empty call", "delete", "noop_fastcall_x_empty"),
            ("SSD tier on: delete 1 key p50 ms", "delete", "delete_p50_ms"),
            ("  x empty call", "delete", "delete_x_empty"),
            ("  x a raw Unix round trip", "delete", "delete_x_rtt"),
            ("  daemon CPU us per delete", "delete", "delete_daemon_cpu_us"),
            ("SSD tier on: delete 1 key with an SSD copy p50 ms", "delete", "delete_ssd_p50_ms"),
            ("  x empty call", "delete", "delete_ssd_x_empty"),
            ("  x the disk's page write + fdatasync", "delete", "delete_ssd_x_floor"),
            ("  daemon CPU us per delete", "delete", "delete_ssd_daemon_cpu_us"),
            *[row for what in AFTER for row in (
                (f"1-key commit right after {what.replace('_', ' ')}: p50 us", "after",
                 f"commit_after_{what}_p50_us"),
                ("  daemon CPU us per round", "after", f"round_after_{what}_daemon_cpu_us"))]]
    print("medians over rounds" + "".join(f" | {t.name}" for t in trees))
    for label, mode, key in cols:
        if mode not in args.modes:
            continue
        vals = [_p50([row[mode][key] for row in runs[str(t)]]) for t in trees]
        print(label + "".join(f" | {v:.3g}" for v in vals))
    if args.json:
        tree_runs.save_runs(args.json, trees, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
