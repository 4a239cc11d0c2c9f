"""``_accel.ssd_find_slots``: the SSD tier's key index asked about many keys in one call
, on the C extension and on the Python fallback, against a dict model.

The indexes here are built by hand the way ``kvtierd.spill.ssd`` builds its own (the
tags from ``ssd.key_hash``, Python's xxhash), so every hit the native code finds proves
that its hash agrees with Python's.  Decoy words (the key's tag over another slot, over
no slot at all, past a file's rows) and indexes of random words stand for collisions and
for a bucket array that went wrong: the answers stay right or misses, never reads out of
bounds.  tests/unit/test_native_sanitized.py runs this file again under ASan + UBSan.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import _accel
from kvtierd.spill import format as fmt
from kvtierd.spill.ssd import key_hash

from .conftest import HAVE_NATIVE

NAMESPACES = ("", "a", "bb/x", "n" * 128)
KEY = st.binary(min_size=1, max_size=fmt.MAX_KEY_BYTES)


class Index:
    """Spill-file slot tables and a bucket array over them, built as ssd.py builds its."""

    def __init__(self, file_rows: list[int], gaps: list[int], n_buckets: int) -> None:
        self.tables = [bytearray(n * fmt.ENTRY_BYTES) for n in file_rows]
        self.bases: list[int] = []
        at = 0
        for n, gap in zip(file_rows, gaps, strict=True):
            at += gap
            self.bases.append(at)
            at += n
        self.free = [(f, s) for f, n in enumerate(file_rows) for s in range(n)]
        self.buckets = np.zeros(n_buckets, np.uint64)
        self.where: dict[tuple[bytes, bytes], int] = {}  # (namespace, key) -> slot id

    def put_row(self, ns: bytes, key: bytes) -> int | None:
        """Write an entry for (ns, key) into the next free slot; its slot id."""
        if not self.free:
            return None
        f, slot = self.free.pop(0)
        rec = fmt.EntryRecord(ns.decode(), key, 1, 0, 4096, 7, 1)
        self.tables[f][slot * fmt.ENTRY_BYTES : (slot + 1) * fmt.ENTRY_BYTES] = fmt.pack_entry(rec)
        return self.bases[f] + slot

    def put_word(self, tag: int, sid_plus_one: int) -> bool:
        """The word into the first empty bucket from the tag's home (linear probing)."""
        mask = len(self.buckets) - 1
        if int(np.count_nonzero(self.buckets)) >= len(self.buckets) - 1:
            return False  # (keep one bucket empty, as the tier's load factor does)
        i = tag & mask
        while self.buckets[i]:
            i = (i + 1) & mask
        self.buckets[i] = np.uint64(tag << 32 | sid_plus_one)
        return True

    def add(self, ns: bytes, key: bytes) -> None:
        if (ns, key) in self.where:
            return
        sid = self.put_row(ns, key)
        if sid is not None and self.put_word(key_hash(ns, key) >> 32, sid + 1):
            self.where[(ns, key)] = sid

    def find(self, accel: ModuleType, ns: bytes, keys: list[bytes]) -> list[int]:
        got = accel.ssd_find_slots(self.buckets, self.tables, self.bases, keys, ns)
        return np.frombuffer(got, np.int64).tolist()


@st.composite
def indexes(draw: st.DrawFn) -> tuple[Index, list[tuple[bytes, bytes]]]:
    file_rows = draw(st.lists(st.integers(1, 40), min_size=0, max_size=3))
    gaps = draw(st.lists(st.integers(0, 5), min_size=len(file_rows), max_size=len(file_rows)))
    idx = Index(file_rows, gaps, 1 << draw(st.integers(0, 7)))
    names = [n.encode() for n in NAMESPACES]
    stored = draw(st.lists(st.tuples(st.sampled_from(names), KEY), max_size=60))
    decoys = draw(st.lists(st.tuples(st.integers(0, 59), st.sampled_from(["other", "nowhere",
                                                                         "past", "zero"])),
                           max_size=20))
    # Decoys first, so they lie in the probe runs before the real words: the key's tag over
    # another key's slot, over a slot id no file has, past a table's rows, or over id 0.
    for at, kind in decoys:
        if not stored:
            break
        ns, key = stored[at % len(stored)]
        tag = key_hash(ns, key) >> 32
        if kind == "other":
            sid = idx.put_row(ns, key + b"!" if len(key) < 64 else key[:-1])
            if sid is not None:
                idx.put_word(tag, sid + 1)
        elif kind == "nowhere":
            idx.put_word(tag, (idx.bases[-1] + len(idx.tables[-1]) // fmt.ENTRY_BYTES
                               if idx.bases else 0) + 7)
        elif kind == "past" and idx.bases and idx.bases[0] > 0:
            idx.put_word(tag, idx.bases[0])  # slot id bases[0] - 1: before the first file
        elif kind == "zero":
            idx.put_word(tag, 0)
    for ns, key in stored:
        idx.add(ns, key)
    return idx, stored


SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@SETTINGS
@given(built=indexes(), asked=st.lists(st.tuples(st.sampled_from(NAMESPACES),
                                                 st.binary(min_size=0, max_size=80)),
                                       max_size=20))
def test_ssd_find_slots_agrees_with_a_dict_model(
        accel: ModuleType, built: tuple[Index, list[tuple[bytes, bytes]]],
        asked: list[tuple[str, bytes]]) -> None:
    idx, stored = built
    by_ns: dict[bytes, list[bytes]] = {}
    for ns, key in stored + [(n.encode(), k) for n, k in asked]:
        by_ns.setdefault(ns, []).append(key)
    for ns, keys in by_ns.items():
        # (keys stored, asked, and the same keys again: answers do not depend on order)
        keys = keys + keys[::-1] + [b"", b"z" * 65]
        assert idx.find(accel, ns, keys) == [idx.where.get((ns, k), -1) for k in keys]


@pytest.mark.skipif(not HAVE_NATIVE, reason="kvtier._native is not built")
@settings(max_examples=200, deadline=None)
@given(built=indexes(), asked=st.lists(KEY, max_size=20))
def test_ssd_find_slots_native_and_fallback_give_the_same_bytes(
        built: tuple[Index, list[tuple[bytes, bytes]]], asked: list[bytes]) -> None:
    from kvtier import _native

    idx, stored = built
    for ns in {ns for ns, _ in stored} | {b"a"}:
        keys = [k for n, k in stored if n == ns] + asked
        args = (idx.buckets, idx.tables, idx.bases, keys, ns)
        assert _native.ssd_find_slots(*args) == _py_find(*args)


def _py_find(*args: object) -> bytes:
    """The Python fallback, whatever ``_accel.NATIVE`` says."""
    real = _accel.NATIVE
    try:
        _accel.NATIVE = False  # type: ignore[misc]
        return _accel.ssd_find_slots(*args)  # type: ignore[arg-type]
    finally:
        _accel.NATIVE = real  # type: ignore[misc]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=64),
       log_n=st.integers(0, 6), rows=st.lists(st.integers(0, 9), max_size=3),
       keys=st.lists(st.binary(min_size=0, max_size=80), max_size=12),
       seed=st.integers(0, 3), at=st.lists(st.integers(0, 63), max_size=12))
