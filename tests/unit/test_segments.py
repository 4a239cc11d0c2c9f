"""Tests for kvtierd.segments (format 2): layout geometry, the header and the slot table in
the daemon-only ``.meta`` file, the data-only ``.seg`` file, attach and the data-file audit."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtierd import segments as S
from kvtierd.segments import (
    ENTRY_SUM_AT,
    FLAG_HAS_CHECKSUM,
    HEADER_BYTES,
    KEY_OFFSET,
    MAGIC,
    MAX_KEY_BYTES,
    META_SUFFIX,
    PAGE,
    SLOT_ENTRY_BYTES,
    TABLE_OFFSET,
    Segment,
    SegmentInvalid,
    SegmentLayout,
    SlotRecord,
    SlotState,
    data_path_of,
    entry_seed,
    entry_sum,
    read_header,
    round_up,
    segment_file_name,
)

MiB = 1 << 20
#: Block sizes from one byte to just past 8 MiB, around every page boundary that matters.
BLOCK_SIZES = [1, 2, 100, 4095, 4096, 4097, 8191, 8192, 65536, 65537, 1 * MiB,
               2 * MiB + 1, 8 * MiB, 8 * MiB + 1]
BUDGETS = [0, 4096, 8192, 12288, 64 * 1024, 1 * MiB, 4 * MiB + 123, 17 * MiB, 64 * MiB]


def _max_slots_that_fit(block_bytes: int, budget: int) -> int:
    """The reference answer, by brute force from the format description (both files)."""
    slot = round_up(block_bytes, PAGE)
    n = 0
    while round_up(TABLE_OFFSET + (n + 1) * SLOT_ENTRY_BYTES, PAGE) + (n + 1) * slot <= budget:
        n += 1
    return n


def _assert_geometry(layout: SegmentLayout, block_bytes: int, budget: int) -> None:
    assert layout.block_bytes == block_bytes
    assert layout.slot_bytes % PAGE == 0
    assert block_bytes <= layout.slot_bytes < block_bytes + PAGE
    assert layout.n_slots >= 1
    # The data file clients map holds the slots and nothing else, from byte 0.
    assert layout.data_offset == 0
    assert layout.data_bytes == layout.n_slots * layout.slot_bytes
    # The metadata file: the header page and the slot table, no bigger than it needs to be.
    assert layout.meta_bytes % PAGE == 0
    assert layout.meta_bytes >= TABLE_OFFSET + layout.n_slots * SLOT_ENTRY_BYTES
    assert layout.meta_bytes == round_up(TABLE_OFFSET + layout.n_slots * SLOT_ENTRY_BYTES, PAGE)
    # The extent's shared memory is both files, and it fits the budget.
    assert layout.file_bytes == layout.meta_bytes + layout.data_bytes
    assert layout.file_bytes <= budget


# ================================================================ layout geometry
@pytest.mark.parametrize("block_bytes", BLOCK_SIZES)
@pytest.mark.parametrize("budget", BUDGETS)
def test_fit_is_page_aligned_fits_the_budget_and_is_the_largest(block_bytes: int, budget: int) -> None:
    layout = SegmentLayout.fit(block_bytes, budget)
    expected = _max_slots_that_fit(block_bytes, budget) if budget <= 17 * MiB else None
    if layout is None:
        assert budget < SegmentLayout.one_slot_file_bytes(block_bytes)
        if expected is not None:
            assert expected == 0
        return
    _assert_geometry(layout, block_bytes, budget)
    if expected is not None:
        assert layout.n_slots == expected
    # one more slot would not fit
    n = layout.n_slots + 1
    assert round_up(TABLE_OFFSET + n * SLOT_ENTRY_BYTES, PAGE) + n * layout.slot_bytes > budget


@pytest.mark.parametrize("block_bytes", BLOCK_SIZES)
def test_fit_returns_none_when_one_slot_does_not_fit(block_bytes: int) -> None:
    one = SegmentLayout.one_slot_file_bytes(block_bytes)
    assert SegmentLayout.fit(block_bytes, one - 1) is None
    assert SegmentLayout.fit(block_bytes, 0) is None
    layout = SegmentLayout.fit(block_bytes, one)
    assert layout is not None
    assert layout.n_slots == 1
    assert layout.file_bytes == one
    _assert_geometry(layout, block_bytes, one)


def test_one_slot_extent_is_header_page_table_page_and_one_rounded_slot() -> None:
    assert SegmentLayout.one_slot_file_bytes(1) == 3 * PAGE
    assert SegmentLayout.one_slot_file_bytes(PAGE) == 3 * PAGE
    assert SegmentLayout.one_slot_file_bytes(PAGE + 1) == 4 * PAGE
    assert SegmentLayout.one_slot_file_bytes(8 * MiB + 1) == 2 * PAGE + 8 * MiB + PAGE
    # ... split as: metadata file = header page + table page, data file = the rounded slot
    layout = SegmentLayout.fit(PAGE + 1, 4 * PAGE)
    assert layout is not None and layout.n_slots == 1
    assert (layout.meta_bytes, layout.data_bytes) == (2 * PAGE, 2 * PAGE)


def test_fit_slot_table_grows_past_one_page_when_many_slots() -> None:
    # 1-byte blocks: one page per slot, 128-byte entries; > 32 slots need a 2nd table page
    layout = SegmentLayout.fit(1, 1 * MiB)
    assert layout is not None
    assert layout.n_slots > HEADER_BYTES // SLOT_ENTRY_BYTES
    assert layout.meta_bytes > TABLE_OFFSET + PAGE
    assert layout.data_bytes == layout.n_slots * PAGE  # the data file is not shifted by it
    _assert_geometry(layout, 1, 1 * MiB)


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    block_bytes=st.integers(1, 8 * MiB + 1),
    budget=st.integers(0, 256 * MiB),
)
def test_fit_geometry_holds_for_any_block_size_and_budget(block_bytes: int, budget: int) -> None:
    layout = SegmentLayout.fit(block_bytes, budget)
    if layout is None:
        assert budget < SegmentLayout.one_slot_file_bytes(block_bytes)
        return
    _assert_geometry(layout, block_bytes, budget)
    n = layout.n_slots + 1
    assert round_up(TABLE_OFFSET + n * SLOT_ENTRY_BYTES, PAGE) + n * layout.slot_bytes > budget


# ================================================================ segments on /dev/shm
def _create(shm_dir: str, *, block_bytes: int = 10_000, budget: int = 1 * MiB, index: int = 3,
            namespace: str = "qwen3-8b/tp4/bf16", model_uid: str = "qwen3-8b@2025-05",
            epoch: int = 0xE90C, segment_id: int = 11) -> Segment:
    layout = SegmentLayout.fit(block_bytes, budget)
    assert layout is not None
    return Segment.create(shm_dir, segment_id=segment_id, namespace=namespace,
                          model_uid=model_uid, index=index, layout=layout, boot_epoch=epoch,
                          mlock=False, prefault_threads=1)


@pytest.fixture
def seg(shm_dir: str) -> Iterator[Segment]:
    s = _create(shm_dir)
    yield s
    s.close(unlink=True)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_create_writes_a_header_that_read_header_validates(shm_dir: str) -> None:
    seg = _create(shm_dir, namespace="ns/a", model_uid="uid-\u00e9", index=5, epoch=123456789)
    try:
        lay = seg.layout
        head = read_header(seg.meta)
        assert head["namespace"] == "ns/a"
        assert head["model_uid"] == "uid-\u00e9"
        assert head["boot_epoch"] == 123456789
        assert head["index"] == 5
        assert head["n_slots"] == lay.n_slots
        assert head["block_bytes"] == lay.block_bytes == 10_000
        assert head["slot_bytes"] == lay.slot_bytes
        assert head["table_offset"] == TABLE_OFFSET
        assert head["data_offset"] == lay.data_offset == 0
        assert head["created_unix_ns"] == seg.created_unix_ns > 0
        # the metadata file itself (what a restarted daemon re-attaches) says the same
        on_disk = _read(seg.meta_path)
        assert read_header(on_disk) == head
        assert len(on_disk) == lay.meta_bytes == len(seg.meta)
    finally:
        seg.close(unlink=True)


def test_the_data_file_holds_no_header_and_no_slot_table(seg: Segment) -> None:
    """What a client maps is payload only: a fresh data file is all zeros, of data_bytes."""
    data = _read(seg.path)
    assert len(data) == seg.layout.data_bytes == len(seg.mm)
    assert MAGIC not in data
    assert data == bytes(len(data))
    # a committed row lands in the metadata file, never in the data file
    seg.mark_committed(0, key=b"k" * MAX_KEY_BYTES, length=1, checksum=7, last_access=1,
                       generation=1, epoch=1)
    assert _read(seg.path) == data
    assert b"k" * MAX_KEY_BYTES in _read(seg.meta_path)


def test_create_names_both_files_after_namespace_and_index_with_owner_only_mode(
    shm_dir: str,
) -> None:
    seg = _create(shm_dir, namespace="ns/b", index=42)
    try:
        assert seg.path == os.path.join(shm_dir, segment_file_name("ns/b", 42))
        assert seg.meta_path == os.path.join(shm_dir, segment_file_name("ns/b", 42, META_SUFFIX))
        assert os.path.basename(seg.path).endswith(".000042.seg")
        assert os.path.basename(seg.meta_path).endswith(".000042.meta")
        assert data_path_of(seg.meta_path) == seg.path
        assert sorted(os.listdir(shm_dir)) == sorted(
            os.path.basename(p) for p in (seg.path, seg.meta_path))
        for path in (seg.path, seg.meta_path):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert seg.mlock_error is not None  # mlock=False says so instead of pretending
    finally:
        seg.close(unlink=True)
    assert not os.path.exists(seg.path)
    assert not os.path.exists(seg.meta_path)
    assert os.listdir(shm_dir) == []


def test_close_without_unlink_keeps_both_files(shm_dir: str) -> None:
    seg = _create(shm_dir)
    seg.close(unlink=False)
    assert read_header(_read(seg.meta_path))["namespace"] == "qwen3-8b/tp4/bf16"
    assert os.path.getsize(seg.meta_path) == seg.layout.meta_bytes
    assert os.path.getsize(seg.path) == seg.layout.data_bytes


def test_unlink_removes_both_files_and_the_mappings_stay_usable(shm_dir: str) -> None:
    seg = _create(shm_dir)
    try:
        seg.unlink()
        assert os.listdir(shm_dir) == []
        seg.mark_committed(0, key=b"k", length=1, checksum=None, last_access=1, generation=1,
                           epoch=1)
        assert seg.read_slot(0).key == b"k"
        with seg.data_view(0, 3) as view:
            view[:] = b"abc"
        assert os.pread(seg.fd, 3, 0) == b"abc"
    finally:
        seg.close(unlink=True)  # unlinking files that are gone is not an error


def test_fresh_segment_has_every_slot_free(seg: Segment) -> None:
    for i in range(seg.layout.n_slots):
        assert seg.read_slot(i).state == SlotState.FREE
    assert (seg.scan()["state"] == SlotState.FREE).all()


def test_corrupting_any_header_byte_makes_read_header_raise(seg: Segment) -> None:
    good = bytes(seg.meta[:HEADER_BYTES])
    read_header(good)
    accepted = []
    for offset in range(S._HEADER.size + S._HEADER_SUM.size):
        page = bytearray(good)
        page[offset] ^= 0x5A
        try:
            read_header(bytes(page))
        except ValueError as exc:
            assert str(exc).startswith(("bad magic", "header checksum mismatch")), str(exc)
        else:
            accepted.append(offset)
    assert accepted == [], f"corrupted header bytes at offsets {accepted} were accepted"


def test_read_header_names_the_bad_magic(seg: Segment) -> None:
    page = bytearray(seg.meta[:HEADER_BYTES])
    page[0:8] = b"NOTASEG!"
    with pytest.raises(ValueError, match=r"bad magic b'NOTASEG!'"):
        read_header(bytes(page))


def _resigned_header(seg: Segment, **changes: Any) -> bytes:
    """The segment's header with fields changed and a *valid* header checksum."""
    names = ("magic", "version", "n_slots", "index", "block_bytes", "slot_bytes",
             "table_offset", "data_offset", "boot_epoch", "created", "name_len", "name",
             "uid_len", "uid")
    values = dict(zip(names, S._HEADER.unpack(bytes(seg.meta[: S._HEADER.size])), strict=True))
    values.update(changes)
    head = S._HEADER.pack(*(values[n] for n in names))
    return head + S._HEADER_SUM.pack(xxhash.xxh64_intdigest(head))


