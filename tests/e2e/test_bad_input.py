"""End-to-end: bad input gets an exact error, the daemon keeps serving, nothing is lost.

Every case talks to a real kvtierd process, either through ``kvtier.Client``
(asserting the exact ``kvtier.errors`` class) or through a raw gRPC stub /
raw session-channel socket (asserting the exact status code), and always the
exact message the daemon produces.  After every case ``assert_serving``
checks that the daemon still answers health checks, still stores and
returns bytes, passes its own consistency check, and that its DRAM tier
still balances (free + reserved + committed == total).
"""

from __future__ import annotations

import array
import asyncio
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvtier
from kvtier import errors
from kvtier._core import LOCAL_WRITES_ENV
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd.segments import META_SUFFIX, read_header, segment_file_name
from kvtierd.session_channel import MAX_OPEN_FRAME, MAX_REQUEST_FRAME
from tests.conftest import DaemonProc, temp_daemon

#: The module daemon runs with a small per-call key limit so "too many keys" is cheap.
MAX_KEYS = 8
#: The daemon's defaults that messages quote.
MAX_MESSAGE_BYTES = 4 << 20
HANDSHAKE_TIMEOUT = 10.0
#: DRAM pool: room for every namespace this module declares (4 MiB extents each).
CAPACITY = 64 << 20

BB = 4096  # block_bytes of the shared namespace
NS = "bad/main"
SESSION_SOCKET = "kvtier-session.sock"
_LEN = struct.Struct(">I")

MISSING_METADATA = "missing 'kvtier-session' metadata: open a session first"
UNKNOWN_TOKEN = (
    "unknown session token (the session was closed or never opened; "
    "open one on the session channel)"
)
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]


# ====================================================================== fixtures
@pytest.fixture(scope="module")
def d() -> Iterator[DaemonProc]:
    """One daemon for the whole module: the cases below do not interfere."""
    with temp_daemon("--set", f"server.max_keys_per_call={MAX_KEYS}", capacity="64MiB") as proc:
        yield proc


_log_mark = {"at": 0}


@pytest.fixture(autouse=True)
def _mark_log(d: DaemonProc) -> None:
    """Where the daemon's log stood when the test began (see ``assert_serving``)."""
    _log_mark["at"] = len(d.log())


@pytest.fixture(scope="module")
def stub(d: DaemonProc) -> Iterator[pb_grpc.KVTierStub]:
    """A raw stub: no session metadata unless a test passes it."""
    with grpc.insecure_channel("unix:" + d.grpc_path) as ch:
        yield pb_grpc.KVTierStub(ch)


