"""``Store.check`` off the loop: ``check_snapshot`` (on the loop) + ``check_from`` (a thread).

The reference is the check as it was when it ran on the loop over the live
store (``live_check`` below, kept verbatim but for the names): for every
deliberate corruption of test_store.py the snapshot check, run in a worker
thread, reports exactly its problems.  And a snapshot stays checkable while
the store keeps changing: the check reports what held when it was taken
(nothing, for a sound store), never raises, never reads a closed segment.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable

import pytest

from kvtierd.segments import SLOT_ENTRY_BYTES, TABLE_OFFSET, SlotState
from kvtierd.store import Block, Lower, Reservation, Session, Store

from .conftest import StoreEnv, run
from .test_store import (
    BLOCK,
    CAPACITY,
    CORRUPTIONS,
    EXTENT,
    _corruptible,
    keys,
    put,
    session,
)


def live_check(store: Store) -> list[str]:
    """The store's check() as it ran on the loop before the snapshot split."""
    problems: list[str] = []
    pins: collections.Counter[int] = collections.Counter()
    for lease in store._leases.values():
        for block in lease.blocks:
            pins[id(block)] += 1
    reserved_at: dict[tuple[int, int], Reservation] = {}
    for res in store._reservations.values():
        for ext, slot, _gen in res.places:
            reserved_at[(id(ext), slot)] = res
    extent_bytes = 0
    lru_expected: set[int] = set()
    for ns in store.namespaces.values():
        blocks_at: dict[tuple[int, int], Block] = {}
        for key, block in ns.index.items():
            if block.key != key or block.doomed:
                problems.append(f"{ns.name}: index entry {key.hex()} points at a wrong block")
            blocks_at[(id(block.extent), block.slot)] = block
            if block.pins == 0:
                lru_expected.add(id(block))
        for lease in store._leases.values():
            for block in lease.blocks:
                if block.doomed and block.ns is ns:
                    blocks_at[(id(block.extent), block.slot)] = block
        totals = {"free": 0, "reserved": 0, "committed": 0}
        ns_pinned = 0
        for ext in ns.extents:
            extent_bytes += ext.bytes
            free_set = set(ext.free)
            if len(free_set) != len(ext.free):
                problems.append(f"{ns.name}: extent {ext.segment.index} free list has duplicates")
            counts = {"free": 0, "reserved": 0, "committed": 0}
            pinned_slots = 0
            dirty = 0
            for slot in range(ext.n_slots):
                rec = ext.segment.read_slot(slot)
                where = f"{ns.name}: extent {ext.segment.index} slot {slot}"
                owner = blocks_at.get((id(ext), slot))
                holder = reserved_at.get((id(ext), slot))
                if rec.state == SlotState.FREE:
                    counts["free"] += 1
                    if slot not in free_set:
                        problems.append(f"{where}: FREE on segment but not on the free list")
                    if owner is not None or holder is not None:
                        problems.append(f"{where}: FREE on segment but in use in the index")
                elif rec.state == SlotState.RESERVED:
                    counts["reserved"] += 1
                    if holder is None and slot not in ext.quarantine:
                        problems.append(f"{where}: RESERVED on segment but no reservation")
                elif rec.state == SlotState.DOOMED:
                    counts["committed"] += 1
                    if owner is None or not owner.doomed:
                        problems.append(f"{where}: DOOMED on segment but not a deleted "
                                        "leased block")
                else:
                    counts["committed"] += 1
                    if owner is None or owner.doomed:
                        problems.append(f"{where}: COMMITTED on segment but not indexed")
                    elif (rec.key, rec.length, rec.generation, rec.checksum) != (
                        owner.key, owner.length, owner.generation, owner.checksum
                    ):
                        problems.append(f"{where}: slot table disagrees with the index")
                if owner is not None:
                    dirty += owner.lower == Lower.DIRTY
                    if pins[id(owner)] != owner.pins:
                        problems.append(
                            f"{where}: pins {owner.pins} != leases {pins[id(owner)]}")
                    if owner.pins:
                        pinned_slots += 1
            if counts["free"] != len(ext.free):
                problems.append(f"{ns.name}: extent {ext.segment.index} free list "
                                f"{len(ext.free)} != FREE slots {counts['free']}")
            if (counts["reserved"], counts["committed"]) != (ext.reserved, ext.committed):
                problems.append(f"{ns.name}: extent {ext.segment.index} counters "
                                f"({ext.reserved}, {ext.committed}) != slot table "
                                f"({counts['reserved']}, {counts['committed']})")
            if sum(counts.values()) != ext.n_slots:
                problems.append(f"{ns.name}: extent {ext.segment.index} does not balance")
            if dirty != ext.dirty:
                problems.append(f"{ns.name}: extent {ext.segment.index} dirty counter "
                                f"{ext.dirty} != DIRTY blocks {dirty}")
            if pinned_slots != ext.pinned:
                problems.append(f"{ns.name}: extent {ext.segment.index} pinned counter "
                                f"{ext.pinned} != leased slots {pinned_slots}")
            ns_pinned += pinned_slots
            for k in totals:
                totals[k] += counts[k]
        if ns_pinned != ns.leased:
            problems.append(f"{ns.name}: leased counter {ns.leased} != leased blocks {ns_pinned}")
        if (totals["reserved"], totals["committed"]) != (ns.reserved, ns.committed):
            problems.append(f"{ns.name}: namespace counters ({ns.reserved}, {ns.committed}) "
                            f"!= slot tables ({totals['reserved']}, {totals['committed']})")
        if set(ns.in_flight) != {k for r in store._reservations.values()
                                 if r.session.ns is ns for k in r.keys}:
            problems.append(f"{ns.name}: in-flight keys disagree with open reservations")
    if extent_bytes + store.budget_free != store.capacity:
        problems.append(f"DRAM budget does not balance: extents {extent_bytes} + free "
                        f"{store.budget_free} != capacity {store.capacity}")
    if {id(b) for b in store.lru} != lru_expected:
        problems.append("LRU does not hold exactly the unleased visible blocks")
    acct = store.dram_bytes()
    if acct["free"] + acct["reserved"] + acct["committed"] != acct["total"] or acct["free"] < 0:
        problems.append(f"DRAM accounting does not add up: {acct}")
    return problems


