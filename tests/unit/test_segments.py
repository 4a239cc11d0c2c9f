"""Tests for kvtierd.segments: layout geometry, the header, the slot table, data views."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtierd import segments as S
from kvtierd.segments import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    PAGE,
    SLOT_ENTRY_BYTES,
    TABLE_OFFSET,
    Segment,
    SegmentLayout,
    SlotRecord,
    SlotState,
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
    """The reference answer, by brute force from the format description."""
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
    assert layout.data_offset % PAGE == 0
    assert layout.data_offset >= TABLE_OFFSET + layout.n_slots * SLOT_ENTRY_BYTES
    # the slot table is no bigger than it needs to be (rounded to a page)
    assert layout.data_offset == round_up(TABLE_OFFSET + layout.n_slots * SLOT_ENTRY_BYTES, PAGE)
    assert layout.file_bytes == layout.data_offset + layout.n_slots * layout.slot_bytes
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


def test_one_slot_file_is_header_page_table_page_and_one_rounded_slot() -> None:
    assert SegmentLayout.one_slot_file_bytes(1) == 3 * PAGE
    assert SegmentLayout.one_slot_file_bytes(PAGE) == 3 * PAGE
    assert SegmentLayout.one_slot_file_bytes(PAGE + 1) == 4 * PAGE
    assert SegmentLayout.one_slot_file_bytes(8 * MiB + 1) == 2 * PAGE + 8 * MiB + PAGE


def test_fit_slot_table_grows_past_one_page_when_many_slots() -> None:
    # 1-byte blocks: one page per slot, 128-byte entries; > 32 slots need a 2nd table page
    layout = SegmentLayout.fit(1, 1 * MiB)
    assert layout is not None
    assert layout.n_slots > HEADER_BYTES // SLOT_ENTRY_BYTES
    assert layout.data_offset > TABLE_OFFSET + PAGE
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


def test_create_writes_a_header_that_read_header_validates(shm_dir: str) -> None:
    seg = _create(shm_dir, namespace="ns/a", model_uid="uid-\u00e9", index=5, epoch=123456789)
    try:
        lay = seg.layout
        head = read_header(seg.mm)
        assert head["namespace"] == "ns/a"
        assert head["model_uid"] == "uid-\u00e9"
        assert head["boot_epoch"] == 123456789
        assert head["index"] == 5
        assert head["n_slots"] == lay.n_slots
        assert head["block_bytes"] == lay.block_bytes == 10_000
        assert head["slot_bytes"] == lay.slot_bytes
        assert head["table_offset"] == TABLE_OFFSET
        assert head["data_offset"] == lay.data_offset
        assert isinstance(head["created_unix_ns"], int) and head["created_unix_ns"] > 0
        # the file itself (what a restarted daemon re-attaches) says the same
        with open(seg.path, "rb") as f:
            on_disk = f.read()
        assert read_header(on_disk) == head
        assert len(on_disk) == lay.file_bytes
    finally:
        seg.close(unlink=True)


def test_create_names_the_file_after_namespace_and_index_with_owner_only_mode(shm_dir: str) -> None:
    seg = _create(shm_dir, namespace="ns/b", index=42)
    try:
        assert seg.path == os.path.join(shm_dir, segment_file_name("ns/b", 42))
        assert os.path.basename(seg.path).endswith(".000042.seg")
        assert stat.S_IMODE(os.stat(seg.path).st_mode) == 0o600
        assert seg.mlock_error is not None  # mlock=False says so instead of pretending
    finally:
        seg.close(unlink=True)
    assert not os.path.exists(seg.path)


def test_close_without_unlink_keeps_the_file(shm_dir: str) -> None:
    seg = _create(shm_dir)
    seg.close(unlink=False)
    with open(seg.path, "rb") as f:
        assert read_header(f.read())["namespace"] == "qwen3-8b/tp4/bf16"


def test_fresh_segment_has_every_slot_free(seg: Segment) -> None:
    for i in range(seg.layout.n_slots):
        assert seg.read_slot(i).state == SlotState.FREE


def test_corrupting_any_header_byte_makes_read_header_raise(seg: Segment) -> None:
    good = bytes(seg.mm[:HEADER_BYTES])
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
    page = bytearray(seg.mm[:HEADER_BYTES])
    page[0:8] = b"NOTASEG!"
    with pytest.raises(ValueError, match=r"bad magic b'NOTASEG!'"):
        read_header(bytes(page))


def test_read_header_rejects_another_format_version_even_with_a_valid_checksum(seg: Segment) -> None:
    fields = list(S._HEADER.unpack(bytes(seg.mm[: S._HEADER.size])))
    fields[1] = S.FORMAT_VERSION + 1
    head = S._HEADER.pack(*fields)
    page = head + S._HEADER_SUM.pack(xxhash.xxh64_intdigest(head))
    with pytest.raises(ValueError, match=f"format version {S.FORMAT_VERSION + 1}, expected "
                                         f"{S.FORMAT_VERSION}"):
        read_header(page)


def test_read_header_of_a_zeroed_page_raises(seg: Segment) -> None:
    with pytest.raises(ValueError, match="bad magic"):
        read_header(bytes(HEADER_BYTES))


# ================================================================ slot table
def _entry(seg: Segment, slot: int) -> bytes:
    off = TABLE_OFFSET + slot * SLOT_ENTRY_BYTES
    return bytes(seg.mm[off : off + SLOT_ENTRY_BYTES])


def test_mark_reserved_reads_back_reserved_with_its_generation(seg: Segment) -> None:
    seg.mark_reserved(2, generation=17)
    assert seg.read_slot(2) == SlotRecord(SlotState.RESERVED, b"", 0, None, 0, 17, 0)


def test_mark_committed_reads_back_every_field(seg: Segment) -> None:
    key = bytes(range(MAX_KEY_BYTES))
    seg.mark_reserved(1, generation=9)
    seg.mark_committed(1, key=key, length=9_999, checksum=2**64 - 1, last_access=2**40,
                       generation=9, epoch=77)
    assert seg.read_slot(1) == SlotRecord(SlotState.COMMITTED, key, 9_999, 2**64 - 1, 2**40, 9, 77)


def test_mark_committed_without_checksum_reads_back_none_and_zero_checksum_is_kept(
    seg: Segment,
) -> None:
    seg.mark_committed(0, key=b"a", length=1, checksum=None, last_access=1, generation=1, epoch=1)
    assert seg.read_slot(0).checksum is None
    seg.mark_committed(1, key=b"b", length=1, checksum=0, last_access=1, generation=1, epoch=1)
    assert seg.read_slot(1).checksum == 0


def test_mark_free_reads_back_free(seg: Segment) -> None:
    seg.mark_reserved(0, generation=1)
    seg.mark_committed(0, key=b"k", length=5, checksum=1, last_access=3, generation=1, epoch=2)
    seg.mark_free(0)
    assert seg.read_slot(0).state == SlotState.FREE


def test_reserve_after_free_clears_the_previous_key(seg: Segment) -> None:
    seg.mark_committed(0, key=b"old", length=5, checksum=1, last_access=3, generation=1, epoch=2)
    seg.mark_free(0)
    seg.mark_reserved(0, generation=2)
    assert seg.read_slot(0) == SlotRecord(SlotState.RESERVED, b"", 0, None, 0, 2, 0)


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


def test_slot_writes_never_touch_neighbouring_entries_or_the_header(seg: Segment) -> None:
    header = bytes(seg.mm[:HEADER_BYTES])
    n = seg.layout.n_slots
    others = {i: _entry(seg, i) for i in (0, 2, n - 1)}
    seg.mark_reserved(1, generation=3)
    seg.mark_committed(1, key=b"x" * MAX_KEY_BYTES, length=1, checksum=2**64 - 1,
                       last_access=2**64 - 1, generation=2**64 - 1, epoch=2**64 - 1)
    seg.touch(1, 2**64 - 1)
    seg.mark_free(1)
    assert bytes(seg.mm[:HEADER_BYTES]) == header
    assert {i: _entry(seg, i) for i in others} == others


@pytest.mark.parametrize("slot", [-1, "n"])
def test_slot_index_out_of_range_raises_index_error(seg: Segment, slot: Any) -> None:
    bad = seg.layout.n_slots if slot == "n" else slot
    for call in (lambda: seg.read_slot(bad), lambda: seg.mark_reserved(bad, 1),
                 lambda: seg.mark_free(bad), lambda: seg.touch(bad, 1),
                 lambda: seg.mark_committed(bad, key=b"k", length=1, checksum=None,
                                            last_access=1, generation=1, epoch=1)):
        with pytest.raises(IndexError, match="out of range"):
            call()


class RecordingMap:
    """Stands in for a segment's mmap and records every store in order.

    ``mark_committed``/``mark_free`` write through item assignment; if they
    ever switch to ``struct.pack_into`` this wrapper (no buffer protocol) makes
    the ordering tests fail loudly rather than pass vacuously.
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


