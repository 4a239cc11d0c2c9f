"""Recovery: re-adopting segments of a previous run into a fresh store.

What a previous run left is validated like network input (no file a
client could reach is trusted): every slot field, the entry checksum, the data file's size.  The
tests below corrupt exactly one field of one slot of a stopped segment's
``.meta`` file and check that only that slot is dropped, with its reason
counted, and that the store works afterwards.
"""

from __future__ import annotations

import collections
import os
import struct
from collections.abc import Callable, Iterator

import pytest

from kvtier import _accel
from kvtierd import recovery, segments, shared_index
from kvtierd.block_table import REFERENCED
from kvtierd.segments import (
    DATA_SUFFIX,
    ENTRY_SUM_AT,
    KEY_OFFSET,
    MAGIC,
    MAX_ACCESS_SEQ,
    MAX_GENERATION,
    SLOT_ENTRY_BYTES,
    TABLE_OFFSET,
    Segment,
    SegmentLayout,
    SlotState,
    entry_seed,
    entry_sum,
)
from kvtierd.store import Store

from .conftest import PEER, run, segment_factory

#: The restarted daemon's boot epoch; the stopped segments were written at an older one.
BOOT = 2
OLD_EPOCH = 1
BB = 4096
#: Where each field sits inside a slot entry (format 2).
STATE, KEY_LEN, FLAGS, PAD, LENGTH, CHECKSUM, GENERATION, EPOCH = 0, 1, 2, 3, 8, 16, 24, 32
LAST_ACCESS = 112
Q = struct.Struct("<Q")


def _store(shm_dir: str, capacity: int = 8 << 20) -> Store:
    return Store(capacity=capacity, extent_size=1 << 20, extent_factory=segment_factory(shm_dir),
                 lease_ttl=300, reservation_ttl=60, boot_epoch=BOOT)


def _recovered(shm_dir: str, capacity: int = 8 << 20) -> tuple[Store, recovery.RecoveryReport]:
    """A fresh store that has recovered the segments in ``shm_dir``, and its report."""
    store = _store(shm_dir, capacity)
    return store, recovery.recover(store, shm_dir)


def _segment(shm_dir: str, index: int, *, uid: str = "m", namespace: str = "ns") -> Segment:
    layout = SegmentLayout.fit(BB, 64 << 10)  # 14 slots
    assert layout is not None
    return Segment.create(shm_dir, segment_id=index + 1, namespace=namespace, model_uid=uid,
                          index=index, layout=layout, boot_epoch=OLD_EPOCH, mlock=False)


def test_a_key_committed_twice_keeps_the_more_recent_copy(shm_dir: str) -> None:
    a, b = _segment(shm_dir, 0), _segment(shm_dir, 1)
    a.mark_committed(0, key=b"dup", length=5, checksum=None, last_access=10, generation=1, epoch=1)
    a.mark_committed(1, key=b"dup", length=6, checksum=None, last_access=30, generation=1, epoch=1)
    b.mark_committed(2, key=b"dup", length=7, checksum=None, last_access=20, generation=1, epoch=1)
    b.mark_committed(3, key=b"other", length=8, checksum=None, last_access=5, generation=1, epoch=1)
    b.mark_reserved(4, generation=3)
    for seg in (a, b):
        seg.close(unlink=False)
    store, report = _recovered(shm_dir)
    ns = store.namespaces["ns"]
    assert ns.index[b"dup"].length == 6  # last_access 30 wins over 10 and 20
    assert ns.index[b"other"].length == 8
    assert ns.committed == 2 and ns.recovered == 2 and sum(report.blocks.values()) == 2
    assert ns.reserved == 1  # the slot reserved at the crash is quarantined
    # CLOCK after a restart: blocks used after the median last access keep their bit
    flags = ns.table.inspect([ns.index[b"dup"].ref, ns.index[b"other"].ref])["flags"]
    assert (flags & REFERENCED).tolist() == [REFERENCED, 0]
    assert report.problems == [] and store.check() == []
    store.close_all()


