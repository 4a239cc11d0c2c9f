"""Recovery's side of the store: adopting a previous run's extents as ``recovery``
validated them, and ordering the adopted blocks once every extent is in."""


from __future__ import annotations

import itertools
import logging

import numpy as np

from kvtier.errors import (
    CapacityExhausted,
    FailedPrecondition,
)
from kvtierd.segments import (
    MAX_ACCESS_SEQ,
    Segment,
)
from kvtierd.store.base import _recommit, _Undo
from kvtierd.store.fast_path import FastPath
from kvtierd.store.types import AdoptedSlots, Block, Extent

log = logging.getLogger(__name__)


class Adoption(FastPath):
    """Adoption of a previous run's segments."""

    def check_adoptable(self, segment: Segment) -> None:
        """Raise unless a previous run's segment can be adopted now (the store is unchanged).

        ``CapacityExhausted`` when the budget cannot hold the extent,
        ``FailedPrecondition`` when its layout conflicts with the namespace's
        other extents or its extent number is taken.
        """
        lay = segment.layout
        if lay.file_bytes > self.budget_free:
            raise CapacityExhausted(
                f"extent needs {lay.file_bytes} bytes, {self.budget_free} left in dram.capacity"
            )
        ns = self.namespaces.get(segment.namespace)
        if ns is not None and (ns.block_bytes, ns.model_uid) != (lay.block_bytes, segment.model_uid):
            raise FailedPrecondition(
                f"extent {segment.index} of namespace {segment.namespace!r} has block_bytes="
                f"{lay.block_bytes} model_uid={segment.model_uid!r}, other extents have "
                f"block_bytes={ns.block_bytes} model_uid={ns.model_uid!r}"
            )
        if ns is not None and any(e.segment.index == segment.index for e in ns.extents):
            raise FailedPrecondition(f"extent {segment.index} of {segment.namespace!r} twice")

    def adopt_extent(self, segment: Segment, slots: AdoptedSlots) -> int:
        """Take over a segment of a previous run, as ``recovery`` validated it.

        ``slots`` holds what may become visible blocks (every field checked),
        the RESERVED slots (quarantined for the reservation TTL: a writer of
        the previous daemon may still be copying, then freed) and the free
        ones.  Returns the blocks recovered.  Raises like ``check_adoptable``
        (or when a slot-table write fails); the store is unchanged then.
        """
        self.check_adoptable(segment)
        lay = segment.layout
        ns = self.namespaces.get(segment.namespace)
        index: dict[bytes, Block] = ns.index if ns is not None else {}
        adopted, adopted_at = self._adopted, self._adopted_at
        # Plan: the newest copy of each key wins (the same key twice is never written
        # so; be safe).  Losers in this segment are freed, and so are adopted blocks of
        # other extents that a newer copy here beats.
        mine: dict[bytes, tuple[int, int, int | None, int]] = {}  # key -> slot, length, sum, last
        lose_here: list[int] = []
        beaten: list[Block] = []
        rows = zip(slots.keys, zip(slots.slots, slots.lengths, slots.checksums,
                                   slots.last_access, strict=True), strict=True)
        unique = (len(set(slots.keys)) == len(slots.keys)
                  and index.keys().isdisjoint(slots.keys))  # no key twice: the common case
        if not unique:
            for key, (slot, length, checksum, last) in rows:
                prev = mine.get(key)
                old = index.get(key) if prev is None else None
                if prev is not None or old is not None:
                    log.warning("namespace %r: key %s committed twice; keeping the newer copy",
                                segment.namespace, key.hex())
                if prev is not None:
                    if prev[3] >= last:
                        lose_here.append(slot)
                        continue
                    lose_here.append(prev[0])
                elif old is not None:
                    try:
                        old_last: float = adopted_at[adopted.index(old)]  # rare: linear is fine
                    except ValueError:
                        old_last = float("inf")  # not from a previous run: newer than any
                    if old_last >= last:
                        lose_here.append(slot)
                        continue
                    beaten.append(old)
                mine[key] = (slot, length, checksum, last)
        with _Undo() as undo:
            for slot in lose_here:
                undo.add(_recommit, segment, slot)
                segment.mark_free(slot)
            for old in beaten:
                undo.add(_recommit, old.extent.segment, old.slot)
                old.extent.segment.mark_free(old.slot)
        # Applied: nothing below can fail.
        if ns is None:
            # Published in bulk by finish_recovery, not key by key here.
            ns = self._new_namespace(segment.namespace, lay.block_bytes, segment.model_uid,
                                     lay.slot_bytes, publish=False)
        # pop() hands out the lowest slot first
        ext = Extent(segment, sorted([*slots.free, *lose_here], reverse=True),
                     list(slots.generations))
        deadline = self._clock() + self.reservation_ttl
        for slot in slots.reserved:
            ext.quarantine[slot] = deadline
        ext.reserved += len(ext.quarantine)
        ns.reserved += len(ext.quarantine)
        for old in beaten:
            del ns.index[old.key]
            at = adopted.index(old)
            del adopted[at], adopted_at[at]
            self._unaccount(old)
            old.extent.free.append(old.slot)
            ns.recovered -= 1
        if unique:
            keys, at_slots = slots.keys, slots.slots
            lengths, sums, lasts = slots.lengths, slots.checksums, slots.last_access
        else:
            keys = list(mine)
            at_slots, lengths, sums, lasts = (list(col) for col in zip(*mine.values(),
                                                                       strict=True)) \
                if mine else ([], [], [], [])
        gens = ext.generations
        # Built by map() from C: a quarter of a million blocks in a few hundred ms.
        new = list(map(Block, itertools.repeat(ns), keys, itertools.repeat(ext), at_slots,
                       lengths, sums, map(gens.__getitem__, at_slots)))
        ns.index.update(zip(keys, new, strict=True))
        adopted.extend(new)
        adopted_at.extend(lasts)
        recovered = len(new)
        ext.committed += recovered
        ext.dirty += recovered
        ns.committed += recovered
        self.budget_free -= lay.file_bytes
        ns.extents.append(ext)
        ns.extents.sort(key=lambda e: e.segment.index)
        ns.next_extent_index = max(ns.next_extent_index, segment.index + 1)
        ns.recovered += recovered
        return recovered

    def finish_recovery(self) -> None:
        """Order the adopted blocks by their persisted last access (oldest first in the LRU).

        The access sequence goes on from the newest one; when that is in the upper
        half of its range (a long-lived cache, or a damaged table) the adopted
        blocks are renumbered 1..n in the same order first, so it never runs into
        the bound recovery enforces (``MAX_ACCESS_SEQ``).
        """
        blocks = self._adopted
        lasts = np.array(self._adopted_at, dtype=np.uint64)
        order = np.argsort(lasts, kind="stable").tolist()
        top = int(lasts.max()) if len(blocks) else 0
        if top >= MAX_ACCESS_SEQ // 2:  # the writes first: a failure leaves memory as it was
            for rank, i in enumerate(order, 1):
                blocks[i].extent.segment.touch(blocks[i].slot, rank)
            top = len(order)
        self.lru.update(zip(map(blocks.__getitem__, order), itertools.repeat(None)))
        self._access_seq = itertools.count(top + 1)
        self._adopted, self._adopted_at = [], []
        for ns in self.namespaces.values():
            if ns.index.shared is None:
                self._publish(ns)
