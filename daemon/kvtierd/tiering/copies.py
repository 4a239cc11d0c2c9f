"""The copies between DRAM slots and the tiers below, on the worker threads.

A copy that finds the DRAM slot's memory faulted (a writer truncated its
namespace's data file or punched holes in it: ``spill.blockio.memory_fault``)
is the writer's loss, never a fault of a spill tier: it ends ``SLOT_FAULT``,
and ``lose`` drops the block from DRAM (as a delete does; its copies below
stay).
"""

from __future__ import annotations

import time

from kvtier.errors import Corrupted
from kvtierd.spill.blockio import fault_kind, memory_fault
from kvtierd.spill.ssd import SpillFull
from kvtierd.spill.tier import Geometry, LowerTier, WritesMany
from kvtierd.store import BlockBatch, Store
from kvtierd.tiering.below import Below
from kvtierd.tiering.common import Copy, Reporter, live_many

#: What reading one block into a DRAM slot gives: (length, checksum), None (a miss or
#: a fault of the tier), or SLOT_FAULT.
ReadOutcome = tuple[int, int] | None | Copy


class Copier:
    """Copies blocks down from DRAM slots and up into them, counting what fails."""

    def __init__(self, store: Store, below: Below, report: Reporter) -> None:
        self._store = store
        self._below = below
        self._report = report

    # ---------------------------------------------------------------- down
    def copy_down(self, blocks: BlockBatch, i: int, tier: LowerTier, op: str) -> bool | Copy:
        """Worker thread: copy block ``i`` of a pinned batch into ``tier`` (``op``:
        "demotion" or "publish"); True when the tier holds it now, False when the copy
        failed (counted as the tier's fault), SLOT_FAULT when the slot's memory faulted."""
        return self._copy_down(blocks, i, tier, op, self._below.geometry_off_loop(blocks.ns))

    def _copy_down(self, blocks: BlockBatch, i: int, tier: LowerTier, op: str,
                   geometry: Geometry) -> bool | Copy:
        ns = blocks.ns
        ext, slot = blocks.place(i)
        key, length = blocks.keys[i], int(blocks.lengths[i])
        t0 = time.perf_counter()
        view = ext.segment.data_view(slot, ns.slot_bytes)
        try:
            tier.write(ns.name, key, view, length, blocks.checksum(i), geometry)
        except (OSError, SpillFull) as exc:
            if memory_fault(exc):
                return Copy.SLOT_FAULT  # the writer's loss, not the tier's fault
            self._report.write_failed(tier, op, ns.name, key, exc)
            return False
        finally:
            view.release()
        self._report.observer.spill_io(tier.name, "write", time.perf_counter() - t0, length)
        return True

    def copy_down_each(self, blocks: BlockBatch, tier: LowerTier,
                       op: str) -> list[bool | Copy]:
        """Worker thread: ``copy_down`` of each block of a batch in turn (a demotion
        batch's share of one worker: one job, not one per block)."""
        geometry = self._below.geometry_off_loop(blocks.ns)
        return [self._copy_down(blocks, i, tier, op, geometry) for i in range(len(blocks))]

    def copy_down_many(self, blocks: BlockBatch, tier: LowerTier,
                       op: str) -> list[bool | Copy]:
        """Worker thread: ``copy_down`` of each block of a pinned batch, as one
        ``write_many``; each block's outcome and fault counted as ``copy_down`` would (a
        batch that fails as a whole is a fault of each of its blocks)."""
        assert isinstance(tier, WritesMany)
        n = len(blocks)
        out: list[bool | Copy] = [False] * n
        if not n:
            return out
        ns = blocks.ns
        geometry = self._below.geometry_off_loop(ns)
        lengths = blocks.lengths.tolist()
        views = []
        for i in range(n):
            ext, slot = blocks.place(i)
            views.append(ext.segment.data_view(slot, ns.slot_bytes))
        t0 = time.perf_counter()
        try:
            try:
                got: list[bool | BaseException] = tier.write_many(
                    ns.name, blocks.keys, views, lengths, blocks.checksum_list(), geometry)
            except OSError as exc:
                got = [exc] * n
        finally:
            for v in views:
                v.release()
        nbytes = 0
        for i, res in enumerate(got):
            if not isinstance(res, BaseException):
                out[i] = res
                nbytes += lengths[i]
            elif memory_fault(res):
                out[i] = Copy.SLOT_FAULT  # the writer's loss, not the tier's fault
            elif isinstance(res, (OSError, SpillFull)):
                self._report.write_failed(tier, op, ns.name, blocks.keys[i], res)
            else:
                raise res
        if nbytes:
            self._report.observer.spill_io(tier.name, "write", time.perf_counter() - t0,
                                           nbytes)
        return out

    # ---------------------------------------------------------------- up
    def read_block(self, namespace: str, key: bytes, tier: LowerTier, dst: memoryview,
                   geometry: Geometry) -> ReadOutcome:
        """Worker thread: read one block into a DRAM slot; (length, checksum), None
        (a miss), or SLOT_FAULT (the slot's memory faulted: the copy below stays)."""
        t0 = time.perf_counter()
        try:
            length, checksum = tier.read_into(namespace, key, dst, geometry)
        except KeyError:
            return None  # evicted or deleted meanwhile: a miss
        except (Corrupted, OSError) as exc:
            if memory_fault(exc):
                return Copy.SLOT_FAULT  # the writer's loss, not the tier's fault
            self._report.fault(tier.name, fault_kind(exc))
            return None
        self._report.observer.spill_io(tier.name, "read", time.perf_counter() - t0, length)
        return length, checksum

    def read_blocks(self, namespace: str, tier: LowerTier, items: list[tuple[bytes, memoryview]],
                    geometry: Geometry) -> list[ReadOutcome]:
        """Worker thread: ``read_block`` for each of ``items``: a batched tier's in one
        ``read_many``, another tier's (always one block here) through ``read_block``."""
        if not tier.batched:
            return [self.read_block(namespace, key, tier, dst, geometry) for key, dst in items]
        t0 = time.perf_counter()
        try:
            results = tier.read_many(namespace, items, geometry)
        except OSError as exc:
            self._report.fault(tier.name, fault_kind(exc))
            return [None] * len(items)
        out: list[ReadOutcome] = []
        nbytes = 0
        for res in results:
            if isinstance(res, tuple):
                out.append(res)
                nbytes += res[0]
            elif isinstance(res, (Corrupted, OSError)):
                if memory_fault(res):
                    out.append(Copy.SLOT_FAULT)
                else:
                    self._report.fault(tier.name, fault_kind(res))
                    out.append(None)
            else:
                out.append(None)  # KeyError: a miss
        if nbytes:
            self._report.observer.spill_io(tier.name, "read", time.perf_counter() - t0, nbytes)
        return out

    # ---------------------------------------------------------------- a faulted slot
    def lose(self, blocks: BlockBatch, op: str) -> None:
        """DRAM blocks whose slots faulted while ``op`` copied them: their bytes are gone
        (a writer truncated its namespace's data file or punched holes in it).  They
        leave DRAM as by a delete -- a pinned or leased block is hidden now and freed at
        its last release, and the segment marks it doomed so a restart does not revive
        it -- while copies below DRAM stay (they hold the real bytes).  Counted once per
        block; a block gone meanwhile is left alone (event loop).

        (A store method would say it better: ``Store.drop_blocks(blocks)``, the core of a
        delete that needs no session.)"""
        ok, _rows = live_many(blocks)
        if not ok.any():
            return
        ns = blocks.ns
        gone = blocks.take(ok).keys
        self._store.delete(self._store.system_session(ns), gone)
        for key in gone:
            self._report.slot_fault(ns.name, key, op)
