"""The SSD tier's compact bookkeeping: slot columns, the open-addressing key
index, CLOCK eviction and vectorised re-adoption, against a plain-dict model."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvtierd.spill import format as fmt
from kvtierd.spill import ssd as ssd_mod
from kvtierd.spill import ssd_files, ssd_index
from kvtierd.spill.blockio import aligned_buffer
from kvtierd.spill.ssd import SpillFull, SsdTier

KiB = 1 << 10
NAMESPACES = ("a", "bb/x")
KEYS = [b"k%d" % i for i in range(12)] + [b"\x00", b"\x00\x00", b"x" * 64]
#: Two slot sizes (lengths up to 4 KiB take one page, up to 8 KiB two).
LENGTHS = (1, 4096, 4097, 8192)


def data(ns: str, key: bytes, tag: int, length: int) -> bytes:
    seed = xxhash.xxh64_intdigest(ns.encode() + key, tag)
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8).tobytes()


def _opened(path: str, capacity: int = 64 << 20, file_bytes: int = 8 << 20) -> SsdTier:
    """An SSD tier in ``path`` (buffered I/O), open: the spill files there adopted."""
    ssd = SsdTier(path, capacity=capacity, file_bytes=file_bytes, direct="false")
    ssd.open()
    return ssd


def _write(ssd: SsdTier, ns: str, key: bytes, payload: bytes, mhash: int = 7) -> None:
    buf = aligned_buffer(fmt.round_up(len(payload)))
    try:
        buf[: len(payload)] = payload
        with memoryview(buf) as view:
            ssd.write(ns, key, view, len(payload), None, 8192, mhash)
    finally:
        buf.close()


def _read(ssd: SsdTier, ns: str, key: bytes) -> bytes | None:
    e = ssd.find(ns, key, 8192, 7)
    if e is None:
        return None
    buf = aligned_buffer(fmt.round_up(e.length))
    try:
        with memoryview(buf) as view:
            ssd.read_into(e, view)
        return bytes(buf[: e.length])
    finally:
        buf.close()


@pytest.fixture
def weak_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key hashes to one of 4 values: every probe, deletion and adoption meets
    collisions (the index must still tell keys apart by their bytes).  The batch lookup
    hashes in C, with the real hash: here it is ``SsdKeyIndex.probe`` key by key instead
    (test_ssd_lookup.py puts the native one through collisions of its own)."""
    real_field, real_rows = ssd_index.field_hash, ssd_index.row_key_hashes
    weak = 3 << 62  # (the index uses a hash's upper half)
    monkeypatch.setattr(ssd_index, "field_hash", lambda *a: real_field(*a) & weak)
    monkeypatch.setattr(ssd_index, "row_key_hashes",
                        lambda table, n: real_rows(table, n) & np.uint64(weak))
    monkeypatch.setattr(ssd_index.SsdKeyIndex, "find_slots", lambda self, ns, keys: np.array(
        [self.probe(k, ns, ns.ljust(fmt.NAME_BYTES, b"\0"))[1] for k in keys], np.int64))


