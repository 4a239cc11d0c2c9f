"""kvtierd.block_table / kvtier._native.BlockTable (csrc/blocks.c).

Unit tests per operation, a Hypothesis state machine against a plain Python
model, and adoption fuzzing that holds the native ``adopt`` to exactly what
``slot_oracle.scan_slots`` accepts, on slot tables in segments.py's real format.
Pure native: tests/unit/test_native_sanitized.py runs this file again under
ASan/UBSan.
"""

from __future__ import annotations

import collections
import dataclasses
import mmap
import os
import shutil
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvtier._slot_ref import encode_many as refs_of
from kvtier._slot_ref import split
from kvtierd import block_table as bt
from kvtierd import segments
from kvtierd.block_table import BlockTable, Policy
from kvtierd.segments import (
    SLOT_DTYPE,
    SLOT_ENTRY_BYTES,
    TABLE_OFFSET,
    Segment,
    SegmentLayout,
    SlotState,
)

pytestmark = pytest.mark.skipif(not bt.AVAILABLE, reason="kvtier._native is not built")

BLOCK = 1000
SLOT = 4096
EPOCH = 7
CREATED = 0x1234_5678_9ABC_DEF0
FREE, RESERVED, COMMITTED, DOOMED = 0, 1, 2, 3
DIRTY, CLEAN, UNSPILLABLE = 0, 1, 2


def _native_constants() -> dict[str, int]:
    from kvtier import _native

    return dict(_native.BLOCK_TABLE)


def table(n_slots: int = 16, extent_id: int = 1, *, seed: int = 1
          ) -> tuple[BlockTable, bytearray]:
    t = BlockTable(BLOCK, SLOT, seed=seed)
    meta = bytearray(n_slots * SLOT_ENTRY_BYTES)
    t.add_extent(extent_id, n_slots, meta, CREATED)
    return t, meta


def rows(meta: bytearray | bytes) -> np.ndarray:
    return np.frombuffer(bytes(meta), dtype=SLOT_DTYPE)


def commit(t: BlockTable, refs: np.ndarray, *, first: int = 1, length: int = 100) -> None:
    t.commit(refs, [b"key-%d" % int(r) for r in refs], np.full(len(refs), length), None,
             first_access=first, epoch=EPOCH)


def claimed(t: BlockTable, n: int) -> np.ndarray:
    refs, short = t.claim(n)
    assert short == 0 and len(refs) == n
    return refs


