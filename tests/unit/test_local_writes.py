"""Writes without a call: slots granted ahead and commits through the session page.

The protocol (csrc/writes.c): the daemon names slots it reserved for the
session in the page's grant entries; a writer takes some (a compare-and-swap
the daemon's take-back races fairly), fills them, publishes commit records and
the ring's head, rings the eventfd and waits on the DONE word.  These tests
drive the native halves against each other (one waiting in another thread) and
the store's side against a page whose every byte the client controls.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import _index, _native, _page
from kvtier._index import LocalWrites
from kvtierd.access import Right
from kvtierd.segments import SegmentLayout, SlotState
from kvtierd.shared_index import GRANT_TAKEN, GRANT_VALID, GRANTS_N, HAS_SUM, LAST, SessionPage
from kvtierd.store import GRANT_IDLE_SECONDS, CommitResult, Session, StoreOptions

from .conftest import StoreEnv, close_store_and_files, make_store, run
from .test_store import BLOCK, CAPACITY, TOTAL_SLOTS, keys, payload, put, session

pytestmark = pytest.mark.skipif(not hasattr(_native, "grants_take"), reason="no native build")

_W_HEAD = _page.W_HEAD
_W_DONE = _page.W_DONE
_W_GRANTS = _page.W_GRANTS
_W_RING = _page.W_RING
#: The word of a grant of slot 9 in segment 7.
W9 = GRANT_VALID | 7 << 32 | 9
_RECORD = _page.RECORD_BYTES


def _writer(page: SessionPage) -> tuple[LocalWrites, int]:
    """A client's view of ``page``'s write area, and the doorbell's daemon end."""
    bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    writes = LocalWrites(page.mapping, bell)
    return writes, bell


def _rung(bell: int) -> bool:
    try:
        return os.eventfd_read(bell) > 0
    except BlockingIOError:
        return False


# ------------------------------------------------------------------ the native protocol
def test_grants_taken_committed_and_answered_across_threads() -> None:
    page = SessionPage("ns", writes=True)
    writes, bell = _writer(page)
    page.set_grant(0, GRANT_VALID | 7 << 32 | 3)
    page.set_grant(5, W9)
    got = writes.take(2)
    assert got is not None and [(g.entry, g.segment_id, g.slot) for g in got] == [
        (0, 7, 3), (5, 7, 9)]
    assert page.grant_word(0) == GRANT_VALID | GRANT_TAKEN | 7 << 32 | 3
    # None left: the writer asks for more (the wanted word, read at its next call).
    assert writes.take(1) is None and page.wanted() == 1 and not _rung(bell)
    # The daemon cannot take back a grant a writer holds; it can once given back.
    assert not page.revoke_grant(0, GRANT_VALID | 7 << 32 | 3)
    writes.untake(got[:1])
    assert page.revoke_grant(0, GRANT_VALID | 7 << 32 | 3) and page.grant_word(0) == 0

    answered: list[bytes] = []

    def daemon() -> None:
        time.sleep(0.05)  # the writer is asleep on DONE by now (futex)
        assert _rung(bell)
        records = page.take_commits()
        assert records is not None
        assert records.records() == [(5, W9, b"key-a", 100, 77, HAS_SUM | LAST)]
        page.finish_commits(bytes([CommitResult.COMMITTED]))
        answered.append(b"ok")

    t = threading.Thread(target=daemon)
    t.start()
    results = writes.commit([(5, W9, b"key-a", 100, 77)], lambda: True, 5.0)
    t.join()
    assert answered and results == bytes([CommitResult.COMMITTED])
    # Two batches in one take: the last record of each is marked, without a checksum here.
    writes._head = _native.commits_put(page.mapping, writes._head, [(1, 11, b"x", 1, None)])
    writes._head = _native.commits_put(page.mapping, writes._head,
                                       [(2, 2**64 - 1, b"y" * 64, 2, 2**64 - 1), (3, 0, b"z", 3, 0)])
    taken = page.take_commits()
    assert taken is not None and taken.records() == [
        (1, 11, b"x", 1, 0, LAST), (2, 2**64 - 1, b"y" * 64, 2, 2**64 - 1, HAS_SUM),
        (3, 0, b"z", 3, 0, HAS_SUM | LAST)]
    # Two batches, each checked whole: no grant is held here, so both are LOST.
    assert taken.batches == [(0, 1, CommitResult.LOST), (1, 3, CommitResult.LOST)]
    page.finish_commits(b"\x01\x02\x03")
    assert _native.commit_results(page.mapping, 1, 3) == b"\x01\x02\x03"
    assert _native.done_wait(page.mapping, 4, 0.0)
    writes.close()
    os.close(bell)
    page.close()


def test_readable_spin_sees_an_answer_at_once_and_gives_up_after_its_time() -> None:
    """How a fast call's caller looks for its answer before it sleeps in recv."""
    a, b = socket.socketpair()
    try:
        t0 = time.perf_counter()
        assert not _native.readable_spin(a.fileno(), 0.02)  # nothing: the whole spin
        assert 0.02 <= time.perf_counter() - t0 < 2.0
        assert not _native.readable_spin(a.fileno(), 0.0)  # 0: one look
        threading.Timer(0.01, b.send, (b"x",)).start()
        t0 = time.perf_counter()
        assert _native.readable_spin(a.fileno(), 5.0)  # the answer ends the spin
        assert time.perf_counter() - t0 < 2.0
        assert a.recv(1) == b"x"
        b.close()
        assert _native.readable_spin(a.fileno(), 5.0)  # end of file is for recv to say
        assert a.recv(1) == b""
    finally:
        a.close()
        b.close()
    with pytest.raises(ValueError):
        _native.readable_spin(-1, 0.0)


def test_grants_taken_as_columns_decode_their_words_and_go_back_whole() -> None:
    """The writer's hot path takes grants as columns (no object per grant): entries,
    words, and where each slot is (segment, slot * slot_bytes), the offset saturated
    where a daemon's word and slot size would overflow it (the view refuses it)."""
    page = SessionPage("ns", writes=True)
    writes, bell = _writer(page)
    page.set_grant(0, GRANT_VALID | 7 << 32 | 3)
    page.set_grant(5, W9)
    page.set_grant(9, GRANT_VALID | 0x3FFF_FFFF << 32 | 0xFFFF_FFFF)
    got = writes.take_columns(2, 4096)
    assert got is not None and len(got) == 2 and got
    assert (got.entries, got.words, got.segment_ids, got.offsets) == (
        [0, 5], [GRANT_VALID | 7 << 32 | 3, W9], [7, 7], [3 * 4096, 9 * 4096])
    assert list(got) == [_index.Grant(0, GRANT_VALID | 7 << 32 | 3), _index.Grant(5, W9)]
    assert got[1].slot == 9 and page.grant_word(5) == W9 | GRANT_TAKEN
    # Fewer left than asked: none taken, the page asks for that many.
    assert writes.take_columns(2, 4096) is None and page.wanted() == 2
    assert page.grant_word(9) & GRANT_TAKEN == 0
    far = writes.take_columns(1, 2**40)
    assert far is not None and (far.segment_ids, far.offsets) == ([0x3FFF_FFFF], [2**64 - 1])
    writes.untake(got)
    writes.untake(far)
    writes.untake(_index.NO_GRANTS)
    assert [page.grant_word(e) & GRANT_TAKEN for e in (0, 5, 9)] == [0, 0, 0]
    assert writes.take_columns(0, 4096) is None and writes.take_columns(257, 4096) is None
    with pytest.raises(ValueError):
        _native.grants_take_columns(bytearray(8), 1, 4096)  # no write area
    writes.close()
    os.close(bell)
    page.close()


