"""``kvtier.Client``: the synchronous client.

Control goes over gRPC on a Unix socket; bytes never do: ``reserve`` hands
out writable numpy views of shared-memory slots and ``acquire`` read-only
ones.  Every call makes a fixed number of RPCs however many keys it carries
(``put``: Reserve + Commit; ``get``: Acquire + Release).
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from kvtier._core import (
    DEFAULT_TIMEOUT,
    SESSION_METADATA,
    KeyStatus,
    LeaseState,
    ReservationState,
    Tier,
    as_bytes_view,
    as_keys,
    grpc_options,
    socket_paths,
)
from kvtier._session import SegmentMaps, SessionLink, map_request, open_request
from kvtier.errors import (
    Corrupted,
    FailedPrecondition,
    InvalidArgument,
    KVTierError,
    from_rpc_error,
)
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

_Resp = TypeVar("_Resp")


class Reservation(ReservationState):
    """Writable slots for the keys of one ``reserve`` call.

    ``buffers[i]`` is a writable uint8 view of ``block_bytes`` for each key
    whose status is ``RESERVED`` (``None`` otherwise).  Write into it (or use
    ``write(i, data)``, which also records the length), then ``commit()``.
    Leaving the ``with`` block without committing aborts.
    """

    def __init__(self, client: Client, keys: list[bytes], resp: pb.ReserveResponse) -> None:
        super().__init__(keys, resp, client._maps, client.block_bytes)
        self._client = client

    def commit(self) -> int:
        """Make every reserved key visible (all or nothing); returns how many."""
        if self.done:
            return 0
        req = self.commit_request(self._client.checksum)
        resp = self._client._call(self._client._stub.Commit, req)
        self.done = True
        self.release_views()
        return int(resp.committed)

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        self.release_views()
        self._client._call(self._client._stub.Abort, pb.AbortRequest(reservation_id=self.reservation_id))

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
    """Read-only views of the leased leading prefix; released on exit."""

    def __init__(self, client: Client, keys: list[bytes], resp: pb.AcquireResponse) -> None:
        self._client = client
        self.lease_id = resp.lease_id
        super().__init__(keys, resp, client._maps, client.checksum)

    def release(self) -> None:
        if self.done:
            return
        self.done = True
        self.release_views()
        self._client._call(self._client._stub.Release, pb.ReleaseRequest(lease_id=self.lease_id))

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
    ) -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise InvalidArgument(f"block_bytes must be a positive int, got {block_bytes!r}")
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.model_uid = model_uid
        self.timeout = timeout
        self.checksum = checksum
        self.grpc_path, self.session_path = socket_paths(socket)
        self._maps = SegmentMaps()
        self._link = SessionLink(self.session_path, timeout)
        try:
            resp, fds = self._link.request(open_request(namespace, block_bytes, model_uid))
            opened = resp.opened
            self._maps.update(opened.segments_version, opened.segments,
                              [s.segment_id for s in opened.segments], fds)
        except BaseException:
            self._link.close()
            raise
        self.token = opened.token
        self.daemon_version = opened.daemon_version
        self._metadata = ((SESSION_METADATA, self.token),)
        self._channel = grpc.insecure_channel(f"unix:{self.grpc_path}", options=grpc_options())
        self._stub = pb_grpc.KVTierStub(self._channel)
        self._closed = False

    # ------------------------------------------------------------- plumbing
    def _call(self, method: Callable[..., _Resp], request: Any) -> _Resp:
        if self._closed:
            raise FailedPrecondition("kvtier.Client is closed")
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def _sync_maps(self, version: int, slots: Sequence[pb.SlotRef]) -> None:
        if self._closed:
            raise FailedPrecondition("kvtier.Client is closed")
        missing = self._maps.missing(s.segment_id for s in slots)
        if version == self._maps.version and not missing:
            return
        resp, fds = self._link.request(map_request(missing))
        m = resp.mapped
        self._maps.update(m.segments_version, m.segments, m.fd_segment_ids, fds)

    # ------------------------------------------------------------- API
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` present; no side effects."""
        return int(self._call(self._stub.Lookup, pb.LookupRequest(keys=as_keys(keys))).hits)

    def lookup_tiers(self, keys: Sequence[bytes]) -> list[Tier]:
        """The tier of each leading present key (callers can decide whether loading pays)."""
        resp = self._call(self._stub.Lookup, pb.LookupRequest(keys=as_keys(keys)))
        return [Tier(t) for t in resp.tiers]

    def reserve(self, keys: Sequence[bytes]) -> Reservation:
        """Writable slots for the keys not present yet (a context manager)."""
        keys = as_keys(keys)
        resp = self._call(self._stub.Reserve, pb.ReserveRequest(keys=keys))
        try:
            self._sync_maps(resp.segments_version, resp.slots)
            return Reservation(self, keys, resp)
        except BaseException:
            if resp.reservation_id:
                self._call(self._stub.Abort, pb.AbortRequest(reservation_id=resp.reservation_id))
            raise

    def acquire(self, keys: Sequence[bytes]) -> Lease:
        """Lease the longest present prefix of ``keys`` for reading (a context manager)."""
        keys = as_keys(keys)
        resp = self._call(self._stub.Acquire, pb.AcquireRequest(keys=keys))
        try:
            self._sync_maps(resp.segments_version, resp.slots)
            return Lease(self, keys, resp)
        except BaseException as exc:
            if resp.lease_id:
                self._call(self._stub.Release, pb.ReleaseRequest(lease_id=resp.lease_id))
            if isinstance(exc, Corrupted):
                # Never served: the bad block becomes a miss and the daemon counts it.
                self._call(self._stub.Delete, pb.DeleteRequest(keys=[exc.key], corrupted=True))
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

    def get(self, keys: Sequence[bytes]) -> list[np.ndarray]:
        """Copies of the blocks of the longest present prefix of ``keys``."""
        with self.acquire(keys) as lease:
            return [v.copy() for v in lease.views]

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many were present."""
        return int(self._call(self._stub.Delete, pb.DeleteRequest(keys=as_keys(keys))).deleted)

    def stats(self) -> dict[str, Any]:
        """The daemon's statistics as a dict (see ``StatsResponse`` in the proto)."""
        resp = self._call(self._stub.Stats, pb.StatsRequest())
        return MessageToDict(resp, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)

    def close(self) -> None:
        """End the session: the daemon releases its leases and aborts its reservations."""
        if self._closed:
            return
        self._closed = True
        self._channel.close()
        self._link.close()
        self._maps.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Client", "KeyStatus", "Lease", "Reservation", "Tier"]
