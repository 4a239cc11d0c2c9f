"""DRAM segments: a namespace's extent as two shared-memory files.

Mechanism only: this module knows the on-segment format and how to create,
map, pre-fault and lock a segment; it knows nothing of keys' meaning, eviction or
sessions (that is ``store``) nor of gRPC (that is ``service``).

Format version 2: each extent is a pair of files in the daemon's shm directory::

    <digest>.<index>.meta   daemon only: header page, then the slot table
                            (n_slots entries of SLOT_ENTRY_BYTES)
    <digest>.<index>.seg    the data, and nothing else: slot i at i * slot_bytes

Only the ``.seg`` file's descriptor is ever sent to a client (read-only to
readers), so what a client can reach is payload: the metadata the daemon
relies on after a crash lives where no client fd or mapping reaches
(format 1 kept both in one file, and a writer could forge it).
A client can still truncate, extend or punch holes in its data file; the
daemon touches data only through native calls that turn the resulting SIGBUS
into an error (``kvtier._accel.install_fault_guard``) and through syscalls,
checks the file's size at adoption and audits it while running
(``audit_data_file``).

Header: magic, format version, namespace name, block_bytes, slot_bytes,
model_uid, segment index within the namespace, boot epoch of the daemon that
formatted it, n_slots, table offset, creation time, and an xxh64 of
everything before it.  Slot entry: state, key, committed length, optional
checksum, last-access sequence, generation (bumped at every reserve, so a
reused slot is never mistaken for its previous content), the boot epoch of its
commit, and an entry checksum over all of that but the state byte and the
last access (seeded with the segment's creation time and the slot number, so
a row copied to another slot or segment does not verify).

Commit ordering (what makes a kill at any instant safe): the client writes
the payload; the daemon writes key/length/checksum/generation and the entry
checksum; the state byte flips to COMMITTED *last*.  Freeing flips the state
byte *first*, then clears the entry checksum.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import enum
import hashlib
import logging
import mmap
import os
import stat
import struct
import threading
import time
from typing import Final

import numpy as np
import xxhash

from kvtier import _accel
from kvtierd.layout import CONSTANTS, SLOT_ENTRY

log = logging.getLogger(__name__)

PAGE: Final = mmap.PAGESIZE
MAGIC: Final = b"KVTSEG\x00\x01"
FORMAT_VERSION: Final = 2
#: The daemon-only file (header + slot table) and the data file clients map.
META_SUFFIX: Final = ".meta"
DATA_SUFFIX: Final = ".seg"
#: Where the slot table starts: the header page comes first, and never shares a page
#: with the slot table or data.
TABLE_OFFSET: Final = CONSTANTS["SLOT_TABLE_OFFSET"]
HEADER_BYTES: Final = TABLE_OFFSET
#: The slot entry (csrc/layout.h): room for a 64-byte key plus fixed fields.
SLOT_ENTRY_BYTES: Final = SLOT_ENTRY.size
MAX_KEY_BYTES: Final = CONSTANTS["SLOT_MAX_KEY"]
NAME_BYTES: Final = 128
UID_BYTES: Final = 256

# magic, version, n_slots, segment_index, block_bytes, slot_bytes, table_offset,
# data_offset, boot_epoch, created_unix_ns, name_len, name, uid_len, uid
_HEADER = struct.Struct(f"<8sIIIQQQQQQH{NAME_BYTES}sH{UID_BYTES}s")
_HEADER_SUM = struct.Struct("<Q")
# state, key_len, flags, pad, pad32, length, checksum, generation, epoch, key, entry_sum,
# last_access.  The entry checksum covers the bytes [_SUM_FROM, ENTRY_SUM_AT): everything
# but the state byte (written last at commit, first at free) and the last access
# (rewritten at every read, and only an LRU hint).
_SLOT = SLOT_ENTRY.struct()
assert _SLOT.size <= SLOT_ENTRY_BYTES
#: Byte offsets of the state byte, the key, the entry checksum and the last access
#: inside a slot entry.
_STATE_AT: Final = SLOT_ENTRY.offset("state")
KEY_OFFSET: Final = SLOT_ENTRY.offset("key")
ENTRY_SUM_AT: Final = SLOT_ENTRY.offset("entry_sum")
_LAST_ACCESS_AT: Final = SLOT_ENTRY.offset("last_access")
_SUM_FROM: Final = CONSTANTS["SLOT_SUM_FROM"]
assert CONSTANTS["SLOT_SUM_TO"] == ENTRY_SUM_AT
_SEED_MUL: Final = CONSTANTS["SLOT_SEED_MUL"]
_SUM = struct.Struct("<Q")
#: Largest generation and access sequence a slot may carry (adoption drops or
#: resets bigger ones): at a million reserves a second, 2**48 lasts nine years.
MAX_GENERATION: Final = CONSTANTS["MAX_GENERATION"]
MAX_ACCESS_SEQ: Final = CONSTANTS["MAX_ACCESS_SEQ"]
_MASK64: Final = (1 << 64) - 1
assert _HEADER.size + _HEADER_SUM.size <= HEADER_BYTES

FLAG_HAS_CHECKSUM: Final = CONSTANTS["SLOT_HAS_CHECKSUM"]

#: The slot entry as a numpy record, for scanning whole tables at attach time.
SLOT_DTYPE: Final = SLOT_ENTRY.dtype()




def entry_seed(created_unix_ns: int, slot: int) -> int:
    """The entry checksum's seed: binds a row to its segment and its slot."""
    return (created_unix_ns ^ (slot * _SEED_MUL)) & _MASK64