def test_records_put_as_columns_are_the_records_put_as_tuples() -> None:
    recs = [(1, 11, b"x", 1, None), (2, 2**64 - 1, b"y" * 64, 2, 2**64 - 1), (3, 0, b"z", 3, 0)]
    pages = [SessionPage("ns", writes=True) for _ in range(2)]
    assert _native.commits_put(pages[0].mapping, 126, recs) == 129
    assert _native.commits_put_columns(pages[1].mapping, 126, *map(list, zip(*recs, strict=True))) == 129
    ring = slice(_W_RING, _W_RING + _page.RING_RECORDS * _RECORD)
    assert pages[0].mapping[ring] == pages[1].mapping[ring]  # wrapped around the same way
    assert _native.commits_put(pages[0].mapping, 0, [r[:4] + (None,) for r in recs]) == 3
    assert _native.commits_put_columns(pages[1].mapping, 0, [1, 2, 3], [11, 2**64 - 1, 0],
                                       [b"x", b"y" * 64, b"z"], (1, 2, 3), None) == 3
    assert pages[0].mapping[ring] == pages[1].mapping[ring]  # sums None: no checksum at all
    taken = pages[1].take_commits()
    assert taken is not None and taken.records() == [
        (1, 11, b"x", 1, 0, 0), (2, 2**64 - 1, b"y" * 64, 2, 0, 0), (3, 0, b"z", 3, 0, LAST)]
    m = pages[1].mapping
    with pytest.raises(ValueError, match="entries and keys differ in length"):
        _native.commits_put_columns(m, 0, [1, 2], [0, 0], [b"k"], [1, 1], None)
    with pytest.raises(ValueError, match="entries and sums differ in length"):
        _native.commits_put_columns(m, 0, [1], [0], [b"k"], [1], [None, None])
    for key, length in ((b"", 1), (b"k" * 65, 1), (b"k", 2**32)):
        with pytest.raises(ValueError, match="a record's key"):
            _native.commits_put_columns(m, 0, [1], [0], [key], [length], None)
    for n in (0, 129):
        with pytest.raises(ValueError, match="a batch is"):
            _native.commits_put_columns(m, 0, [0] * n, [0] * n, [b"k"] * n, [1] * n, None)
    with pytest.raises(OverflowError):
        _native.commits_put_columns(m, 0, [2**32], [0], [b"k"], [1], None)
    with pytest.raises(OverflowError):
        _native.commits_put_columns(m, 0, [1], [0], [b"k"], [1], [2**64])
    with pytest.raises(TypeError):
        _native.commits_put_columns(m, 0, [1], [0], ["k"], [1], None)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        _native.commits_put_columns(m, 0, 1, [0], [b"k"], [1], None)  # type: ignore[arg-type]
    assert struct.unpack_from("<Q", m, _W_HEAD)[0] == 3  # nothing published by a refusal
    for p in pages:
        p.close()


def test_a_writer_whose_daemon_went_stops_waiting() -> None:
    page = SessionPage("ns", writes=True)
    writes, bell = _writer(page)
    alive = [True]
    threading.Timer(0.2, lambda: alive.__setitem__(0, False)).start()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        writes.commit([(0, W9, b"k", 1, None)], lambda: alive[0], 30.0)
    assert time.monotonic() - t0 < 5
    with pytest.raises(TimeoutError):
        writes.commit([(0, W9, b"k", 1, None)], lambda: True, 0.5)
    writes.close()
    os.close(bell)
    page.close()


def test_an_impossible_head_skips_the_records_and_wakes_the_writer() -> None:
    page = SessionPage("ns", writes=True)
    for head in (129, 2**64 - 1):
        struct.pack_into("<Q", page.mapping, _W_HEAD, head)
        assert page.take_commits() is None
        assert _native.done_wait(page.mapping, head, 0.0)
        taken = page.take_commits()  # from there on, nothing new
        assert taken is not None and not taken and taken.batches == []
    page.close()


def test_record_fields_out_of_range_are_bounded() -> None:
    page = SessionPage("ns", writes=True)
    with pytest.raises(ValueError):
        _native.commits_put(page.mapping, 0, [(0, 0, b"", 1, None)])
    with pytest.raises(ValueError):
        _native.commits_put(page.mapping, 0, [(0, 0, b"k" * 65, 1, None)])
    with pytest.raises(ValueError):
        _native.commits_put(page.mapping, 0, [(0, 0, b"k", 1, None)] * 129)
    with pytest.raises(ValueError):
        _native.grants_untake(page.mapping, [(256, 0)])
    assert _native.grants_take(page.mapping, 0) is None
    assert _native.grants_take(page.mapping, 257) is None
    # A key length byte past 64 reads as an empty key (the store refuses the batch).
    struct.pack_into("<IIQBB", page.mapping, _W_RING, 1, 10, 5, 200, LAST)
    struct.pack_into("<Q", page.mapping, _W_HEAD, 1)
    taken = page.take_commits()
    assert taken is not None and taken.records() == [(1, 0, b"", 10, 5, LAST)]
    assert taken.batches == [(0, 1, CommitResult.INVALID)]
    with pytest.raises(ValueError):
        _native.commits_take(bytearray(_page.PAGE_BYTES), 0, 1)  # a page without a write area
    with pytest.raises(ValueError):  # the session's grant words, one per entry
        _native.commits_take(page.mapping, 0, 1, np.zeros(3, dtype=np.uint64))
    page.close()


_Raw = tuple[int, int, bytes, int, int, int]  # grant, word, key (0..80 bytes), length, sum, flags


def _model_refusal(batch: list[_Raw], max_length: int, held: list[int] | None) -> int:
    """What the native check answers for one batch (its docstring, in Python)."""
    keys = [k if len(k) <= 64 else b"" for _g, _w, k, *_ in batch]
    grants = [g for g, *_ in batch if g < GRANTS_N]  # an entry past the table: no grant
    if (any(not k for k in keys) or any(not 0 < n <= max_length for *_, n, _s, _f in batch)
            or len(set(grants)) != len(grants) or len(set(keys)) != len(keys)):
        return CommitResult.INVALID
    if held is None or any(g >= GRANTS_N or w == 0 or held[g] != w for g, w, *_ in batch):
        return CommitResult.LOST
    return 0


