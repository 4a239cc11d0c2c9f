"""Leases without a call: hazards in the session page against the daemon's slot reuse.

The protocol (csrc/index.c): a reader publishes a hazard for each block's slot,
fences, and checks that the entries it read did not change; the daemon takes an
entry out of the table before it reuses the slot and, after a fence, never
reuses a slot a page names.  These tests drive both halves: the native calls
against each other (one of them from another process, racing), and the store's
reserve path against a client page.
"""

from __future__ import annotations

import mmap
import multiprocessing
import multiprocessing.connection
import os
import random
import struct
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import _native
from kvtier._index import LocalIndex
from kvtierd import store as store_mod
from kvtierd.shared_index import (
    HAZARD_BIT,
    HAZARDS_N,
    PAGE_BYTES,
    SUPERSEDED,
    HazardSet,
    SessionPage,
    SharedIndex,
    collect_hazards,
    hazard_of,
)
from kvtierd.store import Session

from .conftest import StoreEnv, close_store_and_files, make_store
from .test_store import CAPACITY, TOTAL_SLOTS, keys, payload, put, session

pytestmark = pytest.mark.skipif(not hasattr(_native, "index_acquire"), reason="no native build")


def _loc(i: int, checksum: int | None = None) -> tuple[int, int, int, int, int | None]:
    return (7, i, i * 8192, 100 + i, checksum)


def _pair(shared: SharedIndex) -> tuple[SessionPage, LocalIndex]:
    """A session page (the daemon's object) and a client's LocalIndex over both files."""
    page = SessionPage("ns")
    assert page.fd is not None and shared.fd is not None
    local = LocalIndex(shared.fd, page.fd, 4096)
    return page, local


def test_a_lease_reads_the_published_location_and_holds_hazards_until_released() -> None:
    shared = SharedIndex("ns", lower_tiers=False)
    ks = [os.urandom(16) for _ in range(5)]
    for i, k in enumerate(ks):
        shared.add(k, _loc(i, checksum=None if i % 2 else 1000 + i))
    page, local = _pair(shared)
    got = local.acquire([*ks[:3], b"missing-key", ks[4]])
    assert got is not None
    slots, at, _serial = got
    assert [tuple(s) for s in slots] == [
        (7, 0, 100, 1000, True), (7, 8192, 101, 0, False), (7, 16384, 102, 1002, True)]
    assert collect_hazards([page]) == {hazard_of(7, i) for i in range(3)}
    assert sorted(page.accessed()) == sorted(hazard_of(7, i) for i in range(3))
    assert page.accessed() == []  # drained
    assert page.take()[3:] == (1, 3, 2, 303)  # acquires, hit keys, missed keys, bytes
    assert page.leases() == 1
    local.release(at, len(slots))
    assert collect_hazards([page]) == set()
    # Hazards go where there is room; the bound word shrinks back when they end.
    a = local.acquire(ks[:2])
    b = local.acquire(ks[2:4])
    assert a is not None and b is not None and b[1] == a[1] + 2
    local.release(a[1], 2)
    assert collect_hazards([page]) == {hazard_of(7, 2), hazard_of(7, 3)}
    local.release(b[1], 2)
    assert struct.unpack_from("<Q", page.mapping, 64)[0] == 0
    # A final miss leases nothing; a table that was replaced answers nothing, holds nothing.
    assert local.acquire([b"nope"])[:2] == ([], at)  # type: ignore[index]
    _native.index_set_flags(shared._table.mm, SUPERSEDED)  # type: ignore[union-attr]
    assert local.acquire(ks[:2]) is None
    assert collect_hazards([page]) == set()
    local.close()
    page.close()
    shared.close()


@pytest.mark.parametrize("miss", [0, 15, 16, 17, 40])
def test_a_lease_of_many_keys_holds_exactly_the_leading_hits(miss: int) -> None:
    """Leases hash and prefetch keys ahead of their probe: a miss anywhere in a batch
    longer than that still ends it there, with hazards for exactly the hits before it."""
    shared = SharedIndex("ns", lower_tiers=False)
    ks = [os.urandom(16) for _ in range(40)]
    for i, k in enumerate(ks):
        shared.add(k, _loc(i))
    page, local = _pair(shared)
    got = local.acquire([*ks[:miss], b"missing-key", *ks[miss:]])
    assert got is not None
    slots, at, _serial = got
    assert [tuple(s)[2] for s in slots] == [100 + i for i in range(miss)]  # (lengths)
    assert collect_hazards([page]) == {hazard_of(7, i) for i in range(miss)}
    local.release(at, len(slots))
    local.close()
    page.close()
    shared.close()


