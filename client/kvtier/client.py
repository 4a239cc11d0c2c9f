"""``kvtier.Client``: the synchronous client.

Control goes over gRPC on a Unix socket; bytes never do: ``reserve`` hands
out writable numpy views of shared-memory slots and ``acquire`` read-only
ones.  Every call makes a fixed number of RPCs however many keys it carries
(``put``: Reserve + Commit per batch, at most ``put_max_batches``; ``get``:
Acquire + Release).

What every call does is written once in ``kvtier._core`` (shared with
``AsyncClient``); this module is the blocking transport that runs it.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc
import numpy as np

from kvtier._core import (
    DEFAULT_TIMEOUT,
    Call,
    ClientCore,
    CommitHere,
    Finish,
    GrantHere,
    KeyStatus,
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
    grpc_options,
    run_steps,
)
from kvtier._shared_answers import SharedMemoryAnswers
from kvtier.errors import KVTierError
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

_T = TypeVar("_T")


class Reservation(ReservationState):
    """Writable slots for the keys of one ``reserve`` call.

    ``buffers[i]`` is a writable uint8 view of ``block_bytes`` for each key
    whose status is ``RESERVED`` (``None`` otherwise).  Write into it (or use
    ``write(i, data)``, which also records the length), then ``commit()``.
    Leaving the ``with`` block without committing aborts.  If the daemon
    restarted meanwhile, ``commit()`` raises ``SessionLost`` (nothing was
    committed; write again).  A write whose slot lost its memory (its data
    file was truncated) raises ``FailedPrecondition`` and aborts the
    reservation at once.
    """

    _client: Client

    def _on_fault(self) -> None:
        try:
            self._client._run(self._abort_steps())
        except KVTierError:
            pass  # the session ended: so did the reservation

    def commit(self) -> int:
        """Make every reserved key visible (all or nothing); returns how many."""
        return self._client._run(self._commit_steps())

    def abort(self) -> None:
        self._client._run(self._abort_steps())

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        self._client._run(self._exit_steps(et))


class Lease(LeaseState):
    """Read-only views of the leased leading prefix; released on exit.

    If the daemon restarted while the lease was held, ``release()`` raises
    ``SessionLost``: the lease was not honoured to the end, so what the views
    showed after the restart is not guaranteed.
    """

    _client: Client

    def release(self, *, wait: bool = True) -> None:
        """End the lease.  ``wait=False`` sends the Release without waiting for its
        answer (one RPC round trip off the read path); the views are gone either way,
        and a failure then can only mean the lease had already ended."""
        self._client._run(self._release_steps(wait))

    def drop_corrupted(self, bad: Sequence[int]) -> NoReturn:
        """Blocks ``bad`` (indices into ``views``) failed their checksum at the reader.

        For a lease from ``acquire(verify=False)``: ends the lease, deletes
        those blocks as corrupted (the daemon counts them; later calls miss
        there) and raises ``Corrupted`` naming the first, as ``acquire`` does.
        """
        self._client._run(self._drop_corrupted_steps(bad))

    def drop_gone(self, i: int) -> None:
        """The caller's guarded copy of block ``i`` (an index into ``views``) faulted:
        its slot memory was gone (``kvtier._accel.is_memory_fault``).

        Ends the lease (not waiting for the answer) and deletes that block as
        corrupted, best effort; the caller treats the blocks from ``i`` on as a
        miss (recomputes them).  Raises only InvalidArgument, for an ``i`` not
        in the lease.
        """
        self._client._run(self._drop_gone_steps(i))

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        self._client._run(self._exit_steps(et))


class Client(ClientCore[Reservation, Lease]):
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
    Threads may share one client.

    Calls go on the session connection (the fast path) when the daemon offers
    it (``server.fast_path``), else over gRPC; ``fast_path=False`` (or
    ``KVTIER_FAST_PATH=0`` in the environment) always uses gRPC.

    Creating a client installs the fault guard (``kvtier._accel``; chained to
    any SIGBUS handler installed before, e.g. ``faulthandler``'s: enable that
    first; ``KVTIER_FAULT_GUARD=0`` opts out), and the client's own copies
    and checksums of slot memory run under it: when a writer of the
    namespace truncates a data file, ``get``/``acquire`` return the blocks
    before the one whose memory is gone (a miss from there on; that block
    is deleted as corrupted) and writes raise ``FailedPrecondition`` with
    their reservation aborted, instead of the process dying of SIGBUS.
    Reading ``Lease.views`` or writing ``Reservation.buffers`` yourself is
    not guarded: copy them with ``kvtier._accel`` helpers to be.
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
        fast_path: bool | None = None,
    ) -> None:
        super().__init__(socket, namespace=namespace, block_bytes=block_bytes,
                         model_uid=model_uid, timeout=timeout, checksum=checksum,
                         reconnect_max=reconnect_max, fast_path=fast_path)
        #: Lookups, acquires, reserves and commits without a call, where they can.
        self._shared = SharedMemoryAnswers(self)
        self._pending_release: grpc.Future[Any] | None = None
        self._adopt(self._connect())
        self._channel = grpc.insecure_channel(f"unix:{self.grpc_path}",
                                              options=grpc_options())
        self._stub = pb_grpc.KVTierStub(self._channel)

    def _new_reservation(self, keys: list[bytes], resp: pb.ReserveResponse | LocalReserve) -> Reservation:
        return Reservation(self, keys, resp)

    def _new_lease(self, keys: list[bytes], resp: pb.AcquireResponse | LocalAcquire,
                   verify: bool) -> Lease:
        return Lease(self, keys, resp, verify)

    # ------------------------------------------------------------- transport
    def _run(self, steps: Steps[_T]) -> _T:
        return run_steps(steps, self._do)

    def _do(self, step: Step) -> Any:
        if isinstance(step, Call):
            return self._call(step.method, step.request, retry=step.retry)
        if isinstance(step, SyncMaps):
            self._sync_maps(step.version, step.segment_ids)
        elif isinstance(step, Work):
            return step.fn()  # copies and checksums release the GIL
        elif isinstance(step, SendRelease):
            self._send_release(step.lease_id)
        elif isinstance(step, LookHere):
            self._ensure_session()
            if self._shared.index_stale():
                with self._lock:
                    if self._shared.index_stale() and self._link is not None:
                        try:
                            self._maps.fetch(self._link, [], index=True)
                        except KVTierError:
                            return None  # the session ended: the call that follows says so
            return self._shared.answer(step)
        elif isinstance(step, GrantHere):
            self._ensure_session()
            return self._shared.grant(step.keys)
        elif isinstance(step, CommitHere):
            return self._shared.commit(step)  # waits for the daemon, GIL released
        elif isinstance(step, Start):
            return self._start(step.step)
        elif isinstance(step, Finish):
            return step.handle()
        elif isinstance(step, Next):
            return next(step.items, None)
        return None

    def _start(self, step: Call | CommitHere) -> Callable[[], Any]:
        """Begin a commit through the page or a session-bound call without waiting;
        the function that waits for its answer (``Finish``)."""
        if isinstance(step, CommitHere):
            return functools.partial(self._shared.commit_wait, self._shared.commit_start(step))
        assert not step.retry, "only a call never retried in a new session is started"
        method, request = step.method, step.request
        metadata = self._ensure_session()
        link = self._link

        def failed(exc: grpc.RpcError | KVTierError) -> KVTierError:
            err = self._failed(method, metadata, exc, retry=False)
            assert err is not None  # (never retried)
            return err

        if link is not None and link.fast_path and request.ByteSize() <= link.max_call_bytes:
            try:
                call_id = link.send_call(method, request, self.timeout)
            except KVTierError as exc:
                raise failed(exc) from None

            def answer() -> Any:
                try:
                    return link.wait_call(method, call_id, self.timeout)
                except KVTierError as exc:
                    raise failed(exc) from None
            return answer
        fut = getattr(self._stub, method).future(request, timeout=self.timeout,
                                                 metadata=metadata)

        def result() -> Any:
            try:
                return fut.result()
            except grpc.RpcError as exc:
                raise failed(exc) from None
        return result

    def _ensure_session(self) -> Metadata:
        with self._lock:
            self._check_usable()
            if self._link is None:
                with self._backoff.attempt():
                    self._adopt(self._connect())
            return self._metadata

    def _call(self, method: str, request: Any, *, retry: bool = True) -> Any:
        """One call in the current session (a FastCall on the session channel when the
        daemon offers it, else gRPC); reconnects once if the daemon restarted."""
        metadata = self._ensure_session()
        link = self._link
        if link is not None and link.fast_path and request.ByteSize() <= link.max_call_bytes:
            try:
                return link.call(method, request, self.timeout)
            except KVTierError as exc:
                err = self._failed(method, metadata, exc, retry)
        else:
            try:
                return getattr(self._stub, method)(request, timeout=self.timeout,
                                                   metadata=metadata)
            except grpc.RpcError as exc:
                err = self._failed(method, metadata, exc, retry)
        if err is not None:
            raise err
        return self._call(method, request, retry=False)  # a restarted daemon

    def _sync_maps(self, version: int, segment_ids: Collection[int]) -> None:
        with self._lock:
            missing = self._maps_missing(version, segment_ids)
            if missing is not None:
                self._maps.fetch(self._live_link(), missing, version=version)

    def _send_release(self, lease_id: int) -> None:
        """Release without waiting for the answer; the previous one is reaped then."""
        link = self._link
        if link is not None and link.fast_path:
            try:
                link.cast("Release", pb.ReleaseRequest(lease_id=lease_id))
            except KVTierError:
                pass  # the session ended: so did its leases
            return
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

    # ------------------------------------------------------------- API
    def lookup(self, keys: Sequence[bytes], *, prefetch: bool = False) -> int:
        """Number of leading ``keys`` present in any tier.

        ``prefetch=True`` also starts promoting the hits below DRAM into DRAM
        in the background, so a following ``acquire``/``get`` finds them there.
        """
        here = self._shared.look(keys)  # the shared index's answer, when it is final
        if here is not None and here[1]:
            return len(here[0])
        return self._run(self._lookup_steps(keys, prefetch, here))

    def lookup_tiers(self, keys: Sequence[bytes], *, prefetch: bool = False) -> list[Tier]:
        """The tier of each leading present key (callers can decide whether loading pays)."""
        here = self._shared.look(keys)
        if here is not None and here[1]:
            return [Tier(t) for t in here[0]]
        return self._run(self._lookup_tiers_steps(keys, prefetch, here))

    def reserve(self, keys: Sequence[bytes]) -> Reservation:
        """Writable slots for the keys not present yet (a context manager)."""
        return self._run(self._reserve_steps(keys))

    def acquire(self, keys: Sequence[bytes], *, verify: bool = True) -> Lease:
        """Lease the longest present prefix of ``keys`` for reading (a context manager).

        With ``checksum=True`` each block is checked against the checksum its
        writer committed, and one that fails raises ``Corrupted`` (the block is
        deleted: a later call misses there).  ``verify=False`` skips that check
        for a caller that hashes the blocks while copying them (one pass over
        the bytes, not two; ``_accel.scatter_hash``): it compares with
        ``lease.checksums`` and reports failures with ``lease.drop_corrupted``.
        """
        return self._run(self._acquire_steps(keys, verify))

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> int:
        """Store each block under its key, skipping present keys; returns how many were stored.

        A put of less than ``put_batch_bytes`` * 2 is one batch: all or nothing.  A
        larger one is cut into up to ``put_max_batches`` batches, stored in key
        order, each all or nothing, the copy of each overlapping the commit of the
        one before; on an error the batches before the failing one stay stored
        (a leading run of ``keys``: what a lookup of them finds), the others are
        not, and the error's ``stored`` says how many keys were.  It returns (or
        raises) once every commit it sent has answered.
        """
        return self._run(self._put_steps(keys, blocks))

    def put_many(self, items: Iterable[tuple[Sequence[bytes], Sequence[Any]]]) -> int:
        """``put`` of each (keys, blocks) of ``items`` in turn, as one stream: the next
        item is read and copied while the commit of the one before is in flight.
        Each batch is all or nothing and they are stored in order; on an error
        nothing more is read from ``items``, what was stored stays (the error's
        ``stored`` says how many keys) and the rest is not.  Returns how many keys
        were stored, once every commit has answered."""
        return self._run(self._put_many_steps(iter(items)))

    def get(self, keys: Sequence[bytes], out: Sequence[Any] | None = None) -> list[np.ndarray]:
        """Copies of the blocks of the longest present prefix of ``keys``.

        With ``out`` (one writable buffer of at least ``block_bytes`` per key) the
        blocks are copied into those buffers and the results are views of them;
        otherwise new arrays are allocated.
        """
        return self._run(self._get_steps(keys, out))

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many were present."""
        return self._run(self._delete_steps(keys))

    def stats(self) -> dict[str, Any]:
        """The daemon's statistics as a dict (see ``StatsResponse`` in the proto)."""
        return self._run(self._stats_steps())

    def close(self) -> None:
        """End the session: the daemon releases its leases and aborts its reservations."""
        if self._closed:
            return
        self._reap_release()
        self._closed = True
        self._channel.close()
        self._close_session()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Client", "KeyStatus", "Lease", "Reservation", "Tier"]