_raw_record = st.tuples(
    st.sampled_from([0, 1, 2, 255, 256, 2**32 - 1]),
    st.sampled_from([0, GRANT_VALID | 7 << 32 | 1, GRANT_VALID | 7 << 32 | 2, 2**64 - 1]),
    st.binary(min_size=0, max_size=80) | st.sampled_from(
        [b"a", b"b"]),
    st.sampled_from([0, 1, 100, 2**32 - 1]),
    st.integers(0, 2**64 - 1),
    st.sampled_from([0, HAS_SUM, LAST, HAS_SUM | LAST, 0xFF]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(_raw_record, min_size=0, max_size=20),
       max_length=st.sampled_from([1, 100, 2**32 - 1]), with_held=st.booleans())
def test_commits_take_checks_each_batch_as_the_model_does(
        records: list[_Raw], max_length: int, with_held: bool) -> None:
    """Records written byte by byte, as a hostile client may: the columns and each batch's
    refusal (INVALID before LOST) are what the Python model says."""
    page = SessionPage("ns", writes=True)
    held = np.zeros(GRANTS_N, dtype=np.uint64)
    held[1] = GRANT_VALID | 7 << 32 | 1
    held[2] = GRANT_VALID | 7 << 32 | 2
    for i, (g, w, k, n, c, f) in enumerate(records):
        at = _W_RING + i * _RECORD
        struct.pack_into("<IIQBB", page.mapping, at, g, n, c, len(k), f)
        page.mapping[at + _page.R_KEY:at + _page.R_KEY + min(len(k), 64)] = k[:64]
        struct.pack_into("<Q", page.mapping, at + _page.R_WORD, w)
    struct.pack_into("<Q", page.mapping, _W_HEAD, len(records))
    taken = page.take_commits(max_length, held if with_held else None)
    assert taken is not None
    assert taken.records() == [(g, w, k if len(k) <= 64 else b"", n, c, f)
                               for g, w, k, n, c, f in records]
    want, lo = [], 0
    for i, rec in enumerate(records):
        if rec[5] & LAST or i == len(records) - 1:
            want.append((lo, i + 1, _model_refusal(
                records[lo:i + 1], max_length, held.tolist() if with_held else None)))
            lo = i + 1
    assert taken.batches == want
    refs = taken.columns[2].tolist()
    assert refs == [w & ~(GRANT_VALID | GRANT_TAKEN) for _g, w, *_ in records]
    assert taken.columns[5].tolist() == [int(bool(f & HAS_SUM)) for *_, f in records]
    page.close()


def test_grants_store_sets_words_or_nothing() -> None:
    page = SessionPage("ns", writes=True)
    page.set_grants(np.array([3, 9], dtype=np.uint64), np.array([W9, 5], dtype=np.uint64))
    assert (page.grant_word(3), page.grant_word(9)) == (W9, 5)
    with pytest.raises(ValueError):  # an entry out of range: nothing stored
        page.set_grants(np.array([4, GRANTS_N], dtype=np.uint64), np.array([1, 1], dtype=np.uint64))
    assert page.grant_word(4) == 0
    with pytest.raises(ValueError):
        page.set_grants(np.array([4], dtype=np.uint64), np.array([1, 1], dtype=np.uint64))
    page.close()


# ------------------------------------------------------------------ the store's side
GRANTS = 4


def _attach(env: StoreEnv, s: Session) -> tuple[SessionPage, LocalWrites, int]:
    page = SessionPage(s.ns.name, writes=True)
    env.store.attach_page(s, page)
    writes, bell = _writer(page)
    return page, writes, bell


def _detach(env: StoreEnv, s: Session, page: SessionPage, writes: LocalWrites,
            bell: int) -> None:
    env.store.close_session(s)
    writes.close()
    os.close(bell)
    page.close()


def _fill(env: StoreEnv, grant: _index.Grant, data: bytes) -> None:
    seg = env.segment(grant.segment_id)
    with seg.data_view(grant.slot, len(data)) as view:
        view[:] = data


def _as_taken(page: SessionPage, records: list[tuple[int, bytes, int, int | None]]
              ) -> list[tuple[int, int, bytes, int, int | None]]:
    """Records naming each entry's grant word as a writer that took it now would."""
    return [(e, page.grant_word(e) & ~GRANT_TAKEN if 0 <= e < 256 else 0, *rest)
            for e, *rest in records]


def _commit(env: StoreEnv, s: Session, page: SessionPage,
            records: list[tuple[int, bytes, int, int | None]]) -> bytes:
    """The client's half (records in the ring) then the daemon's (take, commit, answer)."""
    head = struct.unpack_from("<Q", page.mapping, _W_HEAD)[0]
    _native.commits_put(page.mapping, head, _as_taken(page, records))
    taken = page.take_commits(s.ns.block_bytes, s.grants.words)
    assert taken is not None
    results, _made = env.store.commit_granted(s, taken)
    page.finish_commits(results)
    return results


@pytest.fixture
def granting(store_factory: Callable[..., StoreEnv]) -> StoreEnv:
    return store_factory(capacity=CAPACITY, extent_size=1 << 20, grant_bytes=GRANTS * BLOCK)


def test_granted_slots_are_reserved_and_commit_without_a_call(granting: StoreEnv) -> None:
    env = granting
    s = session(env)
    put(env, s, [b"first"])  # the namespace has an extent now
    page, writes, bell = _attach(env, s)
    assert env.store.refill_grants(s, 10) == GRANTS  # at most grant_bytes of slots
    assert env.store.refill_grants(s, 10) == 0
    assert s.ns.reserved == GRANTS and env.store.idle_grants() == {s.ns.name: GRANTS}
    assert env.store.check() == []
    # Untaken grants are room held for the next writes, shown apart from reservations.
    acct = env.store.dram_bytes()
    assert (acct["granted"], acct["reserved"]) == (GRANTS * s.ns.slot_bytes, 0)
    got = writes.take(3)
    assert got is not None
    # Taken, they are reservations in progress.
    assert env.store.idle_grants() == {s.ns.name: GRANTS - 3}
    acct = env.store.dram_bytes()
    assert (acct["granted"], acct["reserved"]) == ((GRANTS - 3) * s.ns.slot_bytes,
                                                   3 * s.ns.slot_bytes)
    assert sum(acct[k] for k in ("free", "reserved", "granted", "committed")) == acct["total"]
    assert env.store.dram_free() == acct["free"]  # grants taken or not: not free
    ks = keys(3, "w")
    for g, k in zip(got, ks, strict=True):
        _fill(env, g, payload(k))
    results = _commit(env, s, page, [(g.entry, k, len(payload(k)), 1234)
                                     for g, k in zip(got, ks, strict=True)])
    assert results == bytes([CommitResult.COMMITTED]) * 3
    assert env.store.lookup(s, ks) == 3
    for g, k in zip(got, ks, strict=True):
        block = s.ns.index[k]
        assert (block.checksum, block.slot) == (1234, g.slot)
        assert block.extent.segment.read_slot(block.slot).state == SlotState.COMMITTED
        assert page.grant_word(g.entry) == 0  # consumed: the writer can never take it again
        with block.extent.segment.data_view(block.slot, block.length) as v:
            assert bytes(v) == payload(k)
    assert len(s.grants) == 1 and s.ns.reserved == 1
    assert env.store.refill_grants(s, GRANTS) == 3
    assert env.store.check() == []
    # The words the native commit check reads are grants, as many as counted: check().
    entry = next(iter(s.grants))
    s.grants.words[entry] ^= np.uint64(GRANT_VALID)
    assert any(f"no grant at entries [{entry}]" in p for p in env.store.check())
    s.grants.words[entry] ^= np.uint64(GRANT_VALID)
    assert env.store.check() == []
    free = int(s.grants.free_entries(1)[0])
    s.grants.words[free] = s.grants.words[entry]
    n = len(s.grants)
    assert any(f"{n} grants counted, {n + 1} held" in p for p in env.store.check())
    s.grants.words[free] = 0
    assert env.store.check() == []
    _detach(env, s, page, writes, bell)
    assert s.ns.reserved == 0  # the session's end frees its grants


def test_a_ring_commits_counts_refills_and_answers(granting: StoreEnv) -> None:
    """``commit_from_page``, the daemon's whole answer to a ring: the records commit,
    their count and bytes come back for the metrics, the grants used are refilled as
    the page asks, and each record's result is in the page; a session that lost its
    write right gets LOST for every record, and nothing is committed."""
    env = granting
    s = session(env)
    put(env, s, [b"first"])
    page, writes, bell = _attach(env, s)
    assert env.store.refill_grants(s, GRANTS) == GRANTS
    got = writes.take(2)
    assert got is not None
    ks = keys(2, "r")
    for g, k in zip(got, ks, strict=True):
        _fill(env, g, payload(k))
    head = struct.unpack_from("<Q", page.mapping, _W_HEAD)[0]
    _native.commits_put(page.mapping, head, _as_taken(
        page, [(g.entry, k, len(payload(k)), None) for g, k in zip(got, ks, strict=True)]))
    struct.pack_into("<Q", page.mapping, _page.W_WANT, GRANTS)
    env.store.take_granted()
    out = env.store.commit_from_page(s, page)
    assert (out.records, len(out.blocks), out.nbytes) == (2, 2, sum(len(payload(k)) for k in ks))
    assert env.store.take_granted() == {s.ns.name: 2}  # for the metrics
    assert [b.key for b in out.blocks] == ks and env.store.lookup(s, ks) == 2
    assert _native.commit_results(page.mapping, head, 2) == bytes([CommitResult.COMMITTED]) * 2
    assert len(s.grants) == GRANTS  # refilled
    # An empty ring: nothing found, nothing refilled.
    assert env.store.commit_from_page(s, page).records == 0
    # Rights are what the session holds now.
    got = writes.take(1)
    assert got is not None
    s.rights &= ~int(Right.WRITE)
    _native.commits_put(page.mapping, head + 2, _as_taken(page, [(got[0].entry, b"no", 5, None)]))
    out = env.store.commit_from_page(s, page)
    assert (out.records, list(out.blocks)) == (1, []) and env.store.take_granted() == {}
    assert _native.commit_results(page.mapping, head + 2, 1) == bytes([CommitResult.LOST])
    assert env.store.lookup(s, [b"no"]) == 0
    assert env.store.check() == []
    _detach(env, s, page, writes, bell)


def test_a_present_key_keeps_its_grant_and_a_bad_batch_commits_nothing(
        granting: StoreEnv) -> None:
    env = granting
    s = session(env)
    put(env, s, [b"present"])
    page, writes, bell = _attach(env, s)
    env.store.refill_grants(s, GRANTS)
    g = writes.take(GRANTS)
    assert g is not None
    e = [x.entry for x in g]
    # EXISTS: the grant stays the session's (given back by the writer, reused).
    assert _commit(env, s, page, [(e[0], b"present", 5, None)]) == bytes([CommitResult.EXISTS])
    assert e[0] in s.grants
    bad: list[list[tuple[int, bytes, int, int | None]]] = [
        [(e[1], b"a", 5, None), (e[1], b"b", 5, None)],  # one grant twice
        [(e[1], b"a", 5, None), (e[2], b"a", 5, None)],  # one key twice
        [(e[1], b"a", 0, None)],  # empty block
        [(e[1], b"a", BLOCK + 1, None)],  # longer than block_bytes
    ]
    for batch in bad:
        assert set(_commit(env, s, page, batch)) == {CommitResult.INVALID}
    assert set(_commit(env, s, page, [(e[1], b"a", 5, None), (200, b"b", 5, None)])) == {
        CommitResult.LOST}  # entry 200 is no grant of this session
    assert env.store.lookup(s, [b"a"]) == 0 and len(s.grants) == GRANTS
    # Batches are independent: a bad one next to a good one in the same take.
    head = struct.unpack_from("<Q", page.mapping, _W_HEAD)[0]
    head = _native.commits_put(page.mapping, head, _as_taken(page, [(e[3], b"c", BLOCK + 5, None)]))
    _native.commits_put(page.mapping, head, _as_taken(page, [(e[3], b"c", 7, None)]))
    taken = page.take_commits(s.ns.block_bytes, s.grants.words)
    assert taken is not None
    results, made = env.store.commit_granted(s, taken)
    assert results == bytes([CommitResult.INVALID, CommitResult.COMMITTED]) and len(made) == 1
    page.finish_commits(results)
    assert env.store.check() == []
    # A present key among new ones: those commit, with their checksums where given, and
    # its grant stays.
    assert e[3] not in s.grants and env.store.refill_grants(s, GRANTS) == 1
    writes.untake(g[:3])
    g = writes.take(3)
    assert g is not None
    mixed = [(g[0].entry, b"d", 9, 99), (g[1].entry, b"present", 5, None),
             (g[2].entry, b"e", 11, None)]
    assert _commit(env, s, page, mixed) == bytes(
        [CommitResult.COMMITTED, CommitResult.EXISTS, CommitResult.COMMITTED])
    assert g[1].entry in s.grants and g[0].entry not in s.grants and g[2].entry not in s.grants
    assert (s.ns.index[b"d"].length, s.ns.index[b"d"].checksum) == (9, 99)
    assert (s.ns.index[b"e"].length, s.ns.index[b"e"].checksum) == (11, None)
    assert env.store.check() == []
    _detach(env, s, page, writes, bell)


def _ring(page: SessionPage, batches: list[list[tuple[int, int, bytes, int, int | None]]]
          ) -> int:
    """Records (entry, word, key, length, checksum) written as ``batches`` in one ring, as
    a writer that names any word it likes would; returns the ring's first position."""
    first = head = struct.unpack_from("<Q", page.mapping, _W_HEAD)[0]
    for batch in batches:
        head = _native.commits_put(page.mapping, head, batch)
    return int(first)


def _answer(env: StoreEnv, s: Session, page: SessionPage) -> tuple[list[int], bytes]:
    """The daemon's take of the ring: (each batch's native refusal, each record's answer)."""
    taken = page.take_commits(s.ns.block_bytes, s.grants.words)
    assert taken is not None
    results, _made = env.store.commit_granted(s, taken)
    page.finish_commits(results)
    return [why for _lo, _hi, why in taken.batches], results


def test_keys_a_lower_tier_holds_are_exists_asked_once_per_batch(granting: StoreEnv) -> None:
    """A page commit asks the tiers below DRAM about a batch's new keys in one question
    (``Below.held_below``): those held there are EXISTS and keep their grants."""
    env = granting
    s = session(env)
    put(env, s, [b"present"])
    page, writes, bell = _attach(env, s)
    env.store.refill_grants(s, GRANTS)
    g = writes.take(4)
    assert g is not None
    asked: list[list[bytes]] = []

    def held(keys: Sequence[bytes]) -> list[bool]:
        asked.append(list(keys))
        return [k == b"below" for k in keys]

    records = [(g[0].entry, b"new", 5, None), (g[1].entry, b"below", 5, None),
               (g[2].entry, b"present", 5, None), (g[3].entry, b"other", 5, None)]
    head = struct.unpack_from("<Q", page.mapping, _W_HEAD)[0]
    _native.commits_put(page.mapping, head, _as_taken(page, records))
    taken = page.take_commits(s.ns.block_bytes, s.grants.words)
    assert taken is not None
    results, _made = env.store.commit_granted(s, taken, held)
    page.finish_commits(results)
    assert results == bytes([CommitResult.COMMITTED, CommitResult.EXISTS, CommitResult.EXISTS,
                             CommitResult.COMMITTED])
    assert asked == [[b"new", b"below", b"other"]]  # the new keys, once
    assert g[1].entry in s.grants and g[0].entry not in s.grants
    assert env.store.lookup(s, [b"below"]) == 0 and env.store.check() == []
    _detach(env, s, page, writes, bell)


MANY = 12  # grants of the test below: batches of more than 8 records too


@pytest.fixture
def granting_many(store_factory: Callable[..., StoreEnv]) -> StoreEnv:
    return store_factory(capacity=CAPACITY, extent_size=1 << 20, grant_bytes=MANY * BLOCK)


def test_a_grant_committed_earlier_in_the_ring_is_lost_not_failed(
        granting_many: StoreEnv) -> None:
    """Issue 36: a grant committed by one batch and named again by a later batch of the
    same ring was FAILED (the slot table refused a slot that is no longer reserved),
    telling the writer the daemon failed.  The native check passes both (it saw the
    grants held when the ring was taken); the store's check per batch answers LOST,
    for a batch of one record and one of more than 8 (the vectorized compare)."""
    env = granting_many
    s = session(env)
    put(env, s, [b"first"])
    page, writes, bell = _attach(env, s)
    assert env.store.refill_grants(s, MANY) == MANY
    e = sorted(s.grants)
    w = [int(s.grants.words[g]) for g in e]
    _ring(page, [[(e[0], w[0], b"a", 5, None)],
                 [(e[0], w[0], b"b", 5, None)],  # committed just before: LOST
                 [(e[1], w[1], b"c", 5, None)],  # still held: commits
                 [(g, wd, f"m{i}".encode(), 5, None)  # 10 records, one of them committed
                  for i, (g, wd) in enumerate(zip(e[1:11], w[1:11], strict=True))],
                 [(e[2], w[2], b"d", 5, None)]])  # untouched by the refused batch: commits
    refusals, results = _answer(env, s, page)
    assert refusals == [0, 0, 0, 0, 0]  # the native check could not know
    assert results == bytes([CommitResult.COMMITTED, CommitResult.LOST, CommitResult.COMMITTED,
                             *[CommitResult.LOST] * 10, CommitResult.COMMITTED])
    assert env.store.lookup(s, [b"a"]) == 1 and env.store.lookup(s, [b"c"]) == 1
    assert env.store.lookup(s, [b"b"]) == 0 and env.store.lookup(s, [b"m1"]) == 0
    assert len(s.grants) == MANY - 3 and env.store.check() == []
    # The same batch of more than 8 records whose grants are all still held commits.
    held = sorted(s.grants)
    _ring(page, [[(e[0], w[0], b"x", 5, None)],  # committed in an earlier ring: LOST
                 [(held[0], int(s.grants.words[held[0]]), b"y", 5, None)],
                 [(g, int(s.grants.words[g]), f"n{g}".encode(), 5, None) for g in held[1:]]])
    refusals, results = _answer(env, s, page)
    assert refusals == [CommitResult.LOST, 0, 0]  # an earlier ring's: the native check
    assert results == bytes([CommitResult.LOST, CommitResult.COMMITTED,
                             *[CommitResult.COMMITTED] * (len(held) - 1)])
    assert len(s.grants) == 0 and env.store.check() == []
    _detach(env, s, page, writes, bell)


def test_every_way_a_grant_stops_being_the_sessions_is_lost(granting: StoreEnv) -> None:
    """LOST however the record's grant stopped being (or never was) the session's: taken
    back idle, expired, an entry past the grant table, another session's grant, another
    namespace's slot, the session ended; each refused by the native check (``batches``)
    and answered LOST by the store, nothing committed, the store consistent."""
    env = granting
    s, other, b = session(env), session(env), session(env, "B")
    put(env, s, [b"first"])
    put(env, b, [b"b-first"])
    page, writes, bell = _attach(env, s)
    opage, owrites, obell = _attach(env, other)
    bpage, bwrites, bbell = _attach(env, b)
    assert env.store.refill_grants(s, GRANTS) == GRANTS
    assert env.store.refill_grants(other, 1) == 1 and env.store.refill_grants(b, 1) == 1
    e = sorted(s.grants)
    word = {g: int(s.grants.words[g]) for g in e}
    o_entry = next(iter(other.grants))
    o_word = int(other.grants.words[o_entry])
    b_word = int(b.grants.words[next(iter(b.grants))])

    def lost(record: tuple[int, int, bytes, int, int | None]) -> None:
        _ring(page, [[record]])
        assert _answer(env, s, page) == ([CommitResult.LOST], bytes([CommitResult.LOST]))
        assert env.store.lookup(s, [record[2]]) == 0 and env.store.check() == []

    # Taken back idle (the writer had not taken it): the entry holds nothing now.
    assert page.revoke_grant(e[0], word[e[0]])
    s.grants.end([e[0]])
    assert e[0] not in s.grants
    lost((e[0], word[e[0]], b"revoked", 5, None))
    # Past the grant table, with a word the session does hold.
    lost((GRANTS_N, word[e[1]], b"past", 5, None))
    lost((2**32 - 1, word[e[1]], b"past2", 5, None))
    # Another session's grant (same namespace), in its entry and in one of ours.
    lost((o_entry, o_word, b"foreign", 5, None))
    lost((e[1], o_word, b"foreign2", 5, None))
    # Another namespace's slot.
    lost((e[1], b_word, b"other-ns", 5, None))
    # A word of 0, and a word with no VALID bit.
    lost((e[1], 0, b"zero", 5, None))
    lost((e[1], word[e[1]] & ~GRANT_VALID, b"invalid-bit", 5, None))
    # Expired: held taken past the reservation TTL, quarantined.
    got = writes.take(1)
    assert got is not None
    env.clock.advance(env.store.reservation_ttl)
    env.store.expire()
    env.clock.advance(env.store.reservation_ttl)
    env.store.expire()
    assert got[0].entry not in s.grants
    lost((got[0].entry, got[0].word, b"expired", 5, None))
    # A grant held now commits: the refusals cost the writer nothing else.
    assert env.store.refill_grants(s, GRANTS) > 0
    held = next(iter(s.grants))
    _ring(page, [[(held, int(s.grants.words[held]), b"fine", 5, None)]])
    assert _answer(env, s, page) == ([0], bytes([CommitResult.COMMITTED]))
    # The session ended (its grants with it): LOST, whatever the record says.
    env.store.refill_grants(s, GRANTS)
    g = next(iter(s.grants))
    record = (g, int(s.grants.words[g]), b"closed", 5, None)
    _ring(page, [[record]])
    taken = page.take_commits(s.ns.block_bytes, s.grants.words)
    assert taken is not None and taken.batches == [(0, 1, 0)]
    env.store.close_session(s)
    results, made = env.store.commit_granted(s, taken)
    assert results == bytes([CommitResult.LOST]) and made == []
    writes.close()
    os.close(bell)
    page.close()
    _detach(env, other, opage, owrites, obell)
    _detach(env, b, bpage, bwrites, bbell)
    assert env.store.check() == []


def test_failed_only_when_the_daemon_fails(granting: StoreEnv,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """FAILED is the daemon's own failure (a slot table it cannot write): a batch whose
    grants are all held, refused by the table, is FAILED, nothing of it committed, and
    its grants stay the session's for the writer's retry."""
    env = granting
    s = session(env)
    put(env, s, [b"first"])
    page, writes, bell = _attach(env, s)
    assert env.store.refill_grants(s, GRANTS) == GRANTS
    g = sorted(s.grants)
    table = s.ns.table

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(type(table), "commit", broken)
    _ring(page, [[(g[0], int(s.grants.words[g[0]]), b"k", 5, None)]])
    assert _answer(env, s, page) == ([0], bytes([CommitResult.FAILED]))
    assert g[0] in s.grants and env.store.lookup(s, [b"k"]) == 0
    monkeypatch.undo()
    _ring(page, [[(g[0], int(s.grants.words[g[0]]), b"k", 5, None)]])
    assert _answer(env, s, page) == ([0], bytes([CommitResult.COMMITTED]))
    assert env.store.check() == []
    _detach(env, s, page, writes, bell)


def test_refills_evict_like_a_reserve_when_the_namespace_cannot_grow(
        granting: StoreEnv) -> None:
    env = granting
    s = session(env)
    ks = keys(30)
    put(env, s, ks)  # every slot of both extents committed: the budget is spent
    page, writes, bell = _attach(env, s)
    extents = len(s.ns.extents)
    assert env.store.refill_grants(s, 2) == 2  # the two oldest blocks evicted
    assert env.store.lookup(s, ks[:2]) == 0 and env.store.lookup(s, ks[2:3]) == 1
    assert len(s.ns.extents) == extents
    assert env.store.check() == []
    _detach(env, s, page, writes, bell)


def test_unread_blocks_are_evicted_in_the_order_their_slots_were_claimed_not_committed(
        granting: StoreEnv) -> None:
    """CLOCK's hand walks the slots, and a block's place in that walk is its slot, fixed
    when the slot is claimed (a reserve, or a refill of grants), not when the block is
    committed.  In a full pool every claim evicts at the hand, so unread blocks go in the
    order their slots were claimed.  A grant can wait in the writer's page while newer
    ones are taken before it (first fit by entry, and a refill's grants go to the first
    free entries): the block committed into it last is evicted before blocks committed
    earlier into slots claimed after it (docs/decisions.md, "CLOCK's order is the slots'
    claims, not the commits")."""
    env = granting
    s, other = session(env), session(env)
    old = keys(TOTAL_SLOTS, "old")
    put(env, s, old)  # every slot committed, the budget spent: each claim evicts
    page, writes, bell = _attach(env, s)
    assert env.store.refill_grants(s, GRANTS) == GRANTS  # slots a b c d, entries 0-3
    assert [b.key for b in env.evicted] == old[:GRANTS]  # the hand's first four

    def write(n: int, prefix: str) -> tuple[list[bytes], list[int]]:
        got = writes.take(n)
        assert got is not None
        ks = keys(n, prefix)
        for g, k in zip(got, ks, strict=True):
            _fill(env, g, payload(k))
        assert _commit(env, s, page, [(g.entry, k, len(payload(k)), None)
                                      for g, k in zip(got, ks, strict=True)]) == \
            bytes([CommitResult.COMMITTED]) * n
        return ks, [g.entry for g in got]

    first, at = write(2, "first")  # slots a b
    assert at == [0, 1]
    assert env.store.refill_grants(s, GRANTS) == 2  # slots e f, claimed after c d ...
    second, at = write(2, "second")
    assert at == [0, 1]  # ... into the entries the first put freed: taken first
    third, at = write(2, "third")  # slots c d, claimed before e f, committed last
    assert at == [2, 3]
    assert env.store.lookup(s, first + second + third) == 6
    del env.evicted[:]
    # No reads: another writer's put evicts every block, the rest of the old ones first.
    put(env, other, keys(TOTAL_SLOTS, "new"))
    evicted = [b.key for b in env.evicted]
    assert evicted[:-6] == old[GRANTS + 2:]
    assert evicted[-6:] == first + third + second, (
        "unread blocks go in the order of their slots' claims: a b, c d, e f")
    assert env.store.check() == []
    _detach(env, s, page, writes, bell)


def test_refills_never_grow_nor_evict_while_the_namespace_may_grow(
        store_factory: Callable[..., StoreEnv]) -> None:
    env = store_factory(capacity=CAPACITY, extent_size=1 << 20, grant_bytes=GRANTS * BLOCK)
    s = session(env)
    ks = keys(15)
    put(env, s, ks)  # the first extent full, a second one fits in the budget
    page, writes, bell = _attach(env, s)
    assert env.store.refill_grants(s, 2) == -1  # a Reserve call grows it first
    assert env.store.lookup(s, ks) == 15 and len(s.ns.extents) == 1
    put(env, s, [b"grows"])  # the call's growth: now there are free slots to grant
    assert env.store.refill_grants(s, 2) == 2
    assert len(s.ns.extents) == 2 and env.store.lookup(s, ks) == 15
    assert env.store.check() == []
    _detach(env, s, page, writes, bell)


def test_idle_grants_go_back_and_one_held_past_the_ttl_is_quarantined(
        granting: StoreEnv) -> None:
    env = granting
    s = session(env)
    put(env, s, [b"first"])
    page, writes, bell = _attach(env, s)
    env.store.refill_grants(s, 2)
    held = writes.take(1)
    assert held is not None
    env.clock.advance(GRANT_IDLE_SECONDS)
    env.store.expire()
    assert list(s.grants) == [held[0].entry]  # the idle one went back, the taken one not
    assert s.ns.reserved == 1  # (first seen taken at that sweep)
    env.clock.advance(env.store.reservation_ttl - 1)
    env.store.expire()
    assert list(s.grants) == [held[0].entry]
    env.clock.advance(1)
    env.store.expire()  # held for the TTL: quarantined, still RESERVED
    assert len(s.grants) == 0 and s.ns.reserved == 1
    assert page.grant_word(held[0].entry) == 0
    assert set(_commit(env, s, page, [(held[0].entry, b"late", 5, None)])) == {
        CommitResult.LOST}
    # The entry is granted again, another slot: the late writer's record still names
    # the slot it filled, so it is LOST, never committed into the new slot.
    assert env.store.refill_grants(s, 1) == 1 and held[0].entry in s.grants
    assert page.grant_word(held[0].entry) != held[0].word
    head = struct.unpack_from("<Q", page.mapping, _W_HEAD)[0]
    _native.commits_put(page.mapping, head, [(held[0].entry, held[0].word, b"late", 5, None)])
    taken = page.take_commits(s.ns.block_bytes, s.grants.words)
    assert taken is not None
    results, made = env.store.commit_granted(s, taken)
    page.finish_commits(results)
    assert results == bytes([CommitResult.LOST]) and made == []
    assert env.store.lookup(s, [b"late"]) == 0 and held[0].entry in s.grants
    env.clock.advance(env.store.reservation_ttl)
    env.store.expire()
    assert s.ns.reserved == 0  # the quarantine is over, the unused new grant went back
    assert env.store.check() == []
    _detach(env, s, page, writes, bell)


def test_a_read_only_or_closed_session_gets_no_grants(granting: StoreEnv) -> None:
    env = granting
    s = session(env)
    put(env, s, [b"first"])
    assert env.store.refill_grants(s, 2) == 0  # no page
    page = SessionPage(s.ns.name)  # a page without a write area
    env.store.attach_page(s, page)
    assert env.store.refill_grants(s, 2) == 0
    env.store.close_session(s)
    page.close()


def test_a_refill_queued_by_a_reserve_skips_a_session_that_ended_in_between(
        granting: StoreEnv, caplog: pytest.LogCaptureFixture) -> None:
    """A Reserve queues the writer's refill for the loop's next turn; a session whose
    connection closed before that turn (its page closed) gets none, and nothing fails
    on the closed page (CI saw ``ValueError: mmap closed`` from the queued refill)."""
    env = granting
    s = session(env)
    put(env, s, [b"first"])
    page, writes, bell = _attach(env, s)

    async def reserve_then_close() -> None:
        await env.store.reserve(s, [b"second"])  # queues the refill
        _detach(env, s, page, writes, bell)  # the connection goes in the same turn
        await asyncio.sleep(0)  # the queued refill runs
        await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR):
        run(env.store, reserve_then_close())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert len(s.grants) == 0


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.tuples(st.integers(_page.PAGE_BYTES // 8, _page.WPAGE_BYTES // 8 - 1),
                                st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 300),
                                          st.sampled_from(range(8)).map(lambda i: -1 - i))),
                      max_size=120),
       later=st.floats(0, 30))
