"""The cluster tier (issue 15): two kvtierd "hosts" in two network namespaces this test
creates (a veth pair, private addresses on the veth only) and a real ``mooncake_master``.

A block committed on host A is found by a lookup on host B (tier CLUSTER), promoted
and read byte-exact; a Delete or an Evict removes the cluster's copy for both hosts;
a corrupted or forged cluster object is a miss, never served; the master killed and
restarted mid-traffic leaves both daemons serving their local hits, with the errors
counted, and cluster hits resume.  Where network namespaces cannot be made, the same
tests run on loopback (and say so in their output).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kvtier
from kvtier.cli import evict
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.cluster.format import HEADER_BYTES, Header, Naming
from kvtierd.spill.format import model_hash
from tests.conftest import DaemonProc, start_daemon, stop_daemon

pytestmark = [pytest.mark.one_transport, pytest.mark.timeout(300)]

BB = 64 * 1024
MODEL = "cluster-test-model"
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

    def __init__(self, base: str, *, netns: bool = True) -> None:
        self.base = base
        tag = f"{os.getpid() % 100000}"
        self.ns_a, self.ns_b = f"kvtA{tag}", f"kvtB{tag}"
        octet = os.getpid() % 250 + 1
        self.addr_a, self.addr_b = f"10.213.{octet}.1", f"10.213.{octet}.2"
        self.netns = netns and self._make_namespaces(tag)
        if not self.netns:
            self.addr_a = self.addr_b = "127.0.0.1"
        self.rpc_port, self.http_port, self.metrics_port = (
            _free_port(), _free_port(), _free_port())
        self.secret_file = os.path.join(base, "cluster.secret")
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, SECRET)
        os.close(fd)
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

    def start_master(self) -> None:
        log = open(os.path.join(self.base, "master.log"), "ab")  # noqa: SIM115 (the child's)
        self.master = subprocess.Popen(
            [*self.in_ns("a"), MASTER_BIN, f"--rpc_port={self.rpc_port}",
             f"--rpc_address={self.addr_a}", "--enable_http_metadata_server=true",
             f"--http_metadata_server_host={self.addr_a}",
             f"--http_metadata_server_port={self.http_port}",
             f"--metrics_port={self.metrics_port}", f"--metrics_host={self.addr_a}",
             "--enable_metric_reporting=false", "--logtostderr"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        probe = f"exec 3<>/dev/tcp/{self.addr_a}/{self.rpc_port}"
        deadline = time.monotonic() + 30
        while subprocess.run([*self.in_ns("a"), "bash", "-c", probe],
                             capture_output=True).returncode != 0:
            assert self.master.poll() is None, "mooncake_master exited"
            assert time.monotonic() < deadline, "mooncake_master did not listen in 30 s"
            time.sleep(0.2)

    def kill_master(self) -> None:
        assert self.master is not None
        self.master.send_signal(signal.SIGKILL)
        self.master.wait(10)

    def start_daemon(self, which: str, *extra: str, join: bool = True) -> DaemonProc:
        addr = self.addr_a if which == "a" else self.addr_b
        os.makedirs(os.path.join(self.base, which), exist_ok=True)
        d = start_daemon(
            os.path.join(self.base, which),
            "--set", f"cluster.master={self.master_address}",
            "--set", f"cluster.metadata_server=http://{self.addr_a}:{self.http_port}/metadata",
            "--set", f"cluster.secret_file={self.secret_file}",
            "--set", "cluster.segment_bytes=64MiB",
            "--set", f"cluster.bind_address={addr}",
            "--set", f"cluster.hostname={addr}",
            "--set", "cluster.write=commit",
            *extra, prefix=self.in_ns(which))
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


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    if not os.path.exists(MASTER_BIN):
        pytest.fail(f"{MASTER_BIN} is missing: install kvtier[cluster] (make install)")
    base = tempfile.mkdtemp(prefix="kvt-cl-", dir="/tmp")
    f = Fleet(base)
    try:
        f.start_master()
        f.a = f.start_daemon("a")
        f.b = f.start_daemon("b")
        yield f
    finally:
        f.close()
        shutil.rmtree(base, ignore_errors=True)


def client(d: DaemonProc) -> kvtier.Client:
    return kvtier.Client(d.socket_dir, namespace="fleet", block_bytes=BB, model_uid=MODEL)


def blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BB, dtype=np.uint8) for _ in range(n)]


def fresh_keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def test_a_block_committed_on_a_is_found_on_b_promoted_and_read_byte_exact(
        fleet: Fleet) -> None:
    assert fleet.a is not None and fleet.b is not None
    keys, data = fresh_keys(8), blocks(8, 1)
    with client(fleet.a) as a, client(fleet.b) as b:
        assert a.put(keys, data) == 8
        wait_for(lambda: b.lookup_tiers(keys) == [kvtier.Tier.CLUSTER] * 8, 20,
                 "host B to find A's blocks in the cluster")
        got = b.get(keys)
        assert len(got) == 8
        for g, want in zip(got, data, strict=True):
            assert np.array_equal(g, want)
        assert b.lookup_tiers(keys) == [kvtier.Tier.DRAM] * 8  # promoted
    s = fleet.b.stats()
    assert s.promotions >= 8
    assert "read by this daemon" in cluster_note(fleet.b)
    assert fleet.a.check() == [] and fleet.b.check() == []


def test_a_partial_prefix_stops_at_the_first_key_no_host_has(fleet: Fleet) -> None:
    assert fleet.a is not None and fleet.b is not None
    keys, data = fresh_keys(4), blocks(4, 2)
    with client(fleet.a) as a, client(fleet.b) as b:
        assert a.put(keys[:2], data[:2]) == 2
        assert b.put(keys[3:], data[3:]) == 1  # after the gap: not part of the prefix
        wait_for(lambda: b.lookup_tiers(keys) == [kvtier.Tier.CLUSTER] * 2, 20,
                 "the prefix on B")
        assert [bytes(x) for x in b.get(keys)] == [bytes(x) for x in data[:2]]


def test_delete_on_one_host_removes_the_cluster_copy_for_both(fleet: Fleet) -> None:
    assert fleet.a is not None and fleet.b is not None
    keys, data = fresh_keys(3), blocks(3, 3)
    with client(fleet.a) as a, client(fleet.b) as b:
        assert a.put(keys, data) == 3
        wait_for(lambda: b.lookup(keys) == 3, 20, "B to see the blocks")
        # B holds no copy of its own: its Delete finds and removes the cluster's.
        assert b.delete(keys[:1]) == 1
        assert b.lookup(keys[:1]) == 0
        # A's DRAM copy is A's: a Delete elsewhere does not reach it (documented).
        assert a.lookup_tiers(keys[:1]) == [kvtier.Tier.DRAM]
        # An Evict of the cluster tier on A removes the cluster's copy of the others.
        evicted, _skipped = evict(fleet.a.socket_dir, "fleet", keys[1:], ["cluster"])
        assert evicted == 2
        assert b.lookup(keys[1:]) == 0
        assert a.lookup_tiers(keys[1:]) == [kvtier.Tier.DRAM] * 2


def test_a_corrupted_or_forged_cluster_object_is_a_miss_never_served(fleet: Fleet) -> None:
    assert fleet.a is not None and fleet.b is not None
    keys, data = fresh_keys(2), blocks(2, 4)
    naming = Naming(SECRET)
    mh = model_hash(MODEL)
    with client(fleet.a) as a:
        assert a.put(keys, data) == 2
    with client(fleet.b) as b:
        wait_for(lambda: b.lookup(keys) == 2, 20, "B to see the blocks")
    damaged, forged = (naming.name("fleet", k, BB, mh) for k in keys)
    # Another secret's header over the right bytes: what a daemon of another cluster
    # (or anyone who learnt the name but not the secret) could write.
    fake = Naming(b"not-the-cluster-secret-at-all!!!").pack(
        "fleet", Header(keys[1], BB, 0, BB, mh, 0))
    assert len(fake) == HEADER_BYTES
    out = fleet.mooncake(f"""
        raw = bytearray(s.get({damaged!r}))
        assert len(raw) == {BB + HEADER_BYTES}, len(raw)
        raw[100] ^= 0xFF  # one flipped bit of data, header intact
        print(s.upsert({damaged!r}, bytes(raw)))
        print(s.upsert({forged!r}, bytes({BB}) + {fake!r}))
    """)
    assert out.split() == ["0", "0"], out
    failures = fleet.b.stats().spill_checksum_failures
    with client(fleet.b) as b:
        assert b.get(keys) == []  # the first block is bad: not even a prefix is served
        assert fleet.b.stats().spill_checksum_failures >= failures + 1
        # Bad objects are removed from the cluster (they are bad for every host).
        wait_for(lambda: b.lookup(keys[:1]) == 0, 10, "the damaged object's removal")
    with client(fleet.b) as b:
        assert b.get(keys[1:]) == []
    assert fleet.b.stats().spill_checksum_failures >= failures + 2
    assert fleet.b.check() == []


def test_the_master_killed_and_restarted_mid_traffic(fleet: Fleet) -> None:
    assert fleet.a is not None and fleet.b is not None
    ka, kb, kc = fresh_keys(4), fresh_keys(4), fresh_keys(4)
    da, db = blocks(4, 5), blocks(4, 6)
    with client(fleet.a) as a, client(fleet.b) as b:
        assert a.put(ka, da) == 4 and b.put(kb, db) == 4
        wait_for(lambda: b.lookup(ka) == 4, 20, "B to see A's blocks")
        fa, fb = cluster_faults(fleet.a), cluster_faults(fleet.b)
        fleet.kill_master()
        # Traffic goes on: local hits are served at once, misses are misses; a call
        # that waits on the unreachable master does so once per breaker period.
        slowest = 0.0
        end = time.monotonic() + 12
        while time.monotonic() < end:
            t0 = time.monotonic()
            assert [bytes(x) for x in a.get(ka)] == [bytes(x) for x in da]
            assert [bytes(x) for x in b.get(kb)] == [bytes(x) for x in db]
            assert b.lookup(kc) == 0
            slowest = max(slowest, time.monotonic() - t0)
        assert slowest < 8, slowest
        assert fleet.a.alive() and fleet.b.alive()
        with client(fleet.a) as a2:
            assert a2.put(kc[:1], da[:1]) == 1  # a write's publish fails, counted
        wait_for(lambda: cluster_faults(fleet.a) > fa and cluster_faults(fleet.b) > fb, 20,
                 "both daemons to count cluster errors")
        fleet.start_master()
        # A restarted master lost every object (Mooncake keeps no metadata across a
        # restart); new writes reach the cluster again once the clients rejoin.
        kd, dd = fresh_keys(2), blocks(2, 7)
        assert a.put(kd, dd) == 2

        def b_finds() -> bool:
            # Re-publish until the agents have rejoined (each commit publishes once).
            if b.lookup(kd) != 2:
                with contextlib.suppress(Exception):
                    a.delete(kd)
                    a.put(kd, dd)
                return False
            return True

        wait_for(b_finds, 90, "cluster hits to resume after the master restart")
        assert [bytes(x) for x in b.get(kd)] == [bytes(x) for x in dd]
    assert fleet.a.check() == [] and fleet.b.check() == []


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def test_the_agent_killed_is_restarted_while_the_daemon_serves(fleet: Fleet) -> None:
    assert fleet.a is not None and fleet.b is not None
    keys, data = fresh_keys(3), blocks(3, 8)
    with client(fleet.b) as b:
        assert b.put(keys, data) == 3
        (agent,) = _children(fleet.b.proc.pid)
        os.kill(agent, signal.SIGKILL)
        assert [bytes(x) for x in b.get(keys)] == [bytes(x) for x in data]  # DRAM: served
        wait_for(lambda: "joined as" in cluster_note(fleet.b)
                 and "agent started 2x" in cluster_note(fleet.b), 60, "B's agent to rejoin")
        assert fleet.b.stats().spill_faults["cluster/agent"] >= 1
        assert _children(fleet.b.proc.pid) != [agent]
        more, mdata = fresh_keys(2), blocks(2, 9)
        with client(fleet.a) as a:
            assert a.put(more, mdata) == 2
        wait_for(lambda: b.lookup(more) == 2, 20, "cluster hits on B again")
        assert [bytes(x) for x in b.get(more)] == [bytes(x) for x in mdata]
    assert fleet.b.check() == []


def test_a_master_down_at_start_delays_nothing_and_is_joined_when_up() -> None:
    base = tempfile.mkdtemp(prefix="kvt-cl-", dir="/tmp")
    f = Fleet(base, netns=False)
    try:
        t0 = time.monotonic()
        f.a = f.start_daemon("a", join=False)
        assert time.monotonic() - t0 < 30  # serving: start_daemon waited for that
        wait_for(lambda: f.a is not None and "unreachable" in cluster_note(f.a), 15,
                 "the first try to fail")
        assert "DOWN" in cluster_note(f.a)
        keys, data = fresh_keys(2), blocks(2, 10)
        with client(f.a) as a:
            assert a.put(keys, data) == 2
            assert [bytes(x) for x in a.get(keys)] == [bytes(x) for x in data]
            assert a.lookup(fresh_keys(1)) == 0
        wait_for(lambda: f.a is not None
                 and f.a.stats().spill_faults["cluster/unreachable"] >= 2, 20,
                 "a second try to join, failed and counted")
        f.start_master()
        wait_for(lambda: f.a is not None and "joined as" in cluster_note(f.a), 60,
                 "the daemon to join the master once it is up")
        assert f.a.check() == []
    finally:
        f.close()
        shutil.rmtree(base, ignore_errors=True)