@pytest.fixture
def shm_dir() -> Iterator[str]:
    path = os.path.join("/dev/shm", f"kvt-bt-{uuid.uuid4().hex}")
    os.mkdir(path, 0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def make_segment(directory: str, n_slots: int, *, segment_id: int = 5) -> Segment:
    return Segment.create(directory, segment_id=segment_id, namespace="ns", model_uid="m",
                          index=segment_id, layout=SegmentLayout(BLOCK, SLOT, n_slots),
                          boot_epoch=EPOCH, mlock=False, prefault_threads=1)


# ------------------------------------------------------------------ one layout


def test_slot_dtype_offsets_equal_the_native_layout() -> None:
    from kvtier import _native

    layout, fields = _native.LAYOUT, _native.FIELDS["slot_entry"]
    for name in SLOT_DTYPE.names:
        assert SLOT_DTYPE.fields[name][1] == fields[name][0], name
        assert SLOT_DTYPE.fields[name][0].itemsize == fields[name][1], name
    assert SLOT_DTYPE.itemsize == SLOT_ENTRY_BYTES == layout["SLOT_BYTES"]
    assert TABLE_OFFSET == layout["SLOT_TABLE_OFFSET"]
    assert segments.KEY_OFFSET == layout["SLOT_KEY"]
    assert segments.ENTRY_SUM_AT == layout["SLOT_ENTRY_SUM"] == layout["SLOT_SUM_TO"]
    assert segments._LAST_ACCESS_AT == layout["SLOT_LAST_ACCESS"]
    assert segments.MAX_KEY_BYTES == layout["SLOT_MAX_KEY"]
    assert segments.FLAG_HAS_CHECKSUM == layout["SLOT_HAS_CHECKSUM"]
    assert segments.MAX_GENERATION == layout["MAX_GENERATION"]
    assert segments.MAX_ACCESS_SEQ == layout["MAX_ACCESS_SEQ"]
    assert layout["SLOT_SUM_FROM"] == 1  # segments.entry_sum hashes entry[1:ENTRY_SUM_AT]
    assert [s.value for s in SlotState] == [FREE, RESERVED, COMMITTED, DOOMED]
    native = _native_constants()
    assert (Policy.LRU, Policy.CLOCK) == (native["policy_lru"], native["policy_clock"])


def test_native_record_is_at_most_16_bytes_a_slot() -> None:
    n = 200_000
    t = BlockTable(BLOCK, SLOT)
    empty = t.native_bytes
    t.add_extent(1, n, bytearray(n * SLOT_ENTRY_BYTES), CREATED)
    per_slot = (t.native_bytes - empty) / n
    assert _native_constants()["record_bytes"] == 12
    assert per_slot <= 16, per_slot


# ------------------------------------------------------------------ extents


def test_add_extent_validates_and_starts_all_free() -> None:
    t, meta = table(8)
    assert t.counts() == bt.Counts(8, 8, 0, 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="already in the table"):
        t.add_extent(1, 8, bytearray(8 * 128), CREATED)
    with pytest.raises(ValueError, match="at least 1024 bytes"):
        t.add_extent(2, 8, bytearray(1023), CREATED)
    with pytest.raises(TypeError, match="read-only"):
        t.add_extent(2, 8, bytes(1024), CREATED)
    with pytest.raises(ValueError, match="extent_id"):
        t.add_extent(1 << 31, 8, bytearray(1024), CREATED)
    with pytest.raises(ValueError, match="n_slots"):
        t.add_extent(3, 0, bytearray(1024), CREATED)
    assert t.extents() == [1] and t.check() == []


def test_remove_extent_refuses_while_pinned_and_releases_the_mapping(shm_dir: str) -> None:
    seg = make_segment(shm_dir, 4)
    t = BlockTable(BLOCK, SLOT)
    t.add_segment(seg)
    refs = claimed(t, 2)
    commit(t, refs)
    t.pin(refs[:1])
    with pytest.raises(ValueError, match="pinned"):
        t.remove_extent(5)
    t.unpin(refs[:1])
    assert t.remove_extent(5) == (2, 0)
    assert t.extents() == [] and t.counts().slots == 0
    seg.close(unlink=True)  # no export left: the mapping really closes
    assert seg.meta.closed


# ------------------------------------------------------------------ write path


def test_claim_is_all_or_nothing_and_says_how_many_are_short() -> None:
    t, meta = table(4)
    before = bytes(meta)
    refs, short = t.claim(5)
    assert (len(refs), short) == (0, 1)
    assert bytes(meta) == before and t.counts().free == 4
    refs = claimed(t, 3)
    assert split(refs)[1].tolist() == [0, 1, 2]  # lowest slot first
    r = rows(meta)
    assert r["state"][:4].tolist() == [RESERVED] * 3 + [FREE]
    assert r["generation"][:3].tolist() == [1, 1, 1]
    assert t.counts().reserved == 3 and t.check() == []


def test_claim_leaves_skipped_free_slots_free() -> None:
    t, meta = table(4)
    hazard = (1 << 63) | int(refs_of(1, [0])[0])  # a page's hazard word for slot 0
    refs = claimed_skip = t.claim(2, skip=[hazard, int(refs_of(1, [2])[0])])[0]
    assert split(claimed_skip)[1].tolist() == [1, 3]
    refs2, short = t.claim(1, skip=refs_of(1, [0, 2]))
    assert (len(refs2), short) == (0, 1)  # the free ones are all skipped: nothing taken
    assert t.counts().free == 2 and t.check() == []
    assert len(refs) == 2


def test_release_claims_frees_only_reserved_slots_all_or_nothing() -> None:
    t, meta = table(4)
    refs = claimed(t, 3)
    commit(t, refs[2:])
    before = bytes(meta)
    with pytest.raises(ValueError, match=r"refs\[2\].*COMMITTED, not RESERVED"):
        t.release_claims(refs)
    with pytest.raises(ValueError, match="twice"):
        t.release_claims(refs[[0, 0]])
    with pytest.raises(ValueError, match="extent 9"):
        t.release_claims(refs_of(9, [0]))
    with pytest.raises(ValueError, match="slot 4 of extent 1"):
        t.release_claims(refs_of(1, [4]))
    assert bytes(meta) == before and t.counts().reserved == 2
    t.release_claims(refs[:2])
    assert rows(meta)["state"].tolist() == [FREE, FREE, COMMITTED, FREE]
    assert t.counts().free == 3 and t.check() == []


def test_commit_writes_entries_segments_and_recovery_read_back(shm_dir: str) -> None:
    from .slot_oracle import scan_slots

    seg = make_segment(shm_dir, 6)
    t = BlockTable(BLOCK, SLOT)
    t.add_segment(seg)
    refs = claimed(t, 4)
    keys = [b"a" * 64, b"b", b"c" * 16, b"d" * 7]
    t.commit(refs, keys, [1000, 1, 5, 6], [123, None, 0, 2**64 - 1], first_access=40,
             epoch=EPOCH)
    for i, slot in enumerate(split(refs)[1].tolist()):
        rec = seg.read_slot(slot)
        assert rec.state == SlotState.COMMITTED
        assert (rec.key, rec.length, rec.checksum, rec.last_access, rec.generation,
                rec.epoch) == (keys[i], [1000, 1, 5, 6][i], [123, None, 0, 2**64 - 1][i],
                               40 + i, 1, EPOCH)
        raw = bytes(seg.meta[TABLE_OFFSET + slot * 128 : TABLE_OFFSET + slot * 128 + 128])
        assert int.from_bytes(raw[104:112], "little") == segments.entry_sum(
            raw, segments.entry_seed(seg.created_unix_ns, slot))
    adopted, dropped = scan_slots(seg, boot_epoch=EPOCH)
    assert not dropped and adopted.keys == keys
    assert t.counts().dirty == 4 and t.check() == []
    t.remove_extent(seg.segment_id)
    seg.close(unlink=True)


def test_commit_validates_the_whole_batch_first() -> None:
    t, meta = table(4)
    refs = claimed(t, 3)
    before = bytes(meta)
    bad = [
        (dict(keys=[b"k1", b"", b"k3"]), "keys\\[1\\] is 0 bytes"),
        (dict(keys=[b"k1", b"k" * 65, b"k3"]), "keys\\[1\\] is 65 bytes"),
        (dict(lengths=[1, 1001, 1]), "lengths\\[1\\] = 1001 is outside 1..1000"),
        (dict(lengths=[1, 0, 1]), "lengths\\[1\\] = 0"),
        (dict(lengths=[1, 1]), "refs and lengths differ in length \\(3 != 2\\)"),
        (dict(refs=refs[[0, 1, 1]]), "twice"),
        (dict(refs=np.append(refs[:2], refs_of(1, [3]))), "FREE, not RESERVED"),
        (dict(first=2**48 - 2), "reaches 2\\*\\*48"),
    ]
    for change, message in bad:
        args = dict(refs=refs, keys=[b"k1", b"k2", b"k3"], lengths=[1, 1, 1], first=1) | change
        with pytest.raises(ValueError, match=message):
            t.commit(args["refs"], args["keys"], args["lengths"], None,
                     first_access=args["first"], epoch=EPOCH)
    with pytest.raises(TypeError, match="not bytes"):
        t.commit(refs, [b"k1", "k2", b"k3"], [1, 1, 1], None,  # type: ignore[list-item]
                 first_access=1, epoch=EPOCH)
    assert bytes(meta) == before and t.counts().reserved == 3 and t.check() == []


def _index(capacity: int = 64) -> mmap.mmap:
    from kvtier import _native

    mm = mmap.mmap(-1, 64 + capacity * 64)
    _native.index_format(mm, capacity, 1)
    return mm


def test_commit_with_an_index_publishes_its_keys_from_the_entries_it_wrote() -> None:
    from kvtier import _native

    t, _meta = table(4, extent_id=1)
    meta2 = bytearray(4 * SLOT_ENTRY_BYTES)
    t.add_extent(2, 4, meta2, CREATED)
    refs = np.concatenate([claimed(t, 6)])
    assert set(split(refs)[0].tolist()) == {1, 2}  # a batch over two extents
    idx = _index()
    _native.index_set(idx, b"held", 1, 0, (9, 9, 0, 1, None))  # a key the index has
    keys = [b"k%d" % i for i in range(5)] + [b"held"]
    has = [1, 0, 1, 0, 1, 0]
    sums = [i if h else None for i, h in enumerate(has)]
    published = t.commit(refs, keys, np.arange(1, 7), sums, first_access=1, epoch=EPOCH,
                         index=idx)
    assert published is not None
    done, left = published
    assert done == 6 and left == [5]  # the key held already is the caller's to decide
    segs, slots = split(refs)
    for i, key in enumerate(keys[:5]):
        assert _native.index_locate(idx, key) == (
            int(segs[i]), int(slots[i]), int(slots[i]) * SLOT, i + 1, i if has[i] else None)
    assert _native.index_locate(idx, b"held") == (9, 9, 0, 1, None)
    assert t.counts().committed == 6 and t.check() == []


def test_commit_into_a_full_index_commits_all_and_says_where_publishing_stopped() -> None:
    from kvtier import _native

    t, _meta = table(16)
    idx = _index(16)
    for i in range(10):
        assert _native.index_set(idx, b"old%d" % i, 1, 0) == 1
    refs = claimed(t, 5)
    published = t.commit(refs, [b"k%d" % i for i in range(5)], [1] * 5, None,
                         first_access=1, epoch=EPOCH, index=idx)
    assert published == (2, [])  # 3/4 of 16: the caller grows the index for the rest
    assert _native.index_info(idx)[1] == 12 and t.counts().committed == 5


def test_find_keys_looks_up_and_checks_hashed_hits_against_the_slot() -> None:
    """``find_keys``: a key's ref from the index in the same call as the check of a hit
    on a key held as its hash (not 16 bytes) against the slot entry; a forged entry
    (a collision) is a miss, a 16-byte key is exact.  Many keys (past the stack's 16)
    alike; bad keys and buffers refused."""
    from kvtier import _native

    t, _meta = table(40)
    idx = _index(128)
    keys = [b"k%02d" % i for i in range(19)] + [b"0123456789abcdef"]
    refs = claimed(t, len(keys))
    assert t.commit(refs, keys, [1] * len(keys), None, first_access=1, epoch=EPOCH,
                    index=idx) == (len(keys), [])
    assert t.find_keys(idx, keys).tolist() == refs.tolist()
    assert t.find_keys(idx, [keys[0], b"absent", keys[-1]]).tolist() == [
        int(refs[0]), 0, int(refs[-1])]
    assert t.find_keys(idx, []).tolist() == []
    # Entries for other keys that name the committed blocks: collisions, forged.
    forged = [b"x%02d" % i for i in range(19)] + [b"fedcba9876543210"]
    for mine, theirs in zip(keys, forged, strict=True):
        assert _native.index_set(idx, theirs, 1, 0, _native.index_locate(idx, mine)) == 1
    got = t.find_keys(idx, forged)
    assert got.tolist() == [0] * 19 + [int(refs[-1])]
    got[0] = 7  # (the caller's own array)
    # A slot no longer COMMITTED is no hit either.
    t.delete(refs[:1])
    assert t.find_keys(idx, keys[:1]).tolist() == [0]
    with pytest.raises(TypeError, match="not bytes"):
        t.find_keys(idx, [b"k00", "k01"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="65 bytes"):
        t.find_keys(idx, [b"k00", b"z" * 65])
    with pytest.raises(ValueError, match="0 bytes"):
        t.find_keys(idx, [b""])
    with pytest.raises(ValueError, match="version-2"):
        t.find_keys(mmap.mmap(-1, 4096), [b"k00"])
    _native.index_set(idx, b"stray", 1, 0, (77, 0, 0, 1, None))  # an extent the table lacks
    with pytest.raises(ValueError, match="extent 77"):
        t.find_keys(idx, [b"stray"])
    assert t.check() == []


def test_commit_with_a_buffer_that_holds_no_index_changes_nothing() -> None:
    t, meta = table(4)
    refs = claimed(t, 2)
    before = bytes(meta)
    with pytest.raises(ValueError, match="version-2"):
        t.commit(refs, [b"a", b"b"], [1, 1], None, first_access=1, epoch=EPOCH,
                 index=mmap.mmap(-1, 4096))
    with pytest.raises(BufferError):
        t.commit(refs, [b"a", b"b"], [1, 1], None, first_access=1, epoch=EPOCH,
                 index=bytes(4096))  # type: ignore[arg-type]  # (read-only)
    assert bytes(meta) == before and t.counts().reserved == 2 and t.check() == []


# ------------------------------------------------------------------ read path


def test_pin_unpin_delete_dooms_a_leased_block_until_its_last_unpin() -> None:
    t, meta = table(4)
    refs = claimed(t, 2)
    commit(t, refs)
    t.pin(refs[[0, 0, 1]])
    assert t.inspect(refs)["pins"].tolist() == [2, 1]
    assert t.counts().pinned == 2 and t.counts().evictable == 0
    assert t.delete(refs) == 2
    assert rows(meta)["state"][:2].tolist() == [DOOMED, DOOMED]
    assert t.counts().committed == 2 and t.counts().doomed == 2
    with pytest.raises(ValueError, match="DOOMED, not COMMITTED"):
        t.pin(refs[:1])  # a deleted block is never leased again
    assert t.unpin(refs).tolist() == [int(refs[1])]  # its last pin
    assert rows(meta)["state"][:2].tolist() == [DOOMED, FREE]
    assert t.unpin(refs[:1]).tolist() == [int(refs[0])]
    with pytest.raises(ValueError, match="no pin left"):
        t.unpin(refs[:1])
    assert t.counts().free == 4 and t.check() == []


def test_unpin_is_all_or_nothing() -> None:
    t, _ = table(4)
    refs = claimed(t, 2)
    commit(t, refs)
    t.pin(refs)
    with pytest.raises(ValueError, match=r"refs\[2\]"):
        t.unpin(refs[[0, 1, 0]])  # refs[0] holds one pin, the batch ends two
    assert t.inspect(refs)["pins"].tolist() == [1, 1] and t.check() == []


def test_touch_writes_last_access_sets_the_clock_bit_and_skips_garbage_hints() -> None:
    t, meta = table(4)
    refs = claimed(t, 2)
    commit(t, refs, first=1)
    t.set_prefetched(refs[:1])
    assert t.inspect(refs)["flags"].tolist() == [bt.PREFETCHED, 0]  # no CLOCK bit at commit
    garbage = [2**64 - 1, int(refs_of(1, [3])[0]), int(refs_of(77, [0])[0]),
               (1 << 63) | int(refs[1])]
    assert t.touch(garbage, 10, hints=True) == (1, 0)
    assert rows(meta)["last_access"][:2].tolist() == [1, 13]
    with pytest.raises(ValueError, match="extent 77"):
        t.touch(garbage[2:3], 20)
    assert t.touch(refs, 20) == (2, 1)
    assert rows(meta)["last_access"][:2].tolist() == [20, 21]
    assert t.inspect(refs)["flags"].tolist() == [bt.REFERENCED, bt.REFERENCED]


def test_set_lower_counts_dirty_and_skips_a_reused_slot() -> None:
    t, _ = table(4)
    refs = claimed(t, 2)
    commit(t, refs)
    gens = t.inspect(refs)["generation"]
    assert t.set_lower(refs, CLEAN, gens + np.uint64(1)) == 0  # another generation
    assert t.set_lower(refs, CLEAN, gens) == 2
    assert t.counts().dirty == 0 and t.counts().clean == 2
    with pytest.raises(ValueError, match="lower must be"):
        t.set_lower(refs, 3)
    assert t.set_lower(refs[:1], DIRTY) == 1 and t.counts().dirty == 1 and t.check() == []


def test_evict_frees_or_reserves_unpinned_blocks_only() -> None:
    t, meta = table(4)
    refs = claimed(t, 3)
    commit(t, refs)
    t.pin(refs[2:])
    with pytest.raises(ValueError, match="pinned"):
        t.evict(refs)
    t.evict(refs[:1])
    t.evict(refs[1:2], reserve=True)
    r = rows(meta)
    assert r["state"][:3].tolist() == [FREE, RESERVED, COMMITTED]
    assert r["generation"][1] == 2 and r["entry_sum"][1] == 0
    assert t.counts() == bt.Counts(4, 2, 1, 1, 1, 1, 0, 0, 0, 3) and t.check() == []


def test_match_keys_compares_persisted_keys_of_committed_blocks() -> None:
    t, _ = table(4)
    refs = claimed(t, 3)
    t.commit(refs[:2], [b"a" * 64, b"bb"], [1, 1], None, first_access=1, epoch=EPOCH)
    got = t.match_keys(refs[[0, 1, 1, 2, 0]], [b"a" * 64, b"bb", b"b", b"", b"a" * 65])
    assert got.tolist() == [True, True, False, False, False]  # RESERVED slot 2: never
    t.pin(refs[1:2])
    t.delete(refs[1:2])
    assert t.match_keys(refs[1:2], [b"bb"]).tolist() == [False]  # deleted (DOOMED)
    with pytest.raises(ValueError, match="differ in length"):
        t.match_keys(refs, [b"a"])
    with pytest.raises(TypeError, match="not bytes"):
        t.match_keys(refs[:1], ["a"])  # type: ignore[list-item]


# ------------------------------------------------------------------ victims


@pytest.mark.parametrize("policy", [Policy.LRU, Policy.CLOCK])
def test_victims_are_distinct_evictable_and_respect_spill_and_skip(policy: Policy) -> None:
    t, _ = table(64)
    refs = claimed(t, 60)
    commit(t, refs)
    t.pin(refs[:10])
    t.set_lower(refs[10:40], CLEAN)
    skip = refs[10:15]
    got = t.victims(60, policy, spill=True, skip=skip)
    assert len(set(got.tolist())) == len(got)
    assert set(got.tolist()) <= set(refs[15:40].tolist())  # CLEAN, unpinned, not skipped
    assert len(got) == 25  # all of them: a small table fits the work bound
    assert len(t.victims(60, policy)) == 50  # spill off: DIRTY ones too
    assert t.check() == []  # nothing changed but the policy's state


def test_victims_on_a_table_without_evictable_blocks_return_nothing_quickly() -> None:
    t, _ = table(1 << 16)
    refs = claimed(t, 1 << 15)
    commit(t, refs)
    t.pin(refs)
    for policy in Policy:
        assert len(t.victims(100, policy)) == 0


def test_sampled_lru_takes_the_oldest_blocks() -> None:
    t, _ = table(1024, seed=3)
    refs = claimed(t, 1024)
    order = np.random.default_rng(0).permutation(1024)  # order[i]: slot i's age rank
    t.commit(refs, [b"k%d" % i for i in range(1024)], np.full(1024, 10), None,
             first_access=1, epoch=EPOCH)
    t.touch(refs[np.argsort(order)], 5000)  # slot i accessed at 5000 + order[i]
    for pool in (True, False):
        got = t.victims(64, Policy.LRU, sample=16, pool=pool)
        ranks = order[split(got)[1].astype(np.int64)]
        # 64 of 1024: exact LRU takes ranks 0..63; 16 samples a victim stay near it
        assert np.median(ranks) < 128, (pool, np.median(ranks))


def test_clock_gives_recently_read_blocks_a_second_chance() -> None:
    t, _ = table(8)
    refs = claimed(t, 8)
    commit(t, refs)
    t.touch(refs[:3], 50)  # read since their commit
    first = t.victims(2, Policy.CLOCK)  # the hand clears 0..2 and takes 3, 4
    assert split(first)[1].tolist() == [3, 4]
    t.evict(first)
    t.touch(refs[5:6], 100)  # read again: skipped on the next pass, its bit cleared
    assert split(t.victims(3, Policy.CLOCK))[1].tolist() == [6, 7, 0]
    assert t.inspect(refs[5:6])["flags"].tolist() == [0]


def test_the_clock_hand_takes_the_second_chance_of_dirty_blocks_it_passes() -> None:
    # With spill, eviction takes only blocks the SSD tier holds (not DIRTY); demotion
    # picks DIRTY blocks without their bit first.  A DIRTY block read once must lose its
    # bit when the hand passes it, or it would never be demoted (nor evicted) while
    # unread DIRTY blocks stream past it (the demo's "push it to SSD" found 15 of 16
    # read pages still in DRAM after 2048 other pages).
    t, _ = table(8)
    refs = claimed(t, 8)
    commit(t, refs)  # all DIRTY
    t.touch(refs[:2], 50)  # read: their CLOCK bits
    t.set_lower(refs[2:], CLEAN)
    first = t.victims(2, Policy.CLOCK, spill=True)  # passes 0, 1 (DIRTY): bits cleared
    assert split(first)[1].tolist() == [2, 3]
    assert t.inspect(refs[:2])["flags"].tolist() == [0, 0]
    assert sorted(split(t.dirty(2, Policy.CLOCK))[1].tolist()) == [0, 1]
    assert t.check() == []


def test_a_short_clock_call_scans_two_revolutions_and_leaves_the_hand_in_place() -> None:
    """A CLOCK call that finds fewer victims than asked has seen every slot twice (the
    first pass clears the bits, the second takes what is left), so it stops there and
    its hand stays where it began: the next call starts from the same block.  (Before,
    it walked its whole budget -- 65,536 records and more -- round a table of a few
    eligible blocks, and left the hand wherever the budget ran out.)"""
    t, _ = table(10)
    refs = claimed(t, 10)
    commit(t, refs)
    t.set_lower(refs, CLEAN)
    t.touch(refs[4:6], 50)
    assert split(t.victims(2, Policy.CLOCK, spill=True))[1].tolist() == [0, 1]
    t.evict(refs[:2])
    hand = 2
    # Every eligible block skipped: nothing, and the hand did not move (10 does not
    # divide the old budget, so the old hand moved).
    assert t.victims(3, Policy.CLOCK, spill=True, skip=refs[2:]).tolist() == []
    assert split(t.victims(1, Policy.CLOCK, spill=True))[1].tolist() == [hand]
    # Fewer eligible than asked: all of them (slot 2 too: a plan's choice is not an
    # eviction), the read ones after their second chance.
    got = split(t.victims(20, Policy.CLOCK, spill=True))[1].tolist()
    assert sorted(got) == [2, 3, 4, 5, 6, 7, 8, 9] and got[-2:] == [4, 5]
    assert t.check() == []
    assert BlockTable(BLOCK, SLOT, seed=1).clock_scans_all()  # (no slots: trivially)


def test_dirty_candidates_are_unpinned_dirty_blocks() -> None:
    t, _ = table(16)
    refs = claimed(t, 12)
    commit(t, refs)
    t.set_lower(refs[:4], CLEAN)
    t.pin(refs[4:6])
    for policy in Policy:
        got = t.dirty(16, policy)
        assert sorted(got.tolist()) == sorted(refs[6:12].tolist())
    assert t.check() == []


# ------------------------------------------------------------------ check


def test_check_reports_a_slot_table_changed_behind_the_tables_back() -> None:
    t, meta = table(4)
    refs = claimed(t, 2)
    commit(t, refs)
    assert t.check() == []
    meta[0] = FREE  # slot 0's state byte
    meta[128 + 50] ^= 1  # a key byte of slot 1: its entry checksum no longer verifies
    problems = t.check()
    assert any("slot 0: COMMITTED in the table, FREE in the slot table" in p for p in problems)
    assert any("slot 1: entry checksum does not verify" in p for p in problems)


def test_batches_of_refs_must_be_whole_uint64s() -> None:
    t, _ = table(4)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        t._t.pin(b"1234567")
    with pytest.raises(ValueError, match="not C-contiguous"):
        t._t.pin(np.zeros(8, np.uint64)[::2])


def test_large_batches_apply_with_the_gil_released_and_stay_consistent() -> None:
    n = 5000  # above KVT_BLK_NOGIL_MIN
    t, _ = table(n)
    refs = claimed(t, n)
    commit(t, refs)
    t.pin(refs)
    t.unpin(refs)
    assert t.delete(refs) == 0 and t.counts().free == n and t.check() == []


# ------------------------------------------------------------------ adoption


@dataclasses.dataclass
class SlotSpec:
    state: int
    key_len: int
    flags: int
    length: int
    checksum: int
    generation: int
    epoch: int
    last: int
    good_sum: bool


def _forge(seg: Segment, slot: int, s: SlotSpec) -> None:
    """Write an entry as a crash or a bug could leave it (the real format, any values)."""
    off = TABLE_OFFSET + slot * SLOT_ENTRY_BYTES
    key = bytes((slot + i) % 256 for i in range(min(s.key_len, 64)))
    packed = segments._SLOT.pack(s.state, s.key_len, s.flags, 0, 0, s.length, s.checksum,
                                 s.generation, s.epoch, key, 0, s.last)
    total = segments.entry_sum(packed, segments.entry_seed(seg.created_unix_ns, slot))
    if not s.good_sum:
        total ^= 1
    seg.meta[off : off + segments._SLOT.size] = packed
    seg.meta[off + 104 : off + 112] = total.to_bytes(8, "little")


_u64 = st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1),
                 st.sampled_from([2**47, 2**48 - 1, 2**48, 2**64 - 1]))