def test_any_write_area_leaves_the_store_consistent(
        shm_dir: str, words: list[tuple[int, int]], later: float) -> None:
    """Arbitrary words anywhere in a session's write area (head, DONE, grants, ring
    records; some of them the session's real grant words): the store commits only
    what a valid batch of its own grants says, serves another namespace, and
    check() is clean; the session's end balances everything."""
    env = make_store(shm_dir, capacity=CAPACITY, extent_size=1 << 20,
                     grant_bytes=GRANTS * BLOCK)
    try:
        a, b = session(env, "A"), session(env, "B")
        put(env, a, keys(6, "a"))
        put(env, b, keys(6, "b"))
        page = SessionPage("A", writes=True)
        env.store.attach_page(a, page)
        env.store.refill_grants(a, GRANTS)
        real = [int(w) for w in a.grants.words[a.grants.entries()]]
        view = np.frombuffer(page.mapping, dtype=np.uint64)
        for at, value in words:
            view[at] = real[-1 - value % len(real)] if value < 0 else value
        del view
        for _ in range(2):
            taken = page.take_commits(a.ns.block_bytes, a.grants.words)
            if taken is not None:
                results, _made = env.store.commit_granted(a, taken)
                assert len(results) == len(taken)
                # Whatever the page says, the daemon did not fail: never FAILED.
                assert CommitResult.FAILED not in results, results
                page.finish_commits(results)
            env.store.refill_grants(a, page.wanted())
        assert len(a.grants) <= GRANTS
        env.clock.advance(later)
        env.store.expire()
        put(env, b, keys(10, "b2"))
        assert env.store.lookup(b, keys(10, "b2")) == 10
        assert env.store.check() == []
        env.store.close_session(a)
        env.store.close_session(b)
        assert env.store.check() == []
        assert all(ns.reserved == 0 for ns in env.store.namespaces.values())
        page.close()
    finally:
        close_store_and_files(env.store, shm_dir)