def test_ssd_find_slots_on_a_garbage_index_stays_in_bounds_and_confirms_every_hit(
        accel: ModuleType, words: list[int], log_n: int, rows: list[int],
        keys: list[bytes], seed: int, at: list[int]) -> None:
    """Any bucket words (a full table with no empty bucket included), tables of any size
    (a partial last row too), any keys: no read out of bounds (the sanitized run checks),
    the probe ends, and a hit is a slot whose entry really holds the key."""
    n = 1 << log_n
    buckets = np.array((words * n)[:n], np.uint64)
    rng = np.random.default_rng(seed)
    tables = [bytearray(rng.integers(0, 256, r * fmt.ENTRY_BYTES + 3 * (i == 0),
                                     dtype=np.uint8).tobytes())
              for i, r in enumerate(rows)]
    bases = list(np.cumsum([0] + [r + 1 for r in rows])[:-1].tolist())
    # Some rows that do hold the keys asked, and their words somewhere, so hits happen.
    for t, r, base in zip(tables, rows, bases, strict=True):
        for s in range(min(r, len(keys))):
            if 1 <= len(keys[s]) <= 64:
                t[s * fmt.ENTRY_BYTES : (s + 1) * fmt.ENTRY_BYTES] = fmt.pack_entry(
                    fmt.EntryRecord("a", keys[s], 1, 0, 1, 1, 1))
                if s < len(at):
                    buckets[at[s] % n] = np.uint64(
                        (key_hash(b"a", keys[s]) >> 32) << 32 | (base + s + 1))
    got = np.frombuffer(accel.ssd_find_slots(buckets, tables, bases, keys, b"a"),
                        np.int64).tolist()
    assert len(got) == len(keys)
    for key, sid in zip(keys, got, strict=True):
        if sid < 0:
            assert sid == -1
            continue
        f = max(i for i, b in enumerate(bases) if b <= sid)
        off = (sid - bases[f]) * fmt.ENTRY_BYTES
        row = bytes(tables[f][off : off + fmt.ENTRY_BYTES])
        assert row[1] == len(key) and row[fmt.KEY_AT : fmt.KEY_AT + len(key)] == key
        assert row[2] == 1 and row[fmt.NS_AT] == ord("a")
        # ... and a word of the key's tag names it
        assert (key_hash(b"a", key) >> 32) << 32 | (sid + 1) in buckets.tolist()


def test_ssd_find_slots_of_a_full_index_of_one_tag_ends(accel: ModuleType) -> None:
    """No empty bucket and every word the key's tag over other slots: every bucket is
    probed once, then it is a miss."""
    idx = Index([8], [0], 8)
    others = [idx.put_row(b"a", b"o%d" % i) for i in range(8)]
    tag = key_hash(b"a", b"k") >> 32
    idx.buckets[:] = [np.uint64(tag << 32 | (sid + 1)) for sid in others if sid is not None]
    assert idx.find(accel, b"a", [b"k", b"o3"]) == [-1, -1]  # (o3's tag is another)


def test_ssd_find_slots_tells_keys_of_the_same_tag_apart(accel: ModuleType) -> None:
    """Two keys whose real xxh3 hashes share their upper half (found by hashing many
    keys), indexed in either order, in a run that wraps round the end of the array."""
    a, b = _colliding_keys(b"ns")
    tag = key_hash(b"ns", a) >> 32
    for first, second in ((a, b), (b, a)):
        idx = Index([4], [3], 4)
        idx.buckets[:] = 0
        sa, sb = idx.put_row(b"ns", first), idx.put_row(b"ns", second)
        assert sa is not None and sb is not None
        home = tag & 3
        idx.buckets[home] = np.uint64(tag << 32 | (sa + 1))
        idx.buckets[(home + 1) & 3] = np.uint64(tag << 32 | (sb + 1))
        idx.buckets[(home + 2) & 3] = np.uint64(5 << 32 | 1)  # another tag, then empty
        assert idx.find(accel, b"ns", [first, second, first + b"?", b"x"]) == [sa, sb, -1, -1]
        # Another namespace: the same key bytes, another field (and seed): a miss.
        assert idx.find(accel, b"nt", [first, second]) == [-1, -1]


_COLLIDING: dict[bytes, tuple[bytes, bytes]] = {}


def _colliding_keys(ns: bytes) -> tuple[bytes, bytes]:
    """Two 16-byte keys of ``ns`` whose key hashes have the same upper 32 bits."""
    if ns not in _COLLIDING:
        n = 1 << 18  # ~8 pairs expected among 2^18 keys
        field = np.zeros((n, fmt.MAX_KEY_BYTES + fmt.NAME_BYTES), np.uint8)
        keys = np.frombuffer(b"".join(b"%016d" % i for i in range(n)), np.uint8).reshape(n, 16)
        field[:, :16] = keys
        field[:, fmt.MAX_KEY_BYTES : fmt.MAX_KEY_BYTES + len(ns)] = np.frombuffer(ns, np.uint8)
        seeds = np.full(n, 16 | len(ns) << 8, np.uint64)
        tags = np.frombuffer(_accel.hash_rows(field, field.shape[1], 0, field.shape[1], seeds),
                             np.uint64) >> np.uint64(32)
        order = np.argsort(tags, kind="stable")
        same = np.flatnonzero(tags[order][1:] == tags[order][:-1])
        assert len(same), "no two keys share a tag (very unlikely)"
        i, j = int(order[same[0]]), int(order[same[0] + 1])
        _COLLIDING[ns] = (b"%016d" % i, b"%016d" % j)
    a, b = _COLLIDING[ns]
    assert key_hash(ns, a) >> 32 == key_hash(ns, b) >> 32 and a != b
    return a, b


