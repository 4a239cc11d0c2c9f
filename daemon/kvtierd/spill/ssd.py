"""The local SSD tier: preallocated spill files of fixed-size slots.

Mechanism with its own bookkeeping: which (namespace, key) is in which slot,
an LRU, and a byte budget (``capacity``).  It does not decide *what* to spill
(that is ``kvtierd.tiering``); it stores what it is given, evicting its own
least recently used entries when full, and hands evicted entries' bytes to
``on_evict`` first (the shared tier, when configured).

Threading: one lock guards the in-memory state; no I/O happens under it.
``find``/``remove``/``stats`` are O(keys) and safe on the event loop;
``write``/``sync``/``read_into``/``open``/``flush_frees`` block and run on
worker threads.  A slot being written is owned by its writer (``busy``); an
entry being read has ``readers > 0`` and is neither evicted nor reused until
the read ends.

Files (format in ``spill.format``): ``spill-<slot_bytes>-<index>.kvt``, one
set per slot size, created on demand (``fallocate``) up to the budget -- the first small,
each next twice the last, up to ``spill.ssd_file_size`` -- and
re-adopted at start from their slot tables -- one sequential read per file,
no data is read (every read verifies the data's checksum instead).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
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
#: LRU entries one allocation may inspect for a victim (bounded work per write).
EVICTION_SCAN_LIMIT: Final = 4096
#: A slot size's first spill file is this big (or 8 slots); each next one doubles, up to
#: ``spill.ssd_file_size``: a few MiB of spill never allocate gigabytes.
FIRST_FILE_BYTES: Final = 64 << 20
FIRST_FILE_SLOTS: Final = 8


class SpillFull(Exception):
    """No slot can be made free for this size (everything is being read or written)."""


@dataclasses.dataclass(eq=False, slots=True)
class SpillFile:
    path: str
    fd: int
    index: int
    layout: fmt.SpillLayout
    table: Any  # mmap: page-aligned mirror of the on-disk slot table
    free: list[int]
    busy: set[int] = dataclasses.field(default_factory=set)
    committed: int = 0
    needs_sync: bool = False
    dirty_pages: set[int] = dataclasses.field(default_factory=set)  # table pages to write
    retired: bool = False  # unlinked and closed (set under io_lock): no more table writes
    io_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    def data_offset(self, slot: int) -> int:
        return self.layout.data_offset + slot * self.layout.slot_bytes


@dataclasses.dataclass(eq=False, slots=True)
class SsdEntry:
    namespace: str
    key: bytes
    file: SpillFile
    slot: int
    length: int
    checksum: int
    block_bytes: int
    model_hash: int
    seq: int
    readers: int = 0
    removed: bool = False  # out of the index while being read: freed at the last reader


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


class _Index(dict[tuple[str, bytes], SsdEntry]):
    """(namespace, key) -> entry, keeping the slot bytes each namespace holds (for quotas).

    ``watch(namespace, key, stored)``, when set, hears every key that comes in
    (stored) or goes (not): the KV events (``kvtierd.events``).  It is called
    under the tier's lock, from any thread."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_of: collections.Counter[str] = collections.Counter()
        self.watch: Callable[[str, bytes, bool], None] | None = None

    def __setitem__(self, k: tuple[str, bytes], e: SsdEntry) -> None:
        old = super().get(k)
        if old is not None:
            self.bytes_of[old.namespace] -= old.file.slot_bytes
        super().__setitem__(k, e)
        self.bytes_of[e.namespace] += e.file.slot_bytes
        if self.watch is not None and old is None:
            self.watch(k[0], k[1], True)

    def __delitem__(self, k: tuple[str, bytes]) -> None:
        e = super().pop(k)
        self.bytes_of[e.namespace] -= e.file.slot_bytes
        if self.watch is not None:
            self.watch(k[0], k[1], False)

    def pop(self, k: tuple[str, bytes], *default: Any) -> Any:  # type: ignore[override]
        if k in self:
            e = super().pop(k)
            self.bytes_of[e.namespace] -= e.file.slot_bytes
            if self.watch is not None:
                self.watch(k[0], k[1], False)
            return e
        return super().pop(k, *default)


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
        self.index = _Index()
        #: Bytes of slots each quota-limited namespace is writing right now.
        self._writing: collections.Counter[str] = collections.Counter()
        self.lru: collections.OrderedDict[SsdEntry, None] = collections.OrderedDict()
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
        self._removed: set[SsdEntry] = set()  # out of the index, still being read
        self.counters = SsdCounters()
        #: Called (from any thread) with a fault kind the tier absorbed itself.
        self.on_fault: Callable[[str], None] | None = None

    def _absorbed(self, kind: str, n: int = 1) -> None:
        self.counters.faults[kind] += n
        if self.on_fault is not None:
            for _ in range(n):
                self.on_fault(kind)

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
        adopted: list[SsdEntry] = []
        for name in sorted(self.io.listdir(self.root)):
            path = os.path.join(self.root, name)
            if name.endswith(".tmp") or name.startswith(".kvtier-direct-probe"):
                self._unlink_quietly(path)  # a file creation cut short by a crash
                continue
            match = _FILE_RE.fullmatch(name)
            if match is None:
                continue
            try:
                adopted += self._adopt_file(path, int(match.group(1)), int(match.group(2)))
            except (fmt.FormatError, OSError) as exc:
                log.warning("SSD tier: dropping spill file %s: %s", path, exc)
                self.counters.dropped_files.append(f"{name}: {exc}")
                self._absorbed("bad_file")
                self._unlink_quietly(path)
        adopted.sort(key=lambda e: e.seq)
        for entry in adopted:
            self.lru[entry] = None
        self._seq = max((e.seq for e in adopted), default=0)
        self.counters.adopted = len(adopted)
        self.counters.adopt_seconds = time.perf_counter() - t0
        log.info("SSD tier %s: %d blocks re-adopted from %d files in %.3f s (%s I/O)",
                 self.root, len(adopted), sum(len(v) for v in self.files.values()),
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

    def _adopt_file(self, path: str, slot_bytes: int, index: int) -> list[SsdEntry]:
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
        f = SpillFile(path, fd, index, layout, table, [])
        rows = np.frombuffer(table, dtype=fmt.ENTRY_DTYPE, count=layout.n_slots)
        raw = np.frombuffer(table, dtype=np.uint8, count=layout.n_slots * fmt.ENTRY_BYTES).reshape(
            layout.n_slots, fmt.ENTRY_BYTES)
        state = rows["state"]
        candidates = np.flatnonzero(state != fmt.EntryState.FREE).tolist()
        sums = rows["entry_sum"]
        lengths = rows["length"]
        entries: list[SsdEntry] = []
        torn: list[int] = []
        for slot in candidates:
            row = raw[slot]
            ok = (int(state[slot]) == fmt.EntryState.COMMITTED
                  and xxhash.xxh3_64_intdigest(row[: fmt.ENTRY_SUM_AT].tobytes()) == int(sums[slot])
                  and 1 <= int(row[1]) <= fmt.MAX_KEY_BYTES and int(row[2]) <= fmt.NAME_BYTES
                  and 1 <= int(lengths[slot]) <= layout.slot_bytes)
            if not ok:
                torn.append(slot)
                continue
            rec = rows[slot]
            key = row[fmt.KEY_AT : fmt.KEY_AT + int(row[1])].tobytes()
            ns = row[fmt.NS_AT : fmt.NS_AT + int(row[2])].tobytes().decode(errors="replace")
            entries.append(SsdEntry(ns, key, f, slot, int(rec["length"]), int(rec["checksum"]),
                                    int(rec["block_bytes"]), int(rec["model_hash"]),
                                    int(rec["seq"])))
        kept: list[SsdEntry] = []
        for e in entries:
            old = self.index.get((e.namespace, e.key))
            if old is not None:  # the same key twice (a crash between rewrite and free)
                loser = e if old.seq >= e.seq else old
                if loser is old:
                    self._forget_adopted(old)
                    self.index[(e.namespace, e.key)] = e
                    kept.append(e)
                else:
                    torn.append(e.slot)
                continue
            self.index[(e.namespace, e.key)] = e
            kept.append(e)
        for slot in torn:
            f.table[slot * fmt.ENTRY_BYTES : (slot + 1) * fmt.ENTRY_BYTES] = bytes(fmt.ENTRY_BYTES)
        if torn:
            self.counters.dropped_entries += len(torn)
            self._absorbed("torn_entry", len(torn))
            log.warning("SSD tier: %s: %d slot entries failed their check and were freed",
                        path, len(torn))
            self._pending_frees.add(f)
        used = {e.slot for e in kept}
        f.free = [s for s in range(layout.n_slots - 1, -1, -1) if s not in used]
        f.committed = len(kept)
        self.files.setdefault(slot_bytes, []).append(f)
        self.file_budget_used += layout.file_bytes
        self._next_index = max(self._next_index, index + 1)
        return kept

    def _forget_adopted(self, entry: SsdEntry) -> None:
        """Drop an adopted entry that lost to a newer copy of its key."""
        f = entry.file
        f.table[entry.slot * fmt.ENTRY_BYTES : (entry.slot + 1) * fmt.ENTRY_BYTES] = bytes(
            fmt.ENTRY_BYTES)
        f.free.append(entry.slot)
        f.committed -= 1
        self._pending_frees.add(f)
        self.counters.dropped_entries += 1

    # ================================================================ loop-safe queries
    def find(self, namespace: str, key: bytes, block_bytes: int, mhash: int) -> SsdEntry | None:
        """The entry for a key if it was written for this namespace geometry."""
        e = self.index.get((namespace, key))
        if e is None or (e.block_bytes, e.model_hash) != (block_bytes, mhash):
            return None
        return e

    def remove(self, namespace: str, keys: Iterable[bytes]) -> int:
        """Forget keys (delete); their FREE entries reach the disk at the next ``flush_frees``."""
        n = 0
        with self._lock:
            for key in keys:
                e = self.index.pop((namespace, key), None)
                if e is None:
                    continue
                n += 1
                self.lru.pop(e, None)
                self._drop(e)
        return n

    def all_keys(self) -> list[tuple[str, bytes]]:
        """Every (namespace, key) held.  O(entries): run it off the loop."""
        with self._lock:
            return list(self.index)

    def watch(self, callback: Callable[[str, bytes, bool], None] | None) -> None:
        """Tell ``callback(namespace, key, stored)`` every key that comes or goes from
        now on (under the tier's lock, from any thread; keep it short)."""
        with self._lock:
            self.index.watch = callback

    def keys_of(self, namespace: str, geometry: tuple[int, int] | None = None) -> list[bytes]:
        """The keys held for ``namespace`` (only those written for ``geometry``, a
        (block_bytes, model hash) pair, when given).  O(entries): run it off the loop."""
        with self._lock:
            items = list(self.index.items())
        return [key for (ns, key), e in items if ns == namespace
                and (geometry is None or (e.block_bytes, e.model_hash) == geometry)]

    def drop_namespace(self, namespace: str, keep: Callable[[SsdEntry], bool]) -> int:
        """Forget every entry of ``namespace`` for which ``keep`` is false."""
        with self._lock:
            victims = [e for (ns, _), e in self.index.items() if ns == namespace and not keep(e)]
            for e in victims:
                del self.index[(e.namespace, e.key)]
                self.lru.pop(e, None)
                self._drop(e)
        return len(victims)

    def _drop(self, e: SsdEntry) -> None:
        """Free an entry's slot now, or at its last reader (lock held; index already updated)."""
        if e.readers:
            e.removed = True
            self._removed.add(e)
            return
        f = e.file
        f.table[e.slot * fmt.ENTRY_BYTES : (e.slot + 1) * fmt.ENTRY_BYTES] = bytes(fmt.ENTRY_BYTES)
        f.committed -= 1
        f.free.append(e.slot)
        self._pending_frees.add(f)

    def stats(self) -> dict[str, int]:
        with self._lock:
            committed = sum(f.committed * f.slot_bytes for fs in self.files.values() for f in fs)
            busy = sum(len(f.busy) * f.slot_bytes for fs in self.files.values() for f in fs)
            blocks = len(self.index)
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
        Raises SpillFull or OSError (EFAULT: ``src`` faulted); the tier is
        unchanged then.
        """
        padded = fmt.round_up(length)
        if checksum is None:
            checksum = _accel.checksum(src[:length])
        f, slot = self._allocate_within_quota(namespace, key, padded)
        try:
            self.io.pwrite(f.fd, src[:padded], f.data_offset(slot))
        except BaseException:
            with self._lock:
                f.busy.discard(slot)
                f.free.append(slot)
                self._written(namespace, padded)
            raise
        with self._lock:
            self._written(namespace, padded)
            self._seq += 1
            seq = self._seq
            e = SsdEntry(namespace, key, f, slot, length, checksum, block_bytes, mhash, seq)
            f.table[slot * fmt.ENTRY_BYTES : (slot + 1) * fmt.ENTRY_BYTES] = fmt.pack_entry(
                fmt.EntryRecord(namespace, key, length, checksum, block_bytes, mhash, seq))
            # The table page reaches the disk in sync(), once per batch, after the data.
            f.dirty_pages.add(slot // fmt.ENTRIES_PER_PAGE)
            f.busy.discard(slot)
            f.committed += 1
            f.needs_sync = True
            old = self.index.get((namespace, key))
            if old is not None:  # a rewrite: the new copy replaces the old one
                self.lru.pop(old, None)
                self._drop(old)
            self.index[(namespace, key)] = e
            self.lru[e] = None
            self.counters.writes += 1
            self.counters.write_bytes += length
        return e

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
        """A slot of ``slot_bytes`` owned by the caller (``busy``).

        In order: a free slot; a new file while the budget allows (one creator
        per slot size at a time -- the others wait for its file rather than
        each taking budget for one); the budget of an empty file of another
        size; the least recently used entry of this size; a whole file of
        another size, emptied.
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
                self.files.setdefault(slot_bytes, []).append(f)
                self._creating.discard(slot_bytes)
                self._room.notify_all()

    def _allocate_within_quota(self, namespace: str, key: bytes,
                               slot_bytes: int) -> tuple[SpillFile, int]:
        """``_allocate``, except that a namespace at its SSD quota reuses the slot of its
        own least recently used block of this size instead of taking more room."""
        quota = self.quota_of(namespace)
        if not quota:
            return self._allocate(slot_bytes)
        with self._room:
            # Slots being written count too: concurrent writers must not all see room.
            held = self.index.bytes_of[namespace] + self._writing[namespace]
            old = self.index.get((namespace, key))
            if old is not None:  # a rewrite frees the old copy's bytes
                held -= old.file.slot_bytes
            if held + slot_bytes <= quota:
                victim = None
                self._writing[namespace] += slot_bytes
            else:
                victim = next((e for e in self.lru if e.namespace == namespace
                               and e.file.slot_bytes == slot_bytes and e.readers == 0
                               and e is not old), None)
                if victim is None:
                    raise SpillFull(f"namespace {namespace!r} is at its SSD quota ({held} of "
                                    f"{quota} bytes) and none of its {slot_bytes}-byte blocks "
                                    "can be evicted")
                self._evict_for_reuse(victim)
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
            if f.free:
                slot = f.free.pop()
                f.busy.add(slot)
                return f, slot
        return None

    def _victim(self, slot_bytes: int) -> SsdEntry | None:
        for i, e in enumerate(self.lru):
            if i >= EVICTION_SCAN_LIMIT:
                break
            if e.file.slot_bytes == slot_bytes and e.readers == 0:
                return e
        return None

    def _take_victim(self, slot_bytes: int) -> SsdEntry:
        """Evict the least recently used entry of this size (lock held), or reclaim a file."""
        e = self._victim(slot_bytes)
        if e is None:
            if self._reclaim_other_size(slot_bytes):
                raise _Retry
            raise SpillFull(f"SSD tier is full: no evictable {slot_bytes}-byte slot "
                            "(all are being read or written)")
        self._evict_for_reuse(e)
        return e

    def _evict_for_reuse(self, e: SsdEntry) -> None:
        """Take ``e`` out of the index; its slot becomes the caller's (busy) (lock held)."""
        del self.index[(e.namespace, e.key)]
        del self.lru[e]
        e.file.committed -= 1
        e.file.busy.add(e.slot)
        self.counters.evictions += 1
        if self.on_evicted is not None:
            self.on_evicted(e.namespace, e.key)

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
                if f.committed == 0 and not f.busy:
                    self._forget_file(f)
                    return True
        return False

    def _forget_file(self, f: SpillFile) -> None:
        """Take a file out of the tier and delete it in the background (lock held)."""
        self.files[f.slot_bytes].remove(f)
        if not self.files[f.slot_bytes]:
            del self.files[f.slot_bytes]
        self.file_budget_used -= f.layout.file_bytes
        self._pending_frees.discard(f)
        threading.Thread(target=self._retire_file, args=(f,), daemon=True).start()

    def _reclaim_other_size(self, slot_bytes: int) -> bool:
        """Budget is held by files of other slot sizes: empty the one holding the least
        recently used block, evicting its blocks, and delete it (lock held)."""
        for e in self.lru:
            f = e.file
            if f.slot_bytes == slot_bytes or f.busy:
                continue
            members = [x for x in self.lru if x.file is f]
            if any(x.readers for x in members) or f.committed != len(members):
                continue
            for x in members:
                del self.index[(x.namespace, x.key)]
                del self.lru[x]
                self.counters.evictions += 1
                if self.on_evicted is not None:
                    self.on_evicted(x.namespace, x.key)
            f.committed = 0
            self._forget_file(f)
            return True
        return self._retire_empty_file(slot_bytes)

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
        return SpillFile(path, fd, index, layout, table, list(range(layout.n_slots - 1, -1, -1)))

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
        with self._lock:
            if self.index.get((entry.namespace, entry.key)) is not entry:
                raise KeyError("the SSD copy was evicted or deleted")
            entry.readers += 1
            self.lru.move_to_end(entry)
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
                entry.readers -= 1
                if kind is None:
                    self.counters.reads += 1
                    self.counters.read_bytes += entry.length
                elif kind:
                    if kind == "checksum":
                        self.counters.checksum_failures += 1
                    if self.index.get((entry.namespace, entry.key)) is entry:
                        del self.index[(entry.namespace, entry.key)]
                        self.lru.pop(entry, None)
                        self._drop(entry)
                if entry.removed and entry.readers == 0:
                    self._removed.discard(entry)
                    entry.removed = False
                    self._drop(entry)

    def _read_verified(self, entry: SsdEntry, dst: memoryview) -> None:
        padded = fmt.round_up(entry.length)
        n = self.io.pread(entry.file.fd, dst[:padded], entry.file.data_offset(entry.slot))
        if n < padded:
            raise Corrupted(f"short read: {n} of {padded} bytes (file truncated?)")
        if _accel.checksum(dst[: entry.length]) != entry.checksum:
            raise Corrupted(f"block {entry.key.hex()} failed its checksum on the SSD tier")

    # ================================================================ invariants
    def check(self) -> list[str]:
        """Cross-check index, LRU, free lists, slot tables and the byte budget."""
        problems: list[str] = []
        with self._lock:
            budget = 0
            for slot_bytes, fs in self.files.items():
                for f in fs:
                    budget += f.layout.file_bytes
                    where = os.path.basename(f.path)
                    if f.slot_bytes != slot_bytes:
                        problems.append(f"{where}: filed under slot size {slot_bytes}")
                    members = {e.slot for e in self.index.values() if e.file is f}
                    removed = {e.slot for e in self._removed if e.file is f}
                    free = set(f.free)
                    if len(free) != len(f.free):
                        problems.append(f"{where}: free list has duplicates")
                    groups = (members, removed, free, f.busy)
                    if sum(map(len, groups)) != len(set().union(*groups)):
                        problems.append(f"{where}: a slot is in two of indexed/removed/free/busy")
                    if sum(map(len, groups)) != f.layout.n_slots:
                        problems.append(f"{where}: slots do not balance")
                    rows = np.frombuffer(f.table, dtype=fmt.ENTRY_DTYPE, count=f.layout.n_slots)
                    on_table = set(np.flatnonzero(rows["state"] == fmt.EntryState.COMMITTED)
                                   .tolist())
                    if not members <= on_table:
                        problems.append(f"{where}: indexed slots are FREE in the slot table")
                    if not on_table <= members | removed | f.busy:
                        problems.append(f"{where}: slot table has COMMITTED slots nobody holds")
                    if f.committed != len(members) + len(removed):
                        problems.append(f"{where}: committed counter {f.committed} != indexed "
                                        f"{len(members)} + being read {len(removed)}")
            if budget != self.file_budget_used:
                problems.append(f"SSD file budget {self.file_budget_used} != files {budget}")
            if budget > self.capacity:
                problems.append(f"SSD files {budget} exceed spill.ssd_capacity {self.capacity}")
            held: collections.Counter[str] = collections.Counter()
            for e in self.index.values():
                held[e.namespace] += e.file.slot_bytes
            if +held != +self.index.bytes_of:
                problems.append(f"SSD bytes per namespace {dict(+self.index.bytes_of)} != "
                                f"{dict(+held)} counted from the index")
            if set(self.lru) != set(self.index.values()):
                problems.append("SSD LRU does not hold exactly the indexed entries")
            for (ns, key), e in self.index.items():
                if (e.namespace, e.key) != (ns, key) or e.removed:
                    problems.append(f"SSD index entry {ns}/{key.hex()} points at a wrong entry")
        return problems

    def _unlink_quietly(self, path: str) -> None:
        try:
            self.io.unlink(path)
        except OSError:
            pass


class _Retry(Exception):
    pass

