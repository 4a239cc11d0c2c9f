"""The policy walks ``Tiering.lower`` (``spill.tier.Tier``), never which tiers it has.

A third implementation -- an in-memory stand-in for the cluster tier
(Mooncake Store), cross-host and not local -- is given to ``Tiering`` as
``below``: demotion, SSD eviction hand-offs, promotion, Delete and Evict all
reach it with no change to the policy.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from kvtier import _accel
from kvtierd.spill.ssd import SsdTier
from kvtierd.spill.tier import Geometry, HandOff, SharedAdapter, SsdAdapter, Tier
from kvtierd.tiering import TIER_DRAM, TIER_SSD, SpillPolicy, Tiering

from .conftest import make_store
from .spill_harness import DRAM, Env, MiB, disk_dir, keys, payload

__all__ = ["disk_dir"]  # a fixture

TIER_CLUSTER = 4  # not on the wire yet: the policy does not care


class DictTier:
    """A remote tier in a dict: what a cluster tier would look like to the policy."""

    tier = TIER_CLUSTER
    name = "cluster"
    local = False
    cross_host = True
    durable_writes = True

    def __init__(self) -> None:
        self.blocks: dict[tuple[str, bytes], tuple[bytes, int, Geometry]] = {}
        self.lock = threading.Lock()
        self.opened = self.closed = False

    def open(self) -> None:
        self.opened = True

    def close(self) -> None:
        self.closed = True

    def connect(self, *, on_fault: Callable[[str], None], hand_off: HandOff | None,
                on_lost: Callable[[str, bytes], None] | None) -> None:
        pass

    def held(self, namespace: str, key: bytes, geometry: Geometry | None) -> int | None:
        return None

    def contains(self, namespace: str, key: bytes) -> bool:
        with self.lock:
            return (namespace, key) in self.blocks

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

    def remove(self, namespace: str, keys: Sequence[bytes]) -> int:
        return 0

    def flush(self) -> None:
        pass

    def delete(self, namespace: str, keys: Sequence[bytes]) -> set[bytes]:
        with self.lock:
            return {k for k in keys if self.blocks.pop((namespace, k), None) is not None}

    def keys_of(self, namespace: str, geometry: Geometry | None) -> list[bytes]:
        return []

    def check(self) -> list[str]:
        return []


def test_the_adapters_and_a_third_tier_are_tiers() -> None:
    """Structural: mypy checks the adapters against the Protocol; this checks the fake."""
    tiers: list[Tier] = [DictTier()]
    assert tiers[0].tier == TIER_CLUSTER
    assert (SsdAdapter.local, SharedAdapter.local) == (True, False)


@asynccontextmanager
async def tiered(shm_dir: str, below: Sequence[Tier], *, ssd_dir: str | None = None,
                 ssd_capacity: int = 8 * MiB) -> AsyncIterator[Env]:
    senv = make_store(shm_dir, capacity=DRAM, extent_size=MiB + 4 * 4096)
    ssd = (SsdTier(ssd_dir, capacity=ssd_capacity, file_bytes=1 * MiB) if ssd_dir else None)
    t = Tiering(senv.store, ssd=ssd, below=below,
                policy=SpillPolicy(backpressure_timeout=5.0), io_threads=2)
    await t.start()
    env = Env(senv, t)
    try:
        yield env
        await env.settle()
        assert t.check() == []
    finally:
        await t.stop()
        await senv.store.drain()
        senv.store.close_all()


def test_a_cluster_tier_alone_takes_demotions_and_serves_promotions(shm_dir: str) -> None:
    cluster = DictTier()

    async def go() -> None:
        async with tiered(shm_dir, [cluster]) as env:
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
                                                        disk_dir: str) -> None:  # noqa: F811
    cluster = DictTier()

    async def go() -> None:
        async with tiered(shm_dir, [cluster], ssd_dir=os.path.join(disk_dir, "ssd"),
                          ssd_capacity=1 * MiB) as env:
            s = env.session()
            ks = keys(60)
            await env.put_all(s, ks)
            await env.settle()
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
