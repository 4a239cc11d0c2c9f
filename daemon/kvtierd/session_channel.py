"""The session channel: a Unix stream socket that opens sessions and passes fds.

A client connects once, declares its namespace (``OpenSession``), and gets a
session token plus the namespace's segment file descriptors (``SCM_RIGHTS``);
later ``MapSegments`` requests fetch fds of extents added since.  The peer's
pid/uid/gid come from ``SO_PEERCRED``, and this is where access is decided:
a peer without a read or write right on the namespace is refused before the
namespace is declared and before any fd moves; a peer that may only read gets
read-only fds.  ``OpenAdmin`` opens an admin session (a token, no fds) for
the admin calls.  The open connection *is* the session's
liveness: when it closes (the client exited, crashed or was SIGKILLed) the
session's leases are released and its reservations aborted at once.

Frames are a 4-byte big-endian length and a ``kvtier.v1.SessionRequest`` /
``SessionResponse`` (the format and the fd limit live in ``kvtier._wire``,
shared with the client).  Anything malformed gets a ``SessionError`` frame and the
connection is closed; the daemon keeps serving.

**The fast path.**  Once a session is open, a ``FastCall`` frame carries a
``kvtier.v1.KVTier`` call (``Acquire``, ``Reserve``, ...) on this same
connection instead of gRPC: the daemon serves it with the very handler that
serves the gRPC method (``service.methods``), as this connection's own
session, and answers with a ``FastReply`` or a ``SessionError`` that names
the call (``call_id``) and leaves the connection open.  Calls run
concurrently (at most :data:`MAX_CALLS_IN_FLIGHT` per connection; past that
the daemon reads no further frame until one ends) and may be answered out of
order; ``no_reply`` calls (a Release) are never answered.  When the
connection ends, its calls still running are cancelled before the session
is closed.

**The shared index.**  With the fast path on, ``SessionOpened`` also carries
the namespace's shared index (read-only; ``kvtierd.shared_index``), which
the client searches for a ``Lookup`` without calling, and a lookup counters
page (read-write, this session's alone) where it adds what it looked up;
the daemon adds those counts to the namespace's client-reported figures before
each scrape and each Stats and when the session ends, never to its own (host-wide)
figures, and trusts them for nothing else (``kvtierd.counters``).  A client whose table says
``SUPERSEDED`` asks for the new one with ``MapSegments(want_index=True)``.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import re
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Final

from google.protobuf.message import DecodeError

from kvtier import __version__
from kvtier._wire import FRAME_LEN, MAX_FDS_PER_MSG
from kvtier.errors import (
    CapacityExhausted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVTierError,
    PermissionDenied,
    status_of,
)
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.access import (
    AccessPolicy,
    AdminSession,
    AdminSessions,
    Identity,
    Right,
    peer_groups,
)
from kvtierd.config import DEFAULT_MAX_KEYS_PER_CALL, LimitsConfig
from kvtierd.metrics import Metrics
from kvtierd.segments import UID_BYTES, Segment
from kvtierd.service import FastCallFailed, FastContext, Method
from kvtierd.shared_index import HAZARDS_N, SessionPage
from kvtierd.store import Namespace, Peer, Session, Store

log = logging.getLogger(__name__)

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
#: A connection must declare its namespace this soon or it is dropped (a
#: half-open connection that never speaks must not hold resources forever).
HANDSHAKE_TIMEOUT: Final = 10.0
_NAME_RE: Final = re.compile(r"[A-Za-z0-9._/-]{1,128}")
#: FastCalls one connection may have running at once; the next frame is read
#: when one ends (a client cannot make the daemon hold unbounded work).
MAX_CALLS_IN_FLIGHT: Final = 64
#: Room a FastCall frame needs beyond its request message (method name, ids, tags).
_CALL_OVERHEAD: Final = 4096
#: Rings in a row that find no commit record before a doorbell is paused, and the
#: longest pause (``SessionChannel._doorbell``).
EMPTY_RINGS_BEFORE_PAUSE: Final = 4
EMPTY_RING_PAUSE_MAX: Final = 0.05
#: Bytes asked of each recv: small frames that arrive together are read at once.
_RECV_BYTES: Final = 64 << 10
#: The frame format is shared with the client (kvtier._wire): a 4-byte length prefix.
_LEN: Final = FRAME_LEN


class _Closed(Exception):
    """The peer closed the connection."""


class _Conn:
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
        self.send_lock = asyncio.Lock()
        #: The serial of the shared index table last sent on this connection (0: none).
        self.index_sent = 0
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._eof: BaseException | None = None
        self._watching = False
        self._watch()

    def _watch(self) -> None:
        if not self._watching and self._eof is None:
            self._loop.add_reader(self.sock.fileno(), self._readable)
            self._watching = True

    def _unwatch(self) -> None:
        if self._watching:
            self._loop.remove_reader(self.sock.fileno())
            self._watching = False

    def _readable(self) -> None:
        try:
            data = self.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._eof, data = exc, b""
        if data:
            self.buf += data
            if len(self.buf) > self.cap:
                self._unwatch()  # backpressure: more() resumes
        else:
            if self._eof is None:
                self._eof = _Closed()
            self._unwatch()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def more(self) -> None:
        """Wait until more bytes are in ``buf`` (raises at EOF or a socket error)."""
        if self._eof is not None:
            raise self._eof
        self._watch()
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._eof is not None and not self.buf:
            raise self._eof

    def close(self) -> None:
        self._unwatch()
        self._eof = self._eof or _Closed()
        self.sock.close()


def validate_decl(decl: pb.NamespaceDecl) -> None:
    """Check a namespace declaration at the edge, with exact messages."""
    if not _NAME_RE.fullmatch(decl.name):
        raise InvalidArgument(
            f"namespace name {decl.name!r} must be 1..128 characters of [A-Za-z0-9._/-]"
        )
    if decl.block_bytes == 0:
        raise InvalidArgument("block_bytes is required and must be > 0")
    uid_bytes = len(decl.model_uid.encode())
    if not 0 < uid_bytes <= UID_BYTES:
        raise InvalidArgument(f"model_uid must be 1..{UID_BYTES} bytes of UTF-8, got {uid_bytes}")


class SessionChannel:
    """Serves the session socket at ``path`` for ``store``."""

    def __init__(self, store: Store, metrics: Metrics, path: str, mode: int, *,
                 policy: AccessPolicy | None = None, limits: LimitsConfig | None = None,
                 admins: AdminSessions | None = None,
                 methods: Mapping[str, Method] | None = None,
                 max_message_bytes: int = MAX_REQUEST_FRAME,
                 max_keys: int = DEFAULT_MAX_KEYS_PER_CALL,
                 commit_from_page: Callable[[Session, SessionPage], int] | None = None) -> None:
        """``methods``: the service's (``service.methods``), served as FastCalls; None
        turns the fast path off (``server.fast_path: false``).  A FastCall's request
        may be ``max_message_bytes`` long (as a gRPC one), within the frame limit.
        ``commit_from_page``: the service's, run when a writing session's client rings
        its doorbell (writes without a call); None: no session gets a write area."""
        self.commit_from_page = commit_from_page
        #: Session id -> the read end of the pipe its client rings after publishing
        #: commit records (the write end went to the client; see ``_doorbell``).
        self._doorbells: dict[int, int] = {}
        #: Session id -> rings in a row that found no record (see ``_doorbell``).
        self._empty_rings: dict[int, int] = {}
        self.store = store
        self.metrics = metrics
        self.methods = methods
        self.max_call_bytes = min(max_message_bytes, MAX_REQUEST_FRAME - _CALL_OVERHEAD)
        self.max_keys = max_keys
        self.path = path
        self.mode = mode
        self.policy = policy if policy is not None else AccessPolicy(enabled=False)
        self.limits = limits if limits is not None else LimitsConfig()
        self.admins = admins if admins is not None else AdminSessions()
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        #: Session id -> its page (sessions sent a shared index): counters, hazards.
        self._counters: dict[int, SessionPage] = {}
        metrics.before_scrape.append(self.fold_counters)

    def fold_counters(self) -> None:
        """Add what the sessions' clients counted in their pages since the last fold
        to their namespaces' client-reported figures (on the loop; before each scrape
        and each Stats).  Never to the daemon's own: those count what it did."""
        by_ns: dict[str, list[SessionPage]] = {}
        for page in self._counters.values():
            by_ns.setdefault(page.namespace, []).append(page)
        for name, pages in by_ns.items():
            ns = self.store.namespaces.get(name)
            if ns is not None:
                self.store.note_reads(ns)  # CLOCK bits and prefetch hits of reads without a call
            self._fold(ns, pages)

    def _fold(self, ns: Namespace | None, pages: list[SessionPage]) -> None:
        """The pages' counts since their last take, each cut to what its client could
        have done (``SessionPage.take``), summed, to the namespace's client-reported
        figures (``Store.add_reported``: cut to what the host could have done)."""
        block_bytes = 0 if ns is None else ns.block_bytes
        total = [0] * 7
        cut = False
        for page in pages:
            for i, step in enumerate(page.take(max_keys=self.max_keys, block_bytes=block_bytes)):
                total[i] += step
            cut = cut or page.cut
        if ns is not None and (any(total) or cut):
            self.store.add_reported(ns, tuple(total), cut=cut)

    async def start(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.bind(self.path)
        os.chmod(self.path, self.mode)
        sock.listen(512)
        sock.setblocking(False)
        self._sock = sock
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def stop(self) -> None:
        """Stop accepting, close every connection (ending its session)."""
        if self._accept_task is not None:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    async def _accept_loop(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and friends: back off, keep serving
                log.warning("session channel accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        conn = _Conn(sock, MAX_OPEN_FRAME + _RECV_BYTES)
        session: Session | None = None
        admin: AdminSession | None = None
        calls: set[asyncio.Task[None]] = set()
        room = asyncio.Semaphore(MAX_CALLS_IN_FLIGHT)
        # Segment ids whose fds this connection was sent: never sent twice, so a peer
        # that asks again and again without reading cannot park an unbounded number of
        # our fds in its receive queue (the kernel counts fds in flight against our
        # RLIMIT_NOFILE, and past it no other client could be sent any).
        sent: set[int] = set()
        call_id = 0  # of the request being handled: a connection-ending error names it
        try:
            pid, uid, gid = struct.unpack(
                "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            )
            peer = Peer(pid, uid, gid)
            ident = Identity.of_peer(pid, uid, gid, groups=peer_groups(sock))
            while True:
                opened = session is not None or admin is not None
                timeout = None if opened else HANDSHAKE_TIMEOUT
                limit = MAX_REQUEST_FRAME if opened else MAX_OPEN_FRAME
                try:
                    frame = await asyncio.wait_for(self._read_frame(conn, limit), timeout)
                except TimeoutError:
                    raise InvalidArgument(
                        f"no OpenSession within {HANDSHAKE_TIMEOUT:.0f} s of connecting"
                    ) from None
                try:
                    req = pb.SessionRequest.FromString(frame)
                except DecodeError:
                    raise InvalidArgument("session channel frame is not a SessionRequest") from None
                call_id = req.call_id
                kind = req.WhichOneof("kind")
                if kind == "call":
                    if session is None and admin is None:
                        raise FailedPrecondition("FastCall before OpenSession or OpenAdmin")
                    token = session.token if session is not None else admin.token  # type: ignore[union-attr]
                    await room.acquire()  # at most MAX_CALLS_IN_FLIGHT: read on when one ends
                    task = asyncio.get_running_loop().create_task(
                        self._fast_call(conn, token, call_id, req.call))
                    calls.add(task)
                    task.add_done_callback(calls.discard)
                    task.add_done_callback(lambda _t: room.release())
                elif kind == "open":
                    if session is not None or admin is not None:
                        raise FailedPrecondition("this connection already has a session")
                    validate_decl(req.open.ns)
                    rights = self._rights(ident, req.open.ns.name)
                    self._check_session_limit(uid)
                    session = self.store.open_session(
                        req.open.ns.name, req.open.ns.block_bytes, req.open.ns.model_uid, peer
                    )
                    session.rights = int(rights)
                    session.ident = ident
                    conn.cap = MAX_REQUEST_FRAME + _RECV_BYTES
                    log.debug("session %d opened by pid %d uid %d in %r", session.id, pid, uid,
                              session.ns.name)
                    sent = await self._send_opened(conn, session, call_id)
                elif kind == "map":
                    if session is None:
                        raise FailedPrecondition("MapSegments before OpenSession")
                    sent |= await self._send_mapped(conn, session, set(req.map.want_fds) - sent,
                                                    call_id, req.map.want_index)
                elif kind == "admin":
                    if session is not None or admin is not None:
                        raise FailedPrecondition("this connection already has a session")
                    if not self.policy.administers_any(ident):
                        raise PermissionDenied(
                            f"{ident} has no admin right (access.admin, or admin in an "
                            "access.namespaces rule, of the daemon's config)")
                    self._check_session_limit(uid)
                    admin = self.admins.open(ident)
                    conn.cap = MAX_REQUEST_FRAME + _RECV_BYTES
                    opened_admin = pb.SessionOpened(
                        token=admin.token, daemon_version=__version__,
                        boot_epoch=self.store.boot_epoch, fast_path=self.methods is not None,
                        max_call_bytes=self.max_call_bytes)
                    await self._send(conn, pb.SessionResponse(call_id=call_id,
                                                              opened=opened_admin), [])
                else:
                    raise InvalidArgument("empty SessionRequest (set open, map, admin or call)")
        except _Closed:
            pass
        except KVTierError as exc:
            await self._send_error(conn, exc, call_id)
        except (ConnectionError, OSError) as exc:
            log.debug("session channel connection failed: %s", exc)
        except asyncio.CancelledError:
            pass
        finally:
            # Calls still running belong to a session that is ending: they stop first.
            for task in calls:
                task.cancel()
            if calls:
                await asyncio.gather(*calls, return_exceptions=True)
            if admin is not None:
                self.admins.close(admin)
            if session is not None:
                page = self._counters.pop(session.id, None)
                bell = self._doorbells.pop(session.id, None)
                self._empty_rings.pop(session.id, None)
                if bell is not None:
                    asyncio.get_running_loop().remove_reader(bell)
                    os.close(bell)
                    if page is not None:  # commits the client published before it went
                        self._ring(session, page)
                if page is not None:
                    self.store.note_reads(session.ns)
                    self._fold(self.store.namespaces.get(page.namespace), [page])
                aborted, released = self.store.close_session(session)  # and its hazards
                if page is not None:
                    page.close()
                self.metrics.sessions_closed.inc()
                self.metrics.aborted_blocks.labels(session.ns.name, "session_closed").inc(aborted)
                if aborted or released:
                    log.info("session %d (pid %d) closed: %d reserved slots returned, %d leases "
                             "released", session.id, session.peer.pid, aborted, released)
            conn.close()

    async def _fast_call(self, conn: _Conn, token: str, call_id: int, call: pb.FastCall) -> None:
        """Serve one FastCall with the gRPC method's own handler; answer unless no_reply."""
        try:
            if self.methods is None:
                raise FailedPrecondition("the fast path is off on this daemon "
                                         "(server.fast_path: false): use gRPC")
            method = self.methods.get(call.method)
            if method is None:
                raise InvalidArgument(f"FastCall of an unknown method {call.method[:64]!r}")
            if len(call.request) > self.max_call_bytes:
                raise CapacityExhausted(
                    f"{call.method} request of {len(call.request)} bytes exceeds the fast "
                    f"path's {self.max_call_bytes} (server.max_message_bytes): send it over gRPC")
            work = method.handler(method.parse(call.request), FastContext(token))
            # The deadline cancels this task (a timer, not wait_for's second task per call).
            expired = False
            timer = None
            task = asyncio.current_task()
            assert task is not None
            if call.timeout_ms:

                def expire() -> None:
                    nonlocal expired
                    expired = True
                    task.cancel()

                timer = asyncio.get_running_loop().call_later(call.timeout_ms / 1000, expire)
            try:
                resp = await work
            except asyncio.CancelledError:
                if not expired:
                    raise  # the connection is closing
                task.uncancel()
                raise DeadlineExceeded(
                    f"{call.method} did not finish within {call.timeout_ms} ms") from None
            finally:
                if timer is not None:
                    timer.cancel()
            out = pb.SessionResponse(call_id=call_id,
                                     reply=pb.FastReply(response=method.serialize(resp)))
        except FastCallFailed as exc:
            out = _error(call_id, exc.code.value[0], exc.details)
        except KVTierError as exc:
            out = _error(call_id, status_of(exc).value[0], str(exc))
        if call.no_reply:
            return
        try:
            await self._send(conn, out, [])
        except OSError as exc:  # the peer is gone: the read loop ends the session
            log.debug("session channel: answer to call %d not sent: %s", call_id, exc)

    # ------------------------------------------------------------- access
    def _rights(self, ident: Identity, namespace: str) -> Right:
        """The peer's rights on ``namespace``; refused unless it may read or write."""
        rights = self.policy.rights(ident, namespace)
        if not rights & (Right.READ | Right.WRITE):
            raise PermissionDenied(
                f"{ident} may not use namespace {namespace!r} (no read or write right in the "
                "daemon's access rules)")
        return rights

    def _check_session_limit(self, uid: int) -> None:
        limit = self.limits.max_sessions_per_uid
        n = sum(1 for s in self.store.sessions.values() if s.peer.uid == uid and not s.system)
        n += self.admins.count_uid(uid)
        if n >= limit:
            raise CapacityExhausted(
                f"uid {uid} already has {n} sessions open (limits.max_sessions_per_uid is "
                f"{limit})")

    def _hazard_share(self, session: Session) -> int:
        """Hazard entries a new session's page may use: what is left of its uid's
        ``limits.max_hazards_per_uid`` and its namespace's ``max_hazards_per_namespace``
        after the shares of the sessions open now (at most ``HAZARDS_N``).  A share
        never changes while its session lives (a client relies on its hazards), so
        the bound holds whatever order sessions come and go in."""
        uid, name = session.peer.uid, session.ns.name
        by_uid = by_ns = 0
        for other in self.store.sessions.values():
            page = self._counters.get(other.id)
            if page is None:
                continue
            if other.peer.uid == uid:
                by_uid += page.max_hazards
            if other.ns.name == name:
                by_ns += page.max_hazards
        return max(0, min(HAZARDS_N, self.limits.max_hazards_per_uid - by_uid,
                          self.limits.max_hazards_per_namespace - by_ns))

    # ------------------------------------------------------------- framing
    async def _read_frame(self, conn: _Conn, limit: int) -> bytes:
        """The next frame's body (frames that arrived together are read at once)."""
        buf = conn.buf
        need = 0  # the whole frame's bytes, once its length prefix is in
        while True:
            if not need and len(buf) >= _LEN.size:
                (length,) = _LEN.unpack_from(buf)
                if length > limit:
                    raise InvalidArgument(
                        f"frame of {length} bytes exceeds {limit}"
                        + (" before a session is open" if limit == MAX_OPEN_FRAME else ""))
                need = _LEN.size + length
            if need and len(buf) >= need:
                body = bytes(buf[_LEN.size:need])
                del buf[:need]
                return body
            await conn.more()

    async def _send_with_fds(self, conn: _Conn, msg: pb.SessionResponse,
                             segments: list[Segment], *, read_only: bool = False,
                             index_fd: int | None = None, counters_fd: int | None = None,
                             doorbell_fd: int | None = None) -> None:
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
            await self._send(conn, msg, fds)
        finally:
            for fd in fds:
                os.close(fd)

    async def _send(self, conn: _Conn, msg: pb.SessionResponse, fds: list[int]) -> None:
        async with conn.send_lock:  # one frame at a time: FastCalls answer concurrently
            await self._send_frame(conn.sock, msg, fds)

    async def _send_frame(self, conn: socket.socket, msg: pb.SessionResponse,
                          fds: list[int]) -> None:
        body = msg.SerializeToString()
        data = memoryview(_LEN.pack(len(body)) + body)
        # Split so each sendmsg carries at most MAX_FDS_PER_MSG fds (>= 1 byte each).
        n_pieces = max(1, -(-len(fds) // MAX_FDS_PER_MSG))
        if n_pieces > len(data):
            raise InvalidArgument(f"too many segments to send ({len(fds)})")
        cut = [len(data) * k // n_pieces for k in range(n_pieces + 1)]
        loop = asyncio.get_running_loop()
        for k in range(n_pieces):
            piece = data[cut[k] : cut[k + 1]]
            chunk_fds = fds[k * MAX_FDS_PER_MSG : (k + 1) * MAX_FDS_PER_MSG]
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", chunk_fds))] if chunk_fds else []
            while piece:
                try:
                    sent = conn.sendmsg([piece], anc)
                except BlockingIOError:
                    fut: asyncio.Future[None] = loop.create_future()
                    loop.add_writer(conn.fileno(), fut.set_result, None)
                    try:
                        await fut
                    finally:
                        loop.remove_writer(conn.fileno())
                    continue
                piece = piece[sent:]
                anc = []  # the fds went with the first bytes

    async def _send_opened(self, conn: _Conn, session: Session, call_id: int) -> set[int]:
        ns = session.ns
        segs = self.store.segments(ns)
        shared = ns.index.shared
        index_fd = shared.fd if shared is not None and self.methods is not None else None
        serial = 0 if shared is None else shared.serial
        page: SessionPage | None = None
        bell: int | None = None
        bell_w: int | None = None
        # Writes without a call: a page with a write area and a doorbell, for a writer.
        writes = (index_fd is not None and self.commit_from_page is not None
                  and bool(session.rights & Right.WRITE) and self.store.grant_limit(ns) > 0)
        if index_fd is not None:
            try:
                page = SessionPage(ns.name, self.limits.max_leases_per_session, writes=writes,
                                   max_hazards=self._hazard_share(session),
                                   max_reservations=self.limits.max_reservations_per_session)
                if writes:
                    bell, bell_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:  # out of memory or fds: this session calls Lookup
                log.warning("no session page for session %d: %s", session.id, exc)
                if page is not None:
                    page.close()
                page, index_fd = None, None
                bell = bell_w = None  # pipe2 is the last step that can fail
        msg = pb.SessionResponse(
            call_id=call_id,
            opened=pb.SessionOpened(
                token=session.token,
                slot_bytes=ns.slot_bytes,
                segments_version=ns.segments_version,
                segments=[_info(s) for s in segs],
                daemon_version=__version__,
                boot_epoch=self.store.boot_epoch,
                read_only=not session.rights & Right.WRITE,
                fast_path=self.methods is not None,
                max_call_bytes=self.max_call_bytes,
                shared_index=index_fd is not None,
                lookup_counters=page is not None,
                max_keys=self.max_keys,
                write_doorbell=bell is not None,
            )
        )
        try:
            await self._send_with_fds(conn, msg, segs, read_only=not session.rights & Right.WRITE,
                                      index_fd=index_fd,
                                      counters_fd=None if page is None else page.fd,
                                      doorbell_fd=bell_w)
        except BaseException:
            if page is not None:
                page.close()
            if bell is not None:
                os.close(bell)
            raise
        finally:
            if bell_w is not None:
                os.close(bell_w)  # the client holds the only write end now
        if page is not None:
            page.close_fd()  # the mapping stays: the client's counts and hazards are read there
            self.store.attach_page(session, page)
            self._counters[session.id] = page
            conn.index_sent = serial
            if bell is not None:
                self._doorbells[session.id] = bell
                asyncio.get_running_loop().add_reader(bell, self._doorbell, session, page, bell)
        return {seg.segment_id for seg in segs}

    def _doorbell(self, session: Session, page: SessionPage, bell: int) -> None:
        """A writer rang: commit what its page holds (on the loop, from the reader).

        The doorbell is a pipe whose read end only the daemon holds, non-blocking:
        the client got the write end, a different open file description, so
        nothing it does to its fd (``F_SETFL`` clearing ``O_NONBLOCK``, draining,
        closing) can make this read block.  (It was an eventfd shared by ``dup``:
        a client that cleared ``O_NONBLOCK`` on it and drained it hung the loop.)
        A ring is any bytes; one read drains up to 64 KiB of them, however many
        rings that was.  End of file (the client closed its write end) stops the
        watching: commits the page holds then wait for the session's end."""
        try:
            data = os.read(bell, 1 << 16)
        except BlockingIOError:
            return  # rung and answered already
        except OSError as exc:
            log.warning("doorbell of session %d failed: %s", session.id, exc)
            data = b""
        if not data:
            self._silence(session.id)
            return
        if self._ring(session, page):
            self._empty_rings.pop(session.id, None)
            return
        # A client rings after publishing records, so a ring that finds none is rare
        # for an honest one (its records went with the ring before).  Rings in a row
        # that find none are a client ringing for nothing: its doorbell is left
        # unwatched for a while (1 ms, doubling to EMPTY_RING_PAUSE_MAX), so ringing
        # in a loop costs the daemon a bounded number of wakeups per second.
        empty = self._empty_rings.get(session.id, 0) + 1
        self._empty_rings[session.id] = empty
        if empty >= EMPTY_RINGS_BEFORE_PAUSE:
            loop = asyncio.get_running_loop()
            loop.remove_reader(bell)
            pause = min(0.001 * 2 ** (empty - EMPTY_RINGS_BEFORE_PAUSE), EMPTY_RING_PAUSE_MAX)
            loop.call_later(pause, self._rewatch, session, page, bell)

    def _rewatch(self, session: Session, page: SessionPage, bell: int) -> None:
        if self._doorbells.get(session.id) == bell and not session.closed:
            asyncio.get_running_loop().add_reader(bell, self._doorbell, session, page, bell)

    def _silence(self, session_id: int) -> None:
        """Stop watching a doorbell whose write end is gone (EOF would be ready forever)."""
        bell = self._doorbells.get(session_id)
        if bell is not None:
            asyncio.get_running_loop().remove_reader(bell)

    def _ring(self, session: Session, page: SessionPage) -> int:
        """Commit what the page holds; the number of records found."""
        if session.closed or self.commit_from_page is None:
            return 0
        try:
            return self.commit_from_page(session, page)
        except Exception:  # never the loop's end: the page is the client's input
            log.exception("commits from session %d's page failed", session.id)
            return 1  # not an empty ring: its doorbell is not paused for it

    async def _send_mapped(self, conn: _Conn, session: Session,
                           want: set[int], call_id: int, want_index: bool = False) -> set[int]:
        """Answer a MapSegments with fds of the wanted segments (those not sent before on
        this connection) and, if asked, of the current shared index; returns the ids
        whose fds went."""
        ns = session.ns
        shared = ns.index.shared
        # A table goes once per connection (as a segment's fd does).
        serial = 0 if shared is None else shared.serial
        index_fd = shared.fd if (want_index and shared is not None
                                 and session.id in self._counters
                                 and conn.index_sent != serial) else None
        segs = self.store.segments(ns)
        # Only this namespace's segments can ever be sent (a client maps only the namespaces it may).
        send = [s for s in segs if s.segment_id in want]
        msg = pb.SessionResponse(
            call_id=call_id,
            mapped=pb.SegmentsMapped(
                segments_version=ns.segments_version,
                segments=[_info(s) for s in segs],
                fd_segment_ids=[s.segment_id for s in send],
                shared_index=index_fd is not None,
            )
        )
        await self._send_with_fds(conn, msg, send, read_only=not session.rights & Right.WRITE,
                                  index_fd=index_fd)
        if index_fd is not None:
            conn.index_sent = serial
        return {seg.segment_id for seg in send}

    async def _send_error(self, conn: _Conn, exc: KVTierError, call_id: int) -> None:
        msg = _error(call_id, status_of(exc).value[0], str(exc))
        try:
            await asyncio.wait_for(self._send(conn, msg, []), 1.0)
        except (TimeoutError, OSError, KVTierError):
            pass


def _info(seg: Segment) -> pb.SegmentInfo:
    return pb.SegmentInfo(
        segment_id=seg.segment_id,
        data_offset=seg.layout.data_offset,
        data_bytes=seg.layout.n_slots * seg.layout.slot_bytes,
    )


def _error(call_id: int, code: int, message: str) -> pb.SessionResponse:
    return pb.SessionResponse(call_id=call_id, error=pb.SessionError(code=code, message=message))
