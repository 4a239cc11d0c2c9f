"""Stub for kvtier._native (csrc/native.c): GIL-free bulk memory and file helpers.

Use them through kvtier._accel, which falls back to numpy (checksum: the
xxhash package, file I/O: os.pwritev/os.preadv) when the extension is missing.
With install_fault_guard() done, the memory helpers raise OSError(EFAULT) for a
SIGBUS in a buffer (a mapped file truncated under it) instead of dying.
Checked by ``python -m mypy.stubtest kvtier._native``.
"""

from collections.abc import Iterable
from typing import Any, TypeAlias

# Any object exporting the buffer protocol (mmap, memoryview, bytearray,
# numpy array); Python 3.11 has no collections.abc.Buffer to say so.
_Buffer: TypeAlias = Any

def copy(dst: _Buffer, src: _Buffer, threads: int = 0) -> int:
    """Copy all bytes of src into the start of dst; return the number copied."""

def prefault(buf: _Buffer, threads: int = 0) -> int:
    """Fault every page of buf in writable, leaving its content unchanged."""

def checksum(buf: _Buffer) -> int:
    """Return the XXH3-64 hash (seed 0) of the bytes of buf, as an int."""

def hash_rows(buf: _Buffer, stride: int, start: int, stop: int, seeds: _Buffer) -> bytes:
    """XXH3-64 of bytes [start, stop) of each stride-byte row of buf, row i seeded with seeds[i]."""

def gather(dst: _Buffer, pieces: Iterable[_Buffer], threads: int = 0) -> int:
    """Copy the buffers of pieces back to back into the start of dst; return the total."""

def scatter(src: _Buffer, pieces: Iterable[_Buffer], threads: int = 0) -> int:
    """Fill the buffers of pieces, in order, from consecutive bytes of src; return the total."""

def scatter_hash(srcs: Iterable[_Buffer], pieces: Iterable[Iterable[_Buffer]],
                 threads: int = 0) -> list[int]:
    """Scatter each srcs[i] into pieces[i]; return each source's XXH3-64, in one pass."""

def pwrite_full(fd: int, buf: _Buffer, offset: int, threads: int = 0) -> int:
    """Write all of buf to fd at file position offset; return the number written."""

def pread_full(fd: int, buf: _Buffer, offset: int, threads: int = 0) -> int:
    """Read into all of buf from fd at offset; return the number read (less only at EOF)."""

def install_fault_guard() -> bool:
    """Make a SIGBUS in copy/prefault/checksum/gather/scatter(_hash) raise OSError(EFAULT).

    Installs the process's SIGBUS handler once; True if this call installed it.
    """

def fault_guard_installed() -> bool:
    """Return True if install_fault_guard() has installed the guard."""