@pytest.fixture
def wire_reserves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients made after this reserve with the Reserve call, never from slots granted
    ahead: the test sends their reservation ids over the wire itself (a reservation from
    grants has none)."""
    monkeypatch.setenv(LOCAL_WRITES_ENV, "0")


@pytest.fixture
def client(d: DaemonProc) -> Iterator[kvtier.Client]:
    with kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BB, model_uid="m") as c:
        yield c


# ====================================================================== helpers
def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("kvtier-session", token),)


def uniq(prefix: str) -> bytes:
    return f"{prefix}-{uuid.uuid4().hex[:12]}".encode()


def block(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def wait_for(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def rpc_error(fn: Callable[..., Any], req: Any, **kw: Any) -> grpc.RpcError:
    """Call a raw stub method that must fail; its RpcError."""
    with pytest.raises(grpc.RpcError) as ei:
        fn(req, timeout=10, **kw)
    return ei.value


def assert_status(err: grpc.RpcError, code: grpc.StatusCode, details: str) -> None:
    assert (err.code(), err.details()) == (code, details)


def dram_balances(d: DaemonProc) -> pb.StatsResponse:
    s = d.stats()
    (t,) = s.tiers
    assert t.tier == pb.TIER_DRAM
    assert t.total_bytes == CAPACITY
    assert t.free_bytes + t.reserved_bytes + t.granted_bytes + t.committed_bytes \
        == t.total_bytes, t
    return s


def health_ok(d: DaemonProc) -> None:
    with grpc.insecure_channel("unix:" + d.grpc_path) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="kvtier.v1.KVTier"), timeout=10
        )
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def assert_serving(d: DaemonProc, *, settled: bool = True, log_clean: bool = True) -> None:
    """The daemon is alive, healthy, stores and returns bytes, and is consistent.

    With ``log_clean``, nothing this test sent escaped the daemon's own error
    handling (no traceback, no unretrieved task exception in its log).
    """
    assert d.alive(), d.log()
    health_ok(d)
    key = uniq("health")
    data = block(BB - 17, int.from_bytes(key[-4:], "little"))
    with kvtier.Client(d.socket_dir, namespace="bad/health", block_bytes=BB, model_uid="h") as c:
        assert c.put([key], [data]) == 1
        got = c.get([key])
        assert len(got) == 1 and np.array_equal(got[0], data)
        assert c.delete([key]) == 1
    assert d.check() == []
    dram_balances(d)
    if settled:  # nothing a finished case did may still hold capacity
        wait_for(lambda: (lambda s: (s.leases, s.reservations) == (0, 0))(d.stats()),
                 what="no leases and no reservations")
        assert dram_balances(d).tiers[0].reserved_bytes == 0
    if log_clean:
        new = d.log()[_log_mark["at"] :]
        for bad in ("Traceback", "exception was never retrieved"):
            assert bad not in new, new


def daemon_fds(d: DaemonProc) -> list[str]:
    return fd_targets(d.proc.pid)


def fd_targets(pid: int) -> list[str]:
    """What each open fd of process ``pid`` points at."""
    base = f"/proc/{pid}/fd"
    out = []
    for name in os.listdir(base):
        try:
            out.append(os.readlink(os.path.join(base, name)))
        except FileNotFoundError:
            pass  # closed while we looked
    return out


# ---------------------------------------------------------------- session channel
def sc_connect(d: DaemonProc, timeout: float = 15.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(os.path.join(d.socket_dir, SESSION_SOCKET))
    return s


def frame(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


def sc_send(s: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """Send ``data`` (fds ride on the first byte); a daemon that already hung up is fine."""
    try:
        if fds:
            sent = s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            data = data[sent:]
        if data:
            s.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


def recv_fds(s: socket.socket, n: int) -> tuple[bytes, int]:
    """One recvmsg: its bytes and how many fds came with them (closed at once)."""
    data, anc, _flags, _ = s.recvmsg(n, socket.CMSG_SPACE(253 * 4))
    count = 0
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            for fd in arr:
                os.close(fd)
            count += len(arr)
    return data, count


def _recv(s: socket.socket, n: int) -> bytes:
    """One recvmsg; fds that come with it are closed (this test maps nothing)."""
    return recv_fds(s, n)[0]


def sc_read_frame(s: socket.socket) -> pb.SessionResponse:
    buf = bytearray()
    need = _LEN.size
    while len(buf) < need:
        chunk = _recv(s, need - len(buf))
        assert chunk, "the daemon closed the session channel mid-frame"
        buf += chunk
        if len(buf) == _LEN.size:
            need += _LEN.unpack(buf)[0]
    return pb.SessionResponse.FromString(bytes(buf[_LEN.size :]))


def sc_read_raw(s: socket.socket, timeout: float) -> tuple[bytes, int]:
    """Every byte the daemon sends until it closes (EOF or reset), and how many fds came
    with them (closed at once)."""
    deadline = time.monotonic() + timeout
    buf = bytearray()
    nfds = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the daemon did not close the connection within {timeout} s")
        s.settimeout(left)
        try:
            data, n = recv_fds(s, 65536)
        except TimeoutError:
            raise AssertionError(f"the daemon did not close the connection within {timeout} s") from None
        except ConnectionResetError:
            break  # it closed with our unread bytes in its queue: a close all the same
        nfds += n
        if not data:
            break
        buf += data
    return bytes(buf), nfds


def parse_responses(buf: bytes) -> list[pb.SessionResponse]:
    """The length-prefixed SessionResponse frames of ``buf``, which holds whole frames only."""
    out = []
    while buf:
        assert len(buf) >= _LEN.size, f"trailing partial length prefix {buf!r}"
        (n,) = _LEN.unpack_from(buf)
        assert len(buf) >= _LEN.size + n, f"truncated response frame ({len(buf)} of {n} bytes)"
        out.append(pb.SessionResponse.FromString(buf[_LEN.size : _LEN.size + n]))
        buf = buf[_LEN.size + n :]
    return out


def sc_read_to_eof(s: socket.socket, timeout: float = 15.0) -> tuple[list[pb.SessionResponse], float]:
    """Everything the daemon sends until it closes (EOF or reset); and how long that took."""
    t0 = time.monotonic()
    buf, _ = sc_read_raw(s, timeout)
    elapsed = time.monotonic() - t0
    return parse_responses(buf), elapsed


def expect_session_error(s: socket.socket, code: int, message: str, timeout: float = 15.0) -> float:
    """Exactly one SessionError(code, message), then the daemon closes the connection."""
    resps, elapsed = sc_read_to_eof(s, timeout)
    assert [(r.WhichOneof("kind"), r.error.code, r.error.message) for r in resps] == [
        ("error", code, message)
    ]
    return elapsed


def open_body(name: str = NS, block_bytes: int = BB, model_uid: str = "m") -> bytes:
    req = pb.SessionRequest(
        open=pb.OpenSession(ns=pb.NamespaceDecl(name=name, block_bytes=block_bytes,
                                                model_uid=model_uid))
    )
    return req.SerializeToString()


def sc_open(d: DaemonProc, fds: Sequence[int] = ()) -> tuple[socket.socket, str]:
    """A raw session in NS: the connection (its liveness) and the token."""
    s = sc_connect(d)
    sc_send(s, frame(open_body()), fds)
    resp = sc_read_frame(s)
    assert resp.WhichOneof("kind") == "opened", resp
    return s, resp.opened.token


def wait_unauthenticated(stub: pb_grpc.KVTierStub, token: str) -> None:
    """The token stops working (the daemon ends the session as soon as it sees the close)."""

    def gone() -> bool:
        try:
            stub.Lookup(pb.LookupRequest(keys=[b"k"]), metadata=md(token), timeout=10)
        except grpc.RpcError as err:
            assert_status(err, grpc.StatusCode.UNAUTHENTICATED, UNKNOWN_TOKEN)
            return True
        return False

    wait_for(gone, what="the closed session's token to be refused")


# ====================================================================== key lists
CLIENT_CALLS: dict[str, Callable[[kvtier.Client, list[bytes]], Any]] = {
    "Lookup": lambda c, k: c.lookup(k),
    "Reserve": lambda c, k: c.reserve(k),
    "Acquire": lambda c, k: c.acquire(k),
    "Delete": lambda c, k: c.delete(k),
}
REQUESTS: dict[str, Callable[[list[bytes]], Any]] = {
    "Lookup": lambda k: pb.LookupRequest(keys=k),
    "Reserve": lambda k: pb.ReserveRequest(keys=k),
    "Acquire": lambda k: pb.AcquireRequest(keys=k),
    "Delete": lambda k: pb.DeleteRequest(keys=k),
}


def bad_key_list(case: str, present: bytes) -> tuple[list[bytes], str]:
    """A bad key list that includes a present key, and the daemon's exact message."""
    if case == "empty":
        return [], f"keys is empty (1..{MAX_KEYS} keys per call)"
    if case == "too_many":
        keys = [present] + [b"m%d" % i for i in range(MAX_KEYS)]
        return keys, f"{MAX_KEYS + 1} keys exceed max_keys_per_call {MAX_KEYS}"
    if case == "far_too_many":  # also too long: the count is reported first
        keys = [present] + [b"%065d" % i for i in range(1000)]
        return keys, f"1001 keys exceed max_keys_per_call {MAX_KEYS}"
    if case == "key_65_bytes":
        return [present, b"k" * 65], "keys[1] is 65 bytes (1..64 allowed)"
    if case == "key_zero_bytes":
        return [present, b"x", b""], "keys[2] is 0 bytes (1..64 allowed)"
    raise AssertionError(case)


KEY_CASES = ["empty", "too_many", "far_too_many", "key_65_bytes", "key_zero_bytes"]


@pytest.mark.parametrize("case", KEY_CASES)
@pytest.mark.parametrize("method", list(CLIENT_CALLS))
def test_bad_key_list_is_invalid_argument_and_changes_nothing(
    d: DaemonProc, stub: pb_grpc.KVTierStub, client: kvtier.Client, method: str, case: str
) -> None:
    present = uniq("present")
    data = block(BB, 1)
    assert client.put([present], [data]) == 1
    keys, message = bad_key_list(case, present)

    with pytest.raises(errors.InvalidArgument) as ei:
        CLIENT_CALLS[method](client, keys)
    assert type(ei.value) is errors.InvalidArgument
    assert str(ei.value) == message

    err = rpc_error(getattr(stub, method), REQUESTS[method](keys), metadata=md(client.token))
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, message)

    # All or nothing: the present key was neither deleted nor leased, nothing was reserved.
    s = d.stats()
    assert (s.leases, s.reservations) == (0, 0)
    got = client.get([present])
    assert len(got) == 1 and np.array_equal(got[0], data)
    valid = [k for k in keys[1:] if 0 < len(k) <= 64]
    if valid:
        # The valid keys of the refused call are not IN_FLIGHT: reservable now.
        with client.reserve(valid[:1]) as r:
            assert r.statuses == [kvtier.KeyStatus.RESERVED]
    client.delete([present])
    assert_serving(d)


@pytest.mark.parametrize("method", list(CLIENT_CALLS))
def test_key_limits_are_inclusive(d: DaemonProc, client: kvtier.Client, method: str) -> None:
    keys = [uniq("lim")[:8] + b"%056d" % i for i in range(MAX_KEYS)]
    assert all(len(k) == 64 for k in keys)
    result = CLIENT_CALLS[method](client, keys)
    if method == "Reserve":
        assert result.statuses == [kvtier.KeyStatus.RESERVED] * MAX_KEYS
        for i in result.reserved:
            result.write(i, b"v")
        assert result.commit() == MAX_KEYS
        assert client.lookup(keys) == MAX_KEYS
        assert client.delete(keys) == MAX_KEYS
    elif method == "Acquire":
        with result as lease:
            assert lease.hits == 0
    else:
        assert result == 0
    assert_serving(d)


