"""Every mutating Store call is all or nothing, whichever of its fallible steps fails.

The fallible steps are the block table's calls that change slots (each refuses
as a whole: ``claim``, ``release_claims``, ``commit``, ``pin``, ``unpin``,
``touch``, ``delete``, ``evict``), ``unlink`` of a retired extent and the
extent factory.  For each operation a scenario is built afresh in its
own directory for k = 1, 2, ...; the k-th fallible call raises, and the
operation must raise, ``check()`` must be clean and the store must equal its
state before the call.  k grows until the operation completes without
reaching k: the run before it made every call fail once.

"Equal" is ``test_store.snapshot`` (index, counters, free lists, generations,
LRU order, budget, evictions, sessions) with each slot table compared by what
its entries say (``read_slot``), a FREE entry by its state alone: taking back
a reserve leaves the slot FREE with the fields the reserve zeroed, which no
one reads.  Where the store documents a partial step that persists (see
``kvtierd.store``'s docstring), the scenario says so and the comparison is
narrower:

* a reserve that reclaimed another namespace's extent or grew its own before
  the failing step: the reclaim and the growth stay (cache policy and
  capacity); the reserve itself changed nothing (no reservation, no key in
  flight), and every block that left was reported as evicted.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvtierd.block_table import BlockTable
from kvtierd.recovery import recover
from kvtierd.segments import Segment, SegmentLayout, SlotState
from kvtierd.store import Block, Lower, Namespace, Store
from kvtierd.store.adoption import adopt_segment, finish_recovery

from .conftest import BOOT_EPOCH, FakeClock, StoreEnv, close_store, run, segment_factory
from .test_store import (
    BLOCK,
    CAPACITY,
    EXTENT,
    SLOTS_PER_EXTENT,
    TOTAL_SLOTS,
    keys,
    put,
    session,
    snapshot,
)

#: The block table's calls the store's operations may see refused (each changes all of
#: its slots or none), and the Segment call that may fail (``unlink``).
FALLIBLE = ("claim", "release_claims", "commit", "pin", "unpin", "touch", "delete", "evict")
SEGMENT_FALLIBLE = ("unlink",)


class Injected(Exception):
    """The failure the tests inject."""


class Faults:
    """Counts fallible calls while armed; the k-th raises (and disarms: undo steps run)."""

    def __init__(self) -> None:
        self.fail_at = 0
        self.calls = 0
        self.log: list[str] = []

    def arm(self, k: int) -> None:
        self.fail_at, self.calls, self.log = k, 0, []

    def disarm(self) -> None:
        self.fail_at = 0

    def hit(self, what: str) -> None:
        if not self.fail_at:
            return
        self.calls += 1
        self.log.append(what)
        if self.calls == self.fail_at:
            self.fail_at = 0
            raise Injected(f"injected failure of call {self.calls} ({what})")


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Faults:
    f = Faults()
    for cls, names in ((BlockTable, FALLIBLE), (Segment, SEGMENT_FALLIBLE)):
        for name in names:
            monkeypatch.setattr(cls, name, counted(f, name, getattr(cls, name)))
    return f


def counted(f: Faults, name: str, real: Any) -> Any:
    """``real`` (a method), failing as a whole before it runs when ``f`` says so."""

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        f.hit(name)
        return real(self, *args, **kwargs)

    return wrapper


def make_env(directory: str, faults: Faults, **kwargs: Any) -> StoreEnv:
    """A store like ``conftest.make_store`` whose extent factory is a fallible call too."""
    os.makedirs(directory, exist_ok=True)
    real = segment_factory(directory)

    def factory(ns: Namespace, index: int, layout: SegmentLayout, seg_id: int) -> Segment:
        faults.hit("extent factory")
        return real(ns, index, layout, seg_id)

    clock = FakeClock()
    evicted: list[Block] = []
    opts: dict[str, Any] = {"capacity": CAPACITY, "extent_size": EXTENT, "lease_ttl": 30.0,
                            "reservation_ttl": 10.0, **kwargs}
    store = Store(extent_factory=factory, boot_epoch=BOOT_EPOCH, clock=clock,
                  on_evict=evicted.append, **opts)
    return StoreEnv(store, directory, clock, evicted)


def tables(store: Store, *, last_access: bool = True) -> dict[str, list[list[Any]]]:
    """Each slot table as its entries read: FREE by its state alone."""
    out = {}
    for ns in store.namespaces.values():
        out[ns.name] = [[
            "FREE" if (rec := e.segment.read_slot(slot)).state == SlotState.FREE
            else rec if last_access else dataclasses.replace(rec, last_access=0)
            for slot in range(e.n_slots)] for e in ns.extents]
    return out


def state(env: StoreEnv, *, last_access: bool = True) -> dict[str, Any]:
    snap = snapshot(env.store)
    for ns in snap["namespaces"].values():
        del ns["tables"]
    snap["tables"] = tables(env.store, last_access=last_access)
    snap["reported_evictions"] = len(env.evicted)
    snap["closed"] = [s.closed for s in env.store.sessions.values()]
    return snap


def relaxed(env: StoreEnv) -> dict[str, Any]:
    """What must hold even after a reserve that reclaimed or grew before failing."""
    st = env.store
    return {
        "reservations": st.reservation_count,
        "leases": st.lease_count,
        "sessions": sorted(st.sessions),
        "in_flight": {n: set(ns.in_flight) for n, ns in st.namespaces.items()},
        "leased": {n: ns.leased for n, ns in st.namespaces.items()},
        "reserved": {n: ns.reserved for n, ns in st.namespaces.items()},
    }


Op = Callable[[], object]
Setup = Callable[[StoreEnv], Op]


def each_failure(directory: str, faults: Faults, setup: Setup, *,
                 persists_after: str | None = None, last_access: bool = True,
                 finish: Callable[[StoreEnv], object] | None = None,
                 **store_kwargs: Any) -> list[str]:
    """Fail the operation ``setup`` returns at each of its fallible calls in turn.

    Returns the calls of the run that completed (every one of them was made to
    fail once before).  The store must equal its state before the call; once
    a ``persists_after`` call succeeded (a step the store documents as one that
    stays), ``relaxed`` must hold and every block that left the index must have
    been reported.  ``finish`` runs before each ``check()`` (``finish_recovery``).
    """
    for k in itertools.count(1):
        env = make_env(os.path.join(directory, f"k{k}"), faults, **store_kwargs)
        try:
            op = setup(env)
            before = state(env, last_access=last_access)
            before_relaxed = relaxed(env)
            indexed = {(n, key) for n, ns in env.store.namespaces.items() for key in ns.index}
            reported = len(env.evicted)
            faults.arm(k)
            try:
                op()
            except Injected:
                faults.disarm()
                if persists_after not in faults.log[:-1]:
                    after = state(env, last_access=last_access)
                    assert after == before, f"call {k} ({faults.log[-1]}) changed the store"
                else:
                    assert relaxed(env) == before_relaxed, f"call {k} ({faults.log[-1]})"
                    gone = indexed - {(n, key) for n, ns in env.store.namespaces.items()
                                      for key in ns.index}
                    assert gone == {(b.ns.name, b.key) for b in env.evicted[reported:]}
                if finish is not None:
                    finish(env)
                problems = env.store.check()
                assert problems == [], f"call {k} ({faults.log[-1]}) failed: {problems}"
                continue
            finally:
                faults.disarm()
            assert faults.calls == k - 1
            if finish is not None:
                finish(env)
            assert env.store.check() == []
            return faults.log
        finally:
            close_store(env.store)
    raise AssertionError("unreachable")


@pytest.fixture
def failing(shm_dir: str, faults: Faults) -> Callable[..., list[str]]:
    return functools.partial(each_failure, shm_dir, faults)


def reserve(env: StoreEnv, s: Any, ks: list[bytes]) -> Op:
    return lambda: run(env.store, env.store.reserve(s, ks))


# ================================================================ sessions
def test_open_session_has_no_fallible_step(failing: Callable[..., list[str]]) -> None:
    def setup(env: StoreEnv) -> Op:
        session(env, "A")
        return lambda: session(env, "B", block_bytes=4096)

    assert failing(setup) == []


def test_open_session_that_reformats_a_recovered_namespace(
    failing: Callable[..., list[str]],
) -> None:
    """Each extent's files are removed first; a failure keeps the namespace in memory."""

    def setup(env: StoreEnv) -> Op:
        old = make_env(env.shm_dir, Faults())
        put(old, session(old), keys(TOTAL_SLOTS))
        close_store(old.store)
        report = recover(env.store, env.shm_dir)
        assert report.problems == [] and report.blocks == {"A": TOTAL_SLOTS}
        return lambda: session(env, "A", block_bytes=4096)

    assert failing(setup) == ["unlink", "unlink"]


