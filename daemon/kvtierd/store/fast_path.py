"""The fast path: writes without a call (slots granted ahead in the session's page,
committed from its commit records) and what clients count without a call."""


from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from kvtier.errors import (
    CapacityExhausted,
    Unauthenticated,
)
from kvtierd.access import Right
from kvtierd.counters import ClientReported, saturating_add
from kvtierd.shared_index import (
    GRANT_TAKEN,
    GRANTS_N,
    PageRecords,
    SessionPage,
)
from kvtierd.store.base import _NO_REFS, _NeedExtent, _Raced
from kvtierd.store.operations import Operations
from kvtierd.store.types import (
    GRANT_IDLE_SECONDS,
    Block,
    CommitResult,
    Commits,
    Namespace,
    PageCommits,
    ReserveResult,
    Session,
)

log = logging.getLogger(__name__)

#: Which of some keys a tier below DRAM holds (``Below.held_below``): such a key is
#: EXISTS to a writer, as a DRAM block is.
HeldBelow = Callable[[Sequence[bytes]], list[bool]]

_COMMITTED: Final = int(CommitResult.COMMITTED)
_WRITE: Final = int(Right.WRITE)
_EXISTS: Final = int(CommitResult.EXISTS)
_LENGTH: Final = 3  # PageRecords.columns' row of lengths
_GRANT, _WORD = 0, 1  # ... of grant entries and of the words the writer took

#: A writer's grants are refilled in batches of at least this many slots (one claim,
#: one eviction plan for them all): refilling one slot per commit of one key cost a
#: claim per block, most of a 1-key commit's daemon CPU.
REFILL_BATCH = 32
#: ... within 1 / GRANT_SHARE of the namespace's slots (``grant_target``).
GRANT_SHARE = 16


