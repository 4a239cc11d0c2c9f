"""``kvtier.AsyncClient``: the asyncio client (same arguments and calls as ``Client``).

Open it with ``async with AsyncClient(...) as c`` (or ``await c.open()``).
The session channel is used rarely (open, extent changes) and is driven from
a worker thread so the event loop never blocks on it.
"""

from __future__ import annotations

import asyncio
import os
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

#: Copies and checksums of at least this many bytes run in a worker thread: the event
#: loop stays free for the caller's other work (smaller ones cost less than the hop).
OFFLOAD_BYTES = 256 << 10


def _write_all(r: ReservationState, views: Sequence[memoryview]) -> None:
    for i in r.reserved:
        r.write(i, views[i])


class AsyncReservation(ReservationState):
    """Like ``kvtier.Reservation``; ``await commit()``, ``async with`` aborts on exit."""

    def __init__(self, client: AsyncClient, keys: list[bytes], resp: pb.ReserveResponse) -> None:
        super().__init__(keys, resp, client._maps, client.block_bytes, client._session_gen)
        self._client = client

    async def commit(self) -> int:
        if self.done:
            return 0
        if self._client.checksum and self._nbytes() >= OFFLOAD_BYTES:
            req = await asyncio.to_thread(self.commit_request, True)  # hashing off the loop
        else:
            req = self.commit_request(self._client.checksum)
        try:
            resp = await self._client._bound_call("Commit", req, self.session_gen, "reservation")
        except SessionLost:
            self.done = True
            self.release_views()
            raise
        self.done = True
        self.release_views()
        return int(resp.committed)

    def _nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers if b is not None)

    async def abort(self) -> None:
        if self.done:
            return
        self.done = True
        self.release_views()
        await self._client._bound_call(
            "Abort", pb.AbortRequest(reservation_id=self.reservation_id), self.session_gen,
            "reservation")

    async def __aenter__(self) -> AsyncReservation:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: types.TracebackType | None) -> None:
        if not self.done:
            try:
                await self.abort()
            except KVTierError:
                if et is None:
                    raise


class AsyncLease(LeaseState):
    """Like ``kvtier.Lease``; released by ``async with`` exit or ``await release()``."""

    def __init__(self, client: AsyncClient, keys: list[bytes], resp: pb.AcquireResponse) -> None:
        self._client = client
        super().__init__(keys, resp, client._maps, client.checksum, client._session_gen)

    async def release(self) -> None:
        if self.done:
            return
        self.done = True
        self.release_views()
        await self._client._bound_call("Release", pb.ReleaseRequest(lease_id=self.lease_id),
                                       self.session_gen, "lease")

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: types.TracebackType | None) -> None:
        try:
            await self.release()
        except KVTierError:
            if et is None:
                raise


