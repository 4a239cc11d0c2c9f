"""Grants: slots reserved ahead for a session's writer (``csrc/writes.c``), named in its
session page, which the writer takes, fills and commits by ring records without a call.

Everything about them is here; the store composes it (``Session.grants`` is the
session's ``GrantBook``) and never reaches into its columns:

* ``GrantBook``, one per session: the grants held, as columns (no Python object per
  grant), and every way one ends -- **grant** (``grant``: slots the store claimed go in
  free page entries), **take** (the writer's compare-and-swap in the page; ``taken``
  reads it), **commit** (``commit``: the page's records, checked against the grants
  held, through the store's one commit transition, which the store passes in),
  **revoke** (``untaken_in`` and ``take_back_untaken``: an extent about to be
  reclaimed gives back the grants no writer took, all or none), **sweep** (``sweep``:
  idle ones go back; those held taken for the reservation TTL are returned for the
  store's one expiry sweep to **quarantine**, ``end(..., quarantine=)``), and session
  close (``end(..., freed=True)``).
* The refill policy: ``grant_limit``, ``grant_target``, ``GrantBook.needs_refill``.
  Finding the room stays the store's (``FastPath.refill_grants`` claims from the
  allocator, then ``GrantBook.grant``): a book never claims, evicts or grows.
* The per-namespace figures: ``idle_by_namespace`` (Stats, metrics, accounting),
  ``granted_in`` (growth ahead counts grants as free room).

All or nothing, as the store's calls: a change of the slot table (``release_claims``
in ``end``, the store's commit in ``commit``) comes first, the book's columns and the
page after (nothing there can fail).  No blocking I/O: the page is shared memory.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Final, TypeAlias

import numpy as np
import numpy.typing as npt

from kvtier import _page, _slot_ref
from kvtierd.shared_index import GRANT_TAKEN, GRANTS_N, PageRecords, SessionPage

if TYPE_CHECKING:
    from kvtierd.block_table import RingCommit
    from kvtierd.store.types import Block, Extent, Namespace, Session

log = logging.getLogger(__name__)

#: Grants nobody committed into for this long go back (an idle writer holds no room).
GRANT_IDLE_SECONDS: Final = 5.0
#: A writer's grants are refilled in batches of at least this many slots (one claim,
#: one eviction plan for them all): refilling one slot per commit of one key cost a
#: claim per block, most of a 1-key commit's daemon CPU.
REFILL_BATCH = 32
#: ... and of this many of its puts (what it asks for): a refill's claim costs the same
#: for 1 slot as for 100 (the room plan, the hazard reads, the eviction's table calls).
REFILL_PUTS = 8
#: ... within 1 / GRANT_SHARE of the namespace's slots (``grant_target``).
GRANT_SHARE = 16

#: A grant word's slot ref: ``segment_id << 32 | slot`` (``kvtier._slot_ref``).
_GRANT_REF: Final = ~np.uint64(_page.GRANT_VALID | _page.GRANT_TAKEN)


class CommitResult(enum.IntEnum):
    """A commit record's result byte in the page (``csrc/layout.h``'s ``KVT_W_*``)."""

    COMMITTED = _page.COMMITTED
    EXISTS = _page.EXISTS  # the key was present (or being written): the grant stays
    INVALID = _page.INVALID  # the record's batch was malformed: nothing of it committed
    #: a record of the batch names no grant this session holds (committed already,
    #: earlier in the ring or before; taken back; expired; never its own): nothing of it
    #: committed, the writer's slot is gone (docs/security.md, "Record answers")
    LOST = _page.LOST
    #: the daemon itself failed (its slot table could not be written): nothing
    #: committed; never the answer to anything a writer did
    FAILED = _page.FAILED


_COMMITTED: Final = int(CommitResult.COMMITTED)
_EXISTS: Final = int(CommitResult.EXISTS)
_GRANT, _WORD = 0, 1  # PageRecords.columns' rows of grant entries and of the words taken

#: Which of some keys a tier below DRAM holds (``Below.held_below``): such a key is
#: EXISTS to a writer, as a DRAM block is.
HeldBelow: TypeAlias = Callable[[Sequence[bytes]], list[bool]]
#: The same transition for a writer's whole commit ring in one native call, when it
#: is the plain case (``StoreState.commit_ring``; the last argument its
#: ``answer_min``): None, changing nothing, otherwise.
CommitRing: TypeAlias = Callable[
    ["Namespace", SessionPage, npt.NDArray[np.uint64], "HeldBelow | None", int],
    "RingCommit | None"]
#: The store's one commit transition for a batch of granted slots (``StoreState.commit_slots``
#: over ``Commits(refs, gens, keys, lengths, checksums)``): the blocks made.  All or
#: nothing; ValueError or OSError changes nothing.
CommitGranted: TypeAlias = Callable[
    [npt.NDArray[np.uint64], npt.NDArray[np.uint64], list[bytes], npt.NDArray[np.uint64],
     list[int | None] | npt.NDArray[np.uint64] | None],
    "list[Block]"]


def grant_limit(grant_bytes: int, ns: Namespace) -> int:
    """Most slots a session of ``ns`` may hold granted ahead (``grant_bytes`` of them)."""
    return min(GRANTS_N, grant_bytes // ns.slot_bytes)


def grant_target(limit: int, ns: Namespace, wanted: int) -> int:
    """How many grants a writer that asks for ``wanted`` (its largest put: its next one
    must find as many) is given at a refill: ``REFILL_PUTS`` times that, at least
    ``REFILL_BATCH``, within ``limit`` (``grant_limit``).  A refill happens when it holds
    a quarter of it or less, or less than two puts' worth (``GrantBook.needs_refill``),
    so each claims a batch of at least ``REFILL_PUTS / 2`` puts' worth, however small
    the puts (a claim's fixed cost -- the room plan, the hazard reads, the eviction's
    index and table calls -- was most of a commit's: refilling at a quarter instead of
    half took 32 x 64 KiB puts from 1.29 to 1.15 us of daemon CPU a block), and a writer
    never holds fewer than it wants if it asks for no more than half the limit.
    Past two puts' worth, never more than ``1 / GRANT_SHARE`` of the namespace's slots:
    idle grants are room the cache does not use (a small namespace, or one at its
    quota, grants two puts' worth and no batch).  Two, not one: a writer granted one
    put's worth takes all of it at each put, so each commit's refill came before its
    answer (32 x 512 KiB in a namespace of one 256 MiB extent, a share of 32 slots:
    commits of 81 us p50 instead of 53); with two, the refill comes after it."""
    if wanted <= 0:
        return 0
    share = ns.table.n_slots // GRANT_SHARE
    return min(limit, max(REFILL_PUTS * wanted, REFILL_BATCH), max(2 * wanted, share))


class GrantBook:
    """The slots granted ahead to one session's writer (csrc/writes.c), by the entry of
    its page that names each, as columns: ``words[g]`` is entry g's grant word as the
    page holds it (0: no grant; else ``GRANT_VALID | segment_id << 32 | slot``: what the
    native commit check compares the page against, ``SessionPage.take_commits``) and
    ``gens[g]`` its slot's generation.  No Python object per grant: a put's refill and
    commit add and drop them by the batch.  ``len``, ``in`` and iteration (entries in
    order) count the held entries.

    Each grant is ended by exactly one of: its commit (``commit``), its take-back while
    no writer took it (``sweep`` when idle, ``take_back_untaken`` when its extent is
    reclaimed), quarantine once a writer held it taken for the reservation TTL
    (``sweep`` finds them, the store's expiry ends them: ``end(..., quarantine=)``), or
    the session's close (``end(..., freed=True)``)."""

    __slots__ = ("words", "gens", "_n", "seen", "used", "_session")

    def __init__(self, session: Session) -> None:
        self.words: npt.NDArray[np.uint64] = np.zeros(_page.GRANTS_N, dtype=np.uint64)
        self.gens: npt.NDArray[np.uint64] = np.zeros(_page.GRANTS_N, dtype=np.uint64)
        self._n = 0
        self._session = session
        #: Entry -> when a writer was first seen holding it taken (``sweep``).
        self.seen: dict[int, float] = {}
        #: The store's clock when a grant was last made or committed.
        self.used = 0.0

    # ------------------------------------------------ the columns
    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __contains__(self, g: object) -> bool:
        if not isinstance(g, (int, np.integer)):  # (a numpy integer too)
            return False
        i = int(g)
        return 0 <= i < len(self.words) and bool(self.words[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self.entries().tolist())

    def entries(self) -> npt.NDArray[np.intp]:
        """The entries held, in order."""
        return np.flatnonzero(self.words)

    def free_entries(self, n: int) -> npt.NDArray[np.uint64]:
        """The first ``n`` (at most) entries that hold no grant."""
        return np.flatnonzero(self.words == 0)[:n].astype(np.uint64)

    def refs(self, entries: npt.NDArray[np.integer] | Sequence[int] | None = None
             ) -> npt.NDArray[np.uint64]:
        """The slot refs of ``entries`` (held ones), or of every grant held."""
        words = self.words[self.entries() if entries is None else entries]
        return words & _GRANT_REF

    def places(self) -> list[tuple[int, int, int]]:
        """(extent id, slot, generation) of every grant held (checks, tests)."""
        held = self.entries()
        return [(_slot_ref.segment_of(r), _slot_ref.slot_of(r), gen) for r, gen in zip(
            (self.words[held] & _GRANT_REF).tolist(), self.gens[held].tolist(), strict=True)]

    def drop(self, entries: npt.NDArray[np.uint64] | list[int]) -> None:
        """The grants of ``entries`` (held, each once) end here."""
        if len(entries) <= 8:  # (a fancy assignment costs more than a few item sets)
            words = self.words
            for g in (entries.tolist() if isinstance(entries, np.ndarray) else entries):
                words[g] = 0
        else:
            self.words[entries] = 0
        self._n -= len(entries)

    def problems(self) -> list[str]:
        """What does not add up (``Store.check``): the count, a word without its VALID
        bit or with the writer's TAKEN bit (the page's, never the daemon's)."""
        out = []
        held = self.entries()
        if len(held) != self._n:
            out.append(f"{self._n} grants counted, {len(held)} held")
        words = self.words[held]
        bad = held[(words & np.uint64(_page.GRANT_VALID)) == 0].tolist() + \
            held[(words & np.uint64(_page.GRANT_TAKEN)) != 0].tolist()
        if bad:
            out.append(f"grant words that are no grant at entries {sorted(bad)[:5]}")
        return out

    # ------------------------------------------------ grant and take
    @property
    def page(self) -> SessionPage | None:
        """The session's page (None: not attached, or the session ended)."""
        session = self._session
        return session.ns.pages.get(session.id)

    def grant(self, page: SessionPage, refs: npt.NDArray[np.uint64],
              gens: npt.NDArray[np.uint64], now: float) -> None:
        """Grant ``refs`` (slots the store just claimed, RESERVED at ``gens``) to the
        writer: the first free entries (no word: no grant) of ``page`` name them,
        ref | VALID."""
        page.grant(self.words, self.gens, refs, gens)
        self._n += len(refs)
        self.used = now

    def needs_refill(self, target: int, wanted: int) -> bool:
        """It holds a quarter of ``target`` (``grant_target``) or less, or fewer than two
        puts' worth (``wanted`` each) while that is at most half of ``target``: the next
        put still finds its grants, and a refill claims at least 3/4 of a batch (half,
        when the writer's puts are that large)."""
        n = self._n
        return n < target and n <= max(target // 4, min(2 * wanted, target // 2))

    def taken(self) -> int:
        """How many of the grants its writer has taken (its page says)."""
        if not self._n:
            return 0
        page = self.page
        if page is None:
            return 0
        words = self.words
        return sum(1 for g in self if page.grant_word(g) == int(words[g]) | GRANT_TAKEN)

    def untaken_in(self, ext_id: int) -> list[int]:
        """The entries of its grants in extent ``ext_id`` that no writer took."""
        page = self.page
        held = self.entries()
        words = self.words[held]
        mine = _slot_ref.segments_of(self.refs(held)) == ext_id
        return [g for g, word in zip(held[mine].tolist(), words[mine].tolist(), strict=True)
                if page is None or page.grant_word(g) == word]

    # ------------------------------------------------ end
    def end(self, entries: Iterable[int], *, quarantine: float | None = None,
            freed: bool = False) -> None:
        """Take back grants: their slots are freed (or, with ``quarantine``, stay
        RESERVED until then: a writer may still be copying into them; ``freed``: the
        caller freed them already)."""
        ns = self._session.ns
        page = self.page
        entries = list(entries)
        refs = self.refs(entries)
        if quarantine is None and not freed:
            ns.table.release_claims(refs)
        self.drop(entries)
        by_id = ns.by_id
        for g, ref in zip(entries, refs.tolist(), strict=True):
            self.seen.pop(g, None)
            if page is not None:
                page.set_grant(g, 0)
            if quarantine is not None:
                by_id[_slot_ref.segment_of(ref)].quarantine[_slot_ref.slot_of(ref)] = quarantine  # still RESERVED

    def sweep(self, now: float, reservation_ttl: float) -> list[int]:
        """Grants idle for ``GRANT_IDLE_SECONDS`` go back now.  Returns those a writer
        has held taken for ``reservation_ttl``: expired like a reservation (the caller,
        ``Store.expire``, quarantines them with the reservations: ``end``)."""
        page = self.page
        idle = now - self.used >= GRANT_IDLE_SECONDS
        back: list[int] = []
        stale: list[int] = []
        words = self.words
        for g in self:
            word = int(words[g])
            current = page.grant_word(g) if page is not None else 0
            if current == word | GRANT_TAKEN:
                first = self.seen.setdefault(g, now)
                if now - first >= reservation_ttl:
                    stale.append(g)
                continue
            self.seen.pop(g, None)
            if idle and (page is None or page.revoke_grant(g, current)):
                back.append(g)
        self.end(back)
        return stale

    # ------------------------------------------------ commit
    def commit(self, records: PageRecords, commit: CommitGranted,
               clock: Callable[[], float], exists: HeldBelow | None = None
               ) -> tuple[bytes, list[Block]]:
        """Commit the blocks the writer put in granted slots: ``records`` as
        ``SessionPage.take_commits`` copied them out of its page (grant entry, grant
        word, key, length, checksum, flags) and checked them against ``words``, in
        batches that end with a ``LAST`` record, each all or nothing, through
        ``commit`` (the store's one commit transition).  A batch with a record that
        names no grant the session holds when the batch is committed is ``LOST``
        whole, however it got there: the grant was committed (earlier in this ring or
        in an earlier one), taken back idle, expired, ended with the session, or never
        granted (an entry past the grant table, another session's or namespace's slot,
        an entry granted again since: never committed into the entry's new slot).
        ``FAILED`` only when the daemon could not write its slot table
        (``docs/security.md``, "Record answers").  Returns each record's
        ``CommitResult`` and the blocks made."""
        session = self._session
        results = bytearray()
        made: list[Block] = []
        # The native check compared every batch with the grants held when the ring was
        # taken; a batch that committed ended some of them, so the batches after it are
        # compared again with the grants held now (a grant committed earlier in this
        # ring and named again is LOST, never FAILED: the daemon did not fail).
        changed = False
        for lo, hi, refused in records.batches:
            if not refused and (session.closed or (
                    changed and not _still_held(self.words, records, lo, hi))):
                refused = CommitResult.LOST
            if refused:
                results += bytes([refused]) * (hi - lo)
                continue
            try:
                codes, blocks = self._commit_batch(records, lo, hi, commit, clock, exists)
            except (OSError, ValueError) as exc:  # a slot table that cannot be written
                log.warning("commit of %d granted slots failed: %s", hi - lo, exc)
                codes, blocks = bytes([CommitResult.FAILED]) * (hi - lo), []
            changed = changed or _COMMITTED in codes  # some committed: their grants ended
            results += codes
            made += blocks
        return bytes(results), made

    def commit_ring(self, page: SessionPage, commit_ring: CommitRing, clock: Callable[[], float],
                    exists: HeldBelow | None = None, answer_min: int = -1
                    ) -> RingCommit | None:
        """The writer's whole commit ring in one native call, when it is the plain case
        (``StoreState.commit_ring``, passed in: every record names a grant held and a
        new key, none twice); each record's grant ends there, in ``words`` and the
        page.  None, with nothing changed, for any other ring (``commit`` takes it)."""
        if self._session.closed:
            return None
        got = commit_ring(self._session.ns, page, self.words, exists, answer_min)
        if got is None:
            return None
        self._n -= got.n
        if seen := self.seen:
            for g in np.frombuffer(got.entries, dtype=np.uint64).tolist():
                seen.pop(g, None)
        self.used = clock()
        return got

    def _commit_batch(self, records: PageRecords, lo: int, hi: int, commit: CommitGranted,
                      clock: Callable[[], float], exists: HeldBelow | None
                      ) -> tuple[bytes, list[Block]]:
        """One batch, records[lo:hi], that the native check let through, all or nothing:
        each new key COMMITTED (a key present, being written, or in a lower tier is
        EXISTS: first writer wins, its grant stays)."""
        ns = self._session.ns
        whole = lo == 0 and hi == len(records)
        keys = records.keys if whole else records.keys[lo:hi]
        cols = records.columns if whole else records.columns[:, lo:hi]
        # (Python lists, not numpy reductions, for the flags: a batch is often 1 key.)
        new = (ns.index.find(keys) == 0).tolist()
        if ns.in_flight:
            flying = ns.in_flight.intersection(keys)  # (one fold and one pass)
            for i, key in enumerate(keys):
                if new[i] and key in flying:
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
        made = commit(refs, self.gens[entries], keys, lengths, checksums)
        # Applied (ValueError above: nothing changed); nothing below can fail.
        self.drop(entries)
        if seen := self.seen:
            for g in entries.tolist():
                seen.pop(g, None)
        page = self.page
        if page is not None:  # before DONE: the writer never sees them as its own again
            page.set_grants(entries, np.zeros(len(entries), dtype=np.uint64))
        self.used = clock()
        return codes, made


def _still_held(words: npt.NDArray[np.uint64], records: PageRecords, lo: int, hi: int) -> bool:
    """Whether every record of records[lo:hi] names the grant its entry holds now
    (``words``: the session's grant words; the native check made sure the entries are
    in range)."""
    cols = records.columns
    if hi - lo <= 8:  # (numpy's fancy indexing costs more than a few item reads)
        return all(int(words[g]) == w for g, w in zip(
            cols[_GRANT, lo:hi].tolist(), cols[_WORD, lo:hi].tolist(), strict=True))
    return bool((words[cols[_GRANT, lo:hi]] == cols[_WORD, lo:hi]).all())


# ------------------------------------------------ across the sessions of a namespace
def untaken_in(ext: Extent, namespaces: Mapping[str, Namespace],
               sessions: Mapping[int, Session]) -> list[tuple[Session, int]]:
    """The grants of ``ext``'s namespace's sessions in ``ext`` that no writer took
    (session, grant entry)."""
    owner = namespaces.get(ext.segment.namespace)
    if owner is None or not ext.reserved:
        return []
    return [(session, g) for session in sessions.values()
            if session.ns is owner and session.grants
            for g in session.grants.untaken_in(ext.id)]


def take_back_untaken(exts: Sequence[Extent], namespaces: Mapping[str, Namespace],
                      sessions: Mapping[int, Session]) -> bool:
    """Take back the untaken grants in extents about to be reclaimed, all or none: a
    writer that took one meanwhile (the page's compare-and-swap says so) puts back the
    ones already taken back, and False (the caller plans again)."""
    revoked: list[tuple[Session, int, int]] = []

    def put_back() -> None:
        for s2, g2, w2 in revoked:
            page2 = s2.grants.page
            if page2 is not None:
                page2.set_grant(g2, w2)

    for ext in exts:
        idle = untaken_in(ext, namespaces, sessions)
        if len(idle) != ext.reserved - len(ext.quarantine):
            put_back()  # a writer took one since the plan was made
            return False
        for session, g in idle:
            page = session.grants.page
            word = int(session.grants.words[g])
            if page is not None and not page.revoke_grant(g, word):
                put_back()
                return False
            revoked.append((session, g, word))
    # Applied: the slots go back (the extents' reserved counts drop to their
    # quarantine, which retirement drops with them).
    by_session: dict[int, tuple[Session, list[int]]] = {}
    for session, g, _word in revoked:
        by_session.setdefault(session.id, (session, []))[1].append(g)
    for session, entries in by_session.values():
        session.grants.end(entries)
    return True


def granted_in(ns: Namespace, sessions: Mapping[int, Session]) -> int:
    """Slots of ``ns`` granted ahead to its writers: room its next writes take first
    (the fast path's free list), so growth ahead (``Budget.start_ahead``) counts them as
    free."""
    return sum(len(sessions[sid].grants) for sid in ns.pages if sid in sessions)


def idle_by_namespace(sessions: Iterable[Session]) -> dict[str, int]:
    """Per namespace, the slots granted ahead that no writer has taken yet (``taken``)."""
    out: dict[str, int] = {}
    for s in sessions:
        idle = len(s.grants) - s.grants.taken()
        if idle:
            out[s.ns.name] = out.get(s.ns.name, 0) + idle
    return out