class FastPath(Operations):
    """Grants, page commits and page counters."""

    # ------------------------------------------------ leases without a call (csrc/index.c)
    def attach_page(self, session: Session, page: SessionPage) -> None:
        """``session``'s client leases blocks without a call, with hazards in ``page``:
        no slot it names is reused until the page lets go of it or the session ends."""
        if session.closed:
            raise Unauthenticated("session is closed")
        if session.ns.reported is None:  # no client of it counted anything before
            session.ns.reported = ClientReported(self._clock())
        session.ns.pages[session.id] = page

    # ------------------------------------------------ writes without a call (csrc/writes.c)
    def grant_limit(self, ns: Namespace) -> int:
        """Most slots a session of ``ns`` may hold granted ahead (``grant_bytes`` of them)."""
        return min(GRANTS_N, self.grant_bytes // ns.slot_bytes)

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
        if need is not None and n > (free := ns.free_slots()) and not self._at_quota(ns) \
                and self._grows_first(ns):
            n = max(min(need, limit) - len(session.grants), free)
            if n <= 0:
                return 0
        refs: npt.NDArray[np.uint64] = _NO_REFS
        gens: npt.NDArray[np.uint64] = _NO_REFS
        for _round in range(3):
            try:
                refs, gens = self._claim_refs(ns, n, may_grow=True, partial=True,
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
        # The first free entries (no word: no grant) name the slots, ref | VALID.
        entries = session.grants.free_entries(len(refs))
        page.set_grants(entries, session.grants.add(entries, refs, gens))
        session.grants_used = self._clock()
        self.granted[ns.name] += len(refs)
        if self.grow_ahead:  # for what the writer needs: the grants count as free room
            self._grow_ahead(ns, need if need is not None else len(refs))
        return len(refs)

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
        wanted = page.wanted()
        self.refill_grants(session, self.grant_target(session.ns, wanted), wanted)

    def grant_target(self, ns: Namespace, wanted: int) -> int:
        """How many grants a writer that asks for ``wanted`` (its largest put: its
        next one must find as many) is given at a refill: four times that, at least
        ``REFILL_BATCH``, within ``grant_limit``.  A refill happens when it holds half
        of it or less (``_needs_refill``), so each claims a batch of at least two puts'
        worth, however small the puts (a claim's fixed cost -- the room plan, the
        eviction's index and table calls -- was most of a commit's), and a writer
        never holds fewer than it wants if it asks for no more than half the limit.
        Past what it wants, never more than ``1 / GRANT_SHARE`` of the namespace's
        slots: idle grants are room the cache does not use (a small namespace, or one
        at its quota, grants what the writer asks for and no batch)."""
        if wanted <= 0:
            return 0
        share = ns.table.n_slots // GRANT_SHARE
        return min(self.grant_limit(ns), max(4 * wanted, REFILL_BATCH), max(wanted, share))

    @staticmethod
    def _needs_refill(session: Session, target: int) -> bool:
        return len(session.grants) * 2 <= target and len(session.grants) < target

    def take_granted(self) -> collections.Counter[str]:
        """The slots granted ahead per namespace since the last call (metrics)."""
        granted, self.granted = self.granted, collections.Counter()
        return granted

    def commit_from_page(self, session: Session, page: SessionPage,
                         exists: HeldBelow | None = None) -> PageCommits:
        """The writes made without a call (``csrc/writes.c``), when ``session``'s client
        rings: commit the blocks its writer put in granted slots and named in its page
        (``commit_granted``), wake it, and grant it slots for the next ones (as many as
        it asks, within the limit; before the answer when it holds fewer than it
        asks).  Each record's result goes to the page, which the writer checks like an
        answer.  The rights are checked again: only writers get a page with a write
        area, but a session's rights are what it holds now."""
        out = PageCommits()
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
        # A ring without records refills nothing (it costs a read).  The refill comes
        # after the answer when the writer still holds what its next put takes (the
        # claim is then off its round trip), else before it; so does all but the answer.
        wanted = page.wanted()
        target = self.grant_target(session.ns, wanted)
        if len(session.grants) < wanted:
            self.refill_grants(session, target, wanted)
        page.finish_commits(results)
        if self._needs_refill(session, target):
            self.refill_grants(session, target, wanted)
        out.committed = results.count(_COMMITTED)
        if out.committed == len(records):
            out.nbytes = sum(records.columns[_LENGTH].tolist())
        elif out.committed:
            done = np.frombuffer(results, dtype=np.uint8) == _COMMITTED
            out.nbytes = int(records.columns[_LENGTH][done].sum())
        return out

    def commit_granted(
        self,
        session: Session,
        records: PageRecords,
        exists: HeldBelow | None = None,
    ) -> tuple[bytes, list[Block]]:
        """Commit the blocks ``session``'s writer put in granted slots: ``records`` as
        ``SessionPage.take_commits`` copied them out of its page (grant entry, grant
        word, key, length, checksum, flags) and checked them against the session's
        grants, in batches that end with a ``LAST`` record, each all or nothing.  A
        batch with a record that names no grant the session holds when the batch is
        committed is ``LOST`` whole, however it got there: the grant was committed
        (earlier in this ring or in an earlier one), taken back idle, expired, ended
        with the session, or never granted (an entry past the grant table, another
        session's or namespace's slot, an entry granted again since: never committed
        into the entry's new slot).  ``FAILED`` only when the daemon could not write
        its slot table (``docs/security.md``, "Record answers").  Returns each
        record's ``CommitResult`` and the blocks made."""
        results = bytearray()
        made: list[Block] = []
        # The native check compared every batch with the grants held when the ring was
        # taken; a batch that committed ended some of them, so the batches after it are
        # compared again with the grants held now (a grant committed earlier in this
        # ring and named again is LOST, never FAILED: the daemon did not fail).
        changed = False
        for lo, hi, refused in records.batches:
            if not refused and (session.closed or (
                    changed and not _still_held(session.grants.words, records, lo, hi))):
                refused = CommitResult.LOST
            if refused:
                results += bytes([refused]) * (hi - lo)
                continue
            try:
                codes, blocks = self._commit_batch(session, records, lo, hi, exists)
            except (OSError, ValueError) as exc:  # a slot table that cannot be written
                log.warning("commit of %d granted slots failed: %s", hi - lo, exc)
                codes, blocks = bytes([CommitResult.FAILED]) * (hi - lo), []
            changed = changed or _COMMITTED in codes  # some committed: their grants ended
            results += codes
            made += blocks
        return bytes(results), made

    def _commit_batch(
        self,
        session: Session,
        records: PageRecords,
        lo: int,
        hi: int,
        exists: HeldBelow | None,
    ) -> tuple[bytes, list[Block]]:
        """One batch, records[lo:hi], that the native check let through, all or nothing:
        each new key COMMITTED (a key present, being written, or in a lower tier is
        EXISTS: first writer wins, its grant stays)."""
        ns = session.ns
        whole = lo == 0 and hi == len(records)
        keys = records.keys if whole else records.keys[lo:hi]
        cols = records.columns if whole else records.columns[:, lo:hi]
        # (Python lists, not numpy reductions, for the flags: a batch is often 1 key.)
        new = (ns.index.find(keys) == 0).tolist()
        in_flight = ns.in_flight
        if in_flight:
            for i, key in enumerate(keys):
                if new[i] and key in in_flight:
                    new[i] = False
        if exists is not None and (ask := [i for i, f in enumerate(new) if f]):
            # One question about the batch's new keys (the tiers' batch lookups).
            below = exists(keys if len(ask) == len(keys) else [keys[i] for i in ask])
            for i, held in zip(ask, below, strict=True):
                if held:
                    new[i] = False
        if all(new):
            codes = bytes([_COMMITTED]) * (hi - lo)
        else:
            codes = bytes(_COMMITTED if f else _EXISTS for f in new)
            if not any(new):
                return codes, []
            cols = np.ascontiguousarray(cols[:, np.array(new)])  # (a mask: Fortran order)
            keys = [k for k, f in zip(keys, new, strict=True) if f]
        entries, _words, refs, lengths, sums, has = cols
        flags = has.tolist()
        checksums: list[int | None] | npt.NDArray[np.uint64] | None = (
            sums if all(flags) else None if not any(flags) else
            [c if h else None for c, h in zip(sums.tolist(), flags, strict=True)])
        grants = session.grants
        made = self._commit(ns, Commits(refs, grants.gens[entries], keys, lengths, checksums))
        # Applied (ValueError above: nothing changed); nothing below can fail.
        grants.drop(entries)
        if seen := session.grant_seen:
            for g in entries.tolist():
                seen.pop(g, None)
        page = ns.pages.get(session.id)
        if page is not None:  # before DONE: the writer never sees them as its own again
            page.set_grants(entries, np.zeros(len(entries), dtype=np.uint64))
        session.grants_used = self._clock()
        return codes, made

    def _sweep_grants(self, session: Session, now: float) -> list[int]:
        """Grants idle for ``GRANT_IDLE_SECONDS`` go back now.  Returns those a writer
        has held taken for the reservation TTL: expired like a reservation (the caller,
        ``expire``, quarantines them with the reservations)."""
        page = session.ns.pages.get(session.id)
        idle = now - session.grants_used >= GRANT_IDLE_SECONDS
        back: list[int] = []
        stale: list[int] = []
        words = session.grants.words
        for g in session.grants:
            word = int(words[g])
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

    def add_reported(self, ns: Namespace, steps: tuple[int, ...], *,
                     cut: bool = False) -> tuple[int, ...]:
        """Add what ``ns``'s clients report of their lookups and acquires without a call
        since the last fold (``SessionPage.take``'s steps, summed over the pages) to
        the namespace's client-reported figures, never to the daemon's own: cut to
        what the host could have done since the last fold (``ClientReported.add``).
        ``cut``: a session's take already cut a step (counted as one cut).  Returns
        what was added."""
        if ns.reported is None:
            ns.reported = ClientReported(self._clock())
        added = ns.reported.add(steps, self._clock(), slots=ns.table.n_slots,
                                block_bytes=ns.block_bytes)
        if cut and added == tuple(max(s, 0) for s in steps):
            ns.reported.cut = saturating_add(ns.reported.cut, 1)
        return added


def _still_held(words: npt.NDArray[np.uint64], records: PageRecords, lo: int, hi: int) -> bool:
    """Whether every record of records[lo:hi] names the grant its entry holds now
    (``words``: the session's grant words; the native check made sure the entries are
    in range)."""
    cols = records.columns
    if hi - lo <= 8:  # (numpy's fancy indexing costs more than a few item reads)
        return all(int(words[g]) == w for g, w in zip(
            cols[_GRANT, lo:hi].tolist(), cols[_WORD, lo:hi].tolist(), strict=True))
    return bool((words[cols[_GRANT, lo:hi]] == cols[_WORD, lo:hi]).all())
