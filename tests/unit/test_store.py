"""Tests for kvtierd.store over real segments in /dev/shm: lifecycle, pins, LRU, capacity.

Every store made by the ``store_factory`` fixture must pass ``check()`` when
the test ends (tests that corrupt a store on purpose opt out).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from kvtier import _native
from kvtier.errors import (
    CapacityExhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unauthenticated,
)
from kvtierd.segments import KEY_OFFSET, SLOT_ENTRY_BYTES, TABLE_OFFSET, SegmentLayout, SlotState
from kvtierd.shared_index import TIER_DRAM
from kvtierd.store import Extent, Lower, Namespace, ReserveStatus, Session, Store, StoreOptions
from kvtierd.store.keys import locate

from .conftest import BOOT_EPOCH, PEER, StoreEnv, run, segment_factory

KiB = 1 << 10
MiB = 1 << 20
BLOCK = 64 * KiB
EXTENT = 1 * MiB
_LAYOUT = SegmentLayout.fit(BLOCK, EXTENT)
assert _LAYOUT is not None
SLOTS_PER_EXTENT = _LAYOUT.n_slots  # 15
EXTENT_FILE = _LAYOUT.file_bytes
#: Two full extents and nothing left over: 30 slots of 64 KiB for one namespace.
CAPACITY = 2 * EXTENT_FILE
TOTAL_SLOTS = 2 * SLOTS_PER_EXTENT

RESERVED, EXISTS, IN_FLIGHT = ReserveStatus.RESERVED, ReserveStatus.EXISTS, ReserveStatus.IN_FLIGHT


# ================================================================ helpers
def keys(n: int, prefix: str = "k", start: int = 0) -> list[bytes]:
    return [f"{prefix}{i:04d}".encode() for i in range(start, start + n)]


def payload(key: bytes, block_bytes: int = BLOCK, tag: bytes = b"") -> bytes:
    """A recognisable, key-specific pattern of a key-specific length in 1..block_bytes."""
    length = 1 + (int.from_bytes(key, "little") * 7919) % block_bytes
    unit = key + b"|" + tag + b"#"
    return (unit * (length // len(unit) + 1))[:length]


@pytest.fixture
def env(store_factory: Callable[..., StoreEnv]) -> StoreEnv:
    """30 slots of 64 KiB in two 1 MiB extents (no budget left over)."""
    return store_factory(capacity=CAPACITY, extent_size=EXTENT)


def session(env: StoreEnv, name: str = "A", block_bytes: int = BLOCK,
            model_uid: str = "m1") -> Session:
    return env.store.open_session(name, block_bytes, model_uid, PEER)


def put(env: StoreEnv, s: Session, ks: Sequence[bytes], tag: bytes = b"",
        checksums: bool = False) -> int:
    """Reserve, fill and commit the keys not present yet; the reservation id (0: none)."""
    res = env.reserve(s, ks)
    new = [k for k, st in zip(ks, res.statuses, strict=True) if st == RESERVED]
    assert len(new) == len(res.slots)
    lengths = []
    for k, grant in zip(new, res.slots, strict=True):
        assert grant.length == s.ns.block_bytes and grant.checksum is None
        data = payload(k, s.ns.block_bytes, tag)
        env.write(grant, data)
        lengths.append(len(data))
    if res.reservation_id:
        sums = [int.from_bytes(k[-4:], "little") for k in new] if checksums else None
        assert env.store.commit(s, res.reservation_id, lengths, sums) == len(new)
    return res.reservation_id


def present(env: StoreEnv, s: Session, ks: Sequence[bytes]) -> list[bytes]:
    return [k for k in ks if env.store.lookup(s, [k]) == 1]


def read_leased(env: StoreEnv, s: Session, lease_keys: Sequence[bytes], grants: Sequence[Any],
                tag: bytes = b"") -> None:
    """Assert every leased grant still holds exactly its key's pattern."""
    for k, g in zip(lease_keys, grants, strict=True):
        expected = payload(k, s.ns.block_bytes, tag)
        assert g.length == len(expected)
        assert env.read(g) == expected, f"leased block {k!r} was overwritten"


def slot_of(env: StoreEnv, s: Session, key: bytes) -> tuple[Extent, int]:
    block = s.ns.index[key]
    return block.extent, block.slot


def snapshot(store: Store) -> dict[str, Any]:
    """Everything a failed call must leave as it was (free-list order aside)."""
    nss = {}
    for ns in store.namespaces.values():
        nss[ns.name] = {
            "index": {k: (id(b.extent), b.slot, b.length, b.generation, b.pins)
                      for k, b in ns.index.items()},
            "in_flight": set(ns.in_flight),
            "counts": (ns.reserved, ns.committed, ns.leased, ns.sessions, ns.segments_version),
            "extents": [(id(e), e.counts(), ns.table.inspect(
                (np.uint64(e.id) << np.uint64(32)) | np.arange(e.n_slots, dtype=np.uint64)
            ).tobytes()) for e in ns.extents],
            "tables": [bytes(e.segment.meta[TABLE_OFFSET : TABLE_OFFSET
                                          + e.n_slots * SLOT_ENTRY_BYTES]) for e in ns.extents],
        }
    return {
        "check": store.check(),
        "namespaces": nss,
        "budget_free": store.budget_free,
        "dram": store.dram_bytes(),
        "evictions": store.evictions,
        "reservations": store.reservation_count,
        "leases": store.lease_count,
        "sessions": sorted(store.sessions),
    }


# ================================================================ sessions and namespaces
def test_sessions_of_one_namespace_share_it(env: StoreEnv) -> None:
    a1, a2 = session(env), session(env)
    assert a1.ns is a2.ns and a1.ns.sessions == 2
    assert a1.id != a2.id and a1.token != a2.token
    assert env.store.session_for(a1.token) is a1
    assert env.store.namespaces["A"].slot_bytes == BLOCK


def test_a_namespace_holding_nothing_is_forgotten_with_its_last_session(
        store_factory: Callable[..., StoreEnv]) -> None:
    forgotten: list[str] = []
    env = store_factory(capacity=CAPACITY, extent_size=EXTENT,
                        options=StoreOptions(on_forget=forgotten.append))
    a1, a2 = session(env), session(env)
    env.store.close_session(a1)
    assert "A" in env.store.namespaces  # a2 still uses it
    env.store.close_session(a2)
    assert "A" not in env.store.namespaces and forgotten == ["A"]
    b = session(env, block_bytes=4096)  # declared afresh: any layout
    assert b.ns.block_bytes == 4096
    put(env, b, keys(1))
    env.store.close_session(b)
    assert "A" in env.store.namespaces  # it holds a block: kept for the next session
    assert forgotten == ["A"] and env.store.check() == []


def test_redeclaring_a_namespace_with_another_block_size_is_failed_precondition(
    env: StoreEnv,
) -> None:
    session(env)
    before = snapshot(env.store)
    with pytest.raises(FailedPrecondition) as ei:
        session(env, block_bytes=4096)
    assert str(ei.value) == ("namespace 'A' is declared with block_bytes=65536 model_uid='m1'; "
                             "refusing block_bytes=4096 model_uid='m1'")
    assert snapshot(env.store) == before


