"""A DRAM slot whose memory faults is the writer's loss, never the daemon's (invariant 8).

Writers hold read-write fds of their namespace's data file: they can cut it
short under the daemon.  Here a second fd really truncates the segment's data
file while the daemon has it mapped, and a demotion, a write-through publish
or a promotion then copies that slot: ``pread``/``pwrite`` fail with EFAULT,
and so do the native checksums and copies once the fault guard is installed
(``_accel.install_fault_guard()``, as kvtierd does at start; without it they
die of SIGBUS).  The properties: nothing is
counted as a spill tier's fault, the block is dropped from DRAM (demotion,
publish) or the promotion is a miss with the copy below kept, the slot fault
is counted, no exception escapes a worker thread, and ``check()`` stays clean.

Each test runs in a forked child: a regression that touches the faulted pages
from Python kills that child with SIGBUS, which fails the test instead of the
whole session.
"""

from __future__ import annotations

import asyncio
import os
import signal
import traceback
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import pytest

from kvtier import _accel
from kvtierd.spill.shared import SharedTier
from kvtierd.spill.ssd import SsdTier
from kvtierd.store import Lower, Namespace, ReserveStatus, Session
from kvtierd.tiering import TIER_DRAM, TIER_SHARED, TIER_SSD, SpillPolicy, Tiering

from .conftest import make_store
from .spill_harness import DRAM, Env, MiB, keys, payload

#: No background demotion: the tests demote with a drain, at the moment they choose.
QUIET = SpillPolicy.with_defaults(clean_ahead=0.0, backpressure_timeout=5.0)


# ================================================================ helpers
def isolated(body: Callable[[], None]) -> None:
    """Run ``body`` in a forked child; its exception or its death fails the test."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        code = 0
        try:
            body()
        except BaseException:  # noqa: BLE001 (reported to the parent)
            os.write(w, traceback.format_exc().encode()[-30000:])
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        report = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        pytest.fail(f"the test process died of {signal.Signals(os.WTERMSIG(status)).name}: "
                    "something touched the faulted slot's pages")
    assert os.WEXITSTATUS(status) == 0, report


class Recorder:
    """A TieringObserver that keeps what it is told."""

    def __init__(self) -> None:
        self.spill_faults: Counter[str] = Counter()
        self.slot_faults: Counter[str] = Counter()
        self.errors: list[str] = []

    def spill_io(self, tier: str, op: str, seconds: float, nbytes: int) -> None:
        pass

    def spill_fault(self, tier: str, kind: str) -> None:
        self.spill_faults[f"{tier}/{kind}"] += 1

    def background_error(self, task: str) -> None:
        self.errors.append(task)

    def slot_fault(self, namespace: str) -> None:
        self.slot_faults[namespace] += 1


@asynccontextmanager
async def tiered(shm_dir: str, *, ssd_dir: str | None = None, shared_dir: str | None = None,
                 policy: SpillPolicy = QUIET) -> AsyncIterator[tuple[Env, Recorder]]:
    """``spill_harness.tiered`` with a recording observer."""
    senv = make_store(shm_dir, capacity=DRAM, extent_size=MiB + 4 * 4096)
    ssd = SsdTier(ssd_dir, capacity=8 * MiB, file_bytes=2 * MiB) if ssd_dir else None
    shared = SharedTier(shared_dir) if shared_dir else None
    rec = Recorder()
    t = Tiering(senv.store, ssd=ssd, shared=shared, policy=policy, io_threads=2,
                observer=rec)
    await t.start()
    env = Env(senv, t)
    try:
        yield env, rec
        await env.settle()
        assert t.check() == []
        assert rec.errors == []  # nothing escaped a worker thread
    finally:
        await t.stop()
        await senv.store.drain()
        senv.store.close_all()


async def put(env: Env, s: Session, ks: Sequence[bytes], *, checksums: bool,
              before_commit: Callable[[], object] | None = None) -> None:
    """Write and commit ``ks`` (with their checksums, or leaving them to the daemon)."""
    res = await env.t.reserve(s, ks)
    assert res.statuses == [ReserveStatus.RESERVED] * len(ks)
    data = [payload(k) for k in ks]
    for grant, d in zip(res.slots, data, strict=True):
        env.senv.write(grant, d)
    if before_commit is not None:
        before_commit()
    env.t.commit(s, res.reservation_id, [len(d) for d in data],
                 [_accel.checksum(d) for d in data] if checksums else None)


def cut(ns: Namespace) -> list[tuple[str, int]]:
    """Truncate every data file of ``ns`` to nothing through a second fd, as a writer
    can; returns (path, size) of each for ``restore``."""
    done = []
    for ext in ns.extents:
        fd = os.open(ext.segment.path, os.O_RDWR)
        try:
            done.append((ext.segment.path, os.fstat(fd).st_size))
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)
    return done


def restore(cuts: list[tuple[str, int]]) -> None:
    """Give the files their size back (what the daemon's audit does): zeros, no faults."""
    for path, size in cuts:
        os.truncate(path, size)


# ================================================================ demotion
def _demote_faulted(shm_dir: str, disk_dir: str, *, checksums: bool,
                    to_shared: bool) -> None:
    ks = keys(5)
    where = {"shared_dir": os.path.join(disk_dir, "shared")} if to_shared else {
        "ssd_dir": os.path.join(disk_dir, "ssd")}

    async def go() -> None:
        async with tiered(shm_dir, **where) as (env, rec):
            s = env.session()
            await put(env, s, ks, checksums=checksums)
            cuts = cut(s.ns)
            p = await env.t.drain(20.0)
            assert p.done and p.total_blocks == 5 and p.failed_blocks == 0
            t = env.t
            assert all(k not in s.ns.index for k in ks)  # dropped from DRAM
            assert t.counters.slot_faults == Counter({"A": 5})
            assert rec.slot_faults == Counter({"A": 5})
            # The spill tier did nothing wrong: no fault, no failed spill, no copy made.
            assert t.counters.faults == Counter() and rec.spill_faults == Counter()
            assert not t.counters.spill_failures and not t.counters.demotions
            if to_shared:
                assert t.shared is not None
                assert not any(t.shared.exists("A", k) for k in ks)
            else:
                assert t.ssd is not None and t.ssd.stats()["blocks"] == 0
            assert await t.lookup(s, ks) == []
            restore(cuts)
            # The namespace keeps working: the slots are reused for new blocks.
            more = keys(5, "new")
            await put(env, s, more, checksums=True)
            got, tiers = await env.get(s, more)
            assert got == [payload(k) for k in more] and tiers == [TIER_DRAM] * 5

    asyncio.run(go())


def test_demotion_of_a_truncated_slot_drops_the_block_not_the_ssd(
        shm_dir: str, disk_dir: str) -> None:
    isolated(lambda: _demote_faulted(shm_dir, disk_dir, checksums=True, to_shared=False))


def test_demotion_of_a_truncated_slot_to_the_shared_tier_drops_the_block(
        shm_dir: str, disk_dir: str) -> None:
    isolated(lambda: _demote_faulted(shm_dir, disk_dir, checksums=True, to_shared=True))


def test_demotion_that_checksums_a_truncated_slot_drops_the_block(
        shm_dir: str, disk_dir: str) -> None:
    """No client checksum: the SSD tier checksums the slot itself, and that faults."""

    def body() -> None:
        _accel.install_fault_guard()  # as kvtierd does at start
        _demote_faulted(shm_dir, disk_dir, checksums=False, to_shared=False)

    isolated(body)


# ================================================================ write-through publish
def _publish_faulted(shm_dir: str, disk_dir: str, *, checksums: bool) -> None:
    shared = os.path.join(disk_dir, "shared")
    ks = keys(4)

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=os.path.join(disk_dir, "ssd"), shared_dir=shared,
                          policy=SpillPolicy.with_defaults(clean_ahead=0.0,
                                                           shared_write="commit")) as (
                              env, rec):
            s = env.session()
            cuts: list[tuple[str, int]] = []
            await put(env, s, ks, checksums=checksums,
                      before_commit=lambda: cuts.extend(cut(s.ns)))
            await env.settle()  # the publishes ran
            t = env.t
            assert all(k not in s.ns.index for k in ks)
            assert t.counters.slot_faults == Counter({"A": 4}) == rec.slot_faults
            assert t.counters.faults == Counter() and rec.spill_faults == Counter()
            assert not [f for _, _, fs in os.walk(shared) for f in fs]  # no file, no temp
            assert await t.lookup(s, ks) == []
            restore(cuts)

    asyncio.run(go())


