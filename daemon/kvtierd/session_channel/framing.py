"""Frames and fds on one session-channel connection.

A frame is a 4-byte big-endian length and a ``kvtier.v1.SessionRequest`` /
``SessionResponse`` (the format and the fd limit live in ``kvtier._wire``,
shared with the client).  ``Conn`` reads a connection's bytes with
back-pressure, ``read_frame`` cuts them into frames within a size limit, and
``send`` / ``send_with_fds`` write a whole response frame, with its fds
(``SCM_RIGHTS``) when it carries some.  Nothing here blocks the loop: the
socket is non-blocking and a full one is waited for with ``add_writer``.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
from collections.abc import Callable
from typing import Final

from kvtier._wire import FRAME_LEN, MAX_FDS_PER_MSG
from kvtier.errors import InvalidArgument, KVTierError, status_of
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.segments import Segment

#: Largest frame the daemon sends: the segment list of a 16 TiB namespace in
#: 64 MiB extents is ~4 MiB.
MAX_FRAME: Final = 8 << 20
#: Largest request before a session is open: OpenSession and OpenAdmin are a few
#: hundred bytes.  Anything longer is refused from its length prefix, so a
#: connection that has proven nothing cannot make the daemon buffer megabytes.
MAX_OPEN_FRAME: Final = 64 << 10
#: Largest request in a session: a MapSegments naming every extent of a 16 TiB
#: namespace (262144 ids of <= 4 bytes) fits.
MAX_REQUEST_FRAME: Final = 2 << 20
#: Bytes asked of each recv: small frames that arrive together are read at once.
RECV_BYTES: Final = 64 << 10
#: The frame format is shared with the client (kvtier._wire): a 4-byte length prefix.
_LEN: Final = FRAME_LEN

log = logging.getLogger("kvtierd.session_channel")  # one name for the package's records


class Closed(Exception):
    """The peer closed the connection."""


class Conn:
    """One session-channel connection: its socket, what was read ahead of the frame
    being parsed, and the lock that keeps its response frames whole (FastCalls
    answer from their own tasks).

    The loop watches the socket for the connection's whole life (``add_reader``
    once, not once per read as ``sock_recv`` does: that cost two ``epoll_ctl``
    per call) and reads into ``buf``; reading pauses while ``buf`` holds more
    than ``cap`` bytes (a peer cannot make the daemon buffer more than a frame's
    worth), and ``more()`` resumes it.
    """

    def __init__(self, sock: socket.socket, cap: int) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.cap = cap
        #: Serves frames in ``_readable`` itself while the reader waits for bytes (the
        #: session channel's calls: ``SessionChannel._serve``): False leaves the frames
        #: it did not take to the reader, which is woken.  None: the reader reads all.
        self.fast_lane: Callable[[], bool] | None = None
        self.send_lock = asyncio.Lock()
        #: The serial of the shared index table last sent on this connection (0: none).
        self.index_sent = 0
        #: The loop it is served on (kept: ``asyncio.get_running_loop`` is a system call
        #: on Python 3.11, and the call path asked it three times a call).
        self.loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._eof: BaseException | None = None
        self._watching = False
        self._watch()

    def _watch(self) -> None:
        if not self._watching and self._eof is None:
            self.loop.add_reader(self.sock.fileno(), self._readable)
            self._watching = True

    def _unwatch(self) -> None:
        if self._watching:
            self.loop.remove_reader(self.sock.fileno())
            self._watching = False

    def _readable(self) -> None:
        try:
            data = self.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._eof, data = exc, b""
        if data:
            self.buf += data
            waiter = self._waiter
            if self.fast_lane is not None and waiter is not None and not waiter.done():
                # The reader waits for bytes, so buf held no whole frame before these:
                # the frames they complete are served here, one wake-up and no task
                # step sooner; only a frame the lane leaves wakes the reader.
                try:
                    taken = self.fast_lane()
                except Exception:  # a bug: the reader takes the frames as it would
                    log.exception("session channel: serving frames as they came failed")
                    taken = False
                if taken:
                    return
            if len(self.buf) > self.cap:
                self._unwatch()  # backpressure: more() resumes
        else:
            if self._eof is None:
                self._eof = Closed()
            self._unwatch()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def more(self) -> None:
        """Wait until more bytes are in ``buf`` (raises at EOF or a socket error)."""
        if self._eof is not None:
            raise self._eof
        self._watch()
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._eof is not None and not self.buf:
            raise self._eof

    def close(self) -> None:
        self._unwatch()
        self._eof = self._eof or Closed()
        self.sock.close()


def frame_bytes(buf: bytearray) -> int:
    """The bytes of the frame at the head of ``buf`` (its length prefix and body), once
    that prefix is in; 0 before."""
    if len(buf) < _LEN.size:
        return 0
    (length,) = _LEN.unpack_from(buf)
    return int(_LEN.size + length)


def take_frame(buf: bytearray, need: int) -> bytes:
    """The body of the frame of ``need`` bytes at the head of ``buf``, taken out of it
    (one copy: a slice of ``buf`` would be another)."""
    with memoryview(buf) as view:
        body = bytes(view[_LEN.size:need])
    del buf[:need]
    return body


async def read_frame(conn: Conn, limit: int) -> bytes:
    """The next frame's body (frames that arrived together are read at once)."""
    buf = conn.buf
    while True:
        # (read again after each wait: the connection's fast lane may have taken frames)
        need = frame_bytes(buf)  # the whole frame's bytes, once its length prefix is in
        if need - _LEN.size > limit:
            raise InvalidArgument(
                f"frame of {need - _LEN.size} bytes exceeds {limit}"
                + (" before a session is open" if limit == MAX_OPEN_FRAME else ""))
        if need and len(buf) >= need:
            return take_frame(buf, need)
        await conn.more()