def test_a_lease_held_past_the_ttl_is_ended_by_the_daemon_and_the_client_hears_it() -> None:
    shared = SharedIndex("ns", lower_tiers=False)
    ks = [os.urandom(16) for _ in range(3)]
    for i, k in enumerate(ks):
        shared.add(k, _loc(i))
    page = SessionPage("ns", max_leases=2)
    assert page.fd is not None and shared.fd is not None
    local = LocalIndex(shared.fd, page.fd, 4096)
    a = local.acquire(ks[:2])
    assert a is not None and page.expire(100.0, 5.0) == 0  # first seen at 100
    b = local.acquire(ks[2:])
    assert b is not None and page.expire(104.0, 5.0) == 0
    assert local.acquire(ks[:1]) is None  # the session's lease limit: ask the daemon
    assert page.leases() == 2
    assert page.expire(105.0, 5.0) == 1  # a's lease (two hazards) ended, b's not yet
    assert collect_hazards([page]) == {hazard_of(7, 2)}
    assert local.release(a[1], 2) is False  # the client learns it had expired
    assert local.release(b[1], 1) is True
    # Leased again at the same entries: a new lease (a new serial), not the old one.
    c = local.acquire(ks[:2])
    assert c is not None and c[1] == a[1] and c[2] != a[2]
    assert page.expire(106.0, 5.0) == 0
    assert local.release(c[1], 2) is True
    local.close()
    page.close()
    shared.close()


def test_a_miss_that_is_not_final_goes_to_the_daemon_with_nothing_held() -> None:
    shared = SharedIndex("ns", lower_tiers=True)
    k = os.urandom(16)
    shared.add(k, _loc(1))
    page, local = _pair(shared)
    assert local.acquire([k, b"maybe-on-ssd"]) is None
    assert local.acquire([k]) is not None  # all hits: the lower tier does not matter
    local.close()
    page.close()
    shared.close()


_RACE_KEYS = 512


def _daemon_side(table: mmap.mmap, page: mmap.mmap, data: mmap.mmap, ks: list[bytes],
                 rounds: int, conn: multiprocessing.connection.Connection) -> None:
    """The writer's loop (the daemon's mappings, inherited): take a key out, look for
    hazards, then either put it back (a reader holds its slot) or reuse the slot: new
    bytes there, published anew (the entry's length says which bytes)."""
    rng = random.Random(1)
    reused = kept = 0
    gen = 1
    for _ in range(rounds):
        i = rng.randrange(len(ks))
        _native.index_remove(table, ks[i])
        if hazard_of(1, i) in _native.hazards_collect([page]):
            kept += 1
            length = struct.unpack_from("<Q", data, 8 * i)[0]
        else:
            gen += 1
            length = gen
            struct.pack_into("<Q", data, 8 * i, gen)  # the slot's new content
            reused += 1
        _native.index_set(table, ks[i], 1, 0, (1, i, 8 * i, length, None))
    conn.send((reused, kept))


def test_racing_reader_never_sees_a_slot_reused_under_its_hazard() -> None:
    """A process reuses slots as fast as it can; this one leases all of them at once
    (a long window between its first read of the table and its check) and checks that
    each slot holds the bytes the entry it leased described."""
    shared = SharedIndex("ns", lower_tiers=False)
    ks = [os.urandom(16) for _ in range(_RACE_KEYS)]
    data = mmap.mmap(-1, 8 * _RACE_KEYS)  # MAP_SHARED anonymous: the child writes the same
    for i, k in enumerate(ks):
        struct.pack_into("<Q", data, 8 * i, 1)
        shared.add(k, (1, i, 8 * i, 1, None))
    page, local = _pair(shared)
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    assert shared._table is not None
    child = ctx.Process(target=_daemon_side,
                        args=(shared._table.mm, page.mapping, data, ks, 100_000, send))
    child.start()
    leased = wrong = 0
    try:
        while not recv.poll():
            assert child.is_alive() or recv.poll(), "the writer died"
            got = local.acquire(ks)
            if got is None:
                continue
            slots, at, _ = got
            for _ in range(3):  # read while holding them: the contents must not move
                for slot in slots:
                    if struct.unpack_from("<Q", data, slot.offset)[0] != slot.length:
                        wrong += 1
            local.release(at, len(slots))
            leased += len(slots)
        reused, kept = recv.recv()
    finally:
        child.join(30)
        local.close()
        page.close()
        shared.close()
    assert wrong == 0
    assert leased > 1000 and reused > 1000 and kept > 0, (leased, reused, kept)


