"""``Store.check``: the cross-check of the index, counters and pins against the slot tables,
on a snapshot (so it can run off the loop).

No Python object per block (a TiB pool holds millions): the snapshot holds compact rows copied natively
(``BlockTable.check_rows``: 24 bytes a slot, with each committed key's shared-index
fingerprint; ``_native.index_rows``: 24 bytes a published key), and the check compares
the keys natively with the GIL released (``_native.check_keys``).  Python looks only at
the slots something names or flags: reserved, doomed, pinned, quarantined, held by a
reservation or a grant, or holding a state or key length that is no such thing.
``tests/unit/check_model.py`` keeps the check as it was written in Python, per slot;
the tests hold the two equal.
"""


from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
from typing import Final

import numpy as np

from kvtier import _native, _slot_ref
from kvtierd.segments import MAX_KEY_BYTES, SlotState
from kvtierd.store.budget import Budget
from kvtierd.store.state import StoreState

log = logging.getLogger(__name__)

#: ``BlockTable.check_rows``' row (csrc/blocks.c ``kvt_check_row``): ``a``, ``b`` are a
#: committed key's fingerprint, else ``a`` is the slot's persisted generation.
CHECK_ROW_DTYPE: Final = np.dtype([("a", "<u8"), ("b", "<u8"), ("state", "u1"),
                                   ("key_len", "u1"), ("fp_flags", "u1"), ("pad", "u1"),
                                   ("pins", "<u4")])
assert CHECK_ROW_DTYPE.itemsize == 24


@dataclasses.dataclass(frozen=True, slots=True)
class _ExtentView:
    id: int
    index: int
    n_slots: int
    file_bytes: int
    slot_bytes: int
    quarantine: set[int]
    rows: bytes  # BlockTable.check_rows: what the slot table and the records held


@dataclasses.dataclass(frozen=True, slots=True)
class _NamespaceView:
    name: str
    slot_bytes: int
    #: What ``BlockTable.check`` found (records against slot tables, free lists, counts).
    table_problems: list[str]
    in_flight: list[bytes]
    extents: list[_ExtentView]
    #: The key index: the shared table's fingerprints (``_native.index_rows``) and those
    #: of the keys kept apart (``_native.fingerprint_rows``).
    index_rows: bytes
    unpublished_rows: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class CheckSnapshot:
    """What ``Store.check_from`` needs, copied by ``Store.check_snapshot`` on the loop
    (plain values: namespaces and extents by name and id)."""

    namespaces: list[_NamespaceView]
    #: (namespace, refs) of each lease by a call (a ref once per pin)
    leases: list[tuple[str, np.ndarray]]
    #: (namespace, keys, [(extent id, slot, generation)]) of reservations and grants
    reservations: list[tuple[str, list[bytes], list[tuple[int, int, int]]]]
    budget_free: int
    capacity: int


def take_snapshot(state: StoreState, budget: Budget) -> CheckSnapshot:
    """``Store.check_snapshot``: copy what ``_cross_check`` compares (on the loop: the
    block tables' own check, copies of lists and dicts, and compact native copies of
    the slot tables, the records and the key index -- ``check_rows``, ``index_rows``: 24
    bytes a slot and a key, no Python object per block)."""
    leases = [(lease.ns.name, lease.refs.copy()) for lease in state.leases.values()]
    reservations = [(r.session.ns.name, r.keys, [(e.id, slot, gen) for e, slot, gen
                                                 in r.places])
                    for r in state.reservations.values()]
    reservations += [(s.ns.name, [], s.grants.places())
                     for s in state.sessions.values() if s.grants]
    namespaces = []
    for ns in state.namespaces.values():
        shared = ns.index.table
        extents = [_ExtentView(id=ext.id, index=ext.segment.index, n_slots=ext.n_slots,
                               file_bytes=ext.bytes, quarantine=set(ext.quarantine),
                               rows=ns.table.check_rows(ext.id),
                               slot_bytes=ext.segment.layout.slot_bytes)
                   for ext in ns.extents]
        namespaces.append(_NamespaceView(
            name=ns.name, table_problems=ns.table.check(), in_flight=list(ns.in_flight),
            extents=extents, index_rows=shared.rows(),
            unpublished_rows=_native.fingerprint_rows(list(shared.unpublished)),
            slot_bytes=ns.slot_bytes))
    # An extent being made is out of the budget and in no extent yet: free, for this.
    return CheckSnapshot(namespaces=namespaces, leases=leases, reservations=reservations,
                         budget_free=budget.free_bytes + budget.growing_bytes,
                         capacity=budget.capacity)