def test_redeclaring_a_namespace_with_another_model_uid_is_failed_precondition(
    env: StoreEnv,
) -> None:
    session(env)
    before = snapshot(env.store)
    with pytest.raises(FailedPrecondition) as ei:
        session(env, model_uid="m2")
    assert str(ei.value) == ("namespace 'A' is declared with block_bytes=65536 model_uid='m1'; "
                             "refusing block_bytes=65536 model_uid='m2'")
    assert snapshot(env.store) == before


@pytest.mark.parametrize("block_bytes", [CAPACITY, CAPACITY + 1, 2**40])
def test_block_bytes_bigger_than_capacity_is_invalid_argument(
    env: StoreEnv, block_bytes: int
) -> None:
    with pytest.raises(InvalidArgument) as ei:
        session(env, block_bytes=block_bytes)
    assert str(ei.value) == f"block_bytes {block_bytes} does not fit in dram.capacity {CAPACITY}"
    assert env.store.namespaces == {} and env.store.sessions == {}


def test_largest_block_that_fits_the_capacity_is_accepted(env: StoreEnv) -> None:
    biggest = CAPACITY - 2 * 4096
    s = session(env, block_bytes=biggest)
    put(env, s, keys(1))
    assert env.store.lookup(s, keys(1)) == 1


def test_unknown_token_is_unauthenticated(env: StoreEnv) -> None:
    with pytest.raises(Unauthenticated, match="unknown session token"):
        env.store.session_for("0" * 32)


def test_namespaces_are_isolated_even_for_equal_keys(env: StoreEnv) -> None:
    a = session(env, "A")
    b = session(env, "B", block_bytes=32 * KiB)
    put(env, a, keys(2))
    assert env.store.lookup(b, keys(2)) == 0
    assert env.store.acquire(b, keys(2)).slots == []
    res = env.reserve(b, keys(2))
    assert res.statuses == [RESERVED, RESERVED]
    env.store.abort(b, res.reservation_id)
    assert env.store.delete(b, keys(2)) == 0
    assert env.store.lookup(a, keys(2)) == 2


# ================================================================ invariant 1: visibility
def test_acquire_never_returns_uncommitted_slot(env: StoreEnv) -> None:
    writer, reader = session(env), session(env)
    ks = keys(3)
    res = env.reserve(writer, ks)
    assert res.reservation_id != 0 and res.statuses == [RESERVED] * 3
    for k, g in zip(ks, res.slots, strict=True):
        env.write(g, payload(k))
    for s in (writer, reader):
        assert env.store.lookup(s, ks) == 0
        got = env.store.acquire(s, ks)
        assert got.lease_id == 0 and got.slots == []
    assert env.store.lease_count == 0
    env.store.commit(writer, res.reservation_id, [len(payload(k)) for k in ks], None)
    assert env.store.lookup(reader, ks) == 3
    got = env.store.acquire(reader, ks)
    read_leased(env, reader, ks, got.slots)
    env.store.release(reader, got.lease_id)


