"""Shared fixtures: a real kvtierd process on temp sockets and a small pool."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence

import pytest

from kvtier._admin import fetch_stats, run_check, wait_serving
from kvtier._core import FAST_PATH_ENV
from kvtier.v1 import kvtier_pb2 as pb

#: Test folders whose every test runs over both client transports (DESIGN: the fast path
#: keeps every guarantee), unless marked ``one_transport`` (it speaks raw frames or gRPC
#: itself, so a client transport does not change what it tests).
BOTH_TRANSPORTS = ("tests/e2e/", "tests/crash/")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    path = str(metafunc.definition.path.relative_to(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    if (path.startswith(BOTH_TRANSPORTS)
            and metafunc.definition.get_closest_marker("one_transport") is None):
        metafunc.parametrize("transport", ["fast", "grpc"], indirect=True)


@pytest.fixture(autouse=True)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The client transport of the test (and of the workers it starts): ``fast`` (the
    session channel, the default) or ``grpc`` (``KVTIER_FAST_PATH=0``)."""
    which = str(getattr(request, "param", "fast"))
    monkeypatch.setenv(FAST_PATH_ENV, "1" if which == "fast" else "0")
    return which


#: Small pools keep tests fast and memory-light on a shared 2-core machine.
TEST_CAPACITY = "32MiB"
TEST_EXTENT = "4MiB"


@dataclasses.dataclass
class DaemonProc:
    """A kvtierd child process and where it listens."""

    proc: subprocess.Popen[str]
    socket_dir: str
    shm_dir: str
    log_path: str
    args: list[str]

    @property
    def grpc_path(self) -> str:
        return os.path.join(self.socket_dir, "kvtier.sock")

    def stats(self) -> pb.StatsResponse:
        return fetch_stats(self.socket_dir, timeout=10)

    def check(self) -> list[str]:
        """The daemon's store.check(): empty when index, slot tables and accounting agree."""
        return run_check(self.socket_dir, timeout=30)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metrics_port(self) -> int:
        m = re.search(r"metrics 127\.0\.0\.1:(\d+)", self.log())
        assert m, "daemon log has no metrics address"
        return int(m.group(1))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc.poll() is None


def start_daemon(base: str, *extra: str, capacity: str = TEST_CAPACITY,
                 extent: str = TEST_EXTENT, shm_dir: str | None = None,
                 env: Mapping[str, str] | None = None,
                 prefix: Sequence[str] = ()) -> DaemonProc:
    """Start kvtierd with a clean environment (no inherited ``KVTIER_*``) plus ``env``;
    ``prefix``: a command that execs it (``ip netns exec NAME``: the same pid)."""
    socket_dir = os.path.join(base, "sock")
    shm_dir = shm_dir or f"/dev/shm/kvtier-test-{uuid.uuid4().hex[:12]}"
    log_path = os.path.join(base, f"kvtierd-{uuid.uuid4().hex[:6]}.log")
    args = [
        *prefix, sys.executable, "-m", "kvtierd",
        "--set", f"server.socket_dir={socket_dir}",
        "--set", f"dram.shm_dir={shm_dir}",
        "--set", f"dram.capacity={capacity}",
        "--set", f"dram.extent_size={extent}",
        "--set", "metrics.address=127.0.0.1:0",
        "--set", "log.level=debug",
        "--set", "log.format=text",  # tests read the log; the JSON format has its own tests
        # No SSD tier unless a test asks for one (its later --set wins): by default it
        # would spill under ~/.local/state, shared by every test.
        "--set", "spill.ssd_dir=",
        *extra,
    ]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    child_env.update(env or {})
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=child_env,
                                text=True)
    d = DaemonProc(proc, socket_dir, shm_dir, log_path, args)
    try:
        wait_serving(socket_dir, proc)
    except BaseException:
        stop_daemon(d)
        print(d.log(), file=sys.stderr)
        raise
    return d


def stop_daemon(d: DaemonProc, *, keep_shm: bool = False) -> None:
    if d.proc.poll() is None:
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(15)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait(10)
    if not keep_shm:
        shutil.rmtree(d.shm_dir, ignore_errors=True)


@pytest.fixture
def workdir() -> Iterator[str]:
    """A short temp dir (Unix socket paths are limited to 107 bytes)."""
    path = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(workdir: str) -> Iterator[DaemonProc]:
    d = start_daemon(workdir)
    yield d
    stop_daemon(d)
    assert d.proc.returncode == 0, d.log()
