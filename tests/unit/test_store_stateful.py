"""A Hypothesis state machine driving the Store over real segments against a plain-dict model.

Two namespaces with different block sizes share a pool small enough that
eviction and cross-namespace reclaim happen all the time; three sessions
reserve, commit, abort, acquire, release, delete, close/reopen and let things
expire under a fake clock.

The model is exact: the store's ``on_evict`` hook reports every eviction (the
one way a DRAM block may leave), and each report is checked against the model
(the block must be committed and unpinned) before the model drops it.  So
after every step lookups must agree with the model key for key, every leased
block must still be present with its bytes intact, and ``check()`` is clean.

Two rules go beyond the API.  ``restart`` is a SIGKILL of the daemon: the
store is dropped without any cleanup and a new one recovers the shm directory;
the model keeps exactly its committed, undeleted blocks (every one must read
back with its bytes), leases and reservations are gone, the slots that were
RESERVED stay quarantined for a reservation TTL, sessions are opened again.
``inject_failure`` makes the k-th fallible call of one random operation raise
(a Segment slot-table call, ``unlink`` or the extent factory, as in
test_store_failures.py): the operation must raise and leave the model as it
was, but for what kvtierd.store documents as staying (a reserve's reclaim of
another namespace's extent, reported as evictions; extents removed by a
reclaim that failed part-way, whose blocks are gone at the next restart).

``StoreProgressMachine`` adds a liveness rule: when nothing is leased or
reserved anywhere, a reserve of one new key must succeed (the budget can move
between namespaces).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import os
import shutil
from collections.abc import Sequence
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from kvtier import _native
from kvtier.errors import CapacityExhausted, InvalidArgument, NotFound
from kvtierd.block_table import BlockTable
from kvtierd.recovery import recover
from kvtierd.segments import Segment, SegmentLayout
from kvtierd.store import Block, Namespace, ReserveStatus, SlotGrant, Store

from .conftest import BOOT_EPOCH, PEER, FakeClock, make_shm_dir, segment_factory
from .test_store_failures import FALLIBLE, SEGMENT_FALLIBLE, Faults, Injected, counted

KiB = 1 << 10
#: Two namespaces, different block sizes: 3 slots per A extent, 2 per B extent.
NAMESPACES = {"A": 16 * KiB, "B": 24 * KiB}
#: About four extents in all (13 A slots or 9 B slots), fewer than the 2 x 16 keys,
#: so eviction is routine and the namespaces must take budget from each other.
CAPACITY = 256 * KiB
EXTENT = 64 * KiB
#: Sessions by slot: two in A, one in B (a closed one is reopened in place).
SESSION_NS = ["A", "A", "B"]
N_KEYS = 16
#: The same key bytes in both namespaces: isolation is part of what is checked.
UNIVERSE = [f"key-{i:02d}".encode() for i in range(N_KEYS)]
PROBE_KEY = b"probe"
RESERVATION_TTL = 5.0
LEASE_TTL = 12.0

RESERVED, EXISTS, IN_FLIGHT = ReserveStatus.RESERVED, ReserveStatus.EXISTS, ReserveStatus.IN_FLIGHT

key_sets = st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=8, unique=True)
sessions = st.integers(0, len(SESSION_NS) - 1)


def pattern(tag: int, length: int) -> bytes:
    unit = f"<{tag}>".encode()
    return (unit * (length // len(unit) + 1))[:length]


@dataclasses.dataclass(eq=False)
class MBlock:
    """The model of one committed block (identity = one commit)."""

    ns: str
    key: bytes
    tag: int
    length: int
    checksum: int | None


@dataclasses.dataclass(eq=False)
class MReservation:
    rid: int
    slot: int  # session slot
    ns: str
    keys: list[bytes]
    grants: list[SlotGrant]
    lengths: list[int]
    tags: list[int]
    expires: float


@dataclasses.dataclass(eq=False)
class MLease:
    lid: int
    slot: int
    blocks: list[MBlock]
    grants: list[SlotGrant]
    expires: float


class StoreMachine(RuleBasedStateMachine):
    #: Whether the liveness rule runs (see StoreProgressMachine).
    check_progress = False

    def __init__(self) -> None:
        super().__init__()
        self.dir = make_shm_dir()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock()
        self.evicted: list[Block] = []
        self.quarantine: list[tuple[str, float, int]] = []  # (namespace, until, slots)
        # Every fallible table and Segment call (and the extent factory) counts while armed.
        self.faults = Faults()
        self._unpatched = [(cls, name, cls.__dict__[name])
                           for cls, names in ((BlockTable, FALLIBLE), (Segment, SEGMENT_FALLIBLE))
                           for name in names]
        for cls, name, real in self._unpatched:
            setattr(cls, name, counted(self.faults, name, real))
        try:
            self.store = self._new_store()
            self.sessions = self._open_sessions()
        except BaseException:  # no teardown then: leave the classes as they were
            for cls, name, real in self._unpatched:
                setattr(cls, name, real)
            raise
        self.committed: dict[tuple[str, bytes], MBlock] = {}
        self.reservations: dict[int, MReservation] = {}
        self.leases: dict[int, MLease] = {}
        self.ended_leases: list[tuple[int, int]] = []  # (session slot, lease id)
        self.tags = itertools.count(1)
        self.restarts = 0
        self.evictions_applied: list[tuple[str, bytes]] = []

    def _new_store(self) -> Store:
        real = segment_factory(self.dir)

        def factory(ns: Namespace, index: int, layout: SegmentLayout, seg_id: int) -> Segment:
            self.faults.hit("extent factory")
            return real(ns, index, layout, seg_id)

        return Store(
            capacity=CAPACITY,
            extent_size=EXTENT,
            extent_factory=factory,
            lease_ttl=LEASE_TTL,
            reservation_ttl=RESERVATION_TTL,
            boot_epoch=BOOT_EPOCH,
            clock=self.clock,
            on_evict=self.evicted.append,
            publish=True,  # check() also cross-checks each namespace's shared index
        )

    def _open_sessions(self) -> list[Any]:
        return [self.store.open_session(ns, NAMESPACES[ns], f"uid-{ns}", PEER)
                for ns in SESSION_NS]

    def teardown(self) -> None:
        try:
            for cls, name, real in self._unpatched:
                setattr(cls, name, real)
            self.loop.run_until_complete(self.store.drain())
            self.store.close_all()
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
        finally:
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ helpers
    def _reserve(self, slot: int, keys: Sequence[bytes]) -> Any:
        async def go() -> Any:
            try:
                return await self.store.reserve(self.sessions[slot], keys)
            finally:
                await self.store.drain()

        extents = {id(e) for ns in self.store.namespaces.values() for e in ns.extents}
        try:
            return self.loop.run_until_complete(go())
        finally:
            if self.evicted:
                event("reserve evicted")
            if any(id(e) not in extents for ns in self.store.namespaces.values()
                   for e in ns.extents):
                event("reserve grew an extent")
            if any(b.ns.name != self.sessions[slot].ns.name for b in self.evicted):
                event("reserve reclaimed another namespace's extent")
            self._take_evictions()

    def _take_evictions(self) -> None:
        """Apply the store's eviction reports to the model, checking each one is allowed."""
        pinned = self._pinned()
        for block in self.evicted:
            mb = self.committed.get((block.ns.name, block.key))
            assert mb is not None, f"evicted {block.ns.name}/{block.key!r}, which is not committed"
            assert mb not in pinned, f"evicted leased block {block.ns.name}/{block.key!r}"
            del self.committed[(block.ns.name, block.key)]
            self.evictions_applied.append((block.ns.name, block.key))
        self.evicted.clear()

    def _pinned(self) -> set[MBlock]:
        return {b for lease in self.leases.values() for b in lease.blocks}

    def _segment(self, segment_id: int) -> Any:
        for ns in self.store.namespaces.values():
            for ext in ns.extents:
                if ext.segment.segment_id == segment_id:
                    return ext.segment
        raise AssertionError(f"segment {segment_id} of a live grant is gone")

    def _write(self, grant: SlotGrant, data: bytes) -> None:
        seg = self._segment(grant.segment_id)
        with seg.data_view(grant.offset // seg.layout.slot_bytes, len(data)) as view:
            view[:] = data

    def _read(self, grant: SlotGrant) -> bytes:
        seg = self._segment(grant.segment_id)
        with seg.data_view(grant.offset // seg.layout.slot_bytes, grant.length) as view:
            return bytes(view)

    def _verify_lease(self, lease: MLease) -> None:
        for mb, grant in zip(lease.blocks, lease.grants, strict=True):
            assert (grant.length, grant.checksum) == (mb.length, mb.checksum)
            assert self._read(grant) == pattern(mb.tag, mb.length), (
                f"leased block {mb.ns}/{mb.key!r} was overwritten"
            )

    def _end_lease(self, lid: int) -> None:
        lease = self.leases.pop(lid)
        self.ended_leases.append((lease.slot, lid))

    def _usable_slots(self, ns: str) -> int:
        """Own slots neither reserved nor pinned: a reserve of this many must succeed."""
        total = sum(e.n_slots for e in self.store.namespaces[ns].extents)
        reserved = sum(len(r.keys) for r in self.reservations.values() if r.ns == ns)
        reserved += sum(q for name, _, q in self.quarantine if name == ns)
        leased = sum(1 for b in self._pinned() if b.ns == ns)
        return total - reserved - leased

    # ------------------------------------------------------------ write path
    @rule(slot=sessions, keys=key_sets, data=st.data())
    def reserve(self, slot: int, keys: list[bytes], data: st.DataObject) -> None:
        ns = SESSION_NS[slot]
        in_flight = {k for r in self.reservations.values() if r.ns == ns for k in r.keys}
        expected = [EXISTS if (ns, k) in self.committed else IN_FLIGHT if k in in_flight
                    else RESERVED for k in keys]
        new = [k for k, s in zip(keys, expected, strict=True) if s == RESERVED]
        usable = self._usable_slots(ns)
        n_res = self.store.reservation_count
        try:
            res = self._reserve(slot, keys)
        except CapacityExhausted:
            event("reserve: CapacityExhausted")
            assert new, "CapacityExhausted for a reserve that needs no slot"
            assert len(new) > usable, (
                f"CapacityExhausted for {len(new)} keys with {usable} own slots neither "
                "reserved nor leased"
            )
            assert self.store.reservation_count == n_res
            return
        assert res.statuses == expected
        assert len(res.slots) == len(new)
        if not new:
            assert res.reservation_id == 0
            return
        block_bytes = NAMESPACES[ns]
        lengths = [data.draw(st.integers(1, block_bytes), label="length") for _ in new]
        tags = [next(self.tags) for _ in new]
        for grant, length, tag in zip(res.slots, lengths, tags, strict=True):
            assert grant.length == block_bytes
            self._write(grant, pattern(tag, length))
        self.reservations[res.reservation_id] = MReservation(
            res.reservation_id, slot, ns, new, list(res.slots), lengths, tags,
            self.clock() + RESERVATION_TTL,
        )

    @rule(slot=sessions, keys=key_sets, data=st.data(), with_checksums=st.booleans())
    def put(self, slot: int, keys: list[bytes], data: st.DataObject,
            with_checksums: bool) -> None:
        """Reserve and commit at once (the common client path; keeps the pool full)."""
        before = set(self.reservations)
        self.reserve(slot, keys, data)
        for rid in set(self.reservations) - before:
            self._commit(rid, with_checksums)

    @rule(slot=sessions, keys=st.lists(st.sampled_from(UNIVERSE), min_size=6, max_size=N_KEYS,
                                       unique=True), data=st.data())
    def reserve_a_burst(self, slot: int, keys: list[bytes], data: st.DataObject) -> None:
        """A big prompt: often more than the pool can give, so it must take from the other
        namespace or fail cleanly."""
        self.reserve(slot, keys, data)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data(), with_checksums=st.booleans())
    def commit(self, data: st.DataObject, with_checksums: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reservations)), label="reservation")
        self._commit(rid, with_checksums)

    def _commit(self, rid: int, with_checksums: bool) -> None:
        r = self.reservations[rid]
        sums = [t * 2654435761 % 2**64 for t in r.tags] if with_checksums else None
        assert self.store.commit(self.sessions[r.slot], rid, r.lengths, sums) == len(r.keys)
        del self.reservations[rid]
        for i, (k, length, tag) in enumerate(zip(r.keys, r.lengths, r.tags, strict=True)):
            assert (r.ns, k) not in self.committed
            self.committed[(r.ns, k)] = MBlock(r.ns, k, tag, length,
                                               sums[i] if sums is not None else None)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reservations)), label="reservation")
        r = self.reservations[rid]
        assert self.store.abort(self.sessions[r.slot], rid) == len(r.keys)
        del self.reservations[rid]

    @precondition(lambda self: self.reservations)
    @rule(data=st.data(), other=sessions)
    def commit_from_another_session_is_not_found(self, data: st.DataObject, other: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reservations)), label="reservation")
        r = self.reservations[rid]
        if other == r.slot:
            return
        try:
            self.store.commit(self.sessions[other], rid, r.lengths, None)
        except NotFound:
            pass
        else:
            raise AssertionError("another session committed a reservation it does not own")

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def commit_with_a_bad_length_changes_nothing(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reservations)), label="reservation")
        r = self.reservations[rid]
        bad = list(r.lengths)
        bad[-1] = data.draw(st.sampled_from([0, -1, NAMESPACES[r.ns] + 1]), label="bad length")
        try:
            self.store.commit(self.sessions[r.slot], rid, bad, None)
        except InvalidArgument:
            pass
        else:
            raise AssertionError(f"commit accepted length {bad[-1]}")

    # ------------------------------------------------------------ read path
    @rule(slot=sessions, keys=key_sets)
    def acquire(self, slot: int, keys: list[bytes]) -> None:
        ns = SESSION_NS[slot]
        prefix: list[MBlock] = []
        for k in keys:
            mb = self.committed.get((ns, k))
            if mb is None:
                break
            prefix.append(mb)
        got = self.store.acquire(self.sessions[slot], keys)
        assert len(got.slots) == len(prefix)
        if not prefix:
            assert got.lease_id == 0
            return
        lease = MLease(got.lease_id, slot, prefix, list(got.slots), self.clock() + LEASE_TTL)
        self._verify_lease(lease)
        self.leases[got.lease_id] = lease

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lid = data.draw(st.sampled_from(sorted(self.leases)), label="lease")
        lease = self.leases[lid]
        self._verify_lease(lease)
        self.store.release(self.sessions[lease.slot], lid)
        self._end_lease(lid)

    @precondition(lambda self: self.ended_leases)
    @rule(data=st.data())
    def release_of_an_ended_lease_is_not_found(self, data: st.DataObject) -> None:
        slot, lid = data.draw(st.sampled_from(self.ended_leases), label="ended lease")
        try:
            self.store.release(self.sessions[slot], lid)
        except NotFound:
            pass
        else:
            raise AssertionError(f"lease {lid} was released twice")

    @rule(slot=sessions, keys=key_sets)
    def lookup(self, slot: int, keys: list[bytes]) -> None:
        ns = SESSION_NS[slot]
        expected = 0
        for k in keys:
            if (ns, k) not in self.committed:
                break
            expected += 1
        assert self.store.lookup(self.sessions[slot], keys) == expected

    # ------------------------------------------------------------ delete, sessions, expiry
    @rule(slot=sessions, keys=key_sets)
    def delete(self, slot: int, keys: list[bytes]) -> None:
        ns = SESSION_NS[slot]
        expected = sum(1 for k in keys if (ns, k) in self.committed)
        assert self.store.delete(self.sessions[slot], keys) == expected
        for k in keys:
            self.committed.pop((ns, k), None)  # a leased one lives on in its lease only

    @rule(slot=sessions)
    def delete_every_key(self, slot: int) -> None:
        """An admin wiping a namespace (leased blocks are only hidden)."""
        self.delete(slot, list(UNIVERSE))

    @rule(slot=sessions)
    def close_and_reopen_session(self, slot: int) -> None:
        mine_res = [rid for rid, r in self.reservations.items() if r.slot == slot]
        mine_leases = [lid for lid, lease in self.leases.items() if lease.slot == slot]
        for lid in mine_leases:
            self._verify_lease(self.leases[lid])
        slots_returned = sum(len(self.reservations[rid].keys) for rid in mine_res)
        old = self.sessions[slot]
        assert self.store.close_session(old) == (slots_returned, len(mine_leases))
        assert self.store.close_session(old) == (0, 0)
        for rid in mine_res:
            del self.reservations[rid]
        for lid in mine_leases:
            self._end_lease(lid)
        ns = SESSION_NS[slot]
        self.sessions[slot] = self.store.open_session(ns, NAMESPACES[ns], f"uid-{ns}", PEER)

    @rule(dt=st.sampled_from([0.5, 2.0, 4.0, 5.0, 7.0, 13.0]))
    def advance_clock_and_expire(self, dt: float) -> None:
        self.clock.advance(dt)
        now = self.clock()
        stale_res = [rid for rid, r in self.reservations.items() if r.expires <= now]
        stale_leases = [lid for lid, lease in self.leases.items() if lease.expires <= now]
        for lid in stale_leases:
            self._verify_lease(self.leases[lid])
        expected: collections.Counter[str] = collections.Counter()
        for rid in stale_res:
            expected[self.reservations[rid].ns] += len(self.reservations[rid].keys)
        assert self.store.expire() == (expected, len(stale_leases))
        # An expired reservation's slots stay quarantined for another TTL (a late
        # writer may still be copying); the store releases due ones in the same call.
        self.quarantine = [(ns, until, n) for ns, until, n in self.quarantine if until > now]
        for rid in stale_res:
            r = self.reservations[rid]
            self.quarantine.append((r.ns, now + RESERVATION_TTL, len(r.keys)))
            del self.reservations[rid]
        for lid in stale_leases:
            self._end_lease(lid)

    # ------------------------------------------------------------ restart, failures
    @rule()
    def restart(self) -> None:
        """SIGKILL of the daemon: no cleanup, a new store recovers the directory."""
        # (retired extents' files are gone already; this only ends their unmapping)
        self.loop.run_until_complete(self.store.drain())
        old = self.store
        # Extents whose files a reclaim that failed part-way removed: gone at restart.
        lost: set[tuple[str, bytes]] = set()
        reserved: collections.Counter[str] = collections.Counter()
        for r in self.reservations.values():
            reserved[r.ns] += len(r.keys)
        for ns, _until, n in self.quarantine:
            reserved[ns] += n
        for ns in old.namespaces.values():
            for ext in ns.extents:
                if not os.path.exists(ext.segment.meta_path):
                    event("restart: an extent's files were gone")
                    lost |= {(ns.name, b.key) for b in ns.index.values() if b.extent is ext}
                    reserved[ns.name] -= len(ext.quarantine)
        old.close_all()  # what the kernel does for a killed process: unmap, keep the files
        self.store = self._new_store()
        report = recover(self.store, self.dir)
        assert report.problems == [] and report.dropped == [] and not report.dropped_slots
        self.restarts += 1
        event("restart: warm" if report.warm else "restart: cold")
        if self.restarts > 1:
            event("restart: twice or more")
        if any(n for _ns, _until, n in self.quarantine) or self.reservations:
            event("restart: with reserved slots")
        if self.leases:
            event("restart: with leases")
        # The model: committed and not deleted survives; leases and reservations do not,
        # and every slot that was RESERVED is quarantined for a reservation TTL.
        for key in lost:
            del self.committed[key]
        now = self.clock()
        self.quarantine = [(ns, now + RESERVATION_TTL, n) for ns, n in reserved.items() if n]
        self.reservations.clear()
        self.leases.clear()
        self.ended_leases.clear()
        self.sessions = self._open_sessions()
        assert {(ns, n) for ns, n in report.blocks.items() if n} == {
            (ns, n) for ns, n in collections.Counter(ns for ns, _ in self.committed).items()}
        for (ns, key), mb in self.committed.items():
            block = self.store.namespaces[ns].index[key]
            assert (block.length, block.checksum) == (mb.length, mb.checksum)
            with block.extent.segment.data_view(block.slot, block.length) as view:
                assert bytes(view) == pattern(mb.tag, mb.length), f"{ns}/{key!r} lost its bytes"

    #: Operations ``inject_failure`` may fail (each a rule that changes the model only
    #: once its one store call returned).
    FAILING_OPS = ("reserve", "acquire", "delete", "delete_every_key",
                   "close_and_reopen_session", "advance_clock_and_expire")

    @rule(data=st.data(), k=st.sampled_from([1, 1, 1, 2, 3]))
    def inject_failure(self, data: st.DataObject, k: int) -> None:
        """The k-th fallible call of one operation raises: the operation raises and the
        model stays as it was (but for documented reclaims, reported as evictions)."""
        ops = list(self.FAILING_OPS)
        if self.reservations:
            ops += ["commit", "abort"]
        if self.leases:
            ops += ["release"]
        op = data.draw(st.sampled_from(ops), label="failing operation")
        res, leases = set(self.reservations), set(self.leases)
        quarantine, committed = list(self.quarantine), dict(self.committed)
        n_evicted = len(self.evictions_applied)
        parked = self._quarantined()
        self.faults.arm(k)
        try:
            self._run(op, data)
        except Injected:
            event(f"inject_failure: {op} raised")
            assert (set(self.reservations), set(self.leases)) == (res, leases)
            assert self.quarantine == quarantine
            if op == "advance_clock_and_expire":
                self._take_partial_expiry(parked)
            # only a reserve's reclaim may have taken blocks, each reported as evicted
            gone = {key for key in committed if key not in self.committed}
            assert set(self.committed) <= set(committed)
            assert gone == set(self.evictions_applied[n_evicted:])
            assert all(self.committed[key] is mb for key, mb in committed.items()
                       if key in self.committed)
        else:
            event("inject_failure: the operation completed before its k-th call")
        finally:
            self.faults.disarm()

    def _quarantined(self) -> dict[str, int]:
        """The store's quarantined slots per namespace."""
        return {ns.name: sum(len(e.quarantine) for e in ns.extents)
                for ns in self.store.namespaces.values()}

    def _take_partial_expiry(self, parked: dict[str, int]) -> None:
        """An expiry sweep whose table call failed: each namespace's part (its due
        quarantine freed and its stale leases ended, in one call) is all or nothing,
        and the namespaces before the failing one are done (``Store.expire``); the
        reservations expire only once every part is.  Take in what the store did."""
        now = self.clock()
        for ns in NAMESPACES:
            stale = [lid for lid, lease in self.leases.items()
                     if lease.expires <= now and SESSION_NS[lease.slot] == ns]
            due = sum(n for name, until, n in self.quarantine if name == ns and until <= now)
            freed = parked.get(ns, 0) - self._quarantined().get(ns, 0)
            gone = [lid for lid in stale if lid not in self.store.state.leases]
            done = bool(gone) or freed > 0
            if done:
                event("inject_failure: expiry done in some namespaces only")
                assert len(gone) == len(stale) and freed >= due, (ns, gone, stale, freed, due)
                self.quarantine = [q for q in self.quarantine if not (q[0] == ns and q[1] <= now)]
                for lid in stale:
                    self._end_lease(lid)

    def _run(self, op: str, data: st.DataObject) -> None:
        """Run rule ``op`` with arguments that make it reach the store's writes often:
        present keys for acquire and delete, a session that holds something for close,
        a lease holding a deleted block (freed at its release) when there is one."""
        slot = data.draw(sessions, label="session")
        present = [k for ns, k in self.committed if ns == SESSION_NS[slot]]
        keys = data.draw(st.lists(st.sampled_from(present), min_size=1, max_size=4, unique=True)
                         if present else key_sets, label="keys")
        if op == "reserve":
            self.reserve(slot, data.draw(key_sets, label="keys"), data)
        elif op == "acquire":
            self.acquire(slot, keys)
        elif op == "delete":
            self.delete(slot, keys)
        elif op == "delete_every_key":
            self.delete_every_key(slot)
        elif op == "close_and_reopen_session":
            busy = sorted({r.slot for r in self.reservations.values()}
                          | {x.slot for x in self.leases.values()})
            self.close_and_reopen_session(data.draw(st.sampled_from(busy), label="busy")
                                          if busy else slot)
        elif op == "advance_clock_and_expire":
            self.advance_clock_and_expire(data.draw(st.sampled_from([5.0, 13.0]), label="dt"))
        elif op == "commit":
            self.commit(data, data.draw(st.booleans(), label="checksums"))
        elif op == "abort":
            self.abort(data)
        else:
            assert op == "release", op
            doomed = sorted(lid for lid, x in self.leases.items()
                            if any(self.committed.get((b.ns, b.key)) is not b for b in x.blocks))
            if doomed:
                lid = data.draw(st.sampled_from(doomed), label="lease of a deleted block")
                self._verify_lease(self.leases[lid])
                self.store.release(self.sessions[self.leases[lid].slot], lid)
                self._end_lease(lid)
            else:
                self.release(data)

    # ------------------------------------------------------------ liveness (opt-in)
    @precondition(lambda self: self.check_progress and not self.leases
                  and not self.reservations and not self.quarantine)
    @rule(slot=sessions)
    def one_key_fits_when_nothing_is_pinned(self, slot: int) -> None:
        try:
            res = self._reserve(slot, [PROBE_KEY])
        except CapacityExhausted as exc:
            raise AssertionError(
                f"nothing is leased or reserved anywhere, yet namespace {SESSION_NS[slot]} "
                f"cannot get one slot: {exc}"
            ) from None
        assert res.statuses == [RESERVED]
        self.store.abort(self.sessions[slot], res.reservation_id)

    # ------------------------------------------------------------ invariants
    @invariant()
    def store_checks_clean(self) -> None:
        assert self.store.check() == []

    @invariant()
    def lookups_agree_with_the_model(self) -> None:
        for slot, ns in ((0, "A"), (2, "B")):
            s = self.sessions[slot]
            present = [k for k in UNIVERSE if self.store.lookup(s, [k]) == 1]
            assert present == [k for k in UNIVERSE if (ns, k) in self.committed]
            # What a client reads in the shared index is the same.
            shared = self.store.namespaces[ns].index.shared
            assert shared is not None and shared.fd is not None
            table = shared._table.mm  # type: ignore[union-attr]
            assert [k for k in UNIVERSE if _native.index_lookup(table, [k]) == (b"\x01", True)] \
                == present
            # ... and where it says each block is, what a lease without a call reads.
            index = self.store.namespaces[ns].index
            for k in present:
                b = index[k]
                seg = b.extent.segment
                assert _native.index_locate(table, k) == (
                    seg.segment_id, b.slot, seg.slot_offset(b.slot), b.length, b.checksum)

    @invariant()
    def leases_pin_their_blocks(self) -> None:
        pins: collections.Counter[int] = collections.Counter()
        for lease in self.leases.values():
            for mb in lease.blocks:
                pins[id(mb)] += 1
        for mb in self._pinned():
            if self.committed.get((mb.ns, mb.key)) is mb:  # not deleted: still visible
                assert self.store.lookup(self.sessions[SESSION_NS.index(mb.ns)], [mb.key]) == 1
                assert self.store.namespaces[mb.ns].index[mb.key].pins == pins[id(mb)]

    @invariant()
    def counts_agree_with_the_model(self) -> None:
        assert self.store.reservation_count == len(self.reservations)
        assert self.store.lease_count == len(self.leases)
        for ns in NAMESPACES:
            n = self.store.namespaces[ns]
            assert n.reserved == sum(len(r.keys) for r in self.reservations.values()
                                     if r.ns == ns) + sum(q for name, _, q in self.quarantine
                                                          if name == ns)
            assert n.leased == sum(1 for b in self._pinned() if b.ns == ns)
        acct = self.store.dram_bytes()
        assert acct["free"] + acct["reserved"] + acct["committed"] == acct["total"] == CAPACITY
        assert acct["free"] >= 0
        assert self.store.dram_free() == acct["free"]  # (the demoter's cheap form)


StoreMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_store_against_a_dict_model = StoreMachine.TestCase


class StoreProgressMachine(StoreMachine):
    """The same machine plus: with nothing pinned anywhere, one new key always fits."""

    check_progress = True


StoreProgressMachine.TestCase.settings = settings(
    # cheap (~10 ms an example): the starvation it looks for needs a longer sequence
    # (the minimal one is test_store.py::test_reclaim_takes_extents_that_hold_no_blocks)
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_store_grants_capacity_when_nothing_is_pinned = StoreProgressMachine.TestCase
