"""Client side of the session channel and the segment mappings (the data plane).

``SessionLink`` speaks the session-channel protocol (framing in
``kvtier._wire``, shared with the daemon) over a blocking Unix socket: the
open, the segment fds when the namespace's extents change, and (when the
daemon offers it) the fast path, every KVTier call as a ``FastCall``;
``AsyncSessionLink`` drives the same connection from an asyncio loop;
``SegmentMaps`` holds the mmaps of the namespace's segments and
turns slot references into numpy views over shared memory.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import math
import mmap
import os
import select
import socket
import threading
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import numpy as np
from google.protobuf.message import DecodeError, Message

from kvtier import _index, _native
from kvtier._index import LocalIndex, LocalSlot
from kvtier._paths import explain_unreachable
from kvtier._wire import FRAME_LEN, MAX_FDS_PER_MSG
from kvtier.errors import FailedPrecondition, Unavailable, from_status
from kvtier.v1 import kvtier_pb2 as pb

try:
    from kvtier import _native
except ImportError:  # not built: mappings are populated in the caller's thread
    _native = None  # type: ignore[assignment]

#: Linux MADV_POPULATE_WRITE (5.14+): fill page tables for resident shm pages
#: writably without touching their content; older kernels refuse it harmlessly.
_MADV_POPULATE_WRITE = 23
_MADV_POPULATE_READ = 22


#: Response message type of each ``kvtier.v1.KVTier`` method (for FastReply bodies).
_RESPONSE_OF: Final = {m.name: getattr(pb, m.output_type.name)
                       for m in pb.DESCRIPTOR.services_by_name["KVTier"].methods}
#: How much longer than a call's own deadline the link waits for any frame before
#: it calls the daemon hung (the daemon answers DEADLINE_EXCEEDED at the deadline).
_HUNG_AFTER: Final = 5.0
#: How long a caller looks for the answer to its call before it sleeps in ``recv``
#: (``SessionLink._recv_frame``); 0 never spins.
ANSWER_SPIN_SECONDS: float = 300e-6


class LinkBroken(Unavailable):
    """The session connection failed or closed: its session has ended."""


class SessionLink:
    """A connection to the daemon's session socket: one session's liveness, and
    (when the daemon offers it) its fast path.

    Threads share it.  Every request carries a ``call_id``; whichever waiting
    thread finds no other thread reading reads frames for everybody and hands
    each response to the thread that waits for it (no reader thread, so a
    lone caller pays no thread hop).
    """

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        #: Set from SessionOpened: the daemon serves FastCalls on this connection, with
        #: requests of at most ``max_call_bytes`` (a larger one goes over gRPC).
        self.fast_path = False
        self.max_call_bytes = 0
        self._send_lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._ids = itertools.count(1)
        self._done: dict[int, tuple[pb.SessionResponse, list[int]]] = {}
        self._waiting: set[int] = set()
        self._reading = False
        self._broken: LinkBroken | None = None
        self._frames = FrameSplitter()
        #: Called first by close() (an AsyncSessionLink unregisters from its loop).
        self._on_close: Callable[[], None] | None = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise Unavailable(explain_unreachable(path, exc)) from exc
        sock.settimeout(timeout + _HUNG_AFTER)
        self._sock = sock

    def quiet(self) -> bool:
        """Nothing is waiting to be read and the daemon has not hung up (a syscall, no
        wait): the session stands, so an answer from the shared index is current.  A
        frame waiting for another thread also says no; that thread's call reads it."""
        if self._broken is not None:
            return False
        poll = select.poll()  # one per call: a poll object is not for concurrent use
        try:
            poll.register(self._sock, select.POLLIN)
            return not poll.poll(0)
        except (OSError, ValueError):  # closed meanwhile
            return False

    def hung_up(self) -> bool:
        """The daemon closed the connection (a syscall, no wait; frames still waiting to
        be read do not count)."""
        if self._broken is not None:
            return True
        poll = select.poll()
        try:
            poll.register(self._sock, select.POLLRDHUP)
            return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR)
                       for _, ev in poll.poll(0))
        except (OSError, ValueError):  # closed meanwhile
            return True

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()
            self._on_close = None
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
        except OSError:
            pass
        self._sock.close()
        with self._cond:
            for resp_fds in self._done.values():
                for fd in resp_fds[1]:
                    os.close(fd)
            self._done.clear()
            self._frames.close()

    # ------------------------------------------------------------- calls
    def request(self, req: pb.SessionRequest) -> tuple[pb.SessionResponse, list[int]]:
        """Send one request; the response and the fds that came with it."""
        call_id = self._send(req)
        resp, fds = self._wait(call_id, self.timeout + _HUNG_AFTER)
        if resp.WhichOneof("kind") == "error":
            for fd in fds:
                os.close(fd)
            raise from_status(resp.error.code, resp.error.message)
        return resp, fds

    def call(self, method: str, request: Message, timeout: float) -> Any:
        """One ``kvtier.v1.KVTier`` call on the fast path; its response message.

        Raises the call's error as the kvtier exception (the session goes on),
        or ``LinkBroken`` if the connection failed (the session has ended).
        """
        return self.wait_call(method, self.send_call(method, request, timeout), timeout)

    def send_call(self, method: str, request: Message, timeout: float) -> int:
        """``call``'s first half: send the request; its id, for ``wait_call`` (which must
        follow: until then the answer is kept for it)."""
        return self._send(pb.SessionRequest(call=pb.FastCall(
            method=method, request=request.SerializeToString(),
            timeout_ms=max(1, math.ceil(timeout * 1000)))))

    def wait_call(self, method: str, call_id: int, timeout: float) -> Any:
        """``call``'s second half: the answer to ``call_id``, raised as ``call`` does."""
        resp, fds = self._wait(call_id, timeout + _HUNG_AFTER)
        try:
            return _reply(method, resp, fds)
        except LinkBroken as exc:
            raise self._break(str(exc)) from None

    def cast(self, method: str, request: Message) -> None:
        """A call nobody waits for (``no_reply``: the daemon sends no answer)."""
        with self._send_lock:
            self._send_frame(pb.SessionRequest(call=pb.FastCall(
                method=method, request=request.SerializeToString(), no_reply=True)))

    # ------------------------------------------------------------- plumbing
    def _send(self, req: pb.SessionRequest) -> int:
        with self._cond:
            if self._broken is not None:
                raise self._broken
            call_id = next(self._ids)
            self._waiting.add(call_id)
        req.call_id = call_id
        try:
            with self._send_lock:
                self._send_frame(req)
        except BaseException:
            with self._cond:
                self._waiting.discard(call_id)
            raise
        return call_id

    def _send_frame(self, req: pb.SessionRequest) -> None:
        body = req.SerializeToString()
        try:
            self._sock.sendall(FRAME_LEN.pack(len(body)) + body)
        except OSError as exc:
            raise self._break(f"session channel to {self.path} failed: {exc}") from exc

    def _break(self, why: str) -> LinkBroken:
        err = LinkBroken(why)
        with self._cond:
            if self._broken is None:
                self._broken = err
            self._cond.notify_all()
            return self._broken

    def _wait(self, call_id: int, timeout: float) -> tuple[pb.SessionResponse, list[int]]:
        deadline = time.monotonic() + timeout
        try:
            while True:
                with self._cond:
                    while True:
                        got = self._done.pop(call_id, None)
                        if got is not None:
                            return got
                        if self._broken is not None:
                            raise self._broken
                        if not self._reading:
                            self._reading = True
                            break
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise self._break(f"kvtierd did not answer within {timeout:.1f} s")
                        self._cond.wait(left)
                try:
                    data, fds = self._recv_frame()
                    resp = pb.SessionResponse.FromString(data)
                except (OSError, DecodeError) as exc:
                    with self._cond:
                        self._reading = False
                    raise self._break(f"session channel to {self.path} failed: {exc}") from exc
                except BaseException:
                    with self._cond:
                        self._reading = False
                        self._cond.notify_all()
                    raise
                with self._cond:
                    self._reading = False
                    if resp.call_id == call_id:
                        self._cond.notify_all()
                        return resp, fds
                    if resp.call_id in self._waiting:
                        self._done[resp.call_id] = (resp, fds)
                    else:  # an answer nobody waits for (a connection-ending error has id 0)
                        for fd in fds:
                            os.close(fd)
                        if resp.WhichOneof("kind") == "error":
                            self._broken = LinkBroken(resp.error.message)
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._waiting.discard(call_id)

    def _recv_frame(self) -> tuple[bytes, list[int]]:
        """The next frame and its fds (blocking: after looking for it a short while,
        ``_native.readable_spin``, since the daemon answers a call within a few hundred
        microseconds and a thread asleep in ``recv`` is woken late)."""
        while True:
            got = self._frames.take()
            if got is not None:
                return got
            if ANSWER_SPIN_SECONDS > 0:
                _native.readable_spin(self._sock.fileno(), ANSWER_SPIN_SECONDS)
            self._frames.recv(self._sock)