def test_close_session_ends_reservations_and_leases_or_nothing(
    failing: Callable[..., list[str]],
) -> None:
    def setup(env: StoreEnv) -> Op:
        s, other = session(env), session(env)
        put(env, s, keys(6))
        env.reserve(s, keys(3, prefix="r"))
        env.reserve(s, keys(1, prefix="q"))
        env.store.acquire(s, keys(3))
        env.store.acquire(s, keys(2))  # k0, k1 pinned twice by s
        env.store.acquire(other, keys(1, start=2))  # k2 also by another session
        env.store.delete(other, keys(3))  # all three doomed
        return lambda: env.store.close_session(s)

    calls = failing(setup)
    # 4 reserved slots freed, k0 and k1 freed (their last pins), k2 stays doomed
    # the 4 reserved slots freed, every pin ended (k0 and k1 freed): one call
    assert calls == ["release_claims"]


# ================================================================ write path
def test_reserve_of_free_slots(failing: Callable[..., list[str]]) -> None:
    def setup(env: StoreEnv) -> Op:
        s = session(env)
        put(env, s, keys(2))
        return reserve(env, s, keys(4, prefix="n"))

    assert failing(setup) == ["claim"]


def test_reserve_that_grows_one_extent(failing: Callable[..., list[str]]) -> None:
    """A failed creation gives the budget and the extent number back; growth is capacity,
    not state: an extent made before a later step failed stays."""

    def setup(env: StoreEnv) -> Op:
        return reserve(env, session(env), keys(3))

    calls = failing(setup, persists_after="extent factory")
    assert calls == ["extent factory", "claim"]