def test_a_segment_that_fails_validation_is_removed_and_reported(shm_dir: str) -> None:
    good, bad = _segment(shm_dir, 0), _segment(shm_dir, 1)
    good.mark_committed(0, key=b"k", length=1, checksum=None, last_access=1, generation=1, epoch=1)
    bad.meta[3] ^= 0xFF  # corrupt the magic
    for seg in (good, bad):
        seg.close(unlink=False)
    store, report = _recovered(shm_dir)
    assert list(store.namespaces["ns"].index) == [b"k"]
    assert len(report.dropped) == 1 and "bad magic" in report.dropped[0]
    assert report.dropped[0].startswith(os.path.basename(bad.meta_path) + ": reformatted: ")
    assert not os.path.exists(bad.meta_path) and not os.path.exists(bad.path)  # both files
    assert sorted(os.listdir(shm_dir)) == sorted(
        os.path.basename(p) for p in (good.meta_path, good.path))
    assert report.problems == [] and store.check() == []
    store.close_all()


def test_capacity_shrink_drops_the_coldest_extents(shm_dir: str) -> None:
    hot, cold = _segment(shm_dir, 0), _segment(shm_dir, 1)
    hot.mark_committed(0, key=b"hot", length=1, checksum=None, last_access=99, generation=1, epoch=1)
    cold.mark_committed(0, key=b"cold", length=1, checksum=None, last_access=1, generation=1,
                        epoch=1)
    for seg in (hot, cold):
        seg.close(unlink=False)
    store, report = _recovered(shm_dir, capacity=hot.layout.file_bytes)  # room for one extent only
    assert list(store.namespaces["ns"].index) == [b"hot"]
    assert any("dropped" in d for d in report.dropped)
    assert not os.path.exists(cold.meta_path) and not os.path.exists(cold.path)
    assert report.problems == [] and store.check() == []
    assert store.namespaces["ns"].extents[0].segment.read_slot(0).state == SlotState.COMMITTED
    store.close_all()