slot_specs = st.builds(
    SlotSpec,
    state=st.one_of(st.sampled_from([0, 1, 2, 2, 2, 3]), st.integers(0, 255)),
    key_len=st.one_of(st.integers(1, 64), st.sampled_from([0, 65, 255])),
    flags=st.one_of(st.sampled_from([0, 1]), st.integers(0, 255)),
    length=st.one_of(st.integers(1, BLOCK), st.sampled_from([0, BLOCK + 1, 2**64 - 1])),
    checksum=_u64,
    generation=st.one_of(st.integers(0, 1000), _u64),
    epoch=st.one_of(st.integers(0, EPOCH), st.just(EPOCH + 1), _u64),
    last=st.one_of(st.integers(0, 10**6), _u64),
    good_sum=st.sampled_from([True, True, True, False]),
)

# A valid committed entry, then (sometimes) one field of it broken: most slots of a
# fuzzed table are near the boundary of what adoption accepts.
valid_specs = st.builds(
    SlotSpec, state=st.just(2), key_len=st.integers(1, 64), flags=st.sampled_from([0, 1]),
    length=st.integers(1, BLOCK), checksum=st.just(0), generation=st.integers(0, 2**48 - 1),
    epoch=st.integers(0, EPOCH), last=st.integers(0, 2**48 - 1), good_sum=st.just(True))


