"""An acknowledged Delete stays deleted, in every tier, whatever was in flight.

Deterministic: a BlockIO holds the shared tier's rename (the moment a published file
appears) until the test lets it go, so the Delete runs exactly while a write-through
publish, or an SSD eviction's hand-off to the shared tier, is writing that key.
"""

from __future__ import annotations

import asyncio
import os
import threading

from kvtierd.spill.blockio import BlockIO
from kvtierd.tiering import SpillPolicy

from .spill_harness import keys, tiered

MiB = 1 << 20


class HeldRename(BlockIO):
    """Holds the first rename into ``root`` (a shared-tier publish) until ``release``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.entered = threading.Event()
        self.release = threading.Event()
        self.held: str | None = None
        self._lock = threading.Lock()

    def rename(self, src: str, dst: str) -> None:
        hold = False
        with self._lock:
            if dst.startswith(self.root) and self.held is None:
                self.held, hold = dst, True
        if hold:
            self.entered.set()
            assert self.release.wait(30), "the test never released the publish"
        super().rename(src, dst)


async def _wait(event: threading.Event) -> None:
    for _ in range(1000):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the publish never started")


def _shared_files(root: str) -> list[str]:
    return [f for _, _, fs in os.walk(root) for f in fs if ".tmp." not in f]


def test_a_delete_racing_a_write_through_publish_wins(shm_dir: str,
                                                      disk_dir: str) -> None:
    shared = os.path.join(disk_dir, "shared")
    io = HeldRename(shared)

    async def go() -> None:
        async with tiered(shm_dir, shared_dir=shared, io=io,
                          policy=SpillPolicy.with_defaults(shared_write="commit")) as env:
            s = env.session()
            k = keys(1)
            await env.put(s, k)  # committed: its publish starts and is held at the rename
            await _wait(io.entered)
            delete = asyncio.ensure_future(env.t.delete(s, k))
            await asyncio.sleep(0.2)
            assert not delete.done()  # it waits for the publish in flight
            io.release.set()
            assert await delete == 1
            await env.settle()
            assert _shared_files(shared) == []  # the published file went with the delete
            assert await env.t.lookup(s, k) == []

    try:
        asyncio.run(go())
    finally:
        io.release.set()  # a failed assertion must not leave the publish thread held


def test_a_delete_racing_an_ssd_to_shared_hand_off_wins(shm_dir: str,
                                                        disk_dir: str) -> None:
    shared = os.path.join(disk_dir, "shared")
    io = HeldRename(shared)

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=os.path.join(disk_dir, "ssd"), shared_dir=shared,
                          io=io, ssd_capacity=1 * MiB, file_bytes=1 * MiB,
                          policy=SpillPolicy.with_defaults(shared_write="demotion")) as env:
            s = env.session()
            ks = keys(60)
            writer = asyncio.ensure_future(env.put_all(s, ks))  # DRAM -> SSD -> shared
            await _wait(io.entered)
            assert io.held is not None
            held_key = bytes.fromhex(os.path.basename(io.held))
            delete = asyncio.ensure_future(env.t.delete(s, [held_key]))
            await asyncio.sleep(0.2)
            assert not delete.done()  # it waits for the hand-off in flight
            io.release.set()
            await delete
            await writer
            await env.settle()
            assert await env.t.lookup(s, [held_key]) == []
            assert not env.t.shared.exists(s.ns.name, held_key)  # type: ignore[union-attr]
            others = [k for k in ks if k != held_key]
            assert len(await env.t.lookup(s, others[:1])) == 1  # the rest is still there

    try:
        asyncio.run(go())
    finally:
        io.release.set()  # a failed assertion must not leave the publish thread held