def off_loop(store: Store) -> list[str]:
    """What the service's Check does: snapshot here, cross-check in a worker thread."""
    snap = store.check_snapshot()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(store.check_from, snap).result()


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS.values()), ids=list(CORRUPTIONS))
def test_the_snapshot_check_reports_what_the_live_check_reported(
    store_factory: Callable[..., StoreEnv], corrupt: Callable[[StoreEnv, Session], None]
) -> None:
    env, s = _corruptible(store_factory)
    # a second namespace, a doomed leased block and a DIRTY/CLEAN mix: every branch has data
    b = session(env, "B", block_bytes=BLOCK // 2)
    put(env, b, keys(2, prefix="b"))
    env.store.set_lower(b.ns.index[keys(1, prefix="b")[0]], Lower.CLEAN)
    put(env, s, keys(2, start=4))  # k0..k3 are the corruptions'
    env.store.set_lower(s.ns.index[keys(1, start=5)[0]], Lower.CLEAN)
    env.store.acquire(s, keys(1, start=4))
    env.store.delete(s, keys(1, start=4))
    assert live_check(env.store) == [] == off_loop(env.store)
    corrupt(env, s)
    expected = live_check(env.store)
    assert expected != []
    assert off_loop(env.store) == expected
    assert env.store.check() == expected


def test_a_state_byte_that_is_no_state_is_reported_not_raised(env_clean: StoreEnv) -> None:
    env = env_clean
    s = session(env)
    put(env, s, keys(2))
    env.expect_clean = False
    ext = s.ns.extents[0]
    slot = ext.free[-1]
    ext.segment.meta[TABLE_OFFSET + slot * SLOT_ENTRY_BYTES] = 9
    problems = off_loop(env.store)
    assert f"A: extent 0 slot {slot}: state byte 9 is no slot state" in problems


@pytest.fixture
def env_clean(store_factory: Callable[..., StoreEnv]) -> StoreEnv:
    return store_factory(capacity=CAPACITY, extent_size=EXTENT)


def _busy_store(env: StoreEnv) -> tuple[Session, Session]:
    """Two namespaces (one extent each) with leases, a doomed leased block, a DIRTY/CLEAN
    mix, reservations and quarantined slots."""
    b, a = session(env, "B", block_bytes=BLOCK // 2), session(env, "A")
    put(env, b, keys(3, prefix="b"))
    put(env, a, keys(12))
    env.store.set_lower(a.ns.index[keys(1, start=5)[0]], Lower.CLEAN)
    assert len(env.store.acquire(a, keys(3)).slots) == 3
    assert env.store.delete(a, keys(1)) == 1
    env.reserve(a, keys(2, prefix="r"))
    env.clock.advance(env.store.reservation_ttl)
    assert env.store.expire()[0] == {"A": 2}  # quarantined
    env.reserve(b, keys(1, prefix="q"))
    assert env.store.check() == []
    return a, b


def _churn(env: StoreEnv, a: Session, b: Session, rounds: int) -> Session:
    """Everything that changes a store: leases end, blocks are evicted and deleted,
    sessions close, extents are reclaimed.  Returns A's new session."""
    for i in range(rounds):
        put(env, a, keys(6, prefix=f"n{i}-"))  # evicts
        got = env.store.acquire(a, keys(6, prefix=f"n{i}-"))
        env.store.delete(a, keys(2, prefix=f"n{i}-"))
        env.store.release(a, got.lease_id)
        env.clock.advance(env.store.lease_ttl)
        env.store.expire()
        env.store.close_session(a)
        put(env, b, keys(40, prefix=f"b{i}-"))  # reclaims A's extent
        env.store.delete(b, keys(40, prefix=f"b{i}-"))
        a = session(env, "A")
    return a


def test_a_snapshot_checks_clean_after_the_store_changed_under_it(env_clean: StoreEnv) -> None:
    env = env_clean
    a, b = _busy_store(env)
    snap = env.store.check_snapshot()
    extents = {id(e.segment) for ns in env.store.namespaces.values() for e in ns.extents}
    _churn(env, a, b, rounds=3)
    run(env.store, env.store.drain())  # retired segments are closed now
    gone = extents - {id(e.segment) for ns in env.store.namespaces.values() for e in ns.extents}
    assert gone, "the churn reclaimed no extent the snapshot holds"
    assert env.store.check_from(snap) == []
    assert env.store.check() == []


def test_check_from_in_a_thread_while_the_loop_changes_the_store(env_clean: StoreEnv) -> None:
    env = env_clean
    a, b = _busy_store(env)
    results: list[list[str]] = []
    stop = threading.Event()
    snaps = [env.store.check_snapshot()]
    lock = threading.Lock()

    def checker() -> None:
        while not stop.is_set():
            with lock:
                snap = snaps[-1]
            results.append(env.store.check_from(snap))

    thread = threading.Thread(target=checker)
    thread.start()
    try:
        for _ in range(4):
            a = _churn(env, a, b, rounds=1)
            with lock:
                snaps.append(env.store.check_snapshot())
    finally:
        stop.set()
        thread.join()
    assert results and all(r == [] for r in results)
