"""Drain (the admin call): give every DRAM block without a durable copy below DRAM one.

A drain marks its blocks and the demoter copies them in its ordinary batches
(the same write-back path, off the loop, bounded by ``queue_depth`` and
``BATCH_BYTES``): the demoter asks ``candidates`` for them when it plans a
batch and ``settle``s each at the end of its demotion.  Blocks committed
after the drain began are not part of it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
from collections.abc import Iterable
from typing import Final

from kvtier.errors import FailedPrecondition
from kvtierd.store import Block, Lower
from kvtierd.tiering.common import TICK, live, log
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


@dataclasses.dataclass(eq=False)
class _Drain:
    """One drain: the DRAM blocks it still has to see copied (``pending``) and its tallies.

    A pending block settles exactly once (``settle``): done when it is CLEAN or
    gone from DRAM, failed when its copy failed (UNSPILLABLE).  ``copied``
    remembers the blocks the drain saw become CLEAN, for the final check that
    their copies are still there.
    """

    pending: collections.OrderedDict[Block, None] = dataclasses.field(
        default_factory=collections.OrderedDict)
    copied: list[Block] = dataclasses.field(default_factory=list)
    total_blocks: int = 0
    total_bytes: int = 0
    done_blocks: int = 0
    done_bytes: int = 0
    failed_blocks: int = 0
    collecting: bool = True  # still choosing its blocks (totals may grow)
    finished: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def add(self, block: Block) -> None:
        self.pending[block] = None
        self.total_blocks += 1
        self.total_bytes += block.length

    def settle(self, block: Block) -> None:
        if block not in self.pending:
            return
        del self.pending[block]
        if not live(block):
            self.done_blocks += 1  # gone from DRAM: nothing left to lose
            self.done_bytes += block.length
        elif block.lower == Lower.CLEAN:
            self.done_blocks += 1
            self.done_bytes += block.length
            self.copied.append(block)
        else:
            self.failed_blocks += 1

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

    def candidates(self, limit: int) -> list[Block]:
        """Up to ``limit`` blocks of the running drain to copy now; settles the ones that
        need nothing any more (CLEAN, or gone from DRAM)."""
        d = self._drain
        if d is None or d.finished.is_set() or limit <= 0:
            return []
        out: list[Block] = []
        settled: list[Block] = []
        for scanned, b in enumerate(d.pending):
            if scanned >= DRAIN_SCAN_LIMIT or len(out) >= limit:
                break
            if not live(b) or b.lower == Lower.CLEAN:
                settled.append(b)
            elif not self._ctx.moves.moving(b.ns.name, b.key):
                out.append(b)
        for b in settled:
            d.settle(b)
        return out

    def settle(self, blocks: Iterable[Block]) -> None:
        """The demotion of ``blocks`` ended: each of the drain's settles."""
        if self._drain is not None:
            for b in blocks:
                self._drain.settle(b)

    async def _run(self, d: _Drain) -> None:
        try:
            blocks = list(itertools.chain.from_iterable(
                list(ns.index.values()) for ns in list(self._ctx.store.namespaces.values())))
            for i in range(0, len(blocks), DRAIN_COLLECT_CHUNK):
                for b in blocks[i : i + DRAIN_COLLECT_CHUNK]:
                    if not live(b):
                        continue
                    if b.lower == Lower.CLEAN:
                        if not self._ctx.below.lossy:
                            continue  # copies below are never evicted without a hand-off
                        if self._ctx.below.local_copy(b.ns.name, b.key,
                                                  self._ctx.below.geometry(b.ns)) is not None:
                            continue
                        self._ctx.store.set_lower(b, Lower.DIRTY)  # its copy was evicted
                    d.add(b)
                self._wake.set()
                await asyncio.sleep(0)
            d.collecting = False
            log.info("drain: %d DRAM blocks (%d bytes) need a copy below DRAM",
                     d.total_blocks, d.total_bytes)
            while d.pending:
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
            d.failed_blocks += len(d.pending)
            d.pending.clear()
            d.copied = []
            d.collecting = False
            d.finished.set()

    async def _recheck(self, d: _Drain) -> None:
        """Count as failed the copied blocks whose copy the demotion target (a local tier,
        which evicts) has evicted again meanwhile (and has not passed on below)."""
        below = self._ctx.below
        if not below.lower or not below.lower[0].local:
            return
        missing = [b for b in d.copied if live(b)
                   and below.local_copy(b.ns.name, b.key, below.geometry(b.ns)) is None]
        if missing and below.remote:
            remote = below.remote

            def anywhere(b: Block) -> bool:
                for t in remote:
                    with contextlib.suppress(OSError):  # cannot tell: not a copy to count on
                        if t.present(b.ns.name, [b.key], below.geometry(b.ns))[0]:
                            return True
                return False

            there = await self._ctx.work.run(lambda: [anywhere(b) for b in missing])
            missing = [b for b, ok in zip(missing, there, strict=True) if not ok]
        for b in missing:
            if not live(b):
                continue
            d.done_blocks -= 1
            d.done_bytes -= b.length
            d.failed_blocks += 1
            self._ctx.store.set_lower(b, Lower.DIRTY)
        if missing:
            log.warning("drain: the SSD tier evicted %d of the copies it made before the drain "
                        "ended (spill.ssd_capacity is smaller than what DRAM holds)",
                        len(missing))
