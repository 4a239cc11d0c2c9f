"""Client side of the session channel and the segment mappings (the data plane).

``SessionLink`` speaks the session-channel protocol (framing in
``kvtier._wire``, shared with the daemon) over a blocking Unix socket (it is
used rarely: once at open, and when the namespace's extents change);
``SegmentMaps`` holds the mmaps of the namespace's segments and
turns slot references into numpy views over shared memory.
"""

from __future__ import annotations

import array
import mmap
import os
import socket
import threading
import types
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvtier._paths import explain_unreachable
from kvtier._wire import FRAME_LEN, MAX_FDS_PER_MSG
from kvtier.errors import FailedPrecondition, Unavailable, from_status
from kvtier.v1 import kvtier_pb2 as pb

#: Linux MADV_POPULATE_WRITE (5.14+): fill page tables for resident shm pages
#: writably without touching their content; older kernels refuse it harmlessly.
_MADV_POPULATE_WRITE = 23
_MADV_POPULATE_READ = 22


class SessionLink:
    """A connection to the daemon's session socket: one session's liveness."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self._lock = threading.Lock()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise Unavailable(explain_unreachable(path, exc)) from exc
        self._sock = sock

    def close(self) -> None:
        self._sock.close()

    def request(self, req: pb.SessionRequest) -> tuple[pb.SessionResponse, list[int]]:
        """Send one request; the response and the fds that came with it."""
        with self._lock:
            body = req.SerializeToString()
            try:
                self._sock.sendall(FRAME_LEN.pack(len(body)) + body)
                data, fds = self._recv_frame()
            except OSError as exc:
                raise Unavailable(f"session channel to {self.path} failed: {exc}") from exc
        resp = pb.SessionResponse.FromString(data)
        if resp.WhichOneof("kind") == "error":
            for fd in fds:
                os.close(fd)
            raise from_status(resp.error.code, resp.error.message)
        return resp, fds

    def _recv_frame(self) -> tuple[bytes, list[int]]:
        buf = bytearray()
        fds: list[int] = []
        need = FRAME_LEN.size
        have_len = False
        while len(buf) < need:
            data, ancdata, flags, _ = self._sock.recvmsg(
                max(need - len(buf), 4096), socket.CMSG_SPACE(MAX_FDS_PER_MSG * 4)
            )
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    arr = array.array("i")
                    arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                    fds.extend(arr)
            if flags & socket.MSG_CTRUNC:
                for fd in fds:
                    os.close(fd)
                raise Unavailable("file descriptors were truncated (is RLIMIT_NOFILE too low?)")
            if not data:
                for fd in fds:
                    os.close(fd)
                raise Unavailable("kvtierd closed the session channel")
            buf += data
            if not have_len and len(buf) >= FRAME_LEN.size:
                (length,) = FRAME_LEN.unpack_from(buf)
                need = FRAME_LEN.size + length
                have_len = True
        return bytes(buf[FRAME_LEN.size :]), fds


class SegmentMaps:
    """The namespace's segments mapped into this process (data areas only)."""

    def __init__(self) -> None:
        self.version = 0
        #: The session may only read: the daemon sent read-only fds, map them PROT_READ.
        self.read_only = False
        self._maps: dict[int, mmap.mmap] = {}

    def __contains__(self, segment_id: int) -> bool:
        return segment_id in self._maps

    def mappings(self) -> Mapping[int, mmap.mmap]:
        """segment id -> mmap of every segment mapped now (read-only; for cudaHostRegister)."""
        return types.MappingProxyType(self._maps)

    def missing(self, segment_ids: Iterable[int]) -> list[int]:
        return sorted({s for s in segment_ids if s not in self._maps})

    def update(self, version: int, segments: Sequence[pb.SegmentInfo],
               fd_ids: Sequence[int], fds: Sequence[int]) -> None:
        """Map the segments whose fds arrived; unmap the ones no longer listed."""
        if len(fd_ids) != len(fds):
            for fd in fds:
                os.close(fd)
            raise FailedPrecondition(f"expected {len(fd_ids)} segment fds, received {len(fds)}")
        info = {s.segment_id: s for s in segments}
        try:
            for seg_id, fd in zip(fd_ids, fds, strict=False):
                seg = info.get(seg_id)
                if seg is None or seg_id in self._maps:
                    continue
                prot = mmap.PROT_READ if self.read_only else mmap.PROT_READ | mmap.PROT_WRITE
                try:
                    mm = mmap.mmap(fd, seg.data_bytes, mmap.MAP_SHARED, prot,
                                   offset=seg.data_offset)
                except (ValueError, OSError) as exc:
                    # A writer of this namespace shrank the data file under the daemon
                    # (which sets it back within seconds): this namespace's problem.
                    raise FailedPrecondition(
                        f"segment {seg_id} of this namespace cannot be mapped ({exc}); "
                        "was its data file truncated? retry in a few seconds") from None
                try:
                    mm.madvise(_MADV_POPULATE_READ if self.read_only else _MADV_POPULATE_WRITE)
                except OSError:
                    pass  # older kernel: pages fault in on first touch instead
                self._maps[seg_id] = mm
        finally:
            for fd in fds:
                os.close(fd)
        for seg_id in [s for s in self._maps if s not in info]:
            self._drop(seg_id)
        self.version = version

    def fetch(self, link: SessionLink, want: Sequence[int]) -> None:
        """Ask the daemon over ``link`` for the fds of segments ``want`` and map them
        (blocking: a round trip, then mmap and page-table population)."""
        resp, fds = link.request(map_request(want))
        m = resp.mapped
        self.update(m.segments_version, m.segments, m.fd_segment_ids, fds)

    def view(self, ref: pb.SlotRef, length: int, *, writable: bool) -> np.ndarray:
        mm = self._maps.get(ref.segment_id)
        if mm is None:
            raise FailedPrecondition(f"segment {ref.segment_id} is not mapped in this process")
        arr = np.frombuffer(mm, dtype=np.uint8, count=length, offset=ref.offset)
        if not writable:
            arr.flags.writeable = False
        return arr

    def _drop(self, seg_id: int) -> None:
        mm = self._maps.pop(seg_id)
        try:
            mm.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes when it does

    def close(self) -> None:
        for seg_id in list(self._maps):
            self._drop(seg_id)


def open_request(namespace: str, block_bytes: int, model_uid: str) -> pb.SessionRequest:
    return pb.SessionRequest(
        open=pb.OpenSession(
            ns=pb.NamespaceDecl(name=namespace, block_bytes=block_bytes, model_uid=model_uid)
        )
    )


def admin_request() -> pb.SessionRequest:
    return pb.SessionRequest(admin=pb.OpenAdmin())


def map_request(want: Sequence[int]) -> pb.SessionRequest:
    return pb.SessionRequest(map=pb.MapSegments(want_fds=list(want)))
