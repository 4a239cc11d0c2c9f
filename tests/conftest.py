"""Shared fixtures: a real kvtierd process on temp sockets and a small pool."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from kvtier._admin import fetch_stats, run_check
from kvtier._core import FAST_PATH_ENV
from kvtier.bench.private_daemon import (
    PrivateDaemon,
    start_private_daemon,
    stop_private_daemon,
)
from kvtier.v1 import kvtier_pb2 as pb
from tests.engine_zygote import ZYGOTE_ENV

# The vLLM engines and servers the tests start fork from one process that imported vLLM
# already (tests/engine_zygote.py: 9 of an engine's 13 s start are imports);
# KVTIER_TEST_ZYGOTE=0 starts each afresh.
os.environ.setdefault(ZYGOTE_ENV, "1")

#: Test folders whose every test runs over both client transports (the fast path
#: keeps every guarantee the call path gives), unless marked ``one_transport`` (it speaks raw frames or gRPC
#: itself, so a client transport does not change what it tests).
BOTH_TRANSPORTS = ("tests/e2e/", "tests/crash/")


#: Tests that may wait for an install still going on in the background (the vLLM TPU
#: venv's download, ``make install``'s ``VLLM_TPU_BACKGROUND``): collected last, so the
#: rest of the suite runs meanwhile.
RUN_LAST = ("tests/jax_engines/test_vllm_tpu.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    last = [item for item in items if item.nodeid.startswith(RUN_LAST)]
    if last:
        items[:] = [item for item in items if not item.nodeid.startswith(RUN_LAST)] + last


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


class DaemonProc(PrivateDaemon):
    """A kvtierd child process and where it listens, with the calls tests make of it."""

    def stats(self) -> pb.StatsResponse:
        return fetch_stats(self.socket_dir, timeout=10)

    def check(self) -> list[str]:
        """The daemon's store.check(): empty when index, slot tables and accounting agree."""
        return run_check(self.socket_dir, timeout=30)

    def metrics_port(self) -> int:
        m = re.search(r"metrics 127\.0\.0\.1:(\d+)", self.log())
        assert m, "daemon log has no metrics address"
        return int(m.group(1))

    def metrics_text(self, timeout: float = 10) -> str:
        """A scrape of the daemon's /metrics (the exposition text)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port()}/metrics",
                                    timeout=timeout) as resp:
            text: str = resp.read().decode()
        return text

    def metric_samples(self, timeout: float = 10) -> dict[str, float]:
        """A scrape of /metrics: each sample's name with its labels -> its value."""
        samples = {}
        for line in self.metrics_text(timeout).splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples


def start_daemon(base: str, *extra: str, capacity: str = TEST_CAPACITY,
                 extent: str = TEST_EXTENT, shm_dir: str | None = None,
                 env: Mapping[str, str] | None = None,
                 prefix: Sequence[str] = ()) -> DaemonProc:
    """Start kvtierd with a clean environment (no inherited ``KVTIER_*``) plus ``env``;
    ``prefix``: a command that execs it (``ip netns exec NAME``: the same pid).  ``extra``:
    more kvtierd arguments (``--set KEY=VALUE``: later ones win)."""
    d = start_private_daemon(
        os.path.join(base, "sock"), f"dram.capacity={capacity}", f"dram.extent_size={extent}",
        "log.level=debug",
        "log.format=text",  # tests read the log; the JSON format has its own tests
        argv=extra, shm_dir=shm_dir or f"/dev/shm/kvtier-test-{uuid.uuid4().hex[:12]}",
        metrics="127.0.0.1:0", env=env, prefix=prefix, cls=DaemonProc)
    assert isinstance(d, DaemonProc)
    return d


def stop_daemon(d: DaemonProc, *, keep_shm: bool = False) -> None:
    stop_private_daemon(d, keep_shm=keep_shm)


def scribble(client: Any, key: bytes, at: int = 100) -> None:
    """Flip byte ``at`` of the committed block of ``key`` (through ``client``, a
    ``kvtier.Client`` of its namespace), as a buggy writer could: a checksumming reader
    finds it ``Corrupted``."""
    from kvtier._core import segment_ids_of

    resp = client._call("Acquire", pb.AcquireRequest(keys=[key]))
    assert resp.hits == 1
    client._sync_maps(resp.segments_version, segment_ids_of(resp.slots))
    view = client._maps.view(resp.slots[0], resp.slots[0].length, writable=True)
    view[at] ^= 0xFF
    del view
    client._call("Release", pb.ReleaseRequest(lease_id=resp.lease_id))


def run_in_threads(work: Callable[[int], None], n: int, timeout: float) -> None:
    """``work(0)`` .. ``work(n - 1)`` on ``n`` threads at once, each joined within
    ``timeout``; the first exception any of them raised fails the test here."""
    errs: list[BaseException] = []

    def run(t: int) -> None:
        try:
            work(t)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errs.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not errs, errs[0]


@contextlib.contextmanager
def temp_daemon(*extra: str, **kwargs: Any) -> Iterator[DaemonProc]:
    """``start_daemon`` in a temp dir of its own (module-scoped fixtures), stopped and the
    dir removed after; the daemon must then have exited 0."""
    base = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    d = start_daemon(base, *extra, **kwargs)
    try:
        yield d
    finally:
        stop_daemon(d)
        log = d.log()
        shutil.rmtree(base, ignore_errors=True)
    assert d.proc.returncode == 0, log


@pytest.fixture
def workdir() -> Iterator[str]:
    """A short temp dir (Unix socket paths are limited to 107 bytes)."""
    path = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def disk_dir() -> Iterator[str]:
    """A temp dir on /var/tmp, a disk filesystem where O_DIRECT works (/tmp may be tmpfs),
    removed afterwards."""
    path = tempfile.mkdtemp(prefix="kvt-disk-", dir="/var/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(workdir: str) -> Iterator[DaemonProc]:
    d = start_daemon(workdir)
    yield d
    stop_daemon(d)
    assert d.proc.returncode == 0, d.log()