@pytest.mark.parametrize("version", [1, S.FORMAT_VERSION + 1])
def test_read_header_rejects_another_format_version_even_with_a_valid_checksum(
    seg: Segment, version: int,
) -> None:
    with pytest.raises(ValueError, match=f"format version {version}, expected "
                                         f"{S.FORMAT_VERSION}"):
        read_header(_resigned_header(seg, version=version))


def test_read_header_of_a_zeroed_page_raises(seg: Segment) -> None:
    with pytest.raises(ValueError, match="bad magic"):
        read_header(bytes(HEADER_BYTES))


# ================================================================ slot table
def _entry_at(slot: int) -> int:
    return TABLE_OFFSET + slot * SLOT_ENTRY_BYTES


def _entry(seg: Segment, slot: int) -> bytes:
    off = _entry_at(slot)
    return bytes(seg.meta[off : off + SLOT_ENTRY_BYTES])


def _verifies(seg: Segment, slot: int, raw: bytes | None = None) -> bool:
    """Whether a slot entry's stored entry checksum matches its bytes (as recovery checks)."""
    raw = _entry(seg, slot) if raw is None else raw
    (stored,) = struct.unpack_from("<Q", raw, ENTRY_SUM_AT)
    return entry_sum(raw, entry_seed(seg.created_unix_ns, slot)) == stored


