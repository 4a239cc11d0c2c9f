"""Recovery's side of the store: adopting a previous run's extents as ``recovery``
validated them, and ordering the adopted blocks once every extent is in."""


from __future__ import annotations

import logging

import numpy as np
import numpy.typing as npt

from kvtier.errors import (
    CapacityExhausted,
    FailedPrecondition,
)
from kvtierd.segments import (
    FLAG_HAS_CHECKSUM,
    KEY_OFFSET,
    MAX_ACCESS_SEQ,
    SLOT_DTYPE,
    SLOT_ENTRY_BYTES,
    Segment,
    SlotState,
)
from kvtierd.shared_index import Location
from kvtierd.store.fast_path import FastPath
from kvtierd.store.types import Extent, Namespace

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

    def adopt_segment(self, segment: Segment, *, referenced_from: int = 2**64 - 1
                      ) -> tuple[int, dict[str, int]]:
        """Take over a segment of a previous run: every slot validated natively as
        ``recovery.scan_slots`` does (``BlockTable.adopt``): valid COMMITTED entries
        become visible blocks, RESERVED slots are quarantined for the reservation TTL
        (a writer of the previous daemon may still be copying), the rest are freed.
        Blocks last accessed at ``referenced_from`` or later keep their CLOCK bit.

        Returns (blocks recovered, dropped slots by reason).  Raises like
        ``check_adoptable``; the store is unchanged then.
        """
        self.check_adoptable(segment)
        lay = segment.layout
        ns = self.namespaces.get(segment.namespace)
        if ns is None:
            ns = self._new_namespace(segment.namespace, lay.block_bytes, segment.model_uid,
                                     lay.slot_bytes, publish=False)
        ns.table.add_segment(segment)
        try:
            got = ns.table.adopt(segment, self.boot_epoch, referenced_from=referenced_from)
            recovered = self._index_adopted(ns, segment)
        except BaseException:
            ns.table.remove_extent(segment.segment_id, force=True)
            self._forget_if_unused(ns)
            raise
        # Applied: nothing below can fail.
        ext = Extent(segment, ns.table)
        states = segment.scan(copy=False)["state"]
        deadline = self._clock() + self.reservation_ttl
        ext.quarantine = dict.fromkeys(np.flatnonzero(states == SlotState.RESERVED).tolist(),
                                       deadline)
        del states
        ns.extents.append(ext)
        ns.by_id[ext.id] = ext
        ns.extents.sort(key=lambda e: e.segment.index)
        ns.next_extent_index = max(ns.next_extent_index, segment.index + 1)
        self.budget_free -= lay.file_bytes
        self._last_adopted = max(self._last_adopted, got.max_last_access)
        ns.recovered += recovered
        return recovered, got.dropped

    def _index_adopted(self, ns: Namespace, seg: Segment) -> int:
        """Put an adopted extent's blocks in the key index; a key committed twice (never
        written so; be safe) keeps its newest copy, the other is freed (the table's
        call first: its refusal changes nothing)."""
        refs = ns.table.committed(seg.segment_id)
        if not len(refs):
            return 0
        slots = (refs & np.uint64(0xFFFF_FFFF)).astype(np.int64)
        raw = seg.raw_table()
        rows = np.frombuffer(raw, dtype=SLOT_DTYPE, count=seg.layout.n_slots)[slots]
        keys = _keys_at(raw, slots, rows["key_len"].astype(np.int64))
        offsets = (slots * seg.layout.slot_bytes).tolist()
        sums = np.where(rows["flags"] & FLAG_HAS_CHECKSUM, rows["checksum"], 0).tolist()
        has = (rows["flags"] & FLAG_HAS_CHECKSUM).astype(bool).tolist()
        locs = [(seg.segment_id, sl, off, ln, sm if h else None) for sl, off, ln, sm, h in
                zip(slots.tolist(), offsets, rows["length"].tolist(), sums, has, strict=True)]
        lasts = rows["last_access"].tolist()
        present = ns.index.find(keys)
        if len(set(keys)) != len(keys) or present.any():
            keys, locs, lose = _newest_copies(ns, keys, locs, lasts, refs, present)
            if lose:
                ns.table.delete(np.array([ref for _key, ref, _ in lose], dtype=np.uint64))
            ns.index.remove([key for key, _ref, indexed in lose if indexed])
        ns.index.add(keys, locs)
        return len(keys)

    def finish_recovery(self) -> None:
        """The access sequence goes on from the newest adopted one; when that is in the
        upper half of its range (a long-lived cache, or a damaged table) every adopted
        block's last access is shifted down first (order kept: ``rescale_access``), so
        it never runs into the bound recovery enforces (``MAX_ACCESS_SEQ``)."""
        top = self._last_adopted
        if top >= MAX_ACCESS_SEQ // 2:
            shift = top.bit_length() - (MAX_ACCESS_SEQ // 4).bit_length()
            for ns in self.namespaces.values():
                ns.table.rescale_access(shift)
            top >>= shift
        self._next_access = max(self._next_access, top + 1)
        self._last_adopted = 0
        for ns in self.namespaces.values():
            self._publish(ns)


def _keys_at(raw: bytes, slots: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
             ) -> list[bytes]:
    """The keys of ``slots`` (in that order) from a slot table's bytes: keys of one
    length come out of numpy at once (tables hold one key length or a few)."""
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, SLOT_ENTRY_BYTES)
    out = np.empty(len(slots), dtype=object)
    for k in np.unique(lengths).tolist():
        pick = lengths == k
        cols = np.ascontiguousarray(rows[slots[pick], KEY_OFFSET : KEY_OFFSET + k])
        out[pick] = [bytes(c) for c in cols]
    keys: list[bytes] = out.tolist()
    return keys


def _newest_copies(ns: Namespace, keys: list[bytes], locs: list[Location], lasts: list[int],
                   refs: npt.NDArray[np.uint64], present: npt.NDArray[np.uint64]
                   ) -> tuple[list[bytes], list[Location], list[tuple[bytes, int, bool]]]:
    """Of keys adopted twice (here, or already in the index from another extent), the
    copy last accessed most recently stays: (keys, locations) to index, and (key, ref,
    indexed) of each copy to free (``indexed``: the index holds it now)."""
    best: dict[bytes, tuple[int, int, Location | None]] = {}  # last, ref, loc (None: indexed)
    lose: list[tuple[bytes, int, bool]] = []
    for key, loc, last, ref, old in zip(keys, locs, lasts, refs.tolist(), present.tolist(),
                                        strict=True):
        if key in best or old:
            log.warning("namespace %r: key %s committed twice; keeping the newer copy",
                        ns.name, key.hex())
        if old and key not in best:
            held = ns.by_id[old >> 32].segment.read_slot(old & 0xFFFF_FFFF).last_access
            best[key] = (held, old, None)
        prev = best.get(key)
        if prev is None or last > prev[0]:
            if prev is not None:
                lose.append((key, prev[1], prev[2] is None))
            best[key] = (last, ref, loc)
        else:
            lose.append((key, ref, False))
    out = [(k, v[2]) for k, v in best.items() if v[2] is not None]
    return [k for k, _ in out], [loc for _, loc in out], lose
