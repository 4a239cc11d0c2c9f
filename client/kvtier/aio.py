"""``kvtier.AsyncClient``: the asyncio client (same arguments and calls as ``Client``).

Open it with ``async with AsyncClient(...) as c`` (or ``await c.open()``).
What every call does is written once in ``kvtier._core`` (shared with
``Client``); this module is the transport that runs it without blocking the
event loop: calls go as FastCalls on the session connection, which the loop
reads (``AsyncSessionLink``), when the daemon offers it, else over
``grpc.aio``; opening the session and mapping segments (mmap, page-table
population) run on a worker thread, and so do copies and checksums of
``OFFLOAD_BYTES`` or more.
"""

from __future__ import annotations

import asyncio
import os
import types
from collections.abc import AsyncIterable, Collection, Iterable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc
import numpy as np

from kvtier._core import (
    DEFAULT_TIMEOUT,
    OFFLOAD_BYTES,
    Call,
    ClientCore,
    CommitHere,
    Finish,
    GrantHere,
    LeaseState,
    LocalAcquire,
    LocalReserve,
    LookHere,
    Metadata,
    Next,
    ReservationState,
    SendRelease,
    Start,
    Step,
    Steps,
    SyncMaps,
    Tier,
    Work,
    arun_steps,
    grpc_options,
)
from kvtier._session import AsyncSessionLink, map_request
from kvtier._shared_answers import SharedMemoryAnswers
from kvtier.errors import FailedPrecondition, KVTierError, Unavailable
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

_T = TypeVar("_T")


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class AsyncReservation(ReservationState):
    """Like ``kvtier.Reservation``; ``await commit()``, ``async with`` aborts on exit."""

    _client: AsyncClient

    async def commit(self) -> int:
        return await self._client._run(self._commit_steps())

    async def abort(self) -> None:
        await self._client._run(self._abort_steps())

    async def __aenter__(self) -> AsyncReservation:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: types.TracebackType | None) -> None:
        await self._client._run(self._exit_steps(et))


class AsyncLease(LeaseState):
    """Like ``kvtier.Lease``; released by ``async with`` exit or ``await release()``."""

    _client: AsyncClient

    async def release(self) -> None:
        await self._client._run(self._release_steps(wait=True))

    async def drop_corrupted(self, bad: Sequence[int]) -> NoReturn:
        """As ``Lease.drop_corrupted``: release, delete blocks ``bad``, raise ``Corrupted``."""
        await self._client._run(self._drop_corrupted_steps(bad))

    async def drop_gone(self, i: int) -> None:
        """As ``Lease.drop_gone``: release, delete block ``i`` (its memory was gone)."""
        await self._client._run(self._drop_gone_steps(i))

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: types.TracebackType | None) -> None:
        await self._client._run(self._exit_steps(et))


