"""The one seam between kvtier and its native helpers (``kvtier._native``).

Use ``copy_into`` and ``prefault`` from here, never ``_native`` directly: when
the extension is not built (a source checkout without ``build_ext``) or the
environment sets ``KVTIER_FORCE_PY=1``, they run pure numpy fallbacks with the
same contracts, exceptions and messages.  ``NATIVE`` says which is in use; it
is fixed at import time.

The fallbacks are correct but slower: one thread, and ``prefault``'s
read-then-write-back is not atomic, so a byte written by another thread or
process between the read and the write back can be undone.  Only prefault
memory nobody else writes yet (fresh segments) on the fallback path.
"""

from __future__ import annotations

import os
from typing import Any, Final

import numpy as np
import numpy.typing as npt

try:
    from kvtier import _native
except ImportError:  # not built: the fallbacks below serve
    _HAVE_NATIVE = False
else:
    _HAVE_NATIVE = True

#: True when copy_into/prefault run the C extension (GIL released, threaded).
NATIVE: Final[bool] = _HAVE_NATIVE and os.environ.get("KVTIER_FORCE_PY") != "1"

#: prefault touches one byte every PAGE_SIZE bytes: the smallest page size on
#: the platforms we run on (same constant as KVT_PAGE in csrc/native.c).
PAGE_SIZE: Final = 4096


#: Threads for one large copy.  On a machine with two CPUs or fewer a second
#: thread mostly waits for a CPU another process holds (measured: 7.8 GiB/s
#: with 2 threads vs 15.3 GiB/s with 1 under load), so use one; else auto.
_COPY_THREADS: Final = 1 if len(os.sched_getaffinity(0)) <= 2 else 0


def copy_into(dst: Any, src: Any) -> int:
    """Copy all bytes of ``src`` into the start of ``dst``; return the number copied.

    ``dst`` is a writable C-contiguous buffer (mmap, memoryview, bytearray,
    numpy array) at least ``src``'s size in bytes; ``src`` is any C-contiguous
    buffer.  Bytes of ``dst`` past that are left alone; overlapping buffers are
    copied as by memmove.  Raises ValueError "dst holds N bytes, src has M" or
    "dst/src is not C-contiguous", TypeError "dst is read-only" or when an
    argument is not a buffer.
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
    """
    if NATIVE:
        return _native.prefault(buf, threads)
    return _py_prefault(buf)


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