def test_duplicate_keys_in_reserve_and_acquire(d: DaemonProc, client: kvtier.Client) -> None:
    a, b = uniq("dup"), uniq("dup")
    assert client.put([a], [b"aaa"]) == 1
    with pytest.raises(errors.InvalidArgument) as ei:
        client.reserve([b, a, b])
    assert type(ei.value) is errors.InvalidArgument
    assert str(ei.value) == "duplicate key at index 2"
    with pytest.raises(errors.InvalidArgument) as ei:
        client.acquire([a, a])
    assert type(ei.value) is errors.InvalidArgument
    assert str(ei.value) == "duplicate keys in one acquire"
    s = d.stats()
    assert (s.leases, s.reservations) == (0, 0)
    # Nothing was half-applied: b is not in flight, a is intact.
    assert client.put([b], [b"bbb"]) == 1
    assert [bytes(v) for v in client.get([a, b])] == [b"aaa", b"bbb"]
    # Duplicates are harmless where they cannot pin twice.
    assert client.lookup([a, a, b]) == 3
    assert client.delete([a, a, b]) == 2
    assert_serving(d)


def test_block_larger_than_block_bytes_is_refused_before_reserving(
    d: DaemonProc, client: kvtier.Client
) -> None:
    k = uniq("big")
    with pytest.raises(errors.InvalidArgument) as ei:
        client.put([k], [np.zeros(BB + 1, np.uint8)])
    assert type(ei.value) is errors.InvalidArgument
    assert str(ei.value) == f"blocks[0] is {BB + 1} bytes; a block holds 1..{BB} bytes"
    assert client.lookup([k]) == 0
    assert d.stats().reservations == 0
    assert_serving(d)


def test_client_side_argument_errors(d: DaemonProc, client: kvtier.Client) -> None:
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: client.lookup(b"one bytes object"),  # type: ignore[arg-type]
         "keys must be a sequence of bytes objects, not one bytes object"),
        (lambda: client.reserve([b"ok", "str"]),  # type: ignore[list-item]
         "keys[1] is str, expected bytes"),
        (lambda: client.put([b"a", b"b"], [b"x"]), "keys and blocks differ in length (2 != 1)"),
        (lambda: client.put([b"a"], [b""]), f"blocks[0] is 0 bytes; a block holds 1..{BB} bytes"),
        (lambda: client.put([b"a"], [object()]),
         "blocks[0] (object) does not support the buffer protocol"),
        (lambda: client.put([b"a"], [np.zeros((4, 4), np.uint8)[:, ::2]]),
         "blocks[0] is not C-contiguous"),
    ]
    for call, message in cases:
        with pytest.raises(errors.InvalidArgument) as ei:
            call()
        assert type(ei.value) is errors.InvalidArgument
        assert str(ei.value) == message
    assert client.lookup([b"a"]) == 0
    assert d.stats().reservations == 0
    assert_serving(d)


def test_a_reservations_write_blocks_names_a_bad_block_and_copies_nothing(
    d: DaemonProc, client: kvtier.Client
) -> None:
    """``Reservation.write_blocks`` checks every block in its one native call: a bad one
    is named as ``put`` names it, nothing of the call is copied, and the reservation
    goes on to take good blocks."""
    keys = [uniq("wb-a"), uniq("wb-b")]
    bad: list[tuple[Any, str]] = [
        (np.zeros(BB + 1, np.uint8), f"blocks[1] is {BB + 1} bytes; a block holds 1..{BB} bytes"),
        (b"", f"blocks[1] is 0 bytes; a block holds 1..{BB} bytes"),
        (object(), "blocks[1] (object) does not support the buffer protocol"),
        (np.zeros((4, 4), np.uint8)[:, ::2], "blocks[1] is not C-contiguous"),
    ]
    with client.reserve(keys) as r:
        for block, message in bad:
            with pytest.raises(errors.InvalidArgument) as ei:
                r.write_blocks([b"first", block])
            assert type(ei.value) is errors.InvalidArgument
            assert str(ei.value) == message
            assert ei.value.__cause__ is None and ei.value.__suppress_context__
        assert r.lengths == [None, None]  # nothing written
        r.write_blocks([b"first", np.full((2, 3), 7, np.uint8)])
        assert r.commit() == 2
    got = client.get(keys)
    assert got[0].tobytes() == b"first" and got[1].tobytes() == bytes([7] * 6)
    assert_serving(d)


def test_message_over_max_message_bytes_is_resource_exhausted(
    d: DaemonProc, stub: pb_grpc.KVTierStub, client: kvtier.Client
) -> None:
    huge = b"x" * (MAX_MESSAGE_BYTES + (1 << 20))
    req = pb.ReserveRequest(keys=[huge])
    size = req.ByteSize()
    expected = f"SERVER: Received message larger than max ({size} vs. {MAX_MESSAGE_BYTES})"
    err = rpc_error(stub.Reserve, req, metadata=md(client.token))
    assert_status(err, grpc.StatusCode.RESOURCE_EXHAUSTED, expected)
    with pytest.raises(errors.CapacityExhausted) as ei:
        client.reserve([huge])
    size = pb.ReserveRequest(keys=[huge], packed_slots=True).ByteSize()  # (the client asks)
    assert str(ei.value) == (f"SERVER: Received message larger than max ({size} vs. "
                             f"{MAX_MESSAGE_BYTES})")
    # The connection and the session survive: the same client keeps working.
    k = uniq("after-huge")
    assert client.put([k], [b"ok"]) == 1
    assert [bytes(v) for v in client.get([k])] == [b"ok"]
    client.delete([k])
    assert_serving(d)


# ====================================================================== sessions / tokens
def _session_requests() -> dict[str, Any]:
    return {
        "Lookup": pb.LookupRequest(keys=[b"k"]),
        "Reserve": pb.ReserveRequest(keys=[b"k"]),
        "Commit": pb.CommitRequest(reservation_id=1, lengths=[1]),
        "Abort": pb.AbortRequest(reservation_id=1),
        "Acquire": pb.AcquireRequest(keys=[b"k"]),
        "Release": pb.ReleaseRequest(lease_id=1),
        "Delete": pb.DeleteRequest(keys=[b"k"]),
    }


SESSION_METHODS = list(_session_requests())


@pytest.mark.parametrize("method", SESSION_METHODS)
def test_missing_session_metadata_is_unauthenticated(
    d: DaemonProc, stub: pb_grpc.KVTierStub, method: str
) -> None:
    req = _session_requests()[method]
    err = rpc_error(getattr(stub, method), req)
    assert_status(err, grpc.StatusCode.UNAUTHENTICATED, MISSING_METADATA)
    # Other metadata is not a session either.
    err = rpc_error(getattr(stub, method), req, metadata=(("kvtier-sessions", "x"),))
    assert_status(err, grpc.StatusCode.UNAUTHENTICATED, MISSING_METADATA)
    assert_serving(d)