@st.composite
def near_valid(draw: st.DrawFn) -> SlotSpec:
    spec = draw(valid_specs)
    if spec.flags:
        spec.checksum = draw(_u64)
    field = draw(st.sampled_from([None, None, "state", "key_len", "flags", "length",
                                  "checksum", "generation", "epoch", "last", "good_sum"]))
    if field is not None:
        value = draw(st.booleans()) if field == "good_sum" else draw(
            st.integers(0, 255) if field in ("state", "key_len", "flags") else _u64)
        setattr(spec, field, value)
    return spec


N_FUZZ = 12
#: What the fuzzing saw, over all examples (the last test asserts it saw both).
ADOPTED: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module")
def fuzz_segment() -> Iterator[Segment]:
    path = os.path.join("/dev/shm", f"kvt-bt-{uuid.uuid4().hex}")
    os.mkdir(path, 0o700)
    seg = make_segment(path, N_FUZZ)
    try:
        yield seg
    finally:
        seg.close(unlink=True)
        shutil.rmtree(path, ignore_errors=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(near_valid() | slot_specs, min_size=N_FUZZ, max_size=N_FUZZ),
       cut=st.one_of(st.none(), st.integers(0, N_FUZZ * SLOT)))
def test_native_adopt_accepts_exactly_what_scan_slots_accepts(
        fuzz_segment: Segment, specs: list[SlotSpec], cut: int | None) -> None:
    from .slot_oracle import scan_slots

    seg = fuzz_segment
    for slot, spec in enumerate(specs):
        _forge(seg, slot, spec)
    seg.intact_bytes = seg.layout.data_bytes if cut is None else cut
    before = seg.raw_table()
    # native, on a copy of the same bytes
    meta = bytearray(before)
    t = BlockTable(BLOCK, SLOT)
    t.add_extent(seg.segment_id, N_FUZZ, meta, seg.created_unix_ns)
    got = t.adopt(seg, EPOCH)
    # Python, on the segment itself
    adopted, dropped = scan_slots(seg, boot_epoch=EPOCH)
    assert got.dropped == dict(dropped)
    assert split(t.committed(seg.segment_id))[1].tolist() == adopted.slots
    states = t.inspect(refs_of(seg.segment_id, range(N_FUZZ)))["state"]
    assert np.flatnonzero(states == RESERVED).tolist() == adopted.reserved
    assert np.flatnonzero(states == FREE).tolist() == adopted.free
    assert (got.adopted, got.reserved, got.free) == (
        len(adopted.slots), len(adopted.reserved), len(adopted.free))
    assert got.max_last_access == max(adopted.last_access, default=0)
    # The tables agree byte for byte, with Python's in-memory generations applied (the
    # native table resets a free slot's generation in the slot table itself).
    expect = bytearray(seg.raw_table())
    np.frombuffer(expect, dtype=SLOT_DTYPE)["generation"] = adopted.generations
    diff = np.flatnonzero(np.frombuffer(bytes(meta), np.uint8) != np.frombuffer(
        bytes(expect), np.uint8))
    assert diff.tolist() == [], (diff // 128, diff % 128)
    keys = [bytes(meta[s * 128 + 40 : s * 128 + 40 + meta[s * 128 + 1]])
            for s in adopted.slots]
    assert keys == adopted.keys
    assert t.check() == []
    c = t.counts()
    assert (c.committed, c.dirty, c.evictable) == (len(adopted.slots),) * 3
    ADOPTED.update(adopted=len(adopted.slots), dropped=sum(dropped.values()))


def test_adopt_takes_only_a_fresh_extent() -> None:
    t, meta = table(4)
    claimed(t, 1)
    with pytest.raises(ValueError, match="in use"):
        t._t.adopt(1, EPOCH, 4 * SLOT)
    with pytest.raises(ValueError, match="not in the table"):
        t._t.adopt(2, EPOCH, 4 * SLOT)


def test_adopted_blocks_serve_the_same_operations(shm_dir: str) -> None:
    seg = make_segment(shm_dir, 8)
    t = BlockTable(BLOCK, SLOT)
    t.add_segment(seg)
    refs = claimed(t, 6)
    commit(t, refs, first=100)
    t.delete(refs[5:])  # freed
    t.release_claims(claimed(t, 1))
    quarantined = claimed(t, 1)
    t.remove_extent(seg.segment_id, force=True)
    again = BlockTable(BLOCK, SLOT)
    again.add_segment(seg)
    got = again.adopt(seg, EPOCH)
    assert (got.adopted, got.reserved, got.free, got.max_last_access) == (5, 1, 2, 104)
    assert again.committed(seg.segment_id).tolist() == refs[:5].tolist()
    assert again.inspect(refs[:5])["flags"].tolist() == [0] * 5  # no CLOCK bit by default
    again.release_claims(quarantined)
    again.pin(refs[:2])
    assert len(again.victims(8, Policy.LRU)) == 3
    assert again.check() == []
    again.remove_extent(seg.segment_id, force=True)
    seg.close(unlink=True)


# ------------------------------------------------------------------ state machine


@dataclasses.dataclass
class ModelSlot:
    state: int = FREE
    pins: int = 0
    lower: int = DIRTY
    generation: int = 0


class BlockTableMachine(RuleBasedStateMachine):
    """The native table against dicts: after every step the records, counters and
    slot tables equal the model's, and ``check()`` finds nothing."""

    @initialize(sizes=st.lists(st.integers(1, 12), min_size=1, max_size=3))
    def start(self, sizes: list[int]) -> None:
        self.t = BlockTable(BLOCK, SLOT, seed=7)
        self.metas: dict[int, bytearray] = {}
        self.model: dict[int, ModelSlot] = {}
        self.seq = 1
        self.next_id = 3
        for n in sizes:
            self._add(n)

    def _add(self, n: int) -> None:
        eid = self.next_id
        self.next_id += 2
        self.metas[eid] = bytearray(n * SLOT_ENTRY_BYTES)
        self.t.add_extent(eid, n, self.metas[eid], CREATED + eid)
        for s in range(n):
            self.model[int(refs_of(eid, [s])[0])] = ModelSlot()

    def _in(self, *states: int) -> list[int]:
        return sorted(r for r, m in self.model.items() if m.state in states)

    def _some(self, data: st.DataObject, refs: list[int], *, dup: bool = False) -> list[int]:
        if not refs:
            return []
        pick = st.lists(st.sampled_from(refs), max_size=8, unique=not dup)
        return data.draw(pick)

    def _expect_error(self, fn: object, *args: object, **kwargs: object) -> None:
        snapshot = {e: bytes(m) for e, m in self.metas.items()}
        counts = self.t.counts()
        with pytest.raises(ValueError):
            fn(*args, **kwargs)  # type: ignore[operator]
        assert {e: bytes(m) for e, m in self.metas.items()} == snapshot
        assert self.t.counts() == counts

    @rule(n=st.integers(1, 6))
    def add_extent(self, n: int) -> None:
        if len(self.metas) < 5:
            self._add(n)

    @rule(n=st.integers(0, 20))
    def claim(self, n: int) -> None:
        free = self._in(FREE)
        refs, short = self.t.claim(n)
        if n > len(free):
            assert (len(refs), short) == (0, n - len(free))
            return
        assert short == 0 and len(set(refs.tolist())) == n
        for r in refs.tolist():
            m = self.model[r]
            assert m.state == FREE
            m.state, m.generation = RESERVED, m.generation + 1

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        refs = self._some(data, self._in(RESERVED))
        self.t.release_claims(refs)
        for r in refs:
            self.model[r] = dataclasses.replace(self.model[r], state=FREE, pins=0, lower=DIRTY)

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        refs = self._some(data, self._in(RESERVED))
        if refs and data.draw(st.booleans()):  # a bad item anywhere: nothing changes
            bad = data.draw(st.sampled_from(["length", "state", "dup"]))
            lengths = [10] * len(refs)
            the_refs = list(refs)
            if bad == "length":
                lengths[-1] = BLOCK + 1
            elif bad == "state" and self._in(FREE, COMMITTED):
                the_refs[-1] = self._in(FREE, COMMITTED)[0]
            else:
                the_refs.append(the_refs[0])
                lengths.append(10)
            self._expect_error(self.t.commit, the_refs, [b"k"] * len(the_refs), lengths, None,
                               first_access=self.seq, epoch=EPOCH)
            return
        self.t.commit(refs, [b"key%d" % r for r in refs], [10] * len(refs),
                      [r % 3 for r in refs], first_access=self.seq, epoch=EPOCH)
        self.seq += len(refs)
        for r in refs:
            self.model[r].state, self.model[r].lower = COMMITTED, DIRTY

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        refs = self._some(data, self._in(COMMITTED), dup=True)
        self.t.pin(refs)
        for r in refs:
            self.model[r].pins += 1

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pinned = [r for r in self._in(COMMITTED, DOOMED) if self.model[r].pins]
        refs = self._some(data, pinned)
        freed = self.t.unpin(refs).tolist()
        expect = []
        for r in refs:
            m = self.model[r]
            m.pins -= 1
            if m.state == DOOMED and m.pins == 0:
                m.state, m.lower = FREE, DIRTY
                expect.append(r)
        assert freed == expect

    @rule(data=st.data())
    def unpin_too_many(self, data: st.DataObject) -> None:
        unpinned = [r for r in self._in(COMMITTED) if self.model[r].pins == 0]
        if unpinned:
            self._expect_error(self.t.unpin, self._some(data, unpinned) or unpinned[:1])

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        refs = self._some(data, self._in(COMMITTED))
        doomed = self.t.delete(refs)
        assert doomed == sum(1 for r in refs if self.model[r].pins)
        for r in refs:
            m = self.model[r]
            if m.pins:
                m.state = DOOMED
            else:
                m.state, m.lower = FREE, DIRTY

    @rule(data=st.data(), policy=st.sampled_from(list(Policy)), spill=st.booleans(),
          reserve=st.booleans(), n=st.integers(0, 6))
    def evict_victims(self, data: st.DataObject, policy: Policy, spill: bool, reserve: bool,
                      n: int) -> None:
        got = self.t.victims(n, policy, sample=data.draw(st.integers(1, 8)),
                             pool=data.draw(st.booleans()), spill=spill).tolist()
        eligible = {r for r in self._in(COMMITTED) if self.model[r].pins == 0
                    and not (spill and self.model[r].lower == DIRTY)}
        assert len(set(got)) == len(got) and set(got) <= eligible
        assert len(got) == min(n, len(eligible))  # small tables: never short
        self.t.evict(got, reserve=reserve)
        for r in got:
            m = self.model[r]
            if reserve:
                m.state, m.generation, m.lower = RESERVED, m.generation + 1, DIRTY
            else:
                m.state, m.lower = FREE, DIRTY

    @rule(data=st.data())
    def evict_pinned(self, data: st.DataObject) -> None:
        pinned = [r for r in self._in(COMMITTED) if self.model[r].pins]
        if pinned:
            self._expect_error(self.t.evict, self._some(data, pinned) or pinned[:1])

    @rule(data=st.data(), lower=st.sampled_from([DIRTY, CLEAN, UNSPILLABLE]))
    def set_lower(self, data: st.DataObject, lower: int) -> None:
        refs = self._some(data, sorted(self.model))
        changed = self.t.set_lower(refs, lower)
        expect = 0
        for r in refs:
            m = self.model[r]
            if m.state == COMMITTED and m.lower != lower:
                m.lower = lower
                expect += 1
        assert changed == expect

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        refs = self._some(data, sorted(self.model), dup=True)
        touched, _ = self.t.touch(refs + [2**64 - 1], self.seq, hints=True)
        assert touched == sum(1 for r in refs if self.model[r].state == COMMITTED)
        self.seq += len(refs) + 1

    @rule(data=st.data(), n=st.integers(1, 4))
    def claim_skipping(self, data: st.DataObject, n: int) -> None:
        free = self._in(FREE)
        skip = self._some(data, free)
        refs, short = self.t.claim(n, skip=[r | 1 << 63 for r in skip])  # hazard words
        usable = [r for r in free if r not in skip]
        if n > len(usable):
            assert (len(refs), short) == (0, n - len(usable) if n <= len(free) else n - len(free))
            return
        assert short == 0 and not set(refs.tolist()) & set(skip)
        for r in refs.tolist():
            self.model[r].state, self.model[r].generation = RESERVED, self.model[r].generation + 1

    @rule()
    def restart(self) -> None:
        """A new daemon adopts the slot tables the old one wrote (pins are gone)."""
        self.t = BlockTable(BLOCK, SLOT, seed=8)
        for eid, meta in sorted(self.metas.items()):
            n = len(meta) // SLOT_ENTRY_BYTES
            self.t.add_extent(eid, n, meta, CREATED + eid)
            got = self.t._t.adopt(eid, EPOCH, n * SLOT)
            assert got["dropped"] == {}
        for m in self.model.values():
            m.pins = 0
            if m.state == DOOMED:
                m.state = FREE  # deleted while leased: never comes back
            m.lower = DIRTY  # adopted blocks are DIRTY until the tiers say otherwise

    @rule(data=st.data(), policy=st.sampled_from(list(Policy)))
    def demotion_candidates(self, data: st.DataObject, policy: Policy) -> None:
        n = data.draw(st.integers(0, 8))
        got = self.t.dirty(n, policy).tolist()
        eligible = {r for r in self._in(COMMITTED)
                    if self.model[r].pins == 0 and self.model[r].lower == DIRTY}
        assert len(set(got)) == len(got) and set(got) <= eligible
        assert len(got) == min(n, len(eligible))

    @rule(data=st.data())
    def remove_extent(self, data: st.DataObject) -> None:
        if len(self.metas) < 2:
            return
        eid = data.draw(st.sampled_from(sorted(self.metas)))
        mine = [r for r in self.model if r >> 32 == eid]
        if any(self.model[r].pins for r in mine):
            self._expect_error(self.t.remove_extent, eid)
            return
        committed = sum(1 for r in mine if self.model[r].state in (COMMITTED, DOOMED))
        reserved = sum(1 for r in mine if self.model[r].state == RESERVED)
        assert self.t.remove_extent(eid) == (committed, reserved)
        for r in mine:
            del self.model[r]
        del self.metas[eid]

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "t"):
            return
        refs = np.array(sorted(self.model), dtype=np.uint64)
        recs = self.t.inspect(refs)
        assert recs["state"].tolist() == [self.model[r].state for r in refs.tolist()]
        assert recs["pins"].tolist() == [self.model[r].pins for r in refs.tolist()]
        live = [self.model[r].state in (COMMITTED, DOOMED) for r in refs.tolist()]
        assert [lw for lw, ok in zip(recs["lower"].tolist(), live, strict=True) if ok] == [
            self.model[r].lower for r, ok in zip(refs.tolist(), live, strict=True) if ok]
        assert recs["generation"].tolist() == [self.model[r].generation for r in refs.tolist()]
        for eid, meta in self.metas.items():
            persisted = rows(meta)["state"].tolist()
            mine = [self.model[int(r)].state for r in refs_of(eid, range(len(persisted)))]
            assert persisted == mine
        states = collections.Counter(m.state for m in self.model.values())
        c = self.t.counts()
        assert (c.slots, c.free, c.reserved, c.committed, c.doomed) == (
            len(self.model), states[FREE], states[RESERVED], states[COMMITTED] + states[DOOMED],
            states[DOOMED])
        assert c.pinned == sum(1 for m in self.model.values() if m.pins)
        assert self.t.check() == []


