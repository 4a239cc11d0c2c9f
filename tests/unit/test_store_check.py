"""``Store.check`` off the loop: ``check_snapshot`` (on the loop) + ``check_from`` (a thread).

For every deliberate corruption of test_store.py the snapshot check, run in a
worker thread, reports exactly what ``check()`` reports on the loop.  And a snapshot stays checkable while
the store keeps changing: the check reports what held when it was taken
(nothing, for a sound store), never raises, never reads a closed segment.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

import numpy as np
import pytest

from kvtierd.segments import SLOT_ENTRY_BYTES, TABLE_OFFSET, SlotState
from kvtierd.store import Lower, Session, Store

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
    assert env.store.check() == [] == off_loop(env.store)
    corrupt(env, s)
    expected = env.store.check()
    assert expected != []
    assert off_loop(env.store) == expected


def test_a_state_byte_that_is_no_state_is_reported_not_raised(env_clean: StoreEnv) -> None:
    env = env_clean
    s = session(env)
    put(env, s, keys(2))
    env.expect_clean = False
    ext = s.ns.extents[0]
    slot = int(np.flatnonzero(ext.segment.scan()["state"] == SlotState.FREE)[0])
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
