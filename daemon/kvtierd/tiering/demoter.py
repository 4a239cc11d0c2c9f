"""Demotion (write-back), and the hand-offs between the tiers below DRAM.

When DRAM's free space falls under ``clean_ahead`` of its capacity, the
demoter copies the DIRTY blocks among the ``clean_ahead`` bytes CLOCK would
evict first to the first tier below DRAM (the SSD tier, or without one the
shared tier): straight from the shared-memory slot with O_DIRECT, a batch at
a time, then one ``fdatasync``; only then is each block marked CLEAN, and
only CLEAN blocks are evicted.  A tier that evicts (``LowerTier.local``) hands
what it evicts to the next tier.  The queue is bounded (``queue_depth``
blocks in flight); a reserve that finds only DIRTY victims waits for the
demoter (back-pressure, up to ``backpressure_timeout``) instead of dropping
data or buffering without bound.  A block whose spill fails (disk full, EIO)
becomes UNSPILLABLE and is evicted as without spill tiers: DRAM keeps
serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Final

from kvtier.errors import CapacityExhausted
from kvtierd.spill.blockio import fault_kind
from kvtierd.spill.ssd import SpillFull
from kvtierd.spill.tier import BlockCopy, Geometry, HandOff, LowerTier
from kvtierd.store import Block, Lower, NeedDemotion, ReserveResult, Session
from kvtierd.tiering.common import TICK, Copy, live_many
from kvtierd.tiering.context import Context
from kvtierd.tiering.drain import Drainer

#: Bytes one demotion batch may carry before its fdatasync.
BATCH_BYTES: Final = 64 << 20
#: DRAM blocks per batch lookup below when marking them CLEAN after a restart.
MARK_CLEAN_BATCH: Final = 4096


class Demoter:
    """The demoter task, the back-pressure of reserves on it, and the tier chain's
    hand-offs."""

    def __init__(self, ctx: Context, drainer: Drainer, wake: asyncio.Event) -> None:
        """``wake``: set to start a plan now (a commit, a waiting reserve, a drain)."""
        self._ctx = ctx
        self._drainer = drainer
        self._wake = wake
        self._policy = ctx.below.policy
        self._urgent: list[Block] = []  # DIRTY blocks a waiting reserve needs demoted
        self._forgotten = False  # copies the demoter removed below, not flushed yet
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        lower = ctx.below.lower
        for i, tier in enumerate(lower):
            self._connect(tier, lower[i + 1] if i + 1 < len(lower) else None)

    # ---------------------------------------------------------------- lifecycle
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the last tier's evictions are reported to (before it opens)."""
        self._loop = loop

    def start(self) -> None:
        """Mark what a local tier already holds CLEAN (after a restart) and start."""
        self._mark_clean_below()
        if self._ctx.below.lower:
            self._task = asyncio.get_running_loop().create_task(self._demote_forever(),
                                                                 name="kvtier-demoter")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _mark_clean_below(self) -> None:
        """After a restart, DRAM blocks that also have a copy a local tier knows are CLEAN."""
        below = self._ctx.below
        if not below.local:
            return
        for ns in self._ctx.store.namespaces.values():
            geometry = below.geometry(ns)
            blocks = list(ns.index.values())
            for at in range(0, len(blocks), MARK_CLEAN_BATCH):  # (a batch lookup each)
                chunk = blocks[at : at + MARK_CLEAN_BATCH]
                copies = below.local_copies(ns.name, [b.key for b in chunk], geometry)
                for block, copy in zip(chunk, copies, strict=True):
                    if copy is not None and copy[1] == block.length:
                        self._ctx.store.set_lower(block, Lower.CLEAN)

    # ---------------------------------------------------------------- back-pressure
    async def reserve(self, session: Session, keys: Sequence[bytes],
                      exists: Callable[[bytes], bool] | None) -> ReserveResult:
        """``Store.reserve``, waiting for demotion when only DIRTY blocks could make room.

        Raises: CapacityExhausted when demotion did not free enough blocks within
        ``spill.backpressure_timeout``; what ``Store.reserve`` raises.
        """
        deadline = time.monotonic() + self._policy.backpressure_timeout
        while True:
            try:
                return await self._ctx.store.reserve(session, keys, exists)
            except NeedDemotion as need:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CapacityExhausted(
                        f"DRAM is full for namespace {need.ns.name!r} and demotion to the "
                        f"spill tiers did not free {need.short} blocks within "
                        f"{self._policy.backpressure_timeout:g} s (spill.backpressure_timeout)"
                    ) from None
                self._ctx.report.counters.backpressure_waits += 1
                self._urgent.extend(need.blocks)
                self._wake.set()
                await self._ctx.moves.wait(min(left, 1.0))

    # ---------------------------------------------------------------- the demoter
    async def _demote_forever(self) -> None:
        while True:
            try:
                batch = self.plan()
                if batch:
                    await self._demote(batch)
                    continue
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(TICK):  # (no task per wait, as wait_for makes)
                        await self._wake.wait()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: log and count it, keep the daemon serving
                self._ctx.report.background_error("demotion")
                await asyncio.sleep(TICK)

    def plan(self) -> list[Block]:
        """Blocks to demote now: urgent reserves first, then the clean-ahead target, then
        a running drain's blocks."""
        depth = self._policy.queue_depth
        batch: list[Block] = []
        seen: set[Block] = set()

        def add(blocks: list[Block]) -> None:
            size = sum(b.ns.slot_bytes for b in batch)
            for b in blocks:
                if len(batch) >= depth or size >= BATCH_BYTES:
                    return
                if b not in seen:
                    seen.add(b)
                    batch.append(b)
                    size += b.ns.slot_bytes

        urgent, self._urgent = list(dict.fromkeys(self._urgent)), []  # (retries repeat them)
        if urgent:
            ok, rows = live_many(urgent)
            add([b for b, good, pins, lower in zip(urgent, ok, rows["pins"].tolist(),
                                                   rows["lower"].tolist(), strict=True)
                 if good and pins == 0 and lower == Lower.DIRTY])
        store = self._ctx.store
        target = int(self._policy.clean_ahead * store.capacity)
        free = store.dram_free()
        if free < target:
            add(store.demotion_candidates(target - free, depth))
        add(self._drainer.candidates(depth - len(batch)))
        return batch

    async def _demote(self, batch: list[Block]) -> None:
        target = self._ctx.below.lower[0]
        counters = self._ctx.report.counters
        work = self._ctx.work
        try:
            with self._ctx.moves.demoting(batch):
                # One job per worker thread, each copying its contiguous share in turn
                # (a job per block cost the loop a future and a wake-up each).
                parts = min(work.threads, len(batch))
                step = -(-len(batch) // parts)
                shares = await asyncio.gather(*(
                    work.run(self._ctx.copier.copy_down_each, batch[at:at + step], target,
                             "demotion")
                    for at in range(0, len(batch), step)))
                results = [res for share in shares for res in share]
                synced = await self._sync(target)
                copied: list[Block] = []
                failed: list[Block] = []
                for block, res in zip(batch, results, strict=True):
                    if res is Copy.SLOT_FAULT:
                        self._ctx.copier.lose(block, "demotion")
                    elif res and synced:
                        copied.append(block)
                    else:
                        if res:
                            self._forget(block)
                        failed.append(block)
                still, _rows = live_many(copied)  # (one index search and table read)
                clean = [b for b, ok in zip(copied, still, strict=True) if ok]
                for block, ok in zip(copied, still, strict=True):
                    if not ok:
                        self._forget(block)  # deleted meanwhile: never resurrect it
                if clean:
                    self._ctx.store.set_lower_many(clean, Lower.CLEAN)
                    counters.demotions[f"dram->{target.name}"] += len(clean)
                if failed:
                    self._ctx.store.set_lower_many(failed, Lower.UNSPILLABLE)
                    counters.spill_failures[target.name] += len(failed)
                if self._forgotten:
                    self._forgotten = False
                    try:
                        await self._ctx.work.run(target.flush)
                    except OSError as exc:
                        self._ctx.report.fault(target.name, fault_kind(exc))
        finally:
            self._drainer.settle(batch)

    def _forget(self, block: Block) -> None:
        """Undo a block's copy in the demotion target (a local tier's removal reaches
        the disk at the next flush; a remote copy stays for the Delete that waits on
        this demotion to remove)."""
        if self._ctx.below.lower[0].remove(block.ns.name, [block.key]):
            self._forgotten = True

    async def _sync(self, target: LowerTier) -> bool:
        if target.durable_writes:
            return True
        t0 = time.perf_counter()
        try:
            await self._ctx.work.run(target.sync)
        except OSError as exc:
            self._ctx.report.sync_failed(target, exc)
            return False
        self._ctx.report.observer.spill_io(target.name, "sync", time.perf_counter() - t0, 0)
        return True

    # ---------------------------------------------------------------- the tier chain
    def _connect(self, tier: LowerTier, nxt: LowerTier | None) -> None:
        """A tier's callbacks: its absorbed faults are counted; what it evicts goes to
        the next tier, or, from the last one, leaves the DRAM blocks that counted on it
        without a copy below."""
        hand_off: HandOff | None = None
        if nxt is not None and self._ctx.below.write_policy(nxt) in ("demotion", "commit"):
            target = nxt

            def pass_on(entry: BlockCopy, data: memoryview) -> None:  # an I/O thread
                self._hand_off(tier, target, entry, data)

            hand_off = pass_on
        tier.connect(on_fault=lambda kind: self._ctx.report.fault(tier.name, kind),
                     hand_off=hand_off, on_lost=self._lost_below if nxt is None else None)

    def _hand_off(self, tier: LowerTier, nxt: LowerTier, entry: BlockCopy, data: memoryview) -> None:
        """Eviction hook of ``tier`` (worker thread): pass the block on to ``nxt``.

        A key a Delete is removing is not handed on; a Delete that starts meanwhile waits
        for the hand-off (the movement table) and then removes what it wrote.
        """
        with self._ctx.moves.handing((entry.namespace, entry.key)) as started:
            if not started:
                return
            t0 = time.perf_counter()
            try:
                stored = nxt.write(entry.namespace, entry.key, data, entry.length,
                                   entry.checksum, Geometry(entry.block_bytes, entry.model_hash))
            except (OSError, SpillFull) as exc:
                self._ctx.report.fault(nxt.name,
                                   fault_kind(exc) if isinstance(exc, OSError) else "full")
                raise
        if stored:
            self._ctx.report.counters.demotions[f"{tier.name}->{nxt.name}"] += 1
            self._ctx.report.observer.spill_io(nxt.name, "write", time.perf_counter() - t0,
                                           entry.length)

    def _lost_below(self, namespace: str, key: bytes) -> None:
        """The last tier evicted a copy (any thread, its lock held: just schedule)."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody to tell
                self._loop.call_soon_threadsafe(self._evicted_below, namespace, key)

    def _evicted_below(self, namespace: str, key: bytes) -> None:
        """The last tier below DRAM evicted its copy of (namespace, key) to make room (its
        LRU, or the namespace's SSD quota).  A DRAM block that counted on it (CLEAN) now
        has no copy below: it becomes UNSPILLABLE, evictable like a block without spill
        tiers, and is not demoted again -- re-spilling it would evict another copy in
        turn, for ever, whenever the tier (or the quota) is smaller than what DRAM wants
        to keep clean."""
        ns = self._ctx.store.namespaces.get(namespace)
        block = ns.index.get(key) if ns is not None else None
        if block is not None and block.lower == Lower.CLEAN:
            self._ctx.store.set_lower(block, Lower.UNSPILLABLE)