def test_reserve_that_grows_two_extents(failing: Callable[..., list[str]]) -> None:
    def setup(env: StoreEnv) -> Op:
        return reserve(env, session(env), keys(SLOTS_PER_EXTENT + 1))

    calls = failing(setup, persists_after="extent factory")
    assert calls == ["extent factory"] * 2 + ["claim"]


def test_reserve_that_evicts_evicts_nothing_when_it_fails(
    failing: Callable[..., list[str]],
) -> None:
    def setup(env: StoreEnv) -> Op:
        s = session(env)
        put(env, s, keys(TOTAL_SLOTS - 2))
        env.reserve(s, keys(1, prefix="r"))  # one slot stays free
        lease = env.store.acquire(s, keys(1))
        assert lease.lease_id
        return reserve(env, s, keys(4, prefix="n"))

    calls = failing(setup)
    # the free slot and the three victims, in one call
    assert calls == ["claim"]


def test_reserve_that_reclaims_another_namespace_keeps_the_reclaim(
    failing: Callable[..., list[str]],
) -> None:
    def setup(env: StoreEnv) -> Op:
        a = session(env, "A")
        put(env, a, keys(TOTAL_SLOTS))
        b = session(env, "B", block_bytes=32 * 1024)
        return reserve(env, b, keys(2, prefix="b"))

    calls = failing(setup, persists_after="unlink")
    assert calls == ["unlink", "extent factory", "claim"]


