"""``Store.check``: the cross-check of the index, counters and pins against the slot tables,
on a snapshot (so it can run off the loop)."""


from __future__ import annotations

import collections
import dataclasses
import logging

import numpy as np

from kvtierd.segments import (
    FLAG_HAS_CHECKSUM,
    KEY_OFFSET,
    MAX_KEY_BYTES,
    SLOT_DTYPE,
    SLOT_ENTRY_BYTES,
    SlotState,
)
from kvtierd.shared_index import (
    fingerprint,
)
from kvtierd.store.types import Block, Extent, Lower, Namespace

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class _ExtentView:
    ext: Extent  # identity only: never read by check_from
    index: int
    n_slots: int
    file_bytes: int
    free: list[int]
    quarantine: set[int]
    reserved: int
    committed: int
    pinned: int
    dirty: int
    table: bytes  # the slot table as the segment held it


@dataclasses.dataclass(frozen=True, slots=True)
class _NamespaceView:
    ns: Namespace  # identity only
    name: str
    slot_bytes: int
    reserved: int
    committed: int
    leased: int
    index: list[tuple[bytes, Block]]
    states: list[tuple[int, bool, int]]  # (pins, doomed, lower) of each index entry's block
    in_flight: list[bytes]
    extents: list[_ExtentView]
    # The shared index's fingerprints and unpublished keys (None: not published).
    published: tuple[list[bytes], set[bytes]] | None


@dataclasses.dataclass(frozen=True, slots=True)
class CheckSnapshot:
    """What ``Store.check_from`` needs, copied by ``Store.check_snapshot`` on the loop.

    Blocks, extents and namespaces are held for their identity and for the
    fields that never change after they are made (key, extent, slot, length,
    checksum, generation); what changes (pins, doomed, lower, counters, free
    lists, slot tables) is copied.
    """

    namespaces: list[_NamespaceView]
    leases: list[tuple[list[Block], list[tuple[int, bool, int]]]]
    reservations: list[tuple[Namespace, list[bytes], list[tuple[Extent, int, int]]]]
    lru: list[Block]
    budget_free: int
    capacity: int


def _check_published(name: str, keys: list[bytes], fingerprints: list[bytes],
                     unpublished: set[bytes]) -> list[str]:
    """The shared index holds exactly the index's keys but the unpublished ones."""
    problems = []
    if len(set(fingerprints)) != len(fingerprints):
        problems.append(f"{name}: the shared index holds a key twice")
    want = {fingerprint(k): k for k in keys if k not in unpublished}
    have = set(fingerprints)
    for fp in sorted(want.keys() - have)[:5]:
        problems.append(f"{name}: key {want[fp].hex()} is in the index, not in the shared index")
    stray = len(have - want.keys())
    if stray:
        problems.append(f"{name}: the shared index holds {stray} keys the index does not")
    if unpublished - set(keys):
        problems.append(f"{name}: keys left the index but are still listed unpublished")
    return problems


def _cross_check(snap: CheckSnapshot) -> list[str]:
    """``Store.check_from``: every cross-check, on the snapshot alone."""
    problems: list[str] = []
    pins: collections.Counter[int] = collections.Counter()
    state: dict[int, tuple[int, bool, int]] = {}
    doomed_leased: dict[int, list[Block]] = {}  # id(namespace) -> its doomed leased blocks
    for blocks, states in snap.leases:
        for block, st in zip(blocks, states, strict=True):
            pins[id(block)] += 1
            state[id(block)] = st
            if st[1]:
                doomed_leased.setdefault(id(block.ns), []).append(block)
    reserved_at: set[tuple[int, int]] = set()
    for _ns, _keys, places in snap.reservations:
        for ext, slot, _gen in places:
            reserved_at.add((id(ext), slot))
    extent_bytes = 0
    lru_expected: set[int] = set()
    reserved_bytes = committed_bytes = 0
    for nsv in snap.namespaces:
        name = nsv.name
        reserved_bytes += nsv.reserved * nsv.slot_bytes
        committed_bytes += nsv.committed * nsv.slot_bytes
        blocks_at: dict[tuple[int, int], Block] = {}
        for (key, block), st in zip(nsv.index, nsv.states, strict=True):
            state[id(block)] = st
            if block.key != key or st[1]:
                problems.append(f"{name}: index entry {key.hex()} points at a wrong block")
            blocks_at[(id(block.extent), block.slot)] = block
            if st[0] == 0:
                lru_expected.add(id(block))
        if nsv.published is not None:
            problems.extend(_check_published(name, [k for k, _ in nsv.index], *nsv.published))
        for block in doomed_leased.get(id(nsv.ns), ()):
            blocks_at[(id(block.extent), block.slot)] = block
        totals = {"free": 0, "reserved": 0, "committed": 0}
        ns_pinned = 0
        for ev in nsv.extents:
            extent_bytes += ev.file_bytes
            ns_pinned += _check_extent(ev, name, blocks_at, reserved_at, state, pins, totals,
                                       problems)
        if ns_pinned != nsv.leased:
            problems.append(f"{name}: leased counter {nsv.leased} != leased blocks {ns_pinned}")
        if (totals["reserved"], totals["committed"]) != (nsv.reserved, nsv.committed):
            problems.append(f"{name}: namespace counters ({nsv.reserved}, {nsv.committed}) "
                            f"!= slot tables ({totals['reserved']}, {totals['committed']})")
        if set(nsv.in_flight) != {k for ns, keys, _ in snap.reservations if ns is nsv.ns
                                  for k in keys}:
            problems.append(f"{name}: in-flight keys disagree with open reservations")
    if extent_bytes + snap.budget_free != snap.capacity:
        problems.append(f"DRAM budget does not balance: extents {extent_bytes} + free "
                        f"{snap.budget_free} != capacity {snap.capacity}")
    if {id(b) for b in snap.lru} != lru_expected:
        problems.append("LRU does not hold exactly the unleased visible blocks")
    acct = {"total": snap.capacity, "reserved": reserved_bytes, "committed": committed_bytes,
            "free": snap.capacity - reserved_bytes - committed_bytes}
    if acct["free"] + acct["reserved"] + acct["committed"] != acct["total"] or acct["free"] < 0:
        problems.append(f"DRAM accounting does not add up: {acct}")
    return problems


