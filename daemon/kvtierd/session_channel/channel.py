"""``SessionChannel``: the listening socket, one task per connection, and the
session's end when its connection closes.

Each connection's task reads frames (``framing``) and hands each request to
its part: ``OpenSession``, ``OpenAdmin`` and ``MapSegments`` to ``handshake``,
``FastCall`` to ``fast_calls``.  Before a session is open a connection gets
``HANDSHAKE_TIMEOUT`` and ``MAX_OPEN_FRAME``; after, ``MAX_REQUEST_FRAME``.
Anything malformed gets a ``SessionError`` frame and the connection is
closed; the daemon keeps serving.  When the connection ends, its calls still
running are cancelled, its doorbell is closed (``doorbell``), its page's
counts are folded (``pages``), and the store closes the session: its leases
are released and its reservations aborted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections.abc import Callable, Mapping

from google.protobuf.message import DecodeError

from kvtier._wire import FRAME_LEN
from kvtier.errors import FailedPrecondition, InvalidArgument, KVTierError
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.access import AccessPolicy, AdminSession, AdminSessions, Identity, peer_groups
from kvtierd.config import DEFAULT_MAX_KEYS_PER_CALL, LimitsConfig
from kvtierd.metrics import Metrics
from kvtierd.service import Method
from kvtierd.session_channel.busy_poll import BusyPoll
from kvtierd.session_channel.doorbell import Doorbells
from kvtierd.session_channel.fast_calls import (
    CALLS_PER_TURN,
    MAX_CALLS_IN_FLIGHT,
    max_call_bytes,
    start_call,
)
from kvtierd.session_channel.framing import (
    MAX_OPEN_FRAME,
    MAX_REQUEST_FRAME,
    RECV_BYTES,
    Closed,
    Conn,
    frame_bytes,
    read_frame,
    send_error,
)
from kvtierd.session_channel.handshake import HANDSHAKE_TIMEOUT, Handshake
from kvtierd.session_channel.pages import SessionPages
from kvtierd.shared_index import SessionPage
from kvtierd.store import Peer, Session, Store

log = logging.getLogger("kvtierd.session_channel")  # one name for the package's records


class SessionChannel:
    """Serves the session socket at ``path`` for ``store``."""

    def __init__(self, store: Store, metrics: Metrics, path: str, mode: int, *,
                 policy: AccessPolicy | None = None, limits: LimitsConfig | None = None,
                 admins: AdminSessions | None = None,
                 methods: Mapping[str, Method] | None = None,
                 max_message_bytes: int = MAX_REQUEST_FRAME,
                 max_keys: int = DEFAULT_MAX_KEYS_PER_CALL,
                 commit_from_page: Callable[[Session, SessionPage], int] | None = None,
                 busy_poll: float = 0.0) -> None:
        """``methods``: the service's (``service.methods``), served as FastCalls; None
        turns the fast path off (``server.fast_path: false``).  A FastCall's request
        may be ``max_message_bytes`` long (as a gRPC one), within the frame limit.
        ``commit_from_page``: the service's, run when a writing session's client rings
        its doorbell (writes without a call); None: no session gets a write area.
        ``busy_poll``: seconds the loop keeps polling after each call and commit
        (``server.busy_poll``; 0: off)."""
        self.store = store
        self.metrics = metrics
        self.methods = methods
        self.max_call_bytes = max_call_bytes(max_message_bytes)
        self.max_keys = max_keys
        self.path = path
        self.mode = mode
        self.policy = policy if policy is not None else AccessPolicy(enabled=False)
        self.limits = limits if limits is not None else LimitsConfig()
        self.admins = admins if admins is not None else AdminSessions()
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        #: The pages of the sessions sent a shared index: counters, hazards.
        self.pages = SessionPages(store, self.limits, max_keys)
        self.busy = BusyPoll(busy_poll)
        self.doorbells = Doorbells(commit_from_page, self.busy.active)
        self.handshake = Handshake(store, policy=self.policy, limits=self.limits,
                                   admins=self.admins, methods=methods,
                                   max_call_bytes=self.max_call_bytes, max_keys=max_keys,
                                   pages=self.pages, doorbells=self.doorbells)
        metrics.before_scrape.append(self.fold_counters)

    @property
    def commit_from_page(self) -> Callable[[Session, SessionPage], int] | None:
        return self.doorbells.commit_from_page

    def fold_counters(self) -> None:
        """Add what the sessions' clients counted in their pages since the last fold
        to their namespaces' client-reported figures (``SessionPages.fold``)."""
        self.pages.fold()

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
        conn = Conn(sock, MAX_OPEN_FRAME + RECV_BYTES)
        session: Session | None = None
        admin: AdminSession | None = None
        calls: set[asyncio.Task[None]] = set()  # at most MAX_CALLS_IN_FLIGHT
        room_freed = asyncio.Event()  # set when a call in ``calls`` ends
        # Segment ids whose fds this connection was sent: never sent twice, so a peer
        # that asks again and again without reading cannot park an unbounded number of
        # our fds in its receive queue (the kernel counts fds in flight against our
        # RLIMIT_NOFILE, and past it no other client could be sent any).
        sent: set[int] = set()
        call_id = 0  # of the request being handled: a connection-ending error names it
        served_in_turn = 0  # calls served since the reader last gave the loop up

        def ended(task: asyncio.Task[None]) -> None:
            calls.discard(task)
            room_freed.set()

        def serve_now() -> bool:
            """``Conn.fast_lane`` once a session is open: the FastCall frames the bytes
            just read complete, served in the socket's callback (as the reader would:
            ``start_call``), at most ``CALLS_PER_TURN`` of them and while fewer than
            ``MAX_CALLS_IN_FLIGHT`` calls wait.  False, the frame at the head of the
            buffer left whole, for anything else: another kind of request, a frame too
            long or malformed, the limits reached (the reader answers or waits)."""
            nonlocal call_id
            buf = conn.buf
            for _ in range(CALLS_PER_TURN):
                need = frame_bytes(buf)
                if not need or len(buf) < need:
                    return need - FRAME_LEN.size <= MAX_REQUEST_FRAME  # a part: wait for more
                if len(calls) >= MAX_CALLS_IN_FLIGHT:
                    return False
                try:
                    with memoryview(buf) as view:
                        req = pb.SessionRequest.FromString(
                            view[FRAME_LEN.size:need])  # type: ignore[arg-type]  # (a buffer)
                except DecodeError:
                    return False
                if req.WhichOneof("kind") != "call":
                    return False
                del buf[:need]
                call_id = req.call_id
                self.busy.active()
                task = start_call(self.methods, self.max_call_bytes, conn, token_of(), call_id,
                                  req.call)
                if task is not None:
                    calls.add(task)
                    task.add_done_callback(ended)
            return not frame_bytes(buf)  # more: the reader's turn (CALLS_PER_TURN a turn)

        def token_of() -> str:
            return session.token if session is not None else admin.token  # type: ignore[union-attr]

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
                    frame = await asyncio.wait_for(read_frame(conn, limit), timeout)
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
                    self.busy.active()
                    while len(calls) >= MAX_CALLS_IN_FLIGHT:  # read on when one ends
                        room_freed.clear()
                        await room_freed.wait()
                    task = start_call(self.methods, self.max_call_bytes, conn, token_of(),
                                      call_id, req.call)
                    if task is None:  # served and answered already (it never waited)
                        # Calls read together are served in one turn of the loop: past
                        # CALLS_PER_TURN of them in a row, the other clients get their
                        # turn (a peer packing calls into its socket must not keep the
                        # loop to itself).
                        served_in_turn += 1
                        if served_in_turn >= CALLS_PER_TURN:
                            served_in_turn = 0
                            await asyncio.sleep(0)
                        continue
                    served_in_turn = 0
                    calls.add(task)
                    task.add_done_callback(ended)
                elif kind == "open":
                    if session is not None or admin is not None:
                        raise FailedPrecondition("this connection already has a session")
                    session = self.handshake.open_session(req.open.ns, peer, ident)
                    conn.cap = MAX_REQUEST_FRAME + RECV_BYTES
                    conn.fast_lane = serve_now
                    log.debug("session %d opened by pid %d uid %d in %r", session.id, pid, uid,
                              session.ns.name)
                    sent = await self.handshake.send_opened(conn, session, call_id)
                elif kind == "map":
                    if session is None:
                        raise FailedPrecondition("MapSegments before OpenSession")
                    sent |= await self.handshake.send_mapped(
                        conn, session, set(req.map.want_fds) - sent, call_id, req.map.want_index)
                elif kind == "admin":
                    if session is not None or admin is not None:
                        raise FailedPrecondition("this connection already has a session")
                    admin = self.handshake.open_admin(ident, uid)
                    conn.cap = MAX_REQUEST_FRAME + RECV_BYTES
                    conn.fast_lane = serve_now
                    await self.handshake.send_admin_opened(conn, admin, call_id)
                else:
                    raise InvalidArgument("empty SessionRequest (set open, map, admin or call)")
        except Closed:
            pass
        except KVTierError as exc:
            await send_error(conn, exc, call_id)
        except (ConnectionError, OSError) as exc:
            log.debug("session channel connection failed: %s", exc)
        except asyncio.CancelledError:
            pass
        finally:
            conn.fast_lane = None
            # Calls still running belong to a session that is ending: they stop first.
            for task in calls:
                task.cancel()
            if calls:
                await asyncio.gather(*calls, return_exceptions=True)
            if admin is not None:
                self.admins.close(admin)
            if session is not None:
                self._end_session(session)
            conn.close()

    def _end_session(self, session: Session) -> None:
        """Its connection closed: commit what its page still holds, fold its counts,
        and close it in the store (its reservations aborted, its leases and hazards
        released)."""
        page = self.pages.detach(session.id)
        self.doorbells.close(session, page)  # and commits the client published before it went
        if page is not None:
            self.pages.fold_last(session, page)
        aborted, released = self.store.close_session(session)  # and its hazards
        if page is not None:
            page.close()
        self.metrics.sessions_closed.inc()
        self.metrics.aborted_blocks.labels(session.ns.name, "session_closed").inc(aborted)
        if aborted or released:
            log.info("session %d (pid %d) closed: %d reserved slots returned, %d leases "
                     "released", session.id, session.peer.pid, aborted, released)
