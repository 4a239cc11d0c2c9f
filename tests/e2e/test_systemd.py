"""kvtierd under the systemd protocol, against a real ``$NOTIFY_SOCKET``.

Each test binds an ``AF_UNIX``/``SOCK_DGRAM`` socket (a path, or the abstract
``@name`` form systemd itself uses), starts a real ``kvtierd`` process with
``NOTIFY_SOCKET`` pointing at it and reads what the daemon sends, as PID 1
would: ``READY=1`` only once the sockets are bound and old segments re-attached,
``WATCHDOG=1`` from the event loop every ``WATCHDOG_USEC/2``, ``STOPPING=1`` on
SIGTERM.  The last test runs the daemon under the sandbox settings of
``systemd/kvtierd.service`` that a kernel can enforce without systemd.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvtier
from kvtier._admin import fetch_stats, wait_serving
from kvtier.bench.private_daemon import daemon_args
from tests.conftest import TEST_CAPACITY, TEST_EXTENT, DaemonProc, stop_daemon

#: What these tests check does not depend on the client transport (the adapters,
#: the tools and the daemon's own interfaces); they run once, on the default (fast).
pytestmark = pytest.mark.one_transport

#: WATCHDOG_USEC the tests use: pings every 0.1 s.
WATCHDOG_USEC = 200_000


# --------------------------------------------------------------------------
# The receiving end of $NOTIFY_SOCKET.
# --------------------------------------------------------------------------


class NotifySocket:
    """A bound datagram socket playing systemd's part; ``env`` is the NOTIFY_SOCKET value."""

    def __init__(self, workdir: str, abstract: bool) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        if abstract:
            name = f"kvtier-test-notify-{uuid.uuid4().hex[:12]}"
            self.address: str = "\0" + name
            self.env = "@" + name
        else:
            self.address = os.path.join(workdir, "notify")
            self.env = self.address
        self.sock.bind(self.address)
        self.received: list[str] = []

    def recv(self, timeout: float) -> str | None:
        """The next datagram, or None when none comes within ``timeout`` seconds."""
        self.sock.settimeout(max(timeout, 0.001))
        try:
            msg = self.sock.recv(4096).decode()
        except TimeoutError:
            return None
        self.received.append(msg)
        return msg

    def wait_for(self, state: str, timeout: float, proc: subprocess.Popen[str] | None = None) -> float:
        """Read until ``state`` arrives; returns when (monotonic).  Fails on timeout or exit."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {state} within {timeout} s; got {self.received}")
            msg = self.recv(min(left, 0.5))
            if msg is not None and state in msg.split("\n"):
                return time.monotonic()
            if msg is None and proc is not None and proc.poll() is not None:
                raise AssertionError(f"kvtierd exited ({proc.returncode}) before {state}; "
                                     f"got {self.received}")

    def collect(self, seconds: float) -> list[str]:
        """Everything that arrives within ``seconds``."""
        out: list[str] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            msg = self.recv(left)
            if msg is not None:
                out.append(msg)
        return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=["path", "abstract"])
def notify(request: pytest.FixtureRequest, workdir: str) -> Iterator[NotifySocket]:
    ns = NotifySocket(workdir, abstract=request.param == "abstract")
    yield ns
    ns.close()


@pytest.fixture
def notify_path(workdir: str) -> Iterator[NotifySocket]:
    ns = NotifySocket(workdir, abstract=False)
    yield ns
    ns.close()


# --------------------------------------------------------------------------
# A daemon started the way systemd would: environment, not flags.
# --------------------------------------------------------------------------


def spawn(workdir: str, env_extra: dict[str, str], *, wrapper: tuple[str, ...] = (),
          shm_dir: str | None = None, umask: int | None = None) -> DaemonProc:
    """Start kvtierd (conftest's flags and small pool) without waiting for it."""
    socket_dir = os.path.join(workdir, "sock")
    shm_dir = shm_dir or f"/dev/shm/kvtier-test-{uuid.uuid4().hex[:12]}"
    log_path = os.path.join(workdir, f"kvtierd-{uuid.uuid4().hex[:6]}.log")
    args = daemon_args(socket_dir, shm_dir, [f"dram.capacity={TEST_CAPACITY}",
                                             f"dram.extent_size={TEST_EXTENT}", "log.level=debug"],
                       metrics="127.0.0.1:0", prefix=wrapper)
    drop = ("KVTIER_", "NOTIFY_SOCKET", "WATCHDOG_", "LISTEN_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(env_extra)
    if umask is not None:
        # Not preexec_fn: Python code between fork and exec can deadlock when the test
        # process has threads (JAX's, from other test modules); a shell sets it instead.
        args = ["sh", "-c", f"umask {umask:o} && exec \"$@\"", "sh", *args]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                text=True)
    return DaemonProc(proc, socket_dir, shm_dir, log_path, args)


@contextlib.contextmanager
def running(d: DaemonProc, *, keep_shm: bool = False) -> Iterator[DaemonProc]:
    """Stop the daemon (and remove its shm dir) however the test ends; show its log on failure."""
    try:
        yield d
    except BaseException:
        print(d.log(), file=sys.stderr)
        raise
    finally:
        stop_daemon(d, keep_shm=keep_shm)


def health(socket_dir: str) -> int:
    """One health check, no retries: the status for kvtier.v1.KVTier."""
    path = os.path.join(socket_dir, "kvtier.sock")
    with grpc.insecure_channel(f"unix:{path}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="kvtier.v1.KVTier"), timeout=5
        )
    return int(resp.status)


def connectable(path: str) -> bool:
    """Whether a listening Unix stream socket is bound at ``path`` (the kernel accepts for it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def stop_and_wait(d: DaemonProc, timeout: float = 10) -> float:
    """SIGTERM; returns the seconds until the process exited."""
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(timeout)
    return time.monotonic() - t0


def fill_queue(address: str) -> list[socket.socket]:
    """Fill the receive queue of the datagram socket at ``address`` with filler datagrams.

    Once it is full, a blocking sender (kvtierd's notify) waits in sendmsg()
    until the receiver reads.  Several senders, since each one's own send
    buffer may run out before the receiver's queue does.  Returns the senders
    (close them after draining).
    """
    senders: list[socket.socket] = []
    for _ in range(1000):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.setblocking(False)
        senders.append(s)
        sent = 0
        try:
            while sent < 10_000:
                s.sendto(b"FILLER", address)
                sent += 1
        except BlockingIOError:
            pass
        if sent == 0:  # a fresh sender is refused: the receiver's queue is full
            return senders
    raise AssertionError("could not fill the notify socket's queue")


# --------------------------------------------------------------------------
# READY=1
# --------------------------------------------------------------------------


def test_ready_arrives_when_the_daemon_already_serves(workdir: str, notify: NotifySocket) -> None:
    d = spawn(workdir, {"NOTIFY_SOCKET": notify.env})
    with running(d):
        notify.wait_for("READY=1", timeout=20, proc=d.proc)
        # At READY=1, not one retry later: the gRPC socket answers SERVING.
        assert health(d.socket_dir) == health_pb2.HealthCheckResponse.SERVING
        assert connectable(os.path.join(d.socket_dir, "kvtier-session.sock"))
        assert notify.received[0] == "READY=1", notify.received
        assert stop_and_wait(d) < 5
        assert d.proc.returncode == 0


def test_ready_is_sent_only_after_both_sockets_are_bound(workdir: str, notify: NotifySocket) -> None:
    """Deterministic ordering: hold READY=1 in the daemon's sendmsg() and look at the sockets.

    With the notify socket's queue full, the daemon's first notification
    (READY=1) blocks.  Its sockets must nonetheless be bound and listening:
    had READY=1 come before binding, the daemon would block before binding and
    the sockets would never appear.
    """
    senders = fill_queue(notify.address)
    try:
        d = spawn(workdir, {"NOTIFY_SOCKET": notify.env})
        with running(d):
            grpc_path = os.path.join(d.socket_dir, "kvtier.sock")
            session_path = os.path.join(d.socket_dir, "kvtier-session.sock")
            deadline = time.monotonic() + 30
            while not (connectable(grpc_path) and connectable(session_path)):
                assert d.alive(), d.log()
                assert time.monotonic() < deadline, (
                    "sockets not bound while READY=1 was held: READY=1 is sent before binding\n"
                    + d.log()
                )
                time.sleep(0.05)
            # Both bound while the daemon is (or is about to be) blocked on READY=1.
            # Now read as systemd would: the fillers, then READY=1.
            notify.wait_for("READY=1", timeout=20, proc=d.proc)
            assert [m for m in notify.received if m != "FILLER"] == ["READY=1"]
            assert health(d.socket_dir) == health_pb2.HealthCheckResponse.SERVING
            stop_and_wait(d)
            assert d.proc.returncode == 0
    finally:
        for s in senders:
            s.close()


def test_ready_comes_after_old_segments_are_reattached(workdir: str,
                                                       notify_path: NotifySocket) -> None:
    """A warm restart: at READY=1 the previous run's blocks are already in the index."""
    first = spawn(workdir, {})
    with running(first, keep_shm=True):
        wait_serving(first.socket_dir, first.proc)
        with kvtier.Client(first.socket_dir, namespace="warm", block_bytes=4096,
                           model_uid="m") as c:
            keys = [f"k{i}".encode() for i in range(8)]
            assert c.put(keys, [np.full(4096, i, np.uint8) for i in range(8)]) == 8
        stop_and_wait(first)
    second = spawn(workdir, {"NOTIFY_SOCKET": notify_path.env}, shm_dir=first.shm_dir)
    with running(second):
        notify_path.wait_for("READY=1", timeout=20, proc=second.proc)
        s = fetch_stats(second.socket_dir, timeout=10)
        assert s.warm_start and s.recovered_blocks == 8, s
        with kvtier.Client(second.socket_dir, namespace="warm", block_bytes=4096,
                           model_uid="m") as c:
            assert c.lookup(keys) == 8


# --------------------------------------------------------------------------
# WATCHDOG=1
# --------------------------------------------------------------------------


def test_watchdog_pings_keep_coming(workdir: str, notify: NotifySocket) -> None:
    d = spawn(workdir, {"NOTIFY_SOCKET": notify.env, "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    with running(d):
        notify.wait_for("READY=1", timeout=20, proc=d.proc)
        pings = [m for m in notify.collect(1.2) if m == "WATCHDOG=1"]
        # Every WATCHDOG_USEC/2 = 0.1 s: about 12; a loaded 2-core machine may drop a few.
        assert 4 <= len(pings) <= 30, notify.received
        # They come from the event loop: they go on while it serves calls.
        assert health(d.socket_dir) == health_pb2.HealthCheckResponse.SERVING
        assert len([m for m in notify.collect(0.6) if m == "WATCHDOG=1"]) >= 2


def test_no_watchdog_pings_when_watchdog_pid_names_another_process(
        workdir: str, notify_path: NotifySocket) -> None:
    d = spawn(workdir, {"NOTIFY_SOCKET": notify_path.env, "WATCHDOG_USEC": str(WATCHDOG_USEC),
                        "WATCHDOG_PID": str(os.getpid())})
    with running(d):
        notify_path.wait_for("READY=1", timeout=20, proc=d.proc)
        assert notify_path.collect(1.0) == []
        assert health(d.socket_dir) == health_pb2.HealthCheckResponse.SERVING


def test_watchdog_pings_when_watchdog_pid_is_the_daemon(workdir: str,
                                                        notify_path: NotifySocket) -> None:
    # `exec env` keeps the shell's pid, so $$ is the daemon's pid, as systemd sets it.
    wrapper = ("sh", "-c", 'exec env WATCHDOG_PID=$$ "$@"', "sh")
    d = spawn(workdir, {"NOTIFY_SOCKET": notify_path.env, "WATCHDOG_USEC": str(WATCHDOG_USEC)},
              wrapper=wrapper)
    with running(d):
        notify_path.wait_for("READY=1", timeout=20, proc=d.proc)
        assert len([m for m in notify_path.collect(1.0) if m == "WATCHDOG=1"]) >= 3


# --------------------------------------------------------------------------
# STOPPING=1
# --------------------------------------------------------------------------


def test_sigterm_sends_stopping_and_exits_zero(workdir: str, notify: NotifySocket) -> None:
    d = spawn(workdir, {"NOTIFY_SOCKET": notify.env, "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    with running(d):
        notify.wait_for("READY=1", timeout=20, proc=d.proc)
        with kvtier.Client(d.socket_dir, namespace="s", block_bytes=4096, model_uid="m") as c:
            assert c.put([b"a"], [b"x" * 4096]) == 1
        d.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        notify.wait_for("STOPPING=1", timeout=5)
        d.proc.wait(10)
        assert time.monotonic() - t0 < 5  # server.grace is 2 s; nothing is in flight
        assert d.proc.returncode == 0, d.log()
        after = notify.received[notify.received.index("STOPPING=1"):]
        assert "READY=1" not in after
        assert not os.path.exists(os.path.join(d.socket_dir, "kvtier.sock"))


# --------------------------------------------------------------------------
# Without systemd
# --------------------------------------------------------------------------


def test_runs_normally_without_notify_socket(workdir: str) -> None:
    # WATCHDOG_USEC without NOTIFY_SOCKET (an environment copied from a unit):
    # nothing to notify, nothing fails.
    d = spawn(workdir, {"WATCHDOG_USEC": str(WATCHDOG_USEC)})
    with running(d):
        wait_serving(d.socket_dir, d.proc)
        with kvtier.Client(d.socket_dir, namespace="plain", block_bytes=4096,
                           model_uid="m") as c:
            assert c.put([b"a"], [b"y" * 4096]) == 1
            assert c.lookup([b"a"]) == 1
        time.sleep(0.5)  # several watchdog intervals
        assert d.alive()
        assert stop_and_wait(d) < 5
        assert d.proc.returncode == 0
        log = d.log()
        assert "Traceback" not in log and " ERROR " not in log, log


# --------------------------------------------------------------------------
# The unit's sandbox, as far as a kernel enforces it without systemd.
# --------------------------------------------------------------------------

PR_SET_MDWE = 65
PR_MDWE_REFUSE_EXEC_GAIN = 1

#: Sets the kernel's "memory-deny-write-execute" (what MemoryDenyWriteExecute=yes
#: asks for; inherited across execve), then runs the daemon.
_MDWE_WRAPPER = (
    "import ctypes, os, sys; "
    f"libc = ctypes.CDLL(None, use_errno=True); r = libc.prctl({PR_SET_MDWE}, "
    f"{PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0); "
    "r == 0 or sys.exit('PR_SET_MDWE failed: errno %d' % ctypes.get_errno()); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def _mdwe_supported() -> bool:
    """Linux >= 6.3 knows PR_SET_MDWE; try it in a throwaway child."""
    code = (f"import ctypes, sys; sys.exit(ctypes.CDLL(None).prctl({PR_SET_MDWE}, "
            f"{PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0) != 0)")
    return subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_daemon_works_under_the_units_memory_and_umask_restrictions(
        workdir: str, notify_path: NotifySocket) -> None:
    """MemoryDenyWriteExecute=yes and UMask=0077 from systemd/kvtierd.service."""
    if not sys.platform.startswith("linux") or not _mdwe_supported():
        pytest.skip("kernel without PR_SET_MDWE (Linux < 6.3): cannot enforce W^X here")
    d = spawn(workdir, {"NOTIFY_SOCKET": notify_path.env, "WATCHDOG_USEC": str(WATCHDOG_USEC)},
              wrapper=(sys.executable, "-c", _MDWE_WRAPPER), umask=0o077)
    with running(d):
        notify_path.wait_for("READY=1", timeout=20, proc=d.proc)
        with kvtier.Client(d.socket_dir, namespace="wx", block_bytes=4096, model_uid="m") as c:
            keys = [f"k{i}".encode() for i in range(300)]  # several extents: mmap, mlock, prefault
            blocks = [np.full(4096, i % 251, np.uint8) for i in range(300)]
            assert c.put(keys, blocks) == 300
            got = c.get(keys[:3])
            assert all(np.array_equal(a, b) for a, b in zip(got, blocks[:3], strict=True))
        assert d.check() == []
        # The sockets get server.socket_mode whatever the umask; the segment dir stays private.
        for name in ("kvtier.sock", "kvtier-session.sock"):
            mode = stat.S_IMODE(os.stat(os.path.join(d.socket_dir, name)).st_mode)
            assert mode == 0o660, (name, oct(mode))
        assert stat.S_IMODE(os.stat(d.socket_dir).st_mode) == 0o755
        assert stat.S_IMODE(os.stat(d.shm_dir).st_mode) == 0o700
        assert any(m == "WATCHDOG=1" for m in notify_path.collect(0.5))
        assert stop_and_wait(d) < 5
        assert d.proc.returncode == 0, d.log()
