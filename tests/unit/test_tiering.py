"""Tiering over real segments and real spill files: demotion, promotion, faults.

Each test builds a small DRAM store (30 slots of 64 KiB) plus an SSD tier in a
temp directory on the root filesystem (ext4 here: O_DIRECT works) and/or a
shared tier, drives them on one event loop, and ends with ``check()`` of
both the store and the SSD tier.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest

from kvtier import _accel
from kvtierd.spill.blockio import BlockIO
from kvtierd.spill.shared import SharedTier
from kvtierd.spill.ssd import SsdTier
from kvtierd.store import Lower, ReserveStatus, Session
from kvtierd.tiering import TIER_DRAM, TIER_SHARED, TIER_SSD, SpillPolicy, Tiering

from .conftest import PEER, StoreEnv, make_store

KiB = 1 << 10
MiB = 1 << 20
BLOCK = 64 * KiB
DRAM = 2 * (MiB + 4 * 4096)  # two extents of 1 MiB: 30 slots (see test_store)


def keys(n: int, prefix: str = "k", start: int = 0) -> list[bytes]:
    return [f"{prefix}{i:05d}".encode() for i in range(start, start + n)]


def payload(key: bytes, tag: bytes = b"") -> bytes:
    length = 1 + (int.from_bytes(key, "little") * 7919) % BLOCK
    unit = key + b"|" + tag + b"#"
    return (unit * (length // len(unit) + 1))[:length]


@pytest.fixture
def disk_dir() -> Iterator[str]:
    """A temp directory on a disk filesystem (not tmpfs), removed afterwards."""
    path = tempfile.mkdtemp(prefix="kvt-spill-", dir="/var/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Env:
    def __init__(self, senv: StoreEnv, tiering: Tiering) -> None:
        self.senv = senv
        self.store = senv.store
        self.t = tiering

    def session(self, name: str = "A", model_uid: str = "m1") -> Session:
        return self.store.open_session(name, BLOCK, model_uid, PEER)

    async def put(self, s: Session, ks: Sequence[bytes], tag: bytes = b"") -> list[int]:
        res = await self.t.reserve(s, ks)
        new = [k for k, st in zip(ks, res.statuses, strict=True) if st == ReserveStatus.RESERVED]
        lengths = []
        for k, grant in zip(new, res.slots, strict=True):
            data = payload(k, tag)
            self.senv.write(grant, data)
            lengths.append(len(data))
        if new:
            self.t.commit(s, res.reservation_id, lengths, None)
        return list(res.statuses)

    async def get(self, s: Session, ks: Sequence[bytes]) -> tuple[list[bytes], list[int]]:
        result, tiers = await self.t.acquire(s, ks)
        out = [self.senv.read(g) for g in result.slots]
        if result.lease_id:
            self.store.release(s, result.lease_id)
        return out, tiers

    async def settle(self) -> None:
        """Let the demoter finish what it has planned."""
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not self.t.queue_depth() and not self.t._plan():
                return


@asynccontextmanager
async def tiered(shm_dir: str, *, ssd_dir: str | None = None, shared_dir: str | None = None,
                 ssd_capacity: int = 8 * MiB, file_bytes: int = 2 * MiB,
                 io: BlockIO | None = None, policy: SpillPolicy | None = None,
                 direct: str = "auto", check: bool = True) -> AsyncIterator[Env]:
    senv = make_store(shm_dir, capacity=DRAM, extent_size=MiB + 4 * 4096)
    ssd = (SsdTier(ssd_dir, capacity=ssd_capacity, file_bytes=file_bytes, io=io, direct=direct)
           if ssd_dir else None)
    shared = SharedTier(shared_dir, io=io) if shared_dir else None
    t = Tiering(senv.store, ssd=ssd, shared=shared,
                policy=policy or SpillPolicy(backpressure_timeout=5.0), io_threads=2)
    await t.start()
    env = Env(senv, t)
    try:
        yield env
        if check:
            await env.settle()
            assert t.check() == []
    finally:
        await t.stop()
        await senv.store.drain()
        senv.store.close_all()


# ================================================================ demotion and promotion
def test_working_set_four_times_dram_stays_reachable(shm_dir: str, disk_dir: str) -> None:
    """120 blocks through 30 DRAM slots: every one is read back byte-exact from some tier."""

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s = env.session()
            ks = keys(120)
            for i in range(0, 120, 6):
                assert await env.put(s, ks[i : i + 6]) == [ReserveStatus.RESERVED] * 6
            await env.settle()
            assert env.t.ssd is not None and env.t.ssd.stats()["blocks"] >= 90
            tiers = await env.t.lookup(s, ks)
            assert len(tiers) == 120 and TIER_SSD in tiers and TIER_DRAM in tiers
            for i in range(0, 120, 5):
                got, got_tiers = await env.get(s, ks[i : i + 5])
                assert got == [payload(k) for k in ks[i : i + 5]]
                assert len(got_tiers) == 5
            assert sum(env.t.counters.promotions.values()) >= 90
            assert sum(env.t.counters.demotions.values()) >= 90

    asyncio.run(go())


def test_reserve_of_a_spilled_key_is_exists(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s = env.session()
            ks = keys(60)
            for i in range(0, 60, 10):
                await env.put(s, ks[i : i + 10])
            await env.settle()
            on_ssd = [k for k in ks if k not in s.ns.index]
            assert on_ssd
            assert await env.put(s, on_ssd[:3]) == [ReserveStatus.EXISTS] * 3

    asyncio.run(go())


def test_without_spill_tiers_eviction_drops(shm_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir) as env:
            s = env.session()
            ks = keys(60)
            for i in range(0, 60, 10):
                await env.put(s, ks[i : i + 10])
            assert len(await env.t.lookup(s, ks)) == 0  # the oldest are gone
            assert not env.store.spill_enabled

    asyncio.run(go())


def test_prefetch_promotes_in_the_background(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s = env.session()
            ks = keys(60)
            for i in range(0, 60, 10):
                await env.put(s, ks[i : i + 10])
            await env.settle()
            first = ks[:5]
            assert all(k not in s.ns.index for k in first)
            tiers = await env.t.lookup(s, first, prefetch=True)
            assert tiers == [TIER_SSD] * 5
            for _ in range(100):
                await asyncio.sleep(0.01)
                if all(k in s.ns.index for k in first):
                    break
            assert all(s.ns.index[k].prefetched for k in first)
            got, got_tiers = await env.get(s, first)
            assert got == [payload(k) for k in first] and got_tiers == [TIER_DRAM] * 5
            assert env.t.counters.prefetch_hits == 5

    asyncio.run(go())


def test_delete_removes_every_tier_and_survives_restart(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s = env.session()
            ks = keys(60)
            for i in range(0, 60, 10):
                await env.put(s, ks[i : i + 10])
            await env.settle()
            victim = [k for k in ks if k not in s.ns.index][:4]
            assert await env.t.delete(s, victim) == 4
            assert await env.t.lookup(s, victim) == []
        async with tiered(shm_dir + "-2", ssd_dir=disk_dir) as env2:  # fresh DRAM, same SSD
            s2 = env2.session()
            assert await env2.t.lookup(s2, victim) == []
            rest = [k for k in ks[:30] if k not in victim][:3]
            got, tiers = await env2.get(s2, rest)
            assert got == [payload(k) for k in rest] and tiers == [TIER_SSD] * 3

    os.mkdir(shm_dir + "-2")
    try:
        asyncio.run(go())
    finally:
        shutil.rmtree(shm_dir + "-2", ignore_errors=True)
