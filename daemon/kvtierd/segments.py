"""DRAM segments: self-describing shared-memory files of fixed-size slots.

Mechanism only: this module knows the on-segment format and how to create,
map, pre-fault and lock a segment; it knows nothing of keys' meaning, LRU or
sessions (that is ``store``) nor of gRPC (that is ``service``).

On-segment format, version 1 (all integers little-endian)::

    offset 0            header (HEADER_BYTES = one page)
    offset TABLE_OFFSET slot table: n_slots entries of SLOT_ENTRY_BYTES
    offset data_offset  data area (page aligned): slot i at i * slot_bytes

Header: magic, format version, namespace name, block_bytes, slot_bytes,
model_uid, segment index within the namespace, boot epoch of the daemon that
formatted it, n_slots, table/data offsets, and an xxh64 of everything before
it.  Slot entry: state, key, committed length, optional checksum, last-access
sequence, generation (bumped at every reserve, so a reused slot is never
mistaken for its previous content) and the boot epoch of its commit.

Commit ordering (what makes a kill at any instant safe): the client writes
the payload; the daemon writes key/length/checksum/generation; the state byte
flips to COMMITTED *last*.  Freeing flips the state byte *first*.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import enum
import hashlib
import logging
import mmap
import os
import struct
import time
from typing import Final

import numpy as np
import xxhash

from kvtier import _accel

log = logging.getLogger(__name__)

PAGE: Final = mmap.PAGESIZE
MAGIC: Final = b"KVTSEG\x00\x01"
FORMAT_VERSION: Final = 1
#: One page: the header never shares a page with the slot table or data.
HEADER_BYTES: Final = 4096
TABLE_OFFSET: Final = HEADER_BYTES
#: 128 bytes: room for a 64-byte key plus fixed fields, cache-line multiple.
SLOT_ENTRY_BYTES: Final = 128
MAX_KEY_BYTES: Final = 64
NAME_BYTES: Final = 128
UID_BYTES: Final = 256

# magic, version, n_slots, segment_index, block_bytes, slot_bytes, table_offset,
# data_offset, boot_epoch, created_unix_ns, name_len, name, uid_len, uid
_HEADER = struct.Struct(f"<8sIIIQQQQQQH{NAME_BYTES}sH{UID_BYTES}s")
_HEADER_SUM = struct.Struct("<Q")
# state, key_len, flags, pad, pad32, length, checksum, last_access, generation, epoch, key
_SLOT = struct.Struct(f"<BBBBIQQQQQ{MAX_KEY_BYTES}s")
assert _SLOT.size <= SLOT_ENTRY_BYTES
assert _HEADER.size + _HEADER_SUM.size <= HEADER_BYTES

FLAG_HAS_CHECKSUM: Final = 1
#: Byte offset of the key inside a slot entry.
KEY_OFFSET: Final = 48

#: The slot entry as a numpy record, for scanning whole tables at attach time.
SLOT_DTYPE: Final = np.dtype(
    {
        "names": ["state", "key_len", "flags", "length", "checksum", "last_access",
                  "generation", "epoch", "key"],
        "formats": ["u1", "u1", "u1", "<u8", "<u8", "<u8", "<u8", "<u8", f"S{MAX_KEY_BYTES}"],
        "offsets": [0, 1, 2, 8, 16, 24, 32, 40, KEY_OFFSET],
        "itemsize": SLOT_ENTRY_BYTES,
    }
)


class SegmentInvalid(ValueError):
    """A segment file that must not be used; the message says why."""
#: Byte offset of last_access inside a slot entry (after 4 bytes, pad32, length, checksum).
_LAST_ACCESS_AT: Final = 24


class SlotState(enum.IntEnum):
    """The persisted state byte of a slot."""

    FREE = 0
    RESERVED = 1
    COMMITTED = 2
    DOOMED = 3  # deleted while leased: freed at the last release, never re-adopted


@dataclasses.dataclass(frozen=True, slots=True)
class SlotRecord:
    """One decoded slot-table entry."""

    state: SlotState
    key: bytes
    length: int
    checksum: int | None
    last_access: int
    generation: int
    epoch: int


@dataclasses.dataclass(frozen=True, slots=True)
class SegmentLayout:
    """Geometry of a segment, derived from the block size and a byte budget."""

    block_bytes: int
    slot_bytes: int
    n_slots: int
    data_offset: int

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.n_slots * self.slot_bytes

    @staticmethod
    def one_slot_file_bytes(block_bytes: int) -> int:
        """Bytes of a segment file holding exactly one slot of ``block_bytes``."""
        return round_up(TABLE_OFFSET + SLOT_ENTRY_BYTES, PAGE) + round_up(block_bytes, PAGE)

    @classmethod
    def fit(cls, block_bytes: int, budget_bytes: int) -> SegmentLayout | None:
        """The largest layout whose file fits in ``budget_bytes`` (None if not one slot)."""
        slot_bytes = round_up(block_bytes, PAGE)
        n = max(0, (budget_bytes - HEADER_BYTES) // (slot_bytes + SLOT_ENTRY_BYTES))
        while n > 0:
            data_offset = round_up(TABLE_OFFSET + n * SLOT_ENTRY_BYTES, PAGE)
            if data_offset + n * slot_bytes <= budget_bytes:
                return cls(block_bytes, slot_bytes, n, data_offset)
            n -= 1
        return None


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def segment_file_name(namespace: str, index: int) -> str:
    """File name for a namespace's extent; the header holds the real name."""
    digest = hashlib.sha256(namespace.encode()).hexdigest()[:16]
    return f"{digest}.{index:06d}.seg"


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mlock.restype = ctypes.c_int


