"""Drain (the admin call): give every DRAM block without a durable copy below DRAM one.

A drain marks its blocks and the demoter copies them in its ordinary batches
(the same write-back path, off the loop, bounded by ``queue_depth`` and
``BATCH_BYTES``): the demoter asks ``candidates`` for them when it plans a
batch and ``settle``s each at the end of its demotion.  Blocks committed
after the drain began are not part of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterable
from typing import Final

import numpy as np
import numpy.typing as npt

from kvtier.errors import FailedPrecondition
from kvtierd.spill.tier import Geometry
from kvtierd.store import BlockBatch, Lower
from kvtierd.tiering.common import TICK, live_many, log
from kvtierd.tiering.context import Context

#: DRAM blocks a drain inspects per event-loop step while it collects its blocks.
DRAIN_COLLECT_CHUNK: Final = 4096
#: Entries of a drain's pending list one demoter plan may inspect (bounded work
#: per plan; settled entries leave the list, so the scan rarely gets this far).
DRAIN_SCAN_LIMIT: Final = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class DrainProgress:
    total_blocks: int
    done_blocks: int
    total_bytes: int
    done_bytes: int
    failed_blocks: int
    done: bool


@dataclasses.dataclass(eq=False, slots=True)
class _Part:
    """A batch of a drain's blocks (one namespace) and which of them are not settled."""

    blocks: BlockBatch
    open: npt.NDArray[np.bool_]
    left: int


@dataclasses.dataclass(eq=False)
class _Drain:
    """One drain: the DRAM blocks it still has to see copied (``pending``: batches, in
    the order they were collected, each with its unsettled blocks) and its tallies.

    A pending block settles exactly once (``settle``): done when it is CLEAN or
    gone from DRAM, failed when its copy failed (UNSPILLABLE).  ``copied``
    remembers the blocks the drain saw become CLEAN, for the final check that
    their copies are still there.
    """

    pending: list[_Part] = dataclasses.field(default_factory=list)
    copied: list[BlockBatch] = dataclasses.field(default_factory=list)
    total_blocks: int = 0
    total_bytes: int = 0
    done_blocks: int = 0
    done_bytes: int = 0
    failed_blocks: int = 0
    collecting: bool = True  # still choosing its blocks (totals may grow)
    finished: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def add(self, blocks: BlockBatch) -> None:
        if not len(blocks):
            return
        self.pending.append(_Part(blocks, np.ones(len(blocks), dtype=bool), len(blocks)))
        self.total_blocks += len(blocks)
        self.total_bytes += int(blocks.lengths.sum())

    @property
    def unsettled(self) -> int:
        return sum(p.left for p in self.pending)

    def settle(self, blocks: BlockBatch) -> None:
        """The blocks of ``blocks`` among the pending ones settle."""
        for part in self.pending:
            if part.blocks.ns is blocks.ns:
                hit = np.flatnonzero(part.open & part.blocks.same(blocks))
                if len(hit):
                    self.settle_at(part, hit, *live_many(part.blocks.take(hit)))
        self.pending = [p for p in self.pending if p.left]

    def settle_at(self, part: _Part, at: npt.NDArray[np.intp], ok: npt.NDArray[np.bool_],
                  rows: npt.NDArray[np.void]) -> None:
        """Settle ``part``'s open blocks at ``at`` (``ok``, ``rows``: ``live_many`` of
        them); ``pending`` keeps the part until the caller drops the empty ones."""
        part.open[at] = False
        part.left -= len(at)
        lengths = part.blocks.lengths[at]
        clean = ok & (rows["lower"] == Lower.CLEAN)
        done = ~ok | clean
        self.done_blocks += int(np.count_nonzero(done))  # gone from DRAM: nothing to lose
        self.done_bytes += int(lengths[done].sum())
        self.failed_blocks += len(at) - int(np.count_nonzero(done))
        if clean.any():
            self.copied.append(part.blocks.take(at[clean]))

    def progress(self) -> DrainProgress:
        return DrainProgress(self.total_blocks, self.done_blocks, self.total_bytes,
                             self.done_bytes, self.failed_blocks, self.finished.is_set())