def test_write_through_publish_of_a_truncated_slot_drops_the_block(
        shm_dir: str, disk_dir: str) -> None:
    isolated(lambda: _publish_faulted(shm_dir, disk_dir, checksums=True))


def test_write_through_publish_that_checksums_a_truncated_slot_drops_the_block(
        shm_dir: str, disk_dir: str) -> None:
    def body() -> None:
        _accel.install_fault_guard()  # as kvtierd does at start
        _publish_faulted(shm_dir, disk_dir, checksums=False)

    isolated(body)


# ================================================================ promotion
def _promote_into_faulted(shm_dir: str, disk_dir: str, *, from_shared: bool) -> None:
    ks = keys(5)
    where = {"shared_dir": os.path.join(disk_dir, "shared")} if from_shared else {
        "ssd_dir": os.path.join(disk_dir, "ssd")}
    tier = TIER_SHARED if from_shared else TIER_SSD

    async def go() -> None:
        async with tiered(shm_dir, **where) as (env, rec):
            s = env.session()
            t = env.t
            await put(env, s, ks, checksums=True)
            assert (await t.drain(20.0)).done_blocks == 5
            assert all(s.ns.index[k].lower == Lower.CLEAN for k in ks)
            await t.evict("A", ks, [TIER_DRAM])  # only the copies below are left
            assert await t.lookup(s, ks) == [tier] * 5
            cuts = cut(s.ns)  # every free slot a promotion can get is cut away
            got, tiers = await env.get(s, ks)
            assert got == [] and tiers == []  # a miss, not an error
            assert t.counters.slot_faults == Counter({"A": 5}) == rec.slot_faults
            assert t.counters.faults == Counter() and rec.spill_faults == Counter()
            assert not t.counters.promotions
            # The copies below are intact and still found.
            if from_shared:
                assert t.shared is not None and t.shared.counters.checksum_failures == 0
            else:
                assert t.ssd is not None and t.ssd.stats()["blocks"] == 5
                assert t.ssd.counters.checksum_failures == 0
            assert await t.lookup(s, ks) == [tier] * 5
            restore(cuts)
            got, tiers = await env.get(s, ks)
            assert got == [payload(k) for k in ks] and tiers == [tier] * 5

    asyncio.run(go())


def test_promotion_into_a_truncated_slot_is_a_miss_and_keeps_the_ssd_copy(
        shm_dir: str, disk_dir: str) -> None:
    isolated(lambda: _promote_into_faulted(shm_dir, disk_dir, from_shared=False))


def test_promotion_into_a_truncated_slot_is_a_miss_and_keeps_the_shared_file(
        shm_dir: str, disk_dir: str) -> None:
    isolated(lambda: _promote_into_faulted(shm_dir, disk_dir, from_shared=True))
