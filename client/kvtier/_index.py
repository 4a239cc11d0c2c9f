"""The namespace's shared index, mapped here: lookups without a call.

kvtierd publishes each namespace's DRAM keys in a table in shared memory
(``kvtierd.shared_index``; layout and concurrency in ``csrc/index.c``) and
sends it, read-only, with the session.  ``LocalIndex.lookup`` searches it in
native code: a 64-key lookup costs about a microsecond instead of a round
trip to the daemon.  It answers only what the table can: ``None`` when it
cannot (the table was replaced, a key is malformed, more keys than the daemon
takes in one call), and ``final=False`` when a miss may still be a hit below
DRAM; the client then calls ``Lookup`` as before.  What this session looked up
here is added to its session page, which the daemon reads into its metrics.

``LocalIndex.acquire`` leases blocks the same way, without a call: it publishes
a hazard for each block's slot in the session page and checks that the table
did not change meanwhile (``csrc/index.c``); the daemon never reuses a slot a
page names, and the session's end (a SIGKILL included) drops them all.

``LocalWrites`` writes without a Reserve call (``csrc/writes.c``): the daemon
keeps slots granted ahead in the page's write area; a writer takes some, fills
them, publishes one commit record per block in the page's ring, rings the
daemon's doorbell (a pipe) and waits on the page's DONE word for the results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Final, NamedTuple

import numpy as np

from kvtier import _accel, _page, _slot_ref

try:
    from kvtier import _native
except ImportError:  # not built: the client calls Lookup
    _native = None  # type: ignore[assignment]

#: Whether this build can search a shared index.
AVAILABLE: Final = _native is not None and _accel.NATIVE
#: The page's layout (csrc/layout.h, read through ``kvtier._page``): the header's flags
#: word; the session page, its hazards' bound word, how many hazards it holds; the write
#: area, its wanted-grants word, how many grants and records it holds; a record's results.
SUPERSEDED: Final = _page.SUPERSEDED
PAGE_BYTES: Final = _page.PAGE_BYTES
_HAZARD_HI: Final = _page.HAZARD_HI
_MAX_LEASES: Final = _page.MAX_LEASES
_MAX_RESERVATIONS: Final = _page.MAX_RESERVATIONS
_LOCAL_RESERVATIONS: Final = _page.LOCAL_RESERVATIONS
_MAX_HAZARDS: Final = _page.MAX_HAZARDS  # daemon-written: SET | entries this session may use
_MAX_HAZARDS_SET: Final = _page.MAX_HAZARDS_SET
HAZARDS_N: Final = _page.HAZARDS_N
WPAGE_BYTES: Final = _page.WPAGE_BYTES
_W_WANT: Final = _page.W_WANT
GRANTS_N: Final = _page.GRANTS_N
RING_RECORDS: Final = _page.RING_RECORDS
#: Longest key (a commit record's, as the slot table's).
MAX_KEY_BYTES: Final = _page.KEY_MAX
COMMITTED: Final = _page.COMMITTED
EXISTS: Final = _page.EXISTS
INVALID: Final = _page.INVALID
LOST: Final = _page.LOST
FAILED: Final = _page.FAILED
#: How long a writer waits for the daemon between checks that the session lives.
_WAIT_SLICE: Final = 0.5


class LocalSlot(NamedTuple):
    """Where a block leased without a call is (the fields of the wire's ``SlotRef``)."""

    segment_id: int
    offset: int
    length: int
    checksum: int
    has_checksum: bool


def _hazard_limit(page: mmap.mmap) -> int:
    """The hazard entries this session may use: the daemon's word (its share of the
    uid's and the namespace's limits), or all of them from an older daemon."""
    word: int = struct.unpack_from("<Q", page, _MAX_HAZARDS)[0]
    return min(word & ~_MAX_HAZARDS_SET, HAZARDS_N) if word & _MAX_HAZARDS_SET else HAZARDS_N


class _Hazards:
    """Which of the page's hazard entries are in use (first fit, under a lock), and how
    many leases hold them; keeps the page's bound word (the daemon reads entries below
    it) up to date."""

    def __init__(self, words: np.ndarray, limit: int = 0) -> None:
        """``limit``: the entries [0, limit) the daemon reads (its share for this
        session); a lease that does not fit below it is made with the Acquire call."""
        self._used = bytearray(HAZARDS_N)
        self._limit = limit
        self._words = words  # the page's u64s at _HAZARD_HI (the bound), _MAX_LEASES
        self._hi = 0
        self.leases = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> int | None:
        with self._lock:
            if self.leases >= self._words[2]:  # the session's lease limit: ask the daemon
                return None
            at = self._used.find(bytes(n), 0, self._limit)
            if at < 0:
                return None
            self._used[at:at + n] = b"\1" * n
            self.leases += 1
            if at + n > self._hi:
                self._hi = at + n
                self._words[0] = self._hi  # before the hazards themselves
            return at

    def give(self, at: int, n: int, *, lease: bool = True) -> None:
        """Entries at..at+n are free again (and, with ``lease``, so is their lease)."""
        with self._lock:
            self._used[at:at + n] = bytes(n)
            self.leases -= lease
            if at + n >= self._hi:
                self._hi = self._used.rfind(b"\1") + 1
                self._words[0] = self._hi


class Grant(NamedTuple):
    """A slot the daemon reserved ahead for this session, taken by this writer."""

    entry: int  # its entry in the page
    word: int  # the entry's value: VALID | slot ref (kvtier._slot_ref)

    @property
    def segment_id(self) -> int:
        return _slot_ref.segment_of(self.word) & _page.GRANT_SEGMENT_MASK

    @property
    def slot(self) -> int:
        return _slot_ref.slot_of(self.word)


class TakenGrants:
    """Grants taken by one writer, as columns (``grants_take_columns``): no object per
    grant on the put path.  Iterating (or indexing) makes the ``Grant`` of each, for the
    rare paths (giving grants back, tests)."""

    __slots__ = ("entries", "words", "segment_ids", "offsets")

    def __init__(self, entries: list[int], words: list[int], segment_ids: list[int],
                 offsets: list[int]) -> None:
        #: Each grant's entry in the page, and the word taken there.
        self.entries = entries
        self.words = words
        #: Where each grant's slot is: its segment, and its byte offset in the segment's data.
        self.segment_ids = segment_ids
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __getitem__(self, i: int) -> Grant:
        return Grant(self.entries[i], self.words[i])

    def __iter__(self) -> Iterator[Grant]:
        return map(Grant, self.entries, self.words)


#: No grants (a reservation whose keys all exist).
NO_GRANTS: Final = TakenGrants([], [], [], [])


@dataclasses.dataclass(frozen=True, slots=True)
class CommitColumns:
    """A commit's records as columns (``commits_put_columns``): per record, its grant's
    entry and word, the key, the length and the checksum (``sums`` None: none at all)."""

    entries: Sequence[int]
    words: Sequence[int]
    keys: Sequence[bytes]
    lengths: Sequence[int]
    sums: Sequence[int | None] | None

    def __len__(self) -> int:
        return len(self.entries)


#: What one ring writes (an eventfd takes exactly 8 bytes: the value to add).
_RING_BYTES: Final = struct.pack("<Q", 1)


class LocalWrites:
    """The session page's write area: grants to take, the commit ring, the doorbell."""

    def __init__(self, page: mmap.mmap, doorbell_fd: int) -> None:
        """``doorbell_fd`` stays the caller's to close (this keeps a duplicate)."""
        self._page = page
        self._bell = os.dup(doorbell_fd)
        self._lock = threading.Lock()
        #: Held from a commit's ``publish`` to its ``wait``'s end: one commit in the ring
        #: at a time (a lock of its own: a writer opens its next reservation, which
        #: takes ``_lock``, while its commit is in flight).
        self._ring_lock = threading.Lock()
        self._head = 0
        self._want = 0
        #: The session's reservation limit (the daemon's word); reservations made here
        #: count against it with the Reserve calls' (the daemon reads ``opened``).
        self.max_reservations = struct.unpack_from("<Q", page, _MAX_RESERVATIONS)[0]
        self._opened = 0

    def opened(self, delta: int) -> None:
        """A reservation from grants began (+1) or ended (-1): the page says how many
        are open, for the daemon's reservation limit."""
        with self._lock:
            self._opened = max(0, self._opened + delta)
            try:
                _native.page_store(self._page, _LOCAL_RESERVATIONS, self._opened)
            except ValueError:
                pass  # unmapped: the session is over

    def take(self, n: int) -> list[Grant] | None:
        """Take ``n`` grants (this writer's until committed or ``untake``n), or None when
        the page has fewer: the page then asks for ``n``, which the daemon grants after
        the writer's next Reserve call or commit."""
        if not 0 < n <= min(GRANTS_N, RING_RECORDS):
            return None
        got = _native.grants_take(self._page, n)
        if got is None:  # the Reserve call the caller makes instead brings more
            self._ask_for(n)
            return None
        return [Grant._make(g) for g in got]

    def _ask_for(self, n: int) -> None:
        """The page had fewer than ``n`` grants: it asks for ``n`` (the daemon grants as
        many after the writer's next Reserve call or commit)."""
        if n > self._want:
            self._want = n
            _native.page_store(self._page, _W_WANT, n)

    def take_columns(self, n: int, slot_bytes: int) -> TakenGrants | None:
        """``take`` as columns (no object per grant), with where each slot is (its
        segment, and ``slot * slot_bytes``); None as ``take``."""
        if not 0 < n <= min(GRANTS_N, RING_RECORDS):
            return None
        got = _native.grants_take_columns(self._page, n, slot_bytes)
        if got is None:
            self._ask_for(n)
            return None
        return TakenGrants(*got)

    def untake(self, grants: Sequence[Grant] | TakenGrants) -> None:
        """Give back grants taken and not committed (the daemon may take them back)."""
        if isinstance(grants, TakenGrants):
            grants = list(grants)
        if grants:
            _native.grants_untake(self._page, grants)

    def ring(self) -> None:
        """Wake the daemon: 8 bytes of 1 into the doorbell (the write end of a pipe the
        daemon reads; an older daemon's eventfd adds 1 for the same write).  A full
        pipe (EAGAIN) is a ring already pending."""
        try:
            os.write(self._bell, _RING_BYTES)
        except OSError:
            pass  # full (rung already), or closed: the session is over, and the wait says so

    def commit(self, records: list[tuple[int, int, bytes, int, int | None]] | CommitColumns,
               alive: Callable[[], bool], timeout: float) -> bytes:
        """Publish ``records`` (grant entry, grant word, key, length, checksum; or those
        columns) as one all-or-nothing commit, ring the daemon and wait for its results
        (one byte per record); raises TimeoutError (after ``timeout``) or
        ConnectionError (``alive`` said no)."""
        return self.wait(self.publish(records), alive, timeout)

    def publish(self, records: list[tuple[int, int, bytes, int, int | None]] | CommitColumns
                ) -> tuple[int, int]:
        """The first half of ``commit``: publish ``records`` and ring the daemon, without
        waiting; the ticket for ``wait``, which must follow (in any thread).

        From here to that ``wait`` the ring is this commit's: a commit of another
        thread waits, so the records in flight never exceed the ring and each
        writer's results are its own.  Raises ValueError (nothing published, the
        ring free again) for malformed records or an unmapped page."""
        self._ring_lock.acquire()
        try:
            start = self._head
            if isinstance(records, CommitColumns):
                self._head = _native.commits_put_columns(self._page, start, records.entries,
                                                         records.words, records.keys,
                                                         records.lengths, records.sums)
            else:
                self._head = _native.commits_put(self._page, start, records)
            self.ring()
        except BaseException:
            self._ring_lock.release()
            raise
        return start, len(records)

    def wait(self, ticket: tuple[int, int], alive: Callable[[], bool], timeout: float) -> bytes:
        """The second half of ``commit``: wait for the daemon's results of the records
        ``publish`` put (one byte per record) and free the ring; raises as ``commit``."""
        start, n = ticket
        try:
            waited = 0.0
            while not _native.done_wait(self._page, start + n, _WAIT_SLICE):
                waited += _WAIT_SLICE
                if not alive():
                    raise ConnectionError("the session ended while the daemon committed")
                if waited >= timeout:
                    raise TimeoutError(f"the daemon did not commit within {timeout:g} s")
            return _native.commit_results(self._page, start, n)
        finally:
            self._ring_lock.release()

    def close(self) -> None:
        bell, self._bell = self._bell, -1
        if bell >= 0:
            os.close(bell)


class LocalIndex:
    """The shared index's table mapped read-only, and this session's counters page."""

    def __init__(self, index_fd: int, page_fd: int, max_keys: int,
                 doorbell_fd: int | None = None) -> None:
        """Maps both (the fds stay the caller's to close); with ``doorbell_fd`` the page
        has a write area (``writes``)."""
        self.max_keys = max_keys
        self._table = _map_table(index_fd)
        try:
            size = os.fstat(page_fd).st_size
            self._page = mmap.mmap(page_fd, size, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._table.close()
            raise
        self._counters = np.frombuffer(self._page, dtype=np.uint64, count=3)
        #: Whether this daemon takes hazards (an older one sends a smaller page).
        self.can_lease = size >= PAGE_BYTES
        self._hazards = _Hazards(
            np.frombuffer(self._page, dtype=np.uint64, count=3, offset=_HAZARD_HI)
            if self.can_lease else np.zeros(3, dtype=np.uint64),
            _hazard_limit(self._page) if self.can_lease else 0)
        self._serials = itertools.count(1)
        #: Writes without a call, when the daemon offers them (else None).
        self.writes = (LocalWrites(self._page, doorbell_fd)
                       if doorbell_fd is not None and size >= WPAGE_BYTES else None)

    def lookup(self, keys: list[bytes]) -> tuple[bytes, bool] | None:
        """The tiers of the leading keys present, and whether the first miss is final
        (no tier below DRAM may hold it); None when the table cannot answer."""
        if not 0 < len(keys) <= self.max_keys:
            return None
        try:
            return _native.index_lookup(self._table, keys, self._counters)
        except ValueError:  # closed by another thread (the session was replaced)
            return None

    def acquire(self, keys: list[bytes]) -> tuple[list[LocalSlot], int, int] | None:
        """Lease the leading keys present, without a call: their slots, where their
        hazards start and the lease's serial (``release`` with the first two); None
        when the table cannot answer (the caller asks the daemon: a miss that is not
        final, a superseded table, duplicate keys, the session's lease limit...)."""
        n = len(keys)
        if not self.can_lease or not 0 < n <= min(self.max_keys, HAZARDS_N) or len(set(keys)) != n:
            return None
        at = self._hazards.take(n)
        if at is None:
            return None
        serial = next(self._serials)
        try:
            got = _native.index_acquire(self._table, keys, self._page, at, serial)
        except ValueError:  # closed by another thread (the session was replaced)
            got = None
        hits = 0 if got is None else len(got)
        if hits < n:
            self._hazards.give(at + hits, n - hits, lease=not hits)  # never published
        if got is None:
            return None
        return list(map(LocalSlot._make, got)), at, serial

    def release(self, at: int, n: int) -> bool:
        """End the lease of ``n`` blocks whose hazards start at ``at``; False if the
        daemon had ended it (held past its lease TTL) or the session is gone."""
        if not n:
            return True
        try:
            expired = _native.hazards_clear(self._page, at, n)
        except ValueError:  # closed: the session ended, and its hazards with it
            return False
        self._hazards.give(at, n)
        return expired == 0

    @property
    def superseded(self) -> bool:
        """The daemon replaced this table: ``replace`` it with the new one's fd."""
        return bool(_native.index_info(self._table)[3] & SUPERSEDED)

    def replace(self, index_fd: int) -> None:
        new = _map_table(index_fd)
        old, self._table = self._table, new
        try:
            old.close()
        except BufferError:
            pass  # a lookup in another thread still holds it; it goes with it

    def present(self, key: bytes) -> bool:
        """Whether the table holds ``key`` now (a hint: it may come or go at once)."""
        return self.present_many([key]) == b"\1"

    def present_many(self, keys: list[bytes]) -> bytes:
        """One byte per key: 1 if the table holds it now, else 0 (a hint, as ``present``;
        read under the table's seqlock, ``index_present_many``).  All 0 when the table
        cannot answer (closed by another thread: the session was replaced)."""
        try:
            return _native.index_present_many(self._table, keys)
        except ValueError:
            return bytes(len(keys))

    def close(self) -> None:
        if self.writes is not None:
            self.writes.close()
        self._counters = np.zeros(3, dtype=np.uint64)  # drop the views of the page
        self._hazards = _Hazards(np.zeros(3, dtype=np.uint64))
        for mm in (self._table, self._page):
            try:
                mm.close()
            except BufferError:
                pass  # a lookup in another thread still holds it; it goes with it


#: Linux MADV_POPULATE_READ (5.14+).
_MADV_POPULATE_READ: Final = 22


def _map_table(fd: int) -> mmap.mmap:
    """Map a table read-only, its page tables filled at once (MADV_POPULATE_READ: the
    pages are the daemon's, resident; a lookup of a million keys just after a warm
    restart would otherwise fault its tens of thousands of pages in one at a time)."""
    size = os.fstat(fd).st_size
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    with contextlib.suppress(OSError):  # older kernel: pages fault in on first touch
        mm.madvise(_MADV_POPULATE_READ)
    return mm
