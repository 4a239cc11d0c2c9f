"""The cluster tier: two kvtierd "hosts" in two network namespaces this test
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
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.cli import evict
from kvtierd.cluster import agent as agent_mod
from kvtierd.cluster.format import HEADER_BYTES, Header, Naming
from kvtierd.spill.format import model_hash
from tests.conftest import DaemonProc, stop_daemon
from tests.fleet import MASTER_BIN, SECRET, Fleet, cluster_faults, cluster_note, wait_for

pytestmark = [pytest.mark.one_transport, pytest.mark.timeout(300)]

BB = 64 * 1024
MODEL = "cluster-test-model"


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


def _segment_memory(agent: int) -> tuple[list[int], int]:
    """The sizes of the agent's mappings of its lent segment (its memfd), and its
    resident shared memory (``RssShmem``) in bytes."""
    with open(f"/proc/{agent}/maps") as f:
        sizes = [int(hi, 16) - int(lo, 16) for lo, hi in
                 (line.split()[0].split("-") for line in f
                  if f"/memfd:{agent_mod.SEGMENT_MEMFD} " in line)]
    with open(f"/proc/{agent}/status") as f:
        (kib,) = [int(line.split()[1]) for line in f if line.startswith("RssShmem:")]
    return sizes, kib * 1024


def test_the_lent_segment_is_prefaulted_in_the_background_and_puts_stay_byte_exact(
        fleet: Fleet) -> None:
    """``cluster.prefault_segment`` (on by default, as in this fleet): the agent lends a
    memfd of its own, faults all of it in once joined and says so; off, it lends
    Mooncake's own memory, filled as written. Both serve the other host byte-exact."""
    assert fleet.a is not None and fleet.b is not None
    seg = 64 << 20  # the fleet's cluster.segment_bytes
    wait_for(lambda: "segment pre-faulted (64 MiB" in cluster_note(fleet.a), 30,
             "A's agent to pre-fault its segment")
    (agent,) = _children(fleet.a.proc.pid)
    sizes, resident = _segment_memory(agent)
    assert sizes == [seg] and resident >= seg
    c = fleet.start_daemon("a", "--set", "cluster.prefault_segment=false", name="c-cold")
    try:
        (cold,) = _children(c.proc.pid)
        sizes, resident = _segment_memory(cold)
        assert sizes == [] and resident < seg // 2  # Mooncake's segment, not a memfd
        assert "pre-fault" not in cluster_note(c)
        for d, seed in ((fleet.a, 30), (c, 31)):
            keys, data = fresh_keys(6), blocks(6, seed)
            with client(d) as w, client(fleet.b) as b:
                assert w.put(keys, data) == 6
                wait_for(lambda b=b, keys=keys: b.lookup(keys) == 6, 20,
                         "B to find the blocks")
                assert [bytes(x) for x in b.get(keys)] == [bytes(x) for x in data]
    finally:
        stop_daemon(c)
    assert fleet.a.check() == [] and fleet.b.check() == []


def test_a_lookup_asks_the_master_once_whatever_its_length(fleet: Fleet) -> None:
    """One batched existence check per lookup (the master's own counters say so)."""
    assert fleet.a is not None and fleet.b is not None
    keys, data = fresh_keys(24), blocks(24, 11)
    with client(fleet.a) as a, client(fleet.b) as b:
        assert a.put(keys, data) == 24
        wait_for(lambda: b.lookup(keys) == 24, 20, "B to see the blocks")
        before = fleet.master_metrics()
        assert b.lookup(keys) == 24  # all in the cluster: one question for 24 keys
        assert b.lookup([*keys[:5], b"nowhere", *keys[5:]]) == 5
        after = fleet.master_metrics()
    for name, want in (("master_batch_exist_key_requests_total", 2),
                       ("master_batch_exist_key_items_total", 24 + 25),
                       ("master_exist_key_requests_total", 0)):
        assert after.get(name, 0) - before.get(name, 0) == want, name


