"""The SSD tier's files and what it keeps per slot: a spill file and its slot columns
(:class:`SpillFile`), the entry snapshot a lookup returns (:class:`SsdEntry`), the
tier's counters, and creating and retiring a file on disk.

Per spill file, columns of numpy arrays indexed by slot (state, readers, referenced
bit, namespace id: 8 bytes a slot) and a free stack (4 bytes a slot); everything else
an entry has (key, namespace, length, checksum, geometry, write sequence) is read
from the file's slot-table mirror, which the tier keeps anyway to write table pages.
No Python object per entry at rest: an SSD tier holds millions of entries.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

import numpy as np

from kvtierd.spill import format as fmt
from kvtierd.spill.blockio import BlockIO, aligned_buffer

log = logging.getLogger(__name__)

FILE_RE: Final = re.compile(r"spill-([0-9]+)-([0-9]+)\.kvt")
#: A slot size's first spill file is this big (or 8 slots); each next one doubles, up to
#: ``spill.ssd_file_size``: a few MiB of spill never allocate gigabytes.
FIRST_FILE_BYTES: Final = 64 << 20
FIRST_FILE_SLOTS: Final = 8

#: In-memory slot states (the slot table on disk knows only FREE and COMMITTED).
FREE: Final = 0
INDEXED: Final = 1  # committed and in the key index
BUSY: Final = 2  # owned by a writer
REMOVED: Final = 3  # out of the index, still being read: freed at its last reader

ENTRY_BYTES: Final = fmt.ENTRY_BYTES
#: An entry's length, checksum, block_bytes and model hash (at byte 8 of the entry).
FIELDS: Final = struct.Struct("<QQQQ")
#: The same fields as u64 words of an entry (``length_of_many`` reads them vectorised).
ROW_WORDS: Final = ENTRY_BYTES // 8
LENGTH_WORD: Final = 1  # (bytes 8, 24 and 32 of the entry: fmt.ENTRY_DTYPE)
BLOCK_BYTES_WORD: Final = 3
MODEL_HASH_WORD: Final = 4
assert fmt.ENTRY_DTYPE.fields is not None and [
    fmt.ENTRY_DTYPE.fields[name][1] for name in ("length", "block_bytes", "model_hash")
] == [8 * LENGTH_WORD, 8 * BLOCK_BYTES_WORD, 8 * MODEL_HASH_WORD]


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
    #: Table pages holding entries freed since the tier's last ``flush_frees``.
    freed_pages: set[int] = dataclasses.field(default_factory=set)
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
        """Free a slot's entry in the mirror; its page is written at the next flush of
        frees."""
        self.table[slot * fmt.ENTRY_BYTES : (slot + 1) * fmt.ENTRY_BYTES] = bytes(
            fmt.ENTRY_BYTES)
        self.freed_pages.add(slot // fmt.ENTRIES_PER_PAGE)

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


def entry_at(names: list[str], f: SpillFile, slot: int) -> SsdEntry:
    """The snapshot of a slot's entry (the tier's lock held), ``names`` the namespaces
    by id."""
    (_, klen, _, _, _, length, checksum, block_bytes, mhash, seq, key,
     _) = fmt.ENTRY_STRUCT.unpack_from(f.table, slot * fmt.ENTRY_BYTES)
    return SsdEntry(names[int(f.nsid[slot])], key[:klen], f, slot, length, checksum,
                    block_bytes, mhash, seq)


def create_file(io: BlockIO, root: str, layout: fmt.SpillLayout, index: int,
                flags: int) -> SpillFile:
    """A new spill file, all its slots FREE: written under a temporary name, synced,
    then renamed into place (a crash leaves no half-made file under a spill name)."""
    name = f"spill-{layout.slot_bytes}-{index}.kvt"
    path = os.path.join(root, name)
    tmp = path + ".tmp"
    fd = io.open(tmp, flags | os.O_CREAT | os.O_EXCL)
    try:
        io.fallocate(fd, layout.file_bytes)
        head = aligned_buffer(fmt.PAGE)
        head[:] = fmt.pack_spill_header(layout, index, time.time_ns())
        io.pwrite(fd, head, 0)
        table = aligned_buffer(layout.table_bytes)
        io.pwrite(fd, table, fmt.TABLE_OFFSET)  # zeros: every slot FREE
        io.fdatasync(fd)
        io.rename(tmp, path)
        io.fsync_dir(root)
    except BaseException:
        io.close(fd)
        unlink_quietly(io, tmp)
        raise
    log.info("SSD tier: created %s (%d slots of %d bytes)", name, layout.n_slots,
             layout.slot_bytes)
    return SpillFile(path, fd, index, layout, table)


def retire_file(io: BlockIO, f: SpillFile) -> None:
    """Unlink and close a file the tier let go of (on a thread of its own)."""
    with f.io_lock:  # a table write in flight finishes first; later ones see retired
        f.retired = True
        try:
            io.unlink(f.path)
        except OSError:
            pass
        io.close(f.fd)


def unlink_quietly(io: BlockIO, path: str) -> None:
    try:
        io.unlink(path)
    except OSError:
        pass


def fdatasync(io: BlockIO, f: SpillFile) -> None:
    with f.io_lock:
        if not f.retired:
            io.fdatasync(f.fd)


def write_table_pages(io: BlockIO, lock: threading.Lock, f: SpillFile,
                      pages: Iterable[int]) -> None:
    """Write these pages of a file's slot-table mirror (copied under the tier's ``lock``):
    each run of consecutive pages in one write."""
    runs: list[tuple[int, int]] = []  # (first page, pages)
    for page in sorted(pages):
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    with f.io_lock:
        if f.retired:
            return
        for first, n in runs:
            at, size = first * fmt.PAGE, n * fmt.PAGE
            buf = aligned_buffer(size)  # (exactly ``size``: passed whole, no view to release)
            try:
                with lock:
                    buf[:] = f.table[at : at + size]
                io.pwrite(f.fd, buf, fmt.TABLE_OFFSET + at)
            finally:
                buf.close()
