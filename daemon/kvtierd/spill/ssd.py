"""The local SSD tier: preallocated spill files of fixed-size slots.

Mechanism with its own bookkeeping: which (namespace, key) is in which slot,
a CLOCK eviction order, and a byte budget (``capacity``).  It does not decide
*what* to spill (that is ``kvtierd.tiering``); it stores what it is given,
evicting its own entries when full, and hands evicted entries' bytes to
``on_evict`` first (the shared tier, when configured).

:class:`SsdTier` is the front; its parts, each in a module of its own:

* ``ssd_files``  -- a spill file and its slot columns (no Python object per entry:
  an SSD tier holds millions), the entry snapshots lookups return, creating and
  retiring a file;
* ``ssd_index``  -- the key index: (namespace, key) -> slot id in one
  open-addressing table of 8-byte buckets, confirmed against the slot-table mirror
  (a batch of keys in one native call);
* ``ssd_names``  -- namespace ids: a slot stores a small id, this turns it back
  into the name and its encoded forms;
* ``ssd_listing`` -- whole-tier listings (every entry, every key, a namespace's
  keys), O(entries), for tools, tests and ``keys_of``;
* ``ssd_alloc``  -- slot allocation: free slots, new files within the budget,
  CLOCK eviction, reclaiming another slot size's file, quotas;
* ``ssd_adopt``  -- re-adoption of the spill files at start, vectorised;
* ``ssd_check``  -- ``check()``, the cross-check of all of the above.

(docs/decisions.md, "The SSD tier's bookkeeping in columns".)

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
re-adopted at start from their slot tables.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from kvtier import _accel
from kvtier.errors import Corrupted
from kvtierd.logs import Throttle, event, more
from kvtierd.spill import format as fmt
from kvtierd.spill import ssd_adopt, ssd_check
from kvtierd.spill.blockio import (
    BlockIO,
    fault_kind,
    memory_fault,
    probe_direct_io,
)
from kvtierd.spill.ssd_alloc import SlotAllocator
from kvtierd.spill.ssd_files import (
    BLOCK_BYTES_WORD,
    BUSY,
    ENTRY_BYTES,
    FIELDS,
    FIRST_FILE_BYTES,
    FREE,
    INDEXED,
    LENGTH_WORD,
    MODEL_HASH_WORD,
    REMOVED,
    ROW_WORDS,
    EvictHook,
    SpillFile,
    SpillFull,
    SsdCounters,
    SsdEntry,
    entry_at,
    fdatasync,
    write_table_pages,
)
from kvtierd.spill.ssd_index import SsdKeyIndex, key_hash
from kvtierd.spill.ssd_listing import SsdListing
from kvtierd.spill.ssd_names import NamespaceNames

__all__ = ["BUSY", "FIRST_FILE_BYTES", "FREE", "INDEXED", "REMOVED", "EvictHook", "SpillFile",
           "SpillFull", "SsdCounters", "SsdEntry", "SsdTier", "key_hash"]

log = logging.getLogger(__name__)
_throttle = Throttle()
#: Up to this many keys, ``length_of_many`` reads each hit's entry without numpy.
_FEW = 8


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
        return self._tier.key_index.n

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
        #: (namespace, key) -> slot id, and the files by slot id.
        self.key_index = SsdKeyIndex()
        #: Namespaces (few): id <-> name and its encoded forms.
        self.names = NamespaceNames()
        #: Whole-tier listings (tools, tests, ``keys_of``), O(entries).
        self.listing = SsdListing(self._lock, self.key_index, self.names)
        #: Slot bytes each namespace holds (for quotas).
        self._bytes_of: collections.Counter[str] = collections.Counter()
        self._watch: Callable[[str, bytes, bool], None] | None = None
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
        self.slots = SlotAllocator(self)

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

    def _probe(self, nsid: int, key: bytes) -> tuple[int, int, SpillFile | None]:
        """(bucket, slot id, file) of (namespace ``nsid``, key), or (-1, -1, None) (lock
        held)."""
        return self.key_index.probe(key, self.names.encoded[nsid], self.names.padded[nsid])

    def _index_entry(self, f: SpillFile, slot: int, nsid: int, h: int) -> None:
        """Make a slot whose table row is written INDEXED (lock held; key absent)."""
        f.nsid[slot] = nsid
        f.ref[slot] = 0  # set by reads only (as the DRAM table's CLOCK: docs/decisions.md)
        self.key_index.insert(f.base + slot, h)
        f.state[slot] = INDEXED
        self._bytes_of[self.names.names[nsid]] += f.slot_bytes

    def _unindex(self, bucket: int, f: SpillFile, slot: int, *, watch: bool = True) -> None:
        """Take an INDEXED slot out of the index (lock held): the caller frees, drops or
        takes it next."""
        self.key_index.delete(bucket)
        name = self.names.names[int(f.nsid[slot])]
        self._bytes_of[name] -= f.slot_bytes
        if watch and self._watch is not None:
            self._watch(name, f.row_key(slot), False)

    def _entry_at(self, f: SpillFile, slot: int) -> SsdEntry:
        """The snapshot of a slot's entry (lock held)."""
        return entry_at(self.names.names, f, slot)

    def _entry_of(self, namespace: str, key: bytes) -> SsdEntry | None:
        at = self._slot_of(namespace, key)
        return None if at is None else self._entry_at(*at)

    def _slot_of(self, namespace: str, key: bytes) -> tuple[SpillFile, int] | None:
        """(file, slot) of (namespace, key) in the index, or None (lock held)."""
        i = self.names.ids.get(namespace)
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
        return self.listing.entries(namespace)

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
        adopted = ssd_adopt.adopt_files(self)
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
            return None if at is None else self._length_at(*at, geometry)

    @staticmethod
    def _length_at(f: SpillFile, slot: int, geometry: tuple[int, int] | None) -> int | None:
        """The length of the copy in ``f``'s ``slot`` (written for ``geometry`` when
        given), or None (lock held)."""
        length, _, block_bytes, mhash = FIELDS.unpack_from(f.table, slot * ENTRY_BYTES + 8)
        if geometry is not None and (block_bytes, mhash) != geometry:
            return None
        return int(length)

    def find_many(self, namespace: str, keys: Sequence[bytes], block_bytes: int,
                  mhash: int) -> list[SsdEntry | None]:
        """``find`` of each key: one index lookup for them all (one native call, one
        hold of the lock)."""
        with self._lock:
            i = self.names.ids.get(namespace)
            if i is None or not keys:
                return [None] * len(keys)
            found = [None if sid < 0 else self._entry_at(*self.key_index.locate(sid))
                     for sid in self.key_index.find_slots(self.names.encoded[i], keys).tolist()]
        return [e if e is not None and (e.block_bytes, e.model_hash) == (block_bytes, mhash)
                else None for e in found]

    def length_of_many(self, namespace: str, keys: Sequence[bytes],
                   geometry: tuple[int, int] | None = None) -> list[int | None]:
        """``length_of`` of each key: one index lookup for them all (one native call),
        the lengths and geometries read from the slot tables vectorised, no entry made.
        O(keys), loop-safe: what the tiering asks about a batch of keys below DRAM."""
        lengths = np.full(len(keys), -1, np.int64)
        with self._lock:
            i = self.names.ids.get(namespace)
            if i is None or not keys:
                return [None] * len(keys)
            sids = self.key_index.find_slots(self.names.encoded[i], keys)
            if len(keys) <= _FEW:  # (a 1-key delete or lookup: no numpy step per question)
                return [None if sid < 0 else self._length_at(*self.key_index.locate(sid),
                                                             geometry)
                        for sid in sids.tolist()]
            hit = np.flatnonzero(sids >= 0)
            if hit.size:
                files = self.key_index.files
                if len(files) == 1:
                    groups = [(files[0], hit)]
                else:  # slot ids to files, then each file's hits at once
                    at = np.searchsorted(np.array(self.key_index.bases, np.int64), sids[hit],
                                         side="right") - 1
                    groups = [(files[k], hit[at == k]) for k in np.unique(at).tolist()]
                for f, sel in groups:
                    # The entries as rows of u64 (a view): just the fields wanted gathered.
                    words = np.frombuffer(f.table, "<u8", count=f.n_slots * ROW_WORDS
                                          ).reshape(f.n_slots, ROW_WORDS)
                    slots = sids[sel] - f.base
                    got = words[slots, LENGTH_WORD].astype(np.int64)
                    if geometry is not None:
                        ok = ((words[slots, BLOCK_BYTES_WORD] == geometry[0])
                              & (words[slots, MODEL_HASH_WORD] == geometry[1]))
                        sel, got = sel[ok], got[ok]
                    lengths[sel] = got
                    del words
        return [None if n < 0 else n for n in lengths.tolist()]

    def remove(self, namespace: str, keys: Iterable[bytes]) -> int:
        """Forget keys (delete); their FREE entries reach the disk at the next ``flush_frees``."""
        n = 0
        with self._lock:
            i = self.names.ids.get(namespace)
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

    def all_keys(self) -> list[tuple[str, bytes]]:
        """Every (namespace, key) held.  O(entries): run it off the loop."""
        return self.listing.all_keys()

    def watch(self, callback: Callable[[str, bytes, bool], None] | None) -> None:
        """Tell ``callback(namespace, key, stored)`` every key that comes or goes from
        now on (under the tier's lock, from any thread; keep it short)."""
        with self._lock:
            self._watch = callback

    def keys_of(self, namespace: str, geometry: tuple[int, int] | None = None) -> list[bytes]:
        """The keys held for ``namespace`` (only those written for ``geometry``, a
        (block_bytes, model hash) pair, when given).  O(entries): run it off the loop."""
        return self.listing.keys_of(namespace, geometry)

    def drop_namespace(self, namespace: str, keep: Callable[[SsdEntry], bool]) -> int:
        """Forget every entry of ``namespace`` for which ``keep`` is false."""
        n = 0
        with self._lock:
            i = self.names.ids.get(namespace)
            if i is None:
                return 0
            for f in list(self.key_index.files):
                for slot in np.flatnonzero((f.state == INDEXED) & (f.nsid == i)).tolist():
                    if keep(self._entry_at(f, slot)):
                        continue
                    self._unindex(self.key_index.bucket_of(f, slot), f, slot)
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
            blocks = self.key_index.n
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
        f, slot = self.slots.allocate_within_quota(namespace, key, padded)
        try:
            self.io.pwrite(f.fd, src[:padded], f.data_offset(slot))
        except BaseException:
            with self._lock:
                self._unbusy(f, slot)
                self.slots.written(namespace, padded)
            raise
        with self._lock:
            self.slots.written(namespace, padded)
            self._seq += 1
            seq = self._seq
            f.table[slot * fmt.ENTRY_BYTES : (slot + 1) * fmt.ENTRY_BYTES] = fmt.pack_entry(
                fmt.EntryRecord(namespace, key, length, checksum, block_bytes, mhash, seq))
            # The table page reaches the disk in sync(), once per batch, after the data.
            f.dirty_pages.add(slot // fmt.ENTRIES_PER_PAGE)
            f.nbusy -= 1
            f.committed += 1
            f.needs_sync = True
            nsid = self.names.id_of(namespace)
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
                write_table_pages(self.io, self._lock, f, pages[f])
                fdatasync(self.io, f)
                done.add(f)
        except BaseException:
            with self._lock:
                for f in files:
                    if f not in done:
                        f.needs_sync = True
                        f.dirty_pages |= pages[f]
            raise

    def flush_frees(self) -> None:
        """Persist FREE entries of deleted/evicted blocks (so a restart does not revive
        them): the table pages holding them, then one fdatasync a file."""
        with self._lock:
            files, self._pending_frees = list(self._pending_frees), set()
            pages: dict[SpillFile, set[int]] = {}
            for f in files:
                pages[f], f.freed_pages = f.freed_pages, set()
        for i, f in enumerate(files):
            try:  # (each skips a retired file, under its io_lock)
                write_table_pages(self.io, self._lock, f, pages[f])
                fdatasync(self.io, f)
            except BaseException:
                with self._lock:  # not persisted: the next flush writes them again
                    for x in files[i:]:
                        if x in self.files.get(x.slot_bytes, ()):
                            self._pending_frees.add(x)
                            x.freed_pages |= pages[x]
                raise

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
                        self._unindex(self.key_index.bucket_of(f, slot), f, slot)
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
        """Cross-check the key index, the slot columns, free stacks, slot tables and the
        byte budget (``ssd_check``).  O(slots), vectorised, under the lock."""
        return ssd_check.check(self)