def test_a_commit_is_published_with_one_batched_put(fleet: Fleet) -> None:
    """``cluster.write: commit`` publishes a commit's blocks in one Mooncake batch: one
    batched put start and end at the master for all of them (the master's counters)."""
    assert fleet.a is not None and fleet.b is not None
    keys, data = fresh_keys(24), blocks(24, 12)
    with client(fleet.a) as a, client(fleet.b) as b:
        before = fleet.master_metrics()
        assert a.put(keys, data) == 24
        wait_for(lambda: b.lookup(keys) == 24, 20, "B to see the blocks")
        after = fleet.master_metrics()
        assert [bytes(x) for x in b.get(keys)] == [bytes(x) for x in data]
    for name, want in (("master_batch_put_start_requests_total", 1),
                       ("master_batch_put_start_items_total", 24),
                       ("master_batch_put_end_requests_total", 1),
                       ("master_batch_put_end_items_total", 24),
                       ("master_put_start_requests_total", 0)):
        assert after.get(name, 0) - before.get(name, 0) == want, name


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


def joined_gauge(d: DaemonProc) -> float:
    """``kvtier_cluster_joined`` from the daemon's metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port()}/metrics",
                                timeout=10) as resp:
        text = resp.read().decode()
    (line,) = [x for x in text.splitlines() if x.startswith("kvtier_cluster_joined ")]
    return float(line.split()[1])


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
        assert joined_gauge(f.a) == 0
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
        assert joined_gauge(f.a) == 1
        assert f.a.check() == []
    finally:
        f.close()
        shutil.rmtree(base, ignore_errors=True)


def test_doctor_checks_the_cluster_from_a_host(fleet: Fleet, tmp_path: Path) -> None:
    from tests.e2e.test_doctor import by_check, run_doctor, write_config

    assert fleet.a is not None
    cfg = write_config(tmp_path / "kvtier.yaml", socket_dir=fleet.a.socket_dir,
                       shm_dir=fleet.a.shm_dir)
    with open(cfg, "a") as f:
        f.write(f"cluster:\n  master: {fleet.master_address}\n"
                f"  metadata_server: http://{fleet.addr_a}:{fleet.http_port}/metadata\n"
                f"  secret_file: {fleet.secret_file}\n  bind_address: {fleet.addr_a}\n")
    _rc, doc = run_doctor(cfg, prefix=fleet.in_ns("a"))
    check = by_check(doc)["cluster"]
    assert check["status"] == "OK", check
    assert "master" in check["message"] and "kvtierd:" in check["message"]
    assert "joined as" in check["message"]
    # In host A's namespace, host B's address is not one of its own.
    if fleet.netns:
        text = cfg.read_text().replace(f"bind_address: {fleet.addr_a}",
                                       f"bind_address: {fleet.addr_b}")
        cfg.write_text(text)
        _rc, doc = run_doctor(cfg, prefix=fleet.in_ns("a"))
        check = by_check(doc)["cluster"]
        assert check["status"] == "FAIL" and "not an address of this host" in check["message"]


def test_a_data_file_cut_short_by_a_client_never_reaches_the_agent(fleet: Fleet) -> None:
    """A client truncates its namespace's DRAM data file on host B (it holds a writable
    fd of it): a promotion from the cluster into a slot of that file is the writer's
    loss (a slot fault, a miss), checked before the agent would write there -- the
    agent does not die of SIGBUS, and B serves on."""
    assert fleet.a is not None and fleet.b is not None
    keys, data = fresh_keys(2), blocks(2, 14)
    with client(fleet.a) as a:
        assert a.put(keys, data) == 2
    with client(fleet.b) as b:
        written = int(cluster_note(fleet.b).split(" written")[0].rsplit(" ", 1)[1])
        assert b.put(fresh_keys(1), blocks(1, 15)) == 1  # B has the namespace's extent
        # ... and its publish is over (a transfer from a file cut short under it would
        # still kill the agent: that window is the residual risk docs/deployment.md names)
        wait_for(lambda: f"{written + 1} written" in cluster_note(fleet.b), 20,
                 "B's publish")
        wait_for(lambda: b.lookup(keys) == 2, 20, "B to see the blocks")
        starts = cluster_note(fleet.b).split("agent started ")[1]
        segs = [os.path.join(fleet.b.shm_dir, n) for n in os.listdir(fleet.b.shm_dir)
                if n.endswith(".seg")]
        assert segs
        for path in segs:
            os.truncate(path, 0)
        assert b.get(keys) == []
        assert "faulted during its promotion" in fleet.b.log()
        assert fleet.b.alive()
        assert cluster_note(fleet.b).split("agent started ")[1] == starts  # no restart
        # The daemon's audit gives the files their size back; the cluster still has
        # the blocks, so a later read is served.
        wait_for(lambda: len(b.get(keys)) == 2, 60, "B to read the blocks again")
    assert fleet.b.check() == []


def test_a_separate_segment_owner_keeps_a_hosts_blocks_past_its_daemon(fleet: Fleet) -> None:
    """``cluster.segment_owner``: a standalone Mooncake client lends host C's memory,
    so C's blocks stay in the cluster when C's agent dies and when C's daemon stops."""
    assert fleet.b is not None
    owner, name = fleet.start_owner("a")
    c = None
    try:
        c = fleet.start_daemon("a", "--set", f"cluster.segment_owner={name}", name="c")
        assert f"writing into {name}'s segment" in cluster_note(c)
        keys, data = fresh_keys(3), blocks(3, 16)
        with client(c) as cc:
            assert cc.put(keys, data) == 3
        with client(fleet.b) as b:
            wait_for(lambda: b.lookup(keys) == 3, 20, "B to see C's blocks")
            (agent,) = _children(c.proc.pid)
            os.kill(agent, signal.SIGKILL)
            wait_for(lambda: c is not None and "agent started 2x" in cluster_note(c), 30,
                     "C's agent restarting")
            assert b.lookup(keys) == 3  # still there: the owner holds them
            stop_daemon(c)
            c = None
            assert [bytes(x) for x in b.get(keys)] == [bytes(x) for x in data]
    finally:
        if c is not None:
            stop_daemon(c)
        owner.kill()
        owner.wait(10)


