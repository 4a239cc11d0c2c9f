"""The local SSD tier: preallocated spill files of fixed-size slots.

Mechanism with its own bookkeeping: which (namespace, key) is in which slot,
a CLOCK eviction order, and a byte budget (``capacity``).  It does not decide
*what* to spill (that is ``kvtierd.tiering``); it stores what it is given,
evicting its own entries when full (CLOCK: a referenced bit per slot, set when
an entry is read, and a hand per slot size that clears it and takes the first
unreferenced one), and hands evicted entries' bytes to ``on_evict``
first (the shared tier, when configured).

Bookkeeping in compact form (issue 26): no Python object per entry at rest.
Per spill file, columns of numpy arrays indexed by slot (state, readers,
referenced bit, namespace id: 8 bytes a slot) and a free stack (4 bytes a
slot); everything else an entry has (key, namespace, length, checksum,
geometry, write sequence) is read from the file's slot-table mirror, which
the tier keeps anyway to write table pages.  One open-addressing hash table
(linear probing, backward-shift deletion, load at most 3/4) maps the xxh3-64
of (namespace, key) to a slot id (a file's ``base`` + slot): 8 bytes a bucket,
the hash's upper half (which gives the home bucket) over slot id + 1.  A hit
is confirmed against the key and namespace bytes in the slot-table mirror, so
a hash collision is a probe more, never a wrong block.  ``find`` and friends
return an :class:`SsdEntry` made on demand: a snapshot, kept by nobody after
the call.  (docs/decisions.md, "The SSD tier's bookkeeping in columns".)

Threading: one lock guards the in-memory state; no I/O happens under it.
``find``/``find_many``/``length_of_many``/``remove``/``stats`` are O(keys) and safe on the
event loop (``find_many`` and ``length_of_many`` look a batch of keys up in one native call);
``write``/``sync``/``read_into``/``open``/``flush_frees`` block and run on
worker threads.  A slot being written is owned by its writer (``BUSY``); an
entry being read has ``readers > 0`` and is neither evicted nor reused until
the read ends (out of the index meanwhile it is ``REMOVED``, freed at its
last reader).

Files (format in ``spill.format``): ``spill-<slot_bytes>-<index>.kvt``, one
set per slot size, created on demand (``fallocate``) up to the budget -- the first small,
each next twice the last, up to ``spill.ssd_file_size`` -- and
re-adopted at start from their slot tables -- one sequential read per file,
no data is read (every read verifies the data's checksum instead), every
table validated and indexed with vectorised numpy and one native hashing call
per file, no Python loop per entry.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import errno
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

import numpy as np
import xxhash

from kvtier import _accel
from kvtier.errors import Corrupted
from kvtierd.logs import Throttle, event, more
from kvtierd.spill import format as fmt
from kvtierd.spill.blockio import (
    BlockIO,
    aligned_buffer,
    fault_kind,
    memory_fault,
    probe_direct_io,
)

log = logging.getLogger(__name__)
_throttle = Throttle()

_FILE_RE: Final = re.compile(r"spill-([0-9]+)-([0-9]+)\.kvt")
#: Slots one allocation's CLOCK hand may pass for a victim (bounded work per write).
EVICTION_SCAN_LIMIT: Final = 4096
#: A slot size's first spill file is this big (or 8 slots); each next one doubles, up to
#: ``spill.ssd_file_size``: a few MiB of spill never allocate gigabytes.
FIRST_FILE_BYTES: Final = 64 << 20
FIRST_FILE_SLOTS: Final = 8

#: In-memory slot states (the slot table on disk knows only FREE and COMMITTED).
FREE: Final = 0
INDEXED: Final = 1  # committed and in the key index
BUSY: Final = 2  # owned by a writer
REMOVED: Final = 3  # out of the index, still being read: freed at its last reader

#: Keys per native batch lookup (``_find_slots``): it copies each key's 193-byte field
#: first, so a huge batch goes in pieces of a few MiB.
FIND_BATCH: Final = 16384
#: The key index starts with this many buckets, grows (doubles) above MAX_LOAD, and is
#: rebuilt at most half full: probes stay short, 8 bytes a bucket is 11-21 bytes an entry.
MIN_BUCKETS: Final = 1024
MAX_LOAD: Final = 0.75
#: A bucket holds the upper half of its key's hash (the home bucket's bits, and a check
#: that spares most mismatches a look at the slot table) over slot id + 1.
MAX_SLOT_IDS: Final = (1 << 32) - 1
_LOW: Final = (1 << 32) - 1
_MISS: Final = (-1, -1, None)
ENTRY_BYTES: Final = fmt.ENTRY_BYTES
KEY_AT: Final = fmt.KEY_AT
ENTRY_SUM_AT: Final = fmt.ENTRY_SUM_AT
#: An entry's length, checksum, block_bytes and model hash (at byte 8 of the entry).
_FIELDS: Final = struct.Struct("<QQQQ")
#: The same fields as u64 words of an entry (``length_of_many`` reads them vectorised).
_ROW_WORDS: Final = ENTRY_BYTES // 8
_LENGTH_WORD: Final = 1  # (bytes 8, 24 and 32 of the entry: fmt.ENTRY_DTYPE)
_BLOCK_BYTES_WORD: Final = 3
_MODEL_HASH_WORD: Final = 4
assert fmt.ENTRY_DTYPE.fields is not None and [
    fmt.ENTRY_DTYPE.fields[name][1] for name in ("length", "block_bytes", "model_hash")
] == [8 * _LENGTH_WORD, 8 * _BLOCK_BYTES_WORD, 8 * _MODEL_HASH_WORD]


def key_hash(ns: bytes, key: bytes) -> int:
    """The key index's hash of (namespace, key): the xxh3-64 of the slot entry's zero-padded
    key and namespace fields, seeded with their lengths (what ``hash_rows`` computes over
    a whole slot table at re-adoption)."""
    field = key.ljust(fmt.MAX_KEY_BYTES, b"\0") + ns.ljust(fmt.NAME_BYTES, b"\0")
    return field_hash(field, len(key), len(ns))


def field_hash(field: bytes, key_len: int, ns_len: int) -> int:
    """``key_hash`` of an entry's padded key + namespace field and their lengths."""
    return xxhash.xxh3_64_intdigest(field, key_len | ns_len << 8)


def _row_key_hashes(table: Any, n: int) -> np.ndarray:
    """``key_hash`` of every row of a raw slot table (one native call)."""
    raw = np.frombuffer(table, dtype=np.uint8, count=n * fmt.ENTRY_BYTES).reshape(
        n, fmt.ENTRY_BYTES)
    seeds = raw[:, 1].astype(np.uint64) | raw[:, 2].astype(np.uint64) << np.uint64(8)
    out = np.frombuffer(_accel.hash_rows(table, fmt.ENTRY_BYTES, fmt.KEY_AT, fmt.ENTRY_SUM_AT,
                                         np.ascontiguousarray(seeds)), dtype=np.uint64)
    return out


def _row_ns_hashes(table: Any, n: int) -> np.ndarray:
    """An xxh3-64 of every row's padded namespace field, seeded with its length."""
    raw = np.frombuffer(table, dtype=np.uint8, count=n * fmt.ENTRY_BYTES).reshape(
        n, fmt.ENTRY_BYTES)
    seeds = np.ascontiguousarray(raw[:, 2].astype(np.uint64))
    return np.frombuffer(_accel.hash_rows(table, fmt.ENTRY_BYTES, fmt.NS_AT, fmt.ENTRY_SUM_AT,
                                          seeds), dtype=np.uint64)


def _ns_hash(ns: bytes) -> int:
    return xxhash.xxh3_64_intdigest(ns.ljust(fmt.NAME_BYTES, b"\0"), len(ns))


class SpillFull(Exception):
    """No slot can be made free for this size (everything is being read or written)."""


