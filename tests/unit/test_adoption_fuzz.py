"""Adoption fuzzing: arbitrary bytes in a stopped daemon's metadata.

Hypothesis writes a few arbitrary bytes anywhere into the header and slot
table of namespace A's ``.meta`` file, as left by a daemon killed while
serving (committed, read, deleted, leased-and-deleted and half-written
blocks).  The next start must never crash, never serve a block whose
checksum does not verify against its bytes (every adopted row of A is one
that was really committed at that slot), keep namespace B intact, add up
(``check()``), and take new writes and reads in both namespaces.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct

import xxhash
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtier import _accel
from kvtierd import recovery
from kvtierd import segments as S
from kvtierd.segments import (
    ENTRY_SUM_AT,
    KEY_OFFSET,
    MAX_ACCESS_SEQ,
    MAX_GENERATION,
    SLOT_ENTRY_BYTES,
    TABLE_OFFSET,
    Segment,
    SegmentLayout,
    SlotState,
)
from kvtierd.store import Store

from .conftest import BOOT_EPOCH, PEER, make_shm_dir, make_store, run, segment_factory

A, B = "fuzz/a", "fuzz/b"
BB = 4096
EXTENT = 64 << 10
CAPACITY = 1 << 20
LAYOUT = SegmentLayout.fit(BB, EXTENT)
assert LAYOUT is not None
N_SLOTS = LAYOUT.n_slots
META_BYTES = LAYOUT.meta_bytes
HEADER_END = S._HEADER.size + S._HEADER_SUM.size
TABLE_END = TABLE_OFFSET + N_SLOTS * SLOT_ENTRY_BYTES
#: Where the fields of a slot entry start (format 2), and the last key byte.
FIELDS = [0, 1, 2, 3, 8, 16, 24, 32, KEY_OFFSET, KEY_OFFSET + 5, ENTRY_SUM_AT - 1, ENTRY_SUM_AT,
          112, 120]
Q = struct.Struct("<Q")
#: Slots of A's extent as the killed daemon left them (``_build`` checks them): 0..8
#: committed but for DELETED (freed, then reserved again by a writer still copying at the
#: kill: HALF_WRITTEN) and DOOMED (deleted while a reader held it); the rest never used.
HALF_WRITTEN = DELETED = 3
DOOMED = 4
USED_SLOTS = 9

#: (key, length, checksum) as committed.
Row = tuple[bytes, int, int | None]


@dataclasses.dataclass
class Stopped:
    """What the killed daemon left: namespace A's metadata file and the ground truth."""

    a_meta: str
    #: slot -> every row ever committed at that slot of A's extent
    a_rows: dict[int, set[Row]]
    #: key -> (slot, length, checksum) of B's committed blocks
    b_blocks: dict[bytes, tuple[int, int, int | None]]


