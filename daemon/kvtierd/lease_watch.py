"""Leases made without a call, as kvtierd verifies them: the fast path's facts.

A client on the fast path leases blocks by writing hazards in its session page
(``csrc/index.c``): no call reaches the daemon, so its ``Acquire`` figures
(``NamespaceStats.hits``, ``kvtier_hit_blocks``) never move, and what the client
counts in its page is its word only (``kvtierd.counters``).  What the daemon can
verify is what it sees: a hazard that names a COMMITTED block of the page's own
namespace when the daemon reads it is a lease the daemon honours (the block is
pinned: never evicted, moved or reused while named).  Only such hazards count
here, with lengths from the daemon's own slot table (the ``.meta`` file no client
reaches), never a length, count or serial the client wrote:

* **held now** (``held_now``): the leases (distinct serials per page), distinct
  blocks and their bytes named by a namespace's pages as read now; ``Stats`` and
  every scrape read them afresh.
* **seen** (``LeaseWatch.look``, every ``LOOK_INTERVAL`` on the event loop): each
  entry whose word or serial changed since the last look and that names a
  committed block is a pin seen for the first time: its lease (a serial not held
  at the last look), the block and its bytes are added to the namespace's
  ``SeenTally``.  A lease that begins and ends between two looks is not seen, so
  these totals are a lower bound of the reads made without a call; each unit of
  them is a pin that existed.  A client can raise them only by really holding
  pins at the looks: per look at most its pages' hazard shares
  (``limits.max_hazards_per_*``), at the pace the daemon chooses, never a
  client's (no call makes a look).
* **unverified**: new hazards that named no committed block of the namespace
  (garbage, a slot freed since, another namespace's slot), counted apart.

Every read of a page is a bounded copy of at most ``HAZARDS_N`` words and serials
(below the page's bound word, cut to the session's share) from a sealed memfd the
daemon mapped: it cannot fault, block or grow.  State kept per page: its last
copy (at most 12 KiB) and three arrays of that size; per namespace: one tally.
No Python object per block.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from kvtier import _page, _slot_ref
from kvtierd.counters import saturating_add
from kvtierd.store.types import COMMITTED_STATE

if TYPE_CHECKING:
    from kvtierd.shared_index import SessionPage
    from kvtierd.store import Namespace, Store

#: How often the daemon reads its clients' hazards to count the leases made without a
#: call.  A JAX or vLLM reader holds a lease for the copy of its blocks (~1-10 ms for a
#: prompt's worth), so looks 10 ms apart see a good share of them; a look of pages that
#: did not move costs a copy and a comparison per page (a few microseconds), so 100
#: looks a second cost the loop well under 1% of a core.
LOOK_INTERVAL: Final = 0.01

#: Hazard entries of moved pages one look verifies at most (or one page, whole): the
#: rest wait for the next look, starting there (none starves).  Honest
#: readers move tens to hundreds of entries per 10 ms; one uid may churn its whole share
#: (``limits.max_hazards_per_uid``, 16384) every look, and verifying costs ~0.2 us an
#: entry, so this keeps a look under ~0.3 ms of the loop's time whatever clients write.
LOOK_BUDGET: Final = 1024

_BIT: Final = np.uint64(_page.HAZARD_BIT)
_REF: Final = np.uint64(~_page.HAZARD_BIT & (2**64 - 1))
_U64: Final = np.dtype("<u8")
_NONE: Final = np.zeros(0, dtype=np.uint64)
_NO_MASK: Final = np.zeros(0, dtype=np.bool_)


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """What a namespace's clients lease without a call now, verified: ``leases``
    (distinct serials per page whose hazards name committed blocks), ``blocks``
    (distinct committed blocks named) and their committed ``nbytes``."""

    leases: int = 0
    blocks: int = 0
    nbytes: int = 0


@dataclasses.dataclass(slots=True)
class SeenTally:
    """A namespace's leases made without a call, as the daemon's looks saw them since
    it started (each total saturates, ``kvtierd.counters``)."""

    leases: int = 0
    blocks: int = 0
    nbytes: int = 0
    #: New hazards that named no committed block of the namespace: never counted above.
    unverified: int = 0

    def add(self, leases: int, blocks: int, nbytes: int, unverified: int) -> None:
        self.leases = saturating_add(self.leases, leases)
        self.blocks = saturating_add(self.blocks, blocks)
        self.nbytes = saturating_add(self.nbytes, nbytes)
        self.unverified = saturating_add(self.unverified, unverified)


def _bound(page: SessionPage) -> int:
    """The hazard entries the daemon reads in ``page``: below the client's bound word,
    cut to the session's share."""
    hi: int = struct.unpack_from("<Q", page.mapping, _page.HAZARD_HI)[0]
    return min(hi, page.max_hazards)