def _check_extent(
    ev: _ExtentView,
    name: str,
    blocks_at: dict[tuple[int, int], Block],
    reserved_at: set[tuple[int, int]],
    state: dict[int, tuple[int, bool, int]],
    pins: collections.Counter[int],
    totals: dict[str, int],
    problems: list[str],
) -> int:
    """One extent's slot table against the index, reservations and counters: adds to
    ``totals`` and ``problems``; returns its leased slots."""
    free_set = set(ev.free)
    if len(free_set) != len(ev.free):
        problems.append(f"{name}: extent {ev.index} free list has duplicates")
    rows = np.frombuffer(ev.table, dtype=SLOT_DTYPE, count=ev.n_slots)
    states = rows["state"].tolist()
    klens = rows["key_len"].tolist()
    lengths = rows["length"].tolist()
    gens = rows["generation"].tolist()
    flags = rows["flags"].tolist()
    sums = rows["checksum"].tolist()
    table = ev.table
    me = id(ev.ext)
    counts = {"free": 0, "reserved": 0, "committed": 0}
    pinned_slots = 0
    dirty = 0
    for slot, st in enumerate(states):
        where = f"{name}: extent {ev.index} slot {slot}"
        owner = blocks_at.get((me, slot))
        held = (me, slot) in reserved_at
        if st == SlotState.FREE:
            counts["free"] += 1
            if slot not in free_set:
                problems.append(f"{where}: FREE on segment but not on the free list")
            if owner is not None or held:
                problems.append(f"{where}: FREE on segment but in use in the index")
        elif st == SlotState.RESERVED:
            counts["reserved"] += 1
            if not held and slot not in ev.quarantine:
                problems.append(f"{where}: RESERVED on segment but no reservation")
        elif st == SlotState.DOOMED:
            counts["committed"] += 1  # still pinned by a reader
            if owner is None or not state[id(owner)][1]:
                problems.append(f"{where}: DOOMED on segment but not a deleted leased block")
        elif st == SlotState.COMMITTED:
            counts["committed"] += 1
            if owner is None or state[id(owner)][1]:
                problems.append(f"{where}: COMMITTED on segment but not indexed")
            else:
                at = slot * SLOT_ENTRY_BYTES + KEY_OFFSET
                key = table[at : at + min(klens[slot], MAX_KEY_BYTES)]
                checksum = sums[slot] if flags[slot] & FLAG_HAS_CHECKSUM else None
                if (key, lengths[slot], gens[slot], checksum) != (
                    owner.key, owner.length, owner.generation, owner.checksum
                ):
                    problems.append(f"{where}: slot table disagrees with the index")
        else:
            problems.append(f"{where}: state byte {st} is no slot state")
        if owner is not None:
            owner_pins, _doomed, lower = state[id(owner)]
            dirty += lower == Lower.DIRTY
            if pins[id(owner)] != owner_pins:
                problems.append(f"{where}: pins {owner_pins} != leases {pins[id(owner)]}")
            if owner_pins:
                pinned_slots += 1
    if counts["free"] != len(ev.free):
        problems.append(f"{name}: extent {ev.index} free list "
                        f"{len(ev.free)} != FREE slots {counts['free']}")
    if (counts["reserved"], counts["committed"]) != (ev.reserved, ev.committed):
        problems.append(f"{name}: extent {ev.index} counters "
                        f"({ev.reserved}, {ev.committed}) != slot table "
                        f"({counts['reserved']}, {counts['committed']})")
    if sum(counts.values()) != ev.n_slots:
        problems.append(f"{name}: extent {ev.index} does not balance")
    if dirty != ev.dirty:
        problems.append(f"{name}: extent {ev.index} dirty counter "
                        f"{ev.dirty} != DIRTY blocks {dirty}")
    if pinned_slots != ev.pinned:
        problems.append(f"{name}: extent {ev.index} pinned counter "
                        f"{ev.pinned} != leased slots {pinned_slots}")
    for k in totals:
        totals[k] += counts[k]
    return pinned_slots
