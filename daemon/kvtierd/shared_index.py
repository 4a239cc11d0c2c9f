"""The shared index: a namespace's DRAM keys, published for its clients to search.

A ``Lookup`` is the call a serving engine makes most (one per request, often
per step), and the one that needs nothing but the index.  So the daemon
publishes each namespace's committed DRAM keys in a flat hash table in shared
memory (layout and concurrency in ``csrc/index.c``), hands its clients the
table read-only with the segments, and a client answers a lookup by itself:
no round trip, no daemon CPU.

The daemon is the only writer, from the event loop, and the table mirrors the
store's index exactly: ``KeyIndex`` (the ``Namespace.index`` mapping) writes
every key that enters or leaves it.  A key enters only at commit (or at
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

import fcntl
import itertools
import logging
import mmap
import os
import secrets
import struct
from collections.abc import Iterable
from typing import Final, TypeVar

from kvtier import _accel

log = logging.getLogger(__name__)

try:
    from kvtier import _native
except ImportError:  # not built: nothing is published, clients call Lookup
    _native = None  # type: ignore[assignment]

#: Whether this build can publish (the table code is native only).
AVAILABLE: Final = _native is not None and _accel.NATIVE

HEADER_BYTES: Final = 64
ENTRY_BYTES: Final = 32
#: A new namespace's table: 1024 entries (32 KiB); it doubles as keys arrive.
MIN_CAPACITY: Final = 1024
#: Entries a probe may visit (csrc/index.c's limit): honest keys never need that many.
MAX_PROBE: Final = 1024
#: The header's flags word (csrc/index.h).
SUPERSEDED: Final = 1
MISS_NOT_FINAL: Final = 2
#: The tier a published key is in (the wire's TIER_DRAM).
TIER_DRAM: Final = 1
#: Bytes of a session's lookup counters page (three u64s used).
COUNTERS_BYTES: Final = 4096

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


class _Table:
    """One table file: its fd and the daemon's writable mapping."""

    def __init__(self, capacity: int, max_probe: int) -> None:
        self.capacity = capacity
        self.serial = next(_serials)
        self.fd, self.mm = sealed_memfd(
            "kvtier-index", HEADER_BYTES + capacity * ENTRY_BYTES,
            _F_SEAL_SHRINK | _F_SEAL_GROW | _F_SEAL_FUTURE_WRITE)
        _native.index_format(self.mm, capacity, secrets.randbits(64), max_probe)

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


class SharedIndex:
    """The published table of one namespace (see the module doc)."""

    def __init__(self, namespace: str, *, lower_tiers: bool,
                 max_probe: int = MAX_PROBE) -> None:
        self.namespace = namespace
        self._max_probe = max_probe
        #: Keys the table could not take (past the probe limit): misses are not final.
        self.unpublished: set[bytes] = set()
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

    def add(self, key: bytes) -> None:
        t = self._table
        if t is None:
            return
        r = _native.index_set(t.mm, key, TIER_DRAM, 0)
        if r < 0 or (r == 0 and self._half_full(t)):
            # Full, or a probe ran the limit in a table past half full: a longer
            # cluster than honest keys make below half.  Grow (then it is not).
            t = self._replace()
            if t is None:
                return
            r = _native.index_set(t.mm, key, TIER_DRAM, 0)
        if r > 0:
            if self.unpublished:
                self.unpublished.discard(key)
                self._flags()
        elif key not in self.unpublished:
            self.unpublished.add(key)
            self._flags()

    @staticmethod
    def _half_full(t: _Table) -> bool:
        return bool(_native.index_info(t.mm)[2] * 2 > t.capacity)

    def discard(self, key: bytes) -> None:
        t = self._table
        if t is None:
            return
        if not _native.index_remove(t.mm, key) and key in self.unpublished:
            self.unpublished.discard(key)
            self._flags()

    def add_many(self, keys: Iterable[bytes]) -> None:
        """``add`` of each key, in bulk (a recovered namespace's keys)."""
        todo = list(keys)
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
            at, skipped = _native.index_set_many(self._table.mm, todo, TIER_DRAM, at)
            self.unpublished.update(todo[i] for i in skipped)
            if at < len(todo) and self._replace() is None:
                return
        t = self._table
        if self.unpublished and t is not None and self._half_full(t) and self._replace():
            for key in list(self.unpublished):
                self.add(key)  # (leaves the set when it goes in)
        self._flags()

    def fingerprints(self) -> list[bytes]:
        """The fingerprints of the published keys (for ``Store.check``)."""
        return [] if self._table is None else _native.index_fingerprints(self._table.mm)

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
                new = _Table(capacity, self._max_probe)
                _, skipped = _native.index_copy(new.mm, old.mm)
                if not skipped:
                    break
                new.close()
                capacity *= 2
            else:
                raise ValueError("its keys do not fit a table four times larger")
        except (OSError, ValueError) as exc:
            log.warning("namespace %r: its shared index cannot grow past %d entries (%s); "
                        "its clients' lookups go to the daemon from now on",
                        self.namespace, old.capacity, exc)
            self.close()
            return None
        self._table = new
        self._flags()
        _native.index_set_flags(old.mm, SUPERSEDED)  # after the new one is complete
        old.close()
        return new