def test_commit_writes_every_slot_or_none(failing: Callable[..., list[str]]) -> None:
    def setup(env: StoreEnv) -> Op:
        s = session(env)
        put(env, s, keys(2))
        res = env.reserve(s, keys(4, prefix="n"))
        return lambda: env.store.commit(s, res.reservation_id, [1, 2, 3, BLOCK],
                                        [5, 6, 7, 2**64 - 1])

    assert failing(setup) == ["commit"]


def test_settle_commits_and_frees_or_neither(failing: Callable[..., list[str]]) -> None:
    def setup(env: StoreEnv) -> Op:
        s = session(env)
        res = env.reserve(s, keys(3))
        return lambda: env.store.settle(s, res.reservation_id, [(10, 1), None, (BLOCK, 2)])

    # the commit transition (one for every commit path) frees the other slot with it
    assert failing(setup) == ["commit"]


def test_abort_frees_every_slot_or_none(failing: Callable[..., list[str]]) -> None:
    def setup(env: StoreEnv) -> Op:
        s = session(env)
        res = env.reserve(s, keys(3))
        return lambda: env.store.abort(s, res.reservation_id)

    assert failing(setup) == ["release_claims"]


def test_expire_ends_everything_due_or_nothing(failing: Callable[..., list[str]]) -> None:
    def setup(env: StoreEnv) -> Op:
        s, other = session(env), session(env)
        put(env, s, keys(4))
        env.reserve(s, keys(2, prefix="q"))
        env.clock.advance(env.store.reservation_ttl)
        assert env.store.expire()[0] == {"A": 2}  # quarantined: due in the sweep under test
        env.reserve(s, keys(1, prefix="r"))  # expires in it (and is quarantined)
        env.store.acquire(s, keys(2))  # stale in it
        env.store.acquire(other, keys(1, start=2))  # stale in it
        env.clock.advance(5)
        env.store.acquire(s, keys(1, start=3))  # not stale yet
        assert env.store.delete(s, keys(4)) == 4  # all four doomed
        env.clock.advance(env.store.lease_ttl - 5)
        return env.store.expire

    # the two quarantined slots and the two stale leases: one call (one namespace)
    assert failing(setup) == ["release_claims"]


def test_a_failed_expire_expires_again_at_the_next_sweep(faults: Faults,
                                                         shm_dir: str) -> None:
    env = make_env(shm_dir, faults)
    try:
        s = session(env)
        put(env, s, keys(2))
        env.store.acquire(s, keys(2))
        env.store.delete(s, keys(1))
        env.reserve(s, keys(1, prefix="r"))
        env.clock.advance(env.store.lease_ttl)
        faults.arm(1)
        with pytest.raises(Injected):
            env.store.expire()
        assert env.store.check() == [] and env.store.lease_count == 1
        assert env.store.expire() == ({"A": 1}, 1)
        assert env.store.check() == [] and env.store.lease_count == 0
    finally:
        close_store(env.store)


# ================================================================ read path
def test_acquire_pins_nothing_when_a_touch_fails(failing: Callable[..., list[str]]) -> None:
    """The pins, then the reads' marks (CLOCK bits, last access); a refused touch takes
    the pins back."""

    def setup(env: StoreEnv) -> Op:
        s = session(env)
        put(env, s, keys(3))
        return lambda: env.store.acquire(s, keys(3))

    assert failing(setup) == ["pin", "touch"]


def test_release_frees_doomed_blocks_or_nothing(failing: Callable[..., list[str]]) -> None:
    def setup(env: StoreEnv) -> Op:
        s = session(env)
        put(env, s, keys(4))
        lease = env.store.acquire(s, keys(3))
        env.store.delete(s, keys(2))
        return lambda: env.store.release(s, lease.lease_id)

    assert failing(setup) == ["unpin"]


