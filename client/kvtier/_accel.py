"""The one seam between kvtier and its native helpers (``kvtier._native``).

Use ``copy_into``, ``prefault``, ``checksum``, ``gather``, ``scatter``,
``scatter_hash``, ``pwrite_full`` and ``pread_full`` from here, never ``_native`` directly: when
the extension is not built (a source checkout without ``build_ext``) or the
environment sets ``KVTIER_FORCE_PY=1``, they run pure Python/numpy fallbacks
(``checksum``: the xxhash package) with the same contracts, exceptions and
messages.  ``NATIVE`` says which is in use; it is fixed at import time.

The fallbacks are correct but slower: one thread, the GIL held while copying,
and ``prefault``'s read-then-write-back is not atomic, so a byte written by
another thread or process between the read and the write back can be undone.
Only prefault memory nobody else writes yet (fresh segments) on the fallback
path.

A process that maps files other processes can truncate (kvtierd maps the
shared-memory files it hands out to clients) calls ``install_fault_guard()``
once: then a SIGBUS while ``copy_into``, ``prefault``, ``checksum``,
``gather``, ``scatter`` or ``scatter_hash`` touches a buffer (the file mapped there shrank)
raises ``OSError(EFAULT)`` instead of killing the process, and
``is_memory_fault`` recognises it.  Only the native path can guard: on the
fallback, numpy touching such a buffer still dies of SIGBUS.

Clients are such processes: any writer of a namespace can truncate the
namespace's data files, which every client of it maps.  ``kvtier.Client``
and ``kvtier.AsyncClient`` install the guard when they are created
(``install_client_fault_guard``; ``KVTIER_FAULT_GUARD=0`` opts out) and touch
slot memory only through the helpers here, so a writer's truncation costs the
other processes of the namespace misses and errors, not their lives.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import operator
import os
import stat
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import xxhash

try:
    from kvtier import _native
except ImportError:  # not built: the fallbacks below serve
    _HAVE_NATIVE = False
else:
    _HAVE_NATIVE = True

#: True when the functions here run the C extension (GIL released, threaded).
NATIVE: Final[bool] = _HAVE_NATIVE and os.environ.get("KVTIER_FORCE_PY") != "1"

#: prefault touches one byte every PAGE_SIZE bytes: the smallest page size on
#: the platforms we run on (same constant as KVT_PAGE in csrc/native.c).
PAGE_SIZE: Final = 4096


#: The start of the message (``strerror``) of the OSError(EFAULT) a guarded
#: call raises for a SIGBUS: "memory fault (SIGBUS) at byte N of dst: ...".
MEMORY_FAULT: Final = "memory fault (SIGBUS)"

#: Threads for one large copy.  On a machine with two CPUs or fewer a second
#: thread mostly waits for a CPU another process holds (measured: 7.8 GiB/s
#: with 2 threads vs 15.3 GiB/s with 1 under load), so use one; else auto.
_COPY_THREADS: Final = 1 if len(os.sched_getaffinity(0)) <= 2 else 0


def install_fault_guard() -> bool:
    """Make a SIGBUS in the memory helpers here raise OSError(EFAULT), not kill us.

    Installs (once per process; later calls do nothing) a SIGBUS handler, after
    which ``copy_into``, ``prefault``, ``checksum``, ``gather``, ``scatter``
    and ``scatter_hash`` raise OSError with errno EFAULT and a message starting with
    ``MEMORY_FAULT`` when a buffer they touch faults (a mapped file truncated
    under it, or its file system out of space); the process lives on.  A
    SIGBUS anywhere else goes on to the handler there was before
    (faulthandler's, say) or kills the process as without the guard; SIGSEGV
    is left alone.  Call it after ``faulthandler.enable()``: a handler
    installed later sees SIGBUS first.

    Returns True when the guard is in place (installed by this call or an
    earlier one).  On the pure-Python fallback it is a no-op returning False:
    numpy's copies cannot be guarded, so a fault there still kills the process.
    """
    if NATIVE:
        _native.install_fault_guard()
        return True
    return False


#: ``KVTIER_FAULT_GUARD=0`` (or false/no/off): kvtier clients do not install the
#: fault guard (``install_client_fault_guard``).  For a process whose own SIGBUS
#: handling must see every SIGBUS first, or that wants a core dump at the fault.
FAULT_GUARD_ENV: Final = "KVTIER_FAULT_GUARD"


def install_client_fault_guard() -> bool:
    """The fault guard for a kvtier client process, unless ``KVTIER_FAULT_GUARD=0``.

    ``kvtier.Client`` and ``kvtier.AsyncClient`` call it when created: it
    installs the guard (``install_fault_guard``: once per process, chaining
    to the SIGBUS handler there was before) unless the environment opts out.
    Returns whether the guard is in place now (installed by this call, an
    earlier one or anyone else in the process): only then is a copy out of or
    into a truncated slot an error instead of a SIGBUS.  False on the
    pure-Python fallback, which cannot guard.
    """
    if os.environ.get(FAULT_GUARD_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return fault_guard_installed()
    return install_fault_guard()


def fault_guard_installed() -> bool:
    """Whether the fault guard is in place in this process (and the native path in use)."""
    return NATIVE and bool(_native.fault_guard_installed())


def is_memory_fault(exc: BaseException) -> bool:
    """Whether ``exc`` says a buffer's memory was gone (its mapped file truncated).

    True for the OSError(EFAULT) a guarded call raises for a SIGBUS (its
    message starts with ``MEMORY_FAULT``) and for the OSError(EFAULT) "Bad
    address" that ``pwrite_full``/``pread_full`` (system calls, which fail
    rather than fault) raise for the same cause, guard or not.
    """
    return isinstance(exc, OSError) and exc.errno == errno.EFAULT


def copy_into(dst: Any, src: Any) -> int:
    """Copy all bytes of ``src`` into the start of ``dst``; return the number copied.

    ``dst`` is a writable C-contiguous buffer (mmap, memoryview, bytearray,
    numpy array) at least ``src``'s size in bytes; ``src`` is any C-contiguous
    buffer.  Bytes of ``dst`` past that are left alone; overlapping buffers are
    copied as by memmove.  Raises ValueError "dst holds N bytes, src has M" or
    "dst/src is not C-contiguous", TypeError "dst is read-only" or when an
    argument is not a buffer.

    With the fault guard installed (``install_fault_guard``), a buffer whose
    memory is gone raises OSError(EFAULT) "memory fault (SIGBUS) at byte N of
    dst: ..." (or src); ``dst`` may be partly written by then.
    """
    if NATIVE:
        return _native.copy(dst, src, _COPY_THREADS)
    return _py_copy_into(dst, src)


def prefault(buf: Any, threads: int = 0) -> int:
    """Fault every page of ``buf`` in writable, leaving its content unchanged.

    Touches each 4096-byte page the buffer overlaps and returns how many pages
    that is (``ceil(len / 4096)`` for a page-aligned buffer).  Raises
    ValueError "buf is not C-contiguous", TypeError "buf is read-only" or when
    ``buf`` is not a buffer.  ``threads``: native workers (0 = auto); the
    fallback always uses one.

    With the fault guard installed (``install_fault_guard``), a buffer whose
    memory is gone raises OSError(EFAULT) "memory fault (SIGBUS) at byte N of
    buf: ...".
    """
    if NATIVE:
        return _native.prefault(buf, threads)
    return _py_prefault(buf)


def checksum(buf: Any) -> int:
    """Return the XXH3-64 hash (seed 0) of the bytes of ``buf``, as an int.

    ``buf`` is any C-contiguous buffer; the result equals
    ``xxhash.xxh3_64_intdigest(bytes(buf))`` (the xxhash package is the
    fallback).  Native: the GIL is released for buffers of 64 KiB or more.
    Raises ValueError "buf is not C-contiguous", TypeError when ``buf`` is not
    a buffer.

    With the fault guard installed (``install_fault_guard``), a buffer whose
    memory is gone raises OSError(EFAULT) "memory fault (SIGBUS) at byte N of
    buf: ...".
    """
    if NATIVE:
        return _native.checksum(buf)
    with memoryview(buf) as view:
        _check(view, "buf", writable=False)
        digest: int = xxhash.xxh3_64_intdigest(view)
    return digest


def hash_rows(buf: Any, stride: int, start: int, stop: int, seeds: Any) -> bytes:
    """XXH3-64 of the bytes ``[start, stop)`` of each ``stride``-byte row of ``buf``.

    Row i is seeded with ``seeds[i]`` (a buffer of native-endian uint64, e.g. a
    numpy ``uint64`` array); returns the hashes as bytes, one native-endian
    uint64 per row (``np.frombuffer(..., np.uint64)``).  For tables the caller
    owns (kvtierd's slot tables): not fault-guarded.  Raises ValueError when
    the geometry does not fit (see ``kvtier._native.hash_rows``).
    """
    if NATIVE:
        return _native.hash_rows(buf, stride, start, stop, seeds)
    if stride < 1 or not 0 <= start <= stop <= stride:
        raise ValueError(f"need stride >= 1 and 0 <= start <= stop <= stride, got "
                         f"stride={stride} start={start} stop={stop}")
    with memoryview(buf) as view, memoryview(seeds) as sv:
        _check(view, "buf", writable=False)
        _check(sv, "seeds", writable=False)
        raw = view.cast("B")
        if sv.nbytes % 8:
            raise ValueError(f"seeds has {sv.nbytes} bytes, not a multiple of 8")
        seed_list = np.frombuffer(sv.cast("B"), dtype=np.uint64).tolist()
        rows = len(seed_list)
        if rows and (rows - 1) * stride + stop > raw.nbytes:
            raise ValueError(f"buf has {raw.nbytes} bytes, {rows} rows of stride {stride} "
                             f"need {(rows - 1) * stride + stop}")
        out = np.array([xxhash.xxh3_64_intdigest(raw[i * stride + start : i * stride + stop], s)
                        for i, s in enumerate(seed_list)], dtype=np.uint64)
    return out.tobytes()


#: The SSD tier's slot-table entry, as ``ssd_find_slots`` reads it (csrc/layout.h, the
#: module's LAYOUT): its size, where its key's and namespace's lengths are, where the
#: zero-padded key and then namespace start, and their widths.  Without the module
#: there is no layout (and no SSD tier: the daemon needs the module).
_SSD: Final[dict[str, int]] = dict(_native.LAYOUT) if _HAVE_NATIVE else {}
_SSD_ENTRY: Final = _SSD.get("SSD_ENTRY", 0)
_SSD_KEY_LEN: Final = _SSD.get("SSD_KEY_LEN", 0)
_SSD_NS_LEN: Final = _SSD.get("SSD_NS_LEN", 0)
_SSD_KEY_AT: Final = _SSD.get("SSD_KEY_AT", 0)
_SSD_MAX_KEY: Final = _SSD.get("SSD_MAX_KEY", 0)
_SSD_NAME: Final = _SSD.get("SSD_NAME", 0)


def ssd_find_slots(buckets: Any, tables: Sequence[Any], bases: Sequence[int],
                   keys: Sequence[Any], namespace: Any) -> bytes:
    """The SSD tier's key index (``kvtierd.spill.ssd``) asked about many keys of one
    namespace at once: bytes of one native-endian int64 per key, the slot id holding it
    or -1 (``np.frombuffer(..., np.int64)``).

    ``buckets``: the index, a power of two of native-endian uint64 words (each the key
    hash's upper half over slot id + 1; 0: empty; linear probing); ``tables``: the spill
    files' slot-table mirrors, ``bases`` their first slot ids (ascending), in the same
    order.  A hit is a word with the key hash's upper half naming a slot whose entry
    holds the same key and namespace.  A key not 1..64 bytes long is a miss.  Native:
    one call, the GIL released (from 64 keys); every access stays within the buffers,
    whatever they hold.  Raises ValueError for a malformed index, tables/bases of
    different lengths, bases not ascending, a namespace over 128 bytes or a buffer
    not C-contiguous; TypeError for a key or buffer that is not one.
    """
    if NATIVE:
        return _native.ssd_find_slots(buckets, tables, bases, keys, namespace)
    if not _SSD_ENTRY:
        raise RuntimeError("ssd_find_slots reads csrc/layout.h's SSD entry from "
                           "kvtier._native, which is not built")
    with ExitStack() as stack:
        bv = stack.enter_context(memoryview(buckets))
        nv = stack.enter_context(memoryview(namespace))
        _check(bv, "buckets", writable=False)
        _check(nv, "namespace", writable=False)
        nbytes = bv.nbytes
        n_buckets = nbytes // 8
        if nbytes % 8 or n_buckets == 0 or n_buckets & (n_buckets - 1):
            raise ValueError(f"buckets has {nbytes} bytes, not a power of two of 8-byte words")
        ns = nv.tobytes()
        if len(ns) > _SSD_NAME:
            raise ValueError(f"namespace has {len(ns)} bytes (at most {_SSD_NAME})")
        tables, bases = list(tables), list(bases)
        if len(tables) != len(bases):
            raise ValueError(f"tables and bases differ in length ({len(tables)} and "
                             f"{len(bases)})")
        rows: list[memoryview] = []
        for i, base in enumerate(bases):
            if base < 0:
                raise OverflowError("can't convert negative int to unsigned")
            if i and base <= bases[i - 1]:
                raise ValueError("bases must ascend")
            tv = stack.enter_context(memoryview(tables[i]))
            _check(tv, "a table", writable=False)
            rows.append(stack.enter_context(tv.cast("B")))
        with bv.cast("B") as flat:
            words = np.frombuffer(flat, dtype=np.uint64).tolist()
        pad = ns.ljust(_SSD_NAME, b"\0")
        mask = n_buckets - 1
        out = np.full(len(keys), -1, np.int64)
        for k, key_obj in enumerate(keys):
            with memoryview(key_obj) as kv:
                key = kv.tobytes()
            if not 1 <= len(key) <= _SSD_MAX_KEY:
                continue
            field = key.ljust(_SSD_MAX_KEY, b"\0") + pad
            tag = xxhash.xxh3_64_intdigest(field, len(key) | len(ns) << 8) >> 32
            i = tag & mask
            for _ in range(n_buckets):
                v = words[i]
                if v == 0:
                    break
                if v >> 32 == tag and v & 0xFFFFFFFF:
                    sid = (v & 0xFFFFFFFF) - 1
                    at = bisect.bisect_right(bases, sid) - 1
                    if at >= 0 and sid - bases[at] < len(rows[at]) // _SSD_ENTRY:
                        off = (sid - bases[at]) * _SSD_ENTRY
                        row = rows[at]
                        if (row[off + _SSD_KEY_LEN] == len(key)
                                and row[off + _SSD_NS_LEN] == len(ns)
                                and row[off + _SSD_KEY_AT : off + _SSD_KEY_AT + len(field)]
                                == field):
                            out[k] = sid
                            break
                i = (i + 1) & mask
    return out.tobytes()


def gather(dst: Any, pieces: Iterable[Any]) -> int:
    """Copy the buffers of ``pieces`` back to back into the start of ``dst``.

    Returns the number of bytes copied: the sum of the pieces' sizes in bytes.
    ``pieces`` is a sequence (any iterable) of C-contiguous buffers, empty ones
    and any dtype included; ``dst`` a writable C-contiguous buffer at least
    that large, whose further bytes are left alone.  If a piece overlaps
    ``dst`` the pieces are copied in order, each as by memmove.  Native: all
    buffers are acquired first, then the GIL is released once for the whole
    copy (64 KiB or more), which is split over threads from 4 MiB.  Raises
    ValueError "dst holds N bytes, pieces have M", "dst is not C-contiguous"
    or "pieces[i] is not C-contiguous"; TypeError "dst is read-only", or when
    ``pieces`` is not iterable or ``dst`` or an item is not a buffer.

    With the fault guard installed (``install_fault_guard``), a buffer whose
    memory is gone raises OSError(EFAULT) "memory fault (SIGBUS) at byte N of
    dst: ..." (or pieces[i]); ``dst`` may be partly written
    by then.
    """
    if NATIVE:
        return _native.gather(dst, pieces, _COPY_THREADS)
    return _py_gather_scatter(dst, pieces, gather=True)


def scatter(src: Any, pieces: Iterable[Any]) -> int:
    """Fill the buffers of ``pieces``, in order, from consecutive bytes of ``src``.

    The inverse of ``gather``; returns the number of bytes copied (the sum of
    the pieces' sizes in bytes).  ``pieces`` is a sequence (any iterable) of
    writable C-contiguous buffers, empty ones included; ``src`` a C-contiguous
    buffer at least that large, whose further bytes are ignored.  If buffers
    overlap, the pieces are filled in order, each as by memmove.  Native: as
    ``gather``.  Raises ValueError "src has N bytes, pieces need M", "src is
    not C-contiguous" or "pieces[i] is not C-contiguous"; TypeError
    "pieces[i] is read-only", or when ``pieces`` is not iterable or ``src`` or
    an item is not a buffer.

    With the fault guard installed (``install_fault_guard``), a buffer whose
    memory is gone raises OSError(EFAULT) "memory fault (SIGBUS) at byte N of
    src: ..." (or pieces[i]); the pieces may be partly
    written by then.
    """
    if NATIVE:
        return _native.scatter(src, pieces, _COPY_THREADS)
    return _py_gather_scatter(src, pieces, gather=False)


def scatter_hash(srcs: Iterable[Any], pieces: Iterable[Iterable[Any]]) -> list[int]:
    """Scatter each ``srcs[i]`` into ``pieces[i]`` and return each source's checksum, in one pass.

    For every ``i``: fill the buffers of ``pieces[i]`` in order from consecutive
    bytes of ``srcs[i]`` (as ``scatter(srcs[i], pieces[i])``), and hash all of
    ``srcs[i]``: the result's ``[i]`` equals ``checksum(srcs[i])`` (XXH3-64,
    seed 0), the bytes past the pieces included (hashed, not copied).  Native:
    each source is copied in chunks hashed right after their copy, while still
    in the CPU cache, so its bytes are read from memory once instead of twice
    (``checksum`` then ``scatter``); all buffers are acquired first, then the
    GIL is released once, and calls of 4 MiB or more are split over threads by
    source.  ``srcs`` is an iterable of C-contiguous buffers; ``pieces`` one of
    as many iterables of writable C-contiguous buffers, empty ones included,
    adding up to at most their source's size in bytes.  Sources may share
    memory; a piece may not share any with a source or another piece.

    Raises ValueError "srcs and pieces differ in length (N != M)", "srcs[i] has
    N bytes, pieces[i] need M", "a piece overlaps a source or another piece"
    (nothing is copied then), "srcs[i] is not C-contiguous" or "pieces[i][j] is
    not C-contiguous"; TypeError "pieces[i][j] is read-only", or when an
    argument or an item of ``pieces`` is not iterable or an item not a buffer.

    With the fault guard installed (``install_fault_guard``), a buffer whose
    memory is gone raises OSError(EFAULT) "memory fault (SIGBUS) at byte N of
    srcs[i]: ..." (or pieces[i][j]); the pieces may be partly written by then.
    """
    if NATIVE:
        return _native.scatter_hash(srcs, pieces, _COPY_THREADS)
    return _py_scatter_hash(srcs, pieces)


def scatter_hash_at(srcs: Sequence[Any], bases: Sequence[Any], offsets: Sequence[int],
                    limit: int, hash: bool = True) -> tuple[list[int] | None, list[int]]:
    """``scatter_hash`` (``hash=False``: ``scatter_copy``) with one piece a source, named
    by where it starts: ``srcs[i]`` into ``bases[i]`` from byte ``offsets[i]`` on, the
    piece as long as the source (a put's blocks into their slots, no buffer object made
    per slot; ``bases`` may repeat).  Each source holds 1..``limit`` bytes.  Returns
    (each source's checksum, or None without ``hash``; each source's size in bytes).

    Raises ValueError "srcs, bases and offsets differ in length (N, M, K)", "srcs[i] is
    N bytes (1..limit allowed)", "offsets[i] = N is negative", "bases[i] holds N bytes,
    srcs[i] needs M at offset O", and ``scatter_hash``'s overlap and contiguity errors;
    TypeError "bases[i] is read-only", or for an item that is not a buffer or an offset
    that is not an integer.  Faults as ``scatter_hash``'s, naming srcs[i] or bases[i].
    """
    if NATIVE:
        return _native.scatter_hash_at(srcs, bases, offsets, limit, _COPY_THREADS, hash)
    return _py_scatter_hash_at(srcs, bases, offsets, limit, hash)


def scatter_copy(srcs: Sequence[Any], pieces: Sequence[Sequence[Any]]) -> None:
    """``scatter_hash`` without the hash: every ``srcs[i]`` into ``pieces[i]`` in one
    call (one acquisition of the buffers, one release of the GIL, the same checks and
    the same fault guard), for many blocks at once."""
    if NATIVE:
        _native.scatter_hash(srcs, pieces, _COPY_THREADS, False)
        return
    _py_scatter_hash(srcs, pieces)  # (its checks; the hashes unused)


def pwrite_full(fd: int, buf: Any, offset: int, threads: int = 0) -> int:
    """Write all of ``buf`` to file descriptor ``fd`` at file position ``offset``.

    Returns the number of bytes written: all of ``buf`` (any C-contiguous
    buffer), in bytes.  Short writes continue where they stopped and EINTR is
    retried; the fd's own file position is neither used nor moved.  Works on
    O_DIRECT descriptors when the caller aligns the address and size of
    ``buf`` and ``offset`` (4096 does everywhere); nothing checks that, so
    normal descriptors take any alignment.  Native: the GIL is released, and
    writes of 8 MiB or more are split into chunks of at least 2 MiB written by
    up to ``threads`` threads at once (0: 4), for queue depth.  Raises OSError
    with the errno of the first failed write (some of ``buf`` may be written
    by then); ValueError "buf is not C-contiguous", "offset must be >= 0, got
    N" or "threads must be >= 0, got N"; TypeError when ``buf`` is not a buffer.
    A ``buf`` whose memory is gone (its mapped file truncated) fails the write
    with OSError(EFAULT), guard or not: system calls fail, they do not fault.
    """
    if NATIVE:
        return _native.pwrite_full(fd, buf, offset, threads)
    return _py_pio(fd, buf, offset, threads, write=True)


def pread_full(fd: int, buf: Any, offset: int, threads: int = 0) -> int:
    """Fill all of ``buf`` from file descriptor ``fd`` at file position ``offset``.

    Returns the number of bytes read, which is less than ``buf``'s size in
    bytes only when the file ends first; the rest of ``buf`` is then left
    alone (on an O_DIRECT fd but for the rest of the last 4096-byte block,
    which the device transfers whole: zeros past the end of a file; the read
    is clamped at the end of the file, as a direct read past it would
    zero-fill the buffer).  ``buf`` is a writable C-contiguous buffer.  Short
    reads continue where they stopped and EINTR is retried; the fd's own file
    position is neither used nor moved.  O_DIRECT and threads as
    ``pwrite_full``.  Raises OSError with the errno of the first failed read
    (``buf`` may be partly filled by then); ValueError "buf is not
    C-contiguous", "offset must be >= 0, got N" or "threads must be >= 0, got
    N"; TypeError "buf is read-only" or when ``buf`` is not a buffer.  A
    ``buf`` whose memory is gone fails with OSError(EFAULT), as ``pwrite_full``.
    """
    if NATIVE:
        return _native.pread_full(fd, buf, offset, threads)
    return _py_pio(fd, buf, offset, threads, write=False)


def _check(view: memoryview, name: str, writable: bool) -> None:
    """Raise exactly as the native module does for an unusable buffer."""
    if not view.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous")
    if writable and view.readonly:
        raise TypeError(f"{name} is read-only")


def _py_copy_into(dst: Any, src: Any) -> int:
    # Every view is released before returning, even on error: a live export
    # would stop the caller from closing or resizing an mmap or bytearray.
    with memoryview(dst) as d, memoryview(src) as s:
        _check(d, "dst", writable=True)
        _check(s, "src", writable=False)
        n = s.nbytes
        if d.nbytes < n:
            raise ValueError(f"dst holds {d.nbytes} bytes, src has {n}")
        if n:
            _np_copy(d, s, n)
    return n


def _np_copy(d: memoryview, s: memoryview, n: int) -> None:
    # A separate frame so the arrays (which hold exports of d and s) are gone
    # before the caller's with-block releases the views.  np.copyto handles
    # overlap, which gives memmove semantics.
    np.copyto(_bytes(d)[:n], _bytes(s))


def _py_prefault(buf: Any) -> int:
    with memoryview(buf) as view:
        _check(view, "buf", writable=True)
        return _np_touch(view) if view.nbytes else 0


def _np_touch(view: memoryview) -> int:
    v = _bytes(view)
    start: int = v.ctypes.data
    base = start - start % PAGE_SIZE
    pages = (start + v.size - base + PAGE_SIZE - 1) // PAGE_SIZE
    # Offset 0 plus the first byte of every later page the buffer overlaps,
    # the same bytes csrc/native.c touches.  Write back a *copy*: numpy skips
    # ``a[s] = a[s]`` as a redundant self-assignment, which would not write.
    first = -start % PAGE_SIZE
    for sel in (slice(0, 1), slice(first, None, PAGE_SIZE)):
        v[sel] = v[sel].copy()
    return pages


def _bytes(view: memoryview) -> npt.NDArray[np.uint8]:
    """A flat uint8 array over a C-contiguous view (shares its memory)."""
    return np.frombuffer(view, dtype=np.uint8)


def _py_gather_scatter(flat: Any, pieces: Iterable[Any], gather: bool) -> int:
    # Acquire (and check) every buffer in the native order first: flat, then
    # each piece; ExitStack releases all views acquired so far on any error.
    with ExitStack() as stack:
        f = stack.enter_context(memoryview(flat))
        _check(f, "dst" if gather else "src", writable=gather)
        views = []
        for i, piece in enumerate(tuple(pieces)):
            v = stack.enter_context(memoryview(piece))
            _check(v, f"pieces[{i}]", writable=not gather)
            views.append(v)
        total = sum(v.nbytes for v in views)
        if f.nbytes < total:
            if gather:
                raise ValueError(f"dst holds {f.nbytes} bytes, pieces have {total}")
            raise ValueError(f"src has {f.nbytes} bytes, pieces need {total}")
        _np_gather_scatter(f, views, gather)
    return total


def _np_gather_scatter(f: memoryview, views: list[memoryview], gather: bool) -> None:
    # A separate frame, as _np_copy: the arrays are gone before the views are
    # released.  np.copyto handles overlap, so each piece moves as by memmove.
    flat = _bytes(f)
    off = 0
    for v in views:
        n = v.nbytes
        if n:
            if gather:
                np.copyto(flat[off : off + n], _bytes(v))
            else:
                np.copyto(_bytes(v), flat[off : off + n])
        off += n


def _py_scatter_hash(srcs: Iterable[Any], pieces: Iterable[Iterable[Any]]) -> list[int]:
    # As _py_gather_scatter: every buffer acquired (and checked) in the native
    # order -- srcs[i], then its pieces, block after block -- and released on
    # any error.
    srcs_t, outer = tuple(srcs), tuple(pieces)
    if len(srcs_t) != len(outer):
        raise ValueError(f"srcs and pieces differ in length ({len(srcs_t)} != {len(outer)})")
    inner = [tuple(p) for p in outer]
    with ExitStack() as stack:
        blocks: list[tuple[memoryview, list[memoryview]]] = []
        for i, (src, items) in enumerate(zip(srcs_t, inner, strict=True)):
            s = stack.enter_context(memoryview(src))
            _check(s, f"srcs[{i}]", writable=False)
            views = []
            for j, piece in enumerate(items):
                v = stack.enter_context(memoryview(piece))
                _check(v, f"pieces[{i}][{j}]", writable=True)
                views.append(v)
            need = sum(v.nbytes for v in views)
            if s.nbytes < need:
                raise ValueError(f"srcs[{i}] has {s.nbytes} bytes, pieces[{i}] need {need}")
            blocks.append((s, views))
        if _np_pieces_overlap(blocks):
            raise ValueError("a piece overlaps a source or another piece")
        hashes = [int(xxhash.xxh3_64_intdigest(s)) for s, _ in blocks]
        for s, views in blocks:
            _np_gather_scatter(s, views, gather=False)
    return hashes


def _py_scatter_hash_at(srcs: Sequence[Any], bases: Sequence[Any], offsets: Sequence[int],
                        limit: int, hash: bool) -> tuple[list[int] | None, list[int]]:
    # The native order: srcs[i], its offset, then bases[i], block after block; every
    # view released on any error.
    srcs_t, bases_t, offs_t = tuple(srcs), tuple(bases), tuple(offsets)
    if not len(srcs_t) == len(bases_t) == len(offs_t):
        raise ValueError(f"srcs, bases and offsets differ in length ({len(srcs_t)}, "
                         f"{len(bases_t)}, {len(offs_t)})")
    with ExitStack() as stack:
        blocks: list[tuple[memoryview, list[memoryview]]] = []
        for i, (src, base, offset) in enumerate(zip(srcs_t, bases_t, offs_t, strict=True)):
            s = stack.enter_context(memoryview(src))
            _check(s, f"srcs[{i}]", writable=False)
            n = s.nbytes
            if not 1 <= n <= limit:
                raise ValueError(f"srcs[{i}] is {n} bytes (1..{limit} allowed)")
            off = operator.index(offset)
            if off < 0:
                raise ValueError(f"offsets[{i}] = {off} is negative")
            b = stack.enter_context(memoryview(base))
            _check(b, f"bases[{i}]", writable=True)
            if off > b.nbytes - n:
                raise ValueError(f"bases[{i}] holds {b.nbytes} bytes, srcs[{i}] needs {n} at "
                                 f"offset {off}")
            piece = stack.enter_context(b.cast("B")[off:off + n])
            blocks.append((s, [piece]))
        if _np_pieces_overlap(blocks):
            raise ValueError("a piece overlaps a source or another piece")
        hashes = [int(xxhash.xxh3_64_intdigest(s)) for s, _ in blocks] if hash else None
        for s, views in blocks:
            _np_gather_scatter(s, views, gather=False)
        return hashes, [s.nbytes for s, _ in blocks]


def _np_pieces_overlap(blocks: list[tuple[memoryview, list[memoryview]]]) -> bool:
    """As kvt_blocks_overlap in csrc/native.c: whether a piece shares a byte with
    a source or another piece (sources may share bytes: they are only read)."""
    spans = []
    for s, views in blocks:
        for v, written in [(s, False)] + [(v, True) for v in views]:
            if v.nbytes:
                start = int(_bytes(v).ctypes.data)
                spans.append((start, start + v.nbytes, written))
    spans.sort(key=lambda span: span[0])
    end_any = end_written = 0
    for start, end, written in spans:
        if start < (end_any if written else end_written):
            return True
        end_any = max(end_any, end)
        if written:
            end_written = max(end_written, end)
    return False


def _py_pio(fd: int, buf: Any, offset: int, threads: int, write: bool) -> int:
    if threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    with memoryview(buf) as view:
        _check(view, "buf", writable=not write)
        return _np_pio(fd, view, offset, write) if view.nbytes else 0


def _read_len(fd: int, n: int, offset: int) -> int:
    """As kvt_read_len in csrc/native.c: the bytes worth asking a regular file for.

    Up to the end of the file, in whole 4096-byte blocks on an O_DIRECT fd: a
    direct read past the end zero-fills the buffer to the end of the request.
    """
    try:
        st = os.fstat(fd)
    except OSError:
        return n  # the read itself reports it
    if not stat.S_ISREG(st.st_mode) or st.st_size - offset >= n:
        return n
    avail = max(st.st_size - offset, 0)
    try:
        direct = fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0)
    except OSError:
        direct = 0
    if direct:
        avail = -(-avail // PAGE_SIZE) * PAGE_SIZE
    return min(avail, n)


def _np_pio(fd: int, view: memoryview, offset: int, write: bool) -> int:
    # os.pwritev/os.preadv retry EINTR themselves (PEP 475).  b is a flat byte
    # view of any format; it is gone before this frame raises or returns, so
    # a traceback keeping the frame does not keep buf exported.
    b = _bytes(view).data
    n = b.nbytes if write else _read_len(fd, b.nbytes, offset)
    done = 0
    short_read = False
    error: OSError | None = None
    while done < n:
        try:
            if write:
                got = os.pwritev(fd, [b[done:n]], offset + done)
            else:
                got = os.preadv(fd, [b[done:n]], offset + done)
        except OSError as exc:
            # O_DIRECT: after a read that stopped short at the end of the file
            # the position is unaligned, and the next read fails with EINVAL
            # instead of returning 0.  It is the end of the file all the same.
            if not (exc.errno == errno.EINVAL and short_read):
                error = exc
            break
        if got == 0:
            if write:  # a write that writes nothing would spin
                error = OSError(errno.EIO, os.strerror(errno.EIO))
            break  # end of file
        short_read = not write and got < n - done
        done += got
    del b
    if error is not None:
        raise error
    return done