@pytest.mark.parametrize("token", ["", "0" * 32, "not a token", "f" * 4096])
@pytest.mark.parametrize("method", SESSION_METHODS)
def test_unknown_token_is_unauthenticated(
    d: DaemonProc, stub: pb_grpc.KVTierStub, method: str, token: str
) -> None:
    err = rpc_error(getattr(stub, method), _session_requests()[method], metadata=md(token))
    assert_status(err, grpc.StatusCode.UNAUTHENTICATED, UNKNOWN_TOKEN)
    assert_serving(d)


def test_token_of_closed_client_is_unauthenticated(d: DaemonProc, stub: pb_grpc.KVTierStub) -> None:
    c = kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BB, model_uid="m")
    k = uniq("closed")
    assert c.put([k], [b"kept"]) == 1
    token = c.token
    c.close()
    wait_unauthenticated(stub, token)
    for method, req in _session_requests().items():
        err = rpc_error(getattr(stub, method), req, metadata=md(token))
        assert_status(err, grpc.StatusCode.UNAUTHENTICATED, UNKNOWN_TOKEN)
    # What the closed session committed is not lost.
    with kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BB, model_uid="m") as c2:
        assert [bytes(v) for v in c2.get([k])] == [b"kept"]
        c2.delete([k])
    assert_serving(d)


# A client-side "this client is not usable" error: AsyncClient already answers a
# call before open() with FailedPrecondition; Unauthenticated ("belongs to a
# closed session") would be as clear.  Either, never an exception from outside
# kvtier.errors (errors.py: callers never see grpc's own exceptions).
CLOSED_CLIENT_ERRORS = (errors.FailedPrecondition, errors.Unauthenticated)


def test_closed_client_raises_a_kvtier_error(d: DaemonProc) -> None:
    c = kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BB, model_uid="m")
    c.close()
    for call in (lambda: c.lookup([b"k"]), lambda: c.put([b"k"], [b"v"]),
                 lambda: c.get([b"k"]), lambda: c.delete([b"k"])):
        with pytest.raises(CLOSED_CLIENT_ERRORS) as ei:
            call()
        assert "closed" in str(ei.value)
    assert_serving(d)


def test_async_client_used_before_open_raises_failed_precondition(d: DaemonProc) -> None:
    async def go() -> None:
        c = kvtier.AsyncClient(d.socket_dir, namespace=NS, block_bytes=BB, model_uid="m")
        for call in (lambda: c.lookup([b"k"]), lambda: c.reserve([b"k"]),
                     lambda: c.acquire([b"k"]), lambda: c.delete([b"k"])):
            with pytest.raises(errors.FailedPrecondition) as ei:
                await call()
            assert str(ei.value) == "AsyncClient is not open: use 'async with' or 'await open()'"

    asyncio.run(go())
    assert_serving(d)


def test_closed_async_client_raises_a_kvtier_error(d: DaemonProc) -> None:
    async def go() -> None:
        c = kvtier.AsyncClient(d.socket_dir, namespace=NS, block_bytes=BB, model_uid="m")
        await c.open()
        await c.close()
        with pytest.raises(CLOSED_CLIENT_ERRORS) as ei:
            await c.lookup([b"k"])
        assert "closed" in str(ei.value)

    asyncio.run(go())
    assert_serving(d)


def test_client_whose_session_link_closed_reopens_and_reports_the_old_reservation_lost(
        d: DaemonProc) -> None:
    c = kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BB, model_uid="m")
    try:
        k = uniq("link")
        r = c.reserve([k])
        r.write(0, b"half-written")
        old_token = c.token
        c._link.close()  # the session's liveness ends; the gRPC channel is still open

        def reopened() -> bool:
            # The daemon refuses the old token once it saw the close; the client
            # then opens a new session and retries the (session-free) lookup.
            return c.lookup([k]) == 0 and c.token != old_token

        wait_for(reopened, what="the client to reopen its session")
        with pytest.raises(errors.SessionLost) as ei:
            r.commit()
        assert str(ei.value) == "reservation was lost: its session ended (kvtierd restarted or the session connection dropped)"
        assert c.lookup([k]) == 0
    finally:
        c.close()
    # The reservation was returned with the session, never committed.
    with kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BB, model_uid="m") as c2:
        assert c2.lookup([k]) == 0
        with c2.reserve([k]) as r2:
            assert r2.statuses == [kvtier.KeyStatus.RESERVED]
    assert_serving(d)


def test_token_of_closed_raw_session_is_unauthenticated(
    d: DaemonProc, stub: pb_grpc.KVTierStub
) -> None:
    s, token = sc_open(d)
    resp = stub.Lookup(pb.LookupRequest(keys=[b"k"]), metadata=md(token), timeout=10)
    assert resp.hits == 0
    s.close()
    wait_unauthenticated(stub, token)
    assert_serving(d)


def test_second_open_session_on_one_connection_is_refused(
    d: DaemonProc, stub: pb_grpc.KVTierStub
) -> None:
    s, token = sc_open(d)
    with s:
        sc_send(s, frame(open_body()))
        expect_session_error(s, PRECONDITION, "this connection already has a session")
    # The connection was the session's liveness: its token is gone with it.
    wait_unauthenticated(stub, token)
    assert_serving(d)


# ====================================================================== reservations
@pytest.fixture
def cns(d: DaemonProc) -> Iterator[kvtier.Client]:
    """A namespace whose block_bytes (5000) differs from its slot size (8192)."""
    with kvtier.Client(d.socket_dir, namespace="bad/commit", block_bytes=5000,
                       model_uid="m") as c:
        yield c


@pytest.mark.parametrize("method", ["Commit", "Abort"])
def test_reservation_id_zero_is_invalid_argument(
    d: DaemonProc, stub: pb_grpc.KVTierStub, client: kvtier.Client, method: str
) -> None:
    req = (pb.CommitRequest(reservation_id=0, lengths=[1]) if method == "Commit"
           else pb.AbortRequest(reservation_id=0))
    err = rpc_error(getattr(stub, method), req, metadata=md(client.token))
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT,
                  "reservation_id is required (0 is not a reservation)")
    assert_serving(d)


def not_open(rid: int) -> str:
    return (f"reservation {rid} is not open in this session "
            "(never issued, already committed or aborted, or expired)")


@pytest.mark.parametrize("rid", [1, 987654321, 2**64 - 1])
@pytest.mark.parametrize("method", ["Commit", "Abort"])
def test_unknown_reservation_is_not_found(
    d: DaemonProc, stub: pb_grpc.KVTierStub, client: kvtier.Client, method: str, rid: int
) -> None:
    req = (pb.CommitRequest(reservation_id=rid, lengths=[1]) if method == "Commit"
           else pb.AbortRequest(reservation_id=rid))
    err = rpc_error(getattr(stub, method), req, metadata=md(client.token))
    assert_status(err, grpc.StatusCode.NOT_FOUND, not_open(rid))
    assert_serving(d)