def test_aborted_keys_are_never_visible_and_their_slots_return(env: StoreEnv) -> None:
    s = session(env)
    res = env.reserve(s, keys(4))
    ns = s.ns
    free_before = ns.free_slots()
    assert env.store.abort(s, res.reservation_id) == 4
    assert ns.free_slots() == free_before + 4
    assert env.store.lookup(s, keys(4)) == 0
    assert env.store.acquire(s, keys(4)).slots == []
    assert set(ns.in_flight) == set() and ns.reserved == 0
    for g in res.slots:
        seg = env.segment(g.segment_id)
        assert seg.read_slot(g.offset // seg.layout.slot_bytes).state == SlotState.FREE
    # the keys can be reserved again
    assert env.reserve(s, keys(4)).statuses == [RESERVED] * 4


def test_expired_reservation_is_never_visible_and_cannot_be_committed(env: StoreEnv) -> None:
    s = session(env)
    res = env.reserve(s, keys(2))
    env.clock.advance(env.store.reservation_ttl)
    assert env.store.expire() == ({"A": 2}, 0)
    assert env.store.lookup(s, keys(2)) == 0
    with pytest.raises(NotFound):
        env.store.commit(s, res.reservation_id, [1, 1], None)
    assert env.store.acquire(s, keys(2)).slots == []


def test_reserve_reports_exists_and_in_flight_and_grants_only_reserved_keys(
    env: StoreEnv,
) -> None:
    s1, s2 = session(env), session(env)
    k1, k2, k3 = keys(3)
    put(env, s1, [k1])
    r1 = env.reserve(s1, [k2])
    r2 = env.reserve(s2, [k1, k2, k3])
    assert r2.statuses == [EXISTS, IN_FLIGHT, RESERVED]
    assert len(r2.slots) == 1 and r2.reservation_id not in (0, r1.reservation_id)
    # the in-flight key belongs to s1's reservation, the new one to s2's
    assert set(s1.ns.in_flight) == {k2, k3}
    assert env.store.state.reservations[r1.reservation_id].keys == [k2]
    assert env.store.state.reservations[r2.reservation_id].keys == [k3]
    # the two grants point at different slots
    assert (r1.slots[0].segment_id, r1.slots[0].offset) != (r2.slots[0].segment_id,
                                                            r2.slots[0].offset)
    env.store.abort(s1, r1.reservation_id)
    env.store.abort(s2, r2.reservation_id)


def test_reserve_of_only_present_or_in_flight_keys_opens_no_reservation(env: StoreEnv) -> None:
    s = session(env)
    put(env, s, keys(2))
    r = env.reserve(s, keys(3))
    res = env.reserve(s, keys(3))
    assert res.reservation_id == 0 and res.slots == []
    assert res.statuses == [EXISTS, EXISTS, IN_FLIGHT]
    assert env.store.reservation_count == 1
    env.store.abort(s, r.reservation_id)


def test_duplicate_key_in_reserve_is_invalid_argument_and_changes_nothing(
    env: StoreEnv,
) -> None:
    s = session(env)
    put(env, s, keys(1))
    before = snapshot(env.store)
    k = keys(3)
    with pytest.raises(InvalidArgument) as ei:
        env.reserve(s, [k[1], k[2], k[1]])
    assert str(ei.value) == "duplicate key at index 2"
    assert snapshot(env.store) == before


def test_reserve_grows_extents_lazily_from_the_budget(env: StoreEnv) -> None:
    s = session(env)
    assert s.ns.extents == [] and env.store.budget_free == CAPACITY
    version = s.ns.segments_version
    put(env, s, keys(1))
    assert len(s.ns.extents) == 1 and env.store.budget_free == CAPACITY - EXTENT_FILE
    assert s.ns.segments_version > version
    put(env, s, keys(SLOTS_PER_EXTENT, start=1))  # one more than the first extent holds
    assert len(s.ns.extents) == 2 and env.store.budget_free == 0
    assert env.store.evictions == 0


def test_a_reserve_cancelled_just_after_its_extent_was_made_leaves_no_extent_behind(
        env: StoreEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel lands after the file was made but before the reserve resumed (a client's
    deadline can do that): the made file is removed, its bytes and fds are given back,
    its number is not reused, and the next reserve grows a fresh extent."""
    s = session(env)

    def cancelled_after(made: Any) -> Any:
        async def wait() -> Any:
            await asyncio.wait([made])
            assert made.result() is not None  # really made
            raise asyncio.CancelledError

        return wait()

    monkeypatch.setattr(asyncio, "shield", cancelled_after)
    with pytest.raises(asyncio.CancelledError):
        env.reserve(s, keys(1))
    monkeypatch.undo()
    assert s.ns.extents == [] and env.store.budget_free == CAPACITY
    assert os.listdir(env.shm_dir) == []  # the made file is gone (closed, unlinked)
    put(env, s, keys(1))
    assert [e.segment.path.rsplit(".", 2)[-2] for e in s.ns.extents] == ["000001"]


def test_reused_slot_gets_a_new_generation(env: StoreEnv) -> None:
    s = session(env)
    r1 = env.reserve(s, keys(1))
    g = r1.slots[0]
    seg = env.segment(g.segment_id)
    slot = g.offset // seg.layout.slot_bytes
    gen1 = seg.read_slot(slot).generation
    env.store.abort(s, r1.reservation_id)
    r2 = env.reserve(s, keys(1))
    assert (r2.slots[0].segment_id, r2.slots[0].offset) == (g.segment_id, g.offset)
    assert seg.read_slot(slot).generation == gen1 + 1
    env.store.commit(s, r2.reservation_id, [10], None)
    assert seg.read_slot(slot).generation == gen1 + 1 == s.ns.index[keys(1)[0]].generation


# ================================================================ commit validation
COMMIT_ERRORS = [
    # (lengths, checksums, message template; {rid} is the reservation id)
    ([100], None, "reservation {rid} has 2 slots but 1 lengths were given"),
    ([100, 100, 100], None, "reservation {rid} has 2 slots but 3 lengths were given"),
    ([], None, "reservation {rid} has 2 slots but 0 lengths were given"),
    ([100, 0], None, "lengths[1] = 0 is outside 1..65536 (block_bytes)"),
    ([-1, 100], None, "lengths[0] = -1 is outside 1..65536 (block_bytes)"),
    ([BLOCK + 1, 100], None, "lengths[0] = 65537 is outside 1..65536 (block_bytes)"),
    ([100, 100], [1], "lengths and checksums differ in length (2 != 1)"),
    ([100, 100], [1, 2, 3], "lengths and checksums differ in length (2 != 3)"),
    ([100, 100], [], "lengths and checksums differ in length (2 != 0)"),
]


@pytest.mark.parametrize(("lengths", "checksums", "message"), COMMIT_ERRORS)
def test_invalid_commit_is_invalid_argument_with_exact_message_and_changes_nothing(
    env: StoreEnv, lengths: list[int], checksums: list[int] | None, message: str
) -> None:
    s = session(env)
    ks = keys(2)
    res = env.reserve(s, ks)
    before = snapshot(env.store)
    with pytest.raises(InvalidArgument) as ei:
        env.store.commit(s, res.reservation_id, lengths, checksums)
    assert str(ei.value) == message.format(rid=res.reservation_id)
    assert snapshot(env.store) == before
    assert env.store.check() == []
    assert set(s.ns.in_flight) == set(ks) and env.store.lookup(s, ks) == 0
    # the reservation is still open and commits fine afterwards
    assert env.store.commit(s, res.reservation_id, [1, BLOCK], [0, 2**64 - 1]) == 2
    assert env.store.lookup(s, ks) == 2


@pytest.mark.parametrize(("lengths", "checksums", "message"),
                         [e for e in COMMIT_ERRORS if min(e[0], default=0) >= 0])
def test_a_commit_given_columns_is_checked_as_one_given_lists(
    env: StoreEnv, lengths: list[int], checksums: list[int] | None, message: str
) -> None:
    """A large commit's lengths and checksums come as uint64 columns read from the wire
    (``kvtier._wire.columns``): each bad value is refused with the same message."""
    s = session(env)
    ks = keys(2)
    res = env.reserve(s, ks)
    before = snapshot(env.store)
    as_column = functools.partial(np.array, dtype=np.uint64)
    with pytest.raises(InvalidArgument) as ei:
        env.store.commit(s, res.reservation_id, as_column(lengths),
                         None if checksums is None else as_column(checksums))
    assert str(ei.value) == message.format(rid=res.reservation_id)
    assert snapshot(env.store) == before
    assert env.store.commit(s, res.reservation_id, as_column([1, BLOCK]),
                            as_column([0, 2**64 - 1])) == 2
    assert env.store.lookup(s, ks) == 2


def test_commit_of_an_unknown_reservation_is_not_found(env: StoreEnv) -> None:
    s = session(env)
    for call in (lambda: env.store.commit(s, 999, [1], None), lambda: env.store.abort(s, 999)):
        with pytest.raises(NotFound) as ei:
            call()
        assert str(ei.value) == ("reservation 999 is not open in this session (never issued, "
                                 "already committed or aborted, or expired)")


def test_reservation_id_zero_is_invalid_argument(env: StoreEnv) -> None:
    s = session(env)
    for call in (lambda: env.store.commit(s, 0, [1], None), lambda: env.store.abort(s, 0)):
        with pytest.raises(InvalidArgument) as ei:
            call()
        assert str(ei.value) == "reservation_id is required (0 is not a reservation)"


def test_another_sessions_reservation_is_not_found_and_stays_open(env: StoreEnv) -> None:
    owner, other = session(env), session(env)
    res = env.reserve(owner, keys(1))
    before = snapshot(env.store)
    with pytest.raises(NotFound):
        env.store.commit(other, res.reservation_id, [1], None)
    with pytest.raises(NotFound):
        env.store.abort(other, res.reservation_id)
    assert snapshot(env.store) == before
    assert env.store.commit(owner, res.reservation_id, [1], None) == 1


def test_a_reservation_ends_exactly_once(env: StoreEnv) -> None:
    s = session(env)
    r1 = env.reserve(s, keys(1))
    env.store.commit(s, r1.reservation_id, [5], None)
    r2 = env.reserve(s, keys(1, start=1))
    env.store.abort(s, r2.reservation_id)
    for rid in (r1.reservation_id, r2.reservation_id):
        with pytest.raises(NotFound):
            env.store.commit(s, rid, [5], None)
        with pytest.raises(NotFound):
            env.store.abort(s, rid)


def test_commit_persists_key_length_checksum_generation_and_epoch(env: StoreEnv) -> None:
    s = session(env)
    res = env.reserve(s, keys(2))
    env.store.commit(s, res.reservation_id, [7, BLOCK], [0xFEED, 0])
    for k, g, length, csum in zip(keys(2), res.slots, (7, BLOCK), (0xFEED, 0), strict=True):
        seg = env.segment(g.segment_id)
        rec = seg.read_slot(g.offset // seg.layout.slot_bytes)
        block = s.ns.index[k]
        assert rec.state == SlotState.COMMITTED
        assert (rec.key, rec.length, rec.checksum, rec.epoch) == (k, length, csum, BOOT_EPOCH)
        assert rec.generation == block.generation
    got = env.store.acquire(s, keys(2))
    assert [(g.length, g.checksum) for g in got.slots] == [(7, 0xFEED), (BLOCK, 0)]
    env.store.release(s, got.lease_id)


# ================================================================ lookup and acquire
def test_lookup_counts_the_longest_present_prefix_without_side_effects(env: StoreEnv) -> None:
    s = session(env)
    k = keys(4)
    put(env, s, [k[0], k[1], k[3]])
    before = snapshot(env.store)
    hits = (s.ns.hits, s.ns.misses)
    assert env.store.lookup(s, k) == 2
    assert env.store.lookup(s, [k[3]]) == 1
    assert env.store.lookup(s, [k[2], k[0]]) == 0
    assert env.store.lookup(s, [k[3], k[0], k[2], k[1]]) == 2
    assert env.store.lookup(s, []) == 0
    assert snapshot(env.store) == before and (s.ns.hits, s.ns.misses) == hits


def test_acquire_leases_the_longest_present_prefix_and_pins_it(env: StoreEnv) -> None:
    s = session(env)
    k = keys(4)
    put(env, s, [k[0], k[1], k[3]])
    got = env.store.acquire(s, k)
    assert got.lease_id != 0 and len(got.slots) == 2
    read_leased(env, s, k[:2], got.slots)
    assert [s.ns.index[x].pins for x in (k[0], k[1], k[3])] == [1, 1, 0]
    assert s.ns.leased == 2 and (s.ns.hits, s.ns.misses) == (2, 2)
    assert s.ns.table.counts().evictable == 1  # k3: the leased blocks are not evictable
    env.store.release(s, got.lease_id)
    assert s.ns.leased == 0 and env.store.lease_count == 0


def test_acquire_of_a_missing_first_key_grants_no_lease(env: StoreEnv) -> None:
    s = session(env)
    put(env, s, keys(2, start=1))
    got = env.store.acquire(s, keys(3))
    assert got.lease_id == 0 and got.slots == [] and env.store.lease_count == 0


def test_acquire_with_duplicate_keys_is_invalid_argument_and_pins_nothing(env: StoreEnv) -> None:
    s = session(env)
    put(env, s, keys(2))
    before = snapshot(env.store)
    k = keys(2)
    with pytest.raises(InvalidArgument) as ei:
        env.store.acquire(s, [k[0], k[1], k[0]])
    assert str(ei.value) == "duplicate keys in one acquire"
    assert snapshot(env.store) == before


def test_release_twice_is_not_found(env: StoreEnv) -> None:
    s = session(env)
    put(env, s, keys(1))
    got = env.store.acquire(s, keys(1))
    env.store.release(s, got.lease_id)
    with pytest.raises(NotFound) as ei:
        env.store.release(s, got.lease_id)
    assert str(ei.value) == (f"lease {got.lease_id} is not held by this session "
                             "(already released, or expired)")
    assert s.ns.index[keys(1)[0]].pins == 0


def test_lease_id_zero_is_invalid_argument(env: StoreEnv) -> None:
    s = session(env)
    with pytest.raises(InvalidArgument) as ei:
        env.store.release(s, 0)
    assert str(ei.value) == "lease_id is required (0 is not a lease)"


def test_another_sessions_lease_cannot_be_released(env: StoreEnv) -> None:
    owner, other = session(env), session(env)
    put(env, owner, keys(1))
    got = env.store.acquire(owner, keys(1))
    with pytest.raises(NotFound):
        env.store.release(other, got.lease_id)
    assert owner.ns.index[keys(1)[0]].pins == 1
    env.store.release(owner, got.lease_id)


def test_a_block_stays_pinned_until_its_last_lease_ends(env: StoreEnv) -> None:
    s1, s2 = session(env), session(env)
    put(env, s1, keys(1))
    block = s1.ns.index[keys(1)[0]]
    l1 = env.store.acquire(s1, keys(1))
    l2 = env.store.acquire(s2, keys(1))
    evictable = s1.ns.table.counts
    assert block.pins == 2 and evictable().evictable == 0 and s1.ns.leased == 1
    env.store.release(s1, l1.lease_id)
    assert block.pins == 1 and evictable().evictable == 0 and block.extent.pinned == 1
    env.store.release(s2, l2.lease_id)
    assert block.pins == 0 and evictable().evictable == 1 and block.extent.pinned == 0


# ================================================================ invariant 2: leases pin
def test_leased_block_is_never_evicted_while_the_pool_fills_up(env: StoreEnv) -> None:
    s = session(env)
    first = keys(TOTAL_SLOTS)
    put(env, s, first)
    assert env.store.evictions == 0
    pinned = first[:3]
    lease = env.store.acquire(s, pinned)
    for round_ in range(4):  # write the pool over four times in batches of 5
        for b in range(0, TOTAL_SLOTS, 5):
            put(env, s, keys(5, prefix=f"r{round_}-", start=b))
            assert env.store.lookup(s, pinned) == 3
            assert env.store.check() == []
    assert env.store.evictions >= 4 * TOTAL_SLOTS - 3
    assert not any(b.key in pinned for b in env.evicted)
    read_leased(env, s, pinned, lease.slots)
    env.store.release(s, lease.lease_id)
    # released: evictable again, like any block
    for b in range(0, 2 * TOTAL_SLOTS, 5):
        put(env, s, keys(5, prefix="z-", start=b))
    assert present(env, s, pinned) == []
    assert {b.key for b in env.evicted} >= set(pinned)


def test_eviction_gives_blocks_read_since_the_hand_passed_a_second_chance(
        env: StoreEnv) -> None:
    """CLOCK (docs/decisions.md): a read sets a block's bit; the hand evicts the blocks
    without one first, clearing the bits it passes."""
    s = session(env)
    k = keys(TOTAL_SLOTS)
    put(env, s, k)
    # read k5 and k2 through a lease; a lookup does not count as use
    for x in (k[5], k[2]):
        got = env.store.acquire(s, [x])
        env.store.release(s, got.lease_id)
    assert env.store.lookup(s, [k[0]]) == 1
    put(env, s, keys(TOTAL_SLOTS - 2, prefix="new-"))
    assert {b.key for b in env.evicted} == set(k) - {k[5], k[2]}
    assert present(env, s, [k[5], k[2]]) == [k[5], k[2]]
    put(env, s, keys(TOTAL_SLOTS, prefix="newer-"))
    assert present(env, s, k) == []


def test_delete_of_a_leased_block_hides_it_at_once_and_frees_the_slot_only_at_release(
    env: StoreEnv,
) -> None:
    s, other = session(env), session(env)
    k = keys(3)
    put(env, s, k)
    lease = env.store.acquire(s, k[:1])
    ext, slot = slot_of(env, s, k[0])
    free_before, committed_before = s.ns.free_slots(), s.ns.committed
    assert env.store.delete(other, [k[0]]) == 1
    # hidden at once, for everybody
    assert env.store.lookup(s, k) == 0 and env.store.lookup(other, k[:1]) == 0
    assert env.store.acquire(other, k[:1]).slots == []
    # ... but the slot is still the reader's, marked DOOMED so a crash keeps it deleted
    assert ext.segment.read_slot(slot).state == SlotState.DOOMED
    assert s.ns.free_slots() == free_before and s.ns.committed == committed_before
    read_leased(env, s, k[:1], lease.slots)
    assert env.store.check() == []
    # the key can be written again meanwhile, into another slot
    put(env, other, k[:1], tag=b"v2")
    assert slot_of(env, s, k[0]) != (ext, slot)
    read_leased(env, s, k[:1], lease.slots)  # the old bytes are still there for the reader
    assert env.store.check() == []
    env.store.release(s, lease.lease_id)
    assert ext.segment.read_slot(slot).state == SlotState.FREE
    got = env.store.acquire(s, k[:1])
    read_leased(env, s, k[:1], got.slots, tag=b"v2")
    env.store.release(s, got.lease_id)


def test_doomed_block_is_never_evicted_before_release(env: StoreEnv) -> None:
    s = session(env)
    put(env, s, keys(TOTAL_SLOTS))
    lease = env.store.acquire(s, keys(1))
    env.store.delete(s, keys(1))
    for i in range(3):
        put(env, s, keys(TOTAL_SLOTS - 1, prefix=f"f{i}-"))
    read_leased(env, s, keys(1), lease.slots)
    assert not any(b.key == keys(1)[0] for b in env.evicted)
    env.store.release(s, lease.lease_id)


def test_delete_of_an_unleased_block_frees_its_slot_now(env: StoreEnv) -> None:
    s = session(env)
    k = keys(3)
    put(env, s, k)
    ext, slot = slot_of(env, s, k[1])
    free_before = s.ns.free_slots()
    assert env.store.delete(s, [k[1], k[1], b"missing"]) == 1
    assert ext.segment.read_slot(slot).state == SlotState.FREE
    assert s.ns.free_slots() == free_before + 1
    assert env.store.lookup(s, k) == 1 and env.store.lookup(s, k[2:]) == 1
    assert env.store.delete(s, [k[1]]) == 0
    assert env.evicted == []  # a delete is not an eviction


def test_reserve_at_capacity_evicts_unleased_blocks(env: StoreEnv) -> None:
    s = session(env)
    put(env, s, keys(TOTAL_SLOTS))
    put(env, s, keys(4, prefix="x"))
    assert env.store.evictions == 4 and len(env.evicted) == 4
    assert [b.key for b in env.evicted] == keys(4)
    assert len(s.ns.index) == TOTAL_SLOTS and s.ns.free_slots() == 0
    assert env.store.budget_free == 0 and len(s.ns.extents) == 2


# ================================================================ capacity exhausted
def test_capacity_exhausted_when_everything_is_leased_or_reserved_changes_nothing(
    env: StoreEnv,
) -> None:
    s = session(env)
    put(env, s, keys(TOTAL_SLOTS - 5))
    lease = env.store.acquire(s, keys(TOTAL_SLOTS - 5))
    res = env.reserve(s, keys(5, prefix="r"))
    before = snapshot(env.store)
    with pytest.raises(CapacityExhausted) as ei:
        env.reserve(s, keys(1, prefix="n"))
    assert str(ei.value) == ("DRAM is full for namespace 'A': 1 slots needed, 0 obtainable "
                             f"({TOTAL_SLOTS - 5} leased and 5 reserved blocks in this namespace "
                             "cannot be evicted)")
    assert snapshot(env.store) == before
    env.store.release(s, lease.lease_id)
    env.store.abort(s, res.reservation_id)


def test_capacity_exhausted_evicts_nothing_when_the_reserve_cannot_be_met(env: StoreEnv) -> None:
    """All or nothing: 5 evictable blocks do not satisfy 6 new keys, so none is evicted."""
    s = session(env)
    put(env, s, keys(TOTAL_SLOTS))
    lease = env.store.acquire(s, keys(TOTAL_SLOTS - 5))
    before = snapshot(env.store)
    with pytest.raises(CapacityExhausted) as ei:
        env.reserve(s, keys(6, prefix="n"))
    assert "6 slots needed, 5 obtainable" in str(ei.value)
    assert snapshot(env.store) == before and env.evicted == []
    assert env.store.lookup(s, keys(TOTAL_SLOTS)) == TOTAL_SLOTS
    # five fit
    put(env, s, keys(5, prefix="n"))
    assert [b.key for b in env.evicted] == keys(5, start=TOTAL_SLOTS - 5)
    env.store.release(s, lease.lease_id)


def test_reserve_of_more_keys_than_the_pool_holds_is_capacity_exhausted(env: StoreEnv) -> None:
    s = session(env)
    with pytest.raises(CapacityExhausted):
        env.reserve(s, keys(TOTAL_SLOTS + 1))
    assert env.store.reservation_count == 0 and set(s.ns.in_flight) == set() and s.ns.reserved == 0
    put(env, s, keys(TOTAL_SLOTS))


def test_failing_extent_creation_is_capacity_exhausted_and_returns_the_budget(
    shm_dir: str,
) -> None:
    calls = []

    def factory(ns: Namespace, index: int, layout: SegmentLayout, seg_id: int) -> Any:
        calls.append(index)
        raise OSError(errno.ENOSPC, "No space left on device")

    store = Store(capacity=CAPACITY, extent_size=EXTENT, extent_factory=factory, lease_ttl=30,
                  reservation_ttl=10, boot_epoch=BOOT_EPOCH)
    s = store.open_session("A", BLOCK, "m1", PEER)
    with pytest.raises(CapacityExhausted, match="could not create a DRAM extent: .*No space"):
        run(store, store.reserve(s, keys(1)))
    assert calls and store.budget_free == CAPACITY and s.ns.extents == []
    assert store.reservation_count == 0 and store.check() == []


# ================================================================ cross-namespace reclaim
def test_namespace_b_reclaims_extents_of_namespace_a_whose_blocks_are_all_evictable(
    env: StoreEnv,
) -> None:
    a = session(env, "A")
    b = session(env, "B", block_bytes=32 * KiB)
    put(env, a, keys(TOTAL_SLOTS))
    assert env.store.budget_free == 0
    put(env, b, keys(4, prefix="b"))
    assert env.store.lookup(b, keys(4, prefix="b")) == 4
    assert len(a.ns.extents) == 1 and len(b.ns.extents) == 1
    # the blocks of the reclaimed extent were evicted (the one exit), the rest stay
    assert len(env.evicted) == SLOTS_PER_EXTENT
    assert {blk.ns.name for blk in env.evicted} == {"A"}
    assert len(present(env, a, keys(TOTAL_SLOTS))) == TOTAL_SLOTS - SLOTS_PER_EXTENT
    got = env.store.acquire(b, keys(4, prefix="b"))
    read_leased(env, b, keys(4, prefix="b"), got.slots)
    env.store.release(b, got.lease_id)


def test_reclaim_never_takes_an_extent_holding_a_leased_or_reserved_block(
    env: StoreEnv,
) -> None:
    a = session(env, "A")
    b = session(env, "B", block_bytes=32 * KiB)
    put(env, a, keys(TOTAL_SLOTS - 1))
    ks = keys(TOTAL_SLOTS - 1)
    ext0, ext1 = a.ns.extents
    in0 = next(k for k in ks if a.ns.index[k].extent is ext0)
    lease = env.store.acquire(a, [in0])  # pins extent 0
    res = env.reserve(a, [b"last"])  # the one free slot, in extent 1
    assert res.slots[0].segment_id == ext1.segment.segment_id
    before = snapshot(env.store)
    with pytest.raises(CapacityExhausted):
        env.reserve(b, keys(1, prefix="b"))
    assert snapshot(env.store) == before
    assert env.store.lookup(a, ks) == len(ks)
    # once the reservation ends, extent 1 can go, extent 0 (leased) stays
    env.store.abort(a, res.reservation_id)
    put(env, b, keys(1, prefix="b"))
    assert a.ns.extents == [ext0]
    assert env.store.lookup(a, [in0]) == 1
    read_leased(env, a, [in0], lease.slots)
    env.store.release(a, lease.lease_id)


def test_reclaim_takes_extents_that_hold_no_blocks(env: StoreEnv) -> None:
    """A namespace that deleted everything must not keep the budget from another one."""
    a = session(env, "A")
    b = session(env, "B", block_bytes=32 * KiB)
    put(env, a, keys(TOTAL_SLOTS))
    assert env.store.delete(a, keys(TOTAL_SLOTS)) == TOTAL_SLOTS
    assert a.ns.committed == a.ns.reserved == a.ns.leased == 0 and env.store.budget_free == 0
    # nothing is leased, reserved or even committed anywhere: B must get room
    put(env, b, keys(4, prefix="b"))
    assert env.store.lookup(b, keys(4, prefix="b")) == 4


def test_reclaim_frees_several_extents_when_one_is_too_small_for_the_block(
    store_factory: Callable[..., StoreEnv],
) -> None:
    """B's one-slot file is bigger than one of A's extents: it takes two of them."""
    small = SegmentLayout.fit(BLOCK, 256 * KiB)
    assert small is not None
    env = store_factory(capacity=4 * small.file_bytes, extent_size=256 * KiB)
    a = session(env, "A")
    big = 300 * KiB
    assert SegmentLayout.one_slot_file_bytes(big) > small.file_bytes
    b = session(env, "B", block_bytes=big)
    put(env, a, keys(4 * small.n_slots))
    assert env.store.budget_free == 0 and len(a.ns.extents) == 4
    # nothing is leased or reserved: B's single block must fit once two extents are reclaimed
    put(env, b, keys(1, prefix="b"))
    assert env.store.lookup(b, keys(1, prefix="b")) == 1


# ================================================================ sessions end, expiry
def test_close_session_aborts_its_reservations_and_releases_its_leases(env: StoreEnv) -> None:
    s, other = session(env), session(env)
    put(env, s, keys(4))
    l1 = env.store.acquire(s, keys(2))
    l2 = env.store.acquire(s, keys(3))
    l_other = env.store.acquire(other, keys(1))
    r = env.reserve(s, keys(2, prefix="r"))
    r_other = env.reserve(other, keys(1, prefix="o"))
    free_before = s.ns.free_slots()
    assert env.store.close_session(s) == (2, 2)  # (reserved slots returned, leases released)
    assert s.closed and s.id not in env.store.sessions and s.ns.sessions == 1
    assert s.ns.free_slots() == free_before + 2
    assert env.store.lookup(other, keys(2, prefix="r")) == 0
    assert set(s.ns.in_flight) == {keys(1, prefix="o")[0]}
    # only the other session's lease still pins
    assert [s.ns.index[k].pins for k in keys(4)] == [1, 0, 0, 0]
    assert env.store.lease_count == 1 and env.store.reservation_count == 1
    with pytest.raises(Unauthenticated):
        env.store.session_for(s.token)
    with pytest.raises(Unauthenticated):
        env.reserve(s, keys(1, prefix="late"))
    with pytest.raises(Unauthenticated):
        env.store.acquire(s, keys(1))
    for call in (lambda: env.store.commit(s, r.reservation_id, [1, 1], None),
                 lambda: env.store.release(s, l1.lease_id),
                 lambda: env.store.release(s, l2.lease_id)):
        with pytest.raises(NotFound):
            call()
    assert env.store.close_session(s) == (0, 0)  # idempotent
    env.store.release(other, l_other.lease_id)
    env.store.abort(other, r_other.reservation_id)


def test_expire_ends_reservations_and_leases_past_their_deadline(
    store_factory: Callable[..., StoreEnv],
) -> None:
    env = store_factory(capacity=CAPACITY, extent_size=EXTENT, lease_ttl=30.0,
                        reservation_ttl=10.0)
    s = session(env)
    put(env, s, keys(2))
    t0 = env.clock.now
    r1 = env.reserve(s, keys(1, prefix="r1"))
    lease = env.store.acquire(s, keys(2))
    env.clock.advance(5)
    r2 = env.reserve(s, keys(1, prefix="r2"))
    env.clock.now = t0 + 10 - 1e-6
    assert env.store.expire() == ({}, 0)
    env.clock.now = t0 + 10  # exactly at the deadline counts as expired
    assert env.store.expire() == ({"A": 1}, 0)
    assert r1.reservation_id not in s.reservations and r2.reservation_id in s.reservations
    assert env.store.lookup(s, keys(1, prefix="r1")) == 0
    env.clock.now = t0 + 30
    assert env.store.expire() == ({"A": 1}, 1)
    assert env.store.lease_count == 0 and env.store.reservation_count == 0
    assert [s.ns.index[k].pins for k in keys(2)] == [0, 0]
    assert s.ns.table.counts().evictable == 2
    with pytest.raises(NotFound):
        env.store.release(s, lease.lease_id)
    with pytest.raises(NotFound):
        env.store.commit(s, r2.reservation_id, [1], None)
    assert env.store.expire() == ({}, 0)


def test_expired_lease_of_a_deleted_block_frees_its_slot(env: StoreEnv) -> None:
    s = session(env)
    put(env, s, keys(1))
    ext, slot = slot_of(env, s, keys(1)[0])
    env.store.acquire(s, keys(1))
    env.store.delete(s, keys(1))
    env.clock.advance(env.store.lease_ttl)
    assert env.store.expire() == ({}, 1)
    assert ext.segment.read_slot(slot).state == SlotState.FREE


# ================================================================ accounting
def test_dram_bytes_add_up_through_a_lifecycle(env: StoreEnv) -> None:
    st = env.store

    def acct() -> dict[str, int]:
        d = st.dram_bytes()
        assert d["free"] + d["reserved"] + d["granted"] + d["committed"] == d["total"] == CAPACITY
        assert d["free"] >= 0
        return d

    assert acct() == {"total": CAPACITY, "reserved": 0, "granted": 0, "committed": 0,
                     "free": CAPACITY}
    s = session(env)
    res = env.reserve(s, keys(3))
    assert acct()["reserved"] == 3 * BLOCK
    env.store.commit(s, res.reservation_id, [1, 2, 3], None)
    assert acct()["reserved"] == 0 and acct()["committed"] == 3 * BLOCK
    lease = st.acquire(s, keys(1))
    st.delete(s, keys(3))
    assert acct()["committed"] == BLOCK  # the doomed, leased block still holds its slot
    st.release(s, lease.lease_id)
    assert acct() == {"total": CAPACITY, "reserved": 0, "granted": 0, "committed": 0,
                     "free": CAPACITY}
    put(env, s, keys(TOTAL_SLOTS, prefix="f"))
    put(env, s, keys(5, prefix="g"))
    assert acct()["committed"] == TOTAL_SLOTS * BLOCK


# ================================================================ check() finds corruption
def _corruptible(store_factory: Callable[..., StoreEnv]) -> tuple[StoreEnv, Session]:
    env = store_factory(capacity=CAPACITY, extent_size=EXTENT)
    env.expect_clean = False
    s = session(env)
    put(env, s, keys(4))
    env.store.acquire(s, keys(1))
    env.reserve(s, keys(1, prefix="r"))
    assert env.store.check() == []
    return env, s


def _state_at(ext: Extent, slot: int) -> int:
    return TABLE_OFFSET + slot * SLOT_ENTRY_BYTES


def _first_free(ext: Extent) -> int:
    return int(np.flatnonzero(ext.segment.scan()["state"] == SlotState.FREE)[0])


CORRUPTIONS: dict[str, Callable[[StoreEnv, Session], None]] = {}


def corruption(fn: Callable[[StoreEnv, Session], None]) -> Callable[[StoreEnv, Session], None]:
    CORRUPTIONS[fn.__name__] = fn
    return fn


@corruption
def committed_slot_flipped_to_free(env: StoreEnv, s: Session) -> None:
    ext, slot = slot_of(env, s, keys(2)[1])
    ext.segment.meta[_state_at(ext, slot)] = SlotState.FREE


@corruption
def committed_slot_flipped_to_reserved(env: StoreEnv, s: Session) -> None:
    ext, slot = slot_of(env, s, keys(3)[2])
    ext.segment.meta[_state_at(ext, slot)] = SlotState.RESERVED


@corruption
def free_slot_flipped_to_committed(env: StoreEnv, s: Session) -> None:
    ext = s.ns.extents[0]
    ext.segment.meta[_state_at(ext, _first_free(ext))] = SlotState.COMMITTED


@corruption
def free_slot_flipped_to_reserved(env: StoreEnv, s: Session) -> None:
    ext = s.ns.extents[0]
    ext.segment.meta[_state_at(ext, _first_free(ext))] = SlotState.RESERVED


@corruption
def reserved_slot_flipped_to_free(env: StoreEnv, s: Session) -> None:
    (res,) = s.reservations.values()
    ext, slot, _ = res.places[0]
    ext.segment.meta[_state_at(ext, slot)] = SlotState.FREE


@corruption
def slot_table_key_changed(env: StoreEnv, s: Session) -> None:
    ext, slot = slot_of(env, s, keys(2)[1])
    ext.segment.meta[_state_at(ext, slot) + KEY_OFFSET] ^= 0xFF  # first key byte


@corruption
def slot_table_length_changed(env: StoreEnv, s: Session) -> None:
    ext, slot = slot_of(env, s, keys(2)[1])
    ext.segment.meta[_state_at(ext, slot) + 8] ^= 0x01


@corruption
def slot_table_generation_changed(env: StoreEnv, s: Session) -> None:
    ext, slot = slot_of(env, s, keys(2)[1])
    ext.segment.meta[_state_at(ext, slot) + 24] ^= 0x01  # generation


@corruption
def slot_table_checksum_changed(env: StoreEnv, s: Session) -> None:
    # a warm restart rebuilds blocks from the slot table: a wrong checksum there
    # turns a good block into a "Corrupted" miss (or hides real corruption)
    ext, slot = slot_of(env, s, keys(2)[1])
    ext.segment.meta[_state_at(ext, slot) + 2] ^= 0x01  # flags: has-checksum


@corruption
def pin_without_a_lease(env: StoreEnv, s: Session) -> None:
    s.ns.table.pin([s.ns.index[keys(3)[2]].ref])


@corruption
def lease_forgotten_with_its_pin(env: StoreEnv, s: Session) -> None:
    lease = next(iter(s.leases.values()))
    del s.leases[lease.id]
    del env.store.state.leases[lease.id]


@corruption
def key_dropped_from_the_index(env: StoreEnv, s: Session) -> None:
    s.ns.index.table.discard(keys(2)[1])


@corruption
def budget_does_not_balance(env: StoreEnv, s: Session) -> None:
    env.store.budget.free_bytes -= 4096


@corruption
def in_flight_key_forgotten(env: StoreEnv, s: Session) -> None:
    s.ns.in_flight.clear()


@corruption
def index_entry_under_the_wrong_key(env: StoreEnv, s: Session) -> None:
    s.ns.index.table.add(b"alias", locate(s.ns.index[keys(2)[1]]))


@corruption
def deleted_block_still_indexed(env: StoreEnv, s: Session) -> None:
    s.ns.table.delete([s.ns.index[keys(1)[0]].ref])  # leased: DOOMED, the key stays


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS.values()), ids=list(CORRUPTIONS))
def test_check_reports_deliberate_corruption(
    store_factory: Callable[..., StoreEnv], corrupt: Callable[[StoreEnv, Session], None]
) -> None:
    env, s = _corruptible(store_factory)
    corrupt(env, s)
    assert env.store.check() != [], f"check() did not notice: {corrupt.__name__}"


def test_check_of_an_empty_store_is_clean(env: StoreEnv) -> None:
    assert env.store.check() == []
    session(env)
    assert env.store.check() == []


def test_concurrent_reserves_of_one_key_grant_it_once(env: StoreEnv) -> None:
    s1, s2 = session(env), session(env)

    async def both() -> list[Any]:
        return list(await asyncio.gather(env.store.reserve(s1, keys(3)),
                                         env.store.reserve(s2, keys(3))))

    r1, r2 = run(env.store, both())
    assert sorted([r1.statuses, r2.statuses]) == [[RESERVED] * 3, [IN_FLIGHT] * 3]
    for s, r in ((s1, r1), (s2, r2)):
        if r.reservation_id:
            env.store.abort(s, r.reservation_id)
    assert env.store.reservation_count == 0


def test_segment_factory_is_called_with_namespace_index_layout_and_id(shm_dir: str) -> None:
    seen = []
    real = segment_factory(shm_dir)

    def spy(ns: Namespace, index: int, layout: SegmentLayout, seg_id: int) -> Any:
        seen.append((ns.name, index, layout.block_bytes, seg_id))
        return real(ns, index, layout, seg_id)

    store = Store(capacity=CAPACITY, extent_size=EXTENT, extent_factory=spy, lease_ttl=30,
                  reservation_ttl=10, boot_epoch=BOOT_EPOCH)
    s = store.open_session("A", BLOCK, "m1", PEER)
    run(store, store.reserve(s, keys(SLOTS_PER_EXTENT + 1)))
    assert [(n, i, b) for n, i, b, _ in seen] == [("A", 0, BLOCK), ("A", 1, BLOCK)]
    assert len({sid for *_, sid in seen}) == 2
    assert store.check() == []
    store.close_all()


def test_a_namespace_that_evicts_as_it_commits_keeps_its_index_table_at_one_size(
        store_factory: Callable[..., StoreEnv]) -> None:
    """Each eviction leaves a tombstone in the shared index; a rebuild drops them, so a
    pool that evicts as it commits rebuilds its table at the size its live keys need,
    never doubling it for tombstones (256 slots of 4 KiB, 40 rounds of 64 new keys)."""
    env = store_factory(capacity=1 << 20, extent_size=1 << 20)
    s = session(env, block_bytes=4096)
    sizes = []
    for r in range(40):
        ks = keys(64, "e", 64 * r)
        res = env.reserve(s, ks)
        assert env.store.commit(s, res.reservation_id, [1] * 64, None) == 64
        sizes.append(s.ns.index.table.capacity)
    assert present(env, s, keys(64, "e", 64 * 39)) == keys(64, "e", 64 * 39)
    assert env.store.evictions >= 40 * 64 - 256
    assert max(sizes) <= 1024  # a third of it holds the live keys (<= 256) and 64 more


def test_in_flight_keys_fold_only_when_asked_and_leave_with_their_reservation() -> None:
    """``InFlight``: a reservation's keys come in as its list and are hashed into one set
    only when a question needs them; each reservation's keys leave when it ends,
    folded or not, and the others' stay."""
    from kvtierd.store.types import InFlight

    f = InFlight()
    assert not f and len(f) == 0 and list(f) == []
    f.open(1, [b"a", b"b"])
    assert f and len(f) == 2
    f.close(1, [b"a", b"b"])  # never folded
    assert not f and b"a" not in f
    f.open(2, [b"a", b"b"])
    f.open(3, [b"c"])
    assert b"c" in f and b"z" not in f  # folds both
    assert f.intersection([b"b", b"z", b"c"]) == {b"b", b"c"}
    f.open(4, [b"d"])  # after a fold: kept apart until the next question
    assert len(f) == 4 and set(f) == {b"a", b"b", b"c", b"d"}
    f.close(2, [b"a", b"b"])
    assert set(f) == {b"c", b"d"} and len(f) == 2
    f.open(5, [b"e"])
    f.close(3, [b"c"])
    f.close(4, [b"d"])  # folded, the last folded one: the set empties
    assert set(f) == {b"e"} and len(f) == 1
    f.close(5, [b"e"])
    assert not f and len(f) == 0


def test_live_many_and_set_lower_many_answer_as_their_one_block_forms(env: StoreEnv) -> None:
    """The demoter's batch forms (``tiering.common.live_many``, ``Store.set_lower_many``
    of a ``BlockBatch``) agree with the handles block by block: a block deleted, one
    doomed while pinned, one whose slot holds a new block of its key, and live ones."""
    from kvtierd.block_table import RECORD_DTYPE
    from kvtierd.store import BlockBatch
    from kvtierd.tiering.common import live_many

    s = session(env)
    ks = keys(6)
    put(env, s, ks)
    blocks = [s.ns.index[k] for k in ks]
    batch = s.ns.batch_at(s.ns.index.find(ks))
    assert batch.keys == ks and batch.gens.tolist() == [b.generation for b in blocks]
    assert BlockBatch.of_blocks(s.ns, blocks).refs.tolist() == batch.refs.tolist()
    lease = env.store.acquire(s, ks[1:2])
    env.store.delete(s, ks[0:2])  # gone; doomed (pinned)
    env.store.delete(s, ks[2:3])
    put(env, s, ks[2:3], tag=b"again")  # a new block of the same key
    assert env.store.set_lower_many(BlockBatch.none(s.ns), Lower.CLEAN) == 0  # (no call)
    assert env.store.set_lower_many(batch, Lower.CLEAN) == 3  # only the live ones change
    ok, rows = live_many(batch)
    assert ok.tolist() == [False, False, False, True, True, True]
    assert [b.doomed for b in blocks] == [True, True, True, False, False, False]
    assert batch.doomed(np.arange(6)).tolist() == [b.doomed for b in blocks]
    assert rows.dtype == RECORD_DTYPE
    assert rows["lower"].tolist()[3:] == [int(Lower.CLEAN)] * 3
    assert [b.lower for b in blocks[3:]] == [Lower.CLEAN] * 3
    assert s.ns.index[ks[2]].lower == Lower.DIRTY  # the new block of a reused key
    none, no_rows = live_many(BlockBatch.none(s.ns))
    assert len(none) == 0 and len(no_rows) == 0
    env.store.release(s, lease.lease_id)
    assert env.store.check() == []


def test_a_batch_naming_a_reused_slot_changes_and_counts_only_its_live_blocks(
        env: StoreEnv) -> None:
    """A batch read before one of its slots was freed and reused by another key: that
    entry is stale (not live, its ``set_lower`` left alone: the new block stays DIRTY),
    the others are live and change; the batch's own columns are what it was read with."""
    from kvtierd.tiering.common import live_many

    s = session(env)
    ks = keys(4)
    put(env, s, ks)
    batch = s.ns.batch_at(s.ns.index.find(ks))
    env.store.delete(s, ks[1:2])
    put(env, s, [b"reuses-a-slot"])  # the freed slot's next block, at a new generation
    reused = s.ns.index[b"reuses-a-slot"]
    assert reused.ref == int(batch.refs[1]) and reused.generation != int(batch.gens[1])
    ok, _rows = live_many(batch)
    assert ok.tolist() == [True, False, True, True]
    assert env.store.set_lower_many(batch, Lower.CLEAN) == 3
    assert s.ns.index[b"reuses-a-slot"].lower == Lower.DIRTY
    assert [s.ns.index[k].lower for k in ks[0:1] + ks[2:]] == [Lower.CLEAN] * 3
    assert batch.keys[1] == ks[1]  # (the batch still names the old block)
    # A batch and the same blocks read again: the stale one is not the same block.
    again = s.ns.batch_at(batch.refs)
    assert batch.same(again).tolist() == [True, False, True, True]
    assert env.store.check() == []


def test_a_demotion_plan_takes_each_block_of_its_batches_once_up_to_its_depth(
        env: StoreEnv) -> None:
    """``Demoter.plan``'s accumulator: batches added again (a reserve retrying repeats
    its urgent blocks) and overlapping ones add each block once, in order, and stop at
    the plan's depth; ``pin_blocks`` of the result pins each block once, in one lease."""
    from kvtierd.store import BlockBatch
    from kvtierd.tiering.demoter import _Plan

    s = session(env)
    ks = keys(8)
    put(env, s, ks)
    batch = s.ns.batch_at(s.ns.index.find(ks))
    plan = _Plan(depth=6)
    plan.add(batch.take(np.array([2, 0, 2, 1])))  # (a block twice in one batch)
    plan.add(batch.take(slice(0, 4)))  # 0..2 again, 3 new
    plan.add(BlockBatch.concat(s.ns, [batch.take(slice(3, 8))]))  # 4, 5 fit; 6, 7 do not
    (planned,) = plan.batches()
    assert planned.keys == [ks[2], ks[0], ks[1], ks[3], ks[4], ks[5]] and plan.count == 6
    assert planned.same(batch).sum() == 6 and batch.same(planned).tolist() == [True] * 6 + [
        False, False]
    lease = env.store.pin_blocks(planned)
    assert env.store.leased_blocks(s.ns) == 6
    env.store.unpin(lease)
    assert env.store.leased_blocks(s.ns) == 0 and env.store.check() == []


@pytest.mark.parametrize("n", [1, 3, 12])
def test_a_hashed_hit_that_names_another_key_s_block_is_a_miss(env: StoreEnv, n: int) -> None:
    """The index holds keys other than 16 bytes long as a hash: ``Keys.find`` checks such
    a hit against the key in the slot entry (a collision, or a hostile client's search
    for one, finds nothing), in batches small (one native call, ``find_keys``) and large
    alike; a 16-byte key is exact.  The collisions are forged: entries for other keys
    naming the held blocks' slots, written into the shared table itself."""
    s = session(env)
    held = keys(n, "h") + [b"0123456789abcdef"]
    put(env, s, held)
    index = s.ns.index
    refs = index.find(held)
    assert refs.all()
    asked = [b"other%03d" % i for i in range(n)] + [b"fedcba9876543210"]
    buf = index.table.buffer
    assert buf is not None
    for mine, theirs in zip(held, asked, strict=True):
        assert _native.index_set(buf, theirs, TIER_DRAM, 0, _native.index_locate(buf, mine)) == 1
    try:
        assert index.table.find_many(asked).tolist() == refs.tolist()  # every one a hit
        got = index.find(asked)
        assert got[:n].tolist() == [0] * n  # the slot entries hold other keys
        assert int(got[n]) == int(refs[n])  # 16 bytes: the table's own key, no check
    finally:
        for key in asked:
            assert _native.index_remove(buf, key)
    assert index.find(held).tolist() == refs.tolist()
    assert index.find(asked).tolist() == [0] * (n + 1)