def test_unpin_of_a_tiering_lease(failing: Callable[..., list[str]]) -> None:
    def setup(env: StoreEnv) -> Op:
        s = session(env)
        put(env, s, keys(3))
        lease = env.store.pin_blocks(s.ns.batch_at(s.ns.index.find(keys(3))))
        env.store.delete(s, keys(1))
        return lambda: env.store.unpin(lease)

    assert failing(setup) == ["unpin"]


def test_pin_blocks_and_set_lower_pin_or_not(
    failing: Callable[..., list[str]],
) -> None:
    def setup(env: StoreEnv) -> Op:
        s = session(env)
        put(env, s, keys(3))
        blocks = s.ns.batch_at(s.ns.index.find(keys(3)))
        first = s.ns.index[keys(1)[0]]

        def op() -> None:
            env.store.pin_blocks(blocks)
            env.store.set_lower(first, Lower.CLEAN)

        return op

    assert failing(setup) == ["pin"]


# ================================================================ delete / evict
def test_delete_dooms_and_frees_or_nothing(failing: Callable[..., list[str]]) -> None:
    def setup(env: StoreEnv) -> Op:
        s = session(env)
        put(env, s, keys(5))
        env.store.acquire(s, keys(2))
        ks = keys(5)
        return lambda: env.store.delete(s, [ks[0], ks[2], b"missing", ks[1], ks[3], ks[2]])

    assert failing(setup) == ["delete"]


def test_drop_lost_forgets_every_lost_block_or_none(failing: Callable[..., list[str]]) -> None:
    def setup(env: StoreEnv) -> Op:
        s = session(env)
        put(env, s, keys(6))
        env.store.acquire(s, keys(6)[4:5])
        ext = s.ns.extents[0]
        intact = 3 * ext.segment.layout.slot_bytes
        return lambda: env.store.drop_lost(ext.segment, intact)

    assert failing(setup) == ["delete"]


def test_evict_block(failing: Callable[..., list[str]]) -> None:
    def setup(env: StoreEnv) -> Op:
        s = session(env)
        put(env, s, keys(2))
        block = s.ns.index[keys(2)[1]]
        return lambda: env.store.evict_block(block)

    assert failing(setup) == ["evict"]


# ================================================================ recovery
def test_adopt_segment_with_keys_committed_twice(failing: Callable[..., list[str]]) -> None:
    """Two copies of k0 (the newer in extent 1 beats extent 0's) and two of k20 within
    extent 1 (the older loses): both losers are freed, or neither and nothing adopted."""

    def setup(env: StoreEnv) -> Op:
        old = make_env(env.shm_dir, Faults())
        s = session(old)
        put(old, s, keys(SLOTS_PER_EXTENT + 6))
        ext0, ext1 = s.ns.extents
        dup = s.ns.index[keys(1, start=SLOTS_PER_EXTENT + 5)[0]]
        assert dup.extent is ext1
        free = np.flatnonzero(ext1.segment.scan()["state"] == SlotState.FREE).tolist()
        for slot, key, last in ((free[0], keys(1)[0], 10**9),  # newer than extent 0's copy
                                (free[1], dup.key, 1)):  # older than its other copy
            ext1.segment.mark_committed(slot, key=key, length=5, checksum=None,
                                        last_access=last, generation=1, epoch=BOOT_EPOCH)
        old.store.close_all()
        segs = sorted((Segment.attach(e.segment.meta_path, segment_id=env.store.new_segment_id())
                       for e in (ext0, ext1)), key=lambda g: g.index)
        first, second = segs
        adopt_segment(env.store, first)

        def op() -> None:
            try:
                adopt_segment(env.store, second)
            except Injected:
                second.close(unlink=False)  # not adopted: the caller's to close
                raise

        return op

    calls = failing(setup, finish=lambda env: finish_recovery(env.store))
    assert calls == ["delete"]