def _mlock(mm: mmap.mmap) -> str | None:
    """mlock the whole mapping; the reason as text when the kernel refuses."""
    buf = ctypes.c_char.from_buffer(mm)
    try:
        rc = _libc.mlock(ctypes.addressof(buf), len(mm))
    finally:
        del buf  # release the export so the mmap can be closed later
    if rc != 0:
        err = ctypes.get_errno()
        return f"mlock failed: {os.strerror(err)} (raise RLIMIT_MEMLOCK, e.g. LimitMEMLOCK=infinity)"
    return None


class Segment:
    """One extent of a namespace: an open, mapped, formatted segment file.

    Created and closed off the event loop (file I/O and page faults); the
    slot-table writers below are small in-memory stores, safe on the loop.
    """

    def __init__(
        self,
        *,
        segment_id: int,
        path: str,
        fd: int,
        mm: mmap.mmap,
        namespace: str,
        model_uid: str,
        index: int,
        layout: SegmentLayout,
        mlock_error: str | None,
        prefault_seconds: float,
    ) -> None:
        self.segment_id = segment_id
        self.path = path
        self.fd = fd
        self.mm = mm
        self.namespace = namespace
        self.model_uid = model_uid
        self.index = index
        self.layout = layout
        self.mlock_error = mlock_error
        self.prefault_seconds = prefault_seconds
        #: True when attached from a previous run (its pages are locked after READY).
        self.adopted = False

    # ----------------------------------------------------------- lifecycle
    @classmethod
    def create(
        cls,
        directory: str,
        *,
        segment_id: int,
        namespace: str,
        model_uid: str,
        index: int,
        layout: SegmentLayout,
        boot_epoch: int,
        mlock: bool,
        prefault_threads: int = 0,
    ) -> Segment:
        """Create, size, pre-fault (in parallel) and format a new segment file."""
        path = os.path.join(directory, segment_file_name(namespace, index))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        t0 = time.perf_counter()
        try:
            # Allocate now: a tmpfs smaller than the pool gives ENOSPC here
            # instead of SIGBUS when the pages are first touched.
            os.posix_fallocate(fd, 0, layout.file_bytes)
            mm = mmap.mmap(fd, layout.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        _accel.prefault(mm, prefault_threads)
        prefault_seconds = time.perf_counter() - t0
        mlock_error = _mlock(mm) if mlock else "mlock disabled by config (dram.mlock: false)"
        seg = cls(
            segment_id=segment_id,
            path=path,
            fd=fd,
            mm=mm,
            namespace=namespace,
            model_uid=model_uid,
            index=index,
            layout=layout,
            mlock_error=mlock_error,
            prefault_seconds=prefault_seconds,
        )
        seg._write_header(boot_epoch)
        mib = layout.file_bytes / 2**20
        log.info(
            "segment %s: namespace %r extent %d, %d slots of %d B, %.1f MiB, pre-faulted in "
            "%.3f s (%.2f GB/s)%s",
            os.path.basename(path), namespace, index, layout.n_slots, layout.slot_bytes, mib,
            prefault_seconds, layout.file_bytes / max(prefault_seconds, 1e-9) / 1e9,
            "" if mlock_error is None else f"; not locked: {mlock_error}",
        )
        return seg

    @classmethod
    def attach(cls, path: str, *, segment_id: int) -> Segment:
        """Open and validate an existing segment file without touching its data pages.

        Raises ``SegmentInvalid`` (never half-uses a file): bad magic,
        version or header checksum, a geometry that does not add up, a file
        size that differs from the header's (truncated or extended), or a
        file name that does not match its header.
        """
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise SegmentInvalid(f"truncated: {size} bytes, shorter than its header")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                try:
                    head = read_header(mm)
                except ValueError as exc:
                    raise SegmentInvalid(str(exc)) from None
                layout = _validated_layout(head, size)
                name = str(head["namespace"])
                index = int(head["index"])  # type: ignore[call-overload]
                if os.path.basename(path) != segment_file_name(name, index):
                    raise SegmentInvalid(
                        f"file name does not match its header (namespace {name!r}, extent {index})"
                    )
            except BaseException:
                mm.close()
                raise
        except BaseException:
            os.close(fd)
            raise
        seg = cls(
            segment_id=segment_id, path=path, fd=fd, mm=mm, namespace=name,
            model_uid=str(head["model_uid"]), index=index, layout=layout,
            mlock_error=None, prefault_seconds=0.0,
        )
        seg.adopted = True
        return seg

    def lock_and_populate(self, *, mlock: bool) -> None:
        """mlock an attached segment (faults its pages in without changing them)."""
        self.mlock_error = _mlock(self.mm) if mlock else "mlock disabled by config (dram.mlock: false)"

    def scan(self, *, copy: bool = True) -> np.ndarray:
        """The whole slot table as a structured array (a snapshot, or a live view)."""
        view = np.frombuffer(self.mm, dtype=SLOT_DTYPE, count=self.layout.n_slots,
                             offset=TABLE_OFFSET)
        return view.copy() if copy else view

    def unlink(self) -> None:
        """Remove the file (the mapping stays valid until ``close``)."""
        _unlink_quietly(self.path)

    def close(self, *, unlink: bool) -> None:
        """Unmap and close; with ``unlink`` also remove the file (its data is gone)."""
        try:
            self.mm.close()
        except BufferError:  # a view is still exported; the GC unmaps it later
            pass
        os.close(self.fd)
        if unlink:
            _unlink_quietly(self.path)

    # ----------------------------------------------------------- header
    def _write_header(self, boot_epoch: int) -> None:
        name = self.namespace.encode()
        uid = self.model_uid.encode()
        if len(name) > NAME_BYTES or len(uid) > UID_BYTES:
            raise ValueError(f"namespace ({len(name)} B) or model_uid ({len(uid)} B) too long "
                             f"for the header ({NAME_BYTES}/{UID_BYTES} B)")
        lay = self.layout
        head = _HEADER.pack(
            MAGIC, FORMAT_VERSION, lay.n_slots, self.index, lay.block_bytes, lay.slot_bytes,
            TABLE_OFFSET, lay.data_offset, boot_epoch, time.time_ns(),
            len(name), name, len(uid), uid,
        )
        self.mm[: _HEADER.size] = head
        self.mm[_HEADER.size : _HEADER.size + _HEADER_SUM.size] = _HEADER_SUM.pack(
            xxhash.xxh64_intdigest(head)
        )

    # ----------------------------------------------------------- slot table
    def _entry_offset(self, slot: int) -> int:
        if not 0 <= slot < self.layout.n_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.layout.n_slots - 1}")
        return TABLE_OFFSET + slot * SLOT_ENTRY_BYTES

    def mark_reserved(self, slot: int, generation: int) -> None:
        off = self._entry_offset(slot)
        _SLOT.pack_into(self.mm, off, SlotState.RESERVED, 0, 0, 0, 0, 0, 0, 0, generation, 0, b"")

    def mark_committed(
        self,
        slot: int,
        *,
        key: bytes,
        length: int,
        checksum: int | None,
        last_access: int,
        generation: int,
        epoch: int,
    ) -> None:
        """Persist a commit: every field first, the state byte last."""
        off = self._entry_offset(slot)
        flags = FLAG_HAS_CHECKSUM if checksum is not None else 0
        packed = _SLOT.pack(
            SlotState.RESERVED, len(key), flags, 0, 0, length, checksum or 0, last_access,
            generation, epoch, key,
        )
        self.mm[off + 1 : off + _SLOT.size] = packed[1:]
        self.mm[off] = SlotState.COMMITTED

    def mark_doomed(self, slot: int) -> None:
        """A deleted block still being read: a restart must not bring it back."""
        self.mm[self._entry_offset(slot)] = SlotState.DOOMED

    def mark_free(self, slot: int) -> None:
        """Invalidate first: the state byte flips before anything else changes."""
        self.mm[self._entry_offset(slot)] = SlotState.FREE

    def touch(self, slot: int, last_access: int) -> None:
        struct.pack_into("<Q", self.mm, self._entry_offset(slot) + _LAST_ACCESS_AT, last_access)

    def read_slot(self, slot: int) -> SlotRecord:
        st, klen, flags, _, _, length, csum, last, gen, epoch, key = _SLOT.unpack_from(
            self.mm, self._entry_offset(slot)
        )
        return SlotRecord(
            state=SlotState(st),
            key=key[:klen],
            length=length,
            checksum=csum if flags & FLAG_HAS_CHECKSUM else None,
            last_access=last,
            generation=gen,
            epoch=epoch,
        )

    # ----------------------------------------------------------- data
    def slot_offset(self, slot: int) -> int:
        """Offset of a slot within the data area (what clients address)."""
        return slot * self.layout.slot_bytes

    def data_view(self, slot: int, length: int) -> memoryview:
        """The daemon's own view of a slot's bytes (tests and tiers, never the hot path)."""
        start = self.layout.data_offset + self.slot_offset(slot)
        return memoryview(self.mm)[start : start + length]


