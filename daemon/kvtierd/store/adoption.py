"""Recovery's side of the store: adopting a previous run's extents as ``recovery``
validated them, and ordering the adopted blocks once every extent is in.

Functions of the store, not a layer of it: they run only at start-up, before the
store serves (``kvtierd.recovery.recover``), and use its parts (``Store.state``,
``Store.budget``)."""


from __future__ import annotations

import logging
import os
from typing import Final

import numpy as np
import numpy.typing as npt

from kvtier import _slot_ref
from kvtier.errors import (
    CapacityExhausted,
    FailedPrecondition,
)
from kvtierd.segments import (
    MAX_ACCESS_SEQ,
    SLOT_ENTRY_BYTES,
    TABLE_OFFSET,
    Segment,
    SlotState,
)
from kvtierd.shared_index import Location
from kvtierd.store.store import Store
from kvtierd.store.types import Extent, Namespace

log = logging.getLogger(__name__)

#: Threads that put an adopted extent's keys in the index (before the daemon serves:
#: each owns a range of the table; csrc/index.c ``set_slots_par``).  One below 4 CPUs:
#: on a 2-vCPU host the second thread saved no time (it waits for a core the first
#: needs, 2 x 17 joins per million keys) and cost more CPU: a 1M-block restart took
#: 0.14-0.145 s to recover with one, 0.146-0.184 s with two, and the daemon had used
#: 0.63-0.75 s of CPU by READY against 0.79-0.92 s (2026-12-07, runs alternating,
#: docs/benchmarks.d/warm-restart-1m.md).
ADOPT_THREADS: Final = 1 if (os.cpu_count() or 1) < 4 else 4


def check_adoptable(store: Store, segment: Segment) -> None:
    """Raise unless a previous run's segment can be adopted now (the store is unchanged).

    ``CapacityExhausted`` when the budget cannot hold the extent,
    ``FailedPrecondition`` when its layout conflicts with the namespace's
    other extents or its extent number is taken.
    """
    lay = segment.layout
    if lay.file_bytes > store.budget_free:
        raise CapacityExhausted(
            f"extent needs {lay.file_bytes} bytes, {store.budget_free} left in dram.capacity"
        )
    ns = store.namespaces.get(segment.namespace)
    if ns is not None and (ns.block_bytes, ns.model_uid) != (lay.block_bytes, segment.model_uid):
        raise FailedPrecondition(
            f"extent {segment.index} of namespace {segment.namespace!r} has block_bytes="
            f"{lay.block_bytes} model_uid={segment.model_uid!r}, other extents have "
            f"block_bytes={ns.block_bytes} model_uid={ns.model_uid!r}"
        )
    if ns is not None and any(e.segment.index == segment.index for e in ns.extents):
        raise FailedPrecondition(f"extent {segment.index} of {segment.namespace!r} twice")


def adopt_segment(store: Store, segment: Segment, *, referenced_from: int = 2**64 - 1,
                  expect: int = 0) -> tuple[int, dict[str, int]]:
    """Take over a segment of a previous run: every slot validated natively as
    ``tests/unit/slot_oracle.scan_slots`` does (``BlockTable.adopt``): valid COMMITTED entries
    become visible blocks, RESERVED slots are quarantined for the reservation TTL
    (a writer of the previous daemon may still be copying), the rest are freed.
    Blocks last accessed at ``referenced_from`` or later keep their CLOCK bit.
    ``expect``: how many blocks this and the namespace's extents still to come hold
    (recovery counts them first): the key index is sized for them at once.

    Returns (blocks recovered, dropped slots by reason).  Raises like
    ``check_adoptable``; the store is unchanged then.
    """
    check_adoptable(store, segment)
    lay = segment.layout
    ns = store.namespaces.get(segment.namespace)
    if ns is None:
        ns = store.state.new_namespace(segment.namespace, lay.block_bytes, segment.model_uid,
                                  lay.slot_bytes, publish=False)
    ns.table.add_segment(segment)
    try:
        got = ns.table.adopt(segment, store.boot_epoch, referenced_from=referenced_from)
        recovered = _index_adopted(ns, segment, expect)
    except BaseException:
        ns.table.remove_extent(segment.segment_id, force=True)
        store.state.forget_if_unused(ns)
        raise
    # Applied: nothing below can fail.
    ext = Extent(segment, ns.table)
    if got.reserved:  # (a pass over the slot table only when the crash left some)
        states = segment.scan(copy=False)["state"]
        deadline = store.state.clock() + store.reservation_ttl
        ext.quarantine = dict.fromkeys(
            np.flatnonzero(states == SlotState.RESERVED).tolist(), deadline)
        del states
    ns.extents.append(ext)
    ns.by_id[ext.id] = ext
    ns.extents.sort(key=lambda e: e.segment.index)
    ns.next_extent_index = max(ns.next_extent_index, segment.index + 1)
    store.budget.take(lay.file_bytes)
    store.state.last_adopted = max(store.state.last_adopted, got.max_last_access)
    ns.recovered += recovered
    return recovered, got.dropped