def test_mark_reserved_reads_back_reserved_with_its_generation(seg: Segment) -> None:
    seg.mark_reserved(2, generation=17)
    assert seg.read_slot(2) == SlotRecord(SlotState.RESERVED, b"", 0, None, 0, 17, 0)
    raw = _entry(seg, 2)
    assert raw[ENTRY_SUM_AT : ENTRY_SUM_AT + 8] == bytes(8)  # a reserved row never verifies


def test_mark_committed_reads_back_every_field(seg: Segment) -> None:
    key = bytes(range(MAX_KEY_BYTES))
    seg.mark_reserved(1, generation=9)
    seg.mark_committed(1, key=key, length=9_999, checksum=2**64 - 1, last_access=2**40,
                       generation=9, epoch=77)
    assert seg.read_slot(1) == SlotRecord(SlotState.COMMITTED, key, 9_999, 2**64 - 1, 2**40, 9, 77)
    assert _verifies(seg, 1)


def test_slot_entry_fields_sit_at_their_documented_offsets(seg: Segment) -> None:
    """state 0, key_len 1, flags 2, length 8, checksum 16, generation 24, epoch 32, key 40..104,
    entry_sum 104, last_access 112; the pad bytes and the tail stay zero."""
    key = b"K" * 23
    seg.mark_committed(3, key=key, length=0x0102, checksum=0xC0FFEE, last_access=0xACCE55,
                       generation=0x6E4, epoch=0xE90C)
    raw = _entry(seg, 3)
    assert raw[0] == SlotState.COMMITTED
    assert raw[1] == len(key)
    assert raw[2] == FLAG_HAS_CHECKSUM
    assert raw[3:8] == bytes(5)
    assert struct.unpack_from("<QQQQ", raw, 8) == (0x0102, 0xC0FFEE, 0x6E4, 0xE90C)
    assert KEY_OFFSET == 40 and ENTRY_SUM_AT == 104 and S._LAST_ACCESS_AT == 112
    assert raw[40 : 40 + len(key)] == key and raw[40 + len(key) : 104] == bytes(104 - 40 - len(key))
    (stored,) = struct.unpack_from("<Q", raw, 104)
    assert stored == xxhash.xxh3_64_intdigest(raw[1:104], entry_seed(seg.created_unix_ns, 3))
    assert struct.unpack_from("<Q", raw, 112) == (0xACCE55,)
    assert raw[120:] == bytes(SLOT_ENTRY_BYTES - 120)
    # the numpy record recovery scans with agrees field by field
    row = seg.scan()[3]
    assert (int(row["state"]), int(row["key_len"]), int(row["flags"]), int(row["length"]),
            int(row["checksum"]), int(row["generation"]), int(row["epoch"]),
            int(row["last_access"]), int(row["entry_sum"]), bytes(row["key"])) == (
        SlotState.COMMITTED, len(key), FLAG_HAS_CHECKSUM, 0x0102, 0xC0FFEE, 0x6E4, 0xE90C,
        0xACCE55, stored, key)