class LookupCounters:
    """A session's lookup counters page: the client adds its lookups, hit keys and
    missed keys there (three little-endian u64s); ``take`` returns what was added
    since the last ``take``.  The page is the client's to write, so its values are
    trusted for nothing: a count that went backwards or jumped implausibly adds 0.
    The memfd is sealed against resizing (a client cannot make a read fault)."""

    #: Most a counter may grow between two takes and still be believed.
    MAX_STEP: Final = 1 << 40

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        fd, self._mm = sealed_memfd("kvtier-lookups", COUNTERS_BYTES,
                                    _F_SEAL_SHRINK | _F_SEAL_GROW)
        self.fd: int | None = fd
        self._last = (0, 0, 0)

    def take(self) -> tuple[int, int, int]:
        now = struct.unpack_from("<3Q", self._mm, 0)
        steps = tuple(n - last if 0 <= n - last <= self.MAX_STEP else 0
                      for n, last in zip(now, self._last, strict=True))
        self._last = now
        return steps  # type: ignore[return-value]

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.close_fd()
        self._mm.close()


_V = TypeVar("_V")


class KeyIndex(dict[bytes, _V]):
    """A namespace's key index (a dict) that mirrors its keys into a ``SharedIndex``.

    Only the mutations the store makes are supported: ``d[k] = v``, ``del d[k]``
    and ``update(pairs)``.  Reads are the plain dict's.
    """

    __slots__ = ("shared",)

    def __init__(self) -> None:
        super().__init__()
        self.shared: SharedIndex | None = None

    def __setitem__(self, key: bytes, value: _V) -> None:
        if self.shared is not None and key not in self:
            self.shared.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: bytes) -> None:
        super().__delitem__(key)
        if self.shared is not None:
            self.shared.discard(key)

    def update(self, pairs: Iterable[tuple[bytes, _V]]) -> None:  # type: ignore[override]
        if self.shared is None:  # nothing to mirror (recovery publishes afterwards): C speed
            dict.update(self, pairs)
            return
        for key, value in pairs:
            self[key] = value

    def publish(self, shared: SharedIndex | None) -> None:
        """Start mirroring into ``shared`` (its keys now: all of this index's)."""
        self.shared = shared
        if shared is not None:
            shared.add_many(self)

    def _unsupported(self, *args: object, **kwargs: object) -> None:
        raise TypeError("KeyIndex supports d[k] = v, del d[k] and update() only")

    pop = popitem = clear = setdefault = __ior__ = _unsupported  # type: ignore[assignment]