# ------------------------------------------------------------------ the store's side
def _attach(env: StoreEnv, s: Session) -> tuple[SessionPage, LocalIndex]:
    shared = s.ns.index.shared
    assert shared is not None and shared.fd is not None
    page = SessionPage(s.ns.name)
    assert page.fd is not None
    env.store.attach_page(s, page)
    return page, LocalIndex(shared.fd, page.fd, 4096)


def _detach(env: StoreEnv, s: Session, page: SessionPage, local: LocalIndex) -> None:
    """End ``s`` and close what ``_attach`` opened for it."""
    env.store.close_session(s)
    local.close()
    page.close()


def _read(env: StoreEnv, slot: object) -> bytes:
    seg = env.segment(slot.segment_id)  # type: ignore[attr-defined]
    n = seg.layout.slot_bytes
    with seg.data_view(slot.offset // n, slot.length) as v:  # type: ignore[attr-defined]
        return bytes(v)


@pytest.fixture
def full(store_factory: Callable[..., StoreEnv]) -> tuple[StoreEnv, Session, list[bytes]]:
    """Every one of the 30 slots committed, oldest first."""
    env = store_factory(capacity=CAPACITY, extent_size=1 << 20)
    s = session(env)
    ks = keys(TOTAL_SLOTS)
    for k in ks:
        put(env, s, [k])
    return env, s, ks


def test_a_block_leased_without_a_call_is_not_evicted(
        full: tuple[StoreEnv, Session, list[bytes]]) -> None:
    env, s, ks = full
    page, local = _attach(env, s)
    got = local.acquire([ks[0]])  # the least recently used block
    assert got is not None
    (slot,), at, _ = got
    put(env, s, keys(3, "new"))  # evicts three, never the leased one
    assert env.store.lookup(s, [ks[0]]) == 1
    assert _read(env, slot) == payload(ks[0])
    assert env.store.lookup(s, ks[1:4]) == 0
    local.release(at, 1)
    _detach(env, s, page, local)


def test_reads_without_a_call_move_blocks_to_the_young_end(
        full: tuple[StoreEnv, Session, list[bytes]]) -> None:
    env, s, ks = full
    page, local = _attach(env, s)
    got = local.acquire(ks[:2])
    assert got is not None
    local.release(got[1], 2)
    put(env, s, keys(2, "new"))  # evicts the oldest: the two read ones are young now
    assert env.store.lookup(s, ks[:2]) == 2
    assert env.store.lookup(s, ks[2:3]) == 0 and env.store.lookup(s, ks[3:4]) == 0
    _detach(env, s, page, local)


def test_a_deleted_block_keeps_its_slot_while_leased_and_a_session_end_frees_it(
        full: tuple[StoreEnv, Session, list[bytes]]) -> None:
    env, s, ks = full
    reader = session(env)
    page, local = _attach(env, reader)
    got = local.acquire([ks[5]])
    assert got is not None
    (slot,), _at, _ = got
    assert env.store.delete(s, [ks[5]]) == 1
    # The free slot is the leased one: a reserve evicts rather than reuse it.
    put(env, s, [b"after-delete"])
    assert _read(env, slot) == payload(ks[5])
    assert env.store.lookup(s, ks[:1]) == 0  # the oldest went instead
    # The reader's session ends (its process died): the slot is reused at once.
    env.store.close_session(reader)
    put(env, s, [b"after-close"])
    assert _read(env, slot) != payload(ks[5])
    _detach(env, s, page, local)


def test_a_free_slot_under_a_hazard_makes_the_namespace_grow_not_evict(
        store_factory: Callable[..., StoreEnv]) -> None:
    """The budget has room: a reserve that finds only a free slot a client still
    reads must add an extent, not evict (it once ran out of growth rounds, because
    growth counted that slot as free, and evicted a live block instead)."""
    env = store_factory(capacity=CAPACITY * 4, extent_size=1 << 20)
    s = session(env)
    put(env, s, [b"first"])
    n = s.ns.extents[0].n_slots
    ks = [b"first"] + keys(n - 1)
    put(env, s, ks[1:])
    assert len(s.ns.extents) == 1 and s.ns.free_slots() == 0
    reader = session(env)
    page, local = _attach(env, reader)
    got = local.acquire([ks[5]])
    assert got is not None
    assert env.store.delete(s, [ks[5]]) == 1  # its slot is free now, and still read
    put(env, s, [b"after-delete"])
    assert env.store.evictions == 0 and len(s.ns.extents) == 2
    assert env.store.lookup(s, ks[:5]) == 5 and env.store.lookup(s, ks[6:]) == n - 6
    local.release(got[1], 1)
    env.store.close_session(reader)
    _detach(env, s, page, local)


def test_a_victim_leased_while_the_plan_was_made_is_kept(
        full: tuple[StoreEnv, Session, list[bytes]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client publishes its hazard after the store first read the pages but before
    the victims left the table: the second read sees it, the plan is made again."""
    env, s, ks = full
    page, local = _attach(env, s)
    real = env.store.state.hazards
    calls = []

    def late(ns: store_mod.Namespace) -> set[int]:
        calls.append(1)
        if len(calls) == 1:
            got = local.acquire([ks[0]])  # "meanwhile", before the victims are hidden
            assert got is not None
            page.accessed()  # (not a read the LRU hears of: it stays the oldest)
            return set()
        return real(ns)

    monkeypatch.setattr(env.store.state, "hazards", late)
    put(env, s, [b"new"])
    assert len(calls) >= 3  # first plan raced, the second one saw the hazard
    assert env.store.lookup(s, [ks[0]]) == 1 and env.store.lookup(s, [ks[1]]) == 0
    _detach(env, s, page, local)


def test_a_block_leased_while_its_extent_was_planned_for_reclaim_keeps_the_extent(
        shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader of A leases a block after the reclaim plan first read A's pages but
    before A's extent left the table: the read after the hide sees it, every block of
    the extent goes back in the index (``Keys.unhide_refs``), and B plans again (it
    evicts its own blocks: A's extent is leased now)."""
    env = make_store(shm_dir, capacity=CAPACITY, extent_size=1 << 20)
    try:
        a, b = session(env, "A"), session(env, "B")
        ka = keys(12, "a")
        put(env, a, ka)
        (ext,) = a.ns.extents
        put(env, b, keys(12, "b"))  # B's extent: the budget is spent
        page, local = _attach(env, a)
        real = env.store.state.hazards
        calls: list[int] = []
        got: list[object] = []

        def late(ns: store_mod.Namespace) -> HazardSet:
            if ns is a.ns:
                calls.append(1)
                if len(calls) == 1:  # the plan's read: the client leases "meanwhile"
                    lease = local.acquire([ka[0]])
                    assert lease is not None
                    got.append(lease)
                    page.accessed()
                    return HazardSet([])  # (what the plan saw: nothing yet)
            return real(ns)

        monkeypatch.setattr(env.store.state, "hazards", late)
        put(env, b, keys(12, "b2"))
        assert got and len(calls) >= 2  # the plan raced, the read after the hide saw it
        assert a.ns.extents == [ext] and env.store.lookup(a, ka) == 12
        assert env.store.lookup(b, keys(12, "b2")) == 12
        monkeypatch.undo()
        assert env.store.check() == []
        env.store.close_session(a)
        env.store.close_session(b)
        local.close()
        page.close()
    finally:
        close_store_and_files(env.store, shm_dir)


def test_a_hostile_page_costs_only_its_own_namespace(
        store_factory: Callable[..., StoreEnv]) -> None:
    env = store_factory(capacity=CAPACITY, extent_size=1 << 20)
    a, b = session(env, "A"), session(env, "B")
    put(env, a, keys(10, "a"))
    put(env, b, keys(10, "b"))
    page, local = _attach(env, a)
    rng = random.Random(5)
    hz = np.frombuffer(page.mapping, dtype=np.uint64, count=1536, offset=4096)
    for i in range(1536):  # anything (hazards, serials): B's segments too, no bit...
        hz[i] = rng.choice([rng.getrandbits(64), HAZARD_BIT | rng.getrandbits(40), 0])
    struct.pack_into("<QQ", page.mapping, 64, 2**64 - 1, 2**63)  # bound word, ring head
    ring = np.frombuffer(page.mapping, dtype=np.uint64, count=384, offset=1024)
    ring[:] = hz[:384]
    env.store.note_reads(a.ns)  # garbage in the ring: ignored
    put(env, b, keys(10, "b2"))  # B does not read A's page
    assert env.store.lookup(b, keys(10, "b2")) == 10
    put(env, a, keys(3, "a2"))  # A may lose some slots to its own garbage, no more
    assert not env.store.check()
    env.store.close_session(a)
    env.store.close_session(b)
    local.close()
    del hz, ring
    page.close()


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.tuples(st.integers(0, PAGE_BYTES // 8 - 1),
                                st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 40),
                                          st.sampled_from(range(20)).map(lambda i: -1 - i))),
                      max_size=80),
       later=st.floats(0, 100))
