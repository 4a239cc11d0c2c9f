"""The shared-filesystem tier: content-addressed block files many hosts share.

``<root>/<namespace>/<hh>/<key-hex>`` where ``hh`` is the first byte of the
key in hex (256-way fan-out keeps directories small on Lustre/NFS) and the
namespace is percent-encoded into one path component.  A file is a header page
(``spill.format``: namespace, key, length, checksum, geometry) plus the data,
published whole by write-to-temp, ``fsync`` and ``rename``: a reader on any
host sees no file or a complete one, with no coordinator.  Keys are content
hashes, so two hosts publishing the same key publish the same bytes and the
last rename wins harmlessly.

Nothing here is cached: existence is a ``stat`` and every read verifies the
header and the data checksum.  A file that fails them is removed (it is bad
for every host) and counted.  Buffered I/O: shared filesystems rarely take
O_DIRECT, and the page cache is the client cache they are tuned for.

kvtier does not bound this tier's size: the filesystem's quota and an
operator's cleanup (files' mtimes are their publish times) do.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

from kvtier import _accel
from kvtier.errors import Corrupted
from kvtierd.logs import Throttle, event, more
from kvtierd.spill import format as fmt
from kvtierd.spill.blockio import BlockIO

log = logging.getLogger(__name__)
_throttle = Throttle()


@dataclasses.dataclass
class SharedCounters:
    writes: int = 0
    write_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    checksum_failures: int = 0


def namespace_dir(namespace: str) -> str:
    """One safe path component for a namespace name (no '/', never '.' or '..')."""
    quoted = urllib.parse.quote(namespace, safe="")
    return "%2E" + quoted[1:] if quoted.startswith(".") else quoted


class SharedTier:
    """Block files under ``root``; every method blocks (run them on worker threads)."""

    def __init__(self, root: str, *, io: BlockIO | None = None) -> None:
        self.root = root
        self.io = io or BlockIO()
        self.counters = SharedCounters()
        self._tag = f"{socket.gethostname()}.{os.getpid()}"

    def open(self) -> None:
        self.io.makedirs(self.root, mode=0o700)

    def path(self, namespace: str, key: bytes) -> str:
        hexkey = key.hex()
        return os.path.join(self.root, namespace_dir(namespace), hexkey[:2], hexkey)

    def exists(self, namespace: str, key: bytes) -> bool:
        return self.io.exists(self.path(namespace, key))

    def count_prefix(self, namespace: str, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` have a published file (stat only)."""
        n = 0
        for key in keys:
            if not self.exists(namespace, key):
                break
            n += 1
        return n

    def publish(
        self,
        namespace: str,
        key: bytes,
        data: Any,
        checksum: int | None,
        block_bytes: int,
        mhash: int,
    ) -> bool:
        """Publish ``data`` under the key; False when a file for it already exists.

        Raises OSError with no file left behind (EFAULT: ``data``'s memory
        faulted, e.g. a DRAM slot a client cut away).
        """
        path = self.path(namespace, key)
        if self.io.exists(path):
            return False
        view = memoryview(data).cast("B")
        if checksum is None:
            checksum = _accel.checksum(view)
        head = fmt.pack_block_header(fmt.BlockHeader(namespace, key, view.nbytes, checksum,
                                                     block_bytes, mhash, time.time_ns()))
        directory = os.path.dirname(path)
        self.io.makedirs(directory, mode=0o700)
        tmp = f"{path}.tmp.{self._tag}.{secrets.token_hex(4)}"
        fd = self.io.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            try:
                self.io.pwrite(fd, head, 0)
                self.io.pwrite(fd, view, fmt.BLOCK_DATA_OFFSET)
                self.io.fsync(fd)
            finally:
                self.io.close(fd)
            self.io.rename(tmp, path)
        except BaseException:
            try:
                self.io.unlink(tmp)
            except OSError:
                pass
            raise
        self.counters.writes += 1
        self.counters.write_bytes += view.nbytes
        return True

    def read_into(self, namespace: str, key: bytes, dst: memoryview, block_bytes: int,
                  mhash: int) -> tuple[int, int]:
        """Read a published block into ``dst``; returns (length, checksum).

        Raises KeyError when there is no file (or it belongs to a namespace
        declared with another geometry), ``Corrupted`` when it fails its
        header or checksum (the file is then removed), OSError on I/O errors
        (EFAULT: ``dst``'s memory faulted; the file stays, it is not at fault).
        """
        path = self.path(namespace, key)
        try:
            fd = self.io.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise KeyError(key) from None
        try:
            page = bytearray(fmt.PAGE)
            got = self.io.pread(fd, page, 0)
            try:
                head = fmt.unpack_block_header(memoryview(page)[:got])
            except fmt.FormatError as exc:
                raise Corrupted(f"shared block file {path}: {exc}") from None
            if (head.namespace, head.key) != (namespace, key):
                raise Corrupted(f"shared block file {path} holds {head.namespace!r}/"
                                f"{head.key.hex()}")
            if (head.block_bytes, head.model_hash) != (block_bytes, mhash):
                raise KeyError(key)  # another model's block: not ours to judge or remove
            if head.length > len(dst):
                raise Corrupted(f"shared block file {path}: length {head.length} exceeds the "
                                f"slot ({len(dst)} bytes)")
            n = self.io.pread(fd, dst[: head.length], fmt.BLOCK_DATA_OFFSET)
            if n != head.length:
                raise Corrupted(f"shared block file {path}: {n} of {head.length} data bytes "
                                "(truncated)")
            if _accel.checksum(dst[: head.length]) != head.checksum:
                raise Corrupted(f"shared block file {path} failed its checksum")
        except Corrupted as exc:
            self.counters.checksum_failures += 1
            held = _throttle("shared/read/checksum")
            if held is not None:
                log.warning("shared tier: %s; removing it%s", exc, more(held),
                            extra=event("spill_fault", tier="shared", op="read",
                                        kind="checksum", held_back=held))
            self._unlink_quietly(path)
            raise
        finally:
            self.io.close(fd)
        self.counters.reads += 1
        self.counters.read_bytes += head.length
        return head.length, head.checksum

    def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            try:
                self.io.unlink(self.path(namespace, key))
                n += 1
            except FileNotFoundError:
                pass
        return n

    def _unlink_quietly(self, path: str) -> None:
        try:
            self.io.unlink(path)
        except OSError:
            pass

