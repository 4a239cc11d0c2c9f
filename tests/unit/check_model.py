"""The model of ``Store.check``'s cross-check: the check as it was written in Python,
per slot, over full copies of the slot tables, the native records and the shared
index's fingerprints (before the check ran on compact native rows, ``store/check.py``).
``test_store_check.py`` holds the two equal on every deliberate corruption."""


from __future__ import annotations

import collections
import dataclasses

import numpy as np

from kvtierd.segments import (
    KEY_OFFSET,
    MAX_KEY_BYTES,
    SLOT_DTYPE,
    SLOT_ENTRY_BYTES,
    SlotState,
)
from kvtierd.shared_index import fingerprint
from kvtierd.store import Store


@dataclasses.dataclass(frozen=True, slots=True)
class _ExtentView:
    id: int
    index: int
    n_slots: int
    file_bytes: int
    slot_bytes: int
    quarantine: set[int]
    table: bytes  # the slot table as the segment held it
    records: np.ndarray  # the block table's records of its slots (``RECORD_DTYPE``)


@dataclasses.dataclass(frozen=True, slots=True)
class _NamespaceView:
    name: str
    slot_bytes: int
    #: What ``BlockTable.check`` found (records against slot tables, free lists, counts).
    table_problems: list[str]
    in_flight: list[bytes]
    extents: list[_ExtentView]
    #: The key index: the shared table's fingerprints and the keys kept apart.
    fingerprints: list[bytes]
    unpublished: dict[bytes, tuple[int, int, int, int, int | None]]


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
    extent_bytes = 0
    for nsv in snap.namespaces:
        name = nsv.name
        problems += [f"{name}: {p}" for p in nsv.table_problems]
        keys: list[bytes] = []
        for ev in nsv.extents:
            extent_bytes += ev.file_bytes
            keys += _check_extent(ev, name, held, pins, problems)
        problems += _check_index(name, keys, nsv.fingerprints, nsv.unpublished)
        want = {k for n, ks, _ in snap.reservations if n == name for k in ks}
        if set(nsv.in_flight) != want:
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


def _check_index(name: str, keys: list[bytes], fingerprints: list[bytes],
                 unpublished: dict[bytes, tuple[int, int, int, int, int | None]]) -> list[str]:
    """The key index holds exactly the COMMITTED blocks' keys (in the table or apart)."""
    problems = []
    if len(set(keys)) != len(keys):
        problems.append(f"{name}: a key is committed in two slots")
    if len(set(fingerprints)) != len(fingerprints):
        problems.append(f"{name}: the shared index holds a key twice")
    want = {fingerprint(k): k for k in keys if k not in unpublished}
    have = set(fingerprints)
    for fp in sorted(want.keys() - have)[:5]:
        problems.append(f"{name}: key {want[fp].hex()} is committed but not in the index")
    stray = len(have - want.keys())
    if stray:
        problems.append(f"{name}: the index holds {stray} keys no slot holds")
    if unpublished.keys() - set(keys):
        problems.append(f"{name}: keys left DRAM but are still kept in the index")
    return problems


def _check_extent(
    ev: _ExtentView,
    name: str,
    held: dict[tuple[str, int, int], int],
    pins: collections.Counter[tuple[str, int]],
    problems: list[str],
) -> list[bytes]:
    """One extent's slot table against the reservations and leases; returns the keys of
    its COMMITTED slots."""
    rows = np.frombuffer(ev.table, dtype=SLOT_DTYPE, count=ev.n_slots)
    states = rows["state"].tolist()
    klens = rows["key_len"].tolist()
    gens = rows["generation"].tolist()
    rec_pins = ev.records["pins"].tolist()
    table = ev.table
    keys: list[bytes] = []
    for slot, st in enumerate(states):
        where = f"{name}: extent {ev.index} slot {slot}"
        ref = ev.id << 32 | slot
        gen = held.get((name, ev.id, slot))
        if st == SlotState.RESERVED:
            if gen is None and slot not in ev.quarantine:
                problems.append(f"{where}: RESERVED on segment but no reservation")
            elif gen is not None and gen != gens[slot]:
                problems.append(f"{where}: reserved at generation {gen}, the slot has "
                                f"{gens[slot]}")
        elif gen is not None:
            problems.append(f"{where}: reserved but {SlotState(st).name} on segment"
                            if st in (0, 2, 3) else f"{where}: reserved, state byte {st}")
        if st == SlotState.COMMITTED:
            if not 0 < klens[slot] <= MAX_KEY_BYTES:
                problems.append(f"{where}: COMMITTED with a key of {klens[slot]} bytes")
            else:
                at = slot * SLOT_ENTRY_BYTES + KEY_OFFSET
                keys.append(table[at : at + klens[slot]])
        elif st == SlotState.DOOMED and not rec_pins[slot]:
            problems.append(f"{where}: DOOMED on segment but not leased")
        elif st not in (SlotState.FREE, SlotState.RESERVED, SlotState.COMMITTED,
                        SlotState.DOOMED):
            problems.append(f"{where}: state byte {st} is no slot state")
        if slot in ev.quarantine and st != SlotState.RESERVED:
            problems.append(f"{where}: quarantined but {st}")
        by_calls = pins.get((name, ref), 0)
        if rec_pins[slot] != by_calls:
            problems.append(f"{where}: pins {rec_pins[slot]} != leases {by_calls}")
    return keys


def model_snapshot(store: Store) -> CheckSnapshot:
    """The model's snapshot of ``store`` (as ``Store.check_snapshot`` took it before)."""
    leases = [(lease.ns.name, lease.refs.copy()) for lease in store.state.leases.values()]
    reservations = [(r.session.ns.name, r.keys, [(e.id, slot, gen) for e, slot, gen
                                                 in r.places])
                    for r in store.state.reservations.values()]
    reservations += [(s.ns.name, [], s.grants.places())
                     for s in store.sessions.values() if s.grants]
    namespaces = []
    for ns in store.namespaces.values():
        shared = ns.index.table
        extents = []
        for ext in ns.extents:
            refs = (np.uint64(ext.id) << np.uint64(32)) | np.arange(ext.n_slots, dtype=np.uint64)
            extents.append(_ExtentView(
                id=ext.id, index=ext.segment.index, n_slots=ext.n_slots,
                file_bytes=ext.bytes, quarantine=set(ext.quarantine),
                table=ext.segment.raw_table(), records=ns.table.inspect(refs).copy(),
                slot_bytes=ext.segment.layout.slot_bytes))
        namespaces.append(_NamespaceView(
            name=ns.name, table_problems=ns.table.check(), in_flight=list(ns.in_flight),
            extents=extents, fingerprints=shared.fingerprints(),
            unpublished=dict(shared.unpublished), slot_bytes=ns.slot_bytes))
    return CheckSnapshot(namespaces=namespaces, leases=leases, reservations=reservations,
                         budget_free=store.budget_free + store.growing_bytes,
                         capacity=store.capacity)


def model_check(store: Store) -> list[str]:
    """What the model finds in ``store`` (``Store.check`` but the grant words)."""
    return _cross_check(model_snapshot(store))