def _recorded_commit(seg: Segment, slot: int) -> list[tuple[int, int, bytes]]:
    rec = RecordingMap(seg.mm)
    real, seg.mm = seg.mm, rec  # type: ignore[assignment]
    try:
        seg.mark_committed(slot, key=b"payload-key", length=4000, checksum=0x1234,
                           last_access=99, generation=8, epoch=3)
    finally:
        seg.mm = real
    return rec.writes


def test_mark_committed_writes_the_state_byte_last(seg: Segment) -> None:
    seg.mark_reserved(4, generation=8)
    writes = _recorded_commit(seg, 4)
    state_at = TABLE_OFFSET + 4 * SLOT_ENTRY_BYTES
    assert writes, "mark_committed wrote nothing through the mapping"
    assert writes[-1] == (state_at, state_at + 1, bytes([SlotState.COMMITTED]))
    for start, stop, _ in writes[:-1]:
        assert not start <= state_at < stop, "the state byte was written before the other fields"
    assert seg.read_slot(4).state == SlotState.COMMITTED


def test_commit_interrupted_before_its_last_store_leaves_the_slot_not_committed(
    seg: Segment,
) -> None:
    """Replay every proper prefix of a commit's stores: none of them shows COMMITTED."""
    seg.mark_reserved(5, generation=8)
    writes = _recorded_commit(seg, 5)
    for k in range(len(writes)):
        seg.mark_reserved(5, generation=8)
        for start, stop, data in writes[:k]:
            seg.mm[start:stop] = data
        rec = seg.read_slot(5)
        assert rec.state == SlotState.RESERVED, f"after {k} of {len(writes)} stores"
        assert rec.generation == 8
    # and the full sequence does commit
    for start, stop, data in writes:
        seg.mm[start:stop] = data
    assert seg.read_slot(5).state == SlotState.COMMITTED
    assert seg.read_slot(5).key == b"payload-key"


