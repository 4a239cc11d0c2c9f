"""``kvtier.Client``: the synchronous client.

Control goes over gRPC on a Unix socket; bytes never do: ``reserve`` hands
out writable numpy views of shared-memory slots and ``acquire`` read-only
ones.  Every call makes a fixed number of RPCs however many keys it carries
(``put``: Reserve + Commit; ``get``: Acquire + Release).
"""

from __future__ import annotations

import os
import threading
import types
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from kvtier._core import (
    DEFAULT_TIMEOUT,
    SESSION_BOUND,
    SESSION_METADATA,
    Backoff,
    KeyStatus,
    LeaseState,
    ReservationState,
    Tier,
    as_bytes_view,
    as_keys,
    check_out,
    copy_out,
    grpc_options,
    session_lost,
    socket_paths,
)
from kvtier._session import SegmentMaps, SessionLink, map_request, open_request
from kvtier.errors import (
    Corrupted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVTierError,
    SessionLost,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc


class Reservation(ReservationState):
    """Writable slots for the keys of one ``reserve`` call.

    ``buffers[i]`` is a writable uint8 view of ``block_bytes`` for each key
    whose status is ``RESERVED`` (``None`` otherwise).  Write into it (or use
    ``write(i, data)``, which also records the length), then ``commit()``.
    Leaving the ``with`` block without committing aborts.  If the daemon
    restarted meanwhile, ``commit()`` raises ``SessionLost`` (nothing was
    committed; write again).
    """

    def __init__(self, client: Client, keys: list[bytes], resp: pb.ReserveResponse) -> None:
        super().__init__(keys, resp, client._maps, client.block_bytes, client._session_gen)
        self._client = client

    def commit(self) -> int:
        """Make every reserved key visible (all or nothing); returns how many."""
        if self.done:
            return 0
        req = self.commit_request(self._client.checksum)
        try:
            resp = self._client._bound_call("Commit", req, self.session_gen, "reservation")
        except SessionLost:
            self.done = True
            self.release_views()
            raise
        self.done = True
        self.release_views()
        return int(resp.committed)

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        self.release_views()
        self._client._bound_call("Abort", pb.AbortRequest(reservation_id=self.reservation_id),
                                 self.session_gen, "reservation")

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        if not self.done:
            try:
                self.abort()
            except KVTierError:
                if et is None:
                    raise


class Lease(LeaseState):
    """Read-only views of the leased leading prefix; released on exit.

    If the daemon restarted while the lease was held, ``release()`` raises
    ``SessionLost``: the lease was not honoured to the end, so what the views
    showed after the restart is not guaranteed.
    """

    def __init__(self, client: Client, keys: list[bytes], resp: pb.AcquireResponse) -> None:
        self._client = client
        super().__init__(keys, resp, client._maps, client.checksum, client._session_gen)

    def release(self, *, wait: bool = True) -> None:
        """End the lease.  ``wait=False`` sends the Release without waiting for its
        answer (one RPC round trip off the read path); the views are gone either way,
        and a failure then can only mean the lease had already ended."""
        if self.done:
            return
        self.done = True
        self.release_views()
        if not wait and self.session_gen == self._client._session_gen:
            self._client._send_release(self.lease_id)
            return
        self._client._bound_call("Release", pb.ReleaseRequest(lease_id=self.lease_id),
                                 self.session_gen, "lease")

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        try:
            self.release()
        except KVTierError:
            if et is None:
                raise


class Client:
    """A session in one namespace of a kvtierd.

    ``socket`` is the daemon's socket directory (or its ``kvtier.sock``);
    default ``$KVTIER_SOCKET_DIR``, else ``$XDG_RUNTIME_DIR/kvtier``, else
    ``/tmp/kvtier-$UID``.  The namespace is declared with its layout; a
    conflicting declaration raises ``FailedPrecondition``.  With
    ``checksum=True`` commits carry an xxh3-64 of each block and reads verify
    it (a mismatch raises ``Corrupted``).

    The client rides through daemon restarts: a call that finds the daemon
    gone raises ``Unavailable`` (after at most ``timeout`` seconds); later
    calls reconnect (backing off exponentially up to ``reconnect_max``
    seconds, failing fast in between) and open a new session.  Leases and
    reservations of the old session are reported as ``SessionLost``.
    """

    def __init__(
        self,
        socket: str | os.PathLike[str] | None = None,
        *,
        namespace: str,
        block_bytes: int,
        model_uid: str,
        timeout: float = DEFAULT_TIMEOUT,
        checksum: bool = False,
        reconnect_max: float = 5.0,
    ) -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise InvalidArgument(f"block_bytes must be a positive int, got {block_bytes!r}")
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.model_uid = model_uid
        self.timeout = timeout
        self.checksum = checksum
        self.grpc_path, self.session_path = socket_paths(socket)
        self._backoff = Backoff(maximum=reconnect_max)
        self._closed = False
        self._link: SessionLink | None = None
        self._maps = SegmentMaps()
        self._session_gen = 0
        self._metadata: tuple[tuple[str, str], ...] = ()
        self._lock = threading.RLock()
        self._pending_release: grpc.Future[Any] | None = None
        self._open_session()
        self._channel = grpc.insecure_channel(f"unix:{self.grpc_path}", options=grpc_options())
        self._stub = pb_grpc.KVTierStub(self._channel)

    # ------------------------------------------------------------- session
    def _open_session(self) -> None:
        link = SessionLink(self.session_path, self.timeout)
        maps = SegmentMaps()
        try:
            resp, fds = link.request(open_request(self.namespace, self.block_bytes, self.model_uid))
            opened = resp.opened
            maps.read_only = opened.read_only
            maps.update(opened.segments_version, opened.segments,
                        [s.segment_id for s in opened.segments], fds)
        except BaseException:
            link.close()
            maps.close()
            raise
        self._maps.close()
        self._maps = maps
        self._link = link
        self.token = opened.token
        self.daemon_version = opened.daemon_version
        self._metadata = ((SESSION_METADATA, self.token),)
        self._session_gen += 1

    def _lose_session(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    def _ensure_session(self) -> None:
        if self._closed:
            raise FailedPrecondition("kvtier.Client is closed")
        if self._link is not None:
            return
        self._backoff.check()
        try:
            self._open_session()
        except Unavailable as exc:
            self._backoff.failed(exc)
            raise
        self._backoff.succeeded()

    # ------------------------------------------------------------- plumbing
    def _call(self, method: str, request: Any, *, retry: bool = True) -> Any:
        """One RPC in the current session; reconnects once if the daemon restarted."""
        with self._lock:
            self._ensure_session()
            metadata = self._metadata
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
        if isinstance(err, (Unavailable, Unauthenticated)) and not isinstance(err, DeadlineExceeded):
            with self._lock:
                if self._metadata == metadata:  # nobody reconnected meanwhile
                    self._lose_session()
            if retry and isinstance(err, Unauthenticated) and method not in SESSION_BOUND:
                return self._call(method, request, retry=False)  # a restarted daemon
        raise err

    def _bound_call(self, method: str, request: Any, session_gen: int, what: str) -> Any:
        """A call carrying an id of session ``session_gen`` (commit/abort/release)."""
        if session_gen != self._session_gen:
            raise session_lost(what)
        try:
            return self._call(method, request, retry=False)
        except Unauthenticated:
            raise session_lost(what) from None

    def _send_release(self, lease_id: int) -> None:
        """Release without waiting for the answer; the previous one is reaped then."""
        fut = self._stub.Release.future(
            pb.ReleaseRequest(lease_id=lease_id), timeout=self.timeout, metadata=self._metadata)
        with self._lock:  # a load thread and the caller's may both release
            earlier, self._pending_release = self._pending_release, fut
        if earlier is not None:
            self._wait_release(earlier)

    def _reap_release(self) -> None:
        with self._lock:
            fut, self._pending_release = self._pending_release, None
        if fut is not None:
            self._wait_release(fut)

    @staticmethod
    def _wait_release(fut: Any) -> None:
        try:
            fut.result()
        except grpc.RpcError:
            pass  # the lease had already ended (expired, session lost): nothing to undo

    def _sync_maps(self, version: int, slots: Sequence[pb.SlotRef]) -> None:
        with self._lock:
            if self._closed:
                raise FailedPrecondition("kvtier.Client is closed")
            missing = self._maps.missing(s.segment_id for s in slots)
            if version == self._maps.version and not missing:
                return
            if self._link is None:
                raise Unavailable("the session ended while the call was in flight")
            resp, fds = self._link.request(map_request(missing))
            m = resp.mapped
            self._maps.update(m.segments_version, m.segments, m.fd_segment_ids, fds)

    # ------------------------------------------------------------- API
    def lookup(self, keys: Sequence[bytes], *, prefetch: bool = False) -> int:
        """Number of leading ``keys`` present in any tier.

        ``prefetch=True`` also starts promoting the hits below DRAM into DRAM
        in the background, so a following ``acquire``/``get`` finds them there.
        """
        req = pb.LookupRequest(keys=as_keys(keys), prefetch=prefetch)
        return int(self._call("Lookup", req).hits)

    def lookup_tiers(self, keys: Sequence[bytes], *, prefetch: bool = False) -> list[Tier]:
        """The tier of each leading present key (callers can decide whether loading pays)."""
        resp = self._call("Lookup", pb.LookupRequest(keys=as_keys(keys), prefetch=prefetch))
        return [Tier(t) for t in resp.tiers]

    def reserve(self, keys: Sequence[bytes]) -> Reservation:
        """Writable slots for the keys not present yet (a context manager)."""
        keys = as_keys(keys)
        resp = self._call("Reserve", pb.ReserveRequest(keys=keys))
        try:
            self._sync_maps(resp.segments_version, resp.slots)
            return Reservation(self, keys, resp)
        except BaseException:
            if resp.reservation_id:
                self._call("Abort", pb.AbortRequest(reservation_id=resp.reservation_id))
            raise

    def acquire(self, keys: Sequence[bytes]) -> Lease:
        """Lease the longest present prefix of ``keys`` for reading (a context manager)."""
        keys = as_keys(keys)
        resp = self._call("Acquire", pb.AcquireRequest(keys=keys))
        try:
            self._sync_maps(resp.segments_version, resp.slots)
            return Lease(self, keys, resp)
        except BaseException as exc:
            if resp.lease_id:
                self._call("Release", pb.ReleaseRequest(lease_id=resp.lease_id))
            if isinstance(exc, Corrupted):
                # Never served: the bad block becomes a miss and the daemon counts it.
                self._call("Delete", pb.DeleteRequest(keys=[exc.key], corrupted=True))
            raise

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> int:
        """Store each block under its key, skipping present keys; returns how many were stored."""
        keys = as_keys(keys)
        if len(keys) != len(blocks):
            raise InvalidArgument(f"keys and blocks differ in length ({len(keys)} != {len(blocks)})")
        views = [as_bytes_view(b, i, self.block_bytes) for i, b in enumerate(blocks)]
        with self.reserve(keys) as r:
            for i in r.reserved:
                r.write(i, views[i])
            return r.commit()

    def get(self, keys: Sequence[bytes], out: Sequence[Any] | None = None) -> list[np.ndarray]:
        """Copies of the blocks of the longest present prefix of ``keys``.

        With ``out`` (one writable buffer of at least ``block_bytes`` per key) the
        blocks are copied into those buffers and the results are views of them;
        otherwise new arrays are allocated.
        """
        check_out(keys, out)
        lease = self.acquire(keys)
        try:
            got = copy_out(lease.views, out)
        except BaseException:
            lease.release()
            raise
        lease.release(wait=False)
        return got

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many were present."""
        return int(self._call("Delete", pb.DeleteRequest(keys=as_keys(keys))).deleted)

    def stats(self) -> dict[str, Any]:
        """The daemon's statistics as a dict (see ``StatsResponse`` in the proto)."""
        resp = self._call("Stats", pb.StatsRequest())
        return MessageToDict(resp, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)

    def close(self) -> None:
        """End the session: the daemon releases its leases and aborts its reservations."""
        if self._closed:
            return
        self._reap_release()
        self._closed = True
        self._channel.close()
        self._lose_session()
        self._maps.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Client", "KeyStatus", "Lease", "Reservation", "Tier"]
