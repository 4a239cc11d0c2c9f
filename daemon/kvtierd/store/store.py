"""The store put together: ``Store`` holds its parts (each made by its constructor, each
given the parts it uses) and hands each call to the part that owns it; and what spans
the parts: expiry, accounting, ``check``.

The parts (``kvtierd.store``'s docstring tells the whole):

* ``state`` (``StoreState``): namespaces, sessions, reservations, leases; pins; the one
  commit transition.
* ``budget`` (``Budget``): the DRAM budget, growth, extents added and retired.
* ``room`` (``Allocator``): claims (free slots, eviction, reclaim); the one exit.
* ``calls`` (``Operations``): the calls with a call.
* ``fast_path`` (``FastPath``): grants, commit rings, page counters.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvtierd.logs import event
from kvtierd.segments import Segment
from kvtierd.shared_index import PageRecords, SessionPage
from kvtierd.store.allocator import Allocator
from kvtierd.store.base import ExtentFactory, Pinned, StoreOptions, _refs
from kvtierd.store.budget import Budget
from kvtierd.store.check import CheckSnapshot, _cross_check, take_snapshot
from kvtierd.store.fast_path import FastPath
from kvtierd.store.grants import HeldBelow
from kvtierd.store.operations import Operations
from kvtierd.store.state import StoreState
from kvtierd.store.types import (
    AcquireResult,
    Block,
    BlockBatch,
    Extent,
    Lease,
    Lower,
    Namespace,
    PageCommits,
    Peer,
    ReserveResult,
    Session,
    U64s,
)

log = logging.getLogger(__name__)

#: A store made without options (tests, benchmarks) has these (frozen: one serves all).
_NO_OPTIONS = StoreOptions()


class Store:
    """Block tables, key indexes, reservations and leases over the DRAM extents (see the
    package docstring).  A previous run's extents are adopted by the functions of
    ``kvtierd.store.adoption`` (start-up only).

    All methods run on the event loop thread; the only awaits are extent
    creation/retirement (blocking I/O sent to an executor).  Each call's contract
    (what it does, what it raises) is the docstring of the part's method it hands on to.
    """

    def __init__(
        self,
        *,
        capacity: int,
        extent_size: int,
        extent_factory: ExtentFactory,
        lease_ttl: float,
        reservation_ttl: float,
        boot_epoch: int,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[Block], None] | None = None,
        on_evicted: Callable[[str, int], None] | None = None,
        publish: bool = False,
        grant_bytes: int = 0,
        options: StoreOptions = _NO_OPTIONS,
    ) -> None:
        self.options = options
        self.capacity = capacity
        self.state = StoreState(lease_ttl=lease_ttl, reservation_ttl=reservation_ttl,
                                boot_epoch=boot_epoch, clock=clock, publish=publish,
                                options=options)
        self.budget = Budget(self.state, capacity=capacity, extent_size=extent_size,
                             extent_factory=extent_factory,
                             retired_grace=max(reservation_ttl, lease_ttl), options=options)
        self.room = Allocator(self.state, self.budget, options=options, on_evict=on_evict,
                              on_evicted=on_evicted)
        self.calls = Operations(self.state, self.budget, self.room, capacity=capacity)
        self.fast_path = FastPath(self.state, self.budget, self.room, grant_bytes=grant_bytes)

    # ------------------------------------------------ told once the store exists
    def attach_tiering(self, *, spill: bool, commit_handles: bool) -> None:
        """Told by the tiering layer, which is built over the store (so not a constructor
        option): ``spill``, a spill tier exists (evict only non-DIRTY blocks, and a miss
        in a shared index is not final: the key may be below DRAM); ``commit_handles``,
        page commits return handles of the blocks they made (only for a write-through
        publish: a handle per block costs)."""
        self.state.set_lower_tiers(spill, commit_handles)

    def attach_cluster(self, on_extent: Callable[[Segment], None]) -> None:
        """Tell ``on_extent`` of every extent added from now on (the cluster tier maps it
        into its agent; called on the event loop, so it must not block).  A method, not
        a constructor option: the cluster tier is made after the store, whose live
        segments it maps."""
        self.budget.on_extent = on_extent

    def set_recovery_report(self, seconds: float, dropped: Sequence[str]) -> None:
        """Recovery's figures (Stats, metrics): the time it took and the segments it
        dropped.  A method, not a constructor option: recovery adopts into the store, so
        its figures exist only once the store does."""
        self.state.recovery_seconds = seconds
        self.state.dropped_segments = list(dropped)

    def watch(self, changed: Callable[[str, str, list[bytes], bool], None] | None) -> None:
        """``StoreState.watch``: every key into or out of DRAM (the KV events)."""
        self.state.watch(changed)

    def note_prefault(self, seconds: float, mlock_error: str | None) -> None:
        """An adopted extent was locked and pre-faulted after start-up (``app``): its
        time and its mlock error, if any, count with those of created extents."""
        self.budget.prefault_seconds += seconds
        if mlock_error is not None:
            self.budget.mlock_errors.append(mlock_error)

    # ------------------------------------------------ the parts' figures
    @property
    def namespaces(self) -> dict[str, Namespace]:
        return self.state.namespaces

    @property
    def sessions(self) -> dict[int, Session]:
        return self.state.sessions

    @property
    def spill_enabled(self) -> bool:
        """A spill tier exists (``attach_tiering``): evict only non-DIRTY blocks (and a
        miss in a shared index is not final: the key may be below DRAM)."""
        return self.state.spill_enabled

    @property
    def lease_ttl(self) -> float:
        return self.state.lease_ttl

    @property
    def reservation_ttl(self) -> float:
        return self.state.reservation_ttl

    @property
    def boot_epoch(self) -> int:
        return self.state.boot_epoch

    @property
    def prefetched_reads(self) -> int:
        """Prefetched blocks first read without a call (tiering counts those read by calls)."""
        return self.state.prefetched_reads

    @property
    def recovery_seconds(self) -> float:
        return self.state.recovery_seconds

    @property
    def dropped_segments(self) -> list[str]:
        return self.state.dropped_segments

    @property
    def budget_free(self) -> int:
        """Bytes of ``dram.capacity`` in no extent (``Budget.free_bytes``)."""
        return self.budget.free_bytes

    @property
    def growing_bytes(self) -> int:
        return self.budget.growing_bytes

    @property
    def grown_ahead(self) -> int:
        return self.budget.grown_ahead

    @property
    def mlock_errors(self) -> list[str]:
        return self.budget.mlock_errors

    @property
    def prefault_seconds(self) -> float:
        return self.budget.prefault_seconds

    @property
    def evictions(self) -> int:
        return self.room.evictions

    # ------------------------------------------------ the state's primitives
    def pinned(self, ns: Namespace) -> Pinned:
        return self.state.pinned(ns)

    def held_seconds(self, started: float) -> float:
        return self.state.held_seconds(started)

    def note_reads(self, ns: Namespace) -> None:
        self.state.note_reads(ns)

    def system_session(self, ns: Namespace) -> Session:
        return self.state.system_session(ns)

    def live_segments(self) -> list[Segment]:
        return self.state.live_segments()

    @staticmethod
    def segments(ns: Namespace) -> list[Segment]:
        return [e.segment for e in ns.extents]

    @staticmethod
    def slot_of(block: Block) -> int:
        return StoreState.slot_of(block)

    # ------------------------------------------------ extents (the budget's)
    def new_segment_id(self) -> int:
        return self.budget.new_segment_id()

    def add_extent(self, ns: Namespace, segment: Segment) -> None:
        self.budget.add_extent(ns, segment)

    async def stop_growth(self) -> None:
        await self.budget.stop_growth()

    async def drain(self) -> None:
        await self.budget.drain()

    # ------------------------------------------------ the calls (``Operations``)
    def open_session(self, name: str, block_bytes: int, model_uid: str, peer: Peer) -> Session:
        return self.calls.open_session(name, block_bytes, model_uid, peer)

    def session_for(self, token: str) -> Session:
        return self.calls.session_for(token)

    def close_session(self, session: Session) -> tuple[int, int]:
        return self.calls.close_session(session)

    def lookup(self, session: Session, keys: Sequence[bytes]) -> int:
        return self.calls.lookup(session, keys)

    async def reserve(self, session: Session, keys: Sequence[bytes],
                      exists: Callable[[bytes], bool] | None = None) -> ReserveResult:
        """``Operations.reserve``; then a writer with a page gets grants for its next
        writes (``FastPath.after_reserve``)."""
        result = await self.calls.reserve(session, keys, exists)
        self.fast_path.after_reserve(session)
        return result

    def commit(self, session: Session, reservation_id: int, lengths: U64s,
               checksums: U64s | None) -> int:
        return self.calls.commit(session, reservation_id, lengths, checksums)

    def abort(self, session: Session, reservation_id: int) -> int:
        return self.calls.abort(session, reservation_id)

    def acquire(self, session: Session, keys: Sequence[bytes]) -> AcquireResult:
        return self.calls.acquire(session, keys)

    def release(self, session: Session, lease_id: int) -> None:
        self.calls.release(session, lease_id)

    def delete(self, session: Session, keys: Sequence[bytes]) -> int:
        return len(self.calls.delete(session, keys))

    def delete_present(self, session: Session, keys: Sequence[bytes]) -> list[bytes]:
        """``delete``, answering the keys that were present (each once)."""
        return self.calls.delete(session, keys)

    def drop_lost(self, segment: Segment, intact_bytes: int) -> list[Block]:
        return self.calls.drop_lost(segment, intact_bytes)

    def evict_block(self, block: Block) -> bool:
        return self.room.evict_block(block)

    def reservation_slots(self, session: Session, reservation_id: int) -> list[memoryview]:
        return self.calls.reservation_slots(session, reservation_id)

    def settle(self, session: Session, reservation_id: int,
               outcomes: Sequence[tuple[int, int] | None]) -> list[Block | None]:
        return self.calls.settle(session, reservation_id, outcomes)

    def pin_blocks(self, blocks: BlockBatch) -> Lease:
        return self.calls.pin_blocks(blocks)

    def unpin(self, lease: Lease) -> None:
        self.calls.unpin(lease)

    def set_lower(self, block: Block, lower: Lower) -> None:
        self.calls.set_lower(block, lower)

    def set_lower_many(self, blocks: BlockBatch, lower: Lower) -> int:
        return self.calls.set_lower_many(blocks, lower)

    def demotion_candidates(self, target_bytes: int, limit: int) -> list[BlockBatch]:
        return self.calls.demotion_candidates(target_bytes, limit)

    # ------------------------------------------------ without a call (``FastPath``)
    def attach_page(self, session: Session, page: SessionPage) -> None:
        self.fast_path.attach_page(session, page)

    def grant_limit(self, ns: Namespace) -> int:
        return self.fast_path.grant_limit(ns)

    def grant_target(self, ns: Namespace, wanted: int) -> int:
        return self.fast_path.grant_target(ns, wanted)

    def refill_grants(self, session: Session, want: int, need: int | None = None) -> int:
        return self.fast_path.refill_grants(session, want, need)

    def take_granted(self) -> collections.Counter[str]:
        return self.fast_path.take_granted()

    def commit_from_page(self, session: Session, page: SessionPage,
                         exists: HeldBelow | None = None) -> PageCommits:
        return self.fast_path.commit_from_page(session, page, exists)

    def commit_granted(self, session: Session, records: PageRecords,
                       exists: HeldBelow | None = None) -> tuple[bytes, list[Block]]:
        return self.fast_path.commit_granted(session, records, exists)

    def idle_grants(self) -> dict[str, int]:
        return self.fast_path.idle_grants()

    def add_reported(self, ns: Namespace, steps: tuple[int, ...], *,
                     cut: bool = False) -> tuple[int, ...]:
        return self.fast_path.add_reported(ns, steps, cut=cut)

    # ------------------------------------------------ across the parts
    def close_all(self) -> None:
        """Unmap every segment, keeping the files (the warm-restart path re-attaches them);
        retired files still in their grace are cut now."""
        self.budget.cut_retired(everything=True)
        for ns in self.state.namespaces.values():
            self.state.unpublish(ns)
            ns.index.table.close()
            for ext in ns.extents:
                ns.table.remove_extent(ext.id, force=True)  # the table lets go of its mapping
                ext.segment.close(unlink=False)

    def expire(self) -> tuple[collections.Counter[str], int]:
        """The one expiry sweep (the daemon runs it every second).  Write pins past the
        reservation TTL -- reservations made by calls, and grants a writer has held
        taken that long -- end alike: their slots stay RESERVED (quarantined: the
        writer may still be copying) for another TTL, then are freed here.  Read pins
        past the lease TTL -- leases made by calls, and hazards in pages
        (``SessionPage.expire``) -- end alike: their slots may be reused.  The slot-table
        writes of these are all or (raising) nothing; idle grants go back first, each
        on its own (``GrantBook.sweep``).

        Returns (reserved slots returned per namespace, leases released).
        """
        now = self.state.clock()
        self.budget.cut_retired()
        for ns in self.state.namespaces.values():
            self.state.note_reads(ns)  # CLOCK hears of the reads made without a call
        stale_res = [r for r in self.state.reservations.values()
                     if r.expires <= now and not r.session.system]
        stale_grants = [(s, stale) for s in list(self.state.sessions.values())
                        if s.grants and (stale := s.grants.sweep(now, self.state.reservation_ttl))]
        due = [(ns, ext, slot) for ns in self.state.namespaces.values() for ext in ns.extents
               if ext.quarantine for slot, until in ext.quarantine.items() if until <= now]
        stale_leases = [lease for lease in self.state.leases.values()
                        if lease.expires <= now and not lease.session.system]
        # One table call per namespace: its due quarantine freed, its stale leases' pins
        # ended, each all or nothing; a namespace whose call fails expires at the next
        # sweep (and so does everything after it here).
        work: dict[int, tuple[Namespace, list[tuple[Extent, int]], list[Lease]]] = {}
        for ns, ext, slot in due:
            work.setdefault(id(ns), (ns, [], []))[1].append((ext, slot))
        for lease in stale_leases:
            work.setdefault(id(lease.ns), (lease.ns, [], []))[2].append(lease)
        for ns, places, leases in work.values():
            ns.table.release_claims(_refs(places), unpin=np.concatenate(
                [lease.refs for lease in leases]) if leases else None)
            for ext, slot in places:
                del ext.quarantine[slot]
            for lease in leases:
                del lease.session.leases[lease.id]
                del self.state.leases[lease.id]
        # Applied: nothing below can fail.
        granted = sum(len(stale) for _s, stale in stale_grants)
        if stale_res or granted:  # one line per sweep, however many expired (a storm)
            log.warning("%d reservations expired (ids %s%s) and %d granted slots were held "
                        "taken without a commit; their %d slots are quarantined for %.0f s",
                        len(stale_res), ", ".join(str(r.id) for r in stale_res[:5]),
                        ", ..." if len(stale_res) > 5 else "", granted,
                        sum(len(r.keys) for r in stale_res) + granted, self.state.reservation_ttl,
                        extra=event("reservations_expired", count=len(stale_res) + granted))
        until = now + self.state.reservation_ttl
        for res in stale_res:
            self.calls.expire_reservation(res, until)
        for session, stale in stale_grants:
            session.grants.end(stale, quarantine=until)
        # Leases made without a call: their hazards are zeroed (the slots are free to reuse).
        local = sum(page.expire(now, self.state.lease_ttl) for ns in self.state.namespaces.values()
                    for page in ns.pages.values())
        if stale_leases or local:
            log.warning("%d leases expired after %.0f s (%d made by calls: ids %s%s; %d "
                        "without a call)", len(stale_leases) + local, self.state.lease_ttl,
                        len(stale_leases), ", ".join(str(x.id) for x in stale_leases[:5]),
                        ", ..." if len(stale_leases) > 5 else "", local,
                        extra=event("leases_expired", count=len(stale_leases) + local))
        aborted: collections.Counter[str] = collections.Counter()
        for res in stale_res:
            aborted[res.session.ns.name] += len(res.keys)
        return (aborted, len(stale_leases) + local)

    @property
    def lease_count(self) -> int:
        """Leases held by clients, with or without a call (the tiering layer's own pins
        are not counted)."""
        local = sum(page.leases() for ns in self.state.namespaces.values()
                    for page in ns.pages.values())
        return local + self.call_lease_count

    @property
    def call_lease_count(self) -> int:
        """Leases held by clients through Acquire calls (the tiering layer's own pins are
        not counted): the daemon made each one.  (Those made without a call, as the
        daemon verifies them: ``kvtierd.lease_watch``.)"""
        return sum(1 for lease in self.state.leases.values() if not lease.session.system)

    def hazard_count(self) -> int:
        """Blocks clients lease without a call, as their pages say now."""
        return sum(len(self.state.pinned(ns).hazards) for ns in self.state.namespaces.values())

    def leased_blocks(self, ns: Namespace) -> int:
        """Blocks of ``ns`` leased, by calls or without (hazards)."""
        return self.state.pinned(ns).blocks()

    def local_reservations(self, session: Session) -> int:
        """Reservations ``session``'s client holds from grants (its page says; at most
        as many as it has grants taken)."""
        page = session.ns.pages.get(session.id)
        if page is None or not session.grants:
            return 0
        return min(page.local_reservations(), session.grants.taken())

    def local_leases(self, session: Session) -> int:
        """Leases ``session``'s client holds without a call."""
        page = session.ns.pages.get(session.id)
        return 0 if page is None else page.leases()

    @property
    def reservation_count(self) -> int:
        """Reservations open by clients, by call and from grants (promotions in flight
        are not counted)."""
        calls = sum(1 for r in self.state.reservations.values() if not r.session.system)
        return calls + sum(self.local_reservations(s) for s in self.state.sessions.values()
                           if s.grants)

    def dram_bytes(self, idle: dict[str, int] | None = None) -> dict[str, int]:
        """Tier accounting: total = free + reserved + granted + committed (bytes of
        slots); ``granted`` is the slots granted ahead and not taken (``idle_grants``,
        or ``idle`` when the caller has it), ``reserved`` the other reserved slots."""
        if idle is None:
            idle = self.idle_grants()
        spaces = self.state.namespaces
        granted = sum(n * spaces[name].slot_bytes for name, n in idle.items() if name in spaces)
        reserved = sum(ns.reserved * ns.slot_bytes for ns in spaces.values()) - granted
        committed = sum(ns.committed * ns.slot_bytes for ns in spaces.values())
        return {
            "total": self.capacity,
            "reserved": reserved,
            "granted": granted,
            "committed": committed,
            "free": self.dram_free(),
        }

    def dram_free(self) -> int:
        """Bytes of ``dram.capacity`` in no reserved, granted or committed slot (the
        split of reserved and granted, which walks the grants, does not change it):
        cheap enough for the demoter to ask after every commit."""
        spaces = self.state.namespaces.values()
        return self.capacity - sum((ns.reserved + ns.committed) * ns.slot_bytes
                                   for ns in spaces)

    def check(self) -> list[str]:
        """Cross-check the block tables and key indexes against the slot tables; the
        problems found.

        An empty list means: each block table agrees with its slot tables (states,
        free lists, counts: ``BlockTable.check``), the key index holds exactly the
        COMMITTED slots' keys, every RESERVED slot belongs to a reservation, a grant
        or the quarantine (at its generation), a DOOMED one is leased, pin counts
        equal the leases made by calls, in-flight keys are the open reservations'
        and the DRAM budget balances; each session's grant words (what the native commit
        check reads) are grants, as many as it counts.  (``check_from(check_snapshot())``: the
        same but the grant words, with the work off the loop.)
        """
        return _cross_check(self.check_snapshot()) + self._grant_word_problems()

    def _grant_word_problems(self) -> list[str]:
        problems = []
        for s in self.state.sessions.values():
            problems += [f"session {s.id}: {p}" for p in s.grants.problems()]
        return problems

    @staticmethod
    def check_from(snapshot: CheckSnapshot) -> list[str]:
        """``check()`` of a ``check_snapshot()``: reads nothing the store changes, so it
        runs in a worker thread (``loop.run_in_executor(None, store.check_from, snap)``)
        while the loop keeps serving; what it reports held when the snapshot was taken."""
        return _cross_check(snapshot)


    def check_snapshot(self) -> CheckSnapshot:
        """Copy what ``check_from`` cross-checks (``check.take_snapshot``: on the loop,
        compact native copies, no Python object per block), so the cross-check itself
        can run in a worker thread while the store keeps changing."""
        return take_snapshot(self.state, self.budget)