def _cross_check(snap: CheckSnapshot) -> list[str]:
    """``Store.check_from``: every cross-check, on the snapshot alone."""
    problems: list[str] = []
    pins: collections.Counter[tuple[str, int]] = collections.Counter()
    for name, refs in snap.leases:
        pins.update((name, int(r)) for r in refs.tolist())
    held: dict[tuple[str, int, int], int] = {}  # (ns, extent, slot) -> generation
    for name, _keys, places in snap.reservations:
        for ext_id, slot, gen in places:
            if (name, ext_id, slot) in held:
                problems.append(f"{name}: extent {ext_id} slot {slot} is reserved twice")
            held[(name, ext_id, slot)] = gen
    # what names a slot, by (namespace, extent): reservations and leases
    held_by: dict[tuple[str, int], dict[int, int]] = collections.defaultdict(dict)
    for (name, ext_id, slot), gen in held.items():
        held_by[(name, ext_id)][slot] = gen
    pins_by: dict[tuple[str, int], dict[int, int]] = collections.defaultdict(dict)
    for (name, ref), count in pins.items():
        pins_by[(name, _slot_ref.segment_of(ref))][_slot_ref.slot_of(ref)] = count
    extent_bytes = 0
    for nsv in snap.namespaces:
        name = nsv.name
        problems += [f"{name}: {p}" for p in nsv.table_problems]
        for ev in nsv.extents:
            extent_bytes += ev.file_bytes
            _check_extent(ev, name, held_by.get((name, ev.id), {}),
                          pins_by.get((name, ev.id), {}), problems)
        problems += _check_index(nsv)
        mine = [ks for n, ks, _ in snap.reservations if n == name]
        want = {k for ks in mine for k in ks}
        if set(nsv.in_flight) != want or len(want) != sum(map(len, mine)):
            problems.append(f"{name}: in-flight keys disagree with open reservations")
    known = {(e.id) for nsv in snap.namespaces for e in nsv.extents}
    for (name, ext_id, slot) in held:
        if ext_id not in known:
            problems.append(f"{name}: a reservation holds slot {slot} of extent {ext_id}, "
                            "which is gone")
    if extent_bytes + snap.budget_free != snap.capacity:
        problems.append(f"DRAM budget does not balance: extents {extent_bytes} + free "
                        f"{snap.budget_free} != capacity {snap.capacity}")
    return problems


def _check_index(nsv: _NamespaceView) -> list[str]:
    """The key index holds exactly the COMMITTED blocks' keys (in the table or apart)."""
    name = nsv.name
    problems = []
    _, twice, index_twice, missing, stray, gone = _native.check_keys(
        [ev.rows for ev in nsv.extents], nsv.index_rows, nsv.unpublished_rows,
        secrets.randbits(64))
    if twice:
        problems.append(f"{name}: a key is committed in two slots")
    if index_twice:
        problems.append(f"{name}: the shared index holds a key twice")
    for at, slot in missing:
        ev = nsv.extents[at]
        row = np.frombuffer(ev.rows, dtype=CHECK_ROW_DTYPE, count=1, offset=slot * 24)[0]
        fp = int(row["a"]).to_bytes(8, "little") + int(row["b"]).to_bytes(8, "little")
        if row["fp_flags"] == 0:  # a 16-byte key is its own fingerprint
            problems.append(f"{name}: key {fp.hex()} is committed but not in the index")
        else:
            problems.append(f"{name}: a key of {int(row['key_len'])} bytes (extent {ev.index} "
                            f"slot {slot}, fingerprint {fp.hex()}) is committed but not in "
                            "the index")
    if stray:
        problems.append(f"{name}: the index holds {stray} keys no slot holds")
    if gone:
        problems.append(f"{name}: keys left DRAM but are still kept in the index")
    return problems


def _check_extent(ev: _ExtentView, name: str, held: dict[int, int], pins: dict[int, int],
                  problems: list[str]) -> None:
    """One extent's slot table against the reservations (``held``: slot -> generation)
    and leases (``pins``: slot -> pins by calls).  Per slot as the model checks it, but
    only for the slots something names or flags (the rest cannot fail)."""
    rows = np.frombuffer(ev.rows, dtype=CHECK_ROW_DTYPE, count=ev.n_slots)
    st, klen, rec_pins = rows["state"], rows["key_len"], rows["pins"]
    flagged = ((st == SlotState.RESERVED) | (st > SlotState.DOOMED) | (rec_pins != 0)
               | ((st == SlotState.DOOMED) & (rec_pins == 0))
               | ((st == SlotState.COMMITTED) & ((klen == 0) | (klen > MAX_KEY_BYTES))))
    named = [s for s in (*held, *ev.quarantine, *pins) if 0 <= s < ev.n_slots]
    slots = np.union1d(np.flatnonzero(flagged), np.array(named, dtype=np.int64)).tolist()
    for slot in slots:
        row = rows[slot]
        state, key_len, pinned = int(row["state"]), int(row["key_len"]), int(row["pins"])
        where = f"{name}: extent {ev.index} slot {slot}"
        gen = held.get(slot)
        if state == SlotState.RESERVED:
            if gen is None and slot not in ev.quarantine:
                problems.append(f"{where}: RESERVED on segment but no reservation")
            elif gen is not None and gen != int(row["a"]):
                problems.append(f"{where}: reserved at generation {gen}, the slot has "
                                f"{int(row['a'])}")
        elif gen is not None:
            problems.append(f"{where}: reserved but {SlotState(state).name} on segment"
                            if state in (0, 2, 3) else f"{where}: reserved, state byte {state}")
        if state == SlotState.COMMITTED:
            if not 0 < key_len <= MAX_KEY_BYTES:
                problems.append(f"{where}: COMMITTED with a key of {key_len} bytes")
        elif state == SlotState.DOOMED and not pinned:
            problems.append(f"{where}: DOOMED on segment but not leased")
        elif state not in (SlotState.FREE, SlotState.RESERVED, SlotState.COMMITTED,
                           SlotState.DOOMED):
            problems.append(f"{where}: state byte {state} is no slot state")
        if slot in ev.quarantine and state != SlotState.RESERVED:
            problems.append(f"{where}: quarantined but {state}")
        by_calls = pins.get(slot, 0)
        if pinned != by_calls:
            problems.append(f"{where}: pins {pinned} != leases {by_calls}")
