"""The fast path: writes without a call (slots granted ahead in the session's page,
committed from its commit records) and what clients count without a call."""


from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.errors import (
    CapacityExhausted,
    Unauthenticated,
)
from kvtierd.access import Right
from kvtierd.counters import saturating_add
from kvtierd.segments import (
    MAX_KEY_BYTES,
)
from kvtierd.shared_index import (
    GRANT_TAKEN,
    GRANTS_N,
    HAS_SUM,
    LAST,
    CommitRecord,
    SessionPage,
)
from kvtierd.store.base import _grant_word, _NeedExtent, _Raced
from kvtierd.store.operations import Operations
from kvtierd.store.types import (
    GRANT_IDLE_SECONDS,
    Block,
    CommitResult,
    Commits,
    Extent,
    Namespace,
    PageCommits,
    ReserveResult,
    Session,
)

log = logging.getLogger(__name__)


class FastPath(Operations):
    """Grants, page commits and page counters."""

    # ------------------------------------------------ leases without a call (csrc/index.c)
    def attach_page(self, session: Session, page: SessionPage) -> None:
        """``session``'s client leases blocks without a call, with hazards in ``page``:
        no slot it names is reused until the page lets go of it or the session ends."""
        if session.closed:
            raise Unauthenticated("session is closed")
        session.ns.pages[session.id] = page

    # ------------------------------------------------ writes without a call (csrc/writes.c)
    def grant_limit(self, ns: Namespace) -> int:
        """Most slots a session of ``ns`` may hold granted ahead (``grant_bytes`` of them)."""
        return min(GRANTS_N, self.grant_bytes // ns.slot_bytes)

    def refill_grants(self, session: Session, want: int) -> int:
        """Reserve slots ahead for ``session``'s writer until it holds ``want`` (at most
        ``grant_limit``), named in its page: it fills and commits them without a call.
        Takes room as a reserve does (free slots; then, if the namespace may grow, -1:
        the writer's next Reserve call grows it; else evicts), but never grows nor
        waits: short when no more room can be made now.  Returns how many were granted
        (-1: none, the namespace should grow first)."""
        page = session.ns.pages.get(session.id)
        if page is None or not page.writes or session.closed or session.system:
            return 0
        ns = session.ns
        n = min(want, self.grant_limit(ns)) - len(session.grants)
        if n <= 0:
            return 0
        places: list[tuple[Extent, int, int]] = []
        for _round in range(3):
            try:
                places = self._claim(ns, n, may_grow=True, partial=True)
                break
            except _Raced:
                continue
            except _NeedExtent:
                return -1
            except CapacityExhausted:
                break
        held = session.grants
        entries = list(itertools.islice((i for i in range(GRANTS_N) if i not in held),
                                        len(places)))
        for i, place in zip(entries, places, strict=True):
            ext, slot, _gen = place
            session.grants[i] = place
            page.set_grant(i, _grant_word(ext, slot))
        if places:
            session.grants_used = self._clock()
            self.granted[ns.name] += len(places)
        return len(places)

    async def reserve(
        self,
        session: Session,
        keys: Sequence[bytes],
        exists: Callable[[bytes], bool] | None = None,
    ) -> ReserveResult:
        """``Operations.reserve``; a writer with a page that had too few grants to write
        without this call gets more, right after (as many as its page asks for; never
        by growing the namespace: room ahead of use is taken only from what exists)."""
        result = await super().reserve(session, keys, exists)
        page = session.ns.pages.get(session.id)
        if page is not None and page.writes:
            asyncio.get_running_loop().call_soon(self._refill, session, page)
        return result

    def _refill(self, session: Session, page: SessionPage) -> None:
        self.refill_grants(session, page.wanted())

    def take_granted(self) -> collections.Counter[str]:
        """The slots granted ahead per namespace since the last call (metrics)."""
        granted, self.granted = self.granted, collections.Counter()
        return granted

    def commit_from_page(self, session: Session, page: SessionPage,
                         exists: Callable[[bytes], bool] | None = None) -> PageCommits:
        """The writes made without a call (``csrc/writes.c``), when ``session``'s client
        rings: commit the blocks its writer put in granted slots and named in its page
        (``commit_granted``), grant it slots for the next ones (as many as it asks,
        within the limit), then wake it.  Each record's result goes to the page, which
        the writer checks like an answer.  The rights are checked again: only writers
        get a page with a write area, but a session's rights are what it holds now."""
        out = PageCommits()
        records = page.take_commits()
        if records is None:  # an impossible head: only a hostile page has one
            log.warning("session %d wrote an impossible commit ring head; records skipped",
                        session.id)
            return out
        out.records = len(records)
        if not records:
            page.finish_commits(b"")
            return out
        if not int(session.rights) & Right.WRITE:
            page.finish_commits(bytes([CommitResult.LOST]) * len(records))
            return out
        try:
            results, out.blocks = self.commit_granted(session, records, exists)
        except Exception:  # a bug, not the client's input: it still gets its answer
            log.exception("commit of %d records from session %d's page failed",
                          len(records), session.id)
            results = bytes([CommitResult.FAILED]) * len(records)
        out.committed = results.count(CommitResult.COMMITTED)
        out.nbytes = sum(r.length for r, code in zip(records, results, strict=True)
                         if code == CommitResult.COMMITTED)
        # A ring without records refills nothing (it costs a read).
        self.refill_grants(session, page.wanted())
        page.finish_commits(results)
        return out

    def commit_granted(
        self,
        session: Session,
        records: Sequence[CommitRecord],
        exists: Callable[[bytes], bool] | None = None,
    ) -> tuple[bytes, list[Block]]:
        """Commit the blocks ``session``'s writer put in granted slots: ``records`` as
        ``SessionPage.take_commits`` copied them out of its page (grant entry, grant
        word, key, length, checksum, flags), in batches that end with a ``LAST``
        record, each all or nothing.  A record whose word is not the grant the entry
        holds now (the writer filled a slot the daemon took back, and the entry was
        granted again since) is ``LOST``, never committed into the entry's new slot.
        Returns each record's ``CommitResult`` and the blocks made."""
        results = bytearray()
        made: list[Block] = []
        start = 0
        for end, rec in enumerate(records):
            if rec[5] & LAST or end == len(records) - 1:
                batch = records[start:end + 1]
                start = end + 1
                try:
                    codes, blocks = self._commit_batch(session, batch, exists)
                except (OSError, ValueError) as exc:  # a slot table that cannot be written
                    log.warning("commit of %d granted slots failed: %s", len(batch), exc)
                    codes, blocks = bytes([CommitResult.FAILED]) * len(batch), []
                results += codes
                made += blocks
        return bytes(results), made

    def _commit_batch(
        self,
        session: Session,
        batch: Sequence[CommitRecord],
        exists: Callable[[bytes], bool] | None,
    ) -> tuple[bytes, list[Block]]:
        ns = session.ns
        grants = session.grants
        n = len(batch)
        entries = {r[0] for r in batch}
        limit = ns.block_bytes
        if (len({r[2] for r in batch}) != n or len(entries) != n
                or not all(0 < len(r[2]) <= MAX_KEY_BYTES and 0 < r[3] <= limit for r in batch)):
            return bytes([CommitResult.INVALID]) * n, []
        if session.closed or not all(
                (place := grants.get(r[0])) is not None
                and _grant_word(place[0], place[1]) == r[1] for r in batch):
            return bytes([CommitResult.LOST]) * n, []
        in_flight = ns.in_flight
        present = ns.index.find([r[2] for r in batch])
        codes = bytearray(n)
        done: list[int] = []  # the grant entries committed, and their columns
        refs: list[int] = []
        gens: list[int] = []
        keys: list[bytes] = []
        lengths: list[int] = []
        sums: list[int | None] = []
        for i, (g, _word, key, length, raw_sum, flags) in enumerate(batch):
            if present[i] or key in in_flight or (exists is not None and exists(key)):
                codes[i] = CommitResult.EXISTS  # first writer wins; the grant stays
                continue
            codes[i] = CommitResult.COMMITTED
            ext, slot, gen = grants[g]
            done.append(g)
            refs.append(ext.segment.segment_id << 32 | slot)
            gens.append(gen)
            keys.append(key)
            lengths.append(length)
            sums.append(raw_sum if flags & HAS_SUM else None)
        commits = Commits(np.array(refs, dtype=np.uint64), np.array(gens, dtype=np.uint64),
                          keys, np.array(lengths, dtype=np.uint64), sums)
        made = self._commit(ns, commits)  # all or nothing (ValueError: nothing changed)
        # Applied: nothing below can fail.
        page = ns.pages.get(session.id)
        for g in done:
            del grants[g]
            session.grant_seen.pop(g, None)
            if page is not None:
                page.set_grant(g, 0)  # before DONE: the writer never sees it as its own again
        session.grants_used = self._clock()
        return bytes(codes), made

    def _sweep_grants(self, session: Session, now: float) -> list[int]:
        """Grants idle for ``GRANT_IDLE_SECONDS`` go back now.  Returns those a writer
        has held taken for the reservation TTL: expired like a reservation (the caller,
        ``expire``, quarantines them with the reservations)."""
        page = session.ns.pages.get(session.id)
        idle = now - session.grants_used >= GRANT_IDLE_SECONDS
        back: list[int] = []
        stale: list[int] = []
        for g, (ext, slot, _gen) in session.grants.items():
            word = _grant_word(ext, slot)
            current = page.grant_word(g) if page is not None else 0
            if current == word | GRANT_TAKEN:
                first = session.grant_seen.setdefault(g, now)
                if now - first >= self.reservation_ttl:
                    stale.append(g)
                continue
            session.grant_seen.pop(g, None)
            if idle and (page is None or page.revoke_grant(g, current)):
                back.append(g)
        self._end_grants(session, back)
        return stale

    def idle_grants(self) -> dict[str, int]:
        """Per namespace, the slots granted ahead that no writer has taken yet: room held
        for the next writes, not being written.  Stats and metrics show them apart from
        the reserved slots (a taken grant is a reservation; the page's TAKEN bit says
        which, and a client that lies about it only changes these figures)."""
        out: dict[str, int] = {}
        for s in self.sessions.values():
            idle = len(s.grants) - self._taken_grants(s)
            if idle:
                out[s.ns.name] = out.get(s.ns.name, 0) + idle
        return out

    def count_reads(self, ns: Namespace, hits: int, misses: int) -> None:
        """Add what ``ns``'s clients counted of their acquires without a call (bounded
        by the caller; the totals saturate)."""
        ns.hits = saturating_add(ns.hits, hits)
        ns.misses = saturating_add(ns.misses, misses)