class FrameSplitter:
    """Frames out of a session-channel byte stream, with the fds each one carried.

    Frames that arrive together are read together and the rest kept.  The
    kernel ends a read right after the bytes that carried fds, and the daemon
    sends a frame's fds with bytes of that frame, so the fds of one read
    belong to the frame that holds its last byte.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0  # stream offset of _buf[0]
        self._fds: list[tuple[int, list[int]]] = []  # (stream offset they came with, fds)

    def take(self) -> tuple[bytes, list[int]] | None:
        """The next whole frame and its fds, or None until more bytes are in."""
        buf = self._buf
        if len(buf) < FRAME_LEN.size:
            return None
        (length,) = FRAME_LEN.unpack_from(buf)
        need = FRAME_LEN.size + length
        if len(buf) < need:
            return None
        end = self._pos + need
        fds: list[int] = []
        while self._fds and self._fds[0][0] < end:
            fds.extend(self._fds.pop(0)[1])
        body = bytes(buf[FRAME_LEN.size:need])
        del buf[:need]
        self._pos = end
        return body, fds

    def recv(self, sock: socket.socket) -> None:
        """One read from ``sock`` (blocking or not: BlockingIOError passes through)."""
        data, ancdata, flags, _ = sock.recvmsg(
            max(65536, self._missing()), socket.CMSG_SPACE(MAX_FDS_PER_MSG * 4))
        got: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                got.extend(arr)
        if flags & socket.MSG_CTRUNC:
            for fd in got:
                os.close(fd)
            raise OSError("file descriptors were truncated (is RLIMIT_NOFILE too low?)")
        if not data:
            for fd in got:
                os.close(fd)
            raise OSError("kvtierd closed the session channel")
        self._buf += data
        if got:
            self._fds.append((self._pos + len(self._buf) - 1, got))

    def _missing(self) -> int:
        if len(self._buf) < FRAME_LEN.size:
            return FRAME_LEN.size - len(self._buf)
        (length,) = FRAME_LEN.unpack_from(self._buf)
        return FRAME_LEN.size + int(length) - len(self._buf)

    def close(self) -> None:
        """Close the fds of frames nobody took."""
        for _, fds in self._fds:
            for fd in fds:
                os.close(fd)
        self._fds.clear()


class AsyncSessionLink:
    """The asyncio side of a ``SessionLink`` (AsyncClient): after the blocking open
    handshake, the loop reads the connection (``add_reader``) and hands each
    response to the future that waits for its ``call_id``."""

    def __init__(self, link: SessionLink, loop: asyncio.AbstractEventLoop) -> None:
        self.link = link
        self.fast_path = link.fast_path
        self.max_call_bytes = link.max_call_bytes
        self._loop = loop
        self._sock = link._sock
        self._frames = link._frames
        self._pending: dict[int, asyncio.Future[tuple[pb.SessionResponse, list[int]]]] = {}
        self._send_lock = asyncio.Lock()
        self._broken: LinkBroken | None = None
        self._sock.setblocking(False)
        loop.add_reader(self._sock.fileno(), self._readable)
        link._on_close = self._detach

    def _detach(self) -> None:
        with contextlib.suppress(Exception):  # the loop may be closed already
            self._loop.remove_reader(self._sock.fileno())
        self._fail(LinkBroken("the session connection was closed"))

    def _fail(self, err: LinkBroken) -> None:
        if self._broken is None:
            self._broken = err
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self._broken)
        self._pending.clear()

    def _readable(self) -> None:
        try:
            while True:
                try:
                    self._frames.recv(self._sock)
                except BlockingIOError:
                    break
                while (got := self._frames.take()) is not None:
                    data, fds = got
                    resp = pb.SessionResponse.FromString(data)
                    fut = self._pending.pop(resp.call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result((resp, fds))
                        continue
                    for fd in fds:
                        os.close(fd)
                    if resp.WhichOneof("kind") == "error" and resp.call_id == 0:
                        raise OSError(resp.error.message)
        except (OSError, DecodeError) as exc:
            self._loop.remove_reader(self._sock.fileno())
            self._fail(LinkBroken(f"session channel to {self.link.path} failed: {exc}"))

    async def _exchange(self, req: pb.SessionRequest, timeout: float
                        ) -> tuple[pb.SessionResponse, list[int]]:
        if self._broken is not None:
            raise self._broken
        call_id = next(self.link._ids)
        req.call_id = call_id
        fut = self._loop.create_future()
        self._pending[call_id] = fut
        body = req.SerializeToString()
        try:
            async with self._send_lock:
                await self._loop.sock_sendall(self._sock, FRAME_LEN.pack(len(body)) + body)
        except OSError as exc:
            self._pending.pop(call_id, None)
            self._fail(LinkBroken(f"session channel to {self.link.path} failed: {exc}"))
            raise self._broken from exc  # type: ignore[misc]
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            self._fail(LinkBroken(f"kvtierd did not answer within {timeout:.1f} s"))
            raise self._broken from None  # type: ignore[misc]
        finally:
            self._pending.pop(call_id, None)

    async def request(self, req: pb.SessionRequest) -> tuple[pb.SessionResponse, list[int]]:
        """Like ``SessionLink.request``."""
        resp, fds = await self._exchange(req, self.link.timeout + _HUNG_AFTER)
        if resp.WhichOneof("kind") == "error":
            for fd in fds:
                os.close(fd)
            raise from_status(resp.error.code, resp.error.message)
        return resp, fds

    async def call(self, method: str, request: Message, timeout: float) -> Any:
        """Like ``SessionLink.call``."""
        resp, fds = await self._exchange(pb.SessionRequest(call=pb.FastCall(
            method=method, request=request.SerializeToString(),
            timeout_ms=max(1, math.ceil(timeout * 1000)))), timeout + _HUNG_AFTER)
        return _reply(method, resp, fds)

    async def cast(self, method: str, request: Message) -> None:
        """Like ``SessionLink.cast``."""
        if self._broken is not None:
            raise self._broken
        body = pb.SessionRequest(call=pb.FastCall(
            method=method, request=request.SerializeToString(), no_reply=True)
        ).SerializeToString()
        try:
            async with self._send_lock:
                await self._loop.sock_sendall(self._sock, FRAME_LEN.pack(len(body)) + body)
        except OSError as exc:
            self._fail(LinkBroken(f"session channel to {self.link.path} failed: {exc}"))
            raise self._broken from exc  # type: ignore[misc]


def _reply(method: str, resp: pb.SessionResponse, fds: list[int]) -> Any:
    """A FastCall's response message, or its error raised."""
    for fd in fds:  # a FastReply carries none; never leak what a confused peer sent
        os.close(fd)
    kind = resp.WhichOneof("kind")
    if kind == "reply":
        return _RESPONSE_OF[method].FromString(resp.reply.response)
    if kind == "error":
        raise from_status(resp.error.code, resp.error.message)
    raise LinkBroken(f"kvtierd answered {method} with a {kind!r} frame")