def test_ssd_find_slots_argument_errors(accel: ModuleType) -> None:
    idx = Index([2], [0], 4)
    ok = (idx.buckets, idx.tables, idx.bases, [b"k"], b"a")
    assert idx.find(accel, b"a", []) == []
    with pytest.raises(ValueError, match="buckets has 24 bytes, not a power of two of 8-byte"):
        accel.ssd_find_slots(np.zeros(3, np.uint64), *ok[1:])
    with pytest.raises(ValueError, match="buckets has 0 bytes"):
        accel.ssd_find_slots(b"", *ok[1:])
    with pytest.raises(ValueError, match="buckets has 12 bytes"):
        accel.ssd_find_slots(bytes(12), *ok[1:])
    with pytest.raises(ValueError, match=r"tables and bases differ in length \(1 and 2\)"):
        accel.ssd_find_slots(ok[0], ok[1], [0, 5], ok[3], ok[4])
    with pytest.raises(ValueError, match="bases must ascend"):
        accel.ssd_find_slots(ok[0], [bytes(256), bytes(256)], [4, 4], ok[3], ok[4])
    with pytest.raises(ValueError, match=r"namespace has 129 bytes \(at most 128\)"):
        accel.ssd_find_slots(*ok[:4], b"n" * 129)
    with pytest.raises(ValueError, match="buckets is not C-contiguous"):
        accel.ssd_find_slots(np.zeros(8, np.uint64)[::2], *ok[1:])
    with pytest.raises(OverflowError):
        accel.ssd_find_slots(ok[0], ok[1], [-1], ok[3], ok[4])
    with pytest.raises(TypeError):
        accel.ssd_find_slots(*ok[:3], [b"k", 7], ok[4])
    with pytest.raises(TypeError):
        accel.ssd_find_slots(*ok[:3], None, ok[4])
    with pytest.raises(TypeError):
        accel.ssd_find_slots(ok[0], [None], *ok[2:])
    # Keys may be any buffer: bytearray, memoryview, numpy.
    idx.add(b"a", b"key")
    sid = idx.where[(b"a", b"key")]
    assert idx.find(accel, b"a", [bytearray(b"key"), memoryview(b"xkey")[1:],
                                  np.frombuffer(b"key", np.uint8)]) == [sid] * 3


def test_ssd_find_slots_releases_every_buffer(accel: ModuleType) -> None:
    """The buffers are let go on success and on error: an mmap closes, a bytearray grows."""
    import mmap

    table = mmap.mmap(-1, 4096)
    buckets = bytearray(64)
    key = bytearray(b"k")
    accel.ssd_find_slots(buckets, [table], [0], [key], b"a")
    with pytest.raises(ValueError):
        accel.ssd_find_slots(buckets, [table], [0], [key], b"n" * 200)
    with pytest.raises(TypeError):
        accel.ssd_find_slots(buckets, [table], [0], [key, 3], b"a")
    table.close()
    buckets.extend(b"x")
    key.extend(b"x")


@pytest.mark.skipif(not HAVE_NATIVE, reason="kvtier._native is not built")
def test_ssd_find_slots_of_many_keys_runs_without_the_gil_and_from_threads() -> None:
    """From 64 keys the call releases the GIL: threads asking at once all get the right
    answers (and other threads run meanwhile)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvtier import _native

    idx = Index([3000], [0], 8192)
    keys = [b"%016d" % i for i in range(3000)]
    for k in keys:
        idx.add(b"a", k)
    want = [idx.where[(b"a", k)] for k in keys]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: np.frombuffer(_native.ssd_find_slots(
            idx.buckets, idx.tables, idx.bases, keys, b"a"), np.int64).tolist(), range(8)))
    assert all(o == want for o in outs)