class AsyncClient(ClientCore[AsyncReservation, AsyncLease]):
    """The asyncio twin of ``kvtier.Client`` (the fault guard included).  A write
    whose slot lost its memory raises ``FailedPrecondition``; its reservation is
    aborted by ``commit`` (which raises it again) or by leaving ``async with``."""

    _NAME = "kvtier.AsyncClient"

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
        fast_path: bool | None = None,
    ) -> None:
        super().__init__(socket, namespace=namespace, block_bytes=block_bytes,
                         model_uid=model_uid, timeout=timeout, checksum=checksum,
                         reconnect_max=reconnect_max, fast_path=fast_path)
        #: Lookups, acquires, reserves and commits without a call, where they can.
        self._shared = SharedMemoryAnswers(self)
        self._alink: AsyncSessionLink | None = None
        self._channel: grpc.aio.Channel | None = None
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

    def _new_reservation(self, keys: list[bytes], resp: pb.ReserveResponse | LocalReserve) -> AsyncReservation:
        return AsyncReservation(self, keys, resp)

    def _new_lease(self, keys: list[bytes], resp: pb.AcquireResponse | LocalAcquire,
                   verify: bool) -> AsyncLease:
        return AsyncLease(self, keys, resp, verify)

    # ------------------------------------------------------------- transport
    async def _run(self, steps: Steps[_T]) -> _T:
        return await arun_steps(steps, self._do)

    async def _do(self, step: Step) -> Any:
        if isinstance(step, Call):
            return await self._call(step.method, step.request, retry=step.retry)
        if isinstance(step, SyncMaps):
            await self._sync_maps(step.version, step.segment_ids)
        elif isinstance(step, Work):
            if step.nbytes >= OFFLOAD_BYTES:
                return await asyncio.to_thread(step.fn)  # the copies: off the loop
            return step.fn()
        elif isinstance(step, LookHere):
            await self._ensure_session()
            if self._shared.index_stale():
                await self._refresh_index()
            return self._shared.answer(step)
        elif isinstance(step, GrantHere):
            await self._ensure_session()
            return self._shared.grant(step.keys)
        elif isinstance(step, CommitHere):
            return await asyncio.to_thread(self._shared.commit, step)  # waits for the daemon
        elif isinstance(step, Start):
            task = asyncio.ensure_future(self._do(step.step))
            # Finish awaits it; this only keeps an error left behind by a cancelled
            # caller from being reported as never retrieved.
            task.add_done_callback(_retrieve)
            return task
        elif isinstance(step, Finish):
            return await step.handle
        elif isinstance(step, Next):
            items = step.items
            if hasattr(items, "__anext__"):
                try:
                    return await items.__anext__()
                except StopAsyncIteration:
                    return None
            return next(items, None)
        elif isinstance(step, SendRelease):
            alink = self._alink
            if alink is not None and alink.fast_path:
                try:  # no_reply: nothing to wait for
                    await alink.cast("Release", pb.ReleaseRequest(lease_id=step.lease_id))
                except KVTierError:
                    pass  # the session ended: so did its leases
                return None
            # over gRPC, awaited: no thread to leave the answer to
            await self._run(self._bound_call("Release", pb.ReleaseRequest(lease_id=step.lease_id),
                                             self._session_gen, "lease"))
        return None

    async def _open_session(self) -> None:
        self._adopt(await asyncio.to_thread(self._connect))  # mmap + populate: off the loop
        assert self._link is not None
        # From here on the loop reads the connection (calls, segment fds).
        self._alink = AsyncSessionLink(self._link, asyncio.get_running_loop())

    def _lose_session(self) -> None:
        super()._lose_session()  # (closing the link unregisters it from the loop)
        self._alink = None

    def _check_usable(self) -> None:
        super()._check_usable()
        if self._channel is None:
            raise FailedPrecondition("AsyncClient is not open: use 'async with' or 'await open()'")

    async def _ensure_session(self) -> Metadata:
        self._check_usable()
        if self._link is None:
            if self._session_lock is None:
                self._session_lock = asyncio.Lock()
            async with self._session_lock:
                if self._link is None:
                    with self._backoff.attempt():
                        await self._open_session()
        return self._metadata

    async def _call(self, method: str, request: Any, *, retry: bool = True) -> Any:
        """One call in the current session (a FastCall when the daemon offers it, else
        gRPC); reconnects once if the daemon restarted."""
        metadata = await self._ensure_session()
        alink = self._alink
        if alink is not None and alink.fast_path and request.ByteSize() <= alink.max_call_bytes:
            try:
                return await alink.call(method, request, self.timeout)
            except KVTierError as exc:
                err = self._failed(method, metadata, exc, retry)
        else:
            try:
                return await getattr(self._stub, method)(request, timeout=self.timeout,
                                                         metadata=metadata)
            except grpc.RpcError as exc:
                err = self._failed(method, metadata, exc, retry)
        if err is not None:
            raise err
        return await self._call(method, request, retry=False)

    async def _refresh_index(self) -> None:
        """Map the table that replaced the shared index (one mapping update at a time)."""
        if self._maps_lock is None:
            self._maps_lock = asyncio.Lock()
        async with self._maps_lock:
            alink = self._alink
            if not self._shared.index_stale() or alink is None:
                return
            try:
                resp, fds = await alink.request(map_request([], index=True))
            except KVTierError:
                return  # the session ended: the call that follows says so
            self._maps.mapped(resp, fds, asked_index=True)

    async def _sync_maps(self, version: int, segment_ids: Collection[int]) -> None:
        if self._maps_missing(version, segment_ids) is None:
            return
        if self._maps_lock is None:
            self._maps_lock = asyncio.Lock()
        async with self._maps_lock:  # one mapping update at a time
            missing = self._maps_missing(version, segment_ids)
            if missing is None:
                return
            if self._maps.unmappable(missing):  # fds kept: map them again, off the loop
                await asyncio.to_thread(self._maps.retry, missing)
            ask = self._maps.to_ask(missing)
            if not ask and version == self._maps.version:
                return  # what still cannot be mapped is the operation's miss
            alink = self._alink
            if alink is None:
                raise Unavailable("the session ended while the call was in flight")
            resp, fds = await alink.request(map_request(ask))
            # mmap + populate: off the loop
            await asyncio.to_thread(self._maps.mapped, resp, fds)

    # ------------------------------------------------------------- API (as Client's)
    async def lookup(self, keys: Sequence[bytes], *, prefetch: bool = False) -> int:
        here = self._shared.look(keys)  # the shared index's answer, when it is final
        if here is not None and here[1]:
            return len(here[0])
        return await self._run(self._lookup_steps(keys, prefetch, here))

    async def lookup_tiers(self, keys: Sequence[bytes], *, prefetch: bool = False) -> list[Tier]:
        here = self._shared.look(keys)
        if here is not None and here[1]:
            return [Tier(t) for t in here[0]]
        return await self._run(self._lookup_tiers_steps(keys, prefetch, here))

    async def reserve(self, keys: Sequence[bytes]) -> AsyncReservation:
        return await self._run(self._reserve_steps(keys))

    async def acquire(self, keys: Sequence[bytes], *, verify: bool = True) -> AsyncLease:
        """As ``Client.acquire``: ``verify=False`` leaves the checksums to the caller."""
        return await self._run(self._acquire_steps(keys, verify))

    async def put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> int:
        """As ``Client.put`` (in batches past ``put_batch_bytes`` * 2, each all or nothing)."""
        return await self._run(self._put_steps(keys, blocks))

    async def put_many(self, items: Iterable[tuple[Sequence[bytes], Sequence[Any]]]
                       | AsyncIterable[tuple[Sequence[bytes], Sequence[Any]]]) -> int:
        """As ``Client.put_many``; ``items`` may also be an async iterable."""
        it = items.__aiter__() if isinstance(items, AsyncIterable) else iter(items)
        return await self._run(self._put_many_steps(it))

    async def get(self, keys: Sequence[bytes], out: Sequence[Any] | None = None
                  ) -> list[np.ndarray]:
        """Copies of the longest present prefix (into ``out`` when given), like ``Client.get``."""
        return await self._run(self._get_steps(keys, out))

    async def delete(self, keys: Sequence[bytes]) -> int:
        return await self._run(self._delete_steps(keys))

    async def stats(self) -> dict[str, Any]:
        return await self._run(self._stats_steps())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._channel is not None:
            await self._channel.close(None)
        self._close_session()

    async def __aenter__(self) -> AsyncClient:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
