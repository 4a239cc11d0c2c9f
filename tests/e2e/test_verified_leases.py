"""Operators see fast-path hits: leases made without a call, verified by kvtierd itself.

With every reader on the fast path no Acquire call reaches the daemon, so its call
figures (``kvtier_hit_blocks``, ``NamespaceStats.hits``) stay at 0 and only the
clients' own word (``client_reported``) showed reads.  The daemon now reads its
clients' hazards and counts those that name committed blocks of their namespace
(``kvtierd.lease_watch``).  Against a real kvtierd:

* a reader's lease without a call shows, as facts, on /metrics (``kvtier_fast_path_*``),
  in ``Stats`` (``NamespaceStats.fast_path_leases``, ``leases``, ``hazard_blocks``) and
  in ``kvtier stats``;
* a tenant that forges its page (counters stepped by 2^40, hazards of garbage, of free
  slots, of another namespace's blocks) moves only its client-reported figures and the
  unverified count: no verified figure, of its namespace or the host.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest

import kvtier
from kvtier import _page, _slot_ref
from kvtier._index import LocalIndex
from kvtier._session import SessionLink, open_request
from kvtier.cli import main as kvtier_main
from kvtier.v1 import kvtier_pb2 as pb
from tests.conftest import DaemonProc

BB = 64 << 10
#: How long a test waits for the daemon's looks (10 ms apart) to see a lease.
SEEN_WITHIN = 10.0

pytestmark = pytest.mark.one_transport  # the fast path is what is tested


def _ns(s: pb.StatsResponse, name: str) -> pb.NamespaceStats:
    return next(n for n in s.namespaces if n.name == name)


def _wait_seen(d: DaemonProc, name: str, leases: int) -> pb.StatsResponse:
    deadline = time.monotonic() + SEEN_WITHIN
    while True:
        s = d.stats()
        if _ns(s, name).fast_path_leases.leases_seen >= leases or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def test_a_lease_without_a_call_shows_on_metrics_and_in_kvtier_stats(
        daemon: DaemonProc, capsys: pytest.CaptureFixture[str]) -> None:
    d = daemon
    ks = [b"blk%04d" % i for i in range(8)]
    with kvtier.Client(d.socket_dir, namespace="llama", block_bytes=BB, model_uid="m",
                       timeout=10) as c:
        c.put(ks, [np.full(BB, i, np.uint8) for i in range(8)])
        with c.acquire(ks[:5]) as lease:
            assert lease.local and lease.hits == 5  # no call: the fast path
            s = _wait_seen(d, "llama", 1)
            f = _ns(s, "llama").fast_path_leases
            assert (f.leases, f.blocks, f.bytes) == (1, 5, 5 * BB)
            assert (f.leases_seen, f.blocks_seen, f.bytes_seen, f.unverified) == (1, 5, 5 * BB, 0)
            assert (s.leases, s.hazard_blocks, _ns(s, "llama").leased_blocks) == (1, 5, 5)
            assert s.lease_looks > 0 and s.lease_look_interval_seconds == pytest.approx(0.01)
            assert _ns(s, "llama").hits == 0  # no Acquire call reached the daemon
            m = d.metric_samples()
            label = '{namespace="llama"}'
            assert m["kvtier_fast_path_leases" + label] == 1
            assert m["kvtier_fast_path_leased_blocks" + label] == 5
            assert m["kvtier_fast_path_leased_bytes" + label] == 5 * BB
            assert m["kvtier_fast_path_leases_seen_total" + label] == 1
            assert m["kvtier_fast_path_leased_blocks_seen_total" + label] == 5
            assert m["kvtier_fast_path_leased_bytes_seen_total" + label] == 5 * BB
            assert m["kvtier_active_leases"] == 1
            assert m["kvtier_fast_path_lease_looks_total"] > 0
            capsys.readouterr()
            assert kvtier_main(["--socket", d.socket_dir, "stats"]) == 0
            out = capsys.readouterr().out
        section = out[out.index("leases without a call, verified by kvtierd"):].splitlines()
        row = next(line.split() for line in section if line.split()[:1] == ["llama"])
        assert row == ["llama", "1", "5", "320.0", "KiB", "1", "5", "320.0", "KiB", "0"]
        assert "client-reported hit" in out  # the clients' word stays in its own column
        s = d.stats()
        f = _ns(s, "llama").fast_path_leases
        assert (f.leases, f.blocks, f.bytes, f.leases_seen, f.blocks_seen) == (0, 0, 0, 1, 5)
        assert (s.leases, s.hazard_blocks) == (0, 0)
        # A second read is a second lease seen; the totals only grow.
        with c.acquire(ks[5:]) as lease:
            assert lease.local and lease.hits == 3
            f = _ns(_wait_seen(d, "llama", 2), "llama").fast_path_leases
            assert (f.leases_seen, f.blocks_seen, f.bytes_seen) == (2, 8, 8 * BB)
    assert d.check() == []


def test_a_forged_page_moves_no_verified_figure(daemon: DaemonProc) -> None:
    """A tenant of A steps its page's counters and fills its hazards with garbage, every
    slot of A's and B's first segments but A's committed ones (free slots of A, B's
    committed blocks), rewriting them all the time, while an honest reader of B leases
    without a call: A's client-reported figures and its unverified count move; no
    verified figure does, of A or of the host, and B's are its reader's own."""
    d = daemon
    a_keys = [b"a%d" % i for i in range(4)]
    with kvtier.Client(d.socket_dir, namespace="A", block_bytes=BB, model_uid="m",
                       timeout=10) as a_writer:
        a_writer.put(a_keys, [np.full(BB, 1, np.uint8)] * 4)
    b = kvtier.Client(d.socket_dir, namespace="B", block_bytes=BB, model_uid="m", timeout=10)
    link = SessionLink(os.path.join(d.socket_dir, "kvtier-session.sock"), 10)
    try:
        b.put([b"b%d" % i for i in range(4)], [np.full(BB, 2, np.uint8)] * 4)
        resp, fds = link.request(open_request("A", BB, "m"))
        n = len(resp.opened.segments)
        assert resp.opened.lookup_counters, "no page: the fast path is off"
        page = mmap.mmap(fds[n + 1], os.fstat(fds[n + 1]).st_size)
        words = np.frombuffer(page, dtype=np.uint64)
        hi, hz, ser = _page.HAZARD_HI // 8, _page.HAZARDS // 8, _page.SERIALS // 8
        # The forger learns A's committed slots with one real lease, then lets it go.
        local = LocalIndex(fds[n], fds[n + 1], 4096)
        got = local.acquire(a_keys)
        assert got is not None and len(got[0]) == 4
        a_hazards = set(words[hz + got[1]:hz + got[1] + 4].tolist())
        local.release(got[1], 4)
        local.close()
        for fd in fds:
            os.close(fd)
        time.sleep(0.2)  # the daemon's looks may have seen that lease: a real one
        base = _ns(d.stats(), "A").fast_path_leases
        bit = np.uint64(_page.HAZARD_BIT)
        refs = np.concatenate([_slot_ref.encode_many(seg, np.arange(16)) for seg in range(1, 9)])
        forged = np.array([w for w in (refs | bit).tolist() if w not in a_hazards]
                          + [1, 2**64 - 1, 12345, int(refs[0])], dtype=np.uint64)
        deadline = time.monotonic() + 1.5
        rounds = 0
        with b.acquire([b"b0", b"b1"]) as lease:
            assert lease.local and lease.hits == 2
            while time.monotonic() < deadline:
                rounds += 1
                words[:_page.COUNTERS_N] += np.uint64((1 << 40) - 1)
                words[hi] = len(forged)
                words[hz:hz + len(forged)] = np.roll(forged, rounds)
                words[ser:ser + len(forged)] = rounds
                time.sleep(0.005)
                if rounds % 50 == 0:
                    s = d.stats()
                    assert (s.leases, s.hazard_blocks) == (1, 2)  # B's reader's lease only
            s = d.stats()
            a, bs = _ns(s, "A").fast_path_leases, _ns(s, "B").fast_path_leases
            assert (a.leases, a.blocks, a.bytes) == (0, 0, 0)
            assert (a.leases_seen, a.blocks_seen, a.bytes_seen) == (
                base.leases_seen, base.blocks_seen, base.bytes_seen)
            assert a.unverified > base.unverified
            assert _ns(s, "A").leased_blocks == 0
            assert _ns(s, "A").client_reported.acquire_hits > 0  # the forger's word, apart
            assert (bs.leases, bs.blocks, bs.bytes) == (1, 2, 2 * BB)
            assert (bs.leases_seen, bs.blocks_seen, bs.unverified) == (1, 2, 0)
            assert (s.leases, s.hazard_blocks) == (1, 2)
            assert _ns(s, "A").hits == 0 and _ns(s, "B").hits == 0
            m = d.metric_samples()
            assert m['kvtier_fast_path_leased_blocks{namespace="A"}'] == 0
            assert m['kvtier_fast_path_leased_blocks_seen_total{namespace="A"}'] == base.blocks_seen
            assert m['kvtier_fast_path_leased_blocks{namespace="B"}'] == 2
            assert m["kvtier_active_leases"] == 1
        assert rounds > 50, rounds
        words[hz:hz + len(forged)] = 0
        del words
        page.close()
    finally:
        link.close()
        b.close()
    assert _ns(d.stats(), "B").fast_path_leases.blocks_seen == 2
    assert d.check() == []