class Drainer:
    """The running drain (at most one), and the demoter's view of it."""

    def __init__(self, ctx: Context, wake: asyncio.Event) -> None:
        """``wake``: the demoter's wake-up."""
        self._ctx = ctx
        self._wake = wake
        self._drain: _Drain | None = None

    async def drain(self, wait: float) -> DrainProgress:
        """Start a drain, or join the one running; answer after ``wait`` seconds or when
        it is done, with its progress.

        A drain gives every DRAM block without a durable copy below DRAM
        (DIRTY or UNSPILLABLE, and CLEAN ones whose SSD copy the SSD tier has
        since evicted when no shared tier could have taken it) a copy in the
        first tier below DRAM (the SSD tier, or without one the shared tier).  The demoter makes the
        copies, in its ordinary batches; blocks stay in DRAM, CLEAN.  A block
        whose copy fails counts as failed and the drain still finishes; so
        does a copied block the SSD tier evicted again before the drain ended
        (the tier is too small for DRAM).  Blocks committed after the drain
        began are not part of it.

        Raises: FailedPrecondition when this daemon has no tier below DRAM.
        """
        if not self._ctx.below.lower:
            raise FailedPrecondition("this daemon has no spill tier to drain DRAM to: set "
                                     "spill.ssd_dir (or spill.shared_dir)")
        d = self._drain
        if d is None or d.finished.is_set():
            d = self._drain = _Drain()
            self._ctx.work.spawn(self._run(d))
        if wait > 0 and not d.finished.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(d.finished.wait(), timeout=wait)
        return d.progress()

    def candidates(self, limit: int) -> list[BlockBatch]:
        """Up to ``limit`` blocks of the running drain to copy now (a batch per part of
        its pending list that has some); settles the ones that need nothing any more
        (CLEAN, or gone from DRAM).  Inspects ``DRAIN_SCAN_LIMIT`` pending blocks at most,
        a table read and an index search per part."""
        d = self._drain
        if d is None or d.finished.is_set() or limit <= 0:
            return []
        out: list[BlockBatch] = []
        taken = scanned = 0
        for part in d.pending:
            if scanned >= DRAIN_SCAN_LIMIT or taken >= limit:
                break
            at = np.flatnonzero(part.open)[: DRAIN_SCAN_LIMIT - scanned]
            seen = part.blocks.take(at)
            ok, rows = live_many(seen)
            done = ~ok | (rows["lower"] == Lower.CLEAN)
            want = ~done & ~self._ctx.moves.moving_many(seen.ns.name, seen.keys)
            # The scan stops right after the block that fills ``limit``.
            upto = np.cumsum(want)
            stop = (int(np.searchsorted(upto, limit - taken)) + 1
                    if len(upto) and upto[-1] >= limit - taken else len(at))
            scanned += stop
            settled = np.flatnonzero(done[:stop])
            if len(settled):
                d.settle_at(part, at[settled], ok[settled], rows[settled])
            chosen = np.flatnonzero(want[:stop])
            if len(chosen):
                out.append(seen.take(chosen))
                taken += len(chosen)
        d.pending = [p for p in d.pending if p.left]
        return out

    def settle(self, batches: Iterable[BlockBatch]) -> None:
        """The demotion of ``batches`` ended: each of the drain's blocks among them
        settles."""
        if self._drain is not None:
            for blocks in batches:
                self._drain.settle(blocks)

    async def _run(self, d: _Drain) -> None:
        try:
            below = self._ctx.below
            everything = [ns.visible() for ns in list(self._ctx.store.namespaces.values())]
            for blocks in everything:
                ns = blocks.ns
                for i in range(0, len(blocks), DRAIN_COLLECT_CHUNK):
                    self._collect(d, blocks.take(slice(i, i + DRAIN_COLLECT_CHUNK)),
                                  below.geometry(ns))
                    self._wake.set()
                    await asyncio.sleep(0)
            d.collecting = False
            log.info("drain: %d DRAM blocks (%d bytes) need a copy below DRAM",
                     d.total_blocks, d.total_bytes)
            while d.unsettled:
                self._wake.set()
                await self._ctx.moves.wait(TICK)
            await self._recheck(d)
            log.info("drain done: %d of %d blocks durable below DRAM, %d failed",
                     d.done_blocks, d.total_blocks, d.failed_blocks)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: log it; the blocks not settled count as failed below
            log.exception("drain failed")
        finally:
            # Whatever ended the drain, it ends done with every block settled one way:
            # done_blocks + failed_blocks == total_blocks.
            d.failed_blocks += d.unsettled
            d.pending.clear()
            d.copied = []
            d.collecting = False
            d.finished.set()

    def _collect(self, d: _Drain, blocks: BlockBatch, geometry: Geometry) -> None:
        """Add the live blocks of a chunk that need a copy below DRAM to ``d``: DIRTY and
        UNSPILLABLE ones, and CLEAN ones whose copy the first tier evicted since (when
        the tiers below may lose copies), which become DIRTY again."""
        ok, rows = live_many(blocks)
        keep = ok.copy()
        clean = np.flatnonzero(ok & (rows["lower"] == Lower.CLEAN))
        if len(clean):
            if not self._ctx.below.lossy:
                keep[clean] = False  # copies below are never evicted without a hand-off
            else:
                copies = self._ctx.below.local_copies(
                    blocks.ns.name, [blocks.keys[i] for i in clean.tolist()], geometry)
                has = np.array([c is not None for c in copies], dtype=bool)
                keep[clean[has]] = False
                self._ctx.store.set_lower_many(blocks.take(clean[~has]), Lower.DIRTY)
        d.add(blocks.take(keep))

    async def _recheck(self, d: _Drain) -> None:
        """Count as failed the copied blocks whose copy the demotion target (a local tier,
        which evicts) has evicted again meanwhile (and has not passed on below)."""
        below = self._ctx.below
        if not below.lower or not below.lower[0].local:
            return
        missing: list[BlockBatch] = []
        for blocks in d.copied:
            ok, _rows = live_many(blocks)
            live = blocks.take(ok)
            copies = below.local_copies(live.ns.name, live.keys, below.geometry(live.ns))
            gone = np.array([c is None for c in copies], dtype=bool)
            if gone.any():
                missing.append(live.take(gone))
        if missing and below.remote:
            remote = below.remote

            def anywhere(blocks: BlockBatch, geometry: Geometry) -> npt.NDArray[np.bool_]:
                out = np.zeros(len(blocks), dtype=bool)
                for i, key in enumerate(blocks.keys):
                    for t in remote:
                        with contextlib.suppress(OSError):  # cannot tell: no copy to count on
                            if t.present(blocks.ns.name, [key], geometry)[0]:
                                out[i] = True
                                break
                return out

            geometries = [below.geometry(b.ns) for b in missing]
            there = await self._ctx.work.run(
                lambda: [anywhere(b, g) for b, g in zip(missing, geometries, strict=True)])
            missing = [b.take(~found) for b, found in zip(missing, there, strict=True)]
        lost = 0
        for blocks in missing:
            ok, _rows = live_many(blocks)
            blocks = blocks.take(ok)
            if not len(blocks):
                continue
            lost += len(blocks)
            d.done_blocks -= len(blocks)
            d.done_bytes -= int(blocks.lengths.sum())
            d.failed_blocks += len(blocks)
            self._ctx.store.set_lower_many(blocks, Lower.DIRTY)
        if lost:
            log.warning("drain: the SSD tier evicted %d of the copies it made before the drain "
                        "ended (spill.ssd_capacity is smaller than what DRAM holds)", lost)
