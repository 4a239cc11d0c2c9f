"""The fast path: writes without a call (slots granted ahead in the session's page,
committed from its commit records) and what clients count without a call.

What a grant is and every way it ends is ``kvtierd.store.grants`` (``Session.grants``,
a ``GrantBook``); this part decides when: it finds the room for a refill (a claim of the
allocator's, as a reserve does) and hands it to the book, and it answers a session's
commit ring, passing the book the store's one commit transition
(``StoreState.commit_slots``).  A component the store holds (``Store.fast_path``)."""


from __future__ import annotations

import asyncio
import collections
import logging
from typing import Final

import numpy as np
import numpy.typing as npt

from kvtier.errors import (
    CapacityExhausted,
    Unauthenticated,
)
from kvtierd.access import Right
from kvtierd.counters import ClientReported, saturating_add
from kvtierd.shared_index import GRANTS_N, PageRecords, SessionPage
from kvtierd.store import grants
from kvtierd.store.allocator import Allocator
from kvtierd.store.base import _NO_REFS, _NeedExtent, _Raced
from kvtierd.store.budget import Budget
from kvtierd.store.grants import CommitResult, HeldBelow
from kvtierd.store.state import StoreState
from kvtierd.store.types import (
    Block,
    Commits,
    Namespace,
    PageCommits,
    Session,
)

log = logging.getLogger(__name__)

_COMMITTED: Final = int(CommitResult.COMMITTED)
_WRITE: Final = int(Right.WRITE)
_LENGTH: Final = 3  # PageRecords.columns' row of lengths