TestBlockTableMachine = BlockTableMachine.TestCase
TestBlockTableMachine.settings = settings(max_examples=60, stateful_step_count=30,
                                          deadline=None)


def test_entry_checksum_seed_matches_segments() -> None:
    # the native seed: created ^ slot * 0x9E3779B97F4A7C15 (mod 2**64), as entry_seed
    t, meta = table(3)
    refs = claimed(t, 3)
    commit(t, refs)
    for slot in range(3):
        raw = bytes(meta[slot * 128 : slot * 128 + 128])
        seed = segments.entry_seed(CREATED, slot)
        assert int.from_bytes(raw[104:112], "little") == xxhash.xxh3_64_intdigest(
            raw[1:104], seed)


def test_adoption_fuzzing_saw_adopted_and_dropped_slots() -> None:
    if not ADOPTED:
        pytest.skip("the fuzzing test did not run in this session")
    assert ADOPTED["adopted"] > 100 and ADOPTED["dropped"] > 100, ADOPTED


@pytest.mark.parametrize("seed", range(4))
def test_native_adopt_matches_scan_slots_on_tables_of_random_bytes(
        fuzz_segment: Segment, seed: int) -> None:
    from .slot_oracle import scan_slots

    seg = fuzz_segment
    rng = np.random.default_rng(seed)
    raw = bytearray(rng.integers(0, 256, N_FUZZ * SLOT_ENTRY_BYTES, dtype=np.uint8).tobytes())
    for slot in range(0, N_FUZZ, 3):  # a third of them plausible but for the checksum
        raw[slot * 128] = COMMITTED
        raw[slot * 128 + 1] = 1 + slot
    seg.meta[TABLE_OFFSET : TABLE_OFFSET + len(raw)] = raw
    seg.intact_bytes = seg.layout.data_bytes
    meta = bytearray(raw)
    t = BlockTable(BLOCK, SLOT)
    t.add_extent(seg.segment_id, N_FUZZ, meta, seg.created_unix_ns)
    got = t.adopt(seg, EPOCH)
    adopted, dropped = scan_slots(seg, boot_epoch=EPOCH)
    assert got.dropped == dict(dropped) and got.adopted == len(adopted.slots) == 0
    expect = bytearray(seg.raw_table())
    np.frombuffer(expect, dtype=SLOT_DTYPE)["generation"] = adopted.generations
    assert bytes(meta) == bytes(expect)
    assert t.check() == []


