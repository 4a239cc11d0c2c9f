"""What the sync and async clients share: arguments, reservations, leases.

Transport-free: the clients do the RPCs; this module builds requests from
user arguments and turns responses into objects over shared memory.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier import _accel
from kvtier._paths import GRPC_SOCKET_NAME, SESSION_SOCKET_NAME, default_socket_dir
from kvtier._session import SegmentMaps
from kvtier.errors import Corrupted, InvalidArgument, SessionLost, Unavailable
from kvtier.v1 import kvtier_pb2 as pb

#: Metadata entry that carries the session token on every call.
SESSION_METADATA = "kvtier-session"
#: Default per-call deadline: long enough for an extent growth that
#: pre-faults hundreds of MiB, short enough that a dead daemon is noticed.
DEFAULT_TIMEOUT = 30.0
#: Client-side gRPC message limit (responses of big batches stay far below).
MAX_MESSAGE_BYTES = 64 << 20


class KeyStatus(enum.IntEnum):
    """Outcome of ``reserve`` for one key."""

    RESERVED = pb.RESERVE_STATUS_RESERVED  # a writable buffer is yours
    EXISTS = pb.RESERVE_STATUS_EXISTS  # already committed: nothing to write
    IN_FLIGHT = pb.RESERVE_STATUS_IN_FLIGHT  # another writer holds it now


class Tier(enum.IntEnum):
    DRAM = pb.TIER_DRAM
    SSD = pb.TIER_SSD
    SHARED = pb.TIER_SHARED


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


def session_lost(what: str) -> SessionLost:
    return SessionLost(f"{what} was lost: its session ended "
                       "(kvtierd restarted or the session connection dropped)")


#: Calls that carry ids of the session that issued them: never retried in a new one.
SESSION_BOUND = frozenset({"Commit", "Abort", "Release"})


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


def as_keys(keys: Sequence[bytes]) -> list[bytes]:
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raise InvalidArgument("keys must be a sequence of bytes objects, not one bytes object")
    out = []
    for i, key in enumerate(keys):
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


def copy_out(views: Sequence[np.ndarray], out: Sequence[Any] | None) -> list[np.ndarray]:
    """Copies of leased views: new arrays, or views of the caller's ``out`` buffers."""
    if out is None:
        return [v.copy() for v in views]
    got = []
    for i, view in enumerate(views):
        dst = np.frombuffer(out[i], dtype=np.uint8)
        if dst.nbytes < len(view):
            raise InvalidArgument(f"out[{i}] holds {dst.nbytes} bytes, its block has {len(view)}")
        _accel.copy_into(dst, view)  # streaming copy: no read-for-ownership of dst
        got.append(dst[: len(view)])
    return got


def check_out(keys: Sequence[bytes], out: Sequence[Any] | None) -> None:
    if out is not None and len(out) != len(keys):
        raise InvalidArgument(f"keys and out differ in length ({len(keys)} != {len(out)})")


class ReservationState:
    """A reservation's keys, statuses and writable buffers (transport-free part)."""

    def __init__(self, keys: list[bytes], resp: pb.ReserveResponse, maps: SegmentMaps,
                 block_bytes: int, session_gen: int) -> None:
        self.keys = keys
        self.session_gen = session_gen
        self.reservation_id = resp.reservation_id
        self.statuses = [KeyStatus(s) for s in resp.statuses]
        self.buffers: list[np.ndarray | None] = [None] * len(keys)
        self.lengths: list[int | None] = [None] * len(keys)
        self._block_bytes = block_bytes
        slots = iter(resp.slots)
        for i, status in enumerate(self.statuses):
            if status == KeyStatus.RESERVED:
                self.buffers[i] = maps.view(next(slots), block_bytes, writable=True)
        self.done = self.reservation_id == 0

    @property
    def reserved(self) -> list[int]:
        """Indices of the keys this reservation lets you write."""
        return [i for i, s in enumerate(self.statuses) if s == KeyStatus.RESERVED]

    def write(self, i: int, data: Any) -> None:
        """Copy ``data`` (any buffer) into the slot of ``keys[i]`` and record its length."""
        buf = self.buffers[i]
        if buf is None:
            raise InvalidArgument(f"keys[{i}] is {self.statuses[i].name}, not reserved by this call")
        view = as_bytes_view(data, i, self._block_bytes)
        _accel.copy_into(buf, view)
        self.lengths[i] = view.nbytes

    def commit_request(self, checksum: bool) -> pb.CommitRequest:
        lengths = []
        sums = []
        for i in self.reserved:
            n = self.lengths[i]
            n = self._block_bytes if n is None else n
            lengths.append(n)
            if checksum:
                buf = self.buffers[i]
                assert buf is not None
                sums.append(_accel.checksum(buf[:n]))
        return pb.CommitRequest(reservation_id=self.reservation_id, lengths=lengths, checksums=sums)

    def release_views(self) -> None:
        self.buffers = [None] * len(self.keys)


class LeaseState:
    """Read-only views of the leased blocks (transport-free part)."""

    def __init__(self, keys: list[bytes], resp: pb.AcquireResponse, maps: SegmentMaps,
                 verify: bool, session_gen: int) -> None:
        self.session_gen = session_gen
        self.lease_id = resp.lease_id
        self.keys = keys[: resp.hits]
        self.tiers = [Tier(t) for t in resp.tiers]
        self.views = [maps.view(ref, ref.length, writable=False) for ref in resp.slots]
        if verify:
            for i, (ref, view) in enumerate(zip(resp.slots, self.views, strict=False)):
                if ref.has_checksum and _accel.checksum(view) != ref.checksum:
                    raise Corrupted(f"block {self.keys[i].hex()} failed its checksum",
                                    key=self.keys[i])
        self.done = self.lease_id == 0

    @property
    def hits(self) -> int:
        return len(self.views)

    def release_views(self) -> None:
        self.views = []
