"""A local two-host cluster for the cluster tier's tests and bench/cluster.py.

Two network namespaces joined by a veth pair (private addresses on the veth only), a
real ``mooncake_master`` in the first, and a kvtierd per namespace joined to it; on a
machine where namespaces cannot be made (not root, no ``ip``), everything runs on
loopback instead, and ``Fleet.netns`` says which.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Mapping

from kvtier.v1 import kvtier_pb2 as pb
from tests.conftest import DaemonProc, start_daemon, stop_daemon

SECRET = b"kvtier-cluster-test-secret-0123456789"
MASTER_BIN = os.path.join(os.path.dirname(sys.executable), "mooncake_master")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class Fleet:
    """A master and two daemons; ``a``/``b`` run in namespaces ``ns_a``/``ns_b``."""

    def __init__(self, base: str, *, netns: bool = True, index: int = 0) -> None:
        """``index``: tells apart several fleets of one process (their namespaces,
        veth pair and addresses)."""
        self.base = base
        # The secret first: nothing made yet is left behind if its directory is missing.
        self.secret_file = os.path.join(base, "cluster.secret")
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, SECRET)
        os.close(fd)
        tag = f"{os.getpid() % 100000}{chr(ord('a') + index - 1) if index else ''}"
        self.ns_a, self.ns_b = f"kvtA{tag}", f"kvtB{tag}"
        octet = (os.getpid() + 37 * index) % 250 + 1
        self.addr_a, self.addr_b = f"10.213.{octet}.1", f"10.213.{octet}.2"
        self.netns = netns and self._make_namespaces(tag)
        if not self.netns:
            self.addr_a = self.addr_b = "127.0.0.1"
        self.rpc_port, self.http_port, self.metrics_port = (
            _free_port(), _free_port(), _free_port())
        self.master: subprocess.Popen[bytes] | None = None
        self.a: DaemonProc | None = None
        self.b: DaemonProc | None = None

    def _make_namespaces(self, tag: str) -> bool:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            return False
        try:
            _ip("netns", "add", self.ns_a)
            _ip("netns", "add", self.ns_b)
            va, vb = f"kva{tag}", f"kvb{tag}"
            _ip("link", "add", va, "type", "veth", "peer", "name", vb)
            _ip("link", "set", va, "netns", self.ns_a)
            _ip("link", "set", vb, "netns", self.ns_b)
            for ns, dev, addr in ((self.ns_a, va, self.addr_a), (self.ns_b, vb, self.addr_b)):
                _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as exc:
            print(f"network namespaces unavailable ({exc}); the cluster tests run on loopback")
            self._drop_namespaces()
            return False
        return True

    def _drop_namespaces(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)

    def in_ns(self, which: str) -> list[str]:
        if not self.netns:
            return []
        return ["ip", "netns", "exec", self.ns_a if which == "a" else self.ns_b]

    @property
    def master_address(self) -> str:
        return f"{self.addr_a}:{self.rpc_port}"

    def start_master(self, *flags: str) -> None:
        """The master in namespace A; ``flags``: more of its command line."""
        log = open(os.path.join(self.base, "master.log"), "ab")  # noqa: SIM115 (the child's)
        self.master = subprocess.Popen(
            [*self.in_ns("a"), MASTER_BIN, f"--rpc_port={self.rpc_port}",
             f"--rpc_address={self.addr_a}", "--enable_http_metadata_server=true",
             f"--http_metadata_server_host={self.addr_a}",
             f"--http_metadata_server_port={self.http_port}",
             f"--metrics_port={self.metrics_port}", f"--metrics_host={self.addr_a}",
             "--enable_metric_reporting=false", "--logtostderr", *flags],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        probe = f"exec 3<>/dev/tcp/{self.addr_a}/{self.rpc_port}"
        deadline = time.monotonic() + 30
        while subprocess.run([*self.in_ns("a"), "bash", "-c", probe],
                             capture_output=True).returncode != 0:
            assert self.master.poll() is None, "mooncake_master exited"
            assert time.monotonic() < deadline, "mooncake_master did not listen in 30 s"
            time.sleep(0.2)

    def start_owner(self, which: str) -> tuple[subprocess.Popen[bytes], str]:
        """A standalone Mooncake client in ``which``'s namespace that lends 64 MiB as a
        segment of a fixed name (``cluster.segment_owner``); returns it and the name."""
        addr = self.addr_a if which == "a" else self.addr_b
        name, service = f"{addr}:{_free_port()}", _free_port()
        log = open(os.path.join(self.base, f"owner-{which}.log"), "ab")  # noqa: SIM115
        owner = subprocess.Popen(
            [*self.in_ns(which), os.path.join(os.path.dirname(MASTER_BIN), "mooncake_client"),
             f"--host={name}", f"--port={service}", "--global_segment_size=64MB",
             "--local_buffer_size=0", f"--master_server_address={self.master_address}",
             f"--metadata_server=http://{self.addr_a}:{self.http_port}/metadata",
             "--protocol=tcp"], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "MC_TCP_BIND_ADDRESS": addr})
        log.close()
        deadline = time.monotonic() + 30  # its service port listens once it has joined
        try:
            while subprocess.run([*self.in_ns(which), "bash", "-c",
                                  f"exec 3<>/dev/tcp/{addr}/{service}"],
                                 capture_output=True).returncode != 0:
                assert owner.poll() is None, "mooncake_client exited"
                assert time.monotonic() < deadline, "mooncake_client did not listen in 30 s"
                time.sleep(0.2)
        except BaseException:
            owner.kill()
            owner.wait(10)
            raise
        return owner, name

    def kill_master(self) -> None:
        assert self.master is not None
        self.master.send_signal(signal.SIGKILL)
        self.master.wait(10)

    def start_daemon(self, which: str, *extra: str, join: bool = True,
                     capacity: str = "32MiB", extent: str = "4MiB",
                     segment: str = "64MiB", name: str = "",
                     env: Mapping[str, str] | None = None) -> DaemonProc:
        """A kvtierd in ``which``'s namespace (``name``: its directory, default
        ``which``), joined to the cluster unless ``join`` is False; ``env``: more
        environment (``PYTHONPATH`` of another checkout, to compare two daemons)."""
        addr = self.addr_a if which == "a" else self.addr_b
        home = os.path.join(self.base, name or which)
        os.makedirs(home, exist_ok=True)
        d = start_daemon(
            home,
            "--set", f"cluster.master={self.master_address}",
            "--set", f"cluster.metadata_server=http://{self.addr_a}:{self.http_port}/metadata",
            "--set", f"cluster.secret_file={self.secret_file}",
            "--set", f"cluster.segment_bytes={segment}",
            "--set", f"cluster.bind_address={addr}",
            "--set", f"cluster.hostname={addr}",
            "--set", "cluster.write=commit",
            *extra, prefix=self.in_ns(which), capacity=capacity, extent=extent, env=env)
        if join:
            wait_for(lambda: "joined as" in cluster_note(d), 60, f"daemon {which} joining")
        return d

    def close(self) -> None:
        for d in (self.a, self.b):
            if d is not None:
                stop_daemon(d)
        if self.master is not None and self.master.poll() is None:
            self.kill_master()
        if self.netns:
            self._drop_namespaces()

    def master_metrics(self) -> dict[str, float]:
        """The master's Prometheus counters (``master_batch_exist_key_requests_total``...)."""
        url = f"http://{self.addr_a}:{self.metrics_port}/metrics"
        out = subprocess.run(
            [*self.in_ns("a"), sys.executable, "-c",
             f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10)"
             ".read().decode())"], capture_output=True, text=True, timeout=60, check=True)
        metrics: dict[str, float] = {}
        for line in out.stdout.splitlines():
            name, _, value = line.rpartition(" ")
            if name and not line.startswith("#"):
                metrics[name] = float(value)
        return metrics

    def mooncake(self, script: str) -> str:
        """Run ``script`` with a Mooncake client ``s`` joined to the cluster from host A's
        namespace (what a process with no kvtier secret could do); returns its stdout."""
        prelude = textwrap.dedent(f"""
            from mooncake.store import MooncakeDistributedStore
            s = MooncakeDistributedStore()
            assert s.setup("{self.addr_a}", "http://{self.addr_a}:{self.http_port}/metadata",
                           16 << 20, 16 << 20, "tcp", "", "{self.master_address}") == 0
        """)
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": self.addr_a}
        out = subprocess.run([*self.in_ns("a"), sys.executable, "-c",
                              prelude + textwrap.dedent(script)],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def cluster_note(d: DaemonProc) -> str:
    for t in d.stats().tiers:
        if t.tier == pb.TIER_CLUSTER:
            return t.note
    return ""


def cluster_faults(d: DaemonProc) -> int:
    return sum(v for k, v in d.stats().spill_faults.items() if k.startswith("cluster/"))