def test_check_from_another_thread_always_sees_whole_batches() -> None:
    import threading

    n = 4096
    t, _ = table(n)
    stop = threading.Event()
    seen: list[list[str]] = []

    def checker() -> None:
        while not stop.is_set():
            seen.append(t.check())

    worker = threading.Thread(target=checker)
    worker.start()
    try:
        seq = 1
        for _ in range(30):  # batches above the GIL-release threshold
            refs = claimed(t, 2048)
            commit(t, refs, first=seq)
            seq += 2048
            t.pin(refs[:1024])
            t.evict(t.victims(1024, Policy.CLOCK))
            t.unpin(refs[:1024])
            t.delete(refs[:1024])
    finally:
        stop.set()
        worker.join()
    assert seen and all(problems == [] for problems in seen)
    assert t.counts().free == n and t.check() == []


def test_adopt_gives_recently_used_blocks_their_clock_bit(shm_dir: str) -> None:
    seg = make_segment(shm_dir, 8)
    t = BlockTable(BLOCK, SLOT)
    t.add_segment(seg)
    refs = claimed(t, 8)
    commit(t, refs, first=10)  # slot i last accessed at 10 + i
    t.remove_extent(seg.segment_id)
    again = BlockTable(BLOCK, SLOT)
    again.add_segment(seg)
    again.adopt(seg, EPOCH, referenced_from=14)
    assert again.inspect(refs)["flags"].tolist() == [0] * 4 + [bt.REFERENCED] * 4
    # the hand takes the older half first
    assert sorted(split(again.victims(4, Policy.CLOCK))[1].tolist()) == [0, 1, 2, 3]
    again.remove_extent(seg.segment_id)
    seg.close(unlink=True)


def test_an_extents_newest_access_follows_commit_touch_and_adopt(shm_dir: str) -> None:
    """What reclaim across namespaces compares: the largest last access an extent's
    blocks were given, kept per extent in O(1), and never lowered by a block leaving."""
    seg = make_segment(shm_dir, 8)
    t = BlockTable(BLOCK, SLOT)
    t.add_segment(seg)
    t.add_extent(9, 4, bytearray(4 * SLOT_ENTRY_BYTES), CREATED)
    assert t.counts(seg.segment_id).newest_access == 0  # nothing committed yet
    refs = claimed(t, 8)
    mine = refs[split(refs)[0] == seg.segment_id]
    commit(t, mine, first=100)
    assert t.counts(seg.segment_id).newest_access == 100 + len(mine) - 1
    t.touch(mine[:1], 500)
    assert t.counts(seg.segment_id).newest_access == 500
    assert t.counts().newest_access == 500  # the table's: its newest extent's
    assert t.counts(9).newest_access == 0
    t.delete(mine[:1])  # the newest block left: the bound stays
    assert t.counts(seg.segment_id).newest_access == 500
    t.remove_extent(9, force=True)
    t.remove_extent(seg.segment_id)
    again = BlockTable(BLOCK, SLOT)
    again.add_segment(seg)
    got = again.adopt(seg, EPOCH)
    assert again.counts(seg.segment_id).newest_access == got.max_last_access == 100 + len(mine) - 1
    again.remove_extent(seg.segment_id)
    seg.close(unlink=True)


def test_rescale_access_keeps_the_order_and_the_entries_valid(shm_dir: str) -> None:
    seg = make_segment(shm_dir, 8)
    t = BlockTable(BLOCK, SLOT)
    t.add_segment(seg)
    refs = claimed(t, 6)
    base = (1 << 47) + 12345
    commit(t, refs, first=base)
    t.delete(refs[5:])
    before = seg.scan()["last_access"][:5].tolist()
    with pytest.raises(ValueError, match="0..63"):
        t.rescale_access(64)
    assert t.rescale_access(20) == 5
    after = seg.scan()["last_access"][:5].tolist()
    assert after == [v >> 20 for v in before] and after == sorted(after)
    assert t.counts(seg.segment_id).newest_access == (base + 4) >> 20
    assert t.check() == []
    t.remove_extent(seg.segment_id)
    again = BlockTable(BLOCK, SLOT)  # the entries still verify (the field is not summed)
    again.add_segment(seg)
    assert again.adopt(seg, EPOCH).adopted == 5
    again.remove_extent(seg.segment_id)
    seg.close(unlink=True)


def test_claim_with_evict_takes_free_slots_and_victims_in_one_call_or_nothing() -> None:
    t, meta = table(6)
    refs = claimed(t, 4)
    commit(t, refs)
    t.pin(refs[3:])
    before = bytes(meta)
    with pytest.raises(ValueError, match="pinned"):
        t.claim(2, evict=refs[2:4])  # one victim is pinned: nothing changes
    with pytest.raises(ValueError, match="twice"):
        t.claim(1, evict=[refs[0], refs[0]])
    got, short = t.claim(3, evict=refs[:1])  # 2 free slots < 3: nothing is evicted
    assert (len(got), short) == (0, 1)
    assert bytes(meta) == before and t.check() == []
    got, short = t.claim(2, evict=refs[:2])
    assert short == 0 and len(got) == 2 and not set(got.tolist()) & set(refs.tolist())
    r = rows(meta)
    assert r["state"][:6].tolist() == [RESERVED] * 2 + [COMMITTED] * 2 + [RESERVED] * 2
    assert r["generation"][:2].tolist() == [2, 2]  # the victims' slots: generation + 1
    assert t.counts().committed == 2 and t.check() == []


def test_commit_with_release_frees_the_rest_of_the_reservation_in_one_call() -> None:
    t, meta = table(4)
    refs = claimed(t, 4)
    before = bytes(meta)
    keys = [b"a", b"b"]
    with pytest.raises(ValueError, match="twice"):
        t.commit(refs[:2], keys, [1, 1], None, first_access=1, epoch=EPOCH, release=refs[1:3])
    with pytest.raises(ValueError, match="is FREE"):
        t.release_claims(refs[3:])
        t.commit(refs[:2], keys, [1, 1], None, first_access=1, epoch=EPOCH, release=refs[3:])
    t.commit(refs[:2], keys, [1, 1], None, first_access=1, epoch=EPOCH, release=refs[2:3])
    assert rows(meta)["state"].tolist() == [COMMITTED, COMMITTED, FREE, FREE]
    assert before != bytes(meta) and t.check() == []


def test_release_claims_with_unpin_ends_both_or_neither() -> None:
    t, _meta = table(4)
    refs = claimed(t, 4)
    commit(t, refs[:2])
    t.pin(refs[:2])
    t.delete(refs[1:2])  # doomed: freed by its last unpin
    with pytest.raises(ValueError, match="no pin left"):
        t.release_claims(refs[2:3], unpin=[refs[0], refs[0]])
    assert t.counts().reserved == 2 and t.inspect(refs[:1])["pins"].tolist() == [1]
    freed = t.release_claims(refs[2:], unpin=refs[:2])
    assert freed.tolist() == [int(refs[1])]
    c = t.counts()
    assert (c.free, c.reserved, c.committed, c.pinned) == (3, 0, 1, 0) and t.check() == []
    assert t.release_claims([]).tolist() == []


