"""The fast path: KVTier calls on the session connection (FastCall) instead of gRPC.

Every other e2e and crash test already runs over both transports (tests/conftest.py);
these are the fast path's own: that it is really used, that it can be turned off at
either end, that threads sharing one client get their own answers while segment fds
arrive on the same connection, that a call's error leaves the session alone, and that
a client SIGKILLed with calls in flight leaves nothing held.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import kvtier
from kvtier import errors
from kvtier.v1 import kvtier_pb2 as pb
from tests.conftest import DaemonProc, run_in_threads, start_daemon, stop_daemon

pytestmark = pytest.mark.one_transport  # each test says which transport it wants

BB = 64 << 10


def _client(d: DaemonProc, ns: str = "fast/a", **kw: object) -> kvtier.Client:
    return kvtier.Client(d.socket_dir, namespace=ns, block_bytes=BB, model_uid="m",
                         timeout=10, **kw)  # type: ignore[arg-type]


def test_the_fast_path_is_used_when_offered_and_off_on_request(daemon: DaemonProc) -> None:
    keys = [b"k%d" % i for i in range(8)]
    blocks = [np.full(BB, i, np.uint8) for i in range(8)]
    with _client(daemon) as c:
        assert c.fast_path
        assert c.put(keys, blocks) == 8
        got = c.get(keys)
        assert all((g == b).all() for g, b in zip(got, blocks, strict=True))
    with _client(daemon, fast_path=False) as g:
        assert not g.fast_path
        assert g.lookup(keys) == 8
        assert [bytes(x[:1]) for x in g.get(keys[:2])] == [b"\x00", b"\x01"]
        assert g.delete(keys) == 8
    assert daemon.check() == []


def test_the_environment_turns_it_off(daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    monkeypatch.setenv("KVTIER_FAST_PATH", "0")
    with _client(daemon) as c:
        assert not c.fast_path
        assert c.put([b"e"], [b"env"]) == 1
    monkeypatch.setenv("KVTIER_FAST_PATH", "1")
    with _client(daemon) as c:
        assert c.fast_path
        assert bytes(c.get([b"e"])[0][:3]) == b"env"
        assert c.delete([b"e"]) == 1


def test_a_daemon_with_the_fast_path_off_is_served_over_grpc(workdir: str) -> None:
    d = start_daemon(workdir, "--set", "server.fast_path=false")
    try:
        with _client(d) as c:
            assert not c.fast_path  # the daemon did not offer it
            assert c.put([b"x"], [b"over grpc"]) == 1
            assert bytes(c.get([b"x"])[0][:9]) == b"over grpc"
            # A FastCall anyway: refused with FAILED_PRECONDITION, the session goes on.
            link = c._link
            assert link is not None
            with pytest.raises(errors.FailedPrecondition, match="fast path is off"):
                link.call("Lookup", pb.LookupRequest(keys=[b"x"]), 5.0)
            assert c.lookup([b"x"]) == 1
    finally:
        stop_daemon(d)
    assert d.proc.returncode == 0, d.log()


def test_a_calls_error_ends_the_call_not_the_session(daemon: DaemonProc) -> None:
    with _client(daemon) as c:
        assert c.fast_path
        link = c._link
        assert link is not None
        token = c.token
        with pytest.raises(errors.InvalidArgument, match="keys is empty"):
            c.lookup([])
        with pytest.raises(errors.NotFound):
            link.call("Release", pb.ReleaseRequest(lease_id=2**63), 5.0)
        with pytest.raises(errors.InvalidArgument, match="unknown method"):
            link.call("NoSuchMethod", pb.LookupRequest(keys=[b"a"]), 5.0)
        assert c.put([b"a"], [b"still here"]) == 1
        assert c.token == token and c._link is link  # the same session throughout
        assert c.delete([b"a"]) == 1


def test_threads_sharing_a_client_get_their_own_answers_while_extents_grow(workdir: str
                                                                           ) -> None:
    """Eight threads on one client, each storing and reading its own blocks while the
    namespace grows extent by extent (segment fds arrive on the connection the calls
    use): every answer reaches its caller, every block reads back byte-exact."""
    d = start_daemon(workdir, capacity="64MiB", extent="1MiB")
    try:
        with _client(d) as c:
            assert c.fast_path

            def work(t: int) -> None:
                for r in range(12):
                    keys = [b"t%d-r%d-%d" % (t, r, i) for i in range(4)]
                    blocks = [np.full(BB, (t * 16 + r + i) % 251, np.uint8) for i in range(4)]
                    assert c.put(keys, blocks) == 4
                    assert c.lookup(keys) == 4
                    with c.acquire(keys) as lease:
                        for v, b in zip(lease.views, blocks, strict=True):
                            assert (v == b).all()
                    got = c.get(keys)
                    assert all((g == b).all() for g, b in zip(got, blocks, strict=True))

            run_in_threads(work, 8, 120)
            assert c.lookup([b"t%d-r%d-%d" % (t, r, i) for t in range(8) for r in range(12)
                             for i in range(4)]) == 8 * 12 * 4
        s = d.stats()
        (ns,) = [n for n in s.namespaces if n.name == "fast/a"]
        assert ns.segments > 8  # it really grew while the calls ran
        assert (s.leases, s.reservations) == (0, 0)
        assert d.check() == []
    finally:
        stop_daemon(d)
    assert d.proc.returncode == 0, d.log()


_HOLDER = """
import os, sys, time
import kvtier
c = kvtier.Client(sys.argv[1], namespace="fast/kill", block_bytes=4096, model_uid="m",
                  fast_path=True)