class AsyncClient:
    """The asyncio twin of ``kvtier.Client``."""

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
        self._maps = SegmentMaps()
        self._link: SessionLink | None = None
        self._channel: grpc.aio.Channel | None = None
        self._metadata: tuple[tuple[str, str], ...] = ()
        self._closed = False
        self._session_gen = 0
        self._backoff = Backoff(maximum=reconnect_max)
        self._session_lock: asyncio.Lock | None = None
        self._maps_lock: asyncio.Lock | None = None

    async def open(self) -> AsyncClient:
        """Open the session (idempotent)."""
        if self._channel is not None:
            return self
        await self._open_session()
        self._channel = grpc.aio.insecure_channel(f"unix:{self.grpc_path}", options=grpc_options())
        self._stub = pb_grpc.KVTierStub(self._channel)
        return self

    async def _open_session(self) -> None:
        link = await asyncio.to_thread(SessionLink, self.session_path, self.timeout)
        maps = SegmentMaps()

        def open_and_map() -> pb.SessionOpened:  # mmap + populate: off the event loop
            resp, fds = link.request(open_request(self.namespace, self.block_bytes,
                                                  self.model_uid))
            opened = resp.opened
            maps.read_only = opened.read_only
            maps.update(opened.segments_version, opened.segments,
                        [s.segment_id for s in opened.segments], fds)
            return opened

        try:
            opened = await asyncio.to_thread(open_and_map)
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

    async def _ensure_session(self) -> None:
        if self._closed:
            raise FailedPrecondition("kvtier.AsyncClient is closed")
        if self._channel is None:
            raise FailedPrecondition("AsyncClient is not open: use 'async with' or 'await open()'")
        if self._link is not None:
            return
        if self._session_lock is None:
            self._session_lock = asyncio.Lock()
        async with self._session_lock:
            if self._link is not None:
                return
            self._backoff.check()
            try:
                await self._open_session()
            except Unavailable as exc:
                self._backoff.failed(exc)
                raise
            self._backoff.succeeded()

    async def _call(self, method: str, request: Any, *, retry: bool = True) -> Any:
        """One RPC in the current session; reconnects once if the daemon restarted."""
        await self._ensure_session()
        metadata = self._metadata
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout,
                                                     metadata=metadata)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
        if isinstance(err, (Unavailable, Unauthenticated)) and not isinstance(err, DeadlineExceeded):
            if self._metadata == metadata:
                self._lose_session()
            if retry and isinstance(err, Unauthenticated) and method not in SESSION_BOUND:
                return await self._call(method, request, retry=False)
        raise err

    async def _bound_call(self, method: str, request: Any, session_gen: int, what: str) -> Any:
        if session_gen != self._session_gen:
            raise session_lost(what)
        try:
            return await self._call(method, request, retry=False)
        except Unauthenticated:
            raise session_lost(what) from None

    async def _sync_maps(self, version: int, slots: Sequence[pb.SlotRef]) -> None:
        if self._closed:
            raise FailedPrecondition("kvtier.AsyncClient is closed")
        missing = self._maps.missing(s.segment_id for s in slots)
        if version == self._maps.version and not missing:
            return
        if self._maps_lock is None:
            self._maps_lock = asyncio.Lock()
        async with self._maps_lock:  # one mapping update at a time
            missing = self._maps.missing(s.segment_id for s in slots)
            if version == self._maps.version and not missing:
                return
            link = self._link
            if link is None:
                raise Unavailable("the session ended while the call was in flight")
            maps = self._maps

            def map_missing() -> None:  # mmap + populate: off the event loop
                resp, fds = link.request(map_request(missing))
                m = resp.mapped
                maps.update(m.segments_version, m.segments, m.fd_segment_ids, fds)

            await asyncio.to_thread(map_missing)

    async def lookup(self, keys: Sequence[bytes], *, prefetch: bool = False) -> int:
        req = pb.LookupRequest(keys=as_keys(keys), prefetch=prefetch)
        return int((await self._call("Lookup", req)).hits)

    async def lookup_tiers(self, keys: Sequence[bytes], *, prefetch: bool = False) -> list[Tier]:
        req = pb.LookupRequest(keys=as_keys(keys), prefetch=prefetch)
        return [Tier(t) for t in (await self._call("Lookup", req)).tiers]

    async def reserve(self, keys: Sequence[bytes]) -> AsyncReservation:
        keys = as_keys(keys)
        resp = await self._call("Reserve", pb.ReserveRequest(keys=keys))
        try:
            await self._sync_maps(resp.segments_version, resp.slots)
            return AsyncReservation(self, keys, resp)
        except BaseException:
            if resp.reservation_id:
                await self._call("Abort",
                                 pb.AbortRequest(reservation_id=resp.reservation_id))
            raise

    async def acquire(self, keys: Sequence[bytes]) -> AsyncLease:
        keys = as_keys(keys)
        resp = await self._call("Acquire", pb.AcquireRequest(keys=keys))
        try:
            await self._sync_maps(resp.segments_version, resp.slots)
            if self.checksum and sum(r.length for r in resp.slots) >= OFFLOAD_BYTES:
                return await asyncio.to_thread(AsyncLease, self, keys, resp)  # verification
            return AsyncLease(self, keys, resp)
        except BaseException as exc:
            if resp.lease_id:
                await self._call("Release", pb.ReleaseRequest(lease_id=resp.lease_id))
            if isinstance(exc, Corrupted):
                await self._call("Delete",
                                 pb.DeleteRequest(keys=[exc.key], corrupted=True))
            raise

    async def put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> int:
        keys = as_keys(keys)
        if len(keys) != len(blocks):
            raise InvalidArgument(f"keys and blocks differ in length ({len(keys)} != {len(blocks)})")
        views = [as_bytes_view(b, i, self.block_bytes) for i, b in enumerate(blocks)]
        async with await self.reserve(keys) as r:
            if sum(views[i].nbytes for i in r.reserved) >= OFFLOAD_BYTES:
                await asyncio.to_thread(_write_all, r, views)  # the copies: off the loop
            else:
                _write_all(r, views)
            return await r.commit()

    async def get(self, keys: Sequence[bytes], out: Sequence[Any] | None = None
                  ) -> list[np.ndarray]:
        """Copies of the longest present prefix (into ``out`` when given), like ``Client.get``."""
        check_out(keys, out)
        async with await self.acquire(keys) as lease:
            if sum(v.nbytes for v in lease.views) >= OFFLOAD_BYTES:
                return await asyncio.to_thread(copy_out, lease.views, out)
            return copy_out(lease.views, out)

    async def delete(self, keys: Sequence[bytes]) -> int:
        resp = await self._call("Delete", pb.DeleteRequest(keys=as_keys(keys)))
        return int(resp.deleted)

    async def stats(self) -> dict[str, Any]:
        resp = await self._call("Stats", pb.StatsRequest())
        return MessageToDict(resp, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._channel is not None:
            await self._channel.close(None)
        self._lose_session()
        self._maps.close()

    async def __aenter__(self) -> AsyncClient:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