def test_commit_or_abort_twice_is_not_found(
    d: DaemonProc, stub: pb_grpc.KVTierStub, wire_reserves: None, client: kvtier.Client
) -> None:
    k1, k2 = uniq("twice"), uniq("twice")
    r = client.reserve([k1])
    r.write(0, b"one")
    assert r.commit() == 1
    err = rpc_error(stub.Commit, pb.CommitRequest(reservation_id=r.reservation_id, lengths=[3]),
                    metadata=md(client.token))
    assert_status(err, grpc.StatusCode.NOT_FOUND, not_open(r.reservation_id))
    err = rpc_error(stub.Abort, pb.AbortRequest(reservation_id=r.reservation_id),
                    metadata=md(client.token))
    assert_status(err, grpc.StatusCode.NOT_FOUND, not_open(r.reservation_id))
    assert r.commit() == 0  # the client knows it is done: a no-op, not an error

    r2 = client.reserve([k2])
    r2.abort()
    for req in (pb.AbortRequest(reservation_id=r2.reservation_id),
                pb.CommitRequest(reservation_id=r2.reservation_id, lengths=[1])):
        method = stub.Abort if isinstance(req, pb.AbortRequest) else stub.Commit
        err = rpc_error(method, req, metadata=md(client.token))
        assert_status(err, grpc.StatusCode.NOT_FOUND, not_open(r2.reservation_id))
    # The committed block is intact; the aborted key is free to write again.
    assert [bytes(v) for v in client.get([k1])] == [b"one"]
    assert client.lookup([k2]) == 0
    assert client.put([k2], [b"two"]) == 1
    client.delete([k1, k2])
    assert_serving(d)


def test_other_sessions_reservation_and_lease_are_not_found(
    d: DaemonProc, stub: pb_grpc.KVTierStub, wire_reserves: None, client: kvtier.Client
) -> None:
    held, new = uniq("own"), uniq("own")
    assert client.put([held], [b"held"]) == 1
    lease = client.acquire([held])
    r = client.reserve([new])
    r.write(0, b"new")
    with kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BB, model_uid="m") as other:
        theirs = md(other.token)
        err = rpc_error(stub.Commit, pb.CommitRequest(reservation_id=r.reservation_id,
                                                      lengths=[3]), metadata=theirs)
        assert_status(err, grpc.StatusCode.NOT_FOUND, not_open(r.reservation_id))
        err = rpc_error(stub.Abort, pb.AbortRequest(reservation_id=r.reservation_id),
                        metadata=theirs)
        assert_status(err, grpc.StatusCode.NOT_FOUND, not_open(r.reservation_id))
        err = rpc_error(stub.Release, pb.ReleaseRequest(lease_id=lease.lease_id),
                        metadata=theirs)
        assert_status(err, grpc.StatusCode.NOT_FOUND,
                      f"lease {lease.lease_id} is not held by this session "
                      "(already released, or expired)")
        # The owner's reservation and lease are untouched.
        s = d.stats()
        assert (s.leases, s.reservations) == (1, 1)
        assert other.lookup([new]) == 0
    assert r.commit() == 1
    assert bytes(lease.views[0]) == b"held"
    lease.release()
    assert [bytes(v) for v in client.get([held, new])] == [b"held", b"new"]
    client.delete([held, new])
    assert_serving(d)


def _bad_commits(rid: int) -> list[tuple[list[int], list[int], str]]:
    return [
        ([5000], [], f"reservation {rid} has 2 slots but 1 lengths were given"),
        ([], [], f"reservation {rid} has 2 slots but 0 lengths were given"),
        ([5000, 1, 1], [], f"reservation {rid} has 2 slots but 3 lengths were given"),
        ([5000, 0], [], "lengths[1] = 0 is outside 1..5000 (block_bytes)"),
        ([5001, 1], [], "lengths[0] = 5001 is outside 1..5000 (block_bytes)"),
        ([8192, 1], [], "lengths[0] = 8192 is outside 1..5000 (block_bytes)"),  # a whole slot
        ([2**64 - 1, 1], [], "lengths[0] = 18446744073709551615 is outside 1..5000 (block_bytes)"),
        ([5000, 1], [7], "lengths and checksums differ in length (2 != 1)"),
        ([5000, 1], [7, 8, 9], "lengths and checksums differ in length (2 != 3)"),
    ]


def test_malformed_commit_is_invalid_argument_and_keeps_the_reservation(
    d: DaemonProc, stub: pb_grpc.KVTierStub, wire_reserves: None, cns: kvtier.Client
) -> None:
    k1, k2 = uniq("mal"), uniq("mal")
    d1, d2 = block(5000, 2), block(1, 3)
    r = cns.reserve([k1, k2])
    r.write(0, d1)
    r.write(1, d2)
    for lengths, checksums, message in _bad_commits(r.reservation_id):
        err = rpc_error(stub.Commit, pb.CommitRequest(reservation_id=r.reservation_id,
                                                      lengths=lengths, checksums=checksums),
                        metadata=md(cns.token))
        assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, message)
        # Still open, nothing visible, capacity still reserved (2 slots of 8192).
        s = dram_balances(d)
        assert s.reservations == 1
        assert s.tiers[0].reserved_bytes == 2 * 8192
        assert cns.lookup([k1]) == 0
        assert d.check() == []
    assert r.commit() == 2
    got = cns.get([k1, k2])
    assert [g.tobytes() for g in got] == [d1.tobytes(), d2.tobytes()]
    cns.delete([k1, k2])
    assert_serving(d)


# ====================================================================== leases
def test_bad_release_is_refused_and_keeps_the_lease(
    d: DaemonProc, stub: pb_grpc.KVTierStub, client: kvtier.Client
) -> None:
    k = uniq("rel")
    assert client.put([k], [b"leased"]) == 1
    mine = md(client.token)
    err = rpc_error(stub.Release, pb.ReleaseRequest(lease_id=0), metadata=mine)
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, "lease_id is required (0 is not a lease)")
    for lid in (424242, 2**64 - 1):
        err = rpc_error(stub.Release, pb.ReleaseRequest(lease_id=lid), metadata=mine)
        assert_status(err, grpc.StatusCode.NOT_FOUND,
                      f"lease {lid} is not held by this session (already released, or expired)")
    lease = stub.Acquire(pb.AcquireRequest(keys=[k]), metadata=mine, timeout=10)  # a call's
    assert d.stats().leases == 1
    stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id), metadata=mine, timeout=10)
    assert d.stats().leases == 0
    err = rpc_error(stub.Release, pb.ReleaseRequest(lease_id=lease.lease_id), metadata=mine)
    assert_status(err, grpc.StatusCode.NOT_FOUND,
                  f"lease {lease.lease_id} is not held by this session "
                  "(already released, or expired)")
    # Pin counts did not go negative: the block is still there and leasable once.
    with client.acquire([k]) as again:
        assert bytes(again.views[0]) == b"leased"
        assert d.stats().leases == 1
    client.delete([k])
    assert_serving(d)


def test_client_double_release_is_a_no_op(d: DaemonProc, client: kvtier.Client) -> None:
    k = uniq("rel2")
    assert client.put([k], [b"x"]) == 1
    lease = client.acquire([k])
    lease.release()
    lease.release()
    with lease:
        pass
    assert d.stats().leases == 0
    client.delete([k])
    assert_serving(d)


