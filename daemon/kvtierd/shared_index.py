"""The shared index: a namespace's DRAM keys, published for its clients to search.

A ``Lookup`` is the call a serving engine makes most (one per request, often
per step), and the one that needs nothing but the index.  So the daemon
publishes each namespace's committed DRAM keys in a flat hash table in shared
memory (layout and concurrency in ``csrc/index.c``), hands its clients the
table read-only with the segments, and a client answers a lookup by itself:
no round trip, no daemon CPU.

The daemon is the only writer, from the event loop, and the table *is* the
store's key index (``kvtierd.store.keys``): a key enters only at commit (or at
recovery), so a client never sees a block that is not visible; it leaves
before the delete or eviction returns.  What a client cannot learn from the
table, it asks the daemon: a namespace with tiers below DRAM sets
``MISS_NOT_FINAL``, so a client's miss there goes on to a ``Lookup`` call for the
keys the table did not hold.

The file is a sealed memfd: clients get it ``O_RDONLY`` and the seals
(``F_SEAL_FUTURE_WRITE``, ``F_SEAL_SHRINK``, ``F_SEAL_GROW``) stop any writable
mapping or size change, even through ``/proc/self/fd``; the daemon writes
through the one writable mapping it made before sealing.  A table that fills
up is replaced, never resized in place: the daemon builds a larger one, marks
the old one ``SUPERSEDED`` and clients that see the flag ask for the new fd.
Publishing never fails a store operation: if a table cannot be made (out of
memory, out of fds) the namespace stops publishing and its clients fall back
to ``Lookup`` calls.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import logging
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Final, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from kvtier import _accel, _page, _slot_ref

log = logging.getLogger(__name__)

try:
    from kvtier import _native
except ImportError:  # not built: nothing is published, clients call Lookup
    _native = None  # type: ignore[assignment]

#: Whether this build can publish (the table code is native only).
AVAILABLE: Final = _native is not None and _accel.NATIVE

#: The table's geometry, its header's flags word and the session page's layout:
#: ``csrc/layout.h``, read through ``kvtier._page`` (its one definition).
HEADER_BYTES: Final = _page.INDEX_HEADER_BYTES
ENTRY_BYTES: Final = _page.INDEX_ENTRY_BYTES
#: A new namespace's table: 1024 entries (64 KiB); it doubles as keys arrive.
MIN_CAPACITY: Final = 1024
#: Entries a probe may visit (csrc/index.c's limit): honest keys never need that many.
MAX_PROBE: Final = _page.INDEX_MAX_PROBE
SUPERSEDED: Final = _page.SUPERSEDED
MISS_NOT_FINAL: Final = _page.MISS_NOT_FINAL
#: The tier a published key is in (the wire's TIER_DRAM).
TIER_DRAM: Final = 1
PAGE_BYTES: Final = _page.PAGE_BYTES
_RING_HEAD: Final = _page.RING_HEAD
_MAX_LEASES: Final = _page.MAX_LEASES
_MAX_RESERVATIONS: Final = _page.MAX_RESERVATIONS  # daemon-written: the reservation limit
_LOCAL_RESERVATIONS: Final = _page.LOCAL_RESERVATIONS  # client-written: from grants
#: Daemon-written: MAX_HAZARDS_SET | n, the hazard entries [0, n) the session may use
#: (its share of ``limits.max_hazards_per_uid`` / ``_per_namespace``); the daemon reads
#: no entry past it.  0 (an older daemon): all ``HAZARDS_N``.
_MAX_HAZARDS: Final = _page.MAX_HAZARDS
MAX_HAZARDS_SET: Final = _page.MAX_HAZARDS_SET
_HAZARDS: Final = _page.HAZARDS
_SERIALS: Final = _page.SERIALS
_HAZARD_HI: Final = _page.HAZARD_HI
_RING: Final = _page.RING
RING_N: Final = _page.RING_N
#: A page with a write area (``csrc/writes.c``).
WPAGE_BYTES: Final = _page.WPAGE_BYTES
_W_WANT: Final = _page.W_WANT
_W_GRANTS: Final = _page.W_GRANTS
GRANTS_N: Final = _page.GRANTS_N
GRANT_VALID: Final = _page.GRANT_VALID
GRANT_TAKEN: Final = _page.GRANT_TAKEN
#: A commit record's flags.
HAS_SUM: Final = _page.HAS_SUM
LAST: Final = _page.LAST
HAZARDS_N: Final = _page.HAZARDS_N
HAZARD_BIT: Final = _page.HAZARD_BIT
_REF_BITS: Final = np.uint64(~HAZARD_BIT & (2**64 - 1))
_HAZARD_BIT64: Final = np.uint64(HAZARD_BIT)
_NO_WORDS: Final = np.zeros(0, dtype=np.uint64)
_NO_WORDS.flags.writeable = False

#: Where a published block is: (segment id, slot, offset, length, checksum or None).
Location: TypeAlias = tuple[int, int, int, int, "int | None"]


class CommitRecord(NamedTuple):
    """A commit record as the daemon copies it out of a page (``csrc/writes.c``): the
    writer filled the slot of grant entry ``grant`` (whose word it read as ``word``)."""

    grant: int  # the grant entry, 0 .. GRANTS_N - 1
    word: int  # the grant word the writer took (VALID | slot ref)
    key: bytes
    length: int
    checksum: int  # meaningful with HAS_SUM in flags
    flags: int  # HAS_SUM, LAST


@dataclasses.dataclass(frozen=True, slots=True)
class PageRecords:
    """The commit records a ring brought, as columns (``SessionPage.take_commits``).
    Each batch (ending with a ``LAST`` record, or the last one taken) was checked
    natively as a whole: ``batches`` holds (start, end, refusal), the refusal INVALID
    (a key or length out of range, a grant entry or key twice), LOST (an entry past
    the grant table, or a word that is not the one the session's grant entry holds)
    or 0 (it may commit)."""

    batches: list[tuple[int, int, int]]
    keys: list[bytes]
    #: Six u64 rows: grant entry, grant word, the grant's slot ref, length, checksum,
    #: has checksum.
    columns: npt.NDArray[np.uint64]
    flags: bytes

    def __len__(self) -> int:
        return len(self.keys)

    def records(self) -> list[CommitRecord]:
        """The records as tuples, word included (tests and logs: O(records) objects)."""
        g, words, _refs, length, sums, _has = self.columns.tolist()
        return [CommitRecord(*r) for r in zip(g, words, self.keys, length, sums, self.flags,
                                              strict=True)]


def hazard_of(segment_id: int, slot: int) -> int:
    """The value a client's page holds while it leases the block in ``slot``."""
    return HAZARD_BIT | _slot_ref.encode(segment_id, slot)

# Linux's memfd seals; F_SEAL_FUTURE_WRITE (5.1) is not in Python's fcntl yet.
_F_SEAL_SHRINK: Final = 0x0002
_F_SEAL_GROW: Final = 0x0004
_F_SEAL_FUTURE_WRITE: Final = 0x0010
_F_SEAL_SEAL: Final = 0x0001


def sealed_memfd(name: str, size: int, seals: int) -> tuple[int, mmap.mmap]:
    """A memfd of ``size`` zero bytes, mapped read-write here, then sealed with ``seals``."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | _F_SEAL_SEAL)
        except BaseException:
            mm.close()
            raise
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def fingerprint(key: bytes) -> bytes:
    """What a table entry stores for ``key`` (17 bytes)."""
    return _native.index_fingerprint(key)


_serials = itertools.count(1)

#: ``add_slots`` populates a table it grows to at least this size in the background.
POPULATE_MIN_BYTES: Final = 16 << 20
#: How full (num, den) a table grown for a batch of keys (``add_slots``: a commit's, a
#: recovered extent's, recovery's all at once) may be.  Tables double, so one holding N
#: keys is 1/3..2/3 full: a miss probes ~2-5 entries (one cache line each), and a warm
#: restart waits for half the fresh pages a table at most half full would need
#: (~0.8 ms/MiB of first touch on a VM).  Inserts stop at 3/4 used (tombstones count);
#: the rebuild then leaves it at most 3/8 full (``_replace``).
GROW_LOAD: Final = (2, 3)


class _Table:
    """One table file: its fd and the daemon's writable mapping."""

    def __init__(self, capacity: int, max_probe: int) -> None:
        self.capacity = capacity
        self.max_probe = max_probe
        self.serial = next(_serials)
        self.fd, self.mm = sealed_memfd(
            "kvtier-index", HEADER_BYTES + capacity * ENTRY_BYTES,
            _F_SEAL_SHRINK | _F_SEAL_GROW | _F_SEAL_FUTURE_WRITE)
        _native.index_format(self.mm, capacity, secrets.randbits(64), max_probe)
        self._populating: threading.Thread | None = None

    def populate_in_background(self) -> None:
        """Allocate the table's pages in a thread (``_native.index_populate``, GIL
        released) while the writer goes on: a table made for a warm restart's millions of
        keys would otherwise take its page faults one insert at a time."""
        if self._populating is not None:
            return  # (made ahead: populating already)
        self._populating = threading.Thread(target=_native.index_populate, args=(self.mm,),
                                            name="kvtier-index-populate", daemon=True)
        self._populating.start()

    @property
    def populating(self) -> bool:
        """Whether its pages are still being populated (``populate_in_background``)."""
        return self._populating is not None and self._populating.is_alive()

    def close(self) -> None:
        if self._populating is not None:  # (it holds the mapping until it is done)
            self._populating.join()
        self.mm.close()
        os.close(self.fd)


def capacity_for(keys: int, start: int = 0) -> int:
    """The entries of a table grown for ``keys`` keys (from ``start`` entries, at
    least MIN_CAPACITY): at most ``GROW_LOAD`` full."""
    num, den = GROW_LOAD
    want = max(start, MIN_CAPACITY)
    while keys * den > want * num:
        want *= 2
    return want


#: Tables made ahead of a warm start (``prepare_tables``), by namespace.
_prepared: dict[str, _Table] = {}


def prepare_tables(keys: dict[str, int], max_probe: int = MAX_PROBE) -> None:
    """Make each namespace's key index table ahead of a warm start, sized for at most
    ``keys[name]`` keys (``segments.slots_by_namespace``), its pages populated by a
    thread meanwhile: kvtierd calls this before it imports the rest of itself, so a
    third of a second of imports hides the table's first touch (~0.8 ms/MiB on a VM:
    0.1 s for a million keys), and recovery's inserts find the pages there.  Recovery
    takes a table whose size it wants (``_take_prepared``) and closes the rest
    (``drop_prepared``).  Tables too small to be worth a thread are not made."""
    for name, n in keys.items():
        capacity = capacity_for(n)
        if capacity * ENTRY_BYTES < POPULATE_MIN_BYTES or name in _prepared:
            continue
        try:
            table = _Table(capacity, max_probe)
        except OSError as exc:  # (no memory for it now: recovery makes its own, or fails)
            log.debug("no index table made ahead for %r: %s", name, exc)
            continue
        table.populate_in_background()
        _prepared[name] = table


def _take_prepared(namespace: str, capacity: int, max_probe: int) -> _Table | None:
    """The table made ahead for ``namespace``, if it has between ``capacity`` and
    twice that many entries (the slots were an upper bound on the keys)."""
    table = _prepared.pop(namespace, None)
    if table is None:
        return None
    if capacity <= table.capacity <= 2 * capacity and table.max_probe == max_probe:
        return table
    table.close()
    return None


def drop_prepared() -> None:
    """Close the tables made ahead that recovery did not take."""
    while _prepared:
        _prepared.popitem()[1].close()


class SharedIndex:
    """The published table of one namespace (see the module doc)."""

    def __init__(self, namespace: str, *, lower_tiers: bool,
                 max_probe: int = MAX_PROBE) -> None:
        self.namespace = namespace
        self._max_probe = max_probe
        #: Keys the table could not take (past the probe limit), with their locations:
        #: misses are not final.
        self.unpublished: dict[bytes, Location] = {}
        self._lower = lower_tiers
        self._table: _Table | None = _Table(MIN_CAPACITY, max_probe)
        self._flags()

    @property
    def fd(self) -> int | None:
        """The current table's fd (None: this namespace no longer publishes)."""
        return None if self._table is None else self._table.fd

    @property
    def serial(self) -> int:
        """Tells tables apart: a new one (replaced, grown) has a new serial (0: none)."""
        return 0 if self._table is None else self._table.serial

    @property
    def capacity(self) -> int:
        return 0 if self._table is None else self._table.capacity

    def set_lower_tiers(self, lower: bool) -> None:
        self._lower = lower
        self._flags()

    def add(self, key: bytes, loc: Location) -> None:
        """Publish ``key`` (or move it) at ``loc``.  A key the table cannot take (past
        the probe limit, or the table is full and cannot grow) is kept in
        ``unpublished``: the store's index holds every key either way."""
        t = self._table
        r = 0
        if t is not None:
            r = _native.index_set(t.mm, key, TIER_DRAM, 0, loc)
            if r < 0 or (r == 0 and self._half_full(t)):
                # Full, or a probe ran the limit in a table past half full: a longer
                # cluster than honest keys make below half.  Grow (then it is not).
                t = self._replace()
                r = 0 if t is None else _native.index_set(t.mm, key, TIER_DRAM, 0, loc)
        if r > 0:
            if self.unpublished and self.unpublished.pop(key, None) is not None:
                self._flags()
        else:
            new = key not in self.unpublished
            self.unpublished[key] = loc
            if new:
                self._flags()

    @staticmethod
    def _half_full(t: _Table) -> bool:
        return bool(_native.index_info(t.mm)[2] * 2 > t.capacity)

    def discard(self, key: bytes) -> None:
        t = self._table
        if (t is None or not _native.index_remove(t.mm, key)) and key in self.unpublished:
            del self.unpublished[key]
            self._flags()

    def discard_many(self, keys: Sequence[bytes], *, hidden: bool = False) -> None:
        """``discard`` of each key, in one table call (none with ``hidden``: the keys
        ``BlockTable.unpublish`` took out; only those kept apart are left to forget)."""
        t = self._table
        if t is None:
            for key in keys:
                self.discard(key)
            return
        gone = bytes(len(keys)) if hidden else _native.index_remove_many(t.mm, keys)
        if self.unpublished and gone.count(0):
            changed = False
            for key, hit in zip(keys, gone, strict=True):
                if not hit and self.unpublished.pop(key, None) is not None:
                    changed = True
            if changed:
                self._flags()

    def hide(self, key: bytes) -> None:
        """Take ``key`` out of the table for now (``unhide`` puts it back): an eviction
        being planned hides its victims before it looks for clients' hazards."""
        t = self._table
        if t is not None:
            _native.index_remove(t.mm, key)

    def add_many(self, items: Iterable[tuple[bytes, Location]]) -> None:
        """``add`` of each (key, location), in bulk (a recovered namespace's keys)."""
        pairs = list(items)
        todo = [k for k, _ in pairs]
        locs = [loc for _, loc in pairs]
        at = 0
        t = self._table
        if t is not None:  # one table big enough for them all (at most half full): no regrowth
            used = _native.index_info(t.mm)[2]
            want = t.capacity
            while (used + len(todo)) * 2 > want:
                want *= 2
            if want > t.capacity:
                self._replace(want)
        while self._table is not None and at < len(todo):
            at, skipped = _native.index_set_many(self._table.mm, todo, TIER_DRAM, at, locs)
            self.unpublished.update((todo[i], locs[i]) for i in skipped)
            if at < len(todo) and self._replace() is None:
                break
        if at < len(todo):  # no table can take them: kept here (the index holds every key)
            self.unpublished.update(zip(todo[at:], locs[at:], strict=True))
            self._flags()
            return
        t = self._table
        if self.unpublished and t is not None and self._half_full(t) and self._replace():
            for key, loc in list(self.unpublished.items()):
                self.add(key, loc)  # (leaves the set when it goes in)
        self._flags()

    @property
    def buffer(self) -> mmap.mmap | None:
        """The current table's writable buffer (None: no table), for the native calls
        that take entries out by slot (``BlockTable.unpublish``)."""
        t = self._table
        return None if t is None else t.mm

    def room_for(self, n: int) -> mmap.mmap | None:
        """The current table's buffer when it takes ``n`` more keys without growing
        (``add_slots``' rule: at most ``GROW_LOAD`` full), else None: the keys then go
        in through ``add_slots``, which grows it.  A commit hands the buffer to
        ``BlockTable.commit``, which publishes the keys it commits in the same call."""
        t = self._table
        return None if t is None or self._rebuild_for(t, n) else t.mm

    @staticmethod
    def _rebuild_for(t: _Table, n: int) -> int:
        """0 when ``t`` takes ``n`` more keys as it is (used entries, tombstones too, at
        most ``GROW_LOAD`` of it), else the entries of the table to rebuild it into,
        sized for its live keys (a rebuild leaves its tombstones behind): grown for them
        as before when they need it, else the same size while they and ``n`` more fill
        at most a third of it (twice that past a third: a rebuild at once again).
        (Sized for the used entries, a pool that evicts as it commits doubled its table
        at every rebuild, without bound: the tombstones of its evictions counted as
        keys.)"""
        _, live, used, _ = _native.index_info(t.mm)
        if capacity_for(used + n, t.capacity) == t.capacity:
            return 0
        grown = capacity_for(live + n, t.capacity)
        if grown > t.capacity:
            return grown
        return t.capacity if 3 * (live + n) <= t.capacity else 2 * t.capacity

    def add_slots(self, table: memoryview, slots: npt.NDArray[np.uint64], segment_id: int,
                  slot_bytes: int, *, room: int = 0, threads: int = 1) -> list[int]:
        """Publish the keys of COMMITTED slot-table entries (an adopted extent's blocks),
        read from ``table`` itself: no Python object per key.  Returns the indices into
        ``slots`` left out -- a key the table holds already, or one past the probe
        limit -- for the caller (which copy stays; ``add`` keeps the others apart).
        ``room``: keys still to come (recovery's count of every extent's blocks): the
        table grows once, for them all, instead of doubling extent by extent (each
        growth copies every key), to at most ``GROW_LOAD`` full.  ``threads``: insert on
        up to that many threads (recovery, before the daemon serves: a thread owns a
        range of the table; csrc/index.c ``set_slots_par``)."""
        slots = np.ascontiguousarray(slots, dtype=np.uint64)
        left: list[int] = []
        t = self._table
        if t is None:
            return list(range(len(slots)))
        want = self._rebuild_for(t, max(len(slots), room))
        if want:
            if self._replace(want) is None:
                return list(range(len(slots)))
            if self._table is not None and want * ENTRY_BYTES >= POPULATE_MIN_BYTES:
                self._table.populate_in_background()
        at = 0
        while self._table is not None and at < len(slots):
            # (More threads only once the table's pages are in: while its populating
            # thread runs, inserts on more threads fault the same memfd it fills, and
            # were slower than one.)
            n = threads if not self._table.populating else 1
            at, out = _native.index_set_slots(self._table.mm, table, slots, segment_id,
                                              slot_bytes, at, n)
            left += out
            if at < len(slots) and self._replace() is None:
                left += range(at, len(slots))
                break
        self._flags()
        return left

    def find_many(self, keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
        """The daemon's batch lookup (the table as its key index): each key's
        block's slot ref (``kvtier._slot_ref``), or 0 when the
        table does not hold it (hidden keys are absent).  A fingerprint match: a key
        that is not 16 bytes long is held as a hash, so the caller checks such hits
        against the slot entry's key (``BlockTable.match_keys``).  Keys the table left
        out (``unpublished``) are found there."""
        t = self._table
        if t is None:
            out = np.zeros(len(keys), dtype=np.uint64)
        else:
            out = np.frombuffer(_native.index_find_many(t.mm, keys), dtype=np.uint64).copy()
        if self.unpublished:
            for i, key in enumerate(keys):
                loc = self.unpublished.get(key)
                if loc is not None and not out[i]:
                    out[i] = _slot_ref.encode(loc[0], loc[1])
        return out

    def fingerprints(self) -> list[bytes]:
        """The fingerprints of the published keys."""
        return [] if self._table is None else _native.index_fingerprints(self._table.mm)

    def rows(self) -> bytes:
        """The fingerprints of the published keys as 24-byte rows (``Store.check``:
        ``_native.index_rows``, no Python object per key)."""
        return b"" if self._table is None else _native.index_rows(self._table.mm)

    def close(self) -> None:
        """Stop publishing: the table is marked superseded (clients ask again, and get
        no table) and the daemon's mapping goes; clients' mappings stay until unmapped."""
        t, self._table = self._table, None
        if t is not None:
            _native.index_set_flags(t.mm, SUPERSEDED)
            t.close()

    def _flags(self) -> None:
        t = self._table
        if t is not None:
            lower = self._lower or bool(self.unpublished)
            _native.index_set_flags(t.mm, MISS_NOT_FINAL if lower else 0)

    def _replace(self, capacity: int = 0) -> _Table | None:
        """A new table holding the old one's keys (of ``capacity`` entries, else twice
        the size unless tombstones, not keys, filled it); the old one is marked
        superseded."""
        old = self._table
        assert old is not None
        _, live, _, _ = _native.index_info(old.mm)
        if not capacity:
            capacity = old.capacity * 2 if (live + 1) * 8 > old.capacity * 3 else old.capacity
            if capacity == old.capacity and live * 4 > old.capacity:
                capacity *= 2  # a rebuild at this size would leave it past a quarter full
        try:
            for _ in range(3):  # a key the copy skips (probe limit) would be lost: go larger
                new = (_take_prepared(self.namespace, capacity, self._max_probe)
                       or _Table(capacity, self._max_probe))
                _, skipped = _native.index_copy(new.mm, old.mm)
                if not skipped:
                    break
                new.close()
                capacity *= 2
            else:
                raise ValueError("its keys do not fit a table four times larger")
        except (OSError, ValueError) as exc:
            # The table stays (its keys are only fingerprints here: they cannot move);
            # the keys it cannot take are kept apart, and clients' misses go on to the
            # daemon (MISS_NOT_FINAL).
            log.warning("namespace %r: its shared index cannot grow past %d entries (%s); "
                        "keys past it are found by the daemon only", self.namespace,
                        old.capacity, exc)
            return None
        self._table = new
        self._flags()
        _native.index_set_flags(old.mm, SUPERSEDED)  # after the new one is complete
        old.close()
        return new


class SessionPage:
    """A session's page (``csrc/layout.h``'s ``KVT_PAGE_*``), which its client writes:

    * counters: the lookups, hit and missed keys it answered from the table, and
      its acquires without a call, their hit and missed keys and bytes; ``take``
      returns what was added since the last ``take``;
    * hazards: one per block the client leases without a call, each with its
      lease's serial (the daemon never reuses such a slot, see ``csrc/index.c``;
      ``expire`` ends leases held past the TTL as the daemon ends its own);
    * a ring of the blocks it read that way (``accessed``: read hints, CLOCK bits).

    The page is the client's to write, so it is trusted for nothing the daemon
    relies on: its counts are kept apart as client-reported (``kvtierd.counters``),
    and one that went backwards or jumped implausibly adds 0; a hazard
    only keeps slots of the session's own namespace (at most ``HAZARDS_N``), a
    ring entry names a block the store looks up and checks.  The memfd is sealed
    against resizing (a client cannot make a read fault)."""

    #: Most a counter may grow between two takes and still be believed.
    MAX_STEP: Final = 1 << 40
    #: Lookups or acquires a session may report per second: above what one process
    #: does without a call (each is a few microseconds of searching and fencing).
    MAX_CALLS_PER_SECOND: Final = 1 << 20
    #: Keys a session's lookups may report per second (hit and missed).
    MAX_KEYS_PER_SECOND: Final = 1 << 24
    #: Blocks a session's acquires may report leasing per second (and with them,
    #: ``block_bytes`` each, the bytes leased: 64 GiB/s of 64 KiB blocks per session;
    #: a namespace's sessions together are held to the host's memory bandwidth,
    #: ``kvtierd.counters.HOST_READ_BYTES_PER_SECOND``).
    MAX_BLOCKS_PER_SECOND: Final = 1 << 20

    def __init__(self, namespace: str, max_leases: int = 1 << 32, *, writes: bool = False,
                 max_reservations: int = 1 << 32, max_hazards: int = HAZARDS_N) -> None:
        """``max_leases``: the session's lease limit, written for the client to honour
        (an Acquire call counts the page's leases against it too).  ``writes``: the
        page has a write area (grants and the commit ring, ``csrc/writes.c``), and
        ``max_reservations`` is written for the client to honour likewise.
        ``max_hazards``: the hazard entries the client may use (the daemon reads
        none past them; a client that needs more makes the Acquire call)."""
        self.namespace = namespace
        #: Hazard entries read here: [0, max_hazards), fixed for the session's life.
        self.max_hazards = max(0, min(max_hazards, HAZARDS_N))
        fd, self._mm = sealed_memfd("kvtier-session", WPAGE_BYTES if writes else PAGE_BYTES,
                                    _F_SEAL_SHRINK | _F_SEAL_GROW)
        struct.pack_into("<QQ", self._mm, _MAX_LEASES, max_leases, max_reservations)
        struct.pack_into("<Q", self._mm, _MAX_HAZARDS, MAX_HAZARDS_SET | self.max_hazards)
        # The hazards as last read (``_read``): their words, serials and what they give.
        self._hz_raw = b""
        self._hz_words: npt.NDArray[np.uint64] = _NO_WORDS
        self._hz_set: frozenset[int] | None = frozenset()
        self._hz_leases = 0
        # For ``expire``: the words and serials the last sweep saw, and since when
        # each entry has held what it holds.
        self._ex_raw = b""
        self._ex_hz = np.zeros(0, dtype=np.uint64)
        self._ex_serial = np.zeros(0, dtype=np.uint64)
        self._ex_since = np.zeros(0, dtype=np.float64)
        self.fd: int | None = fd
        self.writes = writes
        #: Commit records taken so far (the daemon's own count; the page's is the client's).
        self._w_tail = 0
        self._last = (0,) * _page.COUNTERS_N
        self._taken_at: float | None = None
        #: Whether the last ``take`` cut a step (backwards, a jump, past a bound).
        self.cut = False
        self._ring_tail = 0

    @property
    def mapping(self) -> mmap.mmap:
        return self._mm

    def take(self, *, max_keys: int | None = None, block_bytes: int | None = None,
             clock: Callable[[], float] = time.monotonic) -> tuple[int, ...]:
        """(lookups, lookup hits, lookup misses, acquires, acquire hits, acquire misses,
        bytes leased) added since the last take.

        The client writes these: a step that went backwards or jumped past
        ``MAX_STEP`` is 0, and with ``max_keys`` and ``block_bytes`` (the keys one
        call can name, the bytes one block can hold) every step is also cut to
        what the client could have done: the keys hit or missed to ``max_keys``
        per lookup or acquire, the bytes leased to ``block_bytes`` per acquired
        key, and all of them to rates no client reaches without a call
        (``MAX_*_PER_SECOND`` over the time since the last take, plus a second).
        ``cut`` says whether this take cut anything.  What comes out is the
        client's word all the same: the daemon keeps it apart from its own figures
        (``kvtierd.counters``)."""
        now = struct.unpack_from(f"<{_page.COUNTERS_N}Q", self._mm, _page.COUNTERS)
        raw = tuple(n - last for n, last in zip(now, self._last, strict=True))
        steps = [d if 0 <= d <= self.MAX_STEP else 0 for d in raw]
        self._last = now
        t = clock()
        if max_keys is not None and block_bytes is not None:
            # Seconds this take covers, plus one of slack (the first take: two).
            span = 1.0 + (min(max(t - self._taken_at, 0.0), 3600.0)
                          if self._taken_at is not None else 1.0)
            calls = int(self.MAX_CALLS_PER_SECOND * span)
            lookups, hits, misses, acquires, got, missed, nbytes = steps
            lookups, acquires = min(lookups, calls), min(acquires, calls)
            keys = min(lookups * max_keys, int(self.MAX_KEYS_PER_SECOND * span))
            hits = min(hits, keys)
            misses = min(misses, keys - hits)
            blocks = min(acquires * max_keys, int(self.MAX_BLOCKS_PER_SECOND * span))
            got = min(got, blocks)
            missed = min(missed, blocks - got)
            nbytes = min(nbytes, got * block_bytes)
            steps = [lookups, hits, misses, acquires, got, missed, nbytes]
        self._taken_at = t
        self.cut = tuple(steps) != raw
        return tuple(steps)

    # ------------------------------------------------------------ hazards
    # The client changes its hazards at any time, as often as it likes; the daemon
    # reads them for every reserve of the namespace, so reading is made to cost what
    # changed: the entries' words are copied out (one memcpy of at most 6 KiB) and
    # parsed only when they differ from the last copy.  A copy is a plain read of
    # aligned words; the callers fence first (``fence``), as the handshake with
    # ``index_acquire`` needs.  Entries past ``max_hazards`` (or the client's bound
    # word) are never read.
    def _bound(self) -> int:
        hi: int = struct.unpack_from("<Q", self._mm, _HAZARD_HI)[0]
        return min(hi, self.max_hazards)

    def hazard_words(self) -> npt.NDArray[np.uint64]:
        """The hazard values the page holds now, sorted, each once, read-only (call
        after ``fence``).  The same array while the page's words do not move."""
        if not self.max_hazards:
            return self._hz_words
        n = self._bound()
        raw = self._mm[_HAZARDS:_HAZARDS + 8 * n]
        if raw != self._hz_raw:
            words = np.frombuffer(raw, dtype="<u8")
            unique = np.unique(words[words != 0]).astype(np.uint64, copy=False)
            unique.flags.writeable = False
            self._hz_words = unique
            self._hz_set = None  # made when asked
            self._hz_raw = raw
            self._hz_leases = -1  # counted when asked
        return self._hz_words

    def hazards(self) -> frozenset[int]:
        """``hazard_words`` as a set (tests and per-value questions; the reserve path
        uses the array)."""
        words = self.hazard_words()
        if self._hz_set is None:
            self._hz_set = frozenset(words.tolist())
        return self._hz_set

    def leases(self) -> int:
        """Leases the client holds without a call (distinct serials among its hazards)."""
        fence()
        self.hazard_words()
        if self._hz_leases < 0:
            words = np.frombuffer(self._hz_raw, dtype="<u8")
            serials = np.frombuffer(self._mm, dtype="<u8", count=len(words), offset=_SERIALS)
            self._hz_leases = len(np.unique(serials[words != 0]))
        return self._hz_leases

    def expire(self, now: float, ttl: float) -> int:
        """End the leases held for ``ttl`` seconds or more, as the daemon ends its own:
        their hazards go back to 0 (the client's release then says the lease expired).
        A hazard the client released and made again is a new one (a new serial).
        Returns the number of leases ended.

        Vectorized over the entries: an entry holds the same lease while its word and
        serial are those of the last sweep; a page unchanged since then, whose oldest
        lease is not due, costs one comparison."""
        n = self._bound()
        raw = self._mm[_HAZARDS:_HAZARDS + 8 * n] + self._mm[_SERIALS:_SERIALS + 8 * n]
        if raw == self._ex_raw and not (now - self._ex_since[self._ex_hz != 0] >= ttl).any():
            return 0
        words = np.frombuffer(raw, dtype="<u8", count=n)
        serials = np.frombuffer(raw, dtype="<u8", count=n, offset=8 * n)
        m = min(n, len(self._ex_hz))
        since = np.full(n, now, dtype=np.float64)
        same = (words[:m] == self._ex_hz[:m]) & (serials[:m] == self._ex_serial[:m])
        since[:m][same] = self._ex_since[:m][same]
        due = np.flatnonzero((words != 0) & (now - since >= ttl))
        ended: set[int] = set()
        for i in due.tolist():
            if _native.hazards_expire(self._mm, i, int(words[i])):
                ended.add(int(serials[i]))
        self._ex_raw, self._ex_hz, self._ex_serial = raw, words, serials
        self._ex_since = since
        return len(ended)

    def accessed(self) -> list[int]:
        """The hazard values of the blocks read since the last call (at most ``RING_N``;
        duplicates and garbage possible: the client wrote them)."""
        head = struct.unpack_from("<Q", self._mm, _RING_HEAD)[0]
        tail = self._ring_tail
        if head == tail:
            return []
        self._ring_tail = head
        n = head - tail
        if not 0 < n <= RING_N:  # lapped, or went backwards: the latest RING_N
            n = RING_N if n > 0 else 0
        if n == 0:
            return []
        ring = struct.unpack_from(f"<{RING_N}Q", self._mm, _RING)
        return [ring[(head - n + i) % RING_N] for i in range(n)]

    # ------------------------------------------------------------ the write area
    def set_grant(self, i: int, word: int) -> None:
        """Name a granted slot in entry ``i`` (0: none).  The daemon writes an entry
        only while it holds no grant there, so no writer is filling it."""
        _native.page_store(self._mm, _W_GRANTS + 8 * i, word)

    def grant_word(self, i: int) -> int:
        value: int = struct.unpack_from("<Q", self._mm, _W_GRANTS + 8 * i)[0]
        return value

    def revoke_grant(self, i: int, word: int) -> bool:
        """Take back grant ``i`` unless its writer has taken it (then False)."""
        return _native.page_cas(self._mm, _W_GRANTS + 8 * i, word, 0)

    def local_reservations(self) -> int:
        """Reservations the client says it holds from grants (its word: the store
        believes at most as many as the session holds grants)."""
        value: int = struct.unpack_from("<Q", self._mm, _LOCAL_RESERVATIONS)[0]
        return value

    def wanted(self) -> int:
        """How many grants the client asks to have (its word: bounded by the caller)."""
        value: int = struct.unpack_from("<Q", self._mm, _W_WANT)[0]
        return value

    def take_commits(self, max_length: int = 0xFFFF_FFFF,
                     held: npt.NDArray[np.uint64] | None = None) -> PageRecords | None:
        """The commit records published since the last call, copied out of the page, with
        each batch checked against ``max_length`` and ``held`` (the session's grant
        words; None: it holds none); None when the client's head is impossible (behind,
        or more than the ring holds), which ends this page's writes: the records are
        skipped."""
        head, batches, keys, columns, flags = _native.commits_take(
            self._mm, self._w_tail, max_length, held)
        if batches is None or keys is None or columns is None or flags is None:
            self._w_tail = head
            _native.commits_done(self._mm, head, b"")  # its waiters wake up to nothing
            return None
        return PageRecords(batches, keys,
                           np.frombuffer(columns, dtype=np.uint64).reshape(6, len(keys)), flags)

    @property
    def commits_tail(self) -> int:
        """Where the next commit records begin (the records before it were answered)."""
        return self._w_tail

    def grant(self, held: npt.NDArray[np.uint64], gens: npt.NDArray[np.uint64],
              refs: npt.NDArray[np.uint64], ref_gens: npt.NDArray[np.uint64]) -> None:
        """Name ``refs`` in the first entries that hold no grant, in ``held`` (the
        daemon's words of every entry, with their generations in ``gens``: both
        written) and in the page, one native call (``grants_grant``)."""
        _native.grants_grant(self._mm, held, gens, np.ascontiguousarray(refs, dtype=np.uint64),
                             np.ascontiguousarray(ref_gens, dtype=np.uint64))

    def set_grants(self, entries: npt.NDArray[np.uint64], words: npt.NDArray[np.uint64]) -> None:
        """``set_grant`` of several entries in one call."""
        _native.grants_store(self._mm, entries, words)

    def finish_commits(self, results: bytes) -> None:
        """Each taken record's result, then DONE (the writers waiting wake up)."""
        _native.commits_done(self._mm, self._w_tail, results)
        self._w_tail += len(results)

    def finished_commits(self, n: int) -> None:
        """The ``n`` records from the tail were answered already, natively
        (``BlockTable.commit_ring``'s ``answer_min``): the tail moves past them."""
        self._w_tail += n

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.close_fd()
        self._mm.close()


def fence() -> None:
    """A full fence: the daemon's removals from a table come before its reads of the
    pages that follow (its half of ``index_acquire``'s handshake)."""
    _native.hazards_collect(())


def collect_hazards(pages: Iterable[SessionPage], last: HazardSet | None = None) -> HazardSet:
    """Every hazard ``pages`` hold, read after a full fence (so after every removal
    from the table this thread made before the call).  Pages whose words did not
    move since they were last read cost a comparison (``SessionPage.hazard_words``),
    and those with no share are not read at.  ``last``: the set an earlier call
    returned for the same pages, returned again if no page moved (its union and
    refs, made once, are kept)."""
    fence()
    arrays = [w for p in pages if p.max_hazards and len(w := p.hazard_words())]
    if last is not None and len(last._arrays) == len(arrays) and all(
            a is b for a, b in zip(last._arrays, arrays, strict=True)):
        return last
    return HazardSet(arrays)


class HazardSet(AbstractSet[int]):
    """The union of some pages' hazards as of one ``collect_hazards``, as numpy
    arrays: however many values a client writes, the daemon spends no Python step
    on each (the union, sorted, and the refs the hazards name are made once, when
    first asked)."""

    __slots__ = ("_arrays", "_words", "_refs")

    def __init__(self, arrays: list[npt.NDArray[np.uint64]]) -> None:
        self._arrays = arrays
        self._words: npt.NDArray[np.uint64] | None = None
        self._refs: npt.NDArray[np.uint64] | None = None

    @property
    def words(self) -> npt.NDArray[np.uint64]:
        """Every hazard value, sorted, each once."""
        if self._words is None:
            if not self._arrays:
                self._words = _NO_WORDS
            elif len(self._arrays) == 1:
                self._words = self._arrays[0]
            else:
                self._words = np.unique(np.concatenate(self._arrays))
        return self._words

    @property
    def refs(self) -> npt.NDArray[np.uint64]:
        """The slot refs the hazards name (their flag bit off), sorted, each once."""
        if self._refs is None:
            words = self.words
            if not len(words) or words[0] & _HAZARD_BIT64:
                # Every word has the flag (the smallest has it): the refs keep their order.
                self._refs = words & _REF_BITS
            else:
                self._refs = np.unique(words & _REF_BITS)
        return self._refs

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int) or not 0 <= value < 1 << 64:
            return False
        return self.any_of(np.array([value], dtype=np.uint64))

    def any_of(self, values: npt.NDArray[np.uint64]) -> bool:
        """One of ``values`` is a hazard (a binary search each: the hazards may be
        thousands, the values few)."""
        words = self.words
        if not len(words) or not len(values):
            return False
        at = np.minimum(np.searchsorted(words, values), len(words) - 1)
        return bool((words[at] == values).any())

    def __bool__(self) -> bool:
        return bool(self._arrays)

    def __len__(self) -> int:
        return len(self.words)

    def __iter__(self) -> Iterator[int]:
        return iter(self.words.tolist())
