"""The policy walks ``Tiering.lower`` (``spill.tier.LowerTier``), never which tiers it has.

A third implementation -- an in-memory stand-in for the cluster tier
(Mooncake Store), cross-host and not local -- is given to ``Tiering`` as
``below``: demotion, SSD eviction hand-offs, promotion, Delete and Evict all
reach it with no change to the policy.  A ``batched`` tier is asked once per
lookup about the whole run of keys and reads a promotion's blocks in one
``read_many``; a tier that cannot answer is a miss and a counted fault.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence

from kvtier import _accel
from kvtierd.spill.tier import (
    TIER_CLUSTER,
    Geometry,
    HandOff,
    LowerTier,
    RemoteTier,
    SharedAdapter,
    SsdAdapter,
    WritesMany,
    _one_by_one,
)
from kvtierd.tiering import TIER_DRAM, TIER_SSD, SpillPolicy

from .spill_harness import MiB, keys, payload, tiered


class DictTier(RemoteTier):
    """A remote tier in a dict: what a cluster tier would look like to the policy."""

    tier = TIER_CLUSTER
    name = "cluster"
    local = False
    cross_host = True
    durable_writes = True

    def __init__(self, *, batched: bool = False) -> None:
        self.batched = batched
        self.blocks: dict[tuple[str, bytes], tuple[bytes, int, Geometry]] = {}
        self.lock = threading.Lock()
        self.opened = self.closed = False
        self.asked: list[int] = []  # keys per present() call
        self.read_batches: list[int] = []  # blocks per read_many() call
        self.down = False

    def open(self) -> None:
        self.opened = True

    def close(self) -> None:
        self.closed = True

    def connect(self, *, on_fault: Callable[[str], None], hand_off: HandOff | None,
                on_lost: Callable[[str, bytes], None] | None) -> None:
        pass

    def contains(self, namespace: str, key: bytes) -> bool:
        with self.lock:
            return (namespace, key) in self.blocks

    def present(self, namespace: str, keys: Sequence[bytes],
                geometry: Geometry | None) -> list[bool]:
        if self.down:
            raise ConnectionRefusedError("the master is down")
        self.asked.append(len(keys))
        return [self.contains(namespace, k) for k in keys]

    async def present_async(self, namespace: str, keys: Sequence[bytes],
                            geometry: Geometry | None) -> list[bool]:
        return self.present(namespace, keys, geometry)

    def read_many(self, namespace: str, items: Sequence[tuple[bytes, memoryview]],
                  geometry: Geometry) -> list[tuple[int, int] | BaseException]:
        self.read_batches.append(len(items))
        return _one_by_one(self, namespace, items, geometry)

    def read_into(self, namespace: str, key: bytes, dst: memoryview,
                  geometry: Geometry) -> tuple[int, int]:
        with self.lock:
            got = self.blocks.get((namespace, key))
        if got is None or got[2] != geometry:
            raise KeyError(key)
        data, checksum, _ = got
        _accel.copy_into(dst[: len(data)], data)
        return len(data), checksum

    def write(self, namespace: str, key: bytes, src: memoryview, length: int,
              checksum: int | None, geometry: Geometry) -> bool:
        data = bytearray(length)
        _accel.copy_into(data, src[:length])
        with self.lock:
            if (namespace, key) in self.blocks:
                return False
            self.blocks[(namespace, key)] = (
                bytes(data), checksum if checksum is not None else _accel.checksum(data),
                geometry)
        return True

    def sync(self) -> None:
        pass

    def delete(self, namespace: str, keys: Sequence[bytes],
               geometry: Geometry | None) -> set[bytes]:
        with self.lock:
            return {k for k in keys if self.blocks.pop((namespace, k), None) is not None}

    def check(self) -> list[str]:
        return []


def test_the_adapters_and_a_third_tier_are_tiers() -> None:
    """Structural: mypy checks the adapters against the Protocol; this checks the fake."""
    tiers: list[LowerTier] = [DictTier()]
    assert tiers[0].tier == TIER_CLUSTER
    assert (SsdAdapter.local, SharedAdapter.local) == (True, False)


class ManyTier(DictTier):
    """A cluster tier stand-in that takes batches of writes (``spill.tier.WritesMany``)."""

    def __init__(self) -> None:
        super().__init__(batched=True)
        self.write_batches: list[int] = []  # blocks per write_many() call
        self.fail_batch: OSError | None = None  # raised for a whole batch
        self.fail_keys: dict[bytes, OSError] = {}  # per block

    def write_many(self, namespace: str, keys: Sequence[bytes], srcs: Sequence[memoryview],
                   lengths: Sequence[int], checksums: Sequence[int | None],
                   geometry: Geometry) -> list[bool | BaseException]:
        self.write_batches.append(len(keys))
        if self.fail_batch is not None:
            raise self.fail_batch
        out: list[bool | BaseException] = []
        for key, src, length, checksum in zip(keys, srcs, lengths, checksums, strict=True):
            if key in self.fail_keys:
                out.append(self.fail_keys[key])
            else:
                out.append(self.write(namespace, key, src, length, checksum, geometry))
        return out


def test_a_cluster_tier_alone_takes_demotions_and_serves_promotions(shm_dir: str) -> None:
    cluster = DictTier()

    async def go() -> None:
        async with tiered(shm_dir, below=[cluster]) as env:
            assert cluster.opened
            s = env.session()
            ks = keys(90)  # three times DRAM
            await env.put_all(s, ks)
            await env.settle()
            assert env.t.counters.demotions["dram->cluster"] >= 60
            got, tiers = await env.get(s, ks[:10])
            assert got == [payload(k) for k in ks[:10]]
            assert tiers == [TIER_CLUSTER] * 10
            assert env.t.counters.promotions["cluster"] == 10
            # Delete and Evict reach it like any tier.
            gone = [k for k in ks[20:40] if k not in s.ns.index]
            assert await env.t.delete(s, gone[:5]) == 5
            assert not any(cluster.contains("A", k) for k in gone[:5])
            assert await env.t.lookup(s, gone[:1]) == []
            res = await env.t.evict("A", gone[5:10], [TIER_CLUSTER])
            assert res.dropped == {"cluster": 5}
            assert await env.t.lookup(s, gone[5:6]) == []
        assert cluster.closed

    asyncio.run(go())


def test_ssd_evictions_hand_off_to_a_cluster_tier_below(shm_dir: str,
                                                        disk_dir: str) -> None:
    cluster = DictTier()

    async def go() -> None:
        async with tiered(shm_dir, below=[cluster], ssd_dir=os.path.join(disk_dir, "ssd"),
                          ssd_capacity=1 * MiB, file_bytes=1 * MiB) as env:
            s, ks = await env.spilled(60)
            assert env.t.counters.demotions["ssd->cluster"] > 0
            assert env.t.counters.demotions["dram->ssd"] >= 30
            tiers = await env.t.lookup(s, ks)
            assert len(tiers) == 60  # every block is somewhere
            assert {TIER_DRAM, TIER_CLUSTER} <= set(tiers)
            oldest = ks[:5]
            got, where = await env.get(s, oldest)
            assert got == [payload(k) for k in oldest] and where == [TIER_CLUSTER] * 5
            # The SSD still answers first for what it holds.
            assert env.t.ssd is not None
            on_ssd = [k for k in ks if ("A", k) in env.t.ssd.index][-3:]
            assert len(on_ssd) == 3
            await env.t.evict("A", on_ssd, [TIER_DRAM])
            assert await env.t.lookup(s, on_ssd) == [TIER_SSD] * 3

    asyncio.run(go())


def test_a_batched_tier_is_asked_once_per_lookup_and_read_in_one_batch(shm_dir: str) -> None:
    batched, plain = DictTier(batched=True), DictTier()

    async def go() -> None:
        for cluster in (batched, plain):
            sub = os.path.join(shm_dir, "batched" if cluster.batched else "plain")
            os.makedirs(sub)
            async with tiered(sub, below=[cluster]) as env:
                s, ks = await env.spilled(90)
                below = [k for k in ks if k not in s.ns.index][:12]
                gap = [*below[:8], b"never written", *below[8:]]
                cluster.asked.clear()
                assert await env.t.lookup(s, gap) == [TIER_CLUSTER] * 8
                if cluster.batched:
                    assert cluster.asked == [len(gap)]  # one question for the whole run
                else:
                    assert cluster.asked == [1] * 9  # key by key, up to the first miss
                cluster.read_batches.clear()
                got, tiers = await env.get(s, below[:8])
                assert got == [payload(k) for k in below[:8]]
                assert tiers == [TIER_CLUSTER] * 8
                if cluster.batched:
                    assert cluster.read_batches == [8]
                else:
                    assert cluster.read_batches == []  # read_into, one per block

    asyncio.run(go())


def test_a_tier_that_cannot_answer_is_a_miss_and_a_counted_fault(shm_dir: str) -> None:
    cluster = DictTier(batched=True)

    async def go() -> None:
        async with tiered(shm_dir, below=[cluster]) as env:
            s, ks = await env.spilled(90)
            below = [k for k in ks if k not in s.ns.index][:4]
            cluster.down = True
            assert await env.t.lookup(s, below) == []
            got, _tiers = await env.get(s, below)
            assert got == []
            assert env.t.counters.faults["cluster/oserror"] >= 2
            cluster.down = False
            assert await env.t.lookup(s, below) == [TIER_CLUSTER] * 4

    asyncio.run(go())


def _write_through() -> SpillPolicy:
    return SpillPolicy.with_defaults(backpressure_timeout=5.0, cluster_write="commit")


def test_a_commit_is_published_to_a_batched_tier_in_one_write_many(shm_dir: str) -> None:
    """``cluster.write: commit``: a commit's blocks reach a ``WritesMany`` tier in one
    call (one Mooncake batch for the cluster tier), a plain tier's block by block."""
    many, plain = ManyTier(), DictTier(batched=True)
    assert isinstance(many, WritesMany) and not isinstance(plain, WritesMany)

    async def go() -> None:
        async with tiered(shm_dir, below=[many], policy=_write_through()) as env:
            s = env.session()
            ks = keys(20)
            await env.put_all(s, ks, batch=10)
            await env.settle()
            assert many.write_batches == [10, 10]
            assert all(many.contains("A", k) for k in ks)
            got, tiers = await env.get(s, ks[:3])
            assert got == [payload(k) for k in ks[:3]] and tiers == [TIER_DRAM] * 3
            assert env.t.counters.faults == Counter()

    asyncio.run(go())