# ====================================================================== namespaces
def conflict_message(name: str, bb: int, uid: str, bb2: int, uid2: str) -> str:
    return (f"namespace {name!r} is declared with block_bytes={bb} model_uid={uid!r}; "
            f"refusing block_bytes={bb2} model_uid={uid2!r}")


@pytest.mark.parametrize("bb2, uid2", [(8192, "m1"), (4095, "m1"), (4096, "m2"), (8192, "M1")])
def test_conflicting_namespace_layout_is_failed_precondition(
    d: DaemonProc, bb2: int, uid2: str
) -> None:
    name = "bad/conflict"
    with kvtier.Client(d.socket_dir, namespace=name, block_bytes=4096, model_uid="m1") as first:
        k = uniq("c")
        assert first.put([k], [b"first"]) == 1
        with pytest.raises(errors.FailedPrecondition) as ei:
            kvtier.Client(d.socket_dir, namespace=name, block_bytes=bb2, model_uid=uid2)
        assert type(ei.value) is errors.FailedPrecondition
        assert str(ei.value) == conflict_message(name, 4096, "m1", bb2, uid2)
        # The same over the raw session channel, and the connection is closed.
        with sc_connect(d) as s:
            sc_send(s, frame(open_body(name, bb2, uid2)))
            expect_session_error(s, PRECONDITION, conflict_message(name, 4096, "m1", bb2, uid2))
        # The first client keeps working and the namespace keeps its layout.
        assert [bytes(v) for v in first.get([k])] == [b"first"]
        k2 = uniq("c")
        assert first.put([k2], [b"second"]) == 1
        (ns,) = [n for n in d.stats().namespaces if n.name == name]
        assert (ns.block_bytes, ns.model_uid) == (4096, "m1")
        wait_for(lambda: [n.sessions for n in d.stats().namespaces if n.name == name] == [1],
                 what="the refused sessions not to count")
        first.delete([k, k2])
    assert_serving(d)


BAD_DECLS = [
    ("", BB, "m", "namespace name '' must be 1..128 characters of [A-Za-z0-9._/-]"),
    ("has space", BB, "m", "namespace name 'has space' must be 1..128 characters of [A-Za-z0-9._/-]"),
    ("a" * 129, BB, "m", f"namespace name {'a' * 129!r} must be 1..128 characters of [A-Za-z0-9._/-]"),
    ("tr\u00e4ge", BB, "m", "namespace name 'tr\u00e4ge' must be 1..128 characters of [A-Za-z0-9._/-]"),
    ("nl\n", BB, "m", "namespace name 'nl\\n' must be 1..128 characters of [A-Za-z0-9._/-]"),
    ("nul\x00", BB, "m", "namespace name 'nul\\x00' must be 1..128 characters of [A-Za-z0-9._/-]"),
    ("bad/decl", 0, "m", "block_bytes is required and must be > 0"),
    ("bad/decl", BB, "", "model_uid must be 1..256 bytes of UTF-8, got 0"),
    ("bad/decl", BB, "u" * 257, "model_uid must be 1..256 bytes of UTF-8, got 257"),
    ("bad/decl", 1 << 40, "m", f"block_bytes {1 << 40} does not fit in dram.capacity {CAPACITY}"),
    ("bad/decl", 2**64 - 1, "m",
     f"block_bytes {2**64 - 1} does not fit in dram.capacity {CAPACITY}"),
]


@pytest.mark.parametrize("name, bb, uid, message", BAD_DECLS,
                         ids=[f"decl{i}" for i in range(len(BAD_DECLS))])
def test_bad_namespace_declaration_is_invalid_argument(
    d: DaemonProc, name: str, bb: int, uid: str, message: str
) -> None:
    with sc_connect(d) as s:
        sc_send(s, frame(open_body(name, bb, uid)))
        expect_session_error(s, INVALID, message)
    if bb > 0:  # (the client refuses block_bytes 0 itself, below)
        with pytest.raises(errors.InvalidArgument) as ei:
            kvtier.Client(d.socket_dir, namespace=name, block_bytes=bb, model_uid=uid)
        assert type(ei.value) is errors.InvalidArgument
        assert str(ei.value) == message
    # A refused declaration declares nothing.
    assert name not in [n.name for n in d.stats().namespaces]
    assert_serving(d)


def test_client_refuses_block_bytes_zero_itself(d: DaemonProc) -> None:
    with pytest.raises(errors.InvalidArgument) as ei:
        kvtier.Client(d.socket_dir, namespace="bad/decl", block_bytes=0, model_uid="m")
    assert str(ei.value) == "block_bytes must be a positive int, got 0"
    assert_serving(d)


def test_namespace_declaration_limits_are_inclusive(d: DaemonProc) -> None:
    name = "N" * 120 + "._/-a-Z9"
    assert len(name) == 128
    with kvtier.Client(d.socket_dir, namespace=name, block_bytes=1, model_uid="u" * 256) as c:
        k = uniq("lim")
        assert c.put([k], [b"z"]) == 1
        assert [bytes(v) for v in c.get([k])] == [b"z"]
        c.delete([k])
    assert_serving(d)


@pytest.mark.parametrize("uid", ["\u20ac" * 86, "\u20ac" * 256, "\u00fc" * 129],
                         ids=["86-euro-258-bytes", "256-euro-768-bytes", "129-umlaut-258-bytes"])
def test_multibyte_model_uid_is_refused_or_recorded_exactly(d: DaemonProc, uid: str) -> None:
    """A model_uid within 1..256 characters but over 256 UTF-8 bytes must not be truncated.

    The segment header has room for 256 bytes of model_uid; what the daemon
    accepts it must record exactly (the warm restart matches extents to their
    namespace by it), or refuse at declaration.
    """
    ns = f"bad/uid-{len(uid.encode())}-{len(uid)}"
    try:
        c = kvtier.Client(d.socket_dir, namespace=ns, block_bytes=BB, model_uid=uid)
    except errors.InvalidArgument as exc:
        assert "model_uid" in str(exc)
    else:
        with c:
            k = uniq("uid")
            assert c.put([k], [b"v"]) == 1  # creates extent 0 of the namespace
            # the header is in the extent's daemon-only metadata file
            with open(os.path.join(d.shm_dir, segment_file_name(ns, 0, META_SUFFIX)), "rb") as f:
                header = read_header(f.read(8192))
            assert header["namespace"] == ns
            assert header["model_uid"] == uid
            c.delete([k])
    assert_serving(d)


# ====================================================================== session channel framing
def test_length_prefix_over_the_limit_closes_the_connection(d: DaemonProc) -> None:
    for length in (MAX_OPEN_FRAME + 1, MAX_REQUEST_FRAME + 1, 0xFFFFFFFF):
        with sc_connect(d) as s:
            sc_send(s, _LEN.pack(length) + b"\x00" * 64)
            elapsed = expect_session_error(
                s, INVALID, f"frame of {length} bytes exceeds {MAX_OPEN_FRAME} before a "
                "session is open")
            assert elapsed < 5
    s, _token = sc_open(d)  # in a session the limit is MAX_REQUEST_FRAME
    with s:
        length = MAX_REQUEST_FRAME + 1
        sc_send(s, _LEN.pack(length) + b"\x00" * 64)
        expect_session_error(s, INVALID, f"frame of {length} bytes exceeds {MAX_REQUEST_FRAME}")
    assert_serving(d)