def test_any_page_content_leaves_the_store_consistent(
        shm_dir: str, words: list[tuple[int, int]], later: float) -> None:
    """Arbitrary words anywhere in a session's page (counters, bound word, ring, hazards,
    serials; some of them real hazards of the namespace's blocks): the store serves
    both namespaces, every count it takes is sane, and check() is clean."""
    env = make_store(shm_dir, capacity=CAPACITY, extent_size=1 << 20)
    try:
        a, b = session(env, "A"), session(env, "B")
        put(env, a, keys(12, "a"))
        put(env, b, keys(12, "b"))
        real = [env.store.slot_of(blk) for blk in a.ns.index.values()]
        page = SessionPage("A", max_leases=4)
        env.store.attach_page(a, page)
        view = np.frombuffer(page.mapping, dtype=np.uint64)
        for at, value in words:
            view[at] = real[-1 - value % len(real)] if value < 0 else value
        del view
        env.store.note_reads(a.ns)
        assert all(0 <= n <= SessionPage.MAX_STEP for n in page.take())
        assert 0 <= env.store.lease_count and 0 <= env.store.hazard_count() <= HAZARDS_N
        env.clock.advance(later)
        env.store.expire()
        put(env, a, keys(20, "a2"))  # evicts around whatever the page holds
        # One extent's worth: an extent of A's a hazard leases is not reclaimed for B
        # (a leased block is never evicted), so B may count on the other one only.
        put(env, b, keys(12, "b2"))
        assert env.store.lookup(b, keys(12, "b2")) == 12
        assert env.store.check() == []
        env.store.close_session(a)
        env.store.close_session(b)
        page.close()
    finally:
        close_store_and_files(env.store, shm_dir)