def test_another_namespace_reclaims_an_extent_whose_only_reservations_are_idle_grants(
        granting: StoreEnv) -> None:
    """Grants no writer took do not hold an extent: reclaim takes them back first (the
    page's entries go to 0); a grant a writer took does hold it, and then the other
    namespace evicts its own blocks instead."""
    env = granting
    a, b = session(env, "A"), session(env, "B")
    put(env, a, keys(3, "a"))  # A's one extent
    page, writes, bell = _attach(env, a)
    assert env.store.refill_grants(a, GRANTS) == GRANTS
    entries = sorted(a.grants)
    put(env, b, keys(15, "b"))  # B's extent: the budget is spent
    # B needs a second extent: A's (3 blocks, 4 idle grants) is reclaimed.
    put(env, b, keys(4, "b2"))
    assert len(a.grants) == 0 and all(page.grant_word(e) == 0 for e in entries)
    assert a.ns.extents == [] and a.ns.reserved == 0
    assert env.store.lookup(b, keys(15, "b")) == 15 and env.store.lookup(b, keys(4, "b2")) == 4
    assert env.store.check() == []
    # Again, with one grant taken by a writer: A's extent stays, B evicts its own.
    put(env, a, keys(3, "a3"))
    assert env.store.refill_grants(a, GRANTS) == GRANTS
    held = writes.take(1)
    assert held is not None
    a_extents = list(a.ns.extents)
    put(env, b, keys(4, "b3"))
    assert a.ns.extents == a_extents and held[0].entry in a.grants
    assert env.store.lookup(b, keys(4, "b3")) == 4
    assert env.store.check() == []
    _detach(env, a, page, writes, bell)


