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

import numpy as np

from kvtier.errors import CapacityExhausted
from kvtierd.spill.blockio import fault_kind
from kvtierd.spill.ssd import SpillFull
from kvtierd.spill.tier import BlockCopy, Geometry, HandOff, LowerTier
from kvtierd.store import BlockBatch, Lower, NeedDemotion, ReserveResult, Session
from kvtierd.tiering.common import TICK, Copy, live_many, outcomes
from kvtierd.tiering.context import Context
from kvtierd.tiering.drain import Drainer

#: Bytes one demotion batch may carry before its fdatasync.
BATCH_BYTES: Final = 64 << 20
#: DRAM blocks per batch lookup below when marking them CLEAN after a restart.
MARK_CLEAN_BATCH: Final = 4096


class _Plan:
    """A demotion batch being planned: a batch per namespace, each block once, at most
    ``depth`` blocks and (about) ``BATCH_BYTES`` of slots."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.count = 0
        self._size = 0
        self._parts: dict[int, list[BlockBatch]] = {}

    def add(self, blocks: BlockBatch) -> None:
        """Add the blocks of ``blocks`` not planned yet, in order, while there is room."""
        if not len(blocks) or self.count >= self.depth or self._size >= BATCH_BYTES:
            return
        blocks = blocks.first_of_each()
        ns = blocks.ns
        prior = self._parts.setdefault(id(ns), [])
        if prior:
            blocks = blocks.take(~blocks.same(BlockBatch.concat(ns, prior)))
        room = min(self.depth - self.count, -(-(BATCH_BYTES - self._size) // ns.slot_bytes))
        blocks = blocks.take(slice(0, room))
        if len(blocks):
            prior.append(blocks)
            self.count += len(blocks)
            self._size += len(blocks) * ns.slot_bytes

    def batches(self) -> list[BlockBatch]:
        return [BlockBatch.concat(parts[0].ns, parts) for parts in self._parts.values() if parts]


class Demoter:
    """The demoter task, the back-pressure of reserves on it, and the tier chain's
    hand-offs."""

    def __init__(self, ctx: Context, drainer: Drainer, wake: asyncio.Event) -> None:
        """``wake``: set to start a plan now (a commit, a waiting reserve, a drain)."""
        self._ctx = ctx
        self._drainer = drainer
        self._wake = wake
        self._policy = ctx.below.policy
        self._urgent: list[BlockBatch] = []  # DIRTY blocks a waiting reserve needs demoted
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
            blocks = ns.visible()
            for at in range(0, len(blocks), MARK_CLEAN_BATCH):  # (a batch lookup each)
                chunk = blocks.take(slice(at, at + MARK_CLEAN_BATCH))
                copies = below.local_copies(ns.name, chunk.keys, geometry)
                there = np.fromiter((-1 if c is None else c[1] for c in copies),
                                    dtype=np.int64, count=len(chunk))
                same = there == chunk.lengths.astype(np.int64)
                if same.any():
                    self._ctx.store.set_lower_many(chunk.take(same), Lower.CLEAN)

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
                if len(need.blocks):
                    self._urgent.append(need.blocks)
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

    def plan(self) -> list[BlockBatch]:
        """Blocks to demote now, a batch per namespace: urgent reserves first, then the
        clean-ahead target, then a running drain's blocks."""
        plan = _Plan(self._policy.queue_depth)
        urgent, self._urgent = self._urgent, []
        by_ns: dict[int, list[BlockBatch]] = {}
        for blocks in urgent:
            by_ns.setdefault(id(blocks.ns), []).append(blocks)
        for group in by_ns.values():  # (retries repeat them: ``add`` takes each once)
            blocks = BlockBatch.concat(group[0].ns, group)
            ok, rows = live_many(blocks)
            plan.add(blocks.take(ok & (rows["pins"] == 0) & (rows["lower"] == Lower.DIRTY)))
        store = self._ctx.store
        target = int(self._policy.clean_ahead * store.capacity)
        free = store.dram_free()
        if free < target:
            for blocks in store.demotion_candidates(target - free, plan.depth):
                plan.add(blocks)
        for blocks in self._drainer.candidates(plan.depth - plan.count):
            plan.add(blocks)
        return plan.batches()

    async def _demote(self, batches: list[BlockBatch]) -> None:
        target = self._ctx.below.lower[0]
        counters = self._ctx.report.counters
        work = self._ctx.work
        try:
            with self._ctx.moves.demoting(batches):
                # One job per worker thread, each copying its contiguous share of a batch in
                # turn (a job per block cost the loop a future and a wake-up each).
                jobs = []
                for blocks in batches:
                    parts = min(work.threads, len(blocks))
                    step = -(-len(blocks) // parts)
                    jobs += [work.run(self._ctx.copier.copy_down_each,
                                      blocks.take(slice(at, at + step)), target, "demotion")
                             for at in range(0, len(blocks), step)]
                shares = iter(await asyncio.gather(*jobs))
                results = []
                for blocks in batches:
                    got: list[bool | Copy] = []
                    while len(got) < len(blocks):
                        got += next(shares)
                    results.append(got)
                synced = await self._sync(target)
                clean: list[BlockBatch] = []
                failed: list[BlockBatch] = []
                for blocks, got in zip(batches, results, strict=True):
                    fault, wrote = outcomes(got)
                    if fault.any():
                        self._ctx.copier.lose(blocks.take(fault), "demotion")
                    copied = wrote if synced else np.zeros(len(got), dtype=bool)
                    self._forget(blocks.take(wrote & ~copied))  # (not durable: undone)
                    failed.append(blocks.take(~fault & ~copied))
                    done = blocks.take(copied)
                    still, _rows = live_many(done)  # (one index search and table read)
                    self._forget(done.take(~still))  # deleted meanwhile: never resurrect it
                    clean.append(done.take(still))
                for blocks in clean:
                    if len(blocks):
                        self._ctx.store.set_lower_many(blocks, Lower.CLEAN)
                        counters.demotions[f"dram->{target.name}"] += len(blocks)
                for blocks in failed:
                    if len(blocks):
                        self._ctx.store.set_lower_many(blocks, Lower.UNSPILLABLE)
                        counters.spill_failures[target.name] += len(blocks)
                if self._forgotten:
                    self._forgotten = False
                    try:
                        await self._ctx.work.run(target.flush)
                    except OSError as exc:
                        self._ctx.report.fault(target.name, fault_kind(exc))
        finally:
            self._drainer.settle(batches)

    def _forget(self, blocks: BlockBatch) -> None:
        """Undo the copies of a batch's blocks in the demotion target (a local tier's
        removal reaches the disk at the next flush; a remote copy stays for the Delete
        that waits on this demotion to remove)."""
        if len(blocks) and self._ctx.below.lower[0].remove(blocks.ns.name, blocks.keys):
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
