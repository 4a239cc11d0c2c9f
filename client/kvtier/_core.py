"""The one client core under ``kvtier.Client`` and ``kvtier.AsyncClient``.

Everything but the transport lives here, once: argument validation, request
building, response decoding, segment mappings and the views over them,
checksums, error mapping, session loss and reconnect pacing.  Each operation
(``lookup``, ``reserve``, ``commit``, ``acquire``, ``put``, ``get``...) is
written once, as a generator of *steps* that says what to do and receives
the results:

* :class:`Call` -- one RPC in the current session (the transport opens or
  reopens the session first and maps a failure with ``ClientCore._failed``);
* :class:`SyncMaps` -- map the segments a response's slots live in;
* :class:`Work` -- copies and checksums of ``nbytes`` of shared memory;
* :class:`SendRelease` -- end a lease without waiting for the answer.

``Client`` runs the steps with :func:`run_steps` on blocking gRPC (Work
inline, SendRelease as a gRPC future); ``AsyncClient`` with
:func:`arun_steps` on ``grpc.aio`` (Work of :data:`OFFLOAD_BYTES` or more on
a worker thread, SendRelease awaited).  That, opening the session and the
mapping locks are all each transport keeps of its own.  (psycopg 3 generates
its sync connection from the async one with a script; steps give the same
one core without generated code.)

Slot memory can vanish under a copy: any writer of a namespace can truncate
the data files every client of it maps (the daemon's audit sets them back
within seconds), and the daemon cuts a retired extent's file to 0.  The
client installs the fault guard (``kvtier._accel``) and touches slots only
through its guarded helpers, so a fault is an outcome here, not a SIGBUS: a
read whose block's memory is gone misses from that block on (the block is
deleted as corrupted, as a checksum failure is, and recomputed by the
caller), a write into such a slot aborts its reservation and raises
``FailedPrecondition`` (``put`` first tries once more through a Reserve call
when the slot was granted ahead).  A segment whose fd arrives but cannot be
mapped is kept unmapped (``SegmentMaps``) and only matters to an operation
that needs it: a read misses there, a write goes elsewhere or fails as above.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import enum
import functools
import os
import threading
import time
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Generator,
    Iterable,
    Iterator,
    Sequence,
)
from typing import Any, Final, Generic, NoReturn, TypeAlias, TypeVar

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from kvtier import _accel, _index
from kvtier._index import (
    CommitColumns,
    LocalIndex,
    LocalSlot,
    LocalWrites,
    TakenGrants,
)
from kvtier._paths import GRPC_SOCKET_NAME, SESSION_SOCKET_NAME, default_socket_dir
from kvtier._session import LinkBroken, SegmentMaps, SessionLink, open_request
from kvtier._wire import SESSION_METADATA
from kvtier.errors import (
    Corrupted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVTierError,
    NotFound,
    SessionLost,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from kvtier.v1 import kvtier_pb2 as pb

#: Default per-call deadline: long enough for an extent growth that
#: pre-faults hundreds of MiB, short enough that a dead daemon is noticed.
DEFAULT_TIMEOUT = 30.0
#: Client-side gRPC message limit (responses of big batches stay far below).
MAX_MESSAGE_BYTES = 64 << 20
#: AsyncClient runs copies and checksums of at least this many bytes on a worker
#: thread: the event loop stays free for the caller's other work (smaller ones
#: cost less than the hop).
OFFLOAD_BYTES = 256 << 10

Metadata: TypeAlias = tuple[tuple[str, str], ...]


class KeyStatus(enum.IntEnum):
    """Outcome of ``reserve`` for one key."""

    RESERVED = pb.RESERVE_STATUS_RESERVED  # a writable buffer is yours
    EXISTS = pb.RESERVE_STATUS_EXISTS  # already committed: nothing to write
    IN_FLIGHT = pb.RESERVE_STATUS_IN_FLIGHT  # another writer holds it now


class Tier(enum.IntEnum):
    DRAM = pb.TIER_DRAM
    SSD = pb.TIER_SSD
    SHARED = pb.TIER_SHARED
    CLUSTER = pb.TIER_CLUSTER


class Backoff:
    """Reconnect pacing: exponential from ``initial`` to ``maximum`` seconds.

    While waiting, calls fail fast with ``Unavailable`` instead of hanging.
    """

    def __init__(self, initial: float = 0.05, maximum: float = 5.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self._delay = 0.0
        self._next = 0.0
        self._last_error = ""

    def check(self) -> None:
        wait = self._next - time.monotonic()
        if wait > 0:
            raise Unavailable(f"kvtierd is unavailable ({self._last_error}); "
                              f"next reconnect attempt in {wait:.2f} s")

    def failed(self, exc: BaseException) -> None:
        self._delay = min(max(self._delay * 2, self.initial), self.maximum)
        self._next = time.monotonic() + self._delay
        self._last_error = str(exc)

    def succeeded(self) -> None:
        self._delay = 0.0
        self._next = 0.0

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """Around one reconnect: fail fast while waiting, then record how it went."""
        self.check()
        try:
            yield
        except Unavailable as exc:
            self.failed(exc)
            raise
        self.succeeded()


def corrupted(key: bytes) -> Corrupted:
    """The error for a block that failed its checksum (the lease's, or its reader's)."""
    return Corrupted(f"block {key.hex()} failed its checksum", key=key)


def session_lost(what: str) -> SessionLost:
    return SessionLost(f"{what} was lost: its session ended "
                       "(kvtierd restarted or the session connection dropped)")


#: Calls that carry ids of the session that issued them: never retried in a new one.
SESSION_BOUND = frozenset({"Commit", "Abort", "Release"})
#: ``KVTIER_FAST_PATH=0`` makes clients built without a ``fast_path`` argument use gRPC.
FAST_PATH_ENV = "KVTIER_FAST_PATH"
#: ``KVTIER_LOCAL_LEASES=0`` makes acquires (and gets) call the daemon even where the
#: shared index could lease their blocks without a call (docs/decisions.md).
LOCAL_LEASES_ENV = "KVTIER_LOCAL_LEASES"
#: ``KVTIER_LOCAL_WRITES=0`` makes reserves (and puts) call Reserve even where the
#: daemon grants slots ahead for writes without a call (csrc/writes.c).
LOCAL_WRITES_ENV = "KVTIER_LOCAL_WRITES"
_OFF = frozenset({"0", "false", "no", "off"})
#: KeyStatus by value (a dict lookup: calling the enum costs ~1 us a key).
_KEY_STATUS: Final = {int(s): s for s in KeyStatus}


def socket_paths(socket: str | os.PathLike[str] | None) -> tuple[str, str]:
    """(gRPC socket, session socket) from a socket directory or gRPC socket path."""
    path = os.fspath(socket) if socket is not None else default_socket_dir()
    if os.path.basename(path) == GRPC_SOCKET_NAME and not os.path.isdir(path):
        path = os.path.dirname(path)
    return os.path.join(path, GRPC_SOCKET_NAME), os.path.join(path, SESSION_SOCKET_NAME)


def grpc_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # A restarted daemon is back within ~100 ms: retry the socket quickly.  (Not
        # grpc.min_reconnect_backoff_ms: gRPC core also takes it as the minimum *connect
        # timeout*, so a busy daemon that answers a new connection after 100 ms would
        # fail the call at once, whatever its own deadline.)
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


#: The key type ``as_keys`` passes through as it is.
_BYTES_ONLY: Final = frozenset({bytes})


def as_keys(keys: Sequence[bytes]) -> list[bytes]:
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raise InvalidArgument("keys must be a sequence of bytes objects, not one bytes object")
    given = list(keys)
    if set(map(type, given)) <= _BYTES_ONLY:  # the usual case, without Python per key
        return given
    out = []
    for i, key in enumerate(given):
        if not isinstance(key, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"keys[{i}] is {type(key).__name__}, expected bytes")
        out.append(bytes(key))
    return out


def as_bytes_view(block: Any, index: int, block_bytes: int) -> memoryview:
    """A flat byte view of a buffer-protocol object, checked against block_bytes."""
    try:
        view = memoryview(block)
    except TypeError:
        raise InvalidArgument(
            f"blocks[{index}] ({type(block).__name__}) does not support the buffer protocol"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument(f"blocks[{index}] is not C-contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if not 0 < view.nbytes <= block_bytes:
        raise InvalidArgument(
            f"blocks[{index}] is {view.nbytes} bytes; a block holds 1..{block_bytes} bytes"
        )
    return view


def copy_out(views: Sequence[np.ndarray], out: Sequence[Any] | None
             ) -> tuple[list[np.ndarray], int | None]:
    """Copies of leased views (new arrays, or views of the caller's ``out`` buffers),
    and the index of the first view whose memory was gone (None: all were copied).

    Every copy is ``_accel.copy_into`` (guarded): a view whose slot faults ends the
    copies there, and the copies of the views before it are returned.
    """
    got: list[np.ndarray] = []
    for i, view in enumerate(views):
        if out is None:
            dst = np.empty(len(view), dtype=np.uint8)
        else:
            dst = np.frombuffer(out[i], dtype=np.uint8)
            if dst.nbytes < len(view):
                raise InvalidArgument(f"out[{i}] holds {dst.nbytes} bytes, its block has "
                                      f"{len(view)}")
        try:
            _accel.copy_into(dst, view)  # streaming copy: no read-for-ownership of dst
        except OSError as exc:
            if not _accel.is_memory_fault(exc):
                raise
            return got, i
        got.append(dst[: len(view)])
    return got, None


def copy_out_verified(views: Sequence[np.ndarray], out: Sequence[Any] | None,
                      checksums: Sequence[int | None] | None
                      ) -> tuple[list[np.ndarray], int | None, int | None]:
    """``copy_out``, then each copy checked against ``checksums`` (None: not checked):
    (the copies, the first view whose memory was gone, the first copy that failed its
    checksum; None where there is none)."""
    got, gone = copy_out(views, out)
    if checksums is not None:
        for i, (copy, want) in enumerate(zip(got, checksums, strict=False)):
            if want is not None and _accel.checksum(copy) != want:
                return got, gone, i
    return got, gone, None


def check_out(keys: Sequence[bytes], out: Sequence[Any] | None) -> None:
    if out is not None and len(out) != len(keys):
        raise InvalidArgument(f"keys and out differ in length ({len(keys)} != {len(out)})")


def slot_gone(namespace: str, exc: OSError) -> FailedPrecondition:
    """The error for a write whose slot memory vanished under it (the fault guard's
    EFAULT: the segment's data file was cut short)."""
    return FailedPrecondition(
        f"a slot of namespace {namespace!r} lost its memory during the write ({exc.strerror}): "
        "its data file was truncated, by a writer of this namespace or the daemon; the "
        "reservation was aborted, nothing of it is committed")


def first_hits(resp: pb.AcquireResponse, n: int) -> pb.AcquireResponse:
    """``resp`` with only its first ``n`` hits (the lease still holds all of them: its
    release ends it whole)."""
    out = pb.AcquireResponse()
    out.CopyFrom(resp)
    del out.slots[n:]
    del out.tiers[n:]
    out.hits = n
    return out


# ----------------------------------------------------------------------------- steps
@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """One RPC in the current session; the step's result is the response."""

    method: str
    request: Any
    retry: bool = True  # once in a new session, if the daemon restarted (not SESSION_BOUND)


@dataclasses.dataclass(frozen=True, slots=True)
class SyncMaps:
    """Map the segments ``segment_ids`` (those some slots live in: ``segment_ids_of``;
    the daemon's extents at ``version``)."""

    version: int
    segment_ids: Collection[int]


def segment_ids_of(slots: Iterable[pb.SlotRef | LocalSlot]) -> set[int]:
    """The segments ``slots`` live in."""
    return {s.segment_id for s in slots}


@dataclasses.dataclass(frozen=True, slots=True)
class Work:
    """Copies or checksums over ``nbytes`` of shared memory; the result is ``fn()``."""

    fn: Callable[[], Any]
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class LookHere:
    """Look ``keys`` up in the shared index (opening the session first; mapping the
    new table first when the daemon replaced it); the result is ``SharedMemoryAnswers.look``'s, or
    with ``lease``, ``SharedMemoryAnswers.lease``'s."""

    keys: Sequence[bytes]
    lease: bool = False


@dataclasses.dataclass(slots=True)
class LocalAcquire:
    """An acquire the shared index answered: the shape of an ``AcquireResponse``, and
    the hazards (in ``index``'s session page, from ``at``) that hold the blocks."""

    index: LocalIndex
    at: int
    slots: list[LocalSlot]
    lease_id: int = 0
    segments_version: int = 0

    @property
    def hits(self) -> int:
        return len(self.slots)

    @property
    def tiers(self) -> list[Tier]:
        return [Tier.DRAM] * len(self.slots)


@dataclasses.dataclass(frozen=True, slots=True)
class GrantHere:
    """Reserve ``keys`` from the slots the daemon granted ahead (opening the session
    first); the result is ``SharedMemoryAnswers.grant``'s (None: call Reserve)."""

    keys: Sequence[bytes]


@dataclasses.dataclass(frozen=True, slots=True)
class CommitHere:
    """Commit a reservation made from grants through the session page (blocking: the
    daemon's answer is waited for); the result is one ``_index`` result per record."""

    writes: LocalWrites
    records: CommitColumns
    session_gen: int


@dataclasses.dataclass(slots=True)
class LocalReserve:
    """A reserve the grants answered: the shape of a ``ReserveResponse``, and the
    grants (one per RESERVED key, in order) that hold the slots, as columns: where
    each slot is (``grants.segment_ids``, ``grants.offsets``) without an object per
    slot; ``slots`` makes them for whoever wants them."""

    writes: LocalWrites
    statuses: list[KeyStatus]
    grants: TakenGrants
    segments_version: int
    block_bytes: int
    reservation_id: int = 0

    @property
    def slots(self) -> list[LocalSlot]:
        bb = self.block_bytes
        return [LocalSlot(seg, off, bb, 0, False)
                for seg, off in zip(self.grants.segment_ids, self.grants.offsets, strict=True)]


@dataclasses.dataclass(frozen=True, slots=True)
class SendRelease:
    """End lease ``lease_id`` of the current session; no need to wait for the answer."""

    lease_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class Start:
    """Begin ``step`` (a session-bound Call, or a CommitHere) without waiting for its
    answer; the result is a handle that exactly one ``Finish`` must be given, on every
    path (a commit started holds the page's ring until then)."""

    step: Call | CommitHere


@dataclasses.dataclass(frozen=True, slots=True)
class Finish:
    """Wait for what ``Start`` began; the result is the step's, or its error."""

    handle: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Next:
    """The next item of ``items`` (an iterator, or with AsyncClient an async iterator
    too), or None at its end."""

    items: Any


Step: TypeAlias = (Call | SyncMaps | Work | SendRelease | LookHere | GrantHere | CommitHere
                   | Start | Finish | Next)
_T = TypeVar("_T")
#: An operation: yields steps, is sent each step's result, returns its own.
Steps: TypeAlias = Generator[Step, Any, _T]


def run_steps(steps: Steps[_T], do: Callable[[Step], Any]) -> _T:
    """Run an operation to its result, each step by ``do``; a step's exception is
    raised inside the operation, where it can clean up (abort, release) and re-raise."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            result: _T = stop.value
            return result
        value, error = None, None
        try:
            value = do(step)
        except BaseException as exc:
            error = exc


async def arun_steps(steps: Steps[_T], do: Callable[[Step], Awaitable[Any]]) -> _T:
    """:func:`run_steps` with an awaitable ``do``."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            result: _T = stop.value
            return result
        value, error = None, None
        try:
            value = await do(step)
        except BaseException as exc:
            error = exc


# ----------------------------------------------------------------------------- core
_R = TypeVar("_R", bound="ReservationState")
_L = TypeVar("_L", bound="LeaseState")


class ClientCore(abc.ABC, Generic[_R, _L]):
    """A session in one namespace of a kvtierd: all of a client but its transport.

    A transport subclass provides ``_new_reservation``/``_new_lease`` (its own
    Reservation and Lease classes), opens the session (``_connect`` then
    ``_adopt``), and runs the ``_*_steps`` operations.
    """

    #: Who says "... is closed".
    _NAME = "kvtier.Client"

    def __init__(
        self,
        socket: str | os.PathLike[str] | None,
        *,
        namespace: str,
        block_bytes: int,
        model_uid: str,
        timeout: float,
        checksum: bool,
        reconnect_max: float,
        fast_path: bool | None = None,
    ) -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise InvalidArgument(f"block_bytes must be a positive int, got {block_bytes!r}")
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.model_uid = model_uid
        self.timeout = timeout
        self.checksum = checksum
        self.grpc_path, self.session_path = socket_paths(socket)
        if fast_path is None:
            fast_path = os.environ.get(FAST_PATH_ENV, "1").strip().lower() not in _OFF
        #: Make calls on the session channel when the daemon offers it (else gRPC).
        self.fast_path_wanted = fast_path
        #: Lease blocks without a call where the shared index can (csrc/index.c).
        self.local_leases = os.environ.get(LOCAL_LEASES_ENV, "1").strip().lower() not in _OFF
        #: Write into slots granted ahead and commit through the page (csrc/writes.c).
        self.local_writes = os.environ.get(LOCAL_WRITES_ENV, "1").strip().lower() not in _OFF
        #: The fault guard is in place (``_accel.install_client_fault_guard``): a copy
        #: out of or into a truncated slot is a miss or an error, not a SIGBUS.
        self.fault_guard = _accel.install_client_fault_guard()
        self.token = ""
        self.daemon_version = ""
        self._backoff = Backoff(maximum=reconnect_max)
        self._closed = False
        self._link: SessionLink | None = None
        self._maps = SegmentMaps()
        self._session_gen = 0
        #: Reservations open now, both kinds (a reserve from grants honours the limit).
        self._open_reservations = 0
        self._res_lock = threading.Lock()
        self._metadata: Metadata = ()
        #: Guards the session state between threads.  Client holds it while it
        #: reconnects or maps; AsyncClient only for a moment (its own waits are
        #: under asyncio locks).
        self._lock = threading.RLock()

    @abc.abstractmethod
    def _new_reservation(self, keys: list[bytes], resp: pb.ReserveResponse | LocalReserve) -> _R:
        """The transport's Reservation over a Reserve answer."""

    @abc.abstractmethod
    def _new_lease(self, keys: list[bytes], resp: pb.AcquireResponse | LocalAcquire,
                   verify: bool) -> _L:
        """The transport's Lease over an Acquire answer."""

    # ------------------------------------------------------------- session
    def _connect(self) -> tuple[SessionLink, SegmentMaps, pb.SessionOpened]:
        """A new session: its connection, its mapped segments, what the daemon said.

        Blocking (a socket round trip, then mmap and page-table population):
        AsyncClient runs it on a worker thread.
        """
        link = SessionLink(self.session_path, self.timeout)
        maps = SegmentMaps()
        try:
            resp, fds = link.request(open_request(self.namespace, self.block_bytes, self.model_uid))
            opened = resp.opened
            maps.read_only = opened.read_only
            maps.slot_bytes = opened.slot_bytes
            n = len(opened.segments)
            try:
                maps.update(opened.segments_version, opened.segments,
                            [s.segment_id for s in opened.segments], fds[:n])
            finally:
                maps.open_index(opened, fds[n:], self.fast_path_wanted and opened.fast_path,
                                self.local_writes)
        except BaseException:
            link.close()
            maps.close()
            raise
        return link, maps, opened

    def _adopt(self, new: tuple[SessionLink, SegmentMaps, pb.SessionOpened]) -> None:
        """Make a session from ``_connect`` the current one (its calls get a new generation)."""
        link, maps, opened = new
        link.fast_path = opened.fast_path and self.fast_path_wanted
        link.max_call_bytes = opened.max_call_bytes
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

    def _close_session(self) -> None:
        self._lose_session()
        self._maps.close()

    def _check_usable(self) -> None:
        """Before a call: the client is not closed (AsyncClient: and is open)."""
        if self._closed:
            raise FailedPrecondition(f"{self._NAME} is closed")

    @property
    def fast_path(self) -> bool:
        """Whether calls go on the session channel now (else over gRPC)."""
        link = self._link
        return link is not None and link.fast_path

    def _failed(self, method: str, metadata: Metadata, exc: grpc.RpcError | KVTierError,
                retry: bool) -> KVTierError | None:
        """The error a failed call raises, or None to retry it once in a new session.

        Unavailable or Unauthenticated (not a deadline) ends the session the call
        used, unless a reconnect replaced it meanwhile; a call that is not
        session-bound is retried when the daemon did not know its token (it
        restarted) or its session connection broke (a FastCall's).
        """
        err = exc if isinstance(exc, KVTierError) else from_rpc_error(exc)
        if isinstance(err, (Unavailable, Unauthenticated)) and not isinstance(err, DeadlineExceeded):
            with self._lock:
                if self._metadata == metadata:  # nobody reconnected meanwhile
                    self._lose_session()
            if (retry and isinstance(err, (Unauthenticated, LinkBroken))
                    and method not in SESSION_BOUND):
                return None
        return err

    def _maps_missing(self, version: int, segment_ids: Iterable[int]) -> list[int] | None:
        """Segments to map before views of slots in ``segment_ids`` can be made (None:
        nothing to do)."""
        if self._closed:
            raise FailedPrecondition(f"{self._NAME} is closed")
        missing = self._maps.missing(segment_ids)
        if version == self._maps.version and not missing:
            return None
        return missing

    def _live_link(self) -> SessionLink:
        if self._link is None:
            raise Unavailable("the session ended while the call was in flight")
        return self._link

    # ------------------------------------------------------------- operations
    def _bound_call(self, method: str, request: Any, session_gen: int, what: str) -> Steps[Any]:
        """A call carrying an id of session ``session_gen`` (commit/abort/release)."""
        if session_gen != self._session_gen:
            raise session_lost(what)
        try:
            return (yield Call(method, request, retry=False))
        except Unauthenticated:
            raise session_lost(what) from None

    def _lookup_any_steps(self, keys: Sequence[bytes], prefetch: bool,
                          here: tuple[bytes, bool] | None = None) -> Steps[Sequence[int]]:
        """The wire tier of each leading present key: from the shared index when it can
        answer, from a Lookup call when it cannot, or for the keys after a miss it
        cannot call final (a tier below DRAM may hold them).  ``here``: the table's
        answer the caller already has (it is not asked again)."""
        if isinstance(keys, (bytes, bytearray, memoryview)):
            as_keys(keys)  # raises: one bytes object is not a list of keys
        if here is None:
            here = yield LookHere(keys)
        if here is not None and here[1]:
            return here[0]
        keys = as_keys(keys)
        done = b"" if here is None else here[0]
        resp = yield Call("Lookup", pb.LookupRequest(keys=keys[len(done):], prefetch=prefetch))
        return [*done, *resp.tiers]

    def _lookup_steps(self, keys: Sequence[bytes], prefetch: bool,
                      here: tuple[bytes, bool] | None = None) -> Steps[int]:
        return len((yield from self._lookup_any_steps(keys, prefetch, here)))

    def _lookup_tiers_steps(self, keys: Sequence[bytes], prefetch: bool,
                            here: tuple[bytes, bool] | None = None) -> Steps[list[Tier]]:
        return [Tier(t) for t in (yield from self._lookup_any_steps(keys, prefetch, here))]

    def _reserve_steps(self, keys: Sequence[bytes], here: bool = True) -> Steps[_R]:
        """A reservation of ``keys``: from the slots granted ahead when it can (and
        ``here``), else by a Reserve call."""
        keys = as_keys(keys)
        local: LocalReserve | None = (yield GrantHere(keys)) if here else None
        if local is not None:
            try:
                yield SyncMaps(local.segments_version, set(local.grants.segment_ids))
                return self._new_reservation(keys, local)
            except FailedPrecondition:
                local.writes.untake(local.grants)  # a segment this process cannot map: call
            except BaseException:
                local.writes.untake(local.grants)
                raise
        resp = yield Call("Reserve", pb.ReserveRequest(keys=keys, packed_slots=True))
        try:
            yield SyncMaps(resp.segments_version, segment_ids_of(reserved_slots(resp)))
            return self._new_reservation(keys, resp)
        except BaseException:
            if resp.reservation_id:
                yield Call("Abort", pb.AbortRequest(reservation_id=resp.reservation_id))
            raise

    def _acquire_steps(self, keys: Sequence[bytes], verify: bool = True) -> Steps[_L]:
        keys = as_keys(keys)
        local: LocalAcquire | None = yield LookHere(keys, lease=True)
        if local is not None:
            try:
                return (yield from self._leased_steps(keys, local, verify))
            except FailedPrecondition:
                # A segment this process cannot map (retired meanwhile, or cut short by
                # a writer): the daemon answers instead.
                local.index.release(local.at, local.hits)
            except BaseException as exc:
                local.index.release(local.at, local.hits)
                if isinstance(exc, Corrupted):
                    yield Call("Delete", pb.DeleteRequest(keys=[exc.key], corrupted=True))
                raise
        resp = yield Call("Acquire", pb.AcquireRequest(keys=keys))
        try:
            return (yield from self._leased_steps(keys, resp, verify))
        except BaseException as exc:
            if resp.lease_id:
                yield Call("Release", pb.ReleaseRequest(lease_id=resp.lease_id))
            if isinstance(exc, Corrupted):
                # Never served: the bad block becomes a miss and the daemon counts it.
                yield Call("Delete", pb.DeleteRequest(keys=[exc.key], corrupted=True))
            raise

    def _leased_steps(self, keys: list[bytes], answer: pb.AcquireResponse | LocalAcquire,
                      verify: bool) -> Steps[_L]:
        """The transport's Lease over an acquire's answer (its segments mapped first).

        A block in a segment this process cannot map ends the lease's views
        there: the blocks from it on are a miss (the lease still holds them,
        its release ends it whole); a local lease raises FailedPrecondition
        instead (the caller asks the daemon).  A block whose memory faults
        while it is verified does the same, and is deleted as corrupted."""
        yield SyncMaps(answer.segments_version, segment_ids_of(answer.slots))
        usable = self._maps.mapped_prefix(answer.slots)
        if usable < len(answer.slots):
            seg = answer.slots[usable].segment_id
            if isinstance(answer, LocalAcquire):
                raise FailedPrecondition(f"segment {seg} cannot be mapped in this process")
            answer = first_hits(answer, usable)
        verified = sum(r.length for r in answer.slots) if self.checksum and verify else 0
        lease: _L = yield Work(functools.partial(self._new_lease, keys, answer, verify), verified)
        if lease.gone is not None:
            yield from self._forget_steps(lease.gone)
        return lease

    def _forget_steps(self, key: bytes) -> Steps[None]:
        """Block ``key``'s slot memory was gone under a read (its data file cut short):
        delete it as corrupted, as a checksum failure does (the daemon counts it, later
        reads miss there instead of reading what the audit put back).  Best effort:
        the read has already made it a miss."""
        try:
            yield Call("Delete", pb.DeleteRequest(keys=[key], corrupted=True))
        except KVTierError:
            pass

    def _put_steps(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> Steps[int]:
        return (yield from self._put_many_steps(iter(((keys, blocks),)), split=True, one=True))

    def _put_many_steps(self, items: Any, *, split: bool = False, one: bool = False
                        ) -> Steps[int]:
        """Store the (keys, blocks) items of the iterator ``items`` in batches, in order:
        one per item (with ``split``, a large item is cut in several: ``put_batches``);
        returns how many were stored.

        Batch i+1 is reserved and copied while batch i's commit is in flight; a
        batch's commit is started only once the one before it answered, so the
        batches are stored in order, each all or nothing.  On an error the
        batches before the failing one stay stored, that batch and the rest are
        not (nothing more is read from ``items``), and the error, a KVTierError,
        carries ``stored``: how many keys the call stored before it.  Returns once
        every commit it started has answered, on every path.  With ``one`` (``items``
        holds one item) its last batch commits as ``commit`` does, without a Start:
        nothing is left to overlap it with."""
        stored = 0
        pending: tuple[ReservationState, Any] | None = None  # a commit in flight
        try:
            while True:
                item = yield Next(items)
                if item is None:
                    break
                try:
                    keys, blocks = item
                except (TypeError, ValueError):
                    raise InvalidArgument(f"an item to put is a (keys, blocks) pair, not "
                                          f"{type(item).__name__}") from None
                keys = as_keys(keys)
                if len(keys) != len(blocks):
                    raise InvalidArgument(f"keys and blocks differ in length ({len(keys)} != "
                                          f"{len(blocks)})")
                views = [as_bytes_view(b, i, self.block_bytes) for i, b in enumerate(blocks)]
                cuts = self.put_batches([v.nbytes for v in views]) if split else [(0, len(keys))]
                for lo, hi in cuts:
                    if pending is not None and not self._can_overlap():
                        stored += yield from self._answered_steps(*pending)
                        pending = None
                    r = yield from self._written_steps(keys[lo:hi], views[lo:hi])
                    h = None
                    try:
                        if pending is not None:  # the batch before answers first
                            done, pending = pending, None
                            stored += yield from self._answered_steps(*done)
                        if one and hi == len(keys):
                            stored += yield from r._commit_steps()
                        else:
                            h = yield from r._commit_start_steps()
                    except BaseException as exc:
                        yield from r._exit_steps(type(exc))
                        raise
                    if h is not None:
                        pending = (r, h)
            if pending is not None:
                done, pending = pending, None
                stored += yield from self._answered_steps(*done)
        except BaseException as exc:
            if pending is not None:  # answered before the error leaves
                try:
                    stored += yield from self._answered_steps(*pending)
                except BaseException:  # noqa: BLE001 (the first error is the one raised)
                    pass
            if isinstance(exc, KVTierError):
                exc.stored = stored  # type: ignore[attr-defined]
            raise
        return stored

    def _answered_steps(self, r: ReservationState, handle: Any) -> Steps[int]:
        """The answer of ``r``'s commit in flight (``handle``); a failed one is ended as
        a failed ``commit`` inside ``with`` would be (aborted where still open)."""
        try:
            return (yield from r._commit_finish_steps(handle))
        except BaseException as exc:
            yield from r._exit_steps(type(exc))
            raise

    def _written_steps(self, keys: list[bytes], views: list[memoryview]) -> Steps[_R]:
        """A reservation of ``keys`` with the blocks ``views`` copied in, ready to commit
        (a slot granted ahead that lost its memory: once more through a Reserve call)."""
        here = True
        while True:
            r = yield from self._reserve_steps(keys, here)
            try:
                yield Work(functools.partial(r.write_all_hashed if self.checksum else r.write_all,
                                             views),
                           sum(views[i].nbytes for i in r.reserved))
                return r
            except BaseException as exc:
                yield from r._exit_steps(type(exc))
                if here and r.local and r.fault is not None:
                    here = False  # a slot granted ahead lost its memory: let the daemon choose
                    continue
                raise

    #: A put is cut into batches of at least this many bytes (so one of twice this is
    #: the smallest cut): a cut pays off only when a batch's copy takes longer than a
    #: commit's fixed cost (the daemon's ~0.1 ms of work and two wake-ups per ring),
    #: which each batch costs again.  Measured on a loaded 2-vCPU host, 32 x 64 KiB
    #: (2 MiB) in 2 or 4 batches moved 0.8x / 0.45x the bytes of one batch, and 32 x
    #: 512 KiB in 4 batches 0.6-1.2x, with 1.9-2.1x the daemon's CPU per block
    #: (docs/benchmarks.md); batches of 16 MiB or more keep that cost near 1%.
    put_batch_bytes = 16 << 20
    #: At most this many batches a put: each costs the daemon a commit's fixed work.
    put_max_batches = 4

    def put_batches(self, nbytes: Sequence[int]) -> list[tuple[int, int]]:
        """The batches (index ranges, in order) a put of blocks of ``nbytes`` is cut into."""
        n = len(nbytes)
        total = sum(nbytes)
        k = max(1, min(self.put_max_batches, n, total // max(1, self.put_batch_bytes)))
        if k == 1:
            return [(0, n)]
        return [(n * j // k, n * (j + 1) // k) for j in range(k)]

    def _can_overlap(self) -> bool:
        """Whether a put may open its next reservation while one is committing (the
        session's reservation limit, where the page says it, leaves room for both)."""
        index = self._maps.index
        writes = None if index is None else index.writes
        return writes is None or writes.max_reservations - self._open_reservations >= 1

    def _get_steps(self, keys: Sequence[bytes], out: Sequence[Any] | None
                   ) -> Steps[list[np.ndarray]]:
        check_out(keys, out)
        # The copies are verified, not the slots: a writer of the namespace can change a
        # slot (or cut its data file, which the audit gives back as zeros) between a check
        # of the slot and the copy, and what the caller gets is the copy.
        lease = yield from self._acquire_steps(keys, verify=False)
        want = lease.checksums if self.checksum else None
        try:
            got, gone, bad = yield Work(functools.partial(copy_out_verified, lease.views, out,
                                                          want),
                                        sum(v.nbytes for v in lease.views) * (2 if want else 1))
        except BaseException as exc:
            yield from lease._exit_steps(type(exc))
            raise
        if bad is not None:
            yield from lease._drop_corrupted_steps([bad])  # raises Corrupted, as acquire does
        yield from lease._release_steps(wait=False)  # every copy is done
        if gone is not None:  # its memory was gone: a miss from there on
            yield from self._forget_steps(lease.keys[gone])
        result: list[np.ndarray] = got
        return result

    def _delete_steps(self, keys: Sequence[bytes]) -> Steps[int]:
        resp = yield Call("Delete", pb.DeleteRequest(keys=as_keys(keys)))
        return int(resp.deleted)

    def _stats_steps(self) -> Steps[dict[str, Any]]:
        resp = yield Call("Stats", pb.StatsRequest())
        return MessageToDict(resp, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)


def reserved_slots(resp: pb.ReserveResponse) -> Sequence[pb.SlotRef] | Sequence[LocalSlot]:
    """A Reserve answer's slots, sent as messages or (``packed_slots``) as columns."""
    if not resp.slot_offsets:
        return resp.slots
    capacity = resp.slot_capacity
    return [LocalSlot(seg, off, capacity, 0, False)
            for seg, off in zip(resp.slot_segment_ids, resp.slot_offsets, strict=True)]


class ReservationState:
    """A reservation's keys, statuses and writable buffers, and its operations.

    A write (``write``, ``write_all``, ``write_blocks``, the commit's checksums)
    whose slot memory vanishes under it (its segment's data file was cut
    short) raises ``FailedPrecondition`` and spoils the reservation: it is
    aborted (at once by the sync client; by ``commit``, which raises the
    same error, or by leaving the ``with`` block otherwise) and nothing of it
    is committed.
    """

    def __init__(self, client: ClientCore[Any, Any], keys: list[bytes],
                 resp: pb.ReserveResponse | LocalReserve) -> None:
        self._client = client
        self.keys = keys
        self.session_gen = client._session_gen
        self.reservation_id = resp.reservation_id
        #: Made from grants (no Reserve call): committed through the page.
        self._local = resp if isinstance(resp, LocalReserve) else None
        n = len(keys)
        self._block_bytes = client.block_bytes
        #: Where the k-th reserved key's slot is: its segment and offset (columns; the
        #: views of ``buffers`` are made only when asked for).
        self._segment_ids: Sequence[int]
        self._offsets: Sequence[int]
        if isinstance(resp, LocalReserve):
            self.statuses = resp.statuses
            grants = resp.grants
            self._segment_ids, self._offsets = grants.segment_ids, grants.offsets
            self._reserved = (tuple(range(n)) if len(grants) == n else
                              tuple(i for i, s in enumerate(self.statuses)
                                    if s == KeyStatus.RESERVED))
        else:
            by_value = _KEY_STATUS
            self.statuses = [by_value[s] if s in by_value else KeyStatus(s)
                             for s in resp.statuses]
            self._reserved = tuple(i for i, s in enumerate(self.statuses)
                                   if s == KeyStatus.RESERVED)
            slots = reserved_slots(resp)
            if len(slots) < len(self._reserved):
                raise FailedPrecondition(f"the daemon reserved {len(self._reserved)} keys "
                                         f"with {len(slots)} slots")
            slots = slots[:len(self._reserved)]
            self._segment_ids = [s.segment_id for s in slots]
            self._offsets = [s.offset for s in slots]
        #: The arrays over the reserved slots' segments (segment id -> array), checked
        #: here as a view of each slot would be (FailedPrecondition otherwise); they hold
        #: the mappings until ``release_views``.
        self._slot_arrays = client._maps.slot_arrays(self._segment_ids, self._offsets,
                                                     self._block_bytes, writable=True)
        self._buffers: list[np.ndarray | None] | None = None  # made by ``buffers``
        self._released = False
        self.lengths: list[int | None] = [None] * n
        self.done = (self.reservation_id == 0 if self._local is None
                     else not self._local.grants)
        #: Checksums of the reserved slots, when ``write_all_hashed`` filled them all and
        #: nothing was written since (the commit then hashes nothing again).
        self._sums: list[int] | None = None
        #: Set when a slot's memory was gone under a write: never committed.
        self.fault: FailedPrecondition | None = None
        if not self.done:
            self._count(+1)

    @property
    def local(self) -> bool:
        """Made from slots granted ahead (no Reserve call)."""
        return self._local is not None

    def _spoilt(self, exc: OSError) -> FailedPrecondition:
        """A write's slot lost its memory (the guard's EFAULT): the reservation is spoilt
        (``_on_fault`` may abort it at once); the error to raise."""
        self.fault = slot_gone(self._client.namespace, exc)
        self._on_fault()
        return self.fault

    def _on_fault(self) -> None:
        """Called when a write faulted (the sync client aborts here)."""

    def _guarded(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, a guarded copy or hash of slot memory; a memory fault spoils
        the reservation and raises its ``FailedPrecondition``."""
        try:
            return fn(*args)
        except OSError as exc:
            if _accel.is_memory_fault(exc):
                raise self._spoilt(exc) from None
            raise

    def _count(self, delta: int) -> None:
        client = self._client
        with client._res_lock:
            client._open_reservations += delta
        if self._local is not None:
            self._local.writes.opened(delta)

    @property
    def reserved(self) -> list[int]:
        """Indices of the keys this reservation lets you write."""
        return list(self._reserved)

    @property
    def buffers(self) -> list[np.ndarray | None]:
        """A writable uint8 view of ``block_bytes`` of each RESERVED key's slot (None for
        the others, and for all of them once the reservation ended).  Made on first use
        (a put copies through ``_write_reserved`` without them), then the same list."""
        bufs = self._buffers
        if bufs is None:
            bufs = [None] * len(self.keys)
            if not self._released:
                arrays, bb = self._slot_arrays, self._block_bytes
                for i, seg, off in zip(self._reserved, self._segment_ids, self._offsets,
                                       strict=True):
                    bufs[i] = arrays[seg][off:off + bb]
            self._buffers = bufs
        return bufs

    def write(self, i: int, data: Any) -> None:
        """Copy ``data`` (any buffer) into the slot of ``keys[i]`` and record its length."""
        buf = self.buffers[i]
        if buf is None:
            raise InvalidArgument(f"keys[{i}] is {self.statuses[i].name}, not reserved by this call")
        view = as_bytes_view(data, i, self._block_bytes)
        self._guarded(_accel.copy_into, buf, view)
        self.lengths[i] = view.nbytes
        self._sums = None

    def write_all(self, views: Sequence[Any]) -> None:
        """``write(i, views[i])`` for every reserved ``i``, in one guarded copy call."""
        self._write_reserved(views, hashed=False)

    def write_blocks(self, blocks: Sequence[Any]) -> None:
        """Copy ``blocks[i]`` (any buffer) into the slot of every reserved key ``i``:
        ``blocks`` has one entry per key of the reserve, the others are not read.
        When the client checksums, each block is hashed in the same pass as its copy
        and ``commit()`` hashes nothing again (what ``put`` does)."""
        if len(blocks) != len(self.keys):
            raise InvalidArgument(f"keys and blocks differ in length ({len(self.keys)} != "
                                  f"{len(blocks)})")
        self._write_reserved(blocks, hashed=self._client.checksum)

    def write_all_hashed(self, views: Sequence[Any]) -> None:
        """``write_all``, checksumming each block in the same pass over it (the commit
        then sends those checksums)."""
        self._write_reserved(views, hashed=True)

    def _write_reserved(self, blocks: Sequence[Any], hashed: bool) -> None:
        """``blocks[i]`` (a C-contiguous buffer of 1..block_bytes bytes) into the slot of
        each reserved key ``i``, in one guarded native call that takes each slot as its
        segment's array and offset (no object per slot, no Python check per block);
        ``hashed``: each checksummed in the same pass (the commit sends those).  A block
        that is not such a buffer raises ``as_bytes_view``'s InvalidArgument, nothing
        copied; InvalidArgument too once the reservation ended, as a write to a key it
        does not hold."""
        self._sums = None
        reserved = self._reserved
        if not reserved:
            self._sums = [] if hashed else None
            return
        if self._released:
            raise InvalidArgument(f"keys[{reserved[0]}] is not reserved by this call")
        arrays = self._slot_arrays
        try:
            sums, nbytes = self._guarded(
                _accel.scatter_hash_at, [blocks[i] for i in reserved],
                [arrays[seg] for seg in self._segment_ids], self._offsets, self._block_bytes,
                hashed)
        except (TypeError, ValueError):
            bad = self._bad_block(blocks)
            if bad is None:
                raise
            raise bad from None
        lengths = self.lengths
        for i, n in zip(reserved, nbytes, strict=True):
            lengths[i] = n
        self._sums = sums

    def _bad_block(self, blocks: Sequence[Any]) -> InvalidArgument | None:
        """The error naming the first reserved block that is not a C-contiguous buffer of
        1..block_bytes bytes (``as_bytes_view``'s, as every write names it), else None."""
        for i in self._reserved:
            try:
                as_bytes_view(blocks[i], i, self._block_bytes)
            except InvalidArgument as exc:
                return exc
        return None

    def commit_request(self, checksum: bool) -> pb.CommitRequest:
        lengths, sums = self._lengths_and_sums(checksum)
        return pb.CommitRequest(reservation_id=self.reservation_id, lengths=lengths,
                                checksums=sums or [])

    def _lengths_and_sums(self, checksum: bool) -> tuple[list[int], list[int] | None]:
        """Each reserved slot's length and (with ``checksum``) its checksum, hashing
        only what ``write_all_hashed`` did not."""
        lengths = []
        sums: list[int] = []
        hashed = self._sums if checksum else None
        for i in self.reserved:
            n = self.lengths[i]
            n = self._block_bytes if n is None else n
            lengths.append(n)
            if checksum and hashed is None:
                buf = self.buffers[i]
                assert buf is not None
                sums.append(self._guarded(_accel.checksum, buf[:n]))
        if not checksum:
            return lengths, None
        return lengths, sums if hashed is None else hashed

    def release_views(self) -> None:
        self._released = True
        self._buffers = [None] * len(self.keys)
        self._slot_arrays = {}

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self._count(-1)
        self.release_views()

    def commit_records(self, checksum: bool) -> CommitColumns:
        """The commit records of a reservation made from grants (csrc/writes.c), as
        columns: each names its grant's entry and the word it took there (the slot it
        filled), its key, length and checksum."""
        assert self._local is not None
        lengths, sums = self._lengths_and_sums(checksum)
        grants = self._local.grants
        keys = (self.keys if len(self._reserved) == len(self.keys)
                else [self.keys[i] for i in self._reserved])
        return CommitColumns(grants.entries, grants.words, keys, lengths, sums)

    def _commit_steps(self) -> Steps[int]:
        what = yield from self._commit_prepare_steps()
        if what is None:
            return 0
        if isinstance(what, CommitHere):
            try:
                results: bytes = yield what
            finally:
                self._finish()
            return self._local_answer(results)
        try:
            resp = yield from self._client._bound_call("Commit", what.request, self.session_gen,
                                                       "reservation")
        except SessionLost:
            self._finish()
            raise
        self._finish()
        return int(resp.committed)

    def _commit_start_steps(self) -> Steps[Any]:
        """``_commit_steps`` up to the commit sent, not waited for: the handle for
        ``_commit_finish_steps``, which must follow on every path (None: nothing to
        commit, nothing to finish)."""
        what = yield from self._commit_prepare_steps()
        if what is None:
            return None
        if isinstance(what, CommitHere):
            try:
                return (yield Start(what))
            except BaseException:
                self._finish()  # never published (the session ended): nothing committed
                raise
        if self.session_gen != self._client._session_gen:
            self._finish()
            raise session_lost("reservation")
        try:
            return (yield Start(what))
        except (SessionLost, Unauthenticated):
            self._finish()
            raise session_lost("reservation") from None

    def _commit_finish_steps(self, handle: Any) -> Steps[int]:
        """The answer of the commit ``_commit_start_steps`` sent; returns as ``commit``."""
        if self._local is not None:
            try:
                results: bytes = yield Finish(handle)
            finally:
                self._finish()
            return self._local_answer(results)
        try:
            resp = yield Finish(handle)
        except Unauthenticated:
            self._finish()
            raise session_lost("reservation") from None
        except SessionLost:
            self._finish()
            raise
        self._finish()
        return int(resp.committed)

    def _commit_prepare_steps(self) -> Steps[CommitHere | Call | None]:
        """What commits this reservation: the page's records (a CommitHere) or the
        Commit call; None when there is nothing to commit."""
        if self.done and self.fault is None:
            return None
        try:
            if self.fault is not None:  # a write lost its slot: never committed
                raise FailedPrecondition(str(self.fault))
            checksum = self._client.checksum
            hashed = (len(self._reserved) * self._block_bytes
                      if checksum and self._sums is None and not self._released else 0)
            if self._local is not None:
                records = yield Work(functools.partial(self.commit_records, checksum), hashed)
                return CommitHere(self._local.writes, records, self.session_gen)
            req = yield Work(functools.partial(self.commit_request, checksum), hashed)
        except FailedPrecondition:
            if self.fault is not None:
                yield from self._exit_steps(FailedPrecondition)  # abort, quietly
            raise
        return Call("Commit", req, retry=False)

    def _local_answer(self, results: bytes) -> int:
        """What a commit through the page answered: how many were committed, or the error."""
        local = self._local
        assert local is not None
        committed = results.count(_index.COMMITTED)
        if committed < len(results):
            # Grants whose key turned out present stay granted: give them back for reuse.
            kept = [g for g, r in zip(local.grants, results, strict=True)
                    if r != _index.COMMITTED]
            local.writes.untake(kept)
        if _index.INVALID in results:
            raise InvalidArgument("the daemon refused this commit's records as malformed")
        if _index.LOST in results:
            raise NotFound("reservation is not open: a slot of this commit is no longer "
                           "this session's (held past reservations.ttl, or committed "
                           "already); write the blocks again")
        if _index.FAILED in results:
            raise Unavailable("the daemon could not record this commit; retry")
        return committed

    def _abort_steps(self) -> Steps[None]:
        if self.done:
            return
        if self._local is not None:
            self._finish()
            self._local.writes.untake(self._local.grants)
            return
        self._finish()
        yield from self._client._bound_call(
            "Abort", pb.AbortRequest(reservation_id=self.reservation_id), self.session_gen,
            "reservation")

    def _exit_steps(self, et: type[BaseException] | None) -> Steps[None]:
        """Leaving the ``with`` block: abort unless committed.  While an exception
        propagates, a failure to abort does not replace it."""
        if self.done:
            return
        try:
            yield from self._abort_steps()
        except KVTierError:
            if et is None:
                raise


class LeaseState:
    """Read-only views of the leased blocks (checksums verified), and its operations.

    ``checksums[i]`` is the XXH3-64 the writer committed for ``views[i]``
    (None if it committed none).  A lease made with ``verify=False`` has not
    compared them: its reader does, while it copies (one pass over the bytes
    instead of two), and reports a block that fails with ``_drop_corrupted_steps``.
    A lease the shared index answered (``LocalAcquire``) is held by hazards in the
    session page, not by the daemon: its release is a write there, no call.
    """

    def __init__(self, client: ClientCore[Any, Any], keys: list[bytes],
                 resp: pb.AcquireResponse | LocalAcquire, verify: bool = True) -> None:
        self._client = client
        self.session_gen = client._session_gen
        self.lease_id = resp.lease_id
        self._local = resp if isinstance(resp, LocalAcquire) else None
        self.keys = keys[: resp.hits]
        self.tiers = resp.tiers if isinstance(resp, LocalAcquire) else [Tier(t) for t in resp.tiers]
        self.views = [client._maps.view(ref, ref.length, writable=False) for ref in resp.slots]
        self.checksums: list[int | None] = [
            int(ref.checksum) if ref.has_checksum else None for ref in resp.slots]
        #: The key of the block whose memory was gone while it was verified (the lease's
        #: views end before it: a miss from there on), or None.
        self.gone: bytes | None = None
        if client.checksum and verify:
            for i, (want, view) in enumerate(zip(self.checksums, self.views, strict=True)):
                if want is None:
                    continue
                try:
                    got = _accel.checksum(view)
                except OSError as exc:
                    if not _accel.is_memory_fault(exc):
                        raise
                    self.gone = self.keys[i]
                    self._first(i)
                    break
                if got != want:
                    raise corrupted(self.keys[i])
        self.done = self.lease_id == 0

    def _first(self, n: int) -> None:
        """Keep only the first ``n`` blocks in view (the lease still holds them all)."""
        self.keys = self.keys[:n]
        self.tiers = self.tiers[:n]
        self.views = self.views[:n]
        self.checksums = self.checksums[:n]

    @property
    def local(self) -> bool:
        """Held by hazards in the session page (leased without a call)."""
        return self._local is not None

    @property
    def hits(self) -> int:
        return len(self.views)

    def release_views(self) -> None:
        self.views = []

    def _release_steps(self, wait: bool) -> Steps[None]:
        if self.done:
            return
        self.done = True
        if self._local is not None:
            self.release_views()  # no view outlives the hazards
            held = self._local.index.release(self._local.at, self._local.hits)
            link = self._client._link
            if (self.session_gen != self._client._session_gen or link is None
                    or link.hung_up()):
                raise session_lost("lease")  # as a Release call would find it
            if not held:
                raise NotFound(f"lease {self.lease_id} is not held by this session (already "
                               "released, or expired)")
            return
        self.release_views()
        if not wait and self.session_gen == self._client._session_gen:
            yield SendRelease(self.lease_id)
            return
        yield from self._client._bound_call(
            "Release", pb.ReleaseRequest(lease_id=self.lease_id), self.session_gen, "lease")

    def _exit_steps(self, et: type[BaseException] | None) -> Steps[None]:
        """Leaving the ``with`` block: release.  While an exception propagates, a
        failure to release does not replace it."""
        try:
            yield from self._release_steps(wait=True)
        except KVTierError:
            if et is None:
                raise

    def _drop_gone_steps(self, i: int) -> Steps[None]:
        """The reader's copy of block ``i`` (an index into ``views``) faulted: its slot
        memory was gone (the data file cut short).  Ends the lease (without waiting)
        and deletes that block as corrupted, best effort: the caller counts the
        blocks before ``i`` as read and the rest as a miss."""
        if not 0 <= i < len(self.keys):
            raise InvalidArgument(f"block {i} is not in this lease of {len(self.keys)} blocks")
        key = self.keys[i]
        try:
            yield from self._release_steps(wait=False)
        except KVTierError:
            pass  # the lease had ended (session lost): the miss stands all the same
        yield from self._client._forget_steps(key)

    def _drop_corrupted_steps(self, bad: Sequence[int]) -> Steps[NoReturn]:
        """The reader found blocks ``bad`` (indices into ``views``) failing their checksum.

        As ``acquire`` does for a block it verifies: end the lease (waiting for
        the answer), delete those blocks as corrupted (never served again: the
        daemon counts them, a later lookup misses there), then raise
        ``Corrupted`` for the first of them.  A failure to release or delete is
        its ``__cause__``; it does not replace it.
        """
        bad = sorted(set(bad))
        if not bad:
            raise InvalidArgument("no block to drop: bad is empty")
        if bad[0] < 0 or bad[-1] >= len(self.keys):
            wrong = bad[0] if bad[0] < 0 else bad[-1]
            raise InvalidArgument(f"block {wrong} is not in this lease of {len(self.keys)} blocks")
        keys = [self.keys[i] for i in bad]
        error = corrupted(keys[0])
        cause: KVTierError | None = None
        try:
            yield from self._release_steps(wait=True)
        except KVTierError as exc:  # the lease had ended (session lost): delete all the same
            cause = exc
        try:
            yield Call("Delete", pb.DeleteRequest(keys=keys, corrupted=True))
        except KVTierError as exc:
            cause = cause or exc
        raise error from cause