class SsdMachine(RuleBasedStateMachine):
    """Writes, rewrites, removes, reads, evictions and restarts of a small SSD tier
    (two slot sizes, room for a dozen blocks: CLOCK eviction and the reclaim of other
    sizes' files are everyday events) against a dict of what must be there."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvt-ssdidx-", dir="/var/tmp")
        self.model: dict[tuple[str, bytes], bytes] = {}
        self.events: list[tuple[str, bytes, bool]] = []
        self.ssd = self._boot()

    def _boot(self) -> SsdTier:
        ssd = _opened(self.dir, 64 * KiB, 40 * KiB)
        ssd.on_evicted = lambda ns, key: self.model.pop((ns, key))
        ssd.watch(lambda ns, key, stored: self.events.append((ns, key, stored)))
        return ssd

    @rule(writes=st.lists(st.tuples(st.sampled_from(NAMESPACES), st.sampled_from(KEYS),
                                    st.sampled_from(LENGTHS), st.integers(0, 3)),
                          min_size=1, max_size=6))
    def write(self, writes: list[tuple[str, bytes, int, int]]) -> None:
        for ns, key, length, tag in writes:
            payload = data(ns, key, tag, length)
            self.events.clear()
            try:
                _write(self.ssd, ns, key, payload)
            except SpillFull:
                continue
            # Stored is told unless this replaced a copy (one evicted to make room is gone).
            assert ((ns, key, True) in self.events) == ((ns, key) not in self.model)
            self.model[(ns, key)] = payload

    @rule(ns=st.sampled_from(NAMESPACES), keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def remove(self, ns: str, keys: list[bytes]) -> None:
        expect = len({k for k in keys if (ns, k) in self.model})
        self.events.clear()
        assert self.ssd.remove(ns, keys) == expect
        for k in set(keys):
            if self.model.pop((ns, k), None) is not None:
                assert (ns, k, False) in self.events

    @rule(ns=st.sampled_from(NAMESPACES), key=st.sampled_from(KEYS))
    def read(self, ns: str, key: bytes) -> None:
        assert _read(self.ssd, ns, key) == self.model.get((ns, key))

    @rule(ns=st.sampled_from(NAMESPACES), key=st.sampled_from(KEYS))
    def removed_while_read(self, ns: str, key: bytes) -> None:
        """A remove during a read: the reader gets the bytes, the slot is freed after."""
        e = self.ssd.find(ns, key, 8192, 7)
        if e is None:
            return
        real = self.ssd._read_verified
        buf = aligned_buffer(fmt.round_up(e.length))

        def read_and_remove(entry: ssd_mod.SsdEntry, dst: memoryview) -> None:
            assert self.ssd.remove(ns, [key]) == 1
            assert e.removed and self.ssd.check() == []
            real(entry, dst)

        self.ssd._read_verified = read_and_remove  # type: ignore[method-assign]
        try:
            with memoryview(buf) as view:
                self.ssd.read_into(e, view)
            assert bytes(buf[: e.length]) == self.model.pop((ns, key))
        finally:
            del self.ssd._read_verified
            buf.close()
        assert not e.removed and self.ssd.find(ns, key, 8192, 7) is None

    @rule(go=st.integers(0, 4))
    def restart(self, go: int) -> None:
        if go:
            return  # (a restart in one draw of five)
        self.ssd.sync()
        self.ssd.flush_frees()
        self.ssd.close()
        self.ssd = self._boot()
        assert self.ssd.counters.adopted == len(self.model)

    @rule(ns=st.sampled_from(NAMESPACES + ("unknown",)),
          keys=st.lists(st.sampled_from(KEYS) | st.binary(max_size=70), max_size=10),
          mhash=st.sampled_from([7, 7, 8]))
    def batch_lookups_agree_with_per_key_ones(self, ns: str, keys: list[bytes],
                                              mhash: int) -> None:
        """``find_many`` and ``length_of_many`` (one native call) answer what ``find``
        and ``length_of`` answer key by key, geometry included, repeats and keys not
        1..64 bytes long too."""
        keys = keys + keys[:2]
        many = self.ssd.find_many(ns, keys, 8192, mhash)
        one = [self.ssd.find(ns, k, 8192, mhash) for k in keys]
        assert [None if e is None else (e.file, e.slot, e.seq, e.length) for e in many] == [
            None if e is None else (e.file, e.slot, e.seq, e.length) for e in one]
        for k, e in zip(keys, many, strict=True):
            assert (e is not None) == ((ns, k) in self.model and mhash == 7)
            assert e is None or (e.namespace, e.key) == (ns, k)
        for geometry in (None, (8192, mhash), (4096, 7)):
            assert self.ssd.length_of_many(ns, keys, geometry) == [
                self.ssd.length_of(ns, k, geometry) for k in keys]
        assert self.ssd.length_of_many(ns, keys) == [
            None if (ns, k) not in self.model else len(self.model[(ns, k)]) for k in keys]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def wrong_geometry_is_a_miss(self, data: st.DataObject) -> None:
        ns, key = data.draw(st.sampled_from(sorted(self.model)))
        assert self.ssd.find(ns, key, 8192, 8) is None
        assert self.ssd.find(ns, key, 4096, 7) is None

    @invariant()
    def agrees(self) -> None:
        assert sorted(self.ssd.all_keys()) == sorted(self.model)
        for ns in NAMESPACES:
            assert sorted(self.ssd.keys_of(ns)) == sorted(k for n, k in self.model if n == ns)
        assert self.ssd.check() == []
        assert self.ssd.stats()["blocks"] == len(self.model)

    def teardown(self) -> None:
        self.ssd.close()
        shutil.rmtree(self.dir, ignore_errors=True)


SETTINGS = settings(max_examples=12, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def test_ssd_tier_agrees_with_a_dict_model() -> None:
    run_state_machine_as_test(SsdMachine, settings=SETTINGS)


def test_ssd_tier_agrees_with_a_dict_model_when_every_key_collides(weak_hash: None) -> None:
    run_state_machine_as_test(SsdMachine, settings=SETTINGS)


# ---------------------------------------------------------------- the structures themselves
@pytest.fixture
def tier(disk_dir: str) -> Iterator[SsdTier]:
    with contextlib.closing(_opened(disk_dir)) as ssd:
        yield ssd


def test_the_key_index_grows_and_finds_every_key_after_deletions(tier: SsdTier) -> None:
    keys = [b"%016d" % i for i in range(1500)]
    for k in keys:
        _write(tier, "a", k, k * 4)
    assert len(tier.key_index.buckets) >= 2048 and tier.check() == []  # grown
    assert tier.remove("a", keys[::3]) == 500
    for i, k in enumerate(keys):
        assert (_read(tier, "a", k) == k * 4) == (i % 3 != 0)
    assert tier.check() == []


def test_no_python_object_per_entry_at_rest(tier: SsdTier) -> None:
    """The tier's bookkeeping is arrays: writing many entries adds no objects to track."""
    import gc

    for i in range(64):
        _write(tier, "a", b"warm%d" % i, b"w")
    gc.collect()
    before = len(gc.get_objects())
    for i in range(2000):
        _write(tier, "a", b"%016d" % i, b"v")
    gc.collect()
    assert len(gc.get_objects()) - before < 100
    assert tier.stats()["blocks"] == 2064