def _payload(key: bytes, length: int) -> bytes:
    return (key * (length // len(key) + 1))[:length]


def _data_ok(seg: Segment, slot: int, length: int, checksum: int | None) -> bool:
    return checksum is None or _accel.checksum(seg.data_view(slot, length)) == checksum


def _put(store: Store, name: str, keys: list[bytes], *, checksums: bool = True) -> dict[bytes, Row]:
    """Reserve, write (through the slot's bytes, as a client does) and commit ``keys``."""
    ns = store.namespaces.get(name)
    session = store.open_session(name, BB, "m", PEER) if ns is None else next(
        s for s in store.sessions.values() if s.ns is ns)
    res = run(store, store.reserve(session, keys))
    assert len(res.slots) == len(keys)
    lengths, sums, rows = [], [], {}
    for i, (key, grant) in enumerate(zip(keys, res.slots, strict=True)):
        seg = next(e.segment for e in session.ns.extents
                   if e.segment.segment_id == grant.segment_id)
        length = 100 + 37 * i
        payload = _payload(key, length)
        with seg.data_view(grant.offset // seg.layout.slot_bytes, length) as view:
            view[:] = payload
        lengths.append(length)
        sums.append(_accel.checksum(payload))
        rows[key] = (key, length, sums[-1] if checksums else None)
    store.commit(session, res.reservation_id, lengths, sums if checksums else None)
    return rows


def _build(shm_dir: str) -> Stopped:
    """Run a daemon's store over both namespaces, then stop it as a SIGKILL would."""
    env = make_store(shm_dir, capacity=CAPACITY, extent_size=EXTENT)
    store = env.store
    committed = _put(store, A, [b"a-%d" % i for i in range(8)])
    committed |= _put(store, A, [b"a-plain"], checksums=False)
    b_rows = _put(store, B, [b"b-%d" % i for i in range(6)])
    a_session = next(s for s in store.sessions.values() if s.ns.name == A)
    ns_a = store.namespaces[A]
    (ext,) = ns_a.extents
    assert ext.segment.layout == LAYOUT
    slot_of = {k: b.slot for k, b in ns_a.index.items()}
    a_rows: dict[int, set[Row]] = {}
    for key, row in committed.items():
        a_rows.setdefault(slot_of[key], set()).add(row)
    # Reads (LRU order), a delete, a delete while leased (DOOMED), a write in flight.
    lease = store.acquire(a_session, [b"a-1", b"a-2"])
    store.release(a_session, lease.lease_id)
    store.delete(a_session, [b"a-3"])  # FREE again: its old key stays in the row
    held = store.acquire(a_session, [b"a-4"])
    store.delete(a_session, [b"a-4"])  # DOOMED: freed at the release that never comes
    assert held.lease_id
    half = run(store, store.reserve(a_session, [b"a-half"]))  # RESERVED at the kill
    assert [g.offset // BB for g in half.slots] == [HALF_WRITTEN] and slot_of[b"a-3"] == DELETED
    assert slot_of[b"a-4"] == DOOMED and len(slot_of) == USED_SLOTS
    seg = ext.segment
    assert [seg.read_slot(i).state for i in range(N_SLOTS)] == (
        [SlotState.COMMITTED] * 3 + [SlotState.RESERVED, SlotState.DOOMED]
        + [SlotState.COMMITTED] * 4 + [SlotState.FREE] * (N_SLOTS - USED_SLOTS))
    assert store.check() == []
    b_ns = store.namespaces[B]
    b_blocks = {k: (b.slot, b.length, b.checksum) for k, b in b_ns.index.items()}
    assert {k: (ln, cs) for k, (_, ln, cs) in b_blocks.items()} == {
        k: (ln, cs) for k, (_, ln, cs) in b_rows.items()}
    meta = ext.segment.meta_path
    store.close_all()  # unmapped, nothing tidied up: what SIGKILL leaves
    return Stopped(meta, a_rows, b_blocks)


def _cycle(store: Store, name: str) -> None:
    """New writes, then a read of everything, in a namespace (declared afresh if it is gone)."""
    session = store.open_session(name, BB, "m", PEER)
    ns = session.ns
    before = list(ns.index)
    new = [b"%s-new-%d" % (name.encode(), i) for i in range(3)]
    res = run(store, store.reserve(session, new))
    lengths, sums = [], []
    for key, grant in zip(new, res.slots, strict=True):
        seg = next(e.segment for e in ns.extents if e.segment.segment_id == grant.segment_id)
        payload = _payload(key, 999)
        with seg.data_view(grant.offset // seg.layout.slot_bytes, len(payload)) as view:
            view[:] = payload
        lengths.append(len(payload))
        sums.append(_accel.checksum(payload))
    assert store.commit(session, res.reservation_id, lengths, sums) == len(new)
    lease = store.acquire(session, before + new)
    assert len(lease.slots) == len(before) + len(new)
    for grant in lease.slots:
        seg = next(e.segment for e in ns.extents if e.segment.segment_id == grant.segment_id)
        assert _data_ok(seg, grant.offset // seg.layout.slot_bytes, grant.length,
                        grant.checksum)
    store.release(session, lease.lease_id)
    store.close_session(session)


_SPECIAL = [Q.pack(v) for v in (0, 1, 2**64 - 1, MAX_GENERATION - 1, MAX_GENERATION,
                                MAX_ACCESS_SEQ - 1, BOOT_EPOCH + 1, BB, BB + 1)] + [
    bytes([v]) for v in (SlotState.FREE, SlotState.RESERVED, SlotState.COMMITTED,
                         SlotState.DOOMED, 4, 0xFF, 64, 65)]
OFFSETS = st.one_of(
    st.integers(0, HEADER_END - 1),  # header fields and the header checksum
    st.builds(lambda slot, field: TABLE_OFFSET + slot * SLOT_ENTRY_BYTES + field,
              st.one_of(st.integers(0, USED_SLOTS), st.integers(0, N_SLOTS - 1)),
              st.sampled_from(FIELDS)),  # one field of a slot, mostly of one in use
    st.integers(0, META_BYTES - 1),  # anywhere at all
)
DATA = st.one_of(st.binary(min_size=1, max_size=16), st.sampled_from(_SPECIAL))
WRITES = st.lists(st.tuples(OFFSETS, DATA), min_size=1, max_size=3)


def _slot_field(slot: int, field: int) -> int:
    return TABLE_OFFSET + slot * SLOT_ENTRY_BYTES + field


def _fresh_store(shm_dir: str, boot_epoch: int) -> Store:
    return Store(capacity=CAPACITY, extent_size=EXTENT,
                 extent_factory=segment_factory(shm_dir, boot_epoch), lease_ttl=30,
                 reservation_ttl=10, boot_epoch=boot_epoch, publish=True)


def _visible(store: Store) -> dict[str, dict[bytes, tuple[int, int, int | None]]]:
    return {name: {k: (b.slot, b.length, b.checksum) for k, b in ns.index.items()}
            for name, ns in store.namespaces.items()}


def _restart_and_check(shm_dir: str, stopped: Stopped) -> None:
    """Start a fresh store on what was left; assert the issue's properties; use both
    namespaces afterwards; then kill that daemon too: the next start adopts every block it
    served, drops nothing (what the damage left must not cost blocks later)."""
    store = _fresh_store(shm_dir, BOOT_EPOCH + 1)
    try:
        report = recovery.recover(store, shm_dir)  # never raises
        assert report.problems == []
        assert store.check() == []
        # A: every adopted block is a row really committed at its slot, whose bytes verify.
        # (A DOOMED state byte set back to COMMITTED does bring its block back: its row and
        # bytes are genuine, only the state byte is outside the entry checksum.)
        ns_a = store.namespaces.get(A)
        for key, block in (ns_a.index.items() if ns_a is not None else ()):
            row = (key, block.length, block.checksum)
            assert row in stopped.a_rows.get(block.slot, set()), (block.slot, row)
            assert block.length <= ns_a.block_bytes
            assert _data_ok(block.extent.segment, block.slot, block.length, block.checksum)
        # B: untouched, every block adopted where it was.
        ns_b = store.namespaces[B]
        assert {k: (b.slot, b.length, b.checksum) for k, b in ns_b.index.items()} == (
            stopped.b_blocks)
        for block in ns_b.index.values():
            assert _data_ok(block.extent.segment, block.slot, block.length, block.checksum)
        assert report.blocks[B] == len(stopped.b_blocks)
        # Both namespaces take writes and reads afterwards (A declared afresh if it is gone
        # or came back with another layout).
        _cycle(store, A)
        _cycle(store, B)
        assert store.check() == []
        served = _visible(store)
    finally:
        store.close_all()
    again = _fresh_store(shm_dir, BOOT_EPOCH + 2)
    try:
        report = recovery.recover(again, shm_dir)
        assert (report.dropped, report.dropped_slots, report.problems) == ([], {}, [])
        assert _visible(again) == served
        assert again.check() == []
    finally:
        again.close_all()


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@example(writes=[(_slot_field(0, 112), Q.pack(2**64 - 1))])  # the exact attack
@example(writes=[(_slot_field(0, 24), Q.pack(2**64 - 1))])
@example(writes=[(_slot_field(HALF_WRITTEN, 24), Q.pack(MAX_GENERATION))])  # quarantined
@example(writes=[(_slot_field(USED_SLOTS, 24), Q.pack(MAX_GENERATION - 1))])  # a FREE slot
@example(writes=[(_slot_field(HALF_WRITTEN, 0), bytes([SlotState.COMMITTED]))])
@example(writes=[(_slot_field(DOOMED, 0), bytes([SlotState.COMMITTED]))])  # see below
@example(writes=[(_slot_field(USED_SLOTS, 0), bytes([SlotState.COMMITTED]))])  # never used
@example(writes=[(100, b"\xff")])  # the header
@example(writes=[(_slot_field(1, KEY_OFFSET), b"a-5")])  # a key that exists elsewhere
@given(writes=WRITES)
def test_arbitrary_bytes_in_a_stopped_namespaces_metadata_never_serve_a_bad_block(
    writes: list[tuple[int, bytes]],
) -> None:
    shm_dir = make_shm_dir()
    try:
        stopped = _build(shm_dir)
        fd = os.open(stopped.a_meta, os.O_RDWR)
        try:
            for offset, data in writes:
                os.pwrite(fd, data[: META_BYTES - offset], offset)
        finally:
            os.close(fd)
        _restart_and_check(shm_dir, stopped)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


#: Header fields (as ``segments._HEADER`` packs them) and the largest value each can hold.
HEADER_FIELDS = {"version": 2**32 - 1, "n_slots": 2**32 - 1, "index": 2**32 - 1,
                 "block_bytes": 2**64 - 1, "slot_bytes": 2**64 - 1, "table_offset": 2**64 - 1,
                 "data_offset": 2**64 - 1, "boot_epoch": 2**64 - 1, "created": 2**64 - 1,
                 "name_len": 2**16 - 1, "uid_len": 2**16 - 1}
_HEADER_NAMES = ("magic", "version", "n_slots", "index", "block_bytes", "slot_bytes",
                 "table_offset", "data_offset", "boot_epoch", "created", "name_len", "name",
                 "uid_len", "uid")


@st.composite
def _header_change(draw: st.DrawFn) -> tuple[str, int | bytes]:
    field = draw(st.sampled_from([*HEADER_FIELDS, "name", "uid"]))
    if field in ("name", "uid"):
        return field, draw(st.binary(max_size=24))
    top = HEADER_FIELDS[field]
    return field, draw(st.one_of(
        st.integers(0, top), st.integers(0, 2 * BB),  # small values: near real geometry
        st.sampled_from([0, 1, 2, N_SLOTS - 1, N_SLOTS + 1, BB - 1, BB + 1, 2 * BB, top])))


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@example(changes=[("block_bytes", BB - 100)])  # same slot size: a valid, smaller layout
@example(changes=[("created", 1)])  # every entry checksum is seeded with it
@example(changes=[("uid", b"another-model")])
@example(changes=[("index", 1)])
@given(changes=st.lists(_header_change(), min_size=1, max_size=3))
def test_a_re_signed_header_with_arbitrary_fields_is_refused_or_adopted_safely(
    changes: list[tuple[str, int | bytes]],
) -> None:
    """Header fields with a *valid* header checksum (a bug, another writer): the segment is
    refused, or adopted only as far as its rows still verify against it."""
    shm_dir = make_shm_dir()
    try:
        stopped = _build(shm_dir)
        with open(stopped.a_meta, "r+b") as f:
            values = dict(zip(_HEADER_NAMES, S._HEADER.unpack(f.read(S._HEADER.size)),
                              strict=True))
            for field, value in changes:
                values[field] = value
            head = S._HEADER.pack(*(values[n] for n in _HEADER_NAMES))
            f.seek(0)
            f.write(head + S._HEADER_SUM.pack(xxhash.xxh64_intdigest(head)))
        _restart_and_check(shm_dir, stopped)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