def test_frame_of_exactly_the_limit_is_read_and_refused(d: DaemonProc) -> None:
    with sc_connect(d) as s:
        sc_send(s, frame(b"\x00" * MAX_OPEN_FRAME))  # field number 0: not a SessionRequest
        expect_session_error(s, INVALID, "session channel frame is not a SessionRequest")
    assert_serving(d)


@pytest.mark.parametrize("body", [
    b"\xff\xff\xff",
    b"\x0a",  # truncated field
    b"\x0a\x05\x0a\x03\xff\xfe\xfd",  # namespace name that is not UTF-8
    b"\x0a\x7f\x0a",  # submessage longer than the frame
    b"GET / HTTP/1.1\r\n\r\n",
], ids=["ff", "truncated", "not-utf8", "overlong", "http"])
def test_frame_that_is_not_a_session_request(d: DaemonProc, body: bytes) -> None:
    with sc_connect(d) as s:
        sc_send(s, frame(body))
        expect_session_error(s, INVALID, "session channel frame is not a SessionRequest")
    assert_serving(d)


@pytest.mark.parametrize("body", [b"", b"\x08\x01", b"\x2a\x00"], ids=["empty", "unknown-varint",
                                                                      "unknown-field-5"])
def test_empty_session_request(d: DaemonProc, body: bytes) -> None:
    with sc_connect(d) as s:
        sc_send(s, frame(body))
        expect_session_error(s, INVALID, "empty SessionRequest (set open, map, admin or call)")
    assert_serving(d)


def test_map_segments_before_open_session(d: DaemonProc) -> None:
    with sc_connect(d) as s:
        req = pb.SessionRequest(map=pb.MapSegments(want_fds=[1, 2, 3]))
        sc_send(s, frame(req.SerializeToString()))
        expect_session_error(s, PRECONDITION, "MapSegments before OpenSession")
    assert_serving(d)


def test_open_with_empty_declaration(d: DaemonProc) -> None:
    with sc_connect(d) as s:
        sc_send(s, frame(b"\x0a\x00"))  # open {} : every field missing
        expect_session_error(s, INVALID,
                             "namespace name '' must be 1..128 characters of [A-Za-z0-9._/-]")
    assert_serving(d)


RANDOM_OUTCOMES = {
    (INVALID, "session channel frame is not a SessionRequest"),
    (INVALID, "empty SessionRequest (set open, map, admin or call)"),
    (PRECONDITION, "MapSegments before OpenSession"),
    (PRECONDITION, "FastCall before OpenSession or OpenAdmin"),
}


@pytest.mark.parametrize("framed", [False, True], ids=["raw", "framed"])
def test_random_bytes_to_session_socket(d: DaemonProc, framed: bool) -> None:
    """Junk gets a SessionError (or a plain close) and never a session; fast, not by timeout."""
    answered = 0
    for seed in range(40):
        rng = random.Random(seed * 2 + framed)
        junk = rng.randbytes(rng.randint(1, 4096))
        with sc_connect(d) as s:
            sc_send(s, frame(junk) if framed else junk)
            try:
                s.shutdown(socket.SHUT_WR)  # a short frame ends at EOF instead of waiting
            except OSError:
                pass  # it already hung up
            resps, elapsed = sc_read_to_eof(s)
        assert elapsed < 5, (seed, elapsed)
        assert len(resps) <= 1, resps
        for r in resps:
            assert r.WhichOneof("kind") == "error", (seed, r)
            got = (r.error.code, r.error.message)
            ok = got in RANDOM_OUTCOMES or (
                got[0] == INVALID and got[1].startswith(("namespace name ", "frame of ",
                                                         "block_bytes ", "model_uid "))
            )
            assert ok, (seed, got)
            answered += 1
    assert answered >= 30  # mostly an explicit SessionError, not just a hang-up
    assert_serving(d)


def test_silent_connections_are_dropped_after_the_handshake_timeout(
    d: DaemonProc, stub: pb_grpc.KVTierStub
) -> None:
    """Connections that never declare a namespace are closed at 10 s; others are served meanwhile."""
    silent = [sc_connect(d, timeout=20) for _ in range(20)]
    partial = [sc_connect(d, timeout=20) for _ in range(5)]
    for s in partial:  # a frame that never completes
        sc_send(s, _LEN.pack(100) + b"\x0a")
    t0 = time.monotonic()
    try:
        # Served while they dangle: a full round trip and a raw session.
        assert_serving(d)
        s2, token = sc_open(d)
        with s2:
            assert stub.Lookup(pb.LookupRequest(keys=[b"k"]), metadata=md(token),
                               timeout=10).hits == 0
        for s in silent + partial:
            left = t0 + HANDSHAKE_TIMEOUT + 5 - time.monotonic()
            expect_session_error(s, INVALID, "no OpenSession within 10 s of connecting",
                                 timeout=max(left, 0.1))
        elapsed = time.monotonic() - t0
        assert HANDSHAKE_TIMEOUT - 1 <= elapsed <= HANDSHAKE_TIMEOUT + 5, elapsed
    finally:
        for s in silent + partial:
            s.close()
    assert_serving(d)


def test_fds_sent_to_the_daemon_do_not_leak(d: DaemonProc, stub: pb_grpc.KVTierStub) -> None:
    marker = tempfile.NamedTemporaryFile(prefix="kvt-fd-marker-", dir="/tmp")
    own: list[int] = []
    try:
        own = [os.open(marker.name, os.O_RDONLY) for _ in range(3)]
        r, w = os.pipe()
        own += [r, w]
        pipe = os.readlink(f"/proc/self/fd/{r}")
        assert_serving(d)

        def count() -> int:
            return len(daemon_fds(d))

        baseline = count()
        kinds = ["open", "garbage", "map", "empty", "bad-decl"]
        for i in range(50):
            kind = kinds[i % len(kinds)]
            if kind == "open":
                s, token = sc_open(d, fds=own)
                with s:
                    stub.Lookup(pb.LookupRequest(keys=[b"k"]), metadata=md(token), timeout=10)
                continue
            with sc_connect(d) as s:
                if kind == "garbage":
                    sc_send(s, frame(b"\xff\xff\xff"), own)
                    expect_session_error(s, INVALID, "session channel frame is not a SessionRequest")
                elif kind == "map":
                    sc_send(s, frame(pb.SessionRequest(map=pb.MapSegments(want_fds=[1]))
                                     .SerializeToString()), own)
                    expect_session_error(s, PRECONDITION, "MapSegments before OpenSession")
                elif kind == "empty":
                    sc_send(s, frame(b""), own)
                    expect_session_error(s, INVALID, "empty SessionRequest (set open, map, admin or call)")
                else:
                    sc_send(s, frame(open_body("bad decl")), own)
                    expect_session_error(s, INVALID, "namespace name 'bad decl' must be 1..128 "
                                         "characters of [A-Za-z0-9._/-]")
        wait_for(lambda: count() <= baseline + 2, timeout=10,
                 what=f"daemon fd count back near {baseline}")
        leaked = [p for p in daemon_fds(d) if p in (marker.name, pipe)]
        assert leaked == [], leaked
    finally:
        for fd in own:
            os.close(fd)
        marker.close()
    assert_serving(d)