def _index_adopted(ns: Namespace, seg: Segment, expect: int = 0) -> int:
    """Put an adopted extent's blocks in the key index, straight from its slot table
    (``SharedIndex.add_slots``: no Python object per key).  A key committed twice
    (never written so; be safe) keeps its newest copy, the other is freed (the
    table's call first: its refusal changes nothing)."""
    refs = ns.table.committed(seg.segment_id)
    if not len(refs):
        return 0
    slots = _slot_ref.slots_of(refs)
    n = seg.layout.n_slots
    table = memoryview(seg.meta)[TABLE_OFFSET : TABLE_OFFSET + n * SLOT_ENTRY_BYTES]
    try:
        left = ns.index.table.add_slots(table, slots, seg.segment_id, seg.layout.slot_bytes,
                                        room=expect, threads=ADOPT_THREADS)
    finally:
        table.release()
    try:
        here = _adopt_left_out(ns, seg, refs, left) if left else set()
    except BaseException:  # the extent is not adopted: its keys leave the index again
        for r in refs.tolist():
            key = seg.read_slot(_slot_ref.slot_of(r)).key
            if int(ns.index.find([key])[0]) == r:
                ns.index.table.discard(key)
        raise
    if ns.index.watch is not None:
        ns.index.watch([seg.read_slot(_slot_ref.slot_of(int(r))).key for r in refs.tolist()
                        if int(r) not in here], True)
    return len(refs) - len(here)


def _adopt_left_out(ns: Namespace, seg: Segment, refs: npt.NDArray[np.uint64],
                    left: list[int]) -> set[int]:
    """The slots ``add_slots`` left out: a key past the probe limit is kept apart; a
    key the index holds already (committed twice: never written so) keeps its copy
    last accessed most recently and the other is freed.  Returns the refs of this
    extent freed."""
    mask = _slot_ref.SLOT_MASK
    apart: list[tuple[bytes, Location]] = []
    moves: list[tuple[bytes, Location]] = []
    lose: list[int] = []

    def segment_of(ref: int) -> Segment:
        return seg if _slot_ref.segment_of(ref) == seg.segment_id else ns.by_id[_slot_ref.segment_of(ref)].segment

    for i in left:
        ref = int(refs[i])
        rec = seg.read_slot(ref & mask)
        loc = (seg.segment_id, ref & mask, seg.slot_offset(ref & mask), rec.length,
               rec.checksum)
        other = int(ns.index.find([rec.key])[0])
        if not other:
            apart.append((rec.key, loc))
            continue
        log.warning("namespace %r: key %s committed twice; keeping the newer copy",
                    ns.name, rec.key.hex())
        if rec.last_access > segment_of(other).read_slot(other & mask).last_access:
            lose.append(other)
            moves.append((rec.key, loc))
        else:
            lose.append(ref)
    if lose:
        ns.table.delete(np.array(lose, dtype=np.uint64))  # first: a refusal changes nothing
    for key, loc in apart + moves:
        ns.index.table.add(key, loc)
    gone_elsewhere = sum(1 for r in lose if _slot_ref.segment_of(r) != seg.segment_id)
    ns.recovered -= gone_elsewhere
    return {r for r in lose if _slot_ref.segment_of(r) == seg.segment_id}


def finish_recovery(store: Store) -> None:
    """The access sequence goes on from the newest adopted one; when that is in the
    upper half of its range (a long-lived cache, or a damaged table) every adopted
    block's last access is shifted down first (order kept: ``rescale_access``), so
    it never runs into the bound recovery enforces (``MAX_ACCESS_SEQ``)."""
    top = store.state.last_adopted
    if top >= MAX_ACCESS_SEQ // 2:
        shift = top.bit_length() - (MAX_ACCESS_SEQ // 4).bit_length()
        for ns in store.namespaces.values():
            ns.table.rescale_access(shift)
        top >>= shift
    store.state.next_access = max(store.state.next_access, top + 1)
    store.state.last_adopted = 0
    for ns in store.namespaces.values():
        store.state.publish_index(ns)