def test_a_grant_taken_while_its_extent_is_being_reclaimed_keeps_the_extent(
        granting: StoreEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race the compare-and-swap settles: a writer takes a grant after the reclaim
    was planned and before its grants are taken back.  The plan is dropped (none of
    the grants is taken back, the blocks are in the table again) and made again."""
    env = granting
    a, b = session(env, "A"), session(env, "B")
    put(env, a, keys(3, "a"))
    page, writes, bell = _attach(env, a)
    assert env.store.refill_grants(a, GRANTS) == GRANTS
    put(env, b, keys(15, "b"))
    revoke = env.store.room._revoke_idle_grants
    taken: list[object] = []

    def racing(exts: list[object]) -> None:
        if not taken:
            got = writes.take(1)  # the writer, between the plan and the take-back
            assert got is not None
            taken.extend(got)
        revoke(exts)  # type: ignore[arg-type]

    monkeypatch.setattr(env.store.room, "_revoke_idle_grants", racing)
    a_extents = list(a.ns.extents)
    put(env, b, keys(4, "b2"))  # B evicts its own blocks instead
    assert taken and a.ns.extents == a_extents
    assert len(a.grants) == GRANTS  # none taken back
    assert all(page.grant_word(e) != 0 for e in a.grants)
    assert env.store.lookup(a, keys(3, "a")) == 3 and env.store.lookup(b, keys(4, "b2")) == 4
    assert env.store.check() == []
    _detach(env, a, page, writes, bell)


def test_refills_come_in_batches_within_a_share_of_the_namespace_and_never_grow_it(
        store_factory: Callable[..., StoreEnv]) -> None:
    """A writer of one key at a time is granted a batch (REFILL_PUTS times what it asks, at least
    REFILL_BATCH) when its namespace is large enough (1/GRANT_SHARE of its slots), two
    puts' worth when not; the slots past what it needs come from free ones while the namespace
    could grow for them, and from eviction only when it cannot (the steady state)."""
    from kvtierd.store.grants import GRANT_SHARE, REFILL_BATCH
    extent = 8 << 20
    layout = SegmentLayout.fit(BLOCK, extent)
    assert layout is not None
    per = layout.n_slots  # 127
    env = store_factory(capacity=5 * layout.file_bytes, extent_size=extent,
                        grant_bytes=256 * BLOCK, options=StoreOptions(grow_ahead=False))
    s = session(env)
    put(env, s, [b"one"])
    assert env.store.grant_target(s.ns, 1) == per // GRANT_SHARE == 7  # one extent: a share
    # A put larger than the share: two puts' worth (the next put's grants are held while
    # the one after is refilled, after the answer), never a batch of eight.
    assert env.store.grant_target(s.ns, 20) == 2 * 20
    put(env, s, keys(4 * per - 8, "fill"))  # 4 extents, 7 slots free, room for a 5th
    assert len(s.ns.extents) == 4 and s.ns.free_slots() == 7
    target = env.store.grant_target(s.ns, 1)
    assert target == min(REFILL_BATCH, 4 * per // GRANT_SHARE) == 31
    page, writes, bell = _attach(env, s)
    # Past what it needs, only the free slots: the namespace does not grow for a batch.
    assert env.store.refill_grants(s, target, 1) == 7 and len(s.ns.extents) == 4
    got = writes.take(7)
    assert got is not None
    writes.untake(got)
    # Nothing free and room to grow: what it needs makes the namespace grow first.
    s.grants.end(list(s.grants))
    put(env, s, keys(7, "more"))
    assert s.ns.free_slots() == 0
    assert env.store.refill_grants(s, target, 1) == -1
    put(env, s, keys(per, "fifth"))  # the 5th extent, filled: the budget is spent
    assert len(s.ns.extents) == 5 and s.ns.free_slots() == 0
    target = env.store.grant_target(s.ns, 1)
    assert target == min(REFILL_BATCH, 5 * per // GRANT_SHARE) == 32
    # The steady state: a batch evicted at once, then one refill per 3/4 of it (a
    # writer of one key refills when it holds a quarter of the batch).
    struct.pack_into("<Q", page.mapping, _page.W_WANT, 1)
    assert env.store.refill_grants(s, target, 1) == target
    evictions = env.store.evictions
    head = struct.unpack_from("<Q", page.mapping, _W_HEAD)[0]
    used = target - target // 4
    for i in range(used):
        taken = writes.take(1)
        assert taken is not None
        g = taken[0]
        head = _native.commits_put(page.mapping, head, [(g.entry, g.word, b"w%d" % i, 9, None)])
        out = env.store.commit_from_page(s, page)
        assert out.committed == 1
        assert len(s.grants) == (target if i == used - 1 else target - i - 1)
    assert env.store.evictions == evictions + used  # one claim of 3/4 of the batch
    assert env.store.check() == []
    _detach(env, s, page, writes, bell)


def test_a_refill_comes_at_a_quarter_of_the_batch_or_before_two_puts_run_short() -> None:
    """``needs_refill``: at a quarter of the target for small puts; at two puts' worth for
    larger ones, but never later than half the target; never at the target itself."""
    from kvtierd.store.grants import GrantBook
    from kvtierd.store.types import Namespace, Peer

    def holding(n: int) -> GrantBook:
        g = Session(1, "", Namespace("n", 16, "m", 16), Peer(0, 0, 0), 0.0).grants
        if n:
            g.grant(SessionPage("n", writes=True), np.arange(1, n + 1, dtype=np.uint64),
                    np.ones(n, dtype=np.uint64), 1.0)
        assert len(g) == n
        return g

    for n, target, wanted, refill in [
            (65, 256, 32, False), (64, 256, 32, True),   # 32-block puts: a quarter
            (9, 32, 1, False), (8, 32, 1, True),         # 1-key puts: a quarter
            (129, 256, 100, False), (128, 256, 100, True),  # large puts: half at most
            (80, 256, 40, True), (81, 256, 40, False),   # two puts' worth
            (0, 0, 1, False), (4, 4, 4, False)]:         # holding the target already
        assert holding(n).needs_refill(target, wanted) is refill, (n, target, wanted)


def test_grants_are_columns_a_batch_adds_and_drops() -> None:
    """``GrantBook``'s columns: words and generations by page entry and a count -- a
    batch added and dropped at once, membership for Python and numpy integers, refs and
    places read back from the words, and ``problems`` for a count or a word that is off."""
    from kvtierd.store.types import Namespace, Peer

    g = Session(1, "", Namespace("n", 16, "m", 16), Peer(0, 0, 0), 0.0).grants
    assert len(g) == 0 and not g and list(g) == []
    assert g.free_entries(3).tolist() == [0, 1, 2]
    refs = np.array([5 << 32 | 7, 5 << 32 | 8, 6 << 32 | 1], dtype=np.uint64)
    page = SessionPage("n", writes=True)
    g.grant(page, refs, np.array([11, 12, 13], dtype=np.uint64), 1.0)
    words = [int(r) | GRANT_VALID for r in refs.tolist()]
    assert g.words[:4].tolist() == words + [0] and g.gens[:3].tolist() == [11, 12, 13]
    assert [page.grant_word(i) for i in range(4)] == words + [0]
    # All or nothing: more grants than free entries, or a ref with a flag bit.
    for bad_refs in (np.arange(GRANTS_N, dtype=np.uint64),
                     np.array([1, GRANT_TAKEN | 2], dtype=np.uint64)):
        with pytest.raises(ValueError):
            g.grant(page, bad_refs, np.zeros(len(bad_refs), dtype=np.uint64), 2.0)
    assert len(g) == 3 and g.used == 1.0 and g.words[3] == 0 and page.grant_word(3) == 0
    page.close()
    assert len(g) == 3 and list(g) == [0, 1, 2] and 1 in g and np.uint64(2) in g
    assert 3 not in g and -1 not in g and "1" not in g and GRANTS_N not in g
    assert g.refs().tolist() == refs.tolist() and g.refs([2]).tolist() == [6 << 32 | 1]
    assert g.places() == [(5, 7, 11), (5, 8, 12), (6, 1, 13)]
    assert g.free_entries(2).tolist() == [3, 4] and g.problems() == []
    g.drop(np.array([1], dtype=np.uint64))
    assert list(g) == [0, 2] and len(g) == 2 and g.free_entries(1).tolist() == [1]
    g.words[1] = 9  # a word that is no grant, and one more than counted
    assert g.problems() == ["2 grants counted, 3 held",
                            "grant words that are no grant at entries [1]"]
    g.words[1] = 0
    g.drop([0, 2])
    assert len(g) == 0 and g.problems() == []
