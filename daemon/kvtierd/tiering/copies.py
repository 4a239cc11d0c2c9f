"""The copies between DRAM slots and the tiers below, on the worker threads.

A copy that finds the DRAM slot's memory faulted (a writer truncated its
namespace's data file or punched holes in it: ``spill.blockio.memory_fault``)
is the writer's loss, never a fault of a spill tier: it ends ``SLOT_FAULT``,
and ``lose`` drops the block from DRAM (as a delete does; its copies below
stay).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvtier.errors import Corrupted
from kvtierd.spill.blockio import fault_kind, memory_fault
from kvtierd.spill.ssd import SpillFull
from kvtierd.spill.tier import Geometry, LowerTier, WritesMany
from kvtierd.store import Block, Store
from kvtierd.tiering.below import Below
from kvtierd.tiering.common import Copy, Reporter, live

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
    def copy_down(self, block: Block, tier: LowerTier, op: str) -> bool | Copy:
        """Worker thread: copy one pinned DRAM block into ``tier`` (``op``: "demotion" or
        "publish"); True when the tier holds it now, False when the copy failed (counted
        as the tier's fault), SLOT_FAULT when the slot's memory faulted."""
        ns = block.ns
        geometry = self._below.geometry_off_loop(ns)
        t0 = time.perf_counter()
        view = block.extent.segment.data_view(block.slot, ns.slot_bytes)
        try:
            tier.write(ns.name, block.key, view, block.length, block.checksum, geometry)
        except (OSError, SpillFull) as exc:
            if memory_fault(exc):
                return Copy.SLOT_FAULT  # the writer's loss, not the tier's fault
            self._report.write_failed(tier, op, block, exc)
            return False
        finally:
            view.release()
        self._report.observer.spill_io(tier.name, "write", time.perf_counter() - t0,
                                       block.length)
        return True

    def copy_down_each(self, blocks: Sequence[Block], tier: LowerTier,
                       op: str) -> list[bool | Copy]:
        """Worker thread: ``copy_down`` of each block in turn (a demotion batch's share
        of one worker: one job, not one per block)."""
        return [self.copy_down(b, tier, op) for b in blocks]

    def copy_down_many(self, blocks: Sequence[Block], tier: LowerTier,
                       op: str) -> list[bool | Copy]:
        """Worker thread: ``copy_down`` of each pinned block, as one ``write_many`` per
        namespace; each block's outcome and fault counted as ``copy_down`` would (a
        batch that fails as a whole is a fault of each of its blocks)."""
        assert isinstance(tier, WritesMany)
        out: list[bool | Copy] = [False] * len(blocks)
        by_ns: dict[str, list[int]] = {}
        for i, b in enumerate(blocks):
            by_ns.setdefault(b.ns.name, []).append(i)
        for idx in by_ns.values():
            ns = blocks[idx[0]].ns
            geometry = self._below.geometry_off_loop(ns)
            views = [blocks[i].extent.segment.data_view(blocks[i].slot, ns.slot_bytes)
                     for i in idx]
            t0 = time.perf_counter()
            try:
                try:
                    got: list[bool | BaseException] = tier.write_many(
                        ns.name, [(blocks[i].key, v, blocks[i].length, blocks[i].checksum)
                                  for i, v in zip(idx, views, strict=True)], geometry)
                except OSError as exc:
                    got = [exc] * len(idx)
            finally:
                for v in views:
                    v.release()
            nbytes = 0
            for i, res in zip(idx, got, strict=True):
                if not isinstance(res, BaseException):
                    out[i] = res
                    nbytes += blocks[i].length
                elif memory_fault(res):
                    out[i] = Copy.SLOT_FAULT  # the writer's loss, not the tier's fault
                elif isinstance(res, (OSError, SpillFull)):
                    self._report.write_failed(tier, op, blocks[i], res)
                else:
                    raise res
            if nbytes:
                self._report.observer.spill_io(tier.name, "write",
                                               time.perf_counter() - t0, nbytes)
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
    def lose(self, block: Block, op: str) -> None:
        """A DRAM block whose slot faulted while ``op`` copied it: its bytes are gone (a
        writer truncated its namespace's data file or punched holes in it).  It leaves
        DRAM as by a delete -- a pinned or leased block is hidden now and freed at its
        last release, and the segment marks it doomed so a restart does not revive it
        -- while copies below DRAM stay (they hold the real bytes).  Counted once per
        block; a block gone meanwhile is left alone (event loop).

        (A store method would say it better: ``Store.drop_block(block)``, the
        per-block core of a delete that needs no session.)"""
        if not live(block):
            return
        ns = block.ns
        self._store.delete(self._store.system_session(ns), [block.key])
        self._report.slot_fault(ns.name, block.key, op)