def test_a_commit_larger_than_the_queue_depth_is_published_whole(shm_dir: str) -> None:
    """queue_depth bounds the blocks in flight; a commit that finds none in flight is
    published whole, in one batch (cut at queue_depth, a P/D consumer would wait for
    blocks that never come)."""
    many = ManyTier()
    policy = SpillPolicy.with_defaults(backpressure_timeout=5.0, cluster_write="commit",
                                       queue_depth=4)

    async def go() -> None:
        async with tiered(shm_dir, below=[many], policy=policy) as env:
            s = env.session()
            ks = keys(12)
            await env.put(s, ks)
            await env.settle()
            assert many.write_batches == [12]
            assert all(many.contains("A", k) for k in ks)
            assert env.t.counters.skipped_publishes == 0

    asyncio.run(go())


def test_a_failed_batch_publish_is_a_fault_of_each_block_and_they_stay_in_dram(
        shm_dir: str) -> None:
    many = ManyTier()

    async def go() -> None:
        async with tiered(shm_dir, below=[many], policy=_write_through()) as env:
            s = env.session()
            ks = keys(8)
            many.fail_batch = ConnectionRefusedError("the master is down")
            await env.put(s, ks)
            await env.settle()
            assert many.write_batches == [8]
            assert sum(v for k, v in env.t.counters.faults.items()
                       if k.startswith("cluster/")) == 8  # as 8 failed writes were
            assert not any(many.contains("A", k) for k in ks)
            got, tiers = await env.get(s, ks)
            assert got == [payload(k) for k in ks] and tiers == [TIER_DRAM] * 8
            # One block of the next batch fails on its own: only it is a fault.
            many.fail_batch = None
            ks2 = keys(6, prefix="j")
            many.fail_keys[ks2[2]] = OSError(errno.EIO, "Mooncake error -1")
            await env.put(s, ks2)
            await env.settle()
            assert [many.contains("A", k) for k in ks2] == [True, True, False, True, True, True]
            assert sum(v for k, v in env.t.counters.faults.items()
                       if k.startswith("cluster/")) == 9

    asyncio.run(go())


def test_a_slot_that_faulted_in_a_batch_publish_drops_only_that_block(shm_dir: str) -> None:
    many = ManyTier()

    async def go() -> None:
        async with tiered(shm_dir, below=[many], policy=_write_through()) as env:
            s = env.session()
            ks = keys(5)
            many.fail_keys[ks[1]] = OSError(errno.EFAULT, "the slot's memory faulted")
            await env.put(s, ks)
            await env.settle()
            assert env.t.counters.slot_faults == Counter({"A": 1})
            assert env.t.counters.faults == Counter()  # the writer's loss, not the tier's
            assert ks[1] not in s.ns.index
            assert [many.contains("A", k) for k in ks] == [True, False, True, True, True]

    asyncio.run(go())