@pytest.mark.parametrize("n", [1, 3, 8, 9, 40])
def test_length_of_many_answers_as_length_of_key_by_key(disk_dir: str, n: int) -> None:
    """Small batches (read entry by entry) and large ones (vectorised) answer alike:
    absent keys, another namespace's, and copies of another geometry are None."""
    ssd = _opened(disk_dir)
    try:
        for i in range(30):
            _write(ssd, "a", b"k%d" % i, b"x" * (i + 1), mhash=7 if i % 3 else 9)
        _write(ssd, "bb/x", b"other", b"o")
        asked = [b"k%d" % (i * 7 % 45) for i in range(n - 1)] + [b"other"]
        for geometry in (None, (8192, 7), (8192, 9)):
            want = [ssd.length_of("a", k, geometry) for k in asked]
            assert ssd.length_of_many("a", asked, geometry) == want
            assert any(w is not None for w in want) or n == 1
        assert ssd.length_of_many("nobody", asked) == [None] * n
    finally:
        ssd.close()


def test_a_delete_persists_only_the_table_pages_it_freed(disk_dir: str) -> None:
    """``flush_frees`` writes the table pages holding freed entries (a run of them in
    one write), not the file's whole table; a restart finds the deleted keys gone and
    every other key still there."""
    ssd = _opened(disk_dir)
    n = 3 * fmt.ENTRIES_PER_PAGE
    keys = [b"p%05d" % i for i in range(n)]
    for k in keys:
        _write(ssd, "a", k, k)
    ssd.sync()
    slots = {k: ssd.index[("a", k)].slot for k in keys}
    f = ssd.index[("a", keys[0])].file
    assert f.layout.table_bytes > 4 * fmt.PAGE  # (so a whole-table write would show)
    page_of = {k: s // fmt.ENTRIES_PER_PAGE for k, s in slots.items()}
    gone = [next(k for k in keys if page_of[k] == 0),  # two pages apart: two writes
            next(k for k in keys if page_of[k] == 2)]
    writes: list[tuple[int, int]] = []
    real = ssd.io.pwrite

    def spy(fd: int, buf: object, offset: int) -> int:
        writes.append((offset, len(buf)))  # type: ignore[arg-type]
        return real(fd, buf, offset)

    ssd.io.pwrite = spy  # type: ignore[method-assign]
    assert ssd.remove("a", gone) == 2
    ssd.flush_frees()
    assert sorted(writes) == [(fmt.TABLE_OFFSET, fmt.PAGE),
                              (fmt.TABLE_OFFSET + 2 * fmt.PAGE, fmt.PAGE)]
    writes.clear()
    ssd.flush_frees()  # nothing freed since: nothing written
    assert writes == []
    ssd.close()
    fresh = _opened(disk_dir)
    try:
        assert [k for k in keys if _read(fresh, "a", k) is None] == gone
        assert _read(fresh, "a", keys[1]) == keys[1]
        assert fresh.check() == []
    finally:
        fresh.close()


def test_readoption_keeps_the_newest_copy_of_a_key_written_twice(disk_dir: str) -> None:
    """A crash between a rewrite's entry and the old copy's FREE entry leaves the key
    twice on disk: re-adoption keeps the newest write and frees the other."""
    ssd = _opened(disk_dir)
    _write(ssd, "a", b"k", b"old")
    _write(ssd, "a", b"other", b"o")
    ssd.sync()
    old = ssd.index[("a", b"k")]
    saved = bytes(old.file.table[old.slot * fmt.ENTRY_BYTES : (old.slot + 1) * fmt.ENTRY_BYTES])
    _write(ssd, "a", b"k", b"new")
    ssd.sync()
    # The old entry back in its slot, as if its FREE entry never reached the disk.
    ssd.flush_frees()
    f = old.file
    f.table[old.slot * fmt.ENTRY_BYTES : (old.slot + 1) * fmt.ENTRY_BYTES] = saved
    ssd_files.write_table_pages(ssd.io, ssd._lock, f, [old.slot // fmt.ENTRIES_PER_PAGE])
    ssd.close()
    fresh = _opened(disk_dir)
    try:
        assert fresh.counters.adopted == 2 and fresh.counters.dropped_entries == 1
        assert _read(fresh, "a", b"k") == b"new"
        assert fresh.check() == []
    finally:
        fresh.close()


def test_readoption_frees_entries_with_junk_past_their_key(disk_dir: str) -> None:
    ssd = _opened(disk_dir)
    _write(ssd, "a", b"k1", b"1")
    _write(ssd, "a", b"k2", b"2")
    ssd.sync()
    e = ssd.index[("a", b"k2")]
    off = e.slot * fmt.ENTRY_BYTES
    row = bytearray(e.file.table[off : off + fmt.ENTRY_BYTES])
    row[fmt.KEY_AT + 10] = 0xFF  # past the 2-byte key, with a valid entry checksum
    row[fmt.ENTRY_SUM_AT : fmt.ENTRY_SUM_AT + 8] = xxhash.xxh3_64_intdigest(
        bytes(row[: fmt.ENTRY_SUM_AT])).to_bytes(8, "little")
    e.file.table[off : off + fmt.ENTRY_BYTES] = bytes(row)
    ssd_files.write_table_pages(ssd.io, ssd._lock, e.file, [e.slot // fmt.ENTRIES_PER_PAGE])
    ssd.close()
    fresh = _opened(disk_dir)
    try:
        assert fresh.counters.adopted == 1 and fresh.counters.faults["torn_entry"] == 1
        assert sorted(fresh.all_keys()) == [("a", b"k1")] and fresh.check() == []
    finally:
        fresh.close()


def test_clock_spares_a_block_read_since_the_hand_passed(disk_dir: str) -> None:
    """Full tier, no reads: the oldest write goes first; a block read since is spared."""
    ssd = _opened(disk_dir, 40 * KiB, 40 * KiB)
    evicted: list[bytes] = []
    ssd.on_evicted = lambda ns, key: evicted.append(key)
    try:
        for i in range(8):  # 8 slots
            _write(ssd, "a", b"k%d" % i, b"v")
        _write(ssd, "a", b"n0", b"v")
        assert evicted == [b"k0"]
        assert _read(ssd, "a", b"k1") == b"v"  # referenced again
        _write(ssd, "a", b"n1", b"v")
        assert evicted == [b"k0", b"k2"]
        assert ssd.check() == []
    finally:
        ssd.close()


def test_concurrent_writers_and_readers_keep_the_books_balanced(tier: SsdTier) -> None:
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        while not stop.is_set():
            for i in range(0, 200, 7):
                try:
                    got = _read(tier, "a", b"%d" % i)
                    assert got in (None, b"%d" % i * 3)
                except KeyError:
                    pass  # evicted or rewritten between find and read
                except BaseException as exc:  # pragma: no cover - reported below
                    errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for rnd in range(3):
            for i in range(200):
                _write(tier, "a", b"%d" % i, b"%d" % i * 3)
            tier.remove("a", [b"%d" % i for i in range(rnd, 200, 5)])
    finally:
        stop.set()
        t.join()
    assert not errors and tier.check() == []


def test_a_full_tier_empties_the_coldest_file_of_another_size(disk_dir: str) -> None:
    ssd = _opened(disk_dir, 64 * KiB, 40 * KiB)
    evicted: list[bytes] = []
    gone: list[bytes] = []
    ssd.on_evicted = lambda ns, key: evicted.append(key)
    ssd.watch(lambda ns, key, stored: None if stored else gone.append(key))
    try:
        for i in range(12):  # one-page slots: a file of 8 and one of 4 fill the budget
            _write(ssd, "a", b"k%d" % i, b"v")
        assert [f.n_slots for f in ssd.files[4096]] == [8, 4]
        for i in range(8):
            assert _read(ssd, "a", b"k%d" % i) == b"v"  # the first file is the warmer
        _write(ssd, "a", b"big", bytes(8192))
        assert sorted(evicted) == sorted(gone) == sorted(b"k%d" % i for i in range(8, 12))
        assert [f.n_slots for f in ssd.files[4096]] == [8] and 8192 in ssd.files
        assert _read(ssd, "a", b"big") == bytes(8192) and ssd.check() == []
    finally:
        ssd.close()


def test_readoption_places_runs_that_wrap_round_the_index(
        disk_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key hashing to the last bucket: the rebuild's runs wrap to the start."""
    monkeypatch.setattr(ssd_index, "field_hash", lambda *a: 1023 << 32)
    monkeypatch.setattr(ssd_index, "row_key_hashes",
                        lambda table, n: np.full(n, 1023 << 32, np.uint64))
    ssd = _opened(disk_dir)
    for i in range(40):
        _write(ssd, "a", b"k%d" % i, b"%d" % i)
    ssd.remove("a", [b"k3", b"k17"])
    ssd.sync()
    ssd.flush_frees()
    ssd.close()
    fresh = _opened(disk_dir)
    try:
        assert fresh.counters.adopted == 38 and fresh.check() == []
        assert int(fresh.key_index.buckets[0]) != 0  # wrapped
        for i in range(40):
            assert _read(fresh, "a", b"k%d" % i) == (None if i in (3, 17) else b"%d" % i)
        assert fresh.remove("a", [b"k0", b"k39"]) == 2 and fresh.check() == []
    finally:
        fresh.close()


def test_slot_ids_are_renumbered_before_they_outgrow_32_bits(
        disk_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files come and go (reclaimed for another slot size): the ids of their slots
    are never reused while a file has them, and renumbered when the next would not fit."""
    monkeypatch.setattr(ssd_index, "MAX_SLOT_IDS", 40)
    rebuilt: list[int] = []
    rebuild = ssd_index.SsdKeyIndex.rebuild
    monkeypatch.setattr(ssd_index.SsdKeyIndex, "rebuild",
                        lambda self: (rebuilt.append(1), rebuild(self))[1])
    # Room for one file: each change of slot size reclaims it for a new one.
    ssd = _opened(disk_dir, 40 * KiB, 40 * KiB)
    model: dict[bytes, bytes] = {}
    ssd.on_evicted = lambda ns, key: model.pop(key)
    try:
        for rnd in range(10):
            for i in range(6):
                payload = bytes([rnd]) * (1 if rnd % 2 else 8192)
                _write(ssd, "a", b"r%d-%d" % (rnd, i), payload)
                model[b"r%d-%d" % (rnd, i)] = payload
            assert ssd.check() == []
            assert all(f.base + f.n_slots < 40 for f in ssd.key_index.files)
            for key, payload in model.items():
                assert _read(ssd, "a", key) == payload
        assert rebuilt  # (renumbered at least once)
    finally:
        ssd.close()


def test_batch_lookups_of_thousands_of_keys_over_many_files(tier: SsdTier) -> None:
    """4096 keys over several files (the bisect of slot ids into files, vectorised), half
    of them held, some rewritten (a new slot) or removed since, one bad length."""
    keys = [b"%016d" % i for i in range(4096)]
    for k in keys[::2]:
        _write(tier, "a", k, k)
    for k in keys[:400:4]:
        _write(tier, "a", k, k + b"!")  # rewritten: another slot
    tier.remove("a", keys[1000:1100])
    assert len(tier.key_index.files) > 1
    asked = keys + [b"", b"x" * 65]
    many = tier.find_many("a", asked, 8192, 7)
    one = [tier.find("a", k, 8192, 7) for k in asked]
    assert [None if e is None else (e.file, e.slot) for e in many] == [
        None if e is None else (e.file, e.slot) for e in one]
    assert sum(e is not None for e in many) == 2048 - 50
    lengths = tier.length_of_many("a", asked, (8192, 7))
    assert lengths == [tier.length_of("a", k, (8192, 7)) for k in asked]
    assert lengths[0] == 17 and lengths[2] == 16 and lengths[1] is None
    assert tier.length_of_many("a", asked, (8192, 8)) == [None] * len(asked)
    assert tier.find_many("b", asked, 8192, 7) == [None] * len(asked)
    assert tier.find_many("a", [], 8192, 7) == [] and tier.length_of_many("a", []) == []


def test_batch_lookups_go_to_the_native_call_in_pieces(
        tier: SsdTier, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch larger than FIND_BATCH is looked up a piece at a time, same answers."""
    keys = [b"p%d" % i for i in range(40)]
    for k in keys[::3]:
        _write(tier, "a", k, k)
    want = tier.length_of_many("a", keys)
    calls: list[int] = []
    real = ssd_index._accel.ssd_find_slots
    monkeypatch.setattr(ssd_index, "FIND_BATCH", 7)
    monkeypatch.setattr(ssd_index._accel, "ssd_find_slots",
                        lambda b, t, s, ks, ns: (calls.append(len(ks)), real(b, t, s, ks, ns))[1])
    assert tier.length_of_many("a", keys) == want
    assert [e is not None for e in tier.find_many("a", keys, 8192, 7)] == [
        n is not None for n in want]
    assert calls == [7, 7, 7, 7, 7, 5] * 2 and sum(n is not None for n in want) == 14