def test_a_hazard_pins_its_extent_against_reclaim_only_where_it_names_a_real_slot(
        shm_dir: str) -> None:
    """Another namespace's reclaim skips an extent a client leases a block of without a
    call (a leased block is never evicted); hazards naming slots the extent does not
    have (a page's garbage) pin nothing, or a tenant could hold its DRAM forever."""
    env = make_store(shm_dir, capacity=CAPACITY, extent_size=1 << 20)
    try:
        a, b = session(env, "A"), session(env, "B")
        put(env, a, keys(12, "a"))
        (ext,) = a.ns.extents
        sid = ext.segment.segment_id
        page = SessionPage("A")
        env.store.attach_page(a, page)
        view = np.frombuffer(page.mapping, dtype=np.uint64)
        view[8] = 4  # the bound word: entries [0, 4)
        view[512:516] = [hazard_of(sid, ext.n_slots + i) for i in range(3)] + [hazard_of(999, 1)]
        put(env, b, keys(12, "b"))  # B's extent: the budget is spent
        put(env, b, keys(12, "b2"))  # reclaims A's extent: the hazards name no slot of it
        assert a.ns.extents == [] and env.store.lookup(b, keys(12, "b2")) == 12
        assert env.store.check() == []
        # A real lease pins: A again, leased by a hazard on a committed slot.
        put(env, a, keys(3, "a3"))
        (ext,) = a.ns.extents
        blk = a.ns.index[keys(3, "a3")[0]]
        view[512] = env.store.slot_of(blk)
        put(env, b, keys(12, "b3"))  # B evicts its own blocks instead
        assert a.ns.extents == [ext] and a.ns.index.get(blk.key) == blk
        assert env.store.check() == []
        del view
        env.store.close_session(a)
        env.store.close_session(b)
        page.close()
    finally:
        close_store_and_files(env.store, shm_dir)