def read_hazards(page: SessionPage) -> bytes:
    """A copy of ``page``'s hazard words then their serials, for the entries the daemon
    reads (``_bound``): 16 bytes each."""
    n = _bound(page)
    mm = page.mapping
    return mm[_page.HAZARDS:_page.HAZARDS + 8 * n] + mm[_page.SERIALS:_page.SERIALS + 8 * n]


def _split(raw: bytes) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    n = len(raw) // 16
    return (np.frombuffer(raw, dtype=_U64, count=n),
            np.frombuffer(raw, dtype=_U64, count=n, offset=8 * n))


def verify(ns: Namespace, words: npt.NDArray[np.uint64]
           ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.uint64]]:
    """Which of ``words`` (hazard values a client wrote) name a COMMITTED block of
    ``ns`` now, and each such block's committed length from the daemon's slot table
    (at most ``block_bytes``; 0 for the others).  Two native calls for all of them;
    a word naming no slot of ``ns`` is never passed to the table."""
    ok = (words & _BIT) != 0
    lengths = np.zeros(len(words), dtype=np.uint64)
    if not ok.any() or not ns.by_id:
        return np.zeros(len(words), dtype=np.bool_), lengths
    ids = np.array(sorted(ns.by_id), dtype=np.uint64)
    sizes = np.array([ns.by_id[i].n_slots for i in ids.tolist()], dtype=np.uint64)
    segs, slots = _slot_ref.split(words & _REF)
    at = np.minimum(np.searchsorted(ids, segs), len(ids) - 1)
    ok &= (ids[at] == segs) & (slots < sizes[at])
    where = np.flatnonzero(ok)
    if not len(where):
        return ok, lengths
    refs = words[where] & _REF
    try:
        committed = ns.table.inspect(refs)["state"] == COMMITTED_STATE
        where = where[committed]
        if len(where):
            got = ns.table.fields(refs[committed])["length"]
            lengths[where] = np.minimum(got, np.uint64(ns.block_bytes))
    except ValueError:  # a slot the table does not know (an extent going away): none
        return np.zeros(len(words), dtype=np.bool_), np.zeros(len(words), dtype=np.uint64)
    ok[:] = False
    ok[where] = True
    return ok, lengths


def held_now(ns: Namespace) -> Held:
    """``ns``'s leases made without a call, read from its pages now and verified
    (``verify``: one pair of table calls for all its pages)."""
    words: list[npt.NDArray[np.uint64]] = []
    serials: list[npt.NDArray[np.uint64]] = []
    for page in list(ns.pages.values()):
        if not page.max_hazards or not _bound(page):
            continue
        w, s = _split(read_hazards(page))
        used = w != 0
        if used.any():
            words.append(w[used])
            serials.append(s[used])
    if not words:
        return Held()
    every = np.concatenate(words)
    ok, lengths = verify(ns, every)
    leases = 0
    at = 0
    for w, s in zip(words, serials, strict=True):
        leases += len(np.unique(s[ok[at:at + len(w)]]))
        at += len(w)
    good = every[ok]
    distinct, first = np.unique(good, return_index=True)
    return Held(leases, len(distinct), int(lengths[ok][first].sum()))


def held_by_namespace(store: Store) -> dict[str, Held]:
    """``held_now`` of every namespace of ``store``, by name."""
    return {name: held_now(ns) for name, ns in list(store.namespaces.items())}


def leased_blocks(ns: Namespace, held: Held) -> int:
    """``ns``'s leased blocks as the daemon reports them: pinned by its calls' leases or a
    spill in flight, and named by verified hazards (``held``, ``held_now(ns)``)."""
    return ns.leased + held.blocks


def active_leases(store: Store, held: dict[str, Held]) -> int:
    """Leases held as the daemon reports them: by Acquire calls, and without a call as
    verified (``held``, ``held_by_namespace(store)``)."""
    return store.call_lease_count + sum(h.leases for h in held.values())


