"""The shared index's table (csrc/index.c) and its daemon-side owner (kvtierd.shared_index)."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import random
import secrets
import struct
import time

import pytest
import xxhash

from kvtier import _native
from kvtier._index import LocalIndex
from kvtierd.shared_index import (
    MIN_CAPACITY,
    MISS_NOT_FINAL,
    PAGE_BYTES,
    SUPERSEDED,
    SessionPage,
    SharedIndex,
    fingerprint,
)

pytestmark = pytest.mark.skipif(not hasattr(_native, "index_lookup"), reason="no native build")


def _table(capacity: int = 64, seed: int = 1) -> mmap.mmap:
    mm = mmap.mmap(-1, 64 + capacity * 64)
    _native.index_format(mm, capacity, seed)
    return mm


def _states(t: mmap.mmap) -> list[int]:
    """Each entry's state byte (0 empty, 1 live, 2 tombstone: csrc/index.c's idx_entry)."""
    capacity = _native.index_info(t)[0]
    return [t[64 + 64 * i + 4] for i in range(capacity)]


def test_set_get_remove_and_lookup_of_the_leading_keys() -> None:
    t = _table()
    keys = [b"a" * 16, b"b", b"c" * 64, b"d" * 16]
    for i, k in enumerate(keys[:3]):
        assert _native.index_set(t, k, 1, 100 + i) == 1
    assert _native.index_get(t, keys[2]) == (1, 102)
    assert _native.index_set(t, keys[2], 2, 7) == 1  # an update, not a second entry
    assert _native.index_info(t) == (64, 3, 3, 0)
    assert _native.index_lookup(t, keys) == (b"\x01\x01\x02", True)
    assert _native.index_lookup(t, [keys[3], keys[0]]) == (b"", True)
    assert _native.index_remove(t, keys[1]) and not _native.index_remove(t, keys[1])
    assert _native.index_lookup(t, keys) == (b"\x01", True)
    # (A tombstone, or an empty entry when the next one is empty: ``_states`` says which.)
    assert _native.index_info(t) == (64, 2, 64 - _states(t).count(0), 0)
    assert _native.index_set(t, keys[1], 1, 0) == 1
    assert _native.index_info(t) == (64, 3, 3, 0)
    _native.index_set_flags(t, MISS_NOT_FINAL)
    assert _native.index_lookup(t, keys) == (b"\x01\x01\x02", False)
    assert _native.index_lookup(t, keys[:3]) == (b"\x01\x01\x02", True)  # no miss: final
    _native.index_set_flags(t, SUPERSEDED)
    assert _native.index_lookup(t, keys) is None


def test_removals_leave_no_tombstone_before_an_empty_entry_and_churn_never_fills() -> None:
    """A removal whose next entry is empty empties its entry (and the tombstones just
    before it) instead of leaving a tombstone: no probe runs through it.  A model of
    random sets and removals in a small table: every key held is found (one by one,
    batched and by the writer's batch find), no removed key is, ``used`` counts the
    entries not empty, and no tombstone is followed by an empty entry.  Then churn at a
    third full (a pool that evicts as it commits): the table never reports itself full
    (before, tombstones filled it to 3/4 and every set past that failed)."""
    rng = random.Random(5)
    t = _table(128, seed=3)
    held: dict[bytes, int] = {}
    pool = [b"k%d" % i for i in range(90)] + [b"%016d" % i for i in range(30)]
    for step in range(3000):
        key = rng.choice(pool)
        if key in held and rng.random() < 0.55:
            assert _native.index_remove(t, key)
            del held[key]
        elif len(held) < 60:
            assert _native.index_set(t, key, 1, step) == 1
            held[key] = step
        states = _states(t)
        assert _native.index_info(t)[1:3] == (len(held), 128 - states.count(0)), step
        assert not any(states[i] == 2 and states[(i + 1) % 128] == 0 for i in range(128)), step
        if step % 50 == 0:
            for k in pool:
                assert _native.index_get(t, k) == ((1, held[k]) if k in held else None), (step, k)
            order = sorted(held)
            if order:
                assert _native.index_lookup(t, order) == (b"\x01" * len(order), True)
    churn = _table(1024, seed=9)
    live = [b"c%07d" % i for i in range(300)]
    for k in live:
        assert _native.index_set(churn, k, 1, 0) == 1
    for i in range(20000):
        gone = live.pop(0)
        assert _native.index_remove_many(churn, [gone]) == b"\x01"
        key = b"n%07d" % i
        assert _native.index_set(churn, key, 1, i) == 1, (i, _native.index_info(churn))
        live.append(key)
    assert _native.index_info(churn)[1] == 300
    assert all(_native.index_get(churn, k) == (1, int(k[1:])) for k in live[-50:])


def test_a_batch_lookup_stops_at_its_first_miss_wherever_it_falls() -> None:
    """Lookups hash and prefetch keys ahead of their probe (16 at a time): the answer
    is still the leading hits, whether the miss falls before, inside or after a group."""
    t = _table(1024)
    keys = [b"%016d" % i for i in range(100)]
    for i, k in enumerate(keys):
        assert _native.index_set(t, k, 1 + i % 2, i) == 1
    tiers = bytes(1 + i % 2 for i in range(100))
    assert _native.index_lookup(t, keys) == (tiers, True)
    for miss in (0, 1, 15, 16, 17, 31, 32, 50, 99, 100):
        probe = [*keys[:miss], b"absent-%09d" % miss, *keys[miss:]]
        assert _native.index_lookup(t, probe) == (tiers[:miss], True), miss
    assert _native.index_lookup(t, []) == (b"", True)


def test_keys_the_table_cannot_judge_are_left_to_the_daemon() -> None:
    t = _table()
    _native.index_set(t, b"k", 1, 0)
    assert _native.index_lookup(t, [b"k", b""]) is None  # the daemon says why
    assert _native.index_lookup(t, [b"k", b"x" * 65]) is None
    assert _native.index_lookup(t, [b"k", "str"]) is None  # type: ignore[list-item]
    assert _native.index_lookup(t, [b"miss", b""]) is None  # past a miss too
    with pytest.raises(ValueError, match="1..64"):
        _native.index_set(t, b"", 1, 0)


def test_fingerprints_are_the_key_at_16_bytes_else_a_hash_flagged() -> None:
    assert fingerprint(b"0123456789abcdef") == b"0123456789abcdef\x00"
    fp = fingerprint(b"x")  # XXH3-128 as (low, high) little-endian, and the flag
    assert fp == xxhash.xxh3_128_intdigest(b"x").to_bytes(16, "little") + b"\x01"
    # A 16-byte key equal to another key's hash is still a different entry.
    t = _table()
    _native.index_set(t, b"x", 1, 0)
    assert _native.index_lookup(t, [fp[:16]]) == (b"", True)


def test_a_table_refuses_past_three_quarters_and_bad_buffers() -> None:
    t = _table(16)
    keys = [secrets.token_bytes(16) for _ in range(13)]
    assert [_native.index_set(t, k, 1, 0) for k in keys] == [1] * 12 + [-1]
    with pytest.raises(ValueError, match="power of two"):
        _native.index_format(mmap.mmap(-1, 4096), 12, 0)
    with pytest.raises(ValueError, match="version-2"):
        _native.index_lookup(bytes(4096), [b"k"])
    small = bytearray(t[:200])
    with pytest.raises(ValueError, match="capacity"):
        _native.index_lookup(small, [b"k"])


def test_remove_many_answers_each_key_and_stops_at_a_bad_one_having_removed_those_before() -> None:
    """Removals hash and prefetch keys a group of 16 at a time: the answers are per key
    wherever the groups fall, and a bad key stops the call with the keys before it
    removed and those after it kept, as one by one."""
    t = _table(256)
    keys = [b"r%03d" % i for i in range(40)]
    for k in keys[::2]:
        assert _native.index_set(t, k, 1, 0) == 1
    hits = _native.index_remove_many(t, keys[:37])
    assert list(hits) == [1 - i % 2 for i in range(37)]
    assert [_native.index_get(t, k) for k in keys[:37]] == [None] * 37
    assert _native.index_get(t, keys[38]) == (1, 0)
    again = [b"s%03d" % i for i in range(40)]
    for k in again:
        assert _native.index_set(t, k, 1, 0) == 1
    with pytest.raises(TypeError):
        _native.index_remove_many(t, again[:20] + ["str"] + again[20:])  # type: ignore[list-item]
    assert [_native.index_get(t, k) is None for k in again] == [True] * 20 + [False] * 20
    with pytest.raises(ValueError):
        _native.index_remove_many(t, [b"x" * 65])


#: A location for tests that only look keys up.
_LOC = (1, 0, 0, 1, None)


def _page() -> int:
    fd = os.memfd_create("page")
    os.ftruncate(fd, PAGE_BYTES)
    return fd


def _colliding(seed: int, capacity: int, n: int) -> list[bytes]:
    """16-byte keys whose home entry is 0 (the seed is in the header: anyone can)."""
    out = []
    while len(out) < n:
        k = secrets.token_bytes(16)
        if xxhash.xxh3_64_intdigest(k, seed) & (capacity - 1) == 0:
            out.append(k)
    return out


def test_colliding_keys_past_the_probe_limit_stay_out_and_misses_are_not_final() -> None:
    shared = SharedIndex("ns", lower_tiers=False, max_probe=128)  # the cap: 1024 entries
    table = shared._table
    assert table is not None and table.capacity == MIN_CAPACITY
    seed = struct.unpack_from("<Q", table.mm, 24)[0]
    keys = _colliding(seed, MIN_CAPACITY, 130)
    for k in keys:
        shared.add(k, _LOC)
    assert len(shared.unpublished) == 2
    local = LocalIndex(shared.fd, _page(), 64)  # type: ignore[arg-type]
    late = sorted(shared.unpublished)[0]
    other = secrets.token_bytes(16)  # elsewhere in the table
    # A probe that runs the whole limit cannot say: the daemon answers.
    assert local.lookup([keys[0], late]) is None
    # A miss anywhere is not final while keys are left out.
    assert local.lookup([keys[0], other]) == (b"\x01", False)
    shared.discard(late)
    shared.discard(sorted(shared.unpublished)[0])
    assert not shared.unpublished
    assert local.lookup([keys[0], other]) == (b"\x01", True)
    local.close()
    shared.close()


def test_a_probe_that_runs_the_limit_past_half_full_grows_the_table() -> None:
    """Honest keys past the probe limit: the table grows rather than leave them out."""
    shared = SharedIndex("ns", lower_tiers=False, max_probe=4)
    keys = [secrets.token_bytes(16) for _ in range(700)]  # 68% of 1024: clusters > 4
    for k in keys:
        shared.add(k, _LOC)
    assert shared.capacity > MIN_CAPACITY
    assert sorted(shared.fingerprints()) == sorted(
        fingerprint(k) for k in keys if k not in shared.unpublished)
    shared.close()


def test_a_full_table_is_replaced_and_the_old_one_says_so() -> None:
    shared = SharedIndex("ns", lower_tiers=True)
    fd0 = os.dup(shared.fd)  # type: ignore[arg-type]
    local = LocalIndex(fd0, _page(), 4096)
    keys = [secrets.token_bytes(16) for _ in range(3000)]
    for k in keys:
        shared.add(k, _LOC)
    assert shared.capacity == 4 * MIN_CAPACITY and not shared.unpublished
    assert local.superseded and local.lookup(keys[:2]) is None
    local.replace(shared.fd)  # type: ignore[arg-type]
    assert local.lookup(keys) == (b"\x01" * 3000, True)
    assert local.lookup([b"nope"]) == (b"", False)  # lower tiers: not final
    shared.set_lower_tiers(False)
    assert local.lookup([b"nope"]) == (b"", True)
    for k in keys[:2500]:  # tombstones fill it: replaced at the same size
        shared.discard(k)
    for k in keys[:2500]:
        shared.add(k, _LOC)
    assert shared.capacity == 4 * MIN_CAPACITY
    os.close(fd0)
    local.close()
    shared.close()


def test_find_many_answers_each_keys_ref_through_growth_hiding_and_left_out_keys() -> None:
    """The daemon's batch lookup (the table as its key index): segment << 32 | slot per
    key, 0 when absent, for exact (16-byte) and hashed keys alike."""
    shared = SharedIndex("ns", lower_tiers=False, max_probe=128)
    table = shared._table
    assert table is not None
    seed = struct.unpack_from("<Q", table.mm, 24)[0]
    keys = [secrets.token_bytes(16) for _ in range(500)] + [b"k%d" % i for i in range(500)]
    for i, k in enumerate(keys):
        shared.add(k, (7 + i % 3, i, i * 4096, 1, None))
    assert shared.capacity > MIN_CAPACITY  # it grew on the way: refs survive the copy
    want = [(7 + i % 3) << 32 | i for i in range(len(keys))]
    assert shared.find_many(keys).tolist() == want
    assert shared.find_many([b"absent", keys[3]]).tolist() == [0, want[3]]
    shared.hide(keys[3])
    shared.discard(keys[600])
    assert shared.find_many([keys[3], keys[600], keys[4]]).tolist() == [0, 0, want[4]]
    shared.add(keys[3], (9, 3, 0, 1, None))  # moved
    assert shared.find_many([keys[3]]).tolist() == [9 << 32 | 3]
    assert shared.find_many([]).tolist() == []
    with pytest.raises(ValueError, match="bytes"):
        shared.find_many([b""])
    shared.close()
    # Keys the table left out (past the probe limit) are found where they are kept.
    crowded = SharedIndex("ns", lower_tiers=False, max_probe=128)
    t2 = crowded._table
    assert t2 is not None
    seed = struct.unpack_from("<Q", t2.mm, 24)[0]
    near = _colliding(seed, MIN_CAPACITY, 130)
    for i, k in enumerate(near):
        crowded.add(k, (5, i, 0, 1, None))
    assert len(crowded.unpublished) == 2
    assert crowded.find_many(near).tolist() == [5 << 32 | i for i in range(130)]
    crowded.close()
    assert crowded.find_many(near[:1]).tolist() == [0]  # closed: holds nothing


def _entry_of(mm: mmap.mmap, key: bytes) -> int:
    """The byte offset of the live entry holding 16-byte ``key`` (its fingerprint is the
    key itself: fp0, fp1 at bytes 8..24 of the entry)."""
    cap = struct.unpack_from("<Q", mm, 16)[0]
    for i in range(cap):
        at = 64 + i * 64
        if mm[at + 4] == 1 and mm[at + 8:at + 24] == key:
            return at
    raise AssertionError("no entry holds the key")


def test_present_many_reads_each_entry_under_its_seqlock() -> None:
    """The client's batch presence test (a reserve from grants): 1 per key the table
    holds (key-only entries and hashed keys too), 0 otherwise; an entry the writer is
    changing (odd sequence number) past the spin limit, and a superseded table, read as
    absent, where the writer's own probe (index_find_many, index_locate) sees it."""
    t = _table()
    # Seeded keys: a busy entry also reads absent a key whose probe passes it (the reader
    # cannot tell whose entry it is), so the table's placement must be the same every run;
    # with these keys no other key of keys[3:6] probes past keys[4]'s entry.
    rng = random.Random(5)
    keys = [rng.randbytes(16) for _ in range(20)] + [b"short", b"l" * 64]
    for i, k in enumerate(keys):
        assert _native.index_set(t, k, 1, 0, None if i % 3 else (1, i, 0, 1, None)) == 1
    absent = [rng.randbytes(16), b"nope"]
    assert _native.index_present_many(t, keys + absent) == b"\1" * len(keys) + b"\0\0"
    assert _native.index_present_many(t, []) == b""
    assert _native.index_present_many(t, [absent[0], keys[0], absent[1], keys[-1]]) == \
        b"\0\1\0\1"
    busy = _entry_of(t, keys[4])
    seq = struct.unpack_from("<I", t, busy)[0]
    struct.pack_into("<I", t, busy, seq + 1)  # the writer mid-change (and descheduled)
    assert _native.index_present_many(t, keys[3:6]) == b"\1\0\1"
    assert _native.index_locate(t, keys[4]) is not None  # the writer's view: no seqlock
    struct.pack_into("<I", t, busy, seq + 2)  # the change done
    assert _native.index_present_many(t, keys[3:6]) == b"\1\1\1"
    for bad in ([b""], [b"k" * 65], [keys[0], "str"], [keys[0], 7]):
        with pytest.raises(ValueError, match="keys\\[[01]\\] is not bytes"):
            _native.index_present_many(t, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _native.index_present_many(t, 5)  # type: ignore[arg-type]
    _native.index_set_flags(t, SUPERSEDED)
    assert _native.index_present_many(t, keys[:3]) == b"\0\0\0"
    with pytest.raises(ValueError):
        _native.index_present_many(bytearray(64), keys[:1])  # no table


def test_shared_index_mirrors_adds_and_discards_and_a_closed_one_takes_nothing() -> None:
    shared = SharedIndex("ns", lower_tiers=False)
    shared.add(b"a", (1, 1, 4096, 4096, None))
    shared.add_many([(b"b", (1, 2, 8192, 4096, None)), (b"c", (1, 3, 12288, 4096, None))])
    shared.discard(b"b")
    assert sorted(shared.fingerprints()) == sorted(fingerprint(k) for k in (b"a", b"c"))
    shared.close()
    assert shared.fd is None
    shared.add(b"d", (1, 4, 16384, 4096, None))  # a closed table takes nothing, and nothing fails
    assert shared.fingerprints() == []


def test_counters_that_jump_or_go_back_add_nothing() -> None:
    page = SessionPage("ns")
    assert page.fd is not None
    mm = mmap.mmap(page.fd, PAGE_BYTES)
    struct.pack_into("<7Q", mm, 0, 3, 10, 2, 1, 1, 1, 4096)
    assert page.take() == (3, 10, 2, 1, 1, 1, 4096)
    struct.pack_into("<7Q", mm, 0, 5, 2**63, 1, 0, 2, 1, 8192)
    assert page.take() == (2, 0, 0, 0, 1, 0, 4096)
    struct.pack_into("<7Q", mm, 0, 6, 2**63 + 4, 3, 1, 3, 1, 2**62)
    assert page.take() == (1, 4, 2, 1, 1, 0, 0)
    with pytest.raises(PermissionError):
        os.ftruncate(page.fd, 0)  # sealed
    mm.close()
    page.close()


def _churn(mm: mmap.mmap, keys: list[bytes], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for k in keys:
            _native.index_remove(mm, k)
        for k in keys:
            _native.index_set(mm, k, 1, 0)


def test_a_reader_never_misses_a_key_another_process_leaves_alone() -> None:
    """The seqlock: entries around the stable keys change all the time in another
    process (removes leave tombstones, inserts reuse them); every lookup of the
    stable keys still hits, and the toggled ones are hit or missed, never garbled."""
    cap = 256
    mm = mmap.mmap(-1, 64 + cap * 64)  # MAP_SHARED anonymous: the child writes the same pages
    _native.index_format(mm, cap, 3)
    stable = [secrets.token_bytes(16) for _ in range(60)]
    toggled = [secrets.token_bytes(16) for _ in range(100)]
    for k in stable + toggled:
        assert _native.index_set(mm, k, 1, 0) == 1
    ctx = multiprocessing.get_context("fork")
    writer = ctx.Process(target=_churn, args=(mm, toggled, 1.5))
    writer.start()
    try:
        lookups = answered = all_present = 0
        while writer.is_alive():
            # None: an entry stayed busy past the spin limit (the writer was descheduled
            # mid-change on a loaded machine), and the client asks the daemon instead.
            got = _native.index_lookup(mm, stable)
            assert got in ((b"\x01" * len(stable), True), None)
            for k in toggled[:10]:
                one = _native.index_lookup(mm, [k])
                assert one in ((b"\x01", True), (b"", True), None)
            # The batch presence test: 0 only for an entry busy past the spin limit.
            present = _native.index_present_many(mm, stable + toggled)
            assert set(present) <= {0, 1}
            lookups += 1
            answered += got is not None
            all_present += present[:len(stable)] == b"\x01" * len(stable)
        assert lookups > 10 and answered > lookups // 2 and all_present > lookups // 2
    finally:
        writer.join(10)
    assert writer.exitcode == 0


def test_keys_check_finds_the_first_bad_and_the_first_repeated_key() -> None:
    """The store's one-pass check of a Reserve's keys (``Operations._reserve_now``):
    (first key not bytes of 1..max_len, first key repeating an earlier one), -1 each
    when none; a hash collision is told apart by the bytes."""
    check = _native.keys_check
    assert check([], 64) == (-1, -1)
    assert check([b"a"], 64) == (-1, -1)
    assert check([b"a", b"b", b"a", b"b"], 64) == (-1, 2)
    assert check([b"a", b"", b"c" * 65, b"a"], 64) == (1, 3)
    assert check([b"x" * 64, b"y" * 65], 64) == (1, -1)
    assert check(["str", b"a", b"a"], 64) == (0, 2)  # type: ignore[list-item]
    many = [b"k%05d" % i for i in range(5000)]
    assert check(many, 64) == (-1, -1)
    assert check([*many, b"k04999"], 64) == (-1, 5000)
    assert check([*many, b"k05000"], 64) == (-1, -1)
    # Keys of one length differing in one byte, and keys that are prefixes of others.
    assert check([b"ab", b"abc", b"a", b"abd", b"abc"], 64) == (-1, 4)
    rng = random.Random(1)
    for _ in range(50):
        keys = [bytes(rng.randrange(2) for _ in range(rng.randrange(1, 6))) for _ in range(20)]
        seen: set[bytes] = set()
        first = next((i for i, k in enumerate(keys) if k in seen or seen.add(k)), -1)
        assert check(keys, 64) == (-1, first), keys
    assert check([b"a", b"a", b"", b"b" * 65], 64, False) == (2, -1)  # the lengths alone
    assert check([b"a", b"a"], 64, False) == (-1, -1)
    assert check([b"a", "s"], 64, False) == (1, -1)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        check(5, 64)  # type: ignore[arg-type]