def test_mark_free_flips_the_state_byte_first(seg: Segment) -> None:
    seg.mark_committed(6, key=b"k", length=1, checksum=None, last_access=1, generation=1, epoch=1)
    rec = RecordingMap(seg.mm)
    real, seg.mm = seg.mm, rec  # type: ignore[assignment]
    try:
        seg.mark_free(6)
    finally:
        seg.mm = real
    state_at = TABLE_OFFSET + 6 * SLOT_ENTRY_BYTES
    assert rec.writes[0] == (state_at, state_at + 1, bytes([SlotState.FREE]))
    assert seg.read_slot(6).state == SlotState.FREE


# ================================================================ data area
def test_slot_offset_is_relative_to_the_data_area(seg: Segment) -> None:
    for i in range(seg.layout.n_slots):
        assert seg.slot_offset(i) == i * seg.layout.slot_bytes
        assert (seg.layout.data_offset + seg.slot_offset(i)) % PAGE == 0


def test_data_view_aliases_the_slot_bytes_in_the_file(seg: Segment) -> None:
    lay = seg.layout
    last = lay.n_slots - 1
    for slot, fill in ((0, 0xA1), (1, 0xB2), (last, 0xC3)):
        with seg.data_view(slot, lay.block_bytes) as view:
            assert len(view) == lay.block_bytes
            assert not view.readonly
            view[:] = bytes([fill]) * lay.block_bytes
    for slot, fill in ((0, 0xA1), (1, 0xB2), (last, 0xC3)):
        start = lay.data_offset + slot * lay.slot_bytes
        assert bytes(seg.mm[start : start + lay.block_bytes]) == bytes([fill]) * lay.block_bytes
        assert os.pread(seg.fd, lay.block_bytes, start) == bytes([fill]) * lay.block_bytes
    # the padding up to the next slot is untouched, and the last slot ends inside the file
    pad_start = lay.data_offset + lay.block_bytes
    assert bytes(seg.mm[pad_start : lay.data_offset + lay.slot_bytes]) == bytes(
        lay.slot_bytes - lay.block_bytes
    )
    assert lay.data_offset + last * lay.slot_bytes + lay.slot_bytes == lay.file_bytes == len(seg.mm)
    # the data area never overlaps the slot table
    assert bytes(seg.mm[TABLE_OFFSET : TABLE_OFFSET + SLOT_ENTRY_BYTES])[0] == SlotState.FREE


def test_data_view_of_a_partial_length_starts_at_the_slot(seg: Segment) -> None:
    with seg.data_view(2, 3) as view:
        view[:] = b"xyz"
    start = seg.layout.data_offset + 2 * seg.layout.slot_bytes
    assert bytes(seg.mm[start : start + 4]) == b"xyz\x00"