@dataclasses.dataclass(eq=False, slots=True)
class SpillFile:
    """One spill file and its slots' columns (one element a slot, nothing per entry)."""

    path: str
    fd: int
    index: int
    layout: fmt.SpillLayout
    table: Any  # mmap: page-aligned mirror of the on-disk slot table
    base: int = 0  # slot ids base + 0 .. base + n_slots - 1 name this file's slots
    state: np.ndarray = dataclasses.field(init=False, repr=False)
    readers: np.ndarray = dataclasses.field(init=False, repr=False)
    ref: np.ndarray = dataclasses.field(init=False, repr=False)
    nsid: np.ndarray = dataclasses.field(init=False, repr=False)
    free: np.ndarray = dataclasses.field(init=False, repr=False)
    nfree: int = 0  # free[:nfree] is the free stack (the top is taken first)
    nbusy: int = 0
    committed: int = 0  # INDEXED + REMOVED slots
    needs_sync: bool = False
    dirty_pages: set[int] = dataclasses.field(default_factory=set)  # table pages to write
    dropped: bool = False  # taken out of the tier (under the tier's lock)
    retired: bool = False  # unlinked and closed (set under io_lock): no more table writes
    io_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        n = self.layout.n_slots
        self.state = np.zeros(n, np.uint8)
        self.readers = np.zeros(n, np.uint16)
        self.ref = np.zeros(n, np.uint8)
        self.nsid = np.zeros(n, np.uint32)
        self.free = np.arange(n - 1, -1, -1, dtype=np.uint32)  # slot 0 on top
        self.nfree = n

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    @property
    def n_slots(self) -> int:
        return self.layout.n_slots

    def data_offset(self, slot: int) -> int:
        return self.layout.data_offset + slot * self.layout.slot_bytes

    def rows(self) -> np.ndarray:
        """The slot-table mirror as records (a view: drop it before ``table.close()``)."""
        return np.frombuffer(self.table, dtype=fmt.ENTRY_DTYPE, count=self.layout.n_slots)

    def raw(self) -> np.ndarray:
        """The slot-table mirror as an (n_slots, ENTRY_BYTES) byte array (a view)."""
        n = self.layout.n_slots
        return np.frombuffer(self.table, dtype=np.uint8, count=n * fmt.ENTRY_BYTES).reshape(
            n, fmt.ENTRY_BYTES)

    def row_key(self, slot: int) -> bytes:
        off = slot * fmt.ENTRY_BYTES
        return bytes(self.table[off + fmt.KEY_AT : off + fmt.KEY_AT + self.table[off + 1]])

    def row_seq(self, slot: int) -> int:
        off = slot * fmt.ENTRY_BYTES + 40
        return int.from_bytes(self.table[off : off + 8], "little")

    def clear_row(self, slot: int) -> None:
        self.table[slot * fmt.ENTRY_BYTES : (slot + 1) * fmt.ENTRY_BYTES] = bytes(
            fmt.ENTRY_BYTES)

    def push_free(self, slot: int) -> None:
        self.free[self.nfree] = slot
        self.nfree += 1


class SsdEntry:
    """A spilled block as of the call that made it: a snapshot, kept by nobody.

    ``readers`` and ``removed`` read (and ``readers`` writes, for tests) the slot's
    live columns; the other fields are the slot entry's values when it was made.
    """

    __slots__ = ("namespace", "key", "file", "slot", "length", "checksum", "block_bytes",
                 "model_hash", "seq")

    def __init__(self, namespace: str, key: bytes, file: SpillFile, slot: int, length: int,
                 checksum: int, block_bytes: int, model_hash: int, seq: int) -> None:
        self.namespace = namespace
        self.key = key
        self.file = file
        self.slot = slot
        self.length = length
        self.checksum = checksum
        self.block_bytes = block_bytes
        self.model_hash = model_hash
        self.seq = seq

    @property
    def readers(self) -> int:
        return int(self.file.readers[self.slot])

    @readers.setter
    def readers(self, n: int) -> None:
        self.file.readers[self.slot] = n

    @property
    def removed(self) -> bool:
        return int(self.file.state[self.slot]) == REMOVED

    def __repr__(self) -> str:
        return (f"SsdEntry({self.namespace!r}, {self.key.hex()}, "
                f"{os.path.basename(self.file.path)}#{self.slot}, seq={self.seq})")


@dataclasses.dataclass
class SsdCounters:
    writes: int = 0
    write_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    adopted: int = 0
    dropped_entries: int = 0
    dropped_files: list[str] = dataclasses.field(default_factory=list)
    # Faults the tier absorbed itself ("bad_file", "torn_entry" at re-adoption, "enospc"
    # when the filesystem is smaller than the capacity); the caller counts failed calls.
    faults: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    adopt_seconds: float = 0.0


#: Called on a worker thread with an evicted entry and its verified bytes (page-aligned,
#: round_up(length) of them, the data first), before its slot is reused (the next
#: tier's "write on demotion"; ``spill.tier.HandOff``).
EvictHook = Callable[[SsdEntry, memoryview], None]


class _IndexView:
    """A read-only mapping (namespace, key) -> :class:`SsdEntry` over the tier's index,
    made on demand (for tests and tools: the tier keeps no entry objects).  Each call
    takes the tier's lock.  ``bytes_of``: slot bytes each namespace holds (quotas)."""

    def __init__(self, tier: SsdTier) -> None:
        self._tier = tier

    @property
    def bytes_of(self) -> collections.Counter[str]:
        return self._tier._bytes_of

    def get(self, k: tuple[str, bytes], default: Any = None) -> Any:
        with self._tier._lock:
            e = self._tier._entry_of(k[0], k[1])
        return default if e is None else e

    def __getitem__(self, k: tuple[str, bytes]) -> SsdEntry:
        e: SsdEntry | None = self.get(k)
        if e is None:
            raise KeyError(k)
        return e

    def __contains__(self, k: object) -> bool:
        return isinstance(k, tuple) and len(k) == 2 and self.get(k) is not None

    def __len__(self) -> int:
        return self._tier._n_indexed

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        return iter(self._tier.all_keys())

    def values(self) -> list[SsdEntry]:
        return self._tier._entries()

    def items(self) -> list[tuple[tuple[str, bytes], SsdEntry]]:
        return [((e.namespace, e.key), e) for e in self._tier._entries()]