assert c.fast_path
c.put([b"held"], [b"x"])
lease = c.acquire([b"held"])
r = c.reserve([b"r%d" % i for i in range(16)])
print("holding", flush=True)
import threading
def spin():
    while True:
        c.lookup([b"held"] * 64)
for _ in range(4):
    threading.Thread(target=spin, daemon=True).start()
time.sleep(60)
"""


def test_a_client_killed_with_fast_calls_in_flight_leaves_nothing_held(daemon: DaemonProc
                                                                         ) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, daemon.socket_dir],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "KVTIER_FAST_PATH": "1"})
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "holding"
        s = daemon.stats()
        assert (s.leases, s.reservations) == (1, 1)
        time.sleep(0.3)  # four threads in the middle of FastCalls
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    deadline = time.monotonic() + 10
    while True:
        s = daemon.stats()
        if (s.sessions, s.leases, s.reservations) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    (dram,) = [t for t in s.tiers if t.tier == pb.TIER_DRAM]
    assert dram.reserved_bytes == 0
    assert daemon.check() == []
    with kvtier.Client(daemon.socket_dir, namespace="fast/kill", block_bytes=4096,
                       model_uid="m") as c:
        assert c.lookup([b"held"]) == 1 and c.lookup([b"r0"]) == 0  # committed stays
        assert c.delete([b"held"]) == 1


def test_a_call_too_big_for_the_fast_path_goes_over_grpc(workdir: str) -> None:
    """A request over server.max_message_bytes: the client sends it over gRPC (whose
    RESOURCE_EXHAUSTED it gets), and a raw FastCall of it is refused the same way;
    the session survives both."""
    d = start_daemon(workdir, "--set", "server.max_message_bytes=256KiB")
    try:
        with _client(d) as c:
            link = c._link
            assert link is not None and c.fast_path
            assert 0 < link.max_call_bytes <= 256 << 10
            many = [b"%064d" % i for i in range(4096)]  # 270 KB of keys: over 256 KiB
            with pytest.raises(errors.CapacityExhausted, match="larger than max"):
                c.delete(many)  # over gRPC, which refuses it (a lookup makes no call)
            with pytest.raises(errors.CapacityExhausted, match="exceeds the fast path"):
                link.call("Lookup", pb.LookupRequest(keys=many), 5.0)
            assert c._link is link and c.put([b"x"], [b"fine"]) == 1
            assert c.lookup(many[:100] + [b"x"]) == 0 and c.lookup([b"x"]) == 1
    finally:
        stop_daemon(d)
    assert d.proc.returncode == 0, d.log()