#: A mapping at least this large is populated in a thread (``_populate``).
POPULATE_IN_BACKGROUND_BYTES: Final = 64 << 20


def _populate(maps: list[mmap.mmap], *, write: bool) -> None:
    """Fault new segment mappings' pages in, so copies into and out of their slots do not
    take them one at a time.  Large ones (a warm daemon's extents: 4 GiB for a million
    4 KiB blocks, about a second here) in one thread, after they are all mapped, with the
    GIL released (``_native.index_populate``, in chunks: it holds the mmap lock) and at
    the lowest CPU priority: the client is ready meanwhile, and a page it touches first
    simply faults.  An older
    kernel (no MADV_POPULATE_*) or a file cut short meanwhile: the pages fault in on
    first touch."""
    native = _native
    large: list[mmap.mmap] = []
    for mm in maps:
        if native is not None and len(mm) >= POPULATE_IN_BACKGROUND_BYTES:
            large.append(mm)
            continue
        try:
            mm.madvise(_MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ)
        except OSError:
            pass
    if large and native is not None:
        populate = native.index_populate

        def run() -> None:
            with contextlib.suppress(OSError):  # the lowest CPU priority: this thread only
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            for mm in large:
                with contextlib.suppress(ValueError):  # (closed meanwhile)
                    populate(mm, write, False)

        threading.Thread(target=run, name="kvtier-populate", daemon=True).start()