async def send_with_fds(conn: Conn, msg: pb.SessionResponse, segments: list[Segment], *,
                        read_only: bool = False, index_fd: int | None = None,
                        counters_fd: int | None = None, doorbell_fd: int | None = None) -> None:
    """Send ``msg`` with the segments' fds.

    The fds are opened now, synchronously: a segment retired by
    another namespace's growth while this send waits for socket space
    closes its own fd, and that number could be reused for another
    namespace's segment before the send completes.  Every segment fd is
    the file reopened (``/proc/self/fd``), never a ``dup`` of the daemon's:
    a client gets an open file description of its own, so its
    ``fcntl(F_SETFL)`` (``O_APPEND``, which makes a writable shared mapping
    fail, ``O_DIRECT``, ``O_NONBLOCK``) changes nothing the daemon or the
    cluster agent use.  A read-only session gets them ``O_RDONLY``: it can
    map them ``PROT_READ`` only, so it cannot write a byte of the namespace.
    After them come ``index_fd`` (the shared index, always reopened
    ``O_RDONLY``) and ``counters_fd`` (the session's own page, whose fd the
    daemon closes once sent: it keeps only the mapping) and ``doorbell_fd``
    (the write end of the pipe its writer rings), when given.
    """
    fds: list[int] = []
    mode = os.O_RDONLY if read_only else os.O_RDWR
    try:
        for s in segments:
            fds.append(os.open(f"/proc/self/fd/{s.fd}", mode | os.O_CLOEXEC))
        if index_fd is not None:
            fds.append(os.open(f"/proc/self/fd/{index_fd}", os.O_RDONLY | os.O_CLOEXEC))
        if counters_fd is not None:
            fds.append(os.dup(counters_fd))
        if doorbell_fd is not None:
            fds.append(os.dup(doorbell_fd))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    try:
        await send(conn, msg, fds)
    finally:
        for fd in fds:
            os.close(fd)


async def send(conn: Conn, msg: pb.SessionResponse, fds: list[int]) -> None:
    """Send one whole frame (and ``fds``) on ``conn``.  A frame without fds while no
    other is being sent goes out in one ``send`` when the socket takes it all (most
    answers: no lock, no coroutine); any other, or the rest of one the socket took in
    part, under the lock."""
    lock = conn.send_lock  # one frame at a time: FastCalls answer concurrently
    if not fds and not lock.locked():
        body = msg.SerializeToString()
        data = _LEN.pack(len(body)) + body
        try:
            sent = conn.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        # (No await since the check: taking the free lock below does not wait either,
        # so no other frame can start between these bytes and the rest.)
        async with lock:
            await _send_rest(conn.sock, memoryview(data)[sent:], conn.loop)
        return
    async with lock:
        await _send_frame(conn.sock, msg, fds, conn.loop)


async def _send_rest(conn: socket.socket, rest: memoryview,
                     loop: asyncio.AbstractEventLoop) -> None:
    """The bytes of a frame (without fds) the socket has not taken yet."""
    while rest:
        try:
            sent = conn.send(rest)
        except BlockingIOError:
            await _writable(conn, loop)
            continue
        rest = rest[sent:]


async def _writable(conn: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
    """Until ``conn`` takes more bytes."""
    fut: asyncio.Future[None] = loop.create_future()
    loop.add_writer(conn.fileno(), fut.set_result, None)
    try:
        await fut
    finally:
        loop.remove_writer(conn.fileno())


async def _send_frame(conn: socket.socket, msg: pb.SessionResponse, fds: list[int],
                      loop: asyncio.AbstractEventLoop) -> None:
    body = msg.SerializeToString()
    data = memoryview(_LEN.pack(len(body)) + body)
    # Split so each sendmsg carries at most MAX_FDS_PER_MSG fds (>= 1 byte each).
    n_pieces = max(1, -(-len(fds) // MAX_FDS_PER_MSG))
    if n_pieces > len(data):
        raise InvalidArgument(f"too many segments to send ({len(fds)})")
    cut = [len(data) * k // n_pieces for k in range(n_pieces + 1)]
    for k in range(n_pieces):
        piece = data[cut[k] : cut[k + 1]]
        chunk_fds = fds[k * MAX_FDS_PER_MSG : (k + 1) * MAX_FDS_PER_MSG]
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", chunk_fds))] if chunk_fds else []
        while piece:
            try:
                sent = conn.sendmsg([piece], anc)
            except BlockingIOError:
                await _writable(conn, loop)
                continue
            piece = piece[sent:]
            anc = []  # the fds went with the first bytes


def error_frame(call_id: int, code: int, message: str) -> pb.SessionResponse:
    """A ``SessionError`` frame answering ``call_id``."""
    return pb.SessionResponse(call_id=call_id, error=pb.SessionError(code=code, message=message))


async def send_error(conn: Conn, exc: KVTierError, call_id: int) -> None:
    """Send ``exc`` as the connection's last frame, if the peer takes it within 1 s."""
    msg = error_frame(call_id, status_of(exc).value[0], str(exc))
    try:
        await asyncio.wait_for(send(conn, msg, []), 1.0)
    except (TimeoutError, OSError, KVTierError):
        pass