class SsdTier:
    """Spill files under ``root`` within ``capacity`` bytes."""

    def __init__(
        self,
        root: str,
        *,
        capacity: int,
        file_bytes: int,
        direct: str = "auto",
        io: BlockIO | None = None,
        on_evict: EvictHook | None = None,
    ) -> None:
        if direct not in ("auto", "true", "false"):
            raise ValueError(f"direct must be auto, true or false, got {direct!r}")
        self.root = root
        self.capacity = capacity
        self.file_bytes = file_bytes
        self.io = io or BlockIO()
        self.on_evict = on_evict
        self._direct_mode = direct
        self.direct = False
        self.direct_error: str | None = None
        self._lock = threading.Lock()
        # Signalled when a file is created (writers of that slot size wait for it).
        self._room = threading.Condition(self._lock)
        self._creating: set[int] = set()
        # The key index: bucket -> slot id + 1 (0: empty), linear probing.
        self._buckets = np.zeros(MIN_BUCKETS, np.uint64)
        self._n_indexed = 0
        # Files by slot id: ``_bases`` ascending, ``_by_base`` the file at each.
        self._bases: list[int] = []
        self._by_base: list[SpillFile] = []
        self._next_base = 0
        # Namespaces (few): id <-> name, its encoded name and that name's hash.
        self._ns_names: list[str] = []
        self._ns_bytes: list[bytes] = []
        self._ns_pad: list[bytes] = []  # the name as the entry's zero-padded field
        self._ns_ids: dict[str, int] = {}
        #: Slot bytes each namespace holds (for quotas).
        self._bytes_of: collections.Counter[str] = collections.Counter()
        self._watch: Callable[[str, bytes, bool], None] | None = None
        #: The CLOCK hand of each slot size: (position in ``files[size]``, slot).
        self._hands: dict[int, tuple[int, int]] = {}
        #: Bytes of slots each quota-limited namespace is writing right now.
        self._writing: collections.Counter[str] = collections.Counter()
        #: Namespace -> its SSD quota in bytes (0: none); set from the access rules.
        self.quota_of: Callable[[str], int] = lambda namespace: 0
        #: Called (lock held, any thread: keep it short) with (namespace, key) of every
        #: entry the tier evicts to make room, so a DRAM copy that counted on it as its
        #: durable copy learns it has none now.
        self.on_evicted: Callable[[str, bytes], None] | None = None
        self.files: dict[int, list[SpillFile]] = {}
        self.file_budget_used = 0  # bytes of files, existing or being created
        self._next_index = 0
        self._seq = 0
        self._pending_frees: set[SpillFile] = set()
        self.counters = SsdCounters()
        #: Called (from any thread) with a fault kind the tier absorbed itself.
        self.on_fault: Callable[[str], None] | None = None

    def _absorbed(self, kind: str, n: int = 1) -> None:
        self.counters.faults[kind] += n
        if self.on_fault is not None:
            for _ in range(n):
                self.on_fault(kind)

    # ================================================================ the key index
    @property
    def index(self) -> _IndexView:
        """(namespace, key) -> entry, made on demand (tests and tools)."""
        return _IndexView(self)

    @property
    def lru(self) -> list[SsdEntry]:
        """Every indexed entry, the likeliest victim first as far as CLOCK knows:
        unreferenced before referenced, then by write sequence (oldest first).
        O(entries): tests and tools only."""
        return sorted(self._entries(), key=lambda e: (int(e.file.ref[e.slot]), e.seq))

    def _ns_id(self, namespace: str) -> int:
        i = self._ns_ids.get(namespace)
        if i is None:
            i = self._ns_ids[namespace] = len(self._ns_names)
            self._ns_names.append(namespace)
            self._ns_bytes.append(namespace.encode())
            self._ns_pad.append(self._ns_bytes[i].ljust(fmt.NAME_BYTES, b"\0"))
        return i

    def _locate(self, sid: int) -> tuple[SpillFile, int]:
        f = self._by_base[bisect.bisect_right(self._bases, sid) - 1]
        return f, sid - f.base

    def _add_file(self, f: SpillFile) -> None:
        """Give ``f`` its slot ids (lock held, or before anyone else sees the tier).

        Slot ids fit 32 bits (the low half of a bucket); when the next file's would
        not, every file is numbered afresh from 0 and the index rebuilt."""
        if self._next_base + f.layout.n_slots >= MAX_SLOT_IDS:
            self._next_base = 0
            for g in self._by_base:
                g.base = self._next_base
                self._next_base += g.layout.n_slots
            self._bases = [g.base for g in self._by_base]
            renumbered = True
        else:
            renumbered = False
        f.base = self._next_base
        self._next_base += f.layout.n_slots
        self._bases.append(f.base)
        self._by_base.append(f)
        if renumbered:
            self._rebuild_from_files()

    def _probe(self, nsid: int, key: bytes) -> tuple[int, int, SpillFile | None]:
        """(bucket, slot id, file) of (namespace ``nsid``, key) in the index, or
        (-1, -1, None) (lock held).

        A candidate is confirmed by the upper half of its key hash (in its bucket),
        then by the key and namespace fields of its slot-table entry (lengths, then
        the padded fields in one comparison)."""
        klen, nlen = len(key), len(self._ns_bytes[nsid])
        if not 1 <= klen <= fmt.MAX_KEY_BYTES:
            return _MISS
        field = key.ljust(fmt.MAX_KEY_BYTES, b"\0") + self._ns_pad[nsid]
        tag = field_hash(field, klen, nlen) >> 32
        buckets = self._buckets
        mask = len(buckets) - 1
        i = tag & mask
        bases, files = self._bases, self._by_base
        one = files[0] if len(files) == 1 else None
        while True:
            v = buckets.item(i)
            if v == 0:
                return _MISS
            if v >> 32 == tag:
                sid = (v & _LOW) - 1
                f = one if one is not None else files[bisect.bisect_right(bases, sid) - 1]
                off = (sid - f.base) * ENTRY_BYTES
                t = f.table
                if (t[off + 1] == klen and t[off + 2] == nlen
                        and t[off + KEY_AT : off + ENTRY_SUM_AT] == field):
                    return i, sid, f
            i = (i + 1) & mask

    def _find_slots(self, nsid: int, keys: Sequence[bytes]) -> np.ndarray:
        """The slot id of each key of namespace ``nsid`` in the index, or -1 (lock held):
        what ``_probe`` finds, for every key in one native call (``_accel.ssd_find_slots``:
        the same hash, the same confirmation against the slot-table mirror)."""
        tables, ns = [f.table for f in self._by_base], self._ns_bytes[nsid]
        if len(keys) <= FIND_BATCH:
            return np.frombuffer(_accel.ssd_find_slots(self._buckets, tables, self._bases,
                                                       keys, ns), dtype=np.int64)
        return np.concatenate([  # (the call copies its keys: ~200 B a key at a time)
            np.frombuffer(_accel.ssd_find_slots(self._buckets, tables, self._bases,
                                                keys[at : at + FIND_BATCH], ns), np.int64)
            for at in range(0, len(keys), FIND_BATCH)])

    def _insert(self, sid: int, h: int) -> None:
        """Put a slot id known to be absent, its key hash ``h``, into the index (lock
        held)."""
        if (self._n_indexed + 1) > MAX_LOAD * len(self._buckets):
            self._grow()
        buckets = self._buckets
        mask = len(buckets) - 1
        tag = h >> 32
        i = tag & mask
        while buckets.item(i):
            i = (i + 1) & mask
        buckets[i] = tag << 32 | (sid + 1)
        self._n_indexed += 1

    def _delete_bucket(self, i: int) -> None:
        """Empty bucket ``i``, shifting later members of its run back (lock held)."""
        buckets = self._buckets
        mask = len(buckets) - 1
        buckets[i] = 0
        j = i
        while True:
            j = (j + 1) & mask
            v = buckets.item(j)
            if v == 0:
                break
            home = (v >> 32) & mask
            if (j - home) & mask >= (j - i) & mask:  # its home is not in (i, j]
                buckets[i] = v
                buckets[j] = 0
                i = j
        self._n_indexed -= 1

    def _grow(self) -> None:
        """Twice the buckets, the members re-placed by their tags (lock held)."""
        v = self._buckets[self._buckets != 0]
        self._place(v >> np.uint64(32), v, 2 * len(self._buckets))

    def _rebuild_from_files(self) -> None:
        """The index afresh from the files' INDEXED slots and their slot-table entries
        (re-adoption, renumbering; vectorised, one native hashing call a file)."""
        tags: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        for f in self._by_base:
            slots = np.flatnonzero(f.state == INDEXED)
            tag = _row_key_hashes(f.table, f.n_slots)[slots] >> np.uint64(32)
            tags.append(tag)
            vals.append(tag << np.uint64(32) | (slots.astype(np.uint64)
                                                 + np.uint64(f.base + 1)))
        empty = np.zeros(0, np.uint64)
        self._place(np.concatenate(tags) if tags else empty,
                    np.concatenate(vals) if vals else empty, MIN_BUCKETS)

    def _place(self, tags: np.ndarray, vals: np.ndarray, n_buckets: int) -> None:
        """Fill a fresh bucket array of at least ``n_buckets`` (at most half full) with
        ``vals``, each from the home its tag gives (lock held)."""
        while n_buckets < MIN_BUCKETS or len(vals) > n_buckets // 2:
            n_buckets *= 2
        # Linear probing in one pass: in order of home bucket, each item takes the first
        # bucket at or after its home past the one before it (a cumulative maximum);
        # the few that run off the end wrap round one by one.
        home = (tags & np.uint64(n_buckets - 1)).astype(np.int64)
        order = np.argsort(home, kind="stable")
        k = np.arange(len(order), dtype=np.int64)
        pos = np.maximum.accumulate(home[order] - k) + k if len(order) else k
        inside = pos < n_buckets
        buckets = np.zeros(n_buckets, np.uint64)
        buckets[pos[inside]] = vals[order[inside]]
        self._buckets = buckets
        self._n_indexed = int(inside.sum())
        mask = n_buckets - 1
        for j in np.flatnonzero(~inside).tolist():
            v = int(vals[order[j]])
            i = (v >> 32) & mask
            while buckets.item(i):
                i = (i + 1) & mask
            buckets[i] = v
            self._n_indexed += 1

    def _index_entry(self, f: SpillFile, slot: int, nsid: int, h: int) -> None:
        """Make a slot whose table row is written INDEXED (lock held; key absent)."""
        f.nsid[slot] = nsid
        f.ref[slot] = 0  # set by reads only (as the DRAM table's CLOCK: docs/decisions.md)
        self._insert(f.base + slot, h)
        f.state[slot] = INDEXED
        self._bytes_of[self._ns_names[nsid]] += f.slot_bytes

    def _unindex(self, bucket: int, f: SpillFile, slot: int, *, watch: bool = True) -> None:
        """Take an INDEXED slot out of the index (lock held): the caller frees, drops or
        takes it next."""
        self._delete_bucket(bucket)
        name = self._ns_names[int(f.nsid[slot])]
        self._bytes_of[name] -= f.slot_bytes
        if watch and self._watch is not None:
            self._watch(name, f.row_key(slot), False)

    def _bucket_of(self, f: SpillFile, slot: int) -> int:
        """The bucket holding an INDEXED slot (lock held): its key hash again, from the
        slot-table entry."""
        t, off = f.table, slot * ENTRY_BYTES
        h = field_hash(bytes(t[off + KEY_AT : off + ENTRY_SUM_AT]), t[off + 1], t[off + 2])
        buckets = self._buckets
        mask = len(buckets) - 1
        want = (h >> 32) << 32 | (f.base + slot + 1)
        i = (h >> 32) & mask
        while buckets.item(i) != want:
            if not buckets.item(i):
                raise AssertionError(f"slot {slot} of {f.path} is INDEXED but not indexed")
            i = (i + 1) & mask
        return i

    def _entry_at(self, f: SpillFile, slot: int) -> SsdEntry:
        """The snapshot of a slot's entry (lock held)."""
        (_, klen, _, _, _, length, checksum, block_bytes, mhash, seq, key,
         _) = fmt.ENTRY_STRUCT.unpack_from(f.table, slot * fmt.ENTRY_BYTES)
        return SsdEntry(self._ns_names[int(f.nsid[slot])], key[:klen], f, slot, length,
                        checksum, block_bytes, mhash, seq)

    def _entry_of(self, namespace: str, key: bytes) -> SsdEntry | None:
        at = self._slot_of(namespace, key)
        return None if at is None else self._entry_at(*at)

    def _slot_of(self, namespace: str, key: bytes) -> tuple[SpillFile, int] | None:
        """(file, slot) of (namespace, key) in the index, or None (lock held)."""
        i = self._ns_ids.get(namespace)
        if i is None:
            return None
        _, sid, f = self._probe(i, key)
        return None if f is None else (f, sid - f.base)

    def _current(self, entry: SsdEntry) -> bool:
        """Whether ``entry`` is still the indexed copy it was made from (lock held)."""
        f, slot = entry.file, entry.slot
        return (not f.dropped and int(f.state[slot]) == INDEXED
                and f.row_seq(slot) == entry.seq)

    def _entries(self, namespace: str | None = None) -> list[SsdEntry]:
        with self._lock:
            out: list[SsdEntry] = []
            for f in self._by_base:
                mask = f.state == INDEXED
                if namespace is not None:
                    mask &= f.nsid == self._ns_ids.get(namespace, -1)
                out.extend(self._entry_at(f, int(s)) for s in np.flatnonzero(mask))
            return out

    # ================================================================ start / stop
    def open(self) -> None:
        """Create the directory, probe O_DIRECT, re-adopt every spill file (blocking)."""
        t0 = time.perf_counter()
        self.io.makedirs(self.root)
        reason = probe_direct_io(self.root, self.io) if self._direct_mode != "false" else (
            "disabled by config (spill.ssd_direct_io: false)")
        if reason is not None and self._direct_mode == "true":
            raise OSError(errno.EINVAL, f"spill.ssd_dir {self.root}: {reason} "
                          "(set spill.ssd_direct_io: auto to run with buffered I/O)")
        self.direct = reason is None
        self.direct_error = reason
        if reason is not None and self._direct_mode == "auto":
            log.warning("SSD tier %s: %s; using buffered I/O with fdatasync (slower, and "
                        "spilled blocks also occupy the page cache)", self.root, reason)
        for name in sorted(self.io.listdir(self.root)):
            path = os.path.join(self.root, name)
            if name.endswith(".tmp") or name.startswith(".kvtier-direct-probe"):
                self._unlink_quietly(path)  # a file creation cut short by a crash
                continue
            match = _FILE_RE.fullmatch(name)
            if match is None:
                continue
            try:
                self._adopt_file(path, int(match.group(1)), int(match.group(2)))
            except (fmt.FormatError, OSError) as exc:
                log.warning("SSD tier: dropping spill file %s: %s", path, exc)
                self.counters.dropped_files.append(f"{name}: {exc}")
                self._absorbed("bad_file")
                self._unlink_quietly(path)
        with self._lock:
            adopted = self._index_adopted()
        self.counters.adopted = adopted
        self.counters.adopt_seconds = time.perf_counter() - t0
        log.info("SSD tier %s: %d blocks re-adopted from %d files in %.3f s (%s I/O)",
                 self.root, adopted, sum(len(v) for v in self.files.values()),
                 self.counters.adopt_seconds, "direct" if self.direct else "buffered")

    def close(self) -> None:
        with self._lock:
            files = [f for fs in self.files.values() for f in fs]
            self.files = {}
        for f in files:
            self.io.close(f.fd)
            f.table.close()

    def _open_flags(self) -> int:
        return os.O_RDWR | (os.O_DIRECT if self.direct else 0)

    def _adopt_file(self, path: str, slot_bytes: int, index: int) -> None:
        """Read a file's header and slot table and validate every entry (vectorised); its
        valid entries become INDEXED-to-be (``_index_adopted`` indexes them)."""
        fd = self.io.open(path, self._open_flags())
        try:
            size = self.io.fstat_size(fd)
            page = aligned_buffer(fmt.PAGE)
            n = self.io.pread(fd, page, 0)
            layout, head_index = fmt.unpack_spill_header(bytes(page[:n]), size)
            if (layout.slot_bytes, head_index) != (slot_bytes, index):
                raise fmt.FormatError(f"header says slot_bytes={layout.slot_bytes} index="
                                      f"{head_index}, the name says {slot_bytes}/{index}")
            if self.file_budget_used + layout.file_bytes > self.capacity:
                raise fmt.FormatError(f"does not fit in spill.ssd_capacity ({self.capacity} "
                                      "bytes) next to the files adopted before it")
            table = aligned_buffer(layout.table_bytes)
            if self.io.pread(fd, table, fmt.TABLE_OFFSET) != layout.table_bytes:
                raise fmt.FormatError("slot table is truncated")
        except BaseException:
            self.io.close(fd)
            raise
        f = SpillFile(path, fd, index, layout, table)
        n = layout.n_slots
        rows, raw = f.rows(), f.raw()
        state = rows["state"]
        klen = rows["key_len"]
        nlen = rows["ns_len"]
        sums = np.frombuffer(_accel.hash_rows(table, fmt.ENTRY_BYTES, 0, fmt.ENTRY_SUM_AT,
                                              np.zeros(n, np.uint64)), dtype=np.uint64)
        ok = ((state == fmt.EntryState.COMMITTED) & (sums == rows["entry_sum"])
              & (klen >= 1) & (klen <= fmt.MAX_KEY_BYTES) & (nlen <= fmt.NAME_BYTES)
              & (rows["length"] >= 1) & (rows["length"] <= layout.slot_bytes))
        # The key and namespace fields are zero past their lengths (what ``key_hash``
        # assumes); an entry that says otherwise was not written by this code.  Checked
        # per distinct length over the table in place (a table has one or a few).
        for lens, at, width in ((klen, fmt.KEY_AT, fmt.MAX_KEY_BYTES),
                                (nlen, fmt.NS_AT, fmt.NAME_BYTES)):
            for size in np.unique(lens[ok]).tolist():
                if size >= width:
                    continue
                sel = np.flatnonzero(ok & (lens == size))
                if 8 * len(sel) >= n:  # most of the table: scan it in place
                    junk = raw[:, at + size : at + width].any(axis=1) & (lens == size)
                    ok &= ~junk
                else:  # a few rows: copy just them
                    ok[sel[raw[sel, at + size : at + width].any(axis=1)]] = False
        cand = np.flatnonzero(ok)
        if cand.size:
            ns_h = _row_ns_hashes(table, n)[cand]
            if (ns_h == ns_h[0]).all():  # one namespace (the usual file): no sort
                uniq, first = ns_h[:1], np.zeros(1, np.int64)
                inverse = np.zeros(len(cand), np.int64)
            else:
                uniq, first, inverse = np.unique(ns_h, return_index=True,
                                                 return_inverse=True)
                inverse = inverse.reshape(-1)
            ids = np.empty(len(uniq), np.uint32)
            for u, row in enumerate(cand[first].tolist()):
                field = bytes(raw[row, fmt.NS_AT : fmt.NS_AT + int(nlen[row])])
                try:
                    ids[u] = self._ns_id(field.decode())
                except UnicodeDecodeError:  # not a name this code wrote
                    ids[u] = 0
                    ok[cand[inverse == u]] = False
            f.nsid[cand] = ids[inverse]
        torn = np.flatnonzero((state != fmt.EntryState.FREE) & ~ok)
        good = np.flatnonzero(ok)
        f.state[good] = INDEXED
        f.committed = int(good.size)
        raw[torn] = 0
        del rows, raw, state, klen, nlen
        if torn.size:
            self.counters.dropped_entries += int(torn.size)
            self._absorbed("torn_entry", int(torn.size))
            log.warning("SSD tier: %s: %d slot entries failed their check and were freed",
                        path, torn.size)
            self._pending_frees.add(f)
        free = np.flatnonzero(f.state == FREE)[::-1]
        f.nfree = len(free)
        f.free[: f.nfree] = free
        self._add_file(f)
        self.files.setdefault(slot_bytes, []).append(f)
        self.file_budget_used += layout.file_bytes
        self._next_index = max(self._next_index, index + 1)

    def _index_adopted(self) -> int:
        """Index every adopted entry; the same key twice (a crash between a rewrite and
        the free of the old copy): the newest write wins, the other slot is freed.
        Returns the entries kept (lock held)."""
        if not self._by_base:
            return 0
        slots = [np.flatnonzero(f.state == INDEXED) for f in self._by_base]
        sid = np.concatenate([s.astype(np.uint64) + np.uint64(f.base)
                              for s, f in zip(slots, self._by_base, strict=True)])
        h = np.concatenate([_row_key_hashes(f.table, f.n_slots)[s]
                            for s, f in zip(slots, self._by_base, strict=True)])
        seq = np.concatenate([f.rows()["seq"][s]
                              for s, f in zip(slots, self._by_base, strict=True)])
        hs = np.sort(h)
        starts = np.zeros(0, np.int64)
        if len(hs) > 1 and (hs[1:] == hs[:-1]).any():  # rare: sort again, keeping order
            order = np.lexsort((~seq, h))  # by hash, the newest first among equal ones
            hs = h[order]
            dup = hs[1:] == hs[:-1]
            starts = np.flatnonzero(dup & ~np.concatenate([[False], dup[:-1]]))
        forgot = False
        for j in starts.tolist():  # runs of equal hashes (rare): compare the keys' bytes
            kept: list[bytes] = []
            k = j
            while k < len(hs) and hs[k] == hs[j]:
                f, slot = self._locate(int(sid[order[k]]))
                off = slot * fmt.ENTRY_BYTES
                ident = bytes(f.table[off + 1 : off + 3]) + bytes(
                    f.table[off + fmt.KEY_AT : off + fmt.ENTRY_SUM_AT])
                if ident in kept:
                    self._forget_adopted(f, slot)  # an older copy of a kept key
                    forgot = True
                else:
                    kept.append(ident)
                k += 1
        if forgot:
            self._rebuild_from_files()
        else:  # the hashes are at hand
            tags = h >> np.uint64(32)
            self._place(tags, tags << np.uint64(32) | (sid + np.uint64(1)), MIN_BUCKETS)
        self._bytes_of.clear()
        for f in self._by_base:
            live = f.state == INDEXED
            counts = np.bincount(f.nsid[live], minlength=len(self._ns_names))
            for i in np.flatnonzero(counts).tolist():
                self._bytes_of[self._ns_names[i]] += int(counts[i]) * f.slot_bytes
        # The reference bits are not persisted: the newer half of the writes starts
        # referenced, so the hand takes the older half first rather than in slot order.
        if len(seq):
            self._seq = int(seq.max())
            median = np.median(seq)
            at = 0
            for f, live in zip(self._by_base, slots, strict=True):
                f.ref[live] = seq[at : at + len(live)] >= median
                at += len(live)
            for f in self._by_base:  # (an older copy dropped above: not referenced)
                f.ref[f.state != INDEXED] = 0
        return self._n_indexed

    def _forget_adopted(self, f: SpillFile, slot: int) -> None:
        """Drop an adopted entry that lost to a newer copy of its key."""
        f.clear_row(slot)
        f.state[slot] = FREE
        f.push_free(slot)
        f.committed -= 1
        self._pending_frees.add(f)
        self.counters.dropped_entries += 1

    # ================================================================ loop-safe queries
    def find(self, namespace: str, key: bytes, block_bytes: int, mhash: int) -> SsdEntry | None:
        """The entry for a key if it was written for this namespace geometry."""
        with self._lock:
            e = self._entry_of(namespace, key)
        if e is None or (e.block_bytes, e.model_hash) != (block_bytes, mhash):
            return None
        return e

    def length_of(self, namespace: str, key: bytes,
                  geometry: tuple[int, int] | None = None) -> int | None:
        """The length of a key's copy (written for ``geometry``, a (block_bytes, model
        hash) pair, when given), or None: ``find`` without making an entry."""
        with self._lock:
            at = self._slot_of(namespace, key)
            if at is None:
                return None
            f, slot = at
            length, _, block_bytes, mhash = _FIELDS.unpack_from(f.table, slot * ENTRY_BYTES + 8)
        if geometry is not None and (block_bytes, mhash) != geometry:
            return None
        return int(length)

    def find_many(self, namespace: str, keys: Sequence[bytes], block_bytes: int,
                  mhash: int) -> list[SsdEntry | None]:
        """``find`` of each key: one index lookup for them all (one native call, one
        hold of the lock)."""
        with self._lock:
            i = self._ns_ids.get(namespace)
            if i is None or not keys:
                return [None] * len(keys)
            found = [None if sid < 0 else self._entry_at(*self._locate(sid))
                     for sid in self._find_slots(i, keys).tolist()]
        return [e if e is not None and (e.block_bytes, e.model_hash) == (block_bytes, mhash)
                else None for e in found]

    def length_of_many(self, namespace: str, keys: Sequence[bytes],
                   geometry: tuple[int, int] | None = None) -> list[int | None]:
        """``length_of`` of each key: one index lookup for them all (one native call),
        the lengths and geometries read from the slot tables vectorised, no entry made.
        O(keys), loop-safe: what the tiering asks about a batch of keys below DRAM."""
        lengths = np.full(len(keys), -1, np.int64)
        with self._lock:
            i = self._ns_ids.get(namespace)
            if i is None or not keys:
                return [None] * len(keys)
            sids = self._find_slots(i, keys)
            hit = np.flatnonzero(sids >= 0)
            if hit.size:
                files = self._by_base
                if len(files) == 1:
                    groups = [(files[0], hit)]
                else:  # slot ids to files, then each file's hits at once
                    at = np.searchsorted(np.array(self._bases, np.int64), sids[hit],
                                         side="right") - 1
                    groups = [(files[k], hit[at == k]) for k in np.unique(at).tolist()]
                for f, sel in groups:
                    # The entries as rows of u64 (a view): just the fields wanted gathered.
                    words = np.frombuffer(f.table, "<u8", count=f.n_slots * _ROW_WORDS
                                          ).reshape(f.n_slots, _ROW_WORDS)
                    slots = sids[sel] - f.base
                    got = words[slots, _LENGTH_WORD].astype(np.int64)
                    if geometry is not None:
                        ok = ((words[slots, _BLOCK_BYTES_WORD] == geometry[0])
                              & (words[slots, _MODEL_HASH_WORD] == geometry[1]))
                        sel, got = sel[ok], got[ok]
                    lengths[sel] = got
                    del words
        return [None if n < 0 else n for n in lengths.tolist()]

    def remove(self, namespace: str, keys: Iterable[bytes]) -> int:
        """Forget keys (delete); their FREE entries reach the disk at the next ``flush_frees``."""
        n = 0
        with self._lock:
            i = self._ns_ids.get(namespace)
            if i is None:
                return 0
            for key in keys:
                bucket, sid, f = self._probe(i, key)
                if f is None:
                    continue
                n += 1
                self._unindex(bucket, f, sid - f.base)
                self._drop(f, sid - f.base)
        return n

    def _snapshot_keys(self, namespace: str | None, geometry: tuple[int, int] | None
                       ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(namespace ids, key lengths, key fields) of the indexed entries, copied under
        the lock (vectorised) so the bytes objects are made outside it."""
        out = []
        with self._lock:
            want = -1 if namespace is None else self._ns_ids.get(namespace)
            if want is None:
                return []
            for f in self._by_base:
                mask = f.state == INDEXED
                if want >= 0:
                    mask &= f.nsid == want
                if geometry is not None:
                    rows = f.rows()
                    mask &= (rows["block_bytes"] == geometry[0]) & (
                        rows["model_hash"] == geometry[1])
                    del rows
                sel = np.flatnonzero(mask)
                raw = f.raw()
                out.append((f.nsid[sel], raw[sel, 1].copy(),
                            raw[sel, fmt.KEY_AT : fmt.KEY_AT + fmt.MAX_KEY_BYTES].copy()))
                del raw
        return out

    def all_keys(self) -> list[tuple[str, bytes]]:
        """Every (namespace, key) held.  O(entries): run it off the loop."""
        parts = self._snapshot_keys(None, None)
        names = self._ns_names
        return [(names[i], k[:n].tobytes()) for ids, lens, keys in parts
                for i, n, k in zip(ids.tolist(), lens.tolist(), keys, strict=True)]

    def watch(self, callback: Callable[[str, bytes, bool], None] | None) -> None:
        """Tell ``callback(namespace, key, stored)`` every key that comes or goes from
        now on (under the tier's lock, from any thread; keep it short)."""
        with self._lock:
            self._watch = callback

    def keys_of(self, namespace: str, geometry: tuple[int, int] | None = None) -> list[bytes]:
        """The keys held for ``namespace`` (only those written for ``geometry``, a
        (block_bytes, model hash) pair, when given).  O(entries): run it off the loop."""
        parts = self._snapshot_keys(namespace, geometry)
        return [k[:n].tobytes() for _, lens, keys in parts
                for n, k in zip(lens.tolist(), keys, strict=True)]

    def drop_namespace(self, namespace: str, keep: Callable[[SsdEntry], bool]) -> int:
        """Forget every entry of ``namespace`` for which ``keep`` is false."""
        n = 0
        with self._lock:
            i = self._ns_ids.get(namespace)
            if i is None:
                return 0
            for f in list(self._by_base):
                for slot in np.flatnonzero((f.state == INDEXED) & (f.nsid == i)).tolist():
                    if keep(self._entry_at(f, slot)):
                        continue
                    self._unindex(self._bucket_of(f, slot), f, slot)
                    self._drop(f, slot)
                    n += 1
        return n

    def _drop(self, f: SpillFile, slot: int) -> None:
        """Free an entry's slot now, or at its last reader (lock held; out of the index)."""
        if f.readers[slot]:
            f.state[slot] = REMOVED
            return
        self._free_slot(f, slot)

    def _free_slot(self, f: SpillFile, slot: int) -> None:
        f.clear_row(slot)
        f.state[slot] = FREE
        f.ref[slot] = 0
        f.committed -= 1
        f.push_free(slot)
        self._pending_frees.add(f)

    def stats(self) -> dict[str, int]:
        with self._lock:
            committed = sum(f.committed * f.slot_bytes for fs in self.files.values() for f in fs)
            busy = sum(f.nbusy * f.slot_bytes for fs in self.files.values() for f in fs)
            blocks = self._n_indexed
        return {"total": self.capacity, "committed": committed, "reserved": busy,
                "free": self.capacity - committed - busy, "blocks": blocks,
                "files": sum(len(v) for v in self.files.values())}

    # ================================================================ write
    def write(
        self,
        namespace: str,
        key: bytes,
        src: memoryview,
        length: int,
        checksum: int | None,
        block_bytes: int,
        mhash: int,
    ) -> SsdEntry:
        """Store ``src[:length]`` under (namespace, key); visible at once, durable after ``sync``.

        ``src`` must cover ``round_up(length, 4096)`` bytes of page-aligned memory
        (a DRAM slot).  ``checksum`` is the xxh3-64 of the data if already known.
        Raises SpillFull or OSError (EFAULT: ``src`` faulted); ValueError when the
        key is not 1..64 bytes or the namespace's name over 128; the tier is
        unchanged then.
        """
        ns = namespace.encode()
        if not 1 <= len(key) <= fmt.MAX_KEY_BYTES or len(ns) > fmt.NAME_BYTES:
            raise ValueError(f"SSD tier: key of {len(key)} bytes (1..{fmt.MAX_KEY_BYTES}) or "
                             f"namespace of {len(ns)} (<= {fmt.NAME_BYTES})")
        padded = fmt.round_up(length)
        if checksum is None:
            checksum = _accel.checksum(src[:length])
        h = key_hash(ns, key)
        f, slot = self._allocate_within_quota(namespace, key, padded)
        try:
            self.io.pwrite(f.fd, src[:padded], f.data_offset(slot))
        except BaseException:
            with self._lock:
                self._unbusy(f, slot)
                self._written(namespace, padded)
            raise
        with self._lock:
            self._written(namespace, padded)
            self._seq += 1
            seq = self._seq
            f.table[slot * fmt.ENTRY_BYTES : (slot + 1) * fmt.ENTRY_BYTES] = fmt.pack_entry(
                fmt.EntryRecord(namespace, key, length, checksum, block_bytes, mhash, seq))
            # The table page reaches the disk in sync(), once per batch, after the data.
            f.dirty_pages.add(slot // fmt.ENTRIES_PER_PAGE)
            f.nbusy -= 1
            f.committed += 1
            f.needs_sync = True
            nsid = self._ns_id(namespace)
            bucket, old, of = self._probe(nsid, key)
            if of is not None:  # a rewrite: the new copy replaces the old one (no event)
                self._unindex(bucket, of, old - of.base, watch=False)
                self._drop(of, old - of.base)
            self._index_entry(f, slot, nsid, h)
            self.counters.writes += 1
            self.counters.write_bytes += length
            if of is None and self._watch is not None:
                self._watch(namespace, key, True)
        return SsdEntry(namespace, key, f, slot, length, checksum, block_bytes, mhash, seq)

    def _unbusy(self, f: SpillFile, slot: int) -> None:
        """A slot a writer owned goes back to the free stack (lock held)."""
        f.state[slot] = FREE
        f.nbusy -= 1
        if not f.dropped:
            f.push_free(slot)

    def _fdatasync(self, f: SpillFile) -> None:
        with f.io_lock:
            if not f.retired:
                self.io.fdatasync(f.fd)

    def sync(self) -> None:
        """Make every write so far durable: each written file's changed table pages,
        then one fdatasync per file (data, then entries, then the flush)."""
        with self._lock:
            files = [f for fs in self.files.values() for f in fs if f.needs_sync]
            pages = {}
            for f in files:
                f.needs_sync = False
                pages[f], f.dirty_pages = f.dirty_pages, set()
        done: set[SpillFile] = set()
        try:
            for f in files:
                for page in sorted(pages[f]):
                    self._write_table_page(f, page)
                self._fdatasync(f)
                done.add(f)
        except BaseException:
            with self._lock:
                for f in files:
                    if f not in done:
                        f.needs_sync = True
                        f.dirty_pages |= pages[f]
            raise

    def flush_frees(self) -> None:
        """Persist FREE entries of deleted/evicted blocks (so a restart does not revive them)."""
        with self._lock:
            files, self._pending_frees = list(self._pending_frees), set()
        for i, f in enumerate(files):
            try:
                with f.io_lock:
                    if f.retired:
                        continue
                self._write_table(f)
                self._fdatasync(f)
            except BaseException:
                with self._lock:  # not persisted: the next flush writes them again
                    self._pending_frees.update(
                        x for x in files[i:] if x in self.files.get(x.slot_bytes, ()))
                raise

    def _write_table_page(self, f: SpillFile, page: int) -> None:
        buf = aligned_buffer(fmt.PAGE)
        with f.io_lock:
            if f.retired:
                return
            with self._lock:
                buf[:] = f.table[page * fmt.PAGE : (page + 1) * fmt.PAGE]
            self.io.pwrite(f.fd, buf, fmt.TABLE_OFFSET + page * fmt.PAGE)
        buf.close()

    def _write_table(self, f: SpillFile) -> None:
        size = f.layout.table_bytes
        buf = aligned_buffer(size)
        with f.io_lock:
            if f.retired:
                return
            with self._lock:
                buf[:size] = f.table[:size]
            self.io.pwrite(f.fd, memoryview(buf)[:size], fmt.TABLE_OFFSET)
        buf.close()

    # ---------------------------------------------------------------- allocation
    def _allocate(self, slot_bytes: int) -> tuple[SpillFile, int]:
        """A slot of ``slot_bytes`` owned by the caller (``BUSY``).

        In order: a free slot; a new file while the budget allows (one creator
        per slot size at a time -- the others wait for its file rather than
        each taking budget for one); the budget of an empty file of another
        size; the CLOCK victim of this size; a whole file of another size,
        emptied.
        """
        while True:
            with self._room:
                found = self._pop_free(slot_bytes)
                if found is not None:
                    return found
                if slot_bytes in self._creating:
                    self._room.wait(timeout=1.0)
                    continue
                layout = fmt.SpillLayout.fit(
                    slot_bytes, min(self._next_file_bytes(slot_bytes),
                                    self.capacity - self.file_budget_used))
                if layout is None and self._retire_empty_file(slot_bytes):
                    continue
                victim: SsdEntry | None = None
                if layout is None:
                    try:
                        victim = self._take_victim(slot_bytes)
                    except _Retry:
                        continue
                else:
                    self._creating.add(slot_bytes)
                    self.file_budget_used += layout.file_bytes
                    index = self._next_index
                    self._next_index += 1
            if victim is not None:
                return self._reuse(victim)
            assert layout is not None
            try:
                f = self._create_file(layout, index)
            except OSError as exc:
                with self._room:
                    self._creating.discard(slot_bytes)
                    self._room.notify_all()
                    self.file_budget_used -= layout.file_bytes
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.files:
                        raise
                    # The filesystem holds less than spill.ssd_capacity: make do with the
                    # files there are (evict within them) instead of failing every write.
                    self.capacity = self.file_budget_used
                self._absorbed(fault_kind(exc))
                log.warning("SSD tier %s: filesystem full (%s); capacity lowered to the %d "
                            "bytes of spill files already allocated", self.root, exc,
                            self.capacity)
                continue
            except BaseException:
                with self._room:
                    self._creating.discard(slot_bytes)
                    self._room.notify_all()
                    self.file_budget_used -= layout.file_bytes
                raise
            with self._room:
                self._add_file(f)
                self.files.setdefault(slot_bytes, []).append(f)
                self._creating.discard(slot_bytes)
                self._room.notify_all()

    def _allocate_within_quota(self, namespace: str, key: bytes,
                               slot_bytes: int) -> tuple[SpillFile, int]:
        """``_allocate``, except that a namespace at its SSD quota reuses the slot of its
        own CLOCK victim of this size instead of taking more room."""
        quota = self.quota_of(namespace)
        if not quota:
            return self._allocate(slot_bytes)
        with self._room:
            # Slots being written count too: concurrent writers must not all see room.
            held = self._bytes_of[namespace] + self._writing[namespace]
            ns_id = self._ns_ids.get(namespace)
            old = -1 if ns_id is None else self._probe(ns_id, key)[1]
            if old >= 0:  # a rewrite frees the old copy's bytes
                held -= self._locate(old)[0].slot_bytes
            if held + slot_bytes <= quota:
                victim = None
                self._writing[namespace] += slot_bytes
            else:
                found = (None if ns_id is None else
                         self._clock(slot_bytes, ns_id=ns_id, exclude=old, limit=None))
                if found is None:
                    raise SpillFull(f"namespace {namespace!r} is at its SSD quota ({held} of "
                                    f"{quota} bytes) and none of its {slot_bytes}-byte blocks "
                                    "can be evicted")
                victim = self._evict_for_reuse(*found)
                self._writing[namespace] += slot_bytes
        if victim is None:
            try:
                return self._allocate(slot_bytes)
            except BaseException:
                with self._lock:
                    self._writing[namespace] -= slot_bytes
                raise
        return self._reuse(victim)

    def _written(self, namespace: str, slot_bytes: int) -> None:
        """A quota-counted slot is no longer being written (lock held)."""
        if self._writing.get(namespace):
            self._writing[namespace] -= slot_bytes

    def _pop_free(self, slot_bytes: int) -> tuple[SpillFile, int] | None:
        for f in self.files.get(slot_bytes, ()):
            if f.nfree:
                f.nfree -= 1
                slot = int(f.free[f.nfree])
                f.state[slot] = BUSY
                f.nbusy += 1
                return f, slot
        return None

    def _clock(self, slot_bytes: int, *, ns_id: int | None = None, exclude: int = -1,
               limit: int | None = EVICTION_SCAN_LIMIT) -> tuple[SpillFile, int] | None:
        """The CLOCK victim among the INDEXED, unread slots of this size (of namespace
        ``ns_id`` only, when given; never slot id ``exclude``), or None (lock held).

        The hand passes at most ``limit`` slots (None: twice round), clearing the
        referenced bit of each candidate it passes; when all it passed were
        referenced, the first of them is the victim.  Vectorised: a window of slots
        at a time."""
        fs = self.files.get(slot_bytes)
        if not fs:
            return None
        fi, pos = self._hands.get(slot_bytes, (0, 0))
        if fi >= len(fs):
            fi, pos = 0, 0
        total = sum(f.n_slots for f in fs)
        budget = 2 * total if limit is None else min(limit, 2 * total)
        scanned = 0
        fallback: tuple[SpillFile, int] | None = None
        while scanned < budget:
            f = fs[fi]
            stop = min(f.n_slots, pos + max(1, min(budget - scanned, 1 << 16)))
            ok = (f.state[pos:stop] == INDEXED) & (f.readers[pos:stop] == 0)
            if ns_id is not None:
                ok &= f.nsid[pos:stop] == ns_id
            if pos <= exclude - f.base < stop:
                ok[exclude - f.base - pos] = False
            cand = np.flatnonzero(ok) + pos
            if cand.size:
                cold = np.flatnonzero(f.ref[cand] == 0)
                if cold.size:
                    f.ref[cand[: cold[0]]] = 0
                    slot = int(cand[cold[0]])
                    self._hands[slot_bytes] = (fi, slot + 1)
                    return f, slot
                f.ref[cand] = 0  # a second chance each
                if fallback is None:
                    fallback = (f, int(cand[0]))
            scanned += stop - pos
            pos = stop
            if pos >= f.n_slots:
                fi, pos = (fi + 1) % len(fs), 0
        if fallback is not None:
            self._hands[slot_bytes] = (fs.index(fallback[0]), fallback[1] + 1)
        else:
            self._hands[slot_bytes] = (fi, pos)
        return fallback

    def _take_victim(self, slot_bytes: int) -> SsdEntry:
        """Evict the CLOCK victim of this size (lock held), or reclaim a file."""
        found = self._clock(slot_bytes)
        if found is None:
            if self._reclaim_other_size(slot_bytes):
                raise _Retry
            raise SpillFull(f"SSD tier is full: no evictable {slot_bytes}-byte slot "
                            "(all are being read or written)")
        return self._evict_for_reuse(*found)

    def _evict_for_reuse(self, f: SpillFile, slot: int) -> SsdEntry:
        """Take an entry out of the index; its slot becomes the caller's (busy) (lock held).
        Returns the entry as it was."""
        e = self._entry_at(f, slot)
        self._unindex(self._bucket_of(f, slot), f, slot)
        f.state[slot] = BUSY
        f.ref[slot] = 0
        f.nbusy += 1
        f.committed -= 1
        self.counters.evictions += 1
        if self.on_evicted is not None:
            self.on_evicted(e.namespace, e.key)
        return e

    def _reuse(self, victim: SsdEntry) -> tuple[SpillFile, int]:
        if self.on_evict is not None:
            buf = aligned_buffer(fmt.round_up(victim.length))
            try:
                self._read_verified(victim, memoryview(buf))
                self.on_evict(victim, memoryview(buf))
            except Exception as exc:  # the victim is dropped either way; never crash
                held = _throttle("ssd/evict_pass_on")
                if held is not None:
                    log.warning("SSD tier: evicted block %s of %r not passed on: %s%s",
                                victim.key.hex(), victim.namespace, exc, more(held),
                                extra=event("spill_fault", tier="shared", op="write",
                                            kind="pass_on", held_back=held))
            finally:
                buf.close()
        return victim.file, victim.slot

    def _retire_empty_file(self, slot_bytes: int) -> bool:
        """Give back the budget of an empty file of another slot size (lock held)."""
        for size, fs in self.files.items():
            if size == slot_bytes:
                continue
            for f in fs:
                if f.committed == 0 and not f.nbusy:
                    self._forget_file(f)
                    return True
        return False

    def _forget_file(self, f: SpillFile) -> None:
        """Take a file out of the tier and delete it in the background (lock held)."""
        self.files[f.slot_bytes].remove(f)
        if not self.files[f.slot_bytes]:
            del self.files[f.slot_bytes]
        self._hands.pop(f.slot_bytes, None)
        at = self._by_base.index(f)
        del self._by_base[at], self._bases[at]
        f.dropped = True
        self.file_budget_used -= f.layout.file_bytes
        self._pending_frees.discard(f)
        threading.Thread(target=self._retire_file, args=(f,), daemon=True).start()

    def _reclaim_other_size(self, slot_bytes: int) -> bool:
        """Budget is held by files of other slot sizes: empty the coldest one (the fewest
        referenced entries, then the oldest write), evicting its blocks, and delete it
        (lock held)."""
        best: tuple[float, int, SpillFile] | None = None
        for size, fs in self.files.items():
            if size == slot_bytes:
                continue
            for f in fs:
                if f.nbusy or not f.committed:
                    continue
                live = f.state == INDEXED
                n = int(live.sum())
                if n != f.committed or f.readers[live].any():
                    continue  # being read
                score = (float(f.ref[live].sum()) / n, int(f.rows()["seq"][live].min()), f)
                if best is None or score[:2] < best[:2]:
                    best = score
        if best is None:
            return self._retire_empty_file(slot_bytes)
        f = best[2]
        for slot in np.flatnonzero(f.state == INDEXED).tolist():
            name, key = self._ns_names[int(f.nsid[slot])], f.row_key(slot)
            self._unindex(self._bucket_of(f, slot), f, slot)
            f.state[slot] = FREE
            self.counters.evictions += 1
            if self.on_evicted is not None:
                self.on_evicted(name, key)
        f.committed = 0
        self._forget_file(f)
        return True

    def _next_file_bytes(self, slot_bytes: int) -> int:
        """The size of the next file for ``slot_bytes`` (sizes double, from small)."""
        n = len(self.files.get(slot_bytes, ()))
        first = max(FIRST_FILE_BYTES, FIRST_FILE_SLOTS * slot_bytes)
        return min(self.file_bytes, first << min(n, 32))

    def _retire_file(self, f: SpillFile) -> None:
        with f.io_lock:  # a table write in flight finishes first; later ones see retired
            f.retired = True
            try:
                self.io.unlink(f.path)
            except OSError:
                pass
            self.io.close(f.fd)

    def _create_file(self, layout: fmt.SpillLayout, index: int) -> SpillFile:
        name = f"spill-{layout.slot_bytes}-{index}.kvt"
        path = os.path.join(self.root, name)
        tmp = path + ".tmp"
        fd = self.io.open(tmp, self._open_flags() | os.O_CREAT | os.O_EXCL)
        try:
            self.io.fallocate(fd, layout.file_bytes)
            head = aligned_buffer(fmt.PAGE)
            head[:] = fmt.pack_spill_header(layout, index, time.time_ns())
            self.io.pwrite(fd, head, 0)
            table = aligned_buffer(layout.table_bytes)
            self.io.pwrite(fd, table, fmt.TABLE_OFFSET)  # zeros: every slot FREE
            self.io.fdatasync(fd)
            self.io.rename(tmp, path)
            self.io.fsync_dir(self.root)
        except BaseException:
            self.io.close(fd)
            self._unlink_quietly(tmp)
            raise
        log.info("SSD tier: created %s (%d slots of %d bytes)", name, layout.n_slots,
                 layout.slot_bytes)
        return SpillFile(path, fd, index, layout, table)

    # ================================================================ read
    def read_into(self, entry: SsdEntry, dst: memoryview) -> None:
        """Read a block into ``dst`` (page aligned, >= round_up(length)) and verify it.

        A block that fails its checksum or cannot be read is dropped from the
        tier and counted; the error (``Corrupted`` or ``OSError``) is raised.
        An ``OSError`` EFAULT (``blockio.memory_fault``: ``dst``'s memory
        faulted -- a client cut its DRAM slot away) is raised with the entry
        kept and nothing counted.  ``KeyError`` when the entry was evicted or
        deleted meanwhile.
        """
        f, slot = entry.file, entry.slot
        with self._lock:
            if not self._current(entry):
                raise KeyError("the SSD copy was evicted or deleted")
            f.readers[slot] += 1
            f.ref[slot] = 1
        kind: str | None = None  # None: read and verified; "": dst faulted, the copy stays
        try:
            self._read_verified(entry, dst)
        except (Corrupted, OSError) as exc:
            if memory_fault(exc):
                kind = ""  # the DRAM slot's memory is gone, not this copy
                raise
            kind = fault_kind(exc)
            held = _throttle(f"ssd/read/{kind}")
            if held is not None:
                log.warning("SSD tier: block %s of %r unreadable (%s: %s); dropped%s",
                            entry.key.hex(), entry.namespace, kind, exc, more(held),
                            extra=event("spill_fault", tier="ssd", op="read", kind=kind,
                                        namespace=entry.namespace, held_back=held))
            raise
        finally:
            with self._lock:
                f.readers[slot] -= 1
                if kind is None:
                    self.counters.reads += 1
                    self.counters.read_bytes += entry.length
                elif kind:
                    if kind == "checksum":
                        self.counters.checksum_failures += 1
                    if self._current(entry):
                        self._unindex(self._bucket_of(f, slot), f, slot)
                        self._drop(f, slot)
                if int(f.state[slot]) == REMOVED and f.readers[slot] == 0:
                    self._free_slot(f, slot)

    def _read_verified(self, entry: SsdEntry, dst: memoryview) -> None:
        padded = fmt.round_up(entry.length)
        n = self.io.pread(entry.file.fd, dst[:padded], entry.file.data_offset(entry.slot))
        if n < padded:
            raise Corrupted(f"short read: {n} of {padded} bytes (file truncated?)")
        if _accel.checksum(dst[: entry.length]) != entry.checksum:
            raise Corrupted(f"block {entry.key.hex()} failed its checksum on the SSD tier")

    # ================================================================ invariants
    def check(self) -> list[str]:
        """Cross-check the key index, the slot columns, free stacks, slot tables (every
        indexed entry's key hash and namespace recomputed from its table row) and the
        byte budget.  O(slots), vectorised, under the lock."""
        problems: list[str] = []
        with self._lock:
            budget = 0
            held: collections.Counter[str] = collections.Counter()
            ids: list[np.ndarray] = []
            ns_hash = np.array([_ns_hash(b) for b in self._ns_bytes] or [0], np.uint64)
            in_files = {id(f) for fs in self.files.values() for f in fs}
            if in_files != {id(f) for f in self._by_base}:
                problems.append("SSD files by slot size and by slot id differ")
            for slot_bytes, fs in self.files.items():
                for f in fs:
                    budget += f.layout.file_bytes
                    problems += self._check_file(f, slot_bytes, ns_hash, held)
                    ids.append(np.flatnonzero(f.state == INDEXED).astype(np.uint64)
                               + np.uint64(f.base))
            if budget != self.file_budget_used:
                problems.append(f"SSD file budget {self.file_budget_used} != files {budget}")
            if budget > self.capacity:
                problems.append(f"SSD files {budget} exceed spill.ssd_capacity {self.capacity}")
            if +held != +self._bytes_of:
                problems.append(f"SSD bytes per namespace {dict(+self._bytes_of)} != "
                                f"{dict(+held)} counted from the slots")
            problems += self._check_buckets(
                np.concatenate(ids) if ids else np.zeros(0, np.uint64))
        return problems

    def _check_file(self, f: SpillFile, slot_bytes: int, ns_hash: np.ndarray,
                    held: collections.Counter[str]) -> list[str]:
        problems: list[str] = []
        where = os.path.basename(f.path)
        if f.slot_bytes != slot_bytes:
            problems.append(f"{where}: filed under slot size {slot_bytes}")
        counts = np.bincount(f.state, minlength=4)
        if len(counts) > 4:
            problems.append(f"{where}: slot states out of range")
        free = f.free[: f.nfree]
        if len(np.unique(free)) != f.nfree:
            problems.append(f"{where}: free list has duplicates")
        if (f.nfree != counts[FREE] or (f.nfree and (f.state[free] != FREE).any())):
            problems.append(f"{where}: free list {f.nfree} != FREE slots {counts[FREE]}")
        if f.nbusy != counts[BUSY]:
            problems.append(f"{where}: busy counter {f.nbusy} != BUSY slots {counts[BUSY]}")
        if f.committed != counts[INDEXED] + counts[REMOVED]:
            problems.append(f"{where}: committed counter {f.committed} != indexed "
                            f"{counts[INDEXED]} + being read {counts[REMOVED]}")
        if (f.readers[(f.state == FREE) | (f.state == BUSY)] != 0).any():
            problems.append(f"{where}: readers on a free or busy slot")
        rows = f.rows()
        on_table = rows["state"] == fmt.EntryState.COMMITTED
        live = f.state == INDEXED
        if (live & ~on_table).any():
            problems.append(f"{where}: indexed slots are FREE in the slot table")
        if (on_table & (f.state == FREE)).any():
            problems.append(f"{where}: slot table has COMMITTED slots nobody holds")
        sel = np.flatnonzero(live)
        if sel.size:
            nsid = f.nsid[sel]
            if (nsid >= len(self._ns_names)).any():
                problems.append(f"{where}: a namespace id out of range")
            elif (_row_ns_hashes(f.table, f.n_slots)[sel] != ns_hash[nsid]).any():
                problems.append(f"{where}: a namespace differs from its slot table entry")
            else:
                for i, c in enumerate(np.bincount(nsid).tolist()):
                    if c:
                        held[self._ns_names[i]] += c * f.slot_bytes
        del rows
        return problems

    def _check_buckets(self, ids: np.ndarray) -> list[str]:
        """Every indexed slot once in the key index, found from its hash's home bucket."""
        b = self._buckets
        occ = np.flatnonzero(b)
        vals = (b[occ] & np.uint64(_LOW)) - np.uint64(1)
        got = np.sort(vals)
        if len(got) != self._n_indexed or not np.array_equal(got, np.sort(ids)):
            return [f"SSD key index holds {len(got)} slots (count {self._n_indexed}), the "
                    f"files {len(ids)} indexed ones (or other ones)"]
        if not len(occ):
            return []
        n = len(b)
        if len(occ) == n:
            return ["SSD key index is full"]
        tags = b[occ] >> np.uint64(32)
        which = np.searchsorted(np.array(self._bases, np.uint64), vals, side="right") - 1
        for k, f in enumerate(self._by_base):
            m = which == k
            slots = (vals[m] - np.uint64(f.base)).astype(np.int64)
            row_tags = _row_key_hashes(f.table, f.n_slots)[slots] >> np.uint64(32)
            if (row_tags != tags[m]).any():
                return [f"{os.path.basename(f.path)}: a key hash in the index differs from "
                        "its slot table entry"]
        # A member must sit no further from its home than the run of members before it.
        idx = np.arange(n)
        last_empty = np.maximum.accumulate(np.where(b == 0, idx, -1))
        if last_empty[-1] >= 0:  # runs that wrap around: the last empty before the end
            last_empty = np.where(last_empty < 0, last_empty[-1] - n, last_empty)
        run = idx - last_empty - 1
        dist = (occ.astype(np.uint64) - (tags & np.uint64(n - 1))) & np.uint64(n - 1)
        if (dist > run[occ]).any():
            return ["SSD key index has a member its probe cannot reach"]
        return []

    def _unlink_quietly(self, path: str) -> None:
        try:
            self.io.unlink(path)
        except OSError:
            pass


class _Retry(Exception):
    pass