def read_header(mm: mmap.mmap | bytes) -> dict[str, object]:
    """Decode and validate a header; raises ValueError naming what is wrong."""
    head = bytes(mm[: _HEADER.size])
    (stored,) = _HEADER_SUM.unpack(bytes(mm[_HEADER.size : _HEADER.size + _HEADER_SUM.size]))
    if head[:8] != MAGIC:
        raise ValueError(f"bad magic {head[:8]!r}")
    if xxhash.xxh64_intdigest(head) != stored:
        raise ValueError("header checksum mismatch")
    (_, version, n_slots, index, block_bytes, slot_bytes, table_off, data_off, epoch, created,
     nlen, name, ulen, uid) = _HEADER.unpack(head)
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version}, expected {FORMAT_VERSION}")
    return {
        "n_slots": n_slots, "index": index, "block_bytes": block_bytes, "slot_bytes": slot_bytes,
        "table_offset": table_off, "data_offset": data_off, "boot_epoch": epoch,
        "created_unix_ns": created, "namespace": name[:nlen].decode(),
        "model_uid": uid[:ulen].decode(),
    }


def _validated_layout(head: dict[str, object], file_size: int) -> SegmentLayout:
    """The layout a header describes, if its numbers are mutually consistent."""
    n, block, slot, table, data = (int(head[k]) for k in (  # type: ignore[call-overload]
        "n_slots", "block_bytes", "slot_bytes", "table_offset", "data_offset"))
    if n < 1 or block < 1:
        raise SegmentInvalid(f"header has n_slots={n} block_bytes={block}")
    if slot != round_up(block, PAGE) or table != TABLE_OFFSET:
        raise SegmentInvalid(f"header geometry is inconsistent (slot_bytes={slot}, "
                             f"block_bytes={block}, table_offset={table})")
    if data != round_up(TABLE_OFFSET + n * SLOT_ENTRY_BYTES, PAGE):
        raise SegmentInvalid(f"header data_offset {data} does not follow from {n} slots")
    layout = SegmentLayout(block, slot, n, data)
    if file_size != layout.file_bytes:
        raise SegmentInvalid(
            f"file is {file_size} bytes but its header describes {layout.file_bytes} "
            "(truncated or extended)"
        )
    return layout


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