@dataclasses.dataclass(slots=True)
class _PageSeen:
    """One page as the last look read it: its copy, and per entry its word, serial and
    whether it named a committed block when first seen."""

    page: SessionPage
    raw: bytes = b""
    words: npt.NDArray[np.uint64] = dataclasses.field(default_factory=lambda: _NONE)
    serials: npt.NDArray[np.uint64] = dataclasses.field(default_factory=lambda: _NONE)
    verified: npt.NDArray[np.bool_] = dataclasses.field(default_factory=lambda: _NO_MASK)


class LeaseWatch:
    """Counts the leases clients make without a call, at the daemon's looks (see the
    module docstring).  Runs on the event loop; ``look`` is the only writer."""

    def __init__(self, store: Store, interval: float = LOOK_INTERVAL) -> None:
        self._store = store
        #: Seconds between looks (``look`` is called by ``app``'s task at this pace).
        self.interval = interval
        #: Looks made since start.
        self.looks = 0
        self._pages: dict[int, _PageSeen] = {}
        self._tallies: dict[str, SeenTally] = {}
        #: The session id of the last page counted (the next look starts after it).
        self._cursor = 0

    def namespaces(self) -> list[str]:
        """The store's namespaces now, by name (each has a tally, zeros included)."""
        return sorted(self._store.namespaces)

    def tally(self, namespace: str) -> SeenTally:
        """What the looks saw of ``namespace`` (zeros when nothing yet)."""
        return self._tallies.get(namespace) or SeenTally()

    def look(self) -> None:
        """Read every page with a hazard share; count the pins seen for the first time
        that name committed blocks of the page's namespace, verifying at most
        ``LOOK_BUDGET`` entries of moved pages, or one page (those left over are read
        again at the next look, first).  Pages and namespaces that are gone are forgotten."""
        self.looks = saturating_add(self.looks, 1)
        live: set[int] = set()
        moved: list[tuple[int, Namespace, _PageSeen, bytes]] = []
        spaces = self._store.namespaces
        for ns in list(spaces.values()):
            for sid, page in list(ns.pages.items()):
                if not page.max_hazards:
                    continue
                live.add(sid)
                seen = self._pages.get(sid)
                if seen is None or seen.page is not page:
                    seen = self._pages[sid] = _PageSeen(page)
                elif not seen.raw and not _bound(page):
                    continue  # held nothing, holds nothing: the common idle case
                raw = read_hazards(page)
                if raw != seen.raw:
                    moved.append((sid, ns, seen, raw))
        if moved:
            # From the page after the last one counted, so that none waits forever.
            moved.sort(key=lambda m: (m[0] <= self._cursor, m[0]))
            budget = LOOK_BUDGET
            for i, (sid, ns, seen, raw) in enumerate(moved):
                entries = len(raw) // 16
                if i and entries > budget:
                    break
                budget -= entries
                self._count(ns, seen, raw)
                self._cursor = sid
        for sid in [s for s in self._pages if s not in live]:
            del self._pages[sid]
        for name in [n for n in self._tallies if n not in spaces]:
            del self._tallies[name]

    def _count(self, ns: Namespace, seen: _PageSeen, raw: bytes) -> None:
        words, serials = _split(raw)
        n, m = len(words), min(len(words), len(seen.words))
        fresh = words != 0
        fresh[:m] &= (words[:m] != seen.words[:m]) | (serials[:m] != seen.serials[:m])
        verified = np.zeros(n, dtype=np.bool_)
        verified[:m] = seen.verified[:m] & ~fresh[:m] & (words[:m] != 0)
        new = np.flatnonzero(fresh)
        if len(new):
            ok, lengths = verify(ns, words[new])
            verified[new[ok]] = True
            # A lease is new unless its serial named a verified block at the last look
            # (a look in the middle of an acquire sees part of its hazards).
            got = int(np.count_nonzero(ok))
            leases = 0
            if got:
                mine = np.unique(serials[new[ok]])
                before = seen.serials[:len(seen.verified)][seen.verified]
                leases = len(mine) if not len(before) else int(
                    np.count_nonzero(~np.isin(mine, before)))
            tally = self._tallies.get(ns.name)
            if tally is None:
                tally = self._tallies[ns.name] = SeenTally()
            tally.add(leases, got, int(lengths.sum()), len(new) - got)
        seen.raw, seen.words, seen.serials, seen.verified = raw, words, serials, verified
