"""The store put together, and what spans every layer: expiry, accounting, check."""

from __future__ import annotations

import asyncio
import collections
import logging

import numpy as np

from kvtier import _native
from kvtierd.logs import event
from kvtierd.store.base import _refs
from kvtierd.store.check import CheckSnapshot, _cross_check, _ExtentView, _NamespaceView
from kvtierd.store.fast_path import FastPath
from kvtierd.store.types import Extent, Lease, Namespace, Session

log = logging.getLogger(__name__)


class Store(FastPath):
    """Block tables, key indexes, reservations and leases over the DRAM extents (see the
    package docstring).  A previous run's extents are adopted by the functions of
    ``kvtierd.store.adoption`` (start-up only)."""

    async def drain(self) -> None:
        """Wait for extents being retired in the background."""
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    def close_all(self) -> None:
        """Unmap every segment, keeping the files (the warm-restart path re-attaches them);
        retired files still in their grace are cut now."""
        self._cut_retired(everything=True)
        for ns in self.namespaces.values():
            self._unpublish(ns)
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
        now = self._clock()
        self._cut_retired()
        for ns in self.namespaces.values():
            self.note_reads(ns)  # CLOCK hears of the reads made without a call
        stale_res = [r for r in self._reservations.values()
                     if r.expires <= now and not r.session.system]
        stale_grants = [(s, stale) for s in list(self.sessions.values())
                        if s.grants and (stale := s.grants.sweep(now, self.reservation_ttl))]
        due = [(ns, ext, slot) for ns in self.namespaces.values() for ext in ns.extents
               if ext.quarantine for slot, until in ext.quarantine.items() if until <= now]
        stale_leases = [lease for lease in self._leases.values()
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
                del self._leases[lease.id]
        # Applied: nothing below can fail.
        granted = sum(len(stale) for _s, stale in stale_grants)
        if stale_res or granted:  # one line per sweep, however many expired (a storm)
            log.warning("%d reservations expired (ids %s%s) and %d granted slots were held "
                        "taken without a commit; their %d slots are quarantined for %.0f s",
                        len(stale_res), ", ".join(str(r.id) for r in stale_res[:5]),
                        ", ..." if len(stale_res) > 5 else "", granted,
                        sum(len(r.keys) for r in stale_res) + granted, self.reservation_ttl,
                        extra=event("reservations_expired", count=len(stale_res) + granted))
        until = now + self.reservation_ttl
        for res in stale_res:
            self._expire_reservation(res, until)
        for session, stale in stale_grants:
            session.grants.end(stale, quarantine=until)
        # Leases made without a call: their hazards are zeroed (the slots are free to reuse).
        local = sum(page.expire(now, self.lease_ttl) for ns in self.namespaces.values()
                    for page in ns.pages.values())
        if stale_leases or local:
            log.warning("%d leases expired after %.0f s (%d made by calls: ids %s%s; %d "
                        "without a call)", len(stale_leases) + local, self.lease_ttl,
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
        local = sum(page.leases() for ns in self.namespaces.values()
                    for page in ns.pages.values())
        return local + sum(1 for lease in self._leases.values() if not lease.session.system)

    def hazard_count(self) -> int:
        """Blocks clients lease without a call, as their pages say now."""
        return sum(len(self.pinned(ns).hazards) for ns in self.namespaces.values())

    def leased_blocks(self, ns: Namespace) -> int:
        """Blocks of ``ns`` leased, by calls or without (hazards)."""
        return self.pinned(ns).blocks()

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
        calls = sum(1 for r in self._reservations.values() if not r.session.system)
        return calls + sum(self.local_reservations(s) for s in self.sessions.values()
                           if s.grants)

    def dram_bytes(self, idle: dict[str, int] | None = None) -> dict[str, int]:
        """Tier accounting: total = free + reserved + granted + committed (bytes of
        slots); ``granted`` is the slots granted ahead and not taken (``idle_grants``,
        or ``idle`` when the caller has it), ``reserved`` the other reserved slots."""
        if idle is None:
            idle = self.idle_grants()
        spaces = self.namespaces
        granted = sum(n * spaces[name].slot_bytes for name, n in idle.items() if name in spaces)
        reserved = sum(ns.reserved * ns.slot_bytes for ns in spaces.values()) - granted
        committed = sum(ns.committed * ns.slot_bytes for ns in spaces.values())
        return {
            "total": self.capacity,
            "reserved": reserved,
            "granted": granted,
            "committed": committed,
            "free": self.capacity - reserved - granted - committed,
        }

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
        for s in self.sessions.values():
            problems += [f"session {s.id}: {p}" for p in s.grants.problems()]
        return problems

    @staticmethod
    def check_from(snapshot: CheckSnapshot) -> list[str]:
        """``check()`` of a ``check_snapshot()``: reads nothing the store changes, so it
        runs in a worker thread (``loop.run_in_executor(None, store.check_from, snap)``)
        while the loop keeps serving; what it reports held when the snapshot was taken."""
        return _cross_check(snapshot)

    def check_snapshot(self) -> CheckSnapshot:
        """Copy what ``check_from`` cross-checks (on the loop: the block tables' own check,
        copies of lists and dicts, and compact native copies of the slot tables, the
        records and the key index -- ``check_rows``, ``index_rows``: 24 bytes a slot and a
        key, no Python object per block), so the cross-check itself can run in a worker
        thread while the store keeps changing."""
        leases = [(lease.ns.name, lease.refs.copy()) for lease in self._leases.values()]
        reservations = [(r.session.ns.name, r.keys, [(e.id, slot, gen) for e, slot, gen
                                                     in r.places])
                        for r in self._reservations.values()]
        reservations += [(s.ns.name, [], s.grants.places())
                         for s in self.sessions.values() if s.grants]
        namespaces = []
        for ns in self.namespaces.values():
            shared = ns.index.table
            extents = [_ExtentView(id=ext.id, index=ext.segment.index, n_slots=ext.n_slots,
                                   file_bytes=ext.bytes, quarantine=set(ext.quarantine),
                                   rows=ns.table.check_rows(ext.id),
                                   slot_bytes=ext.segment.layout.slot_bytes)
                       for ext in ns.extents]
            namespaces.append(_NamespaceView(
                name=ns.name, table_problems=ns.table.check(), in_flight=list(ns.in_flight),
                extents=extents, index_rows=shared.rows(),
                unpublished_rows=_native.fingerprint_rows(list(shared.unpublished)),
                slot_bytes=ns.slot_bytes))
        # An extent being made is out of the budget and in no extent yet: free, for this.
        return CheckSnapshot(namespaces=namespaces, leases=leases, reservations=reservations,
                             budget_free=self.budget_free + self.growing_bytes,
                             capacity=self.capacity)
