"""Harness for the spill-tier tests: a small DRAM store plus spill tiers on one loop.

``tiered(...)`` builds a store of 30 DRAM slots of 64 KiB, an SSD tier in a
directory on a disk filesystem and/or a shared tier, starts ``Tiering`` and,
when the block ends, waits for the demoter and asserts ``check()`` of the
store and the SSD tier.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from kvtierd.spill.blockio import BlockIO
from kvtierd.spill.shared import SharedTier
from kvtierd.spill.ssd import SsdTier
from kvtierd.spill.tier import LowerTier
from kvtierd.store import ReserveStatus, Session
from kvtierd.tiering import SpillPolicy, Tiering

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

    async def put_all(self, s: Session, ks: Sequence[bytes], batch: int = 10) -> None:
        """``put`` a batch at a time (DRAM holds 30 blocks: more means spilling)."""
        for i in range(0, len(ks), batch):
            await self.put(s, ks[i : i + batch])

    async def spilled(self, n: int) -> tuple[Session, list[bytes]]:
        """A session of namespace A with ``keys(n)`` put through it (past DRAM's 30 slots:
        the oldest spill), the demoter settled."""
        s = self.session()
        ks = keys(n)
        await self.put_all(s, ks)
        await self.settle()
        return s, ks

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
            if not self.t.queue_depth() and not self.t.demoter.plan():
                return


@asynccontextmanager
async def tiered(shm_dir: str, *, ssd_dir: str | None = None, shared_dir: str | None = None,
                 ssd_capacity: int = 8 * MiB, file_bytes: int = 2 * MiB,
                 io: BlockIO | None = None, policy: SpillPolicy | None = None,
                 direct: str = "auto", check: bool = True,
                 below: Sequence[LowerTier] = ()) -> AsyncIterator[Env]:
    senv = make_store(shm_dir, capacity=DRAM, extent_size=MiB + 4 * 4096)
    ssd = (SsdTier(ssd_dir, capacity=ssd_capacity, file_bytes=file_bytes, io=io, direct=direct)
           if ssd_dir else None)
    shared = SharedTier(shared_dir, io=io) if shared_dir else None
    t = Tiering(senv.store, ssd=ssd, shared=shared, below=below,
                policy=policy or SpillPolicy.with_defaults(backpressure_timeout=5.0), io_threads=2)
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