# ======================================================================== per-slot validation
def _payload(key: bytes, length: int) -> bytes:
    return (key * (length // len(key) + 1))[:length]


#: What the stopped segments hold: slot -> (key, length, data checksum).
Rows = dict[int, tuple[bytes, int, int]]


def _commit(seg: Segment, slot: int, key: bytes, *, last_access: int) -> tuple[bytes, int, int]:
    """A committed block the way the daemon writes one: data first, then the slot entry."""
    length = 1000 + 7 * slot
    payload = _payload(key, length)
    with seg.data_view(slot, length) as view:
        view[:] = payload
    checksum = _accel.checksum(payload)
    seg.mark_reserved(slot, generation=slot + 1)
    seg.mark_committed(slot, key=key, length=length, checksum=checksum, last_access=last_access,
                       generation=slot + 1, epoch=OLD_EPOCH)
    return key, length, checksum


def _stopped(shm_dir: str, namespace: str, slots: range) -> tuple[Segment, Rows]:
    seg = _segment(shm_dir, 0, namespace=namespace)
    rows = {s: _commit(seg, s, b"%s-key-%d" % (namespace.encode(), s), last_access=10 + s)
            for s in slots}
    seg.close(unlink=False)  # as after SIGKILL: both files stay, nothing is tidied up
    return seg, rows


@pytest.fixture
def stopped(shm_dir: str) -> Iterator[tuple[Segment, Rows, Segment, Rows]]:
    """Namespace "ns": slots 0..5 and the last slot committed; namespace "other": 0..3."""
    ns_seg, ns_rows = _stopped(shm_dir, "ns", range(6))
    last = ns_seg.layout.n_slots - 1
    seg = Segment.attach(ns_seg.meta_path, segment_id=99)
    ns_rows[last] = _commit(seg, last, b"ns-key-last", last_access=50)
    seg.close(unlink=False)
    other_seg, other_rows = _stopped(shm_dir, "other", range(4))
    yield ns_seg, ns_rows, other_seg, other_rows


def _entry_at(slot: int) -> int:
    return TABLE_OFFSET + slot * SLOT_ENTRY_BYTES


def _poke(seg: Segment, slot: int, at: int, change: Callable[[bytes], bytes], width: int,
          *, resign: bool = False) -> None:
    """Rewrite ``width`` bytes at ``at`` of one slot entry in a stopped segment's .meta file.

    With ``resign`` the entry checksum is recomputed, so only the field check
    itself can catch the forged value.
    """
    fd = os.open(seg.meta_path, os.O_RDWR)
    try:
        base = _entry_at(slot)
        old = os.pread(fd, width, base + at)
        new = change(old)
        assert len(new) == width and new != old
        os.pwrite(fd, new, base + at)
        if resign:
            raw = os.pread(fd, SLOT_ENTRY_BYTES, base)
            os.pwrite(fd, Q.pack(entry_sum(raw, entry_seed(seg.created_unix_ns, slot))),
                      base + ENTRY_SUM_AT)
    finally:
        os.close(fd)


def _set(value: int | bytes) -> Callable[[bytes], bytes]:
    return lambda old: value if isinstance(value, bytes) else (
        Q.pack(value) if len(old) == 8 else bytes([value]))


def _xor(mask: int) -> Callable[[bytes], bytes]:
    return lambda old: bytes([old[0] ^ mask]) + old[1:]


def _add(delta: int) -> Callable[[bytes], bytes]:
    return lambda old: Q.pack(Q.unpack(old)[0] + delta)


#: One field of one slot: (reason counted, offset in the entry, change, width, can re-sign).
FIELD_CASES: dict[str, tuple[str, int, Callable[[bytes], bytes], int, bool]] = {
    "key_len=0": ("key length out of range", KEY_LEN, _set(0), 1, True),
    "key_len=65": ("key length out of range", KEY_LEN, _set(65), 1, True),
    "key_len=255": ("key length out of range", KEY_LEN, _set(255), 1, True),
    "length=0": ("length out of range", LENGTH, _set(0), 8, True),
    "length=block_bytes+1": ("length out of range", LENGTH, _set(BB + 1), 8, True),
    "length=2**64-1": ("length out of range", LENGTH, _set(2**64 - 1), 8, True),
    "flags=3": ("unknown flags", FLAGS, _set(3), 1, True),
    "flags=0x81": ("unknown flags", FLAGS, _set(0x81), 1, True),
    "checksum-without-flag": ("checksum without its flag", FLAGS, _set(0), 1, True),
    "generation=2**48": ("generation out of range", GENERATION, _set(MAX_GENERATION), 8, True),
    "generation=2**64-1": ("generation out of range", GENERATION, _set(2**64 - 1), 8, True),
    # the exact attack: the next touch would have packed 2**64 into a u64
    "last_access=2**64-1": ("access sequence out of range", LAST_ACCESS, _set(2**64 - 1), 8,
                            False),
    "last_access=2**48": ("access sequence out of range", LAST_ACCESS, _set(MAX_ACCESS_SEQ), 8,
                          False),
    "epoch=boot+1": ("commit epoch from the future", EPOCH, _set(BOOT + 1), 8, True),
    "epoch=2**64-1": ("commit epoch from the future", EPOCH, _set(2**64 - 1), 8, True),
    "key-byte": ("entry checksum mismatch", KEY_OFFSET, _xor(0x20), 1, False),
    "byte-past-the-key": ("entry checksum mismatch", KEY_OFFSET + 60, _set(b"x"), 1, False),
    "length-in-range": ("entry checksum mismatch", LENGTH, _add(-1), 8, False),
    "checksum-field": ("entry checksum mismatch", CHECKSUM, _xor(1), 8, False),
    "generation-in-range": ("entry checksum mismatch", GENERATION, _add(1), 8, False),
    "epoch-in-range": ("entry checksum mismatch", EPOCH, _add(-1), 8, False),
    "pad-byte": ("entry checksum mismatch", PAD, _set(1), 1, False),
    "entry-sum-field": ("entry checksum mismatch", ENTRY_SUM_AT, _xor(0x80), 8, False),
    "state=4": ("invalid state byte", STATE, _set(4), 1, False),
    "state=255": ("invalid state byte", STATE, _set(255), 1, False),
}
FIELD_PARAMS = [pytest.param(case, resign, id=f"{case}{'-resigned' if resign else ''}")
                for case, (_, _, _, _, can) in FIELD_CASES.items()
                for resign in ((False, True) if can else (False,))]


def _assert_recovered(store: Store, report: recovery.RecoveryReport, expect: dict[str, Rows],
                      dropped: dict[str, int]) -> None:
    """Exactly ``expect`` was adopted (bytes verified), ``dropped`` counted, all adds up."""
    assert report.problems == []
    assert store.check() == []
    assert report.dropped_slots == collections.Counter(dropped)
    assert {name: len(rows) for name, rows in expect.items() if rows} == report.blocks
    for name, rows in expect.items():
        ns = store.namespaces[name]
        got = {b.slot: (b.key, b.length, b.checksum) for b in ns.index.values()}
        assert got == rows, name
        for block in ns.index.values():
            seg = block.extent.segment
            assert _accel.checksum(seg.data_view(block.slot, block.length)) == block.checksum
            assert seg.read_slot(block.slot).state == SlotState.COMMITTED


def _assert_usable(store: Store, name: str) -> None:
    """Reserve every free slot of the namespace (the freed ones too), write, commit, acquire.

    A forged generation or access sequence that survived into the store would
    make ``mark_reserved``/``touch`` raise ``struct.error`` here.
    """
    ns = store.namespaces[name]
    session = store.open_session(name, ns.block_bytes, ns.model_uid, PEER)
    free = sum(e.free for e in ns.extents)
    keys = [b"%s-new-%d" % (name.encode(), i) for i in range(free)]
    res = run(store, store.reserve(session, keys))
    assert len(res.slots) == free
    sums = []
    for key, grant in zip(keys, res.slots, strict=True):
        seg = next(e.segment for e in ns.extents if e.segment.segment_id == grant.segment_id)
        payload = _payload(key, 777)
        with seg.data_view(grant.offset // seg.layout.slot_bytes, len(payload)) as view:
            view[:] = payload
        sums.append(_accel.checksum(payload))
    assert store.commit(session, res.reservation_id, [777] * free, sums) == free
    everything = list(ns.index)
    lease = store.acquire(session, everything)
    assert len(lease.slots) == len(everything)
    for grant in lease.slots:
        seg = next(e.segment for e in ns.extents if e.segment.segment_id == grant.segment_id)
        with seg.data_view(grant.offset // seg.layout.slot_bytes, grant.length) as view:
            assert _accel.checksum(view) == grant.checksum
    store.release(session, lease.lease_id)
    store.close_session(session)
    assert store.check() == []


@pytest.mark.parametrize(("case", "resign"), FIELD_PARAMS)
def test_a_slot_with_one_bad_field_is_dropped_alone_and_the_namespace_works(
    shm_dir: str, stopped: tuple[Segment, Rows, Segment, Rows], case: str, resign: bool,
) -> None:
    ns_seg, ns_rows, _, other_rows = stopped
    reason, at, change, width, _ = FIELD_CASES[case]
    victim = 0  # the lowest slot: the next reserve takes it again
    _poke(ns_seg, victim, at, change, width, resign=resign)
    store, report = _recovered(shm_dir)
    expect = {s: r for s, r in ns_rows.items() if s != victim}
    _assert_recovered(store, report, {"ns": expect, "other": other_rows}, {reason: 1})
    ext = store.namespaces["ns"].extents[0]
    assert ext.segment.read_slot(victim).state == SlotState.FREE  # freed in the table too
    assert ext.segment.read_slot(victim).generation < MAX_GENERATION
    _assert_usable(store, "ns")
    _assert_usable(store, "other")
    store.close_all()


def test_a_slot_whose_data_a_client_cut_off_is_dropped_and_the_file_restored(
    shm_dir: str, stopped: tuple[Segment, Rows, Segment, Rows],
) -> None:
    ns_seg, ns_rows, _, other_rows = stopped
    lay = ns_seg.layout
    last = lay.n_slots - 1
    os.truncate(ns_seg.path, last * lay.slot_bytes + 100)  # into the last slot's block
    store, report = _recovered(shm_dir)
    assert os.path.getsize(ns_seg.path) == lay.data_bytes
    expect = {s: r for s, r in ns_rows.items() if s != last}
    _assert_recovered(store, report, {"ns": expect, "other": other_rows},
                      {"data cut off by a client": 1})
    assert report.dropped == []  # the segment itself is kept
    _assert_usable(store, "ns")
    store.close_all()


def test_a_data_file_a_client_grew_is_cut_back_and_every_block_survives(
    shm_dir: str, stopped: tuple[Segment, Rows, Segment, Rows],
) -> None:
    ns_seg, ns_rows, _, other_rows = stopped
    os.truncate(ns_seg.path, ns_seg.layout.data_bytes + (256 << 20))
    store, report = _recovered(shm_dir)
    assert os.path.getsize(ns_seg.path) == ns_seg.layout.data_bytes
    _assert_recovered(store, report, {"ns": ns_rows, "other": other_rows}, {})
    assert report.dropped == []
    _assert_usable(store, "ns")
    store.close_all()


@pytest.mark.parametrize("source", ["another-slot", "another-segment"])
def test_a_valid_row_copied_elsewhere_does_not_verify(
    shm_dir: str, stopped: tuple[Segment, Rows, Segment, Rows], source: str,
) -> None:
    """The entry checksum is seeded with the segment and the slot: a replayed row is dropped."""
    ns_seg, ns_rows, other_seg, other_rows = stopped
    src = ns_seg if source == "another-slot" else other_seg
    with open(src.meta_path, "rb") as f:
        row = os.pread(f.fileno(), SLOT_ENTRY_BYTES, _entry_at(1))
    _poke(ns_seg, 2, 0, lambda old: row, SLOT_ENTRY_BYTES)
    store, report = _recovered(shm_dir)
    expect = {s: r for s, r in ns_rows.items() if s != 2}
    _assert_recovered(store, report, {"ns": expect, "other": other_rows},
                      {"entry checksum mismatch": 1})
    _assert_usable(store, "ns")
    store.close_all()


@pytest.mark.parametrize("state", [SlotState.FREE, SlotState.DOOMED])
def test_a_freed_or_deleted_row_never_comes_back(shm_dir: str, state: SlotState) -> None:
    """A freed row set back to COMMITTED does not verify; a DOOMED row is freed, not adopted."""
    seg = _segment(shm_dir, 0)
    rows = {s: _commit(seg, s, b"key-%d" % s, last_access=s + 1) for s in range(3)}
    if state == SlotState.FREE:
        seg.mark_free(1)
        seg.meta[_entry_at(1)] = SlotState.COMMITTED  # a torn/forged state byte
        dropped = {"entry checksum mismatch": 1}
    else:
        seg.mark_doomed(1)  # deleted while a reader held it, then the daemon died
        dropped = {}
    seg.close(unlink=False)
    store, report = _recovered(shm_dir)
    _assert_recovered(store, report, {"ns": {0: rows[0], 2: rows[2]}}, dropped)
    assert store.namespaces["ns"].extents[0].segment.read_slot(1).state == SlotState.FREE
    _assert_usable(store, "ns")
    store.close_all()


# ======================================================================== orphaned files
def test_a_data_file_without_metadata_is_removed_and_reported(shm_dir: str) -> None:
    """Format 1 kept header and table in the .seg file; such a file (or a lost .meta) is
    a cold start for its extent, never read."""
    keep, rows = _stopped(shm_dir, "other", range(2))
    stray = os.path.join(shm_dir, "0123456789abcdef.000000" + DATA_SUFFIX)
    with open(stray, "wb") as f:
        f.write(MAGIC + struct.pack("<I", 1) + bytes(3 * 4096))  # a format-1 header, say
    store, report = _recovered(shm_dir)
    assert report.dropped == [f"{os.path.basename(stray)}: reformatted: no metadata file beside "
                              "it (lost, or a format 1 segment of an older kvtierd)"]
    assert not os.path.exists(stray)
    _assert_recovered(store, report, {"other": rows}, {})
    assert sorted(os.listdir(shm_dir)) == sorted(
        os.path.basename(p) for p in (keep.meta_path, keep.path))
    store.close_all()


def test_a_metadata_file_without_its_data_file_is_removed_and_reported(shm_dir: str) -> None:
    keep, rows = _stopped(shm_dir, "other", range(2))
    lost, _ = _stopped(shm_dir, "ns", range(3))
    os.unlink(lost.path)
    store, report = _recovered(shm_dir)
    assert len(report.dropped) == 1
    assert report.dropped[0].startswith(f"{os.path.basename(lost.meta_path)}: reformatted: its "
                                        "data file cannot be opened")
    assert not os.path.exists(lost.meta_path)
    assert "ns" not in store.namespaces
    _assert_recovered(store, report, {"other": rows}, {})
    assert sorted(os.listdir(shm_dir)) == sorted(
        os.path.basename(p) for p in (keep.meta_path, keep.path))
    store.close_all()


# =========================================================== forged values near the limits
# Values adoption accepts but that would overflow later (generations, the access sequence):
# a restart after them must not cost blocks or leave the store inconsistent.
def test_a_reserved_slot_with_an_out_of_range_generation_leaves_the_store_consistent(
    shm_dir: str,
) -> None:
    seg = _segment(shm_dir, 0)
    rows = {0: _commit(seg, 0, b"kept", last_access=1)}
    seg.mark_reserved(1, generation=MAX_GENERATION)  # a writer's slot at the crash, forged
    seg.close(unlink=False)
    store, report = _recovered(shm_dir)
    _assert_recovered(store, report, {"ns": rows}, {})
    store.close_all()


def test_an_adopted_but_forged_access_sequence_does_not_cost_blocks_at_the_next_restart(
    shm_dir: str,
) -> None:
    seg = _segment(shm_dir, 0)
    rows = {0: _commit(seg, 0, b"kept", last_access=1)}
    seg.close(unlink=False)
    _poke(seg, 0, LAST_ACCESS, _set(MAX_ACCESS_SEQ - 1), 8)  # in range: adopted
    store, report = _recovered(shm_dir)
    _assert_recovered(store, report, {"ns": rows}, {})
    _assert_usable(store, "ns")  # commits 13 blocks and reads all 14
    store.close_all()
    again, report = _recovered(shm_dir)
    assert report.dropped_slots == collections.Counter()
    assert report.blocks == {"ns": 14}
    again.close_all()


def test_a_forged_generation_of_a_free_slot_does_not_cost_blocks_at_the_next_restart(
    shm_dir: str,
) -> None:
    seg = _segment(shm_dir, 0)
    rows = {1: _commit(seg, 1, b"kept", last_access=1)}
    seg.close(unlink=False)
    _poke(seg, 0, GENERATION, _set(MAX_GENERATION - 1), 8)  # slot 0 is FREE
    store, report = _recovered(shm_dir)
    _assert_recovered(store, report, {"ns": rows}, {})
    _assert_usable(store, "ns")
    store.close_all()
    again, report = _recovered(shm_dir)
    assert report.dropped_slots == collections.Counter()
    assert report.blocks == {"ns": 14}
    again.close_all()


def test_the_index_table_made_ahead_from_the_headers_is_the_one_recovery_fills(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvtierd makes each namespace's key index table from the segment headers before
    it imports the rest of itself (``segments.slots_by_namespace`` ->
    ``shared_index.prepare_tables``): recovery fills that table when it is the size it
    wants, and closes every table made ahead that it does not take."""
    layout = SegmentLayout.fit(BB, 4 << 20)
    assert layout is not None and layout.n_slots > 700  # past MIN_CAPACITY's 2/3
    full = Segment.create(shm_dir, segment_id=1, namespace="full", model_uid="m", index=0,
                          layout=layout, boot_epoch=OLD_EPOCH, mlock=False)
    sparse = Segment.create(shm_dir, segment_id=2, namespace="sparse", model_uid="m", index=0,
                            layout=layout, boot_epoch=OLD_EPOCH, mlock=False)
    for slot in range(layout.n_slots):
        full.mark_committed(slot, key=b"%016d" % slot, length=1, checksum=None,
                            last_access=slot + 1, generation=1, epoch=OLD_EPOCH)
    sparse.mark_committed(0, key=b"only", length=1, checksum=None, last_access=1,
                          generation=1, epoch=OLD_EPOCH)
    bad = _segment(shm_dir, 1, namespace="full")
    bad.meta[3] ^= 0xFF  # counts nothing (recovery drops it)
    misnamed = _segment(shm_dir, 0, namespace="other")
    for seg in (full, sparse, bad, misnamed):
        seg.close(unlink=False)
    os.rename(misnamed.meta_path, os.path.join(shm_dir, "elsewhere.meta"))
    with open(os.path.join(shm_dir, "junk.meta"), "wb") as f:
        f.write(b"\xff" * 5000)
    counts = segments.slots_by_namespace(shm_dir, max_bytes=1 << 30)
    assert counts == {"full": layout.n_slots, "sparse": layout.n_slots}
    assert segments.slots_by_namespace(shm_dir, max_bytes=100 * BB) == {"full": 100,
                                                                       "sparse": 100}
    monkeypatch.setattr(shared_index, "POPULATE_MIN_BYTES", 0)  # (small tables too)
    shared_index.prepare_tables(counts)
    made = dict(shared_index._prepared)
    assert sorted(made) == ["full", "sparse"]
    store, report = _recovered(shm_dir, capacity=64 << 20)
    assert shared_index._prepared == {}
    full_ns, sparse_ns = store.namespaces["full"], store.namespaces["sparse"]
    assert full_ns.index.table.serial == made["full"].serial  # filled the one made ahead
    assert sparse_ns.index.table.serial != made["sparse"].serial  # 1 key: its own, small
    with pytest.raises(ValueError):
        made["sparse"].mm.read_byte()  # closed
    assert full_ns.index.find([b"%016d" % s for s in range(layout.n_slots)]).all()
    assert sparse_ns.index.find([b"only"]).all()
    assert report.problems == [] and store.check() == []
    store.close_all()


def test_the_median_last_access_is_exact_below_its_sample_and_close_above() -> None:
    """``_median_access``: the threshold of the CLOCK bits after a restart, the median of
    the adopted blocks' last accesses -- exact up to ``MEDIAN_SAMPLE`` of them, from an
    even sample of each extent past it (an exact median of 4M blocks cost ~20 ms of a
    warm start), within a fraction of a percent of the ranks there."""
    import numpy as np

    small = [np.arange(1, 100, dtype=np.uint64), np.arange(1000, 1101, dtype=np.uint64)]
    assert recovery._median_access(small) == int(np.median(np.concatenate(small)))
    assert recovery._median_access([]) == 0
    assert recovery._median_access([np.zeros(0, dtype=np.uint64)]) == 0
    rng = np.random.default_rng(5)
    big = [rng.integers(0, 1 << 40, size=700_000, dtype=np.uint64) for _ in range(3)]
    every = np.sort(np.concatenate(big))
    got = recovery._median_access(big)
    rank = int(np.searchsorted(every, got)) / len(every)
    assert 0.497 < rank < 0.503, rank


@pytest.mark.parametrize(("given", "want"), [(None, "1"), ("3", "3")])
def test_kvtierd_keeps_openblas_to_one_thread_unless_told(given: str | None, want: str) -> None:
    """kvtierd's entry sets OPENBLAS_NUM_THREADS=1 before numpy loads (its threads spin
    between calls: a core of a small host taken from recovery and the event loop), so
    the process has no thread but its own after numpy's import; an operator's own value
    stays."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    out = subprocess.run(
        [sys.executable, "-c", "import os, kvtierd.__main__, numpy; "
         "print(os.environ['OPENBLAS_NUM_THREADS'], len(os.listdir('/proc/self/task')))"],
        env=env, capture_output=True, text=True, check=True, timeout=60)
    value, threads = out.stdout.split()
    assert value == want
    if given is None:
        assert threads == "1"