# ====================================================================== gRPC socket junk
def test_random_bytes_to_grpc_socket(d: DaemonProc) -> None:
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    payloads = [random.Random(seed).randbytes(random.Random(seed).randint(1, 8192))
                for seed in range(30)]
    payloads += [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        preface + b"\xff" * 64,  # valid preface, then a garbage frame
        preface + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + random.Random(99).randbytes(2048),
        b"\x00" * 65536,
    ]
    for junk in payloads:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(d.grpc_path)
            try:
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):  # whatever it answers, until it hangs up
                    pass
            except (TimeoutError, ConnectionResetError, BrokenPipeError):
                pass
    assert_serving(d)


GRPC_METHODS = [*SESSION_METHODS, "Stats", "Check"]


def test_request_body_that_is_not_the_request_message(d: DaemonProc, client: kvtier.Client) -> None:
    """Well-framed gRPC calls whose body is not protobuf: INVALID_ARGUMENT, like the session channel.

    Today grpc answers UNKNOWN ("Unexpected <class DecodeError>...", which
    kvtier.Client turns into ``Internal``, "a bug in kvtier") and the daemon
    logs an ERROR traceback for each such call.
    """
    got = []
    with grpc.insecure_channel("unix:" + d.grpc_path) as ch:
        for method in GRPC_METHODS:
            call = ch.unary_unary(f"/kvtier.v1.KVTier/{method}")  # bytes in, bytes out
            for body in (b"\xff\xff\xff", random.Random(7).randbytes(300), b"\x0a\x00\x0a"):
                with pytest.raises(grpc.RpcError) as ei:
                    call(body, metadata=md(client.token), timeout=10)
                got.append((method, ei.value.code(), ei.value.details()))
    assert_serving(d, log_clean=False)
    for method, code, details in got:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
        assert f"kvtier.v1.{method}Request" in details, details
    assert_serving(d)  # and no ERROR traceback per bad call


def test_oversized_metadata_is_refused_by_grpc(d: DaemonProc, stub: pb_grpc.KVTierStub) -> None:
    err = rpc_error(stub.Lookup, pb.LookupRequest(keys=[b"k"]), metadata=md("f" * 70000))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "received metadata size exceeds hard limit" in err.details()
    assert_serving(d)


def test_half_open_grpc_connections_do_not_block_serving(d: DaemonProc) -> None:
    conns = []
    try:
        for i in range(20):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(d.grpc_path)
            if i % 2:
                s.sendall(b"PRI * HTTP/2.0\r\n")  # half a preface, then silence
            conns.append(s)
        assert_serving(d)
    finally:
        for s in conns:
            s.close()
    assert_serving(d)


# ====================================================================== capacity is not leaked
def test_closed_client_returns_its_reservation_and_lease(d: DaemonProc) -> None:
    before = dram_balances(d).tiers[0]
    c = kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BB, model_uid="m")
    kept, w1, w2 = uniq("kept"), uniq("w"), uniq("w")
    try:
        assert c.put([kept], [b"kept bytes"]) == 1
        lease = c.acquire([kept])
        r = c.reserve([w1, w2])
        r.write(0, b"never committed")
        s = dram_balances(d)
        assert (s.leases, s.reservations) == (1, 1)
        assert s.tiers[0].reserved_bytes == 2 * BB
        assert lease.hits == 1
    finally:
        c.close()
    wait_for(lambda: (lambda s: (s.leases, s.reservations, s.tiers[0].reserved_bytes))(d.stats())
             == (0, 0, 0), what="the closed client's capacity to come back")
    assert d.check() == []
    after = dram_balances(d).tiers[0]
    assert after.committed_bytes == before.committed_bytes + BB  # exactly the committed block
    with kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BB, model_uid="m") as c2:
        assert [bytes(v) for v in c2.get([kept])] == [b"kept bytes"]  # nothing lost
        assert c2.lookup([w1]) == 0  # never committed: never visible
        with c2.reserve([w1, w2]) as r2:  # and not stuck IN_FLIGHT
            assert r2.statuses == [kvtier.KeyStatus.RESERVED] * 2
        c2.delete([kept])
    assert_serving(d)


HOLDER = r"""
import os, sys
import numpy as np
import kvtier
c = kvtier.Client(sys.argv[1], namespace=sys.argv[2], block_bytes=4096, model_uid="m")
c.put([b"kept"], [np.full(4096, 7, np.uint8)])
lease = c.acquire([b"kept"])
r = c.reserve([b"w1", b"w2", b"w3"])
r.write(0, b"torn")
print("HELD", lease.hits, len(r.reserved), flush=True)
sys.stdin.readline()
os._exit(0)  # no close(), no atexit: as good as a crash
"""


def _hold_then_die(d: DaemonProc, p: subprocess.Popen[str], death: str) -> None:
    assert p.stdout is not None and p.stdin is not None and p.stderr is not None
    line = p.stdout.readline().strip()
    assert line == "HELD 1 3", (line, p.stderr.read())
    s = dram_balances(d)
    assert (s.leases, s.reservations) == (1, 1)
    assert s.tiers[0].reserved_bytes == 3 * BB
    if death == "sigkill":
        p.send_signal(signal.SIGKILL)
    else:
        p.stdin.write("go\n")
        p.stdin.flush()
    p.wait(30)


@pytest.mark.parametrize("death", ["os_exit", "sigkill"])
def test_dead_client_process_returns_its_capacity(d: DaemonProc, death: str) -> None:
    ns = f"bad/dead-{death}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    with subprocess.Popen([sys.executable, "-c", HOLDER, d.socket_dir, ns],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env) as p:
        try:
            _hold_then_die(d, p, death)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert p.returncode == (-signal.SIGKILL if death == "sigkill" else 0)
    wait_for(lambda: (lambda s: (s.leases, s.reservations, s.tiers[0].reserved_bytes))(d.stats())
             == (0, 0, 0), what="the dead client's capacity to come back")
    (nss,) = [n for n in d.stats().namespaces if n.name == ns]
    assert (nss.sessions, nss.leased_blocks, nss.reserved_blocks, nss.committed_blocks) == (0, 0, 0, 1)
    assert d.check() == []
    with kvtier.Client(d.socket_dir, namespace=ns, block_bytes=BB, model_uid="m") as c:
        got = c.get([b"kept"])
        assert len(got) == 1 and np.all(got[0] == 7) and got[0].size == BB  # nothing lost
        assert c.lookup([b"w1"]) == 0
        with c.reserve([b"w1", b"w2", b"w3"]) as r:
            assert r.statuses == [kvtier.KeyStatus.RESERVED] * 3
        c.delete([b"kept"])
    assert_serving(d)