def test_entry_checksum_covers_every_byte_but_the_state_and_the_last_access(seg: Segment) -> None:
    seg.mark_committed(4, key=b"covered", length=500, checksum=0x1234, last_access=9,
                       generation=3, epoch=2)
    good = _entry(seg, 4)
    assert _verifies(seg, 4, good)
    uncovered = []
    for offset in range(SLOT_ENTRY_BYTES):
        raw = bytearray(good)
        raw[offset] ^= 0x01
        if _verifies(seg, 4, bytes(raw)):
            uncovered.append(offset)
    assert uncovered == [0, *range(S._LAST_ACCESS_AT, SLOT_ENTRY_BYTES)]


def test_entry_checksum_binds_a_row_to_its_slot_and_its_segment(shm_dir: str) -> None:
    a = _create(shm_dir, index=0)
    b = _create(shm_dir, index=1)
    try:
        assert a.created_unix_ns != b.created_unix_ns
        a.mark_committed(1, key=b"k", length=7, checksum=5, last_access=1, generation=1, epoch=1)
        row = _entry(a, 1)
        assert _verifies(a, 1, row)
        assert not _verifies(a, 2, row)  # copied to another slot of the same segment
        assert not _verifies(b, 1, row)  # copied to the same slot of another segment
    finally:
        a.close(unlink=True)
        b.close(unlink=True)


def test_mark_committed_without_checksum_reads_back_none_and_zero_checksum_is_kept(
    seg: Segment,
) -> None:
    seg.mark_committed(0, key=b"a", length=1, checksum=None, last_access=1, generation=1, epoch=1)
    assert seg.read_slot(0).checksum is None
    raw = _entry(seg, 0)
    assert raw[2] == 0 and raw[16:24] == bytes(8)  # no flag, and no checksum without it
    seg.mark_committed(1, key=b"b", length=1, checksum=0, last_access=1, generation=1, epoch=1)
    assert seg.read_slot(1).checksum == 0
    assert _entry(seg, 1)[2] == FLAG_HAS_CHECKSUM
    assert _verifies(seg, 0) and _verifies(seg, 1)


def test_mark_free_reads_back_free_and_clears_the_entry_checksum(seg: Segment) -> None:
    seg.mark_reserved(0, generation=1)
    seg.mark_committed(0, key=b"k", length=5, checksum=1, last_access=3, generation=1, epoch=2)
    seg.mark_free(0)
    assert seg.read_slot(0).state == SlotState.FREE
    raw = _entry(seg, 0)
    assert raw[ENTRY_SUM_AT : ENTRY_SUM_AT + 8] == bytes(8)
    # a freed row whose state byte came back (a bit flip, a forged table) no longer verifies
    assert not _verifies(seg, 0, bytes([SlotState.COMMITTED]) + raw[1:])


def test_reserve_after_free_clears_the_previous_key(seg: Segment) -> None:
    seg.mark_committed(0, key=b"old", length=5, checksum=1, last_access=3, generation=1, epoch=2)
    seg.mark_free(0)
    seg.mark_reserved(0, generation=2)
    assert seg.read_slot(0) == SlotRecord(SlotState.RESERVED, b"", 0, None, 0, 2, 0)
    assert b"old" not in _entry(seg, 0)


def test_mark_doomed_flips_only_the_state_byte(seg: Segment) -> None:
    seg.mark_committed(2, key=b"gone", length=5, checksum=1, last_access=3, generation=1, epoch=2)
    before = _entry(seg, 2)
    seg.mark_doomed(2)
    after = _entry(seg, 2)
    assert after[0] == SlotState.DOOMED and after[1:] == before[1:]
    assert seg.read_slot(2).state == SlotState.DOOMED


def test_touch_updates_last_access_only(seg: Segment) -> None:
    seg.mark_committed(3, key=b"key3", length=123, checksum=0xABCDEF, last_access=5,
                       generation=4, epoch=6)
    before = seg.read_slot(3)
    raw_before = _entry(seg, 3)
    seg.touch(3, 2**63 + 5)
    after = seg.read_slot(3)
    assert after.last_access == 2**63 + 5
    assert after == SlotRecord(before.state, before.key, before.length, before.checksum,
                               2**63 + 5, before.generation, before.epoch)
    raw_after = _entry(seg, 3)
    changed = [i for i in range(SLOT_ENTRY_BYTES) if raw_before[i] != raw_after[i]]
    assert changed and all(S._LAST_ACCESS_AT <= i < S._LAST_ACCESS_AT + 8 for i in changed)
    assert _verifies(seg, 3)  # the entry checksum does not cover the LRU hint


def test_slot_writes_never_touch_neighbouring_entries_the_header_or_the_data(seg: Segment) -> None:
    header = bytes(seg.meta[:HEADER_BYTES])
    data = _read(seg.path)
    n = seg.layout.n_slots
    others = {i: _entry(seg, i) for i in (0, 2, n - 1)}
    seg.mark_reserved(1, generation=3)
    seg.mark_committed(1, key=b"x" * MAX_KEY_BYTES, length=1, checksum=2**64 - 1,
                       last_access=2**64 - 1, generation=2**64 - 1, epoch=2**64 - 1)
    seg.touch(1, 2**64 - 1)
    seg.mark_doomed(1)
    seg.mark_free(1)
    assert bytes(seg.meta[:HEADER_BYTES]) == header
    assert {i: _entry(seg, i) for i in others} == others
    assert _read(seg.path) == data