def test_a_peer_host_gone_is_a_miss_on_the_others(fleet: Fleet) -> None:
    """Host A's daemon SIGKILLed (its agent dies with it): host B serves its own blocks,
    and A's blocks in the cluster -- which lived in A's memory -- are misses, never an
    error to B's clients; B counts the failed transfers."""
    assert fleet.a is not None and fleet.b is not None
    theirs, mine = fresh_keys(3), fresh_keys(2)
    dt, dm = blocks(3, 12), blocks(2, 13)
    with client(fleet.a) as a:
        assert a.put(theirs, dt) == 3
    with client(fleet.b) as b:
        assert b.put(mine, dm) == 2
        wait_for(lambda: b.lookup(theirs) == 3, 20, "B to see A's blocks")
        (agent,) = _children(fleet.a.proc.pid)
        fleet.a.kill()
        # The agent dies with its daemon (PR_SET_PDEATHSIG): nothing left holding memory.
        wait_for(lambda: not os.path.exists(f"/proc/{agent}"), 10, "A's agent to die")
        t0 = time.monotonic()
        got = b.get(theirs)  # the master may still list them: the transfer fails
        assert got == [] and time.monotonic() - t0 < 10
        assert [bytes(x) for x in b.get(mine)] == [bytes(x) for x in dm]
        # Once the master drops A's segment (client_ttl), they are plain misses.
        wait_for(lambda: b.lookup(theirs) == 0, 30, "A's objects to leave the cluster")
    assert fleet.b.check() == []
    stop_daemon(fleet.a)  # already dead: this removes its segments
    fleet.a = fleet.start_daemon("a")  # for any test after this one