class FastPath:
    """Grants, page commits and page counters (``Store`` hands each call on)."""

    def __init__(self, state: StoreState, budget: Budget, room: Allocator, *,
                 grant_bytes: int) -> None:
        self._state = state
        self._budget = budget
        self._room = room
        #: Bytes of slots each session with a write page may hold reserved ahead.
        self._grant_bytes = grant_bytes
        #: Slots granted ahead per namespace, since metrics last took them (``take_granted``).
        self.granted: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------ leases without a call (csrc/index.c)
    def attach_page(self, session: Session, page: SessionPage) -> None:
        """``session``'s client leases blocks without a call, with hazards in ``page``:
        no slot it names is reused until the page lets go of it or the session ends."""
        if session.closed:
            raise Unauthenticated("session is closed")
        if session.ns.reported is None:  # no client of it counted anything before
            session.ns.reported = ClientReported(self._state.clock())
        session.ns.pages[session.id] = page

    # ------------------------------------------------ writes without a call (csrc/writes.c)
    def grant_limit(self, ns: Namespace) -> int:
        """Most slots a session of ``ns`` may hold granted ahead (``grants.grant_limit``)."""
        return grants.grant_limit(self._grant_bytes, ns)

    def refill_grants(self, session: Session, want: int, need: int | None = None) -> int:
        """Reserve slots ahead for ``session``'s writer until it holds ``want`` (at most
        ``grant_limit``), named in its page: it fills and commits them without a call.
        Takes room as a reserve does (free slots; then, if the namespace may grow, -1:
        the writer's next Reserve call grows it; else evicts), but never grows nor
        waits: short when no more room can be made now.  With ``need`` (fewer than
        ``want``: what the writer's next put takes), the slots past it are only taken
        from free ones while the namespace would grow for them: a refill's batch never
        makes the namespace grow, what the writer needs may.  Returns how many were
        granted (-1: none, the namespace should grow first)."""
        page = session.ns.pages.get(session.id)
        if page is None or not page.writes or session.closed or session.system:
            return 0
        ns = session.ns
        limit = self.grant_limit(ns)
        n = min(want, limit) - len(session.grants)
        if n <= 0:
            return 0
        if need is not None and n > (free := ns.free_slots()) and not self._budget.at_quota(ns) \
                and self._budget.grows_first(ns):
            n = max(min(need, limit) - len(session.grants), free)
            if n <= 0:
                return 0
        refs: npt.NDArray[np.uint64] = _NO_REFS
        gens: npt.NDArray[np.uint64] = _NO_REFS
        for _round in range(3):
            try:
                refs, gens = self._room.claim_refs(ns, n, may_grow=True, partial=True,
                                                   ahead=False)
                break
            except _Raced:
                continue
            except _NeedExtent:
                return -1
            except CapacityExhausted:
                break
        if not len(refs):
            return 0
        session.grants.grant(page, refs, gens, self._state.clock())
        self.granted[ns.name] += len(refs)
        if self._budget.grow_ahead:  # for what the writer needs: the grants count as free room
            self._budget.start_ahead(ns, need if need is not None else len(refs))
        return len(refs)

    def after_reserve(self, session: Session) -> None:
        """After a Reserve call: a writer with a page that had too few grants to write
        without that call gets more, right after (as many as its page asks for; never
        by growing the namespace: room ahead of use is taken only from what exists)."""
        page = session.ns.pages.get(session.id)
        if page is not None and page.writes:
            asyncio.get_running_loop().call_soon(self._refill, session, page)

    def _refill(self, session: Session, page: SessionPage) -> None:
        if session.ns.pages.get(session.id) is not page:  # the session ended in between
            return
        wanted = page.wanted()
        self.refill_grants(session, self.grant_target(session.ns, wanted), wanted)

    def grant_target(self, ns: Namespace, wanted: int) -> int:
        """How many grants a writer that asks for ``wanted`` is given at a refill
        (``grants.grant_target``)."""
        return grants.grant_target(self.grant_limit(ns), ns, wanted)

    def take_granted(self) -> collections.Counter[str]:
        """The slots granted ahead per namespace since the last call (metrics)."""
        granted, self.granted = self.granted, collections.Counter()
        return granted

    def commit_from_page(self, session: Session, page: SessionPage,
                         exists: HeldBelow | None = None) -> PageCommits:
        """The writes made without a call (``csrc/writes.c``), when ``session``'s client
        rings: commit the blocks its writer put in granted slots and named in its page
        (a plain ring in one native call, ``GrantBook.commit_ring``; any other record
        by record, ``commit_granted``), wake it, and grant it slots for the next ones (as many as
        it asks, within the limit; before the answer when it holds fewer than it
        asks).  Each record's result goes to the page, which the writer checks like an
        answer.  The rights are checked again: only writers get a page with a write
        area, but a session's rights are what it holds now."""
        out = PageCommits()
        if session.rights & _WRITE:
            wanted = page.wanted()
            try:  # the plain ring in one native call, answered there when it can be
                # (the client's word, bounded: past GRANTS_N no ring is answered there)
                ring = session.grants.commit_ring(page, self._state.commit_ring,
                                                  self._state.clock, exists,
                                                  min(wanted, GRANTS_N + 1))
            except Exception:  # a bug, not the client's input: the ring is taken again below
                log.exception("native commit of session %d's ring failed", session.id)
                ring = None
            if ring is not None:
                out.records = out.committed = ring.n
                out.nbytes = ring.nbytes
                self._answer(session, page, None if ring.answered
                             else bytes([_COMMITTED]) * ring.n, wanted)
                return out
        records = page.take_commits(session.ns.block_bytes, session.grants.words)
        if records is None:  # an impossible head: only a hostile page has one
            log.warning("session %d wrote an impossible commit ring head; records skipped",
                        session.id)
            return out
        out.records = len(records)
        if not records:
            page.finish_commits(b"")
            return out
        if not session.rights & _WRITE:
            page.finish_commits(bytes([CommitResult.LOST]) * len(records))
            return out
        try:
            results, out.blocks = self.commit_granted(session, records, exists)
        except Exception:  # a bug, not the client's input: it still gets its answer
            log.exception("commit of %d records from session %d's page failed",
                          len(records), session.id)
            results = bytes([CommitResult.FAILED]) * len(records)
        self._answer(session, page, results, page.wanted())
        out.committed = results.count(_COMMITTED)
        if out.committed == len(records):
            out.nbytes = sum(records.columns[_LENGTH].tolist())
        elif out.committed:
            done = np.frombuffer(results, dtype=np.uint8) == _COMMITTED
            out.nbytes = int(records.columns[_LENGTH][done].sum())
        return out

    def _answer(self, session: Session, page: SessionPage, results: bytes | None,
                wanted: int) -> None:
        """Write a ring's answers and DONE, and refill the writer's grants (``wanted``: what
        its page asks for): after the answer when it still holds what its next put takes
        (the claim is then off its round trip), else before it.  ``results`` None: the
        native commit answered already (it holds enough), only the refill is left.  (A
        ring without records refills nothing: it costs a read.)"""
        target = self.grant_target(session.ns, wanted)
        if results is not None:
            if len(session.grants) < wanted:
                self.refill_grants(session, target, wanted)
            page.finish_commits(results)
        if session.grants.needs_refill(target, wanted):
            self.refill_grants(session, target, wanted)

    def commit_granted(
        self,
        session: Session,
        records: PageRecords,
        exists: HeldBelow | None = None,
    ) -> tuple[bytes, list[Block]]:
        """Commit the blocks ``session``'s writer put in granted slots (``records``, as
        ``SessionPage.take_commits`` copied and checked them): ``GrantBook.commit``
        through the store's one commit transition.  Returns each record's
        ``CommitResult`` and the blocks made."""
        ns = session.ns

        def commit(refs: npt.NDArray[np.uint64], gens: npt.NDArray[np.uint64],
                   keys: list[bytes], lengths: npt.NDArray[np.uint64],
                   checksums: list[int | None] | npt.NDArray[np.uint64] | None
                   ) -> list[Block]:
            return self._state.commit_slots(ns, Commits(refs, gens, keys, lengths, checksums))

        return session.grants.commit(records, commit, self._state.clock, exists)

    def idle_grants(self) -> dict[str, int]:
        """Per namespace, the slots granted ahead that no writer has taken yet: room held
        for the next writes, not being written.  Stats and metrics show them apart from
        the reserved slots (a taken grant is a reservation; the page's TAKEN bit says
        which, and a client that lies about it only changes these figures)."""
        return grants.idle_by_namespace(self._state.sessions.values())

    def add_reported(self, ns: Namespace, steps: tuple[int, ...], *,
                     cut: bool = False) -> tuple[int, ...]:
        """Add what ``ns``'s clients report of their lookups and acquires without a call
        since the last fold (``SessionPage.take``'s steps, summed over the pages) to
        the namespace's client-reported figures, never to the daemon's own: cut to
        what the host could have done since the last fold (``ClientReported.add``).
        ``cut``: a session's take already cut a step (counted as one cut).  Returns
        what was added."""
        if ns.reported is None:
            ns.reported = ClientReported(self._state.clock())
        added = ns.reported.add(steps, self._state.clock(), slots=ns.table.n_slots,
                                block_bytes=ns.block_bytes)
        if cut and added == tuple(max(s, 0) for s in steps):
            ns.reported.cut = saturating_add(ns.reported.cut, 1)
        return added

