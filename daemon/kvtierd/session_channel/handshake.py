"""Opening a session on the channel, and the fds it is sent.

``OpenSession`` declares a namespace and gets a session token plus the
namespace's segment fds; later ``MapSegments`` requests fetch fds of extents
added since (and, asked, the current shared index).  This is where access is
decided, from the peer's ``SO_PEERCRED`` identity: a peer without a read or
write right on the namespace is refused before the namespace is declared and
before any fd moves; a peer that may only read gets read-only fds.
``OpenAdmin`` opens an admin session (a token, no fds) for the admin calls.
Both count against ``limits.max_sessions_per_uid``.

With the fast path on, ``SessionOpened`` also carries the shared index and the
session's page (``pages``), and a writer's doorbell (``doorbell``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Final

from kvtier import __version__
from kvtier.errors import CapacityExhausted, InvalidArgument, PermissionDenied
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.access import AccessPolicy, AdminSession, AdminSessions, Identity, Right
from kvtierd.config import LimitsConfig
from kvtierd.segments import UID_BYTES, Segment
from kvtierd.service import Method
from kvtierd.session_channel.doorbell import Doorbells, open_pipe
from kvtierd.session_channel.framing import Conn, send, send_with_fds
from kvtierd.session_channel.pages import SessionPages
from kvtierd.shared_index import SessionPage
from kvtierd.store import Peer, Session, Store

log = logging.getLogger("kvtierd.session_channel")  # one name for the package's records

#: A connection must declare its namespace this soon or it is dropped (a
#: half-open connection that never speaks must not hold resources forever).
HANDSHAKE_TIMEOUT: Final = 10.0
_NAME_RE: Final = re.compile(r"[A-Za-z0-9._/-]{1,128}")


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


class Handshake:
    """Opens sessions and admin sessions, and answers MapSegments."""

    def __init__(self, store: Store, *, policy: AccessPolicy, limits: LimitsConfig,
                 admins: AdminSessions, methods: Mapping[str, Method] | None,
                 max_call_bytes: int, max_keys: int, pages: SessionPages,
                 doorbells: Doorbells) -> None:
        self.store = store
        self.policy = policy
        self.limits = limits
        self.admins = admins
        self.methods = methods
        self.max_call_bytes = max_call_bytes
        self.max_keys = max_keys
        self.pages = pages
        self.doorbells = doorbells

    # ------------------------------------------------------------- opening
    def open_session(self, decl: pb.NamespaceDecl, peer: Peer, ident: Identity) -> Session:
        """Declare ``decl``'s namespace and open a session in it for ``peer``, if its
        rights and its uid's session limit allow (nothing is sent yet)."""
        validate_decl(decl)
        rights = self._rights(ident, decl.name)
        self._check_session_limit(peer.uid)
        session = self.store.open_session(decl.name, decl.block_bytes, decl.model_uid, peer)
        session.rights = int(rights)
        session.ident = ident
        return session

    def open_admin(self, ident: Identity, uid: int) -> AdminSession:
        """Open an admin session for ``ident`` (the peer's ``uid``), if it administers
        anything."""
        if not self.policy.administers_any(ident):
            raise PermissionDenied(
                f"{ident} has no admin right (access.admin, or admin in an "
                "access.namespaces rule, of the daemon's config)")
        self._check_session_limit(uid)
        return self.admins.open(ident)

    async def send_admin_opened(self, conn: Conn, admin: AdminSession, call_id: int) -> None:
        opened_admin = pb.SessionOpened(
            token=admin.token, daemon_version=__version__,
            boot_epoch=self.store.boot_epoch, fast_path=self.methods is not None,
            max_call_bytes=self.max_call_bytes)
        await send(conn, pb.SessionResponse(call_id=call_id, opened=opened_admin), [])

    async def send_opened(self, conn: Conn, session: Session, call_id: int) -> set[int]:
        """Answer an OpenSession: the token, the segment fds and, with the fast path
        on, the shared index, the session's page and a writer's doorbell; returns the
        ids of the segments whose fds went."""
        ns = session.ns
        segs = self.store.segments(ns)
        shared = ns.index.shared
        index_fd = shared.fd if shared is not None and self.methods is not None else None
        serial = 0 if shared is None else shared.serial
        page: SessionPage | None = None
        bell: int | None = None
        bell_w: int | None = None
        # Writes without a call: a page with a write area and a doorbell, for a writer.
        writes = (index_fd is not None and self.doorbells.commit_from_page is not None
                  and bool(session.rights & Right.WRITE) and self.store.grant_limit(ns) > 0)
        if index_fd is not None:
            try:
                page = self.pages.new(session, writes=writes)
                if writes:
                    bell, bell_w = open_pipe()
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
            await send_with_fds(conn, msg, segs, read_only=not session.rights & Right.WRITE,
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
            self.pages.attach(session, page)
            conn.index_sent = serial
            if bell is not None:
                self.doorbells.watch(session, page, bell)
        return {seg.segment_id for seg in segs}

    async def send_mapped(self, conn: Conn, session: Session,
                          want: set[int], call_id: int, want_index: bool = False) -> set[int]:
        """Answer a MapSegments with fds of the wanted segments (those not sent before on
        this connection) and, if asked, of the current shared index; returns the ids
        whose fds went."""
        ns = session.ns
        shared = ns.index.shared
        # A table goes once per connection (as a segment's fd does).
        serial = 0 if shared is None else shared.serial
        index_fd = shared.fd if (want_index and shared is not None
                                 and self.pages.has(session.id)
                                 and conn.index_sent != serial) else None
        segs = self.store.segments(ns)
        # Only this namespace's segments can ever be sent (a client maps only the namespaces it may).
        send_segs = [s for s in segs if s.segment_id in want]
        msg = pb.SessionResponse(
            call_id=call_id,
            mapped=pb.SegmentsMapped(
                segments_version=ns.segments_version,
                segments=[_info(s) for s in segs],
                fd_segment_ids=[s.segment_id for s in send_segs],
                shared_index=index_fd is not None,
            )
        )
        await send_with_fds(conn, msg, send_segs, read_only=not session.rights & Right.WRITE,
                            index_fd=index_fd)
        if index_fd is not None:
            conn.index_sent = serial
        return {seg.segment_id for seg in send_segs}

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


def _info(seg: Segment) -> pb.SegmentInfo:
    return pb.SegmentInfo(
        segment_id=seg.segment_id,
        data_offset=seg.layout.data_offset,
        data_bytes=seg.layout.n_slots * seg.layout.slot_bytes,
    )