@pytest.mark.parametrize("slot", [-1, "n"])
def test_slot_index_out_of_range_raises_index_error(seg: Segment, slot: Any) -> None:
    bad = seg.layout.n_slots if slot == "n" else slot
    for call in (lambda: seg.read_slot(bad), lambda: seg.mark_reserved(bad, 1),
                 lambda: seg.mark_free(bad), lambda: seg.touch(bad, 1),
                 lambda: seg.mark_doomed(bad),
                 lambda: seg.mark_committed(bad, key=b"k", length=1, checksum=None,
                                            last_access=1, generation=1, epoch=1)):
        with pytest.raises(IndexError, match="out of range"):
            call()


# ---------------------------------------------------------------- store ordering
class RecordingMap:
    """Stands in for a segment's metadata mmap and records every store in order.

    Item assignment is recorded directly; ``struct.pack_into`` into it goes
    through ``RecordingStruct`` (patched over the module's structs), which turns
    it into an item assignment.  The wrapper has no buffer protocol, so a writer
    that reaches the mapping any other way (numpy, ctypes, memoryview) fails
    loudly here instead of making the ordering tests pass vacuously.
    """

    def __init__(self, mm: Any) -> None:
        self._mm = mm
        self.writes: list[tuple[int, int, bytes]] = []  # (start, stop, data)

    def __len__(self) -> int:
        return len(self._mm)

    def __getitem__(self, idx: Any) -> Any:
        return self._mm[idx]

    def __setitem__(self, idx: Any, value: Any) -> None:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self._mm))
            assert step == 1
            data = bytes(value)
        else:
            start, stop, data = idx, idx + 1, bytes([int(value)])
        self.writes.append((start, stop, data))
        self._mm[idx] = value


class RecordingStruct:
    """A ``struct.Struct`` whose ``pack_into`` stores through item assignment (recorded)."""

    def __init__(self, real: struct.Struct) -> None:
        self._real = real
        self.size = real.size

    def pack(self, *values: Any) -> bytes:
        return self._real.pack(*values)

    def unpack_from(self, buf: Any, offset: int = 0) -> tuple[Any, ...]:
        return self._real.unpack_from(buf, offset)

    def pack_into(self, buf: Any, offset: int, *values: Any) -> None:
        buf[offset : offset + self.size] = self._real.pack(*values)


@contextlib.contextmanager
def _recording(seg: Segment, monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingMap]:
    rec = RecordingMap(seg.meta)
    with monkeypatch.context() as m:
        m.setattr(S, "_SUM", RecordingStruct(S._SUM))
        m.setattr(S, "_SLOT", RecordingStruct(S._SLOT))
        m.setattr(seg, "meta", rec)
        yield rec


def _recorded(seg: Segment, monkeypatch: pytest.MonkeyPatch,
              call: Callable[[], None]) -> list[tuple[int, int, bytes]]:
    data = _read(seg.path)
    with _recording(seg, monkeypatch) as rec:
        call()
    assert _read(seg.path) == data  # slot-table writers never touch the data file
    return rec.writes


def _commit_slot(seg: Segment, slot: int) -> None:
    seg.mark_committed(slot, key=b"payload-key", length=4000, checksum=0x1234,
                       last_access=99, generation=8, epoch=3)