def entry_sum(entry: bytes, seed: int) -> int:
    """Checksum of one slot entry: every field but the state byte and the last access."""
    return xxhash.xxh3_64_intdigest(entry[_SUM_FROM:ENTRY_SUM_AT], seed)


class SegmentInvalid(ValueError):
    """A segment file that must not be used; the message says why."""




class SlotState(enum.IntEnum):
    """The persisted state byte of a slot."""

    FREE = CONSTANTS["ST_FREE"]
    RESERVED = CONSTANTS["ST_RESERVED"]
    COMMITTED = CONSTANTS["ST_COMMITTED"]
    DOOMED = CONSTANTS["ST_DOOMED"]  # deleted while leased: freed at the last release, never re-adopted


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

    @property
    def meta_bytes(self) -> int:
        """Size of the daemon-only metadata file: header page and slot table."""
        return round_up(TABLE_OFFSET + self.n_slots * SLOT_ENTRY_BYTES, PAGE)

    @property
    def data_bytes(self) -> int:
        """Size of the data file clients map."""
        return self.n_slots * self.slot_bytes

    @property
    def data_offset(self) -> int:
        """Where the data starts in the file clients map: always 0 (format 2)."""
        return 0

    @property
    def file_bytes(self) -> int:
        """Shared memory the extent takes: both files."""
        return self.meta_bytes + self.data_bytes

    @staticmethod
    def one_slot_file_bytes(block_bytes: int) -> int:
        """Bytes of a segment (both files) holding exactly one slot of ``block_bytes``."""
        return round_up(TABLE_OFFSET + SLOT_ENTRY_BYTES, PAGE) + round_up(block_bytes, PAGE)

    @classmethod
    def fit(cls, block_bytes: int, budget_bytes: int) -> SegmentLayout | None:
        """The largest layout whose files fit in ``budget_bytes`` (None if not one slot)."""
        slot_bytes = round_up(block_bytes, PAGE)
        n = max(0, (budget_bytes - HEADER_BYTES) // (slot_bytes + SLOT_ENTRY_BYTES))
        while n > 0:
            layout = cls(block_bytes, slot_bytes, n)
            if layout.file_bytes <= budget_bytes:
                return layout
            n -= 1
        return None


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def segment_file_name(namespace: str, index: int, suffix: str = DATA_SUFFIX) -> str:
    """File name of a namespace's extent (data by default); the header holds the real name."""
    digest = hashlib.sha256(namespace.encode()).hexdigest()[:16]
    return f"{digest}.{index:06d}{suffix}"


def data_path_of(meta_path: str) -> str:
    """The data file that belongs to a metadata file."""
    return meta_path[: -len(META_SUFFIX)] + DATA_SUFFIX


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
    """One extent of a namespace: its open, mapped metadata and data files.

    Created and closed off the event loop (file I/O and page faults); the
    slot-table writers below are small in-memory stores into the daemon-only
    metadata mapping, safe on the loop.  ``fd``/``mm``/``path`` are the data
    file (the only one whose descriptor leaves the daemon); ``meta_fd``/
    ``meta``/``meta_path`` the metadata file.
    """

    def __init__(
        self,
        *,
        segment_id: int,
        path: str,
        fd: int,
        mm: mmap.mmap,
        meta_path: str,
        meta_fd: int,
        meta: mmap.mmap,
        namespace: str,
        model_uid: str,
        index: int,
        layout: SegmentLayout,
        created_unix_ns: int,
        mlock_error: str | None,
        prefault_seconds: float,
    ) -> None:
        self.segment_id = segment_id
        self.path = path
        self.fd = fd
        self.mm = mm
        self.meta_path = meta_path
        self.meta_fd = meta_fd
        self.meta = meta
        self.namespace = namespace
        self.model_uid = model_uid
        self.index = index
        self.layout = layout
        self.created_unix_ns = created_unix_ns
        self.mlock_error = mlock_error
        self.prefault_seconds = prefault_seconds
        #: True when attached from a previous run (its pages are locked after READY).
        self.adopted = False
        #: Data bytes found intact at attach: the file's size if a client cut it short
        #: (slots past it lost their bytes), else ``layout.data_bytes``.
        self.intact_bytes = layout.data_bytes
        #: What attach found wrong with the data file's size, if anything.
        self.size_fault: str | None = None
        #: Held while a worker thread uses ``fd`` by number (the audit) and while
        #: ``close`` closes it: a closed number is soon another file's (a segment
        #: created meanwhile), and an audit through it would cut that file to this
        #: layout's size.
        self._fd_lock = threading.Lock()
        self.closed = False

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
        """Create, size, pre-fault (in parallel) and format a new segment's two files."""
        _check_header_fields(namespace, model_uid)  # before any file exists
        meta_path = os.path.join(directory, segment_file_name(namespace, index, META_SUFFIX))
        path = os.path.join(directory, segment_file_name(namespace, index))
        t0 = time.perf_counter()
        with contextlib.ExitStack() as undo:
            # The data file first: a metadata file is what recovery looks for, so one
            # that exists always has its data file beside it.
            fd = _create_file(path, layout.data_bytes, undo)
            meta_fd = _create_file(meta_path, layout.meta_bytes, undo)
            mm = _map(fd, layout.data_bytes, undo)
            meta = _map(meta_fd, layout.meta_bytes, undo)
            _accel.prefault(meta, 1)
            # mlock faults the pages in as it locks them: touching them first as well
            # only walked them twice (~10% more of the kernel's time per page, which is
            # all of what a fill costs beyond a steady put: docs/decisions.md).  The
            # touch is for a mapping left unlocked.
            if mlock:
                meta_error, data_error = _mlock(meta), _mlock(mm)
                mlock_error = meta_error or data_error
            else:
                data_error = mlock_error = "mlock disabled by config (dram.mlock: false)"
            if data_error is not None:
                _accel.prefault(mm, prefault_threads)
            undo.pop_all()
        prefault_seconds = time.perf_counter() - t0
        created = time.time_ns()
        seg = cls(
            segment_id=segment_id, path=path, fd=fd, mm=mm, meta_path=meta_path,
            meta_fd=meta_fd, meta=meta, namespace=namespace, model_uid=model_uid, index=index,
            layout=layout, created_unix_ns=created, mlock_error=mlock_error,
            prefault_seconds=prefault_seconds,
        )
        seg._write_header(boot_epoch)
        mib = layout.file_bytes / 2**20
        log.info(
            "segment %s: namespace %r extent %d, %d slots of %d B, %.1f MiB, pre-faulted in "
            "%.3f s (%.2f GB/s)%s",
            os.path.basename(path), namespace, index, layout.n_slots, layout.slot_bytes, mib,
            prefault_seconds, layout.file_bytes / max(prefault_seconds, 1e-9) / 1e9,
            "" if seg.mlock_error is None else f"; not locked: {seg.mlock_error}",
        )
        return seg

    @classmethod
    def attach(cls, meta_path: str, *, segment_id: int) -> Segment:
        """Open and validate a previous run's segment without touching its data pages.

        Raises ``SegmentInvalid`` (never half-uses a segment): bad magic,
        version or header checksum, a geometry that does not add up, a
        metadata file whose size differs from the header's, a file name that
        does not match its header, or no data file.  A data file whose size
        is wrong (a client truncated or extended it) is set back to its size;
        ``intact_bytes`` says how much of it survived and ``size_fault`` what
        was wrong.
        """
        with contextlib.ExitStack() as undo:
            meta_fd = os.open(meta_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            undo.callback(os.close, meta_fd)
            size = os.fstat(meta_fd).st_size
            if size < HEADER_BYTES:
                raise SegmentInvalid(f"truncated: {size} bytes, shorter than its header")
            meta = _map(meta_fd, size, undo)
            head, layout = _checked_header(meta_path, meta, size)
            name = str(head["namespace"])
            index = int(head["index"])  # type: ignore[call-overload]
            path = data_path_of(meta_path)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError as exc:
                raise SegmentInvalid(f"its data file cannot be opened: {exc.strerror}") from None
            undo.callback(os.close, fd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentInvalid("its data file is not a regular file")
            intact, fault = st.st_size, None
            if st.st_size != layout.data_bytes:
                fault = (f"data file is {st.st_size} bytes, its metadata describes "
                         f"{layout.data_bytes} (truncated or extended by a client)")
                os.ftruncate(fd, layout.data_bytes)
                os.posix_fallocate(fd, 0, layout.data_bytes)  # the restored range too
                intact = min(st.st_size, layout.data_bytes)
            mm = _map(fd, layout.data_bytes, undo)
            undo.pop_all()
        seg = cls(
            segment_id=segment_id, path=path, fd=fd, mm=mm, meta_path=meta_path,
            meta_fd=meta_fd, meta=meta, namespace=name, model_uid=str(head["model_uid"]),
            index=index, layout=layout,
            created_unix_ns=int(head["created_unix_ns"]),  # type: ignore[call-overload]
            mlock_error=None, prefault_seconds=0.0,
        )
        seg.adopted = True
        seg.intact_bytes, seg.size_fault = intact, fault
        return seg

    def lock_and_populate(self, *, mlock: bool) -> None:
        """mlock an attached segment (faults its pages in without changing them)."""
        self.mlock_error = self._mlock() if mlock else "mlock disabled by config (dram.mlock: false)"

    def _mlock(self) -> str | None:
        # Both files, whatever the first says; mlock of a mapping a client cut short
        # fails (ENOMEM) instead of faulting.
        meta_error, data_error = _mlock(self.meta), _mlock(self.mm)
        return meta_error or data_error

    def audit_data_file(self) -> tuple[str, int] | None:
        """Set the data file back to its size if a client changed it (a worker thread).

        Returns None when the file is as the daemon made it, else (what was
        wrong, intact bytes): a file cut short lost the data of the slots past
        its new end (those bytes read as zeros now); an extended one is cut back
        (a client must not grow the host's shared memory); holes punched into
        it are allocated again, so a later write into them cannot fail for a
        full tmpfs.
        """
        want = self.layout.data_bytes
        with self._fd_lock:
            if self.closed:
                return None  # retired meanwhile: ``fd`` may name another file now
            st = os.fstat(self.fd)
            if st.st_size == want and st.st_blocks * 512 >= want:
                return None
            if st.st_size != want:
                kind = "shrunk" if st.st_size < want else "grown"
                os.ftruncate(self.fd, want)
            else:
                kind = "holes"
            try:
                os.posix_fallocate(self.fd, 0, want)
            except OSError as exc:
                log.warning("segment %s: cannot allocate its data file again: %s",
                            os.path.basename(self.path), exc)
        return kind, min(st.st_size, want)

    def scan(self, *, copy: bool = True) -> np.ndarray:
        """The whole slot table as a structured array (a snapshot, or a live view)."""
        view = np.frombuffer(self.meta, dtype=SLOT_DTYPE, count=self.layout.n_slots,
                             offset=TABLE_OFFSET)
        return view.copy() if copy else view

    def raw_table(self) -> bytes:
        """The slot table's bytes (recovery checks entry checksums on them)."""
        return bytes(self.meta[TABLE_OFFSET : TABLE_OFFSET + self.layout.n_slots
                               * SLOT_ENTRY_BYTES])

    def unlink(self) -> None:
        """Remove both files (the mappings stay valid until ``close``)."""
        _unlink_quietly(self.meta_path)
        _unlink_quietly(self.path)

    def close(self, *, unlink: bool, free: bool = False, keep_fd: bool = False) -> int | None:
        """Unmap and close; with ``unlink`` also remove the files (their data is gone).

        ``free`` (a segment the store retired or dropped): the data file's memory
        goes back to the host now, even while clients still hold fds or mappings of
        it (a client that kept its fd kept the pages of an unlinked file: memory
        beyond ``dram.capacity``).  It is freed by punching the whole file: a
        client's stale mapping then reads zeros, and a page it writes is a new one,
        charged to the client.  No fault: a writer stalled past its reservation,
        or a reader past its lease, is slow, not hostile.  ``keep_fd``: return a
        duplicate of the data file's fd (None if it could not be made), which the
        store cuts to 0 bytes later (``cut_data_file``), when no honest client can
        still be touching it."""
        for mm in (self.mm, self.meta):
            try:
                mm.close()
            except BufferError:  # a view is still exported; the GC unmaps it later
                pass
        kept = None
        with self._fd_lock:
            if self.closed:  # closed before: only the files may still have to go
                if unlink:
                    self.unlink()
                return None
            if free:
                punch_data_file(self.fd, os.path.basename(self.path))
                if keep_fd:
                    try:
                        kept = os.dup(self.fd)
                    except OSError:
                        kept = None
            self.closed = True
            os.close(self.fd)
            os.close(self.meta_fd)
        if unlink:
            self.unlink()
        return kept

    # ----------------------------------------------------------- header
    def _write_header(self, boot_epoch: int) -> None:
        name, uid = _check_header_fields(self.namespace, self.model_uid)
        lay = self.layout
        head = _HEADER.pack(
            MAGIC, FORMAT_VERSION, lay.n_slots, self.index, lay.block_bytes, lay.slot_bytes,
            TABLE_OFFSET, lay.data_offset, boot_epoch, self.created_unix_ns,
            len(name), name, len(uid), uid,
        )
        self.meta[: _HEADER.size] = head
        self.meta[_HEADER.size : _HEADER.size + _HEADER_SUM.size] = _HEADER_SUM.pack(
            xxhash.xxh64_intdigest(head)
        )

    # ----------------------------------------------------------- slot table
    def _entry_offset(self, slot: int) -> int:
        if not 0 <= slot < self.layout.n_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.layout.n_slots - 1}")
        return TABLE_OFFSET + slot * SLOT_ENTRY_BYTES

    def mark_reserved(self, slot: int, generation: int) -> None:
        off = self._entry_offset(slot)
        _SLOT.pack_into(self.meta, off, SlotState.RESERVED, 0, 0, 0, 0, 0, 0, generation, 0, b"",
                        0, 0)

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
        """Persist a commit: every field and the entry checksum first, the state byte last."""
        off = self._entry_offset(slot)
        flags = FLAG_HAS_CHECKSUM if checksum is not None else 0
        packed = _SLOT.pack(
            SlotState.RESERVED, len(key), flags, 0, 0, length, checksum or 0, generation, epoch,
            key, 0, last_access,
        )
        total = entry_sum(packed, entry_seed(self.created_unix_ns, slot))
        self.meta[off + _SUM_FROM : off + ENTRY_SUM_AT] = packed[_SUM_FROM:ENTRY_SUM_AT]
        _SUM.pack_into(self.meta, off + ENTRY_SUM_AT, total)
        _SUM.pack_into(self.meta, off + _LAST_ACCESS_AT, last_access)
        self.meta[off + _STATE_AT] = SlotState.COMMITTED

    def mark_doomed(self, slot: int) -> None:
        """A deleted block still being read: a restart must not bring it back."""
        self.meta[self._entry_offset(slot) + _STATE_AT] = SlotState.DOOMED

    def mark_free(self, slot: int) -> None:
        """Invalidate first: the state byte flips, then the entry checksum is cleared."""
        off = self._entry_offset(slot)
        self.meta[off + _STATE_AT] = SlotState.FREE
        _SUM.pack_into(self.meta, off + ENTRY_SUM_AT, 0)

    def touch(self, slot: int, last_access: int) -> None:
        _SUM.pack_into(self.meta, self._entry_offset(slot) + _LAST_ACCESS_AT, last_access)

    def read_slot(self, slot: int) -> SlotRecord:
        st, klen, flags, _, _, length, csum, gen, epoch, key, _, last = _SLOT.unpack_from(
            self.meta, self._entry_offset(slot)
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
        """Offset of a slot within the data file (what clients address)."""
        return slot * self.layout.slot_bytes

    def data_view(self, slot: int, length: int) -> memoryview:
        """The daemon's own view of a slot's bytes (tiers and tests, never the hot path).

        Client-writable memory: touch it only through ``kvtier._accel`` calls
        (which raise OSError EFAULT when a client removed the pages) or
        syscalls, never with plain Python or numpy reads.
        """
        start = self.slot_offset(slot)
        return memoryview(self.mm)[start : start + length]


def slots_by_namespace(shm_dir: str, *, max_bytes: int) -> dict[str, int]:
    """The slots of the segments in ``shm_dir`` a warm start would attach, per
    namespace, from their metadata headers alone (validated as ``Segment.attach`` does;
    nothing written, nothing kept open; a file that does not validate counts nothing),
    at most ``max_bytes`` of slots per namespace (what dram.capacity can adopt): an
    upper bound on the blocks recovery will adopt (``shared_index.prepare_tables``)."""
    out: dict[str, int] = {}
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return out
    for file in names:
        if not file.endswith(META_SUFFIX):
            continue
        try:
            fd = os.open(os.path.join(shm_dir, file), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            head, layout = _checked_header(file, os.pread(fd, HEADER_BYTES, 0), size)
        except (OSError, SegmentInvalid):
            continue
        finally:
            os.close(fd)
        name = str(head["namespace"])
        most = max_bytes // layout.slot_bytes
        out[name] = min(most, out.get(name, 0) + layout.n_slots)
    return out


def _checked_header(meta_path: str, meta: mmap.mmap | bytes, size: int
                    ) -> tuple[dict[str, object], SegmentLayout]:
    """A metadata file's header and layout, validated (``Segment.attach``): its
    checksum and fields, a geometry that adds up to the file's ``size``, and a file
    name that matches it.  Raises ``SegmentInvalid`` naming what is wrong."""
    try:
        head = read_header(meta)
    except (ValueError, struct.error) as exc:  # (struct.error: fewer bytes than a header)
        raise SegmentInvalid(str(exc)) from None
    layout = _validated_layout(head, size)
    name, index = str(head["namespace"]), int(head["index"])  # type: ignore[call-overload]
    if os.path.basename(meta_path) != segment_file_name(name, index, META_SUFFIX):
        raise SegmentInvalid(
            f"file name does not match its header (namespace {name!r}, extent {index})")
    return head, layout


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
    if nlen > NAME_BYTES or ulen > UID_BYTES:
        raise ValueError(f"name length {nlen} or model_uid length {ulen} out of range")
    try:
        namespace, model_uid = name[:nlen].decode(), uid[:ulen].decode()
    except UnicodeDecodeError:
        raise ValueError("namespace or model_uid is not UTF-8") from None
    return {
        "n_slots": n_slots, "index": index, "block_bytes": block_bytes, "slot_bytes": slot_bytes,
        "table_offset": table_off, "data_offset": data_off, "boot_epoch": epoch,
        "created_unix_ns": created, "namespace": namespace, "model_uid": model_uid,
    }


def _validated_layout(head: dict[str, object], meta_size: int) -> SegmentLayout:
    """The layout a header describes, if its numbers are mutually consistent."""
    n, block, slot, table, data = (int(head[k]) for k in (  # type: ignore[call-overload]
        "n_slots", "block_bytes", "slot_bytes", "table_offset", "data_offset"))
    if n < 1 or block < 1:
        raise SegmentInvalid(f"header has n_slots={n} block_bytes={block}")
    if slot != round_up(block, PAGE) or table != TABLE_OFFSET or data != 0:
        raise SegmentInvalid(f"header geometry is inconsistent (slot_bytes={slot}, "
                             f"block_bytes={block}, table_offset={table}, data_offset={data})")
    layout = SegmentLayout(block, slot, n)
    if meta_size != layout.meta_bytes:
        raise SegmentInvalid(
            f"metadata file is {meta_size} bytes but its header describes {layout.meta_bytes} "
            "(truncated or extended)"
        )
    return layout


def _check_header_fields(namespace: str, model_uid: str) -> tuple[bytes, bytes]:
    name, uid = namespace.encode(), model_uid.encode()
    if len(name) > NAME_BYTES or len(uid) > UID_BYTES:
        raise ValueError(f"namespace ({len(name)} B) or model_uid ({len(uid)} B) too long "
                         f"for the header ({NAME_BYTES}/{UID_BYTES} B)")
    return name, uid


_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
_libc.fallocate.restype = ctypes.c_int
_FALLOC_FL_KEEP_SIZE: Final = 0x01
_FALLOC_FL_PUNCH_HOLE: Final = 0x02


def punch_data_file(fd: int, name: str) -> None:
    """Give a data file's memory back (its size stays; it reads as zeros)."""
    try:
        size = os.fstat(fd).st_size
        if size and _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                                    0, size) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except OSError as exc:
        log.warning("segment %s: its memory could not be freed: %s", name, exc)


def cut_data_file(fd: int) -> None:
    """Cut a retired data file to 0 bytes and close the fd the store kept of it: what a
    client re-touched of it since it was punched goes too (a touch faults from now)."""
    try:
        os.ftruncate(fd, 0)
    except OSError as exc:
        log.warning("a retired data file could not be cut to 0 bytes: %s", exc)
    finally:
        os.close(fd)


def _create_file(path: str, size: int, undo: contextlib.ExitStack) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    undo.callback(os.close, fd)
    undo.callback(_unlink_quietly, path)
    # Allocate now: a tmpfs smaller than the pool gives ENOSPC here instead of
    # SIGBUS when the pages are first touched.
    os.posix_fallocate(fd, 0, size)
    return fd


def _map(fd: int, size: int, undo: contextlib.ExitStack) -> mmap.mmap:
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    undo.callback(mm.close)
    return mm


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
