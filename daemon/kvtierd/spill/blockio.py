"""Every syscall the spill tiers make, behind one class: the fault-injection seam.

Tests subclass :class:`BlockIO` to fail or slow any call (``ENOSPC`` on the
third write, ``EIO`` on reads of one file, a 50 ms fsync...); the tiers never
call ``os`` for file I/O themselves.  Transfers go through
``kvtier._accel.pwrite_full`` / ``pread_full`` (GIL released, retried on
short transfers; the pure-Python fallback under ``KVTIER_FORCE_PY=1``).

All methods block: call them on worker threads.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Any

from kvtier import _accel
from kvtier.errors import Corrupted

#: What every O_DIRECT transfer is aligned to (address, length, offset).
DIRECT_ALIGN = 4096


class BlockIO:
    """Plain POSIX file I/O for the spill tiers."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags | os.O_CLOEXEC, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwrite(self, fd: int, buf: Any, offset: int) -> int:
        return _accel.pwrite_full(fd, buf, offset)

    def pread(self, fd: int, buf: Any, offset: int) -> int:
        return _accel.pread_full(fd, buf, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fallocate(self, fd: int, length: int) -> None:
        os.posix_fallocate(fd, 0, length)

    def fstat_size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        """Create ``path`` and any missing parents, every level created with ``mode``
        (``os.makedirs`` gives only the leaf its mode; parents get 0777 less umask)."""
        head = os.path.dirname(path)
        if head and head != path and not os.path.isdir(head):
            self.makedirs(head, mode)
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            if not os.path.isdir(path):
                raise

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A zeroed, page-aligned anonymous buffer (O_DIRECT needs aligned memory)."""
    return mmap.mmap(-1, max(DIRECT_ALIGN, nbytes))


def probe_direct_io(directory: str, io: BlockIO | None = None) -> str | None:
    """None when ``directory``'s filesystem takes aligned O_DIRECT writes and reads,
    else the reason it does not (e.g. ``"O_DIRECT refused at open: [Errno 22] ..."``).
    """
    io = io or BlockIO()
    path = os.path.join(directory, f".kvtier-direct-probe.{os.getpid()}")
    buf = aligned_buffer(DIRECT_ALIGN)
    back = aligned_buffer(DIRECT_ALIGN)
    try:
        try:
            fd = io.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return f"O_DIRECT refused at open: {exc}"
            raise
        try:
            buf[:8] = b"kvtier\x00\x01"
            io.pwrite(fd, buf, 0)
            if io.pread(fd, back, 0) != DIRECT_ALIGN or back[:8] != buf[:8]:
                return "O_DIRECT read did not return what was written"
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return f"O_DIRECT transfer refused: {exc}"
            raise
        finally:
            io.close(fd)
        return None
    finally:
        buf.close()
        back.close()
        try:
            io.unlink(path)
        except FileNotFoundError:
            pass


def memory_fault(exc: BaseException) -> bool:
    """Whether ``exc`` says the memory a call read or wrote faulted, not the file.

    A DRAM slot lives in a file its namespace's writers hold read-write fds of:
    truncated or hole-punched, its pages are gone.  ``pread``/``pwrite`` then
    fail with EFAULT, and ``kvtier._accel``'s guarded copies and checksums raise
    ``OSError(EFAULT)`` instead of dying of SIGBUS.  The spill tiers' own buffers
    never fault, so on their calls EFAULT always means the slot: the writer's
    loss, never a fault of the tier's device.
    """
    return isinstance(exc, OSError) and exc.errno == errno.EFAULT


def fault_kind(exc: BaseException) -> str:
    """A short label for a failed spill I/O (the metrics label ``kind``)."""
    if isinstance(exc, Corrupted):
        return "checksum"
    if isinstance(exc, OSError):
        return {errno.ENOSPC: "enospc", errno.EDQUOT: "enospc", errno.EIO: "eio",
                errno.ENOENT: "missing",
                # the cluster tier (kvtierd.cluster.tier): its agent not joined, the
                # Mooncake master unreachable, a transfer from a host that is gone
                errno.ENOTCONN: "down", errno.EHOSTDOWN: "master",
                errno.ECOMM: "transfer"}.get(exc.errno or 0, "oserror")
    return type(exc).__name__.lower()