def test_mark_committed_writes_the_state_byte_last(seg: Segment,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    seg.mark_reserved(4, generation=8)
    writes = _recorded(seg, monkeypatch, lambda: _commit_slot(seg, 4))
    state_at = _entry_at(4)
    assert writes, "mark_committed wrote nothing through the mapping"
    assert writes[-1] == (state_at, state_at + 1, bytes([SlotState.COMMITTED]))
    for start, stop, _ in writes[:-1]:
        assert not start <= state_at < stop, "the state byte was written before the other fields"
    # everything else (fields, entry checksum, last access) went in before, inside the entry
    assert all(state_at <= start < stop <= state_at + SLOT_ENTRY_BYTES
               for start, stop, _ in writes)
    covered = {i for start, stop, _ in writes[:-1] for i in range(start, stop)}
    assert covered >= set(range(state_at + 1, state_at + S._LAST_ACCESS_AT + 8))
    assert seg.read_slot(4).state == SlotState.COMMITTED
    assert _verifies(seg, 4)


def test_commit_interrupted_before_its_last_store_leaves_the_slot_not_committed(
    seg: Segment, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replay every proper prefix of a commit's stores: none of them shows COMMITTED."""
    seg.mark_reserved(5, generation=8)
    writes = _recorded(seg, monkeypatch, lambda: _commit_slot(seg, 5))
    for k in range(len(writes)):
        seg.mark_reserved(5, generation=8)
        for start, stop, data in writes[:k]:
            seg.meta[start:stop] = data
        rec = seg.read_slot(5)
        assert rec.state == SlotState.RESERVED, f"after {k} of {len(writes)} stores"
        assert rec.generation == 8
    # and the full sequence does commit, with an entry checksum that verifies
    for start, stop, data in writes:
        seg.meta[start:stop] = data
    assert seg.read_slot(5).state == SlotState.COMMITTED
    assert seg.read_slot(5).key == b"payload-key"
    assert _verifies(seg, 5)


def test_mark_free_flips_the_state_byte_first_then_clears_the_entry_checksum(
    seg: Segment, monkeypatch: pytest.MonkeyPatch,
) -> None:
    seg.mark_committed(6, key=b"k", length=1, checksum=None, last_access=1, generation=1, epoch=1)
    writes = _recorded(seg, monkeypatch, lambda: seg.mark_free(6))
    state_at = _entry_at(6)
    sum_at = state_at + ENTRY_SUM_AT
    assert writes == [(state_at, state_at + 1, bytes([SlotState.FREE])),
                      (sum_at, sum_at + 8, bytes(8))]
    assert seg.read_slot(6).state == SlotState.FREE
    assert not _verifies(seg, 6, bytes([SlotState.COMMITTED]) + _entry(seg, 6)[1:])


def test_touch_and_mark_doomed_are_one_store_each(seg: Segment,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    seg.mark_committed(7, key=b"k", length=1, checksum=None, last_access=1, generation=1, epoch=1)
    at = _entry_at(7)
    assert _recorded(seg, monkeypatch, lambda: seg.touch(7, 42)) == [
        (at + S._LAST_ACCESS_AT, at + S._LAST_ACCESS_AT + 8, struct.pack("<Q", 42))]
    assert _recorded(seg, monkeypatch, lambda: seg.mark_doomed(7)) == [
        (at, at + 1, bytes([SlotState.DOOMED]))]


# ================================================================ data file
def test_slot_offset_is_relative_to_the_data_file(seg: Segment) -> None:
    for i in range(seg.layout.n_slots):
        assert seg.slot_offset(i) == i * seg.layout.slot_bytes
        assert seg.slot_offset(i) % PAGE == 0


def test_data_view_aliases_the_slot_bytes_in_the_data_file(seg: Segment) -> None:
    lay = seg.layout
    last = lay.n_slots - 1
    meta = bytes(seg.meta)
    for slot, fill in ((0, 0xA1), (1, 0xB2), (last, 0xC3)):
        with seg.data_view(slot, lay.block_bytes) as view:
            assert len(view) == lay.block_bytes
            assert not view.readonly
            view[:] = bytes([fill]) * lay.block_bytes
    for slot, fill in ((0, 0xA1), (1, 0xB2), (last, 0xC3)):
        start = slot * lay.slot_bytes
        assert bytes(seg.mm[start : start + lay.block_bytes]) == bytes([fill]) * lay.block_bytes
        assert os.pread(seg.fd, lay.block_bytes, start) == bytes([fill]) * lay.block_bytes
    # the padding up to the next slot is untouched, and the last slot ends the data file
    assert bytes(seg.mm[lay.block_bytes : lay.slot_bytes]) == bytes(
        lay.slot_bytes - lay.block_bytes)
    assert last * lay.slot_bytes + lay.slot_bytes == lay.data_bytes == len(seg.mm)
    assert os.fstat(seg.fd).st_size == lay.data_bytes
    # data writes never reach the metadata file: header and slot table are as they were
    assert bytes(seg.meta) == meta
    assert seg.read_slot(0).state == SlotState.FREE


def test_data_view_of_a_partial_length_starts_at_the_slot(seg: Segment) -> None:
    with seg.data_view(2, 3) as view:
        view[:] = b"xyz"
    start = 2 * seg.layout.slot_bytes
    assert bytes(seg.mm[start : start + 4]) == b"xyz\x00"


# ================================================================ attach
def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _stopped(shm_dir: str, **kwargs: Any) -> Segment:
    """A segment with two committed rows and data, closed as after SIGKILL."""
    seg = _create(shm_dir, **kwargs)
    for slot in (0, seg.layout.n_slots - 1):
        with seg.data_view(slot, 4) as view:
            view[:] = b"%4d" % slot
        seg.mark_committed(slot, key=b"key%d" % slot, length=4, checksum=slot, last_access=slot,
                           generation=1, epoch=1)
    seg.close(unlink=False)
    return seg


def test_attach_re_opens_a_stopped_segment_as_it_was(shm_dir: str) -> None:
    old = _stopped(shm_dir, namespace="ns/x", model_uid="uid", index=9)
    seg = Segment.attach(old.meta_path, segment_id=99)
    try:
        assert (seg.segment_id, seg.namespace, seg.model_uid, seg.index) == (99, "ns/x", "uid", 9)
        assert seg.layout == old.layout
        assert seg.created_unix_ns == old.created_unix_ns
        assert (seg.path, seg.meta_path) == (old.path, old.meta_path)
        assert seg.adopted
        assert (seg.intact_bytes, seg.size_fault) == (seg.layout.data_bytes, None)
        last = seg.layout.n_slots - 1
        assert seg.read_slot(last) == SlotRecord(SlotState.COMMITTED, b"key%d" % last, 4, last,
                                                 last, 1, 1)
        assert bytes(seg.data_view(last, 4)) == b"%4d" % last
        assert _verifies(seg, 0) and _verifies(seg, last)
    finally:
        seg.close(unlink=True)


def _truncate_meta(to: int) -> Callable[[Segment], None]:
    return lambda seg: os.truncate(seg.meta_path, to)


def _resize_meta(delta: int) -> Callable[[Segment], None]:
    return lambda seg: os.truncate(seg.meta_path, seg.layout.meta_bytes + delta)


def _write_meta(offset: int, data: bytes) -> Callable[[Segment], None]:
    def damage(seg: Segment) -> None:
        with open(seg.meta_path, "r+b") as f:
            os.pwrite(f.fileno(), data, offset)
    return damage


def _rewrite_header(**changes: Any) -> Callable[[Segment], None]:
    def damage(seg: Segment) -> None:
        reopened = Segment.attach(seg.meta_path, segment_id=1)
        page = _resigned_header(reopened, **changes)
        reopened.close(unlink=False)
        _write_meta(0, page)(seg)
    return damage


def _rename_both(index: int) -> Callable[[Segment], None]:
    def damage(seg: Segment) -> None:
        d = os.path.dirname(seg.path)
        os.rename(seg.meta_path, os.path.join(d, segment_file_name(seg.namespace, index,
                                                                   META_SUFFIX)))
        os.rename(seg.path, os.path.join(d, segment_file_name(seg.namespace, index)))
    return damage


def _replace_data(make: Callable[[str], None]) -> Callable[[Segment], None]:
    def damage(seg: Segment) -> None:
        os.unlink(seg.path)
        make(seg.path)
    return damage


ATTACH_DAMAGES: dict[str, tuple[Callable[[Segment], None], str]] = {
    "meta-empty": (_truncate_meta(0), r"truncated: 0 bytes, shorter than its header"),
    "meta-into-header": (_truncate_meta(100), r"truncated: 100 bytes, shorter than its header"),
    "meta-shrunk": (_resize_meta(-PAGE), r"metadata file is \d+ bytes but its header describes "
                                         r"\d+ \(truncated or extended\)"),
    "meta-grown": (_resize_meta(PAGE), r"metadata file is \d+ bytes but its header describes "
                                       r"\d+ \(truncated or extended\)"),
    "bad-magic": (_write_meta(0, b"NOTASEG!"), r"bad magic b'NOTASEG!'"),
    "header-byte": (_write_meta(100, b"\xff"), r"header checksum mismatch"),
    "format-1-version": (_rewrite_header(version=1), r"format version 1, expected 2"),
    "data-offset-of-format-1": (_rewrite_header(data_offset=2 * PAGE),
                                r"header geometry is inconsistent"),
    "slot-bytes": (_rewrite_header(slot_bytes=PAGE), r"header geometry is inconsistent"),
    "no-slots": (_rewrite_header(n_slots=0), r"header has n_slots=0"),
    "more-slots": (_rewrite_header(n_slots=10_000), r"metadata file is \d+ bytes but its header"),
    "name-not-utf8": (_rewrite_header(name=b"\xff\xfe", name_len=2), r"not UTF-8"),
    "name-length": (_rewrite_header(name_len=S.NAME_BYTES + 1), r"out of range"),
    "renamed": (_rename_both(7), r"file name does not match its header"),
    "no-data-file": (lambda seg: os.unlink(seg.path), r"its data file cannot be opened"),
    "data-file-is-a-symlink": (_replace_data(lambda p: os.symlink("/dev/zero", p)),
                               r"its data file cannot be opened"),
    "data-file-is-a-directory": (_replace_data(os.mkdir), r"its data file cannot be opened"),
    "data-file-is-a-fifo": (_replace_data(os.mkfifo), r"its data file is not a regular file"),
}


@pytest.mark.parametrize("damage", list(ATTACH_DAMAGES))
def test_attach_refuses_a_segment_it_must_not_use_and_leaks_no_fd(shm_dir: str,
                                                                   damage: str) -> None:
    fn, message = ATTACH_DAMAGES[damage]
    seg = _stopped(shm_dir)
    fn(seg)
    meta = [os.path.join(shm_dir, n) for n in os.listdir(shm_dir) if n.endswith(META_SUFFIX)]
    assert len(meta) == 1
    fds = _open_fds()
    with pytest.raises(SegmentInvalid, match=message):
        Segment.attach(meta[0], segment_id=1)
    assert _open_fds() == fds


@pytest.mark.parametrize("new_size", ["cut-mid-slot", "cut-to-zero"])
def test_attach_restores_a_data_file_a_client_cut_short(shm_dir: str, new_size: str) -> None:
    old = _stopped(shm_dir)
    lay = old.layout
    last = lay.n_slots - 1
    cut = last * lay.slot_bytes + 2 if new_size == "cut-mid-slot" else 0
    os.truncate(old.path, cut)
    seg = Segment.attach(old.meta_path, segment_id=1)
    try:
        assert seg.intact_bytes == cut
        assert seg.size_fault is not None
        assert f"data file is {cut} bytes, its metadata describes {lay.data_bytes}" in (
            seg.size_fault)
        assert os.fstat(seg.fd).st_size == lay.data_bytes == len(seg.mm)
        if cut:
            assert bytes(seg.data_view(0, 4)) == b"%4d" % 0  # before the cut: intact
        # up to the cut the bytes survive; past it they are gone (zeros), never a fault
        kept = (b"%4d" % last)[:2] if cut else b""
        assert bytes(seg.data_view(last, 4)) == kept + bytes(4 - len(kept))
    finally:
        seg.close(unlink=True)


def test_attach_allocates_the_range_it_restored(shm_dir: str) -> None:
    old = _stopped(shm_dir)
    os.truncate(old.path, PAGE)
    seg = Segment.attach(old.meta_path, segment_id=1)
    try:
        assert seg.size_fault is not None
        assert os.stat(seg.path).st_blocks * 512 >= seg.layout.data_bytes
        assert seg.audit_data_file() is None
    finally:
        seg.close(unlink=True)


def test_attach_cuts_back_a_data_file_a_client_extended(shm_dir: str) -> None:
    old = _stopped(shm_dir)
    lay = old.layout
    os.truncate(old.path, lay.data_bytes + 64 * MiB)
    seg = Segment.attach(old.meta_path, segment_id=1)
    try:
        assert seg.intact_bytes == lay.data_bytes  # every slot's data is still there
        assert seg.size_fault is not None and "truncated or extended by a client" in seg.size_fault
        assert os.path.getsize(seg.path) == lay.data_bytes
        assert bytes(seg.data_view(lay.n_slots - 1, 4)) == b"%4d" % (lay.n_slots - 1)
    finally:
        seg.close(unlink=True)


# ================================================================ data-file audit
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
_libc.fallocate.restype = ctypes.c_int
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


def _punch(path: str, offset: int, length: int) -> None:
    """What a client can do to its data fd: free pages without changing the size."""
    fd = os.open(path, os.O_RDWR)
    try:
        if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)


def _allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def _filled(seg: Segment) -> bytes:
    """Every slot filled with its own byte; the data file's expected content."""
    lay = seg.layout
    for slot in range(lay.n_slots):
        with seg.data_view(slot, lay.slot_bytes) as view:
            view[:] = bytes([slot % 251 + 1]) * lay.slot_bytes
    return _read(seg.path)


def test_audit_of_an_untouched_data_file_finds_nothing(seg: Segment) -> None:
    data = _filled(seg)
    assert seg.audit_data_file() is None
    assert _read(seg.path) == data


def test_audit_restores_a_data_file_a_client_shrank(seg: Segment) -> None:
    lay = seg.layout
    data = _filled(seg)
    cut = 2 * lay.slot_bytes + 10
    os.truncate(seg.path, cut)
    assert seg.audit_data_file() == ("shrunk", cut)
    assert os.path.getsize(seg.path) == lay.data_bytes
    assert _allocated(seg.path) >= lay.data_bytes
    after = _read(seg.path)
    assert after[:cut] == data[:cut] and after[cut:] == bytes(lay.data_bytes - cut)
    assert seg.audit_data_file() is None  # and it stays put


def test_audit_cuts_back_a_data_file_a_client_grew(seg: Segment) -> None:
    lay = seg.layout
    data = _filled(seg)
    os.truncate(seg.path, lay.data_bytes + 16 * MiB)
    assert seg.audit_data_file() == ("grown", lay.data_bytes)
    assert os.path.getsize(seg.path) == lay.data_bytes
    assert _read(seg.path) == data  # nothing was lost
    assert seg.audit_data_file() is None


def test_audit_allocates_holes_a_client_punched_again(seg: Segment) -> None:
    lay = seg.layout
    data = _filled(seg)
    hole = (lay.slot_bytes, 2 * lay.slot_bytes)  # slots 1 and 2
    _punch(seg.path, *hole)
    assert os.path.getsize(seg.path) == lay.data_bytes
    assert _allocated(seg.path) <= lay.data_bytes - hole[1]
    assert seg.audit_data_file() == ("holes", lay.data_bytes)
    assert _allocated(seg.path) >= lay.data_bytes
    after = _read(seg.path)
    start, stop = hole[0], hole[0] + hole[1]
    assert after[:start] == data[:start] and after[stop:] == data[stop:]
    assert after[start:stop] == bytes(hole[1])  # the punched bytes are gone, never a fault
    assert seg.audit_data_file() is None


def test_audit_of_a_retired_segment_leaves_the_file_that_took_its_fd_number(
        shm_dir: str) -> None:
    """CI's stress failure: the audit (a worker thread) held a list of segments, one was
    retired and closed meanwhile, a new extent of another namespace got its fd number,
    and the audit cut the new extent's data file to the retired layout's size; its
    clients then could not map it ("shorter than its layout")."""
    old = _create(shm_dir, block_bytes=200_000, budget=4 * MiB, index=1, namespace="ns/big")
    old_fd = old.fd
    old.close(unlink=True, free=True)
    new = _create(shm_dir, block_bytes=16_384, budget=1 * MiB, index=2, namespace="ns/small",
                  segment_id=12)
    try:
        assert new.fd == old_fd  # the number was reused (what made the race possible)
        assert new.layout.data_bytes != old.layout.data_bytes
        assert old.audit_data_file() is None  # closed: it touches no fd at all
        assert os.path.getsize(new.path) == new.layout.data_bytes
        assert new.audit_data_file() is None
    finally:
        new.close(unlink=True)


def test_close_waits_for_an_audit_in_progress(seg: Segment) -> None:
    """The audit and ``close`` exclude each other: while an audit holds the segment's
    fd, ``close`` (another worker thread) does not close it under it."""
    entered, release = threading.Event(), threading.Event()
    real_fstat = os.fstat

    def slow_fstat(fd: int) -> os.stat_result:
        entered.set()
        release.wait(5)
        return real_fstat(fd)

    result: list[object] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S.os, "fstat", slow_fstat)
        t = threading.Thread(target=lambda: result.append(seg.audit_data_file()))
        t.start()
        assert entered.wait(5)
        closer = threading.Thread(target=seg.close, kwargs={"unlink": False})
        closer.start()
        closer.join(0.2)
        assert closer.is_alive()  # held off while the audit uses the fd
        release.set()
        t.join(5)
        closer.join(5)
    assert result == [None] and seg.closed


def _rss_of(path: str) -> int:
    """Bytes of this process's mapping of ``path`` resident now (/proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = head[-1] == path
            elif inside and head[0] == "Rss:":
                rss += int(head[1]) * 1024
    return rss


@pytest.mark.parametrize("mlock", [False, True])
def test_a_new_extent_is_resident_whether_mlock_faults_it_in_or_the_touch_does(
        shm_dir: str, mlock: bool) -> None:
    """mlock faults the pages in itself, so create touches them only when they were not
    locked (mlock off, or refused): either way no page is missing after it."""
    layout = SegmentLayout.fit(10_000, 4 * MiB)
    assert layout is not None
    s = Segment.create(shm_dir, segment_id=12, namespace="n", model_uid="m", index=0,
                       layout=layout, boot_epoch=1, mlock=mlock, prefault_threads=1)
    try:
        if not mlock:
            assert s.mlock_error is not None
        assert _rss_of(s.path) == layout.data_bytes
        assert not any(bytes(s.data_view(0, layout.slot_bytes)))  # zeros, as fallocate left them
    finally:
        s.close(unlink=True)