def test_the_shared_index_takes_an_adopted_extents_keys_from_its_slot_table() -> None:
    """SharedIndex.add_slots (recovery: no Python object per key): every COMMITTED slot's
    key at its location; keys held already are left out for the caller."""
    from kvtier import _native
    from kvtierd.shared_index import SharedIndex

    t, meta = table(8, extent_id=7)
    refs = claimed(t, 6)
    t.commit(refs, [b"k%d" % i for i in range(6)], np.arange(1, 7), list(range(100, 106)),
             first_access=1, epoch=EPOCH)
    shared = SharedIndex("ns", lower_tiers=False)
    shared.add(b"k2", (1, 0, 0, 1, None))  # held already: left out
    slots = refs & np.uint64(0xFFFF_FFFF)
    assert shared.add_slots(memoryview(meta), slots, 7, SLOT) == [2]
    got = shared.find_many([b"k%d" % i for i in range(6)]).tolist()
    assert got == [7 << 32 | i if i != 2 else 1 << 32 for i in range(6)]
    assert shared._table is not None
    assert _native.index_locate(shared._table.mm, b"k4") == (7, 4, 4 * SLOT, 5, 104)
    with pytest.raises(ValueError, match="no COMMITTED entry"):
        shared.add_slots(memoryview(meta), np.array([7], dtype=np.uint64), 7, SLOT)
    shared.close()


def test_add_slots_of_many_keys_checks_all_first_and_sizes_the_table_once() -> None:
    """A batch past the GIL-release threshold (prefetched inserts): every key found at
    its slot; one bad slot anywhere refuses the batch before any key goes in; ``room``
    sizes the table for the keys still to come (no growth at the next extent)."""
    from kvtier import _native
    from kvtierd.shared_index import SharedIndex

    n = 3000
    t, meta = table(n, extent_id=3)
    refs = claimed(t, n - 1)
    t.commit(refs, [b"%016d" % i for i in range(n - 1)], np.full(n - 1, 7), None,
             first_access=1, epoch=EPOCH)
    slots = refs & np.uint64(0xFFFF_FFFF)
    shared = SharedIndex("ns", lower_tiers=False)
    bad = np.concatenate([slots, np.array([n - 1], dtype=np.uint64)])  # the FREE one
    with pytest.raises(ValueError, match=f"slots\\[{n - 1}\\].*no COMMITTED entry"):
        shared.add_slots(memoryview(meta), bad, 3, SLOT)
    assert shared._table is not None and _native.index_info(shared._table.mm)[1] == 0
    assert shared.add_slots(memoryview(meta), slots, 3, SLOT, room=4 * n) == []
    capacity = shared.capacity
    assert capacity >= 2 * 4 * n
    got = shared.find_many([b"%016d" % i for i in range(n - 1)])
    assert got.tolist() == refs.tolist()
    t2, meta2 = table(n, extent_id=4)
    refs2 = claimed(t2, n)
    t2.commit(refs2, [b"x%015d" % i for i in range(n)], np.full(n, 7), None,
              first_access=1, epoch=EPOCH)
    assert shared.add_slots(memoryview(meta2), refs2 & np.uint64(0xFFFF_FFFF), 4, SLOT,
                            room=3 * n) == []
    assert shared.capacity == capacity  # sized once
    assert shared.find_many([b"x%015d" % i for i in range(n)]).tolist() == refs2.tolist()
    shared.close()


def _index_buffer(capacity: int, max_probe: int) -> bytearray:
    from kvtier import _native

    buf = bytearray(64 + capacity * 64)
    _native.index_format(buf, capacity, 0x5EED, max_probe)
    return buf


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_adoption_inserts_on_threads_make_the_table_one_thread_makes(threads: int) -> None:
    """``index_set_slots`` with threads (recovery's, csrc/index.c ``set_slots_par``):
    each thread owns a range of the table; the keys homed within max_probe of a range's
    end (~5 % here) go in after, on one thread.  The same keys go in at the same
    locations as on one thread, the same ones are left out (held already, or twice in
    the extent), the counts agree.  A table without room for them all takes them on
    one thread and stops where one thread does."""
    from kvtier import _native

    meta, slots, keys = _extent_with_twice_held_keys(40_000)
    n = len(keys)
    tables = []
    for k in (1, threads):
        buf = _index_buffer(1 << 16, 1024)
        assert _native.index_set(buf, b"%016d" % 100, 1, 0, (1, 0, 0, 1, None)) == 1
        at, left = _native.index_set_slots(buf, memoryview(meta), slots, 3, SLOT, 0, k)
        assert at == n
        tables.append((buf, left))
    (one, left1), (par, left_n) = tables
    assert left_n == left1 == [100, *range(n - 8, n)]  # held already; the second copies
    assert _native.index_info(par)[:3] == _native.index_info(one)[:3]
    assert sorted(np.frombuffer(_native.index_rows(par), "<u8").reshape(-1, 3).tolist()) == \
        sorted(np.frombuffer(_native.index_rows(one), "<u8").reshape(-1, 3).tolist())
    for key in keys[:n - 8]:
        assert _native.index_locate(par, key) == _native.index_locate(one, key)
    # No room for every key: one thread, stopping where it stops.
    stops = []
    for k in (1, threads):
        buf = _index_buffer(1 << 15, 1024)
        stops.append((*_native.index_set_slots(buf, memoryview(meta), slots, 3, SLOT, 0, k),
                      bytes(buf)))
    assert stops[0] == stops[1] and stops[0][0] < n


def test_adoption_inserts_on_threads_past_the_probe_limit() -> None:
    """With a probe limit of 4 most keys sit near a range's end and many pile up past
    the limit; which ones stay out may depend on the order they went in, nothing else
    does: every key is either where its slot is or left out, the counts add up, and
    the keys held already and the second copies are among those left out."""
    from kvtier import _native

    meta, slots, keys = _extent_with_twice_held_keys(40_000)
    n = len(keys)
    buf = _index_buffer(1 << 16, 4)
    assert _native.index_set(buf, b"%016d" % 100, 1, 0, (1, 0, 0, 1, None)) == 1
    at, left = _native.index_set_slots(buf, memoryview(meta), slots, 3, SLOT, 0, 2)
    assert at == n and left == sorted(left) and {100, *range(n - 8, n)} <= set(left)
    assert _native.index_info(buf)[1] == 1 + n - len(left)
    out = set(left)
    for i, key in enumerate(keys):
        got = _native.index_locate(buf, key)
        if i not in out:
            assert got is not None and got[:3] == (3, int(slots[i]), int(slots[i]) * SLOT)


def _extent_with_twice_held_keys(n: int) -> tuple[bytearray, np.ndarray, list[bytes]]:
    """An extent of ``n`` committed slots whose last 8 hold the keys of its first 8
    again (two commits: never written so by the daemon; adoption must cope)."""
    t, meta = table(n, extent_id=3)
    refs = claimed(t, n)
    keys = [b"%016d" % i for i in range(n - 8)] + [b"%016d" % i for i in range(8)]
    half = n // 2
    t.commit(refs[:half], keys[:half], np.full(half, 9), None, first_access=1, epoch=EPOCH)
    t.commit(refs[half:], keys[half:], np.full(n - half, 9), None, first_access=1,
             epoch=EPOCH)
    return meta, refs & np.uint64(0xFFFF_FFFF), keys


def test_slot_usage_reads_the_committed_entries_last_accesses_in_one_pass() -> None:
    """``slot_usage`` (recovery's first pass over a slot table): the COMMITTED entries
    with an in-bounds last access -- their count, the newest, and each in slot order;
    a buffer that is not whole entries is refused."""
    from kvtier import _native

    t, meta = table(8, extent_id=2)
    refs = claimed(t, 5)
    t.commit(refs[:4], [b"k%d" % i for i in range(4)], [1] * 4, None, first_access=10,
             epoch=EPOCH)
    r = rows(meta)
    assert r["state"].tolist()[:5] == [COMMITTED] * 4 + [RESERVED]
    view = np.frombuffer(meta, dtype=SLOT_DTYPE)
    view["last_access"][1] = 2**48  # out of bounds: not counted (adopt drops it)
    view["last_access"][2] = 77
    view["last_access"][4] = 99  # RESERVED: not counted
    count, newest, lasts = _native.slot_usage(memoryview(meta))
    want = [int(x) for x in view["last_access"][[0, 2, 3]]]
    assert (count, newest) == (3, max(want))
    assert np.frombuffer(lasts, dtype=np.uint64).tolist() == want
    assert _native.slot_usage(b"") == (0, 0, b"")
    with pytest.raises(ValueError, match="whole 128-byte entries"):
        _native.slot_usage(bytes(SLOT_ENTRY_BYTES + 1))


