"""Recovery: re-adopting segments of a previous run into a fresh store."""

from __future__ import annotations

import os

from kvtierd import recovery
from kvtierd.segments import Segment, SegmentLayout, SlotState
from kvtierd.store import Store


def _store(capacity: int = 8 << 20) -> Store:
    return Store(capacity=capacity, extent_size=1 << 20, extent_factory=None,  # type: ignore[arg-type]
                 lease_ttl=300, reservation_ttl=60, boot_epoch=2)


def _segment(shm_dir: str, index: int, *, uid: str = "m") -> Segment:
    layout = SegmentLayout.fit(4096, 64 << 10)
    assert layout is not None
    return Segment.create(shm_dir, segment_id=index + 1, namespace="ns", model_uid=uid,
                          index=index, layout=layout, boot_epoch=1, mlock=False)


def test_a_key_committed_twice_keeps_the_more_recent_copy(shm_dir: str) -> None:
    a, b = _segment(shm_dir, 0), _segment(shm_dir, 1)
    a.mark_committed(0, key=b"dup", length=5, checksum=None, last_access=10, generation=1, epoch=1)
    a.mark_committed(1, key=b"dup", length=6, checksum=None, last_access=30, generation=1, epoch=1)
    b.mark_committed(2, key=b"dup", length=7, checksum=None, last_access=20, generation=1, epoch=1)
    b.mark_committed(3, key=b"other", length=8, checksum=None, last_access=5, generation=1, epoch=1)
    b.mark_reserved(4, generation=3)
    for seg in (a, b):
        seg.close(unlink=False)
    store = _store()
    report = recovery.recover(store, shm_dir)
    ns = store.namespaces["ns"]
    assert ns.index[b"dup"].length == 6  # last_access 30 wins over 10 and 20
    assert ns.index[b"other"].length == 8
    assert ns.committed == 2 and ns.recovered == 2 and sum(report.blocks.values()) == 2
    assert ns.reserved == 1  # the slot reserved at the crash is quarantined
    assert [b.key for b in store.lru] == [b"other", b"dup"]  # oldest first
    assert store.check() == []
    store.close_all()


def test_a_segment_that_fails_validation_is_removed_and_reported(shm_dir: str) -> None:
    good, bad = _segment(shm_dir, 0), _segment(shm_dir, 1)
    good.mark_committed(0, key=b"k", length=1, checksum=None, last_access=1, generation=1, epoch=1)
    bad.mm[3] ^= 0xFF  # corrupt the magic
    for seg in (good, bad):
        seg.close(unlink=False)
    store = _store()
    report = recovery.recover(store, shm_dir)
    assert list(store.namespaces["ns"].index) == [b"k"]
    assert len(report.dropped) == 1 and "bad magic" in report.dropped[0]
    assert not os.path.exists(bad.path)
    assert store.check() == []
    store.close_all()


def test_capacity_shrink_drops_the_coldest_extents(shm_dir: str) -> None:
    hot, cold = _segment(shm_dir, 0), _segment(shm_dir, 1)
    hot.mark_committed(0, key=b"hot", length=1, checksum=None, last_access=99, generation=1, epoch=1)
    cold.mark_committed(0, key=b"cold", length=1, checksum=None, last_access=1, generation=1,
                        epoch=1)
    for seg in (hot, cold):
        seg.close(unlink=False)
    store = _store(capacity=hot.layout.file_bytes)  # room for one extent only
    report = recovery.recover(store, shm_dir)
    assert list(store.namespaces["ns"].index) == [b"hot"]
    assert any("dropped" in d for d in report.dropped)
    assert store.check() == []
    assert store.namespaces["ns"].extents[0].segment.read_slot(0).state == SlotState.COMMITTED
    store.close_all()
