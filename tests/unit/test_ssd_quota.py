"""SSD quotas per namespace: a namespace at quota evicts its own blocks only."""

from __future__ import annotations

import pytest

from kvtierd.spill.blockio import aligned_buffer
from kvtierd.spill.ssd import SpillFull, SsdTier

MiB = 1 << 20
BLK = 64 << 10


def _write(ssd: SsdTier, ns: str, key: bytes, fill: int) -> None:
    buf = aligned_buffer(BLK)
    try:
        buf[:] = bytes([fill]) * BLK
        with memoryview(buf) as view:
            ssd.write(ns, key, view, BLK, None, BLK, 0)
    finally:
        buf.close()


def _keys(ssd: SsdTier, ns: str) -> set[bytes]:
    return {k for (n, k) in ssd.index if n == ns}


def test_namespace_at_ssd_quota_evicts_its_own_oldest_blocks(disk_dir: str) -> None:
    ssd = SsdTier(disk_dir, capacity=8 * MiB, file_bytes=1 * MiB, direct="false")
    ssd.quota_of = lambda ns: 3 * BLK if ns == "q" else 0
    ssd.open()
    try:
        for i in range(4):
            _write(ssd, "other", b"o%d" % i, i)
        for i in range(10):
            _write(ssd, "q", b"q%d" % i, i)
        ssd.sync()
        assert _keys(ssd, "q") == {b"q7", b"q8", b"q9"}  # the newest three
        assert _keys(ssd, "other") == {b"o0", b"o1", b"o2", b"o3"}  # older, yet untouched
        assert ssd.index.bytes_of["q"] == 3 * BLK
        _write(ssd, "q", b"q9", 99)  # a rewrite of a held key needs no eviction
        assert _keys(ssd, "q") == {b"q7", b"q8", b"q9"}
        assert ssd.check() == []
    finally:
        ssd.close()


def test_quota_with_every_block_being_read_refuses_the_write(disk_dir: str) -> None:
    ssd = SsdTier(disk_dir, capacity=8 * MiB, file_bytes=1 * MiB, direct="false")
    ssd.quota_of = lambda ns: 2 * BLK
    ssd.open()
    try:
        _write(ssd, "q", b"a", 1)
        _write(ssd, "q", b"b", 2)
        for e in list(ssd.index.values()):
            e.readers += 1  # as if a promotion were reading each
        with pytest.raises(SpillFull, match=r"namespace 'q' is at its SSD quota \(131072 of "
                                             r"131072 bytes\) and none of its 65536-byte"):
            _write(ssd, "q", b"c", 3)
        for e in list(ssd.index.values()):
            e.readers -= 1
        assert _keys(ssd, "q") == {b"a", b"b"}
        assert ssd.check() == []
    finally:
        ssd.close()


def test_every_eviction_is_reported_and_concurrent_writers_stay_within_quota(
        disk_dir: str) -> None:
    import concurrent.futures

    ssd = SsdTier(disk_dir, capacity=8 * MiB, file_bytes=1 * MiB, direct="false")
    ssd.quota_of = lambda ns: 4 * BLK if ns == "q" else 0
    evicted: list[tuple[str, bytes]] = []
    ssd.on_evicted = lambda ns, key: evicted.append((ns, key))
    ssd.open()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # as the demoter's I/O threads
            list(pool.map(lambda i: _write(ssd, "q", b"q%d" % i, i), range(40)))
        ssd.sync()
        assert ssd.index.bytes_of["q"] <= 4 * BLK
        assert len(_keys(ssd, "q")) <= 4
        # Every block that is gone was reported evicted, once.
        assert sorted(evicted) == sorted({("q", b"q%d" % i) for i in range(40)}
                                         - {("q", k) for k in _keys(ssd, "q")})
        assert ssd.check() == []
    finally:
        ssd.close()


def test_spill_files_start_small_and_double_up_to_the_file_size(disk_dir: str) -> None:
    """A megabyte of spill never allocates gigabytes: the first file of a slot size is
    64 MiB (or 8 slots), each next one twice the last, capped at spill.ssd_file_size."""
    import os

    from kvtierd.spill.ssd import FIRST_FILE_BYTES

    ssd = SsdTier(disk_dir, capacity=1 << 30, file_bytes=256 * MiB, direct="false")
    ssd.open()
    try:
        _write(ssd, "a", b"k0", 1)
        sizes = sorted(os.path.getsize(os.path.join(disk_dir, f)) for f in os.listdir(disk_dir))
        assert len(sizes) == 1 and sizes[0] <= FIRST_FILE_BYTES, sizes
        first_slots = ssd.files[BLK][0].layout.n_slots
        for i in range(1, first_slots + 1):  # one more than the first file holds
            _write(ssd, "a", b"k%d" % i, i % 256)
        layouts = [f.layout for f in ssd.files[BLK]]
        assert len(layouts) == 2 and layouts[1].n_slots > layouts[0].n_slots
        assert FIRST_FILE_BYTES < layouts[1].file_bytes <= 2 * FIRST_FILE_BYTES
        assert ssd.file_budget_used == sum(x.file_bytes for x in layouts)
        ssd.sync()
        fresh = SsdTier(disk_dir, capacity=1 << 30, file_bytes=256 * MiB, direct="false")
        fresh.open()  # files of different sizes are re-adopted, every block with them
        try:
            assert {k for (_, k) in fresh.index} == {b"k%d" % i for i in range(first_slots + 1)}
        finally:
            fresh.close()
    finally:
        ssd.close()