def test_check_rows_copy_state_key_fingerprint_generation_and_pins() -> None:
    """``check_rows``: a committed slot's key fingerprint (the shared index's), the
    generation of any other slot, the persisted state and key length, the pins."""
    from kvtier import _native
    from kvtierd.store.check import CHECK_ROW_DTYPE

    t, meta = table(6, extent_id=2)
    refs = claimed(t, 4)
    keys = [b"a-short-key", b"sixteen-byte-key"]
    t.commit(refs[:2], keys, [5, 6], None, first_access=1, epoch=EPOCH)
    t.pin(refs[:1])
    t.pin(refs[:1])
    got = np.frombuffer(t.check_rows(2), dtype=CHECK_ROW_DTYPE)
    assert len(got) == 6
    fps = np.frombuffer(_native.fingerprint_rows(keys), dtype="<u8").reshape(-1, 3)
    assert got["a"][:2].tolist() == fps[:, 0].tolist()
    assert got["b"][:2].tolist() == fps[:, 1].tolist()
    assert got["fp_flags"][:2].tolist() == fps[:, 2].tolist() == [1, 0]
    assert got["state"].tolist() == [COMMITTED, COMMITTED, RESERVED, RESERVED, FREE, FREE]
    assert got["key_len"][:2].tolist() == [11, 16]
    assert got["pins"].tolist() == [2, 0, 0, 0, 0, 0]
    gens = rows(meta)["generation"]
    assert got["a"][2:].tolist() == gens[2:].tolist() and got["b"][2:].tolist() == [0] * 4
    meta[3 * SLOT_ENTRY_BYTES] = 9  # a state byte that is no state: copied as it is
    assert np.frombuffer(t.check_rows(2), dtype=CHECK_ROW_DTYPE)["state"][3] == 9
    with pytest.raises(ValueError, match="not in the table"):
        t.check_rows(99)


def test_index_rows_and_populate() -> None:
    """``index_rows``: one row per live entry (not per the header's count);
    ``index_populate`` leaves the table as it was."""
    from kvtier import _native
    from kvtierd.shared_index import SharedIndex

    shared = SharedIndex("ns", lower_tiers=False)
    keys = [b"k%d" % i for i in range(50)]
    shared.add_many((k, (1, i, 0, 1, None)) for i, k in enumerate(keys))
    shared.discard(keys[0])
    assert shared._table is not None
    mm = shared._table.mm
    before = bytes(mm)
    assert _native.index_populate(mm) in (True, False)
    assert bytes(mm) == before
    want = sorted(np.frombuffer(_native.fingerprint_rows(keys[1:]), dtype="<u8")
                  .reshape(-1, 3).tolist())
    got = np.frombuffer(shared.rows(), dtype="<u8").reshape(-1, 3).tolist()
    assert sorted(got) == want
    mm[32:40] = (3).to_bytes(8, "little")  # the header's live count, lowered: rows still all
    assert sorted(np.frombuffer(shared.rows(), dtype="<u8").reshape(-1, 3).tolist()) == want
    # ``populating`` says whether a background populate still runs (adoption inserts on
    # one thread until it is done).
    table = shared._table
    assert not table.populating
    table.populate_in_background()
    assert table._populating is not None
    table._populating.join()
    assert not table.populating
    shared.close()


def test_check_keys_counts_and_compares_rows() -> None:
    """``_native.check_keys`` on hand-made rows: every class, and at most 5 missing keys,
    sorted by fingerprint and distinct."""
    from kvtier import _native
    from kvtierd.store.check import CHECK_ROW_DTYPE

    def rows_of(keys: list[bytes], states: list[int] | None = None) -> bytes:
        fps = np.frombuffer(_native.fingerprint_rows(keys), dtype="<u8").reshape(-1, 3)
        out = np.zeros(len(keys), dtype=CHECK_ROW_DTYPE)
        out["a"], out["b"], out["fp_flags"] = fps[:, 0], fps[:, 1], fps[:, 2]
        out["state"] = COMMITTED if states is None else states
        out["key_len"] = [len(k) for k in keys]
        return out.tobytes()

    ks = [b"%016d" % i for i in range(100)]
    index = _native.fingerprint_rows(ks[:90] + [b"stray-1", b"stray-2"])
    got = _native.check_keys([rows_of(ks[:50]), rows_of(ks[50:], [2] * 48 + [0, 1])], index,
                             _native.fingerprint_rows([ks[95], b"left"]), 7)
    n, twice, index_twice, missing, stray, gone = got
    assert n == 98 and not twice and not index_twice and stray == 2 and gone
    # ks[90..97] are missing but ks[95] (kept apart); 16-byte keys sort as bytes
    assert missing == [(1, i - 50) for i in (90, 91, 92, 93, 94)]
    got = _native.check_keys([rows_of(ks[:3] + ks[:1])], _native.fingerprint_rows(ks[:3] * 2),
                             b"", 8)
    assert got == (4, True, True, [], 0, False)
    # a key missing twice is committed twice, and listed once
    got = _native.check_keys([rows_of([b"m", b"m", b"n"])], b"", b"", 9)
    assert got[:3] == (3, True, False) and len(got[3]) == 2
    assert _native.check_keys([], b"", b"", 9) == (0, False, False, [], 0, False)
    with pytest.raises(ValueError):
        _native.check_keys([b"x" * 23], b"", b"", 0)
    with pytest.raises(ValueError):
        _native.check_keys([], b"x" * 25, b"", 0)


def test_by_extent_groups_refs_by_their_extent() -> None:
    assert bt.by_extent(np.zeros(0, dtype=np.uint64)) == []
    one = refs_of(7, [3, 1, 2])
    assert bt.by_extent(one) == [(7, None)]  # one extent: no mask
    mixed = np.concatenate([refs_of(9, [0, 5]), refs_of(7, [4])])
    groups = bt.by_extent(mixed)
    assert [g for g, _ in groups] == [7, 9]
    assert [mask.tolist() for _, mask in groups if mask is not None] == [
        [False, False, True], [True, True, False]]


@pytest.mark.parametrize("n", [2, 33, 511, 512, 4096])
def test_extent_ids_are_the_distinct_extents_in_order_at_any_batch_size(n: int) -> None:
    """Small batches take the distinct ids from a set, large ones from np.unique: the
    same answer either way."""
    rng = np.random.default_rng(n)
    ids = rng.choice([3, 9, 70000, 12], size=n)
    mixed = np.concatenate([refs_of(int(i), [k]) for k, i in enumerate(ids)])
    assert bt.extent_ids(mixed) == sorted(set(ids.tolist()))
    assert bt.extent_ids(refs_of(5, list(range(n)))) == [5]
    assert [g for g, _ in bt.by_extent(mixed)] == sorted(set(ids.tolist()))


def test_entries_read_keys_and_fields_of_the_slot_entries() -> None:
    t, _ = table(8)
    refs = claimed(t, 4)
    t.commit(refs[:3], [b"a", b"bb" * 32, b"c"], [10, 20, 30], [7, None, 9],
             first_access=5, epoch=EPOCH)
    keys, got = t.entries(refs)
    assert keys[:3] == [b"a", b"bb" * 32, b"c"] and keys[3] == b""  # RESERVED: no key
    assert got["length"][:3].tolist() == [10, 20, 30]
    assert got["has_checksum"][:3].tolist() == [1, 0, 1]
    assert got["checksum"][[0, 2]].tolist() == [7, 9]
    assert got["last_access"][:3].tolist() == [5, 6, 7]
    assert got["generation"].tolist() == t.inspect(refs)["generation"].tolist()
    assert got["state"].tolist() == [2, 2, 2, 1]  # COMMITTED x3, RESERVED
    assert t.fields(refs).tobytes() == got.tobytes()  # the same, without the keys
    with pytest.raises(ValueError):
        t.entries([refs[0] + np.uint64(100)])
    t.release_claims(refs[3:])
    assert t.check() == []


def test_n_slots_and_n_free_are_the_counts_through_adds_claims_and_removes() -> None:
    t, _ = table(16, 1)
    assert t.n_slots == t.counts().slots == 16
    assert t.n_free == t.counts().free == 16
    other = bytearray(40 * SLOT_ENTRY_BYTES)
    t.add_extent(2, 40, other, CREATED)
    assert t.n_slots == t.counts().slots == 56
    refs = claimed(t, 10)
    assert t.n_free == t.counts().free == 46
    commit(t, refs[:6])
    t.release_claims(refs[6:])
    t.evict(refs[:2])
    assert t.n_free == t.counts().free == 52
    t.delete(refs[2:6])
    assert t.n_free == t.counts().free == 56
    t.remove_extent(1)
    assert t.n_slots == t.counts().slots == 40
    assert t.n_free == t.counts().free == 40
    t.remove_extent(2)
    assert t.n_slots == t.counts().slots == 0 == t.n_free


def test_slot_offsets_follow_each_extents_own_layout() -> None:
    """``allocator.offsets``: a slot's offset is slot x its extent's slot size, an extent
    recovered with another layout included, in batches small and large."""
    from types import SimpleNamespace

    from kvtierd.store.allocator import offsets

    def ext(slot_bytes: int) -> SimpleNamespace:
        return SimpleNamespace(segment=SimpleNamespace(layout=SimpleNamespace(
            slot_bytes=slot_bytes)))

    ns = SimpleNamespace(slot_bytes=4096, by_id={1: ext(4096), 2: ext(8192), 3: ext(4096)})
    for n in (3, 700):
        segs = [1 + k % 3 for k in range(n)]
        refs = np.concatenate([refs_of(s, [k]) for k, s in enumerate(segs)])
        want = [k * (8192 if s == 2 else 4096) for k, s in enumerate(segs)]
        assert offsets(ns, refs).tolist() == want  # type: ignore[arg-type]
        assert offsets(ns, refs_of(1, [5, 9])).tolist() == [5 * 4096, 9 * 4096]  # type: ignore[arg-type]