class SegmentMaps:
    """The namespace's segments mapped into this process (data areas only).

    A segment whose fd cannot be mapped when it arrives is no error: its data
    file is shorter than the layout the daemon sent (the daemon retired the
    extent and cut its file to 0 after sending the fd, or a writer of this
    namespace truncated it, which the daemon's audit undoes within seconds).
    Its fd is kept (the daemon never sends a segment's fd twice on one
    connection) and mapped again by ``retry`` when an operation needs that
    segment; it is closed when the segment leaves the daemon's list.  A
    segment that still cannot be mapped then is ``unmappable``: the operation
    treats its slots as a miss (reads) or writes elsewhere (``kvtier._core``).
    """

    def __init__(self) -> None:
        self.version = 0
        #: The session may only read: the daemon sent read-only fds, map them PROT_READ.
        self.read_only = False
        #: Distance between slots in a segment's data (SessionOpened.slot_bytes).
        self.slot_bytes = 0
        #: The namespace's shared index, when the daemon sent one (and it is wanted).
        self.index: LocalIndex | None = None
        self._maps: dict[int, mmap.mmap] = {}
        #: Segments listed whose fd came but could not be mapped yet: id -> (fd, info).
        self._unmapped: dict[int, tuple[int, pb.SegmentInfo]] = {}
        # One array over each mapping (read-only, writable): a slot's view is a slice of
        # it, a fraction of what a new np.frombuffer per slot costs.
        self._arrays: tuple[dict[int, np.ndarray], dict[int, np.ndarray]] = ({}, {})

    def __contains__(self, segment_id: int) -> bool:
        return segment_id in self._maps

    def mappings(self) -> Mapping[int, mmap.mmap]:
        """segment id -> mmap of every segment mapped now (read-only; for cudaHostRegister)."""
        return types.MappingProxyType(self._maps)

    def missing(self, segment_ids: Iterable[int]) -> list[int]:
        """The segments of ``segment_ids`` not mapped now (kept fds included), sorted."""
        return sorted({s for s in segment_ids if s not in self._maps})

    def to_ask(self, segment_ids: Iterable[int]) -> list[int]:
        """The segments of ``segment_ids`` whose fds the daemon has to send: neither
        mapped nor kept (it sends none twice on a connection), sorted."""
        return sorted({s for s in segment_ids if s not in self._maps and s not in self._unmapped})

    def unmappable(self, segment_ids: Iterable[int]) -> list[int]:
        """The segments of ``segment_ids`` whose fd is kept unmapped, sorted."""
        return sorted({s for s in segment_ids if s in self._unmapped})

    def mapped_prefix(self, slots: Iterable[pb.SlotRef | LocalSlot]) -> int:
        """How many leading ``slots`` lie in segments mapped now."""
        n = 0
        for ref in slots:
            if ref.segment_id not in self._maps:
                break
            n += 1
        return n

    def update(self, version: int, segments: Sequence[pb.SegmentInfo],
               fd_ids: Sequence[int], fds: Sequence[int]) -> None:
        """Take in the segment list at ``version`` and the fds that came with it: map the
        new segments (keeping the fd of one that cannot be mapped now, for ``retry``),
        unmap the ones no longer listed and close their kept fds.

        Raises FailedPrecondition only when the fds do not match ``fd_ids`` (a
        confused daemon; every fd is closed then), never for a segment that
        cannot be mapped.
        """
        if len(fd_ids) != len(fds):
            for fd in fds:
                os.close(fd)
            raise FailedPrecondition(f"expected {len(fd_ids)} segment fds, received {len(fds)}")
        info = {s.segment_id: s for s in segments}
        kept: set[int] = set()
        new: list[mmap.mmap] = []
        try:
            for seg_id, fd in zip(fd_ids, fds, strict=True):
                seg = info.get(seg_id)
                if seg is None or seg_id in self._maps or seg_id in self._unmapped:
                    continue
                if not self._map(seg_id, fd, seg):
                    self._unmapped[seg_id] = (fd, seg)
                    kept.add(fd)
                else:
                    new.append(self._maps[seg_id])
        finally:
            for fd in fds:
                if fd not in kept:
                    os.close(fd)
            _populate(new, write=not self.read_only)
        for seg_id in [s for s in self._maps if s not in info]:
            self._drop(seg_id)
        for seg_id in [s for s in self._unmapped if s not in info]:
            os.close(self._unmapped.pop(seg_id)[0])
        self.version = version

    def retry(self, segment_ids: Iterable[int]) -> list[int]:
        """Map again the kept fds of ``segment_ids`` (those that have one); returns the
        ones that still cannot be mapped."""
        still = []
        for seg_id in sorted(set(segment_ids)):
            kept = self._unmapped.get(seg_id)
            if kept is None:
                continue
            fd, seg = kept
            if self._map(seg_id, fd, seg):
                _populate([self._maps[seg_id]], write=not self.read_only)
                del self._unmapped[seg_id]
                os.close(fd)
            else:
                still.append(seg_id)
        return still

    def _map(self, seg_id: int, fd: int, seg: pb.SegmentInfo) -> bool:
        """Map segment ``seg_id``'s data area from ``fd`` (not closed); False when its
        data file is shorter than ``seg`` says, or the mapping fails otherwise.

        ``mmap.mmap`` refuses a file shorter than the mapping (it checks with
        fstat): a mapping that would fault at once is never made; one whose
        file is cut short later faults on access, which the fault guard turns
        into errors (``kvtier._accel``).
        """
        prot = mmap.PROT_READ if self.read_only else mmap.PROT_READ | mmap.PROT_WRITE
        try:
            mm = mmap.mmap(fd, seg.data_bytes, mmap.MAP_SHARED, prot, offset=seg.data_offset)
        except (ValueError, OSError):
            return False
        self._maps[seg_id] = mm
        return True

    def open_index(self, opened: pb.SessionOpened, fds: list[int], wanted: bool,
                   writes_wanted: bool = True) -> None:
        """Map the shared index and lookup counters page that came after the segments'
        fds with ``opened`` (if ``wanted`` and this build can search it), with the write
        area when the daemon offers one and ``writes_wanted``; closes ``fds``."""
        try:
            n = 3 if opened.write_doorbell else 2
            if (wanted and _index.AVAILABLE and opened.shared_index and opened.lookup_counters
                    and len(fds) == n):
                self.index = LocalIndex(fds[0], fds[1], opened.max_keys,
                                        fds[2] if n == 3 and writes_wanted else None)
        finally:
            for fd in fds:
                os.close(fd)

    def mapped(self, resp: pb.SessionResponse, fds: list[int], *,
               asked_index: bool = False) -> None:
        """Take in a ``SegmentsMapped`` answer: map its segments and, when it carries
        one, switch to the new shared index (asked for and none came: the daemon no
        longer publishes one, stop searching here)."""
        m = resp.mapped
        n = len(m.fd_segment_ids)
        extra = fds[n:]
        try:
            self.update(m.segments_version, m.segments, m.fd_segment_ids, fds[:n])
            if self.index is not None and m.shared_index and len(extra) == 1:
                self.index.replace(extra[0])
            elif asked_index and self.index is not None and self.index.superseded:
                self.index.close()
                self.index = None
        finally:
            for fd in extra:
                os.close(fd)

    def fetch(self, link: SessionLink, want: Sequence[int], *, index: bool = False,
              version: int | None = None) -> None:
        """Map segments ``want``: map again the ones whose fds are kept, ask the daemon
        over ``link`` for the fds of the others (and of the current shared index, with
        ``index``) and map them (blocking: a round trip, then mmap and page-table
        population).  No round trip when every fd is here already and the segment list
        is at ``version`` (None: always ask)."""
        self.retry(want)
        ask = self.to_ask(want)
        if not ask and not index and version is not None and version == self.version:
            return
        resp, fds = link.request(map_request(ask, index=index))
        self.mapped(resp, fds, asked_index=index)

    def _array(self, segment_id: int, writable: bool) -> np.ndarray:
        """The array over segment ``segment_id``'s whole mapping (a slot's view is a slice
        of it); FailedPrecondition when it is not mapped."""
        arrays = self._arrays[writable]
        whole = arrays.get(segment_id)
        if whole is None:
            mm = self._maps.get(segment_id)
            if mm is None:
                why = (" (its data file is shorter than its layout: truncated)"
                       if segment_id in self._unmapped else "")
                raise FailedPrecondition(f"segment {segment_id} is not mapped in this process{why}")
            whole = np.frombuffer(mm, dtype=np.uint8)
            if not writable:
                whole.flags.writeable = False
            arrays[segment_id] = whole
        return whole

    def view(self, ref: pb.SlotRef | LocalSlot, length: int, *, writable: bool) -> np.ndarray:
        whole = self._array(ref.segment_id, writable)
        end = ref.offset + length
        if end > whole.size:
            raise FailedPrecondition(f"a slot of segment {ref.segment_id} ends at {end}, past "
                                     f"its {whole.size} mapped bytes")
        return whole[ref.offset:end]

    def slot_arrays(self, segment_ids: Sequence[int], offsets: Sequence[int], length: int, *,
                    writable: bool) -> dict[int, np.ndarray]:
        """The arrays over the segments that slots ``(segment_ids[i], offsets[i])`` of
        ``length`` bytes lie in (segment id -> array; slot i's view is
        ``array[offsets[i]:offsets[i] + length]``), every slot checked as ``view``
        checks it, without a view per slot: FailedPrecondition, with ``view``'s
        message, for the first slot (in order) that is not mapped or ends past its
        segment's mapping.  The arrays hold their mappings: a segment unmapped later
        stays mapped while a caller keeps them."""
        got: dict[int, np.ndarray] = {}
        try:
            segs = set(segment_ids)
            for seg in segs:
                got[seg] = self._array(seg, writable)
            if len(segs) == 1:
                ok = not offsets or max(offsets) + length <= got[segment_ids[0]].size
            else:
                ok = all(off + length <= got[seg].size
                         for seg, off in zip(segment_ids, offsets, strict=True))
        except FailedPrecondition:
            ok = False
        if not ok:  # the first slot that fails, with view's error
            for seg, off in zip(segment_ids, offsets, strict=True):
                self.view(LocalSlot(seg, off, length, 0, False), length, writable=writable)
            got = {seg: self._array(seg, writable) for seg in set(segment_ids)}
        return got

    def _drop(self, seg_id: int) -> None:
        for arrays in self._arrays:
            arrays.pop(seg_id, None)
        mm = self._maps.pop(seg_id)
        try:
            mm.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes when it does

    def close(self) -> None:
        for seg_id in list(self._maps):
            self._drop(seg_id)
        for fd, _ in self._unmapped.values():
            os.close(fd)
        self._unmapped.clear()
        if self.index is not None:
            self.index.close()
            self.index = None


def open_request(namespace: str, block_bytes: int, model_uid: str) -> pb.SessionRequest:
    return pb.SessionRequest(
        open=pb.OpenSession(
            ns=pb.NamespaceDecl(name=namespace, block_bytes=block_bytes, model_uid=model_uid)
        )
    )


def admin_request() -> pb.SessionRequest:
    return pb.SessionRequest(admin=pb.OpenAdmin())


def map_request(want: Sequence[int], *, index: bool = False) -> pb.SessionRequest:
    return pb.SessionRequest(map=pb.MapSegments(want_fds=list(want), want_index=index))
