"""Stub for kvtier._native (csrc/native.c): GIL-free bulk memory helpers.

Use them through kvtier._accel, which falls back to numpy when the extension is
missing.  Checked by ``python -m mypy.stubtest kvtier._native``.
"""

from typing import Any, TypeAlias

# Any object exporting the buffer protocol (mmap, memoryview, bytearray,
# numpy array); Python 3.11 has no collections.abc.Buffer to say so.
_Buffer: TypeAlias = Any

def copy(dst: _Buffer, src: _Buffer, threads: int = 0) -> int:
    """Copy all bytes of src into the start of dst; return the number copied."""

def prefault(buf: _Buffer, threads: int = 0) -> int:
    """Fault every page of buf in writable, leaving its content unchanged."""
