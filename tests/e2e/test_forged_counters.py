"""Figures a tenant cannot forge: page counters never reach the host's figures.

A session's page carries counters its client writes (lookups, hits, misses,
acquires, bytes leased without a call).  One uid stepping them once took the
host-wide ``Stats.io[dram].read_bytes`` from 64 KiB to 135 PiB in 61 s.  Here one
uid opens 250 sessions of namespace A (within ``limits.max_sessions_per_uid``) and
steps every counter of every page, by amounts just under the per-take jump limit,
by jumps past it and backwards, while an honest client of B works by calls.  Through
it all and after the sessions end:

* every host-wide figure (``Stats.io``, the namespaces' own hits and misses, the
  leases, hazards and prefetch figures; ``kvtier_lookups``, ``kvtier_hit_blocks``,
  ``kvtier_missed_blocks`` and the tier series in /metrics) is what it was;
* A's client-reported figures (``Stats`` and ``kvtier_client_reported_*``) moved, and
  stay within the bound of ``docs/security.md``: the ``HOST_*`` ceilings times the
  seconds since A's first page, and bytes at most ``block_bytes`` per acquired block;
* the forgery is visible as cuts, and ``check()`` is clean.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest

import kvtier
from kvtier._session import SessionLink, open_request
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.config import DEFAULT_MAX_KEYS_PER_CALL
from kvtierd.counters import (
    HOST_CALLS_PER_SECOND,
    HOST_KEYS_PER_SECOND,
    HOST_READ_BYTES_PER_SECOND,
)
from tests.conftest import start_daemon, stop_daemon

PAGES = 250
BLOCK = 4096
ATTACK_SECONDS = 3.0
#: The steps the forger adds to every counter of every page between two folds (each
#: Stats call folds), in turn: just under the per-take jump limit (SessionPage.MAX_STEP)
#: twice, a jump past it, 1, and a step backwards.
STEPS = [(1 << 40) - 1, (1 << 40) - 1, 1 << 62, 1, -(1 << 41)]
#: Host-wide series of /metrics that count what the daemon did (prefixes).
HOST_SERIES = ("kvtier_lookups_total", "kvtier_hit_blocks_total", "kvtier_missed_blocks_total",
               "kvtier_tier_bytes", "kvtier_spill_io_bytes_total", "kvtier_prefetch_hits_total",
               "kvtier_active_leases", "kvtier_committed_blocks_total")


def _host_series(samples: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in samples.items() if k.startswith(HOST_SERIES)}


def _host_figures(s: pb.StatsResponse) -> tuple[object, ...]:
    """Every figure of ``s`` that is the host's or a namespace's own (not client-reported)."""
    return (sorted((io.tier, io.read_bytes, io.written_bytes, io.reads, io.writes)
                   for io in s.io),
            sorted((n.name, n.hits, n.misses, n.committed_blocks, n.leased_blocks)
                   for n in s.namespaces),
            s.leases, s.hazard_blocks, s.prefetch_hits, s.prefetches, s.evictions,
            s.promotions, s.demotions)


def _within_bound(r: pb.ClientReported, seconds: float, max_keys: int) -> None:
    """A's client-reported figures against docs/security.md's bound after ``seconds``."""
    calls = HOST_CALLS_PER_SECOND * seconds
    keys = HOST_KEYS_PER_SECOND * seconds
    assert r.lookups <= calls and r.acquires <= calls, r
    assert r.lookup_hits + r.lookup_misses <= keys, r
    assert r.acquire_hits + r.acquire_misses <= keys, r
    assert r.lookup_hits + r.lookup_misses <= r.lookups * max_keys, r
    assert r.acquire_hits + r.acquire_misses <= r.acquires * max_keys, r
    assert r.read_bytes <= HOST_READ_BYTES_PER_SECOND * seconds, r
    assert r.read_bytes <= r.acquire_hits * BLOCK, r


def _step(words: list[np.ndarray], step: int) -> None:
    """Add ``step`` to every counter of every page (a negative one wraps: backwards)."""
    for w in words:
        w += np.uint64(step % (1 << 64))


def _namespace(s: pb.StatsResponse, name: str) -> pb.NamespaceStats:
    return next(n for n in s.namespaces if n.name == name)


@pytest.mark.one_transport  # raw sessions; B's client makes calls (no page of its own)
def test_stepping_every_counter_of_250_pages_moves_no_host_figure(workdir: str) -> None:
    d = start_daemon(workdir, "--set", f"limits.max_sessions_per_uid={PAGES + 6}")
    links: list[SessionLink] = []
    pages: list[mmap.mmap] = []
    words: list[np.ndarray] = []  # the pages' counters, as the forger writes them
    try:
        max_keys = DEFAULT_MAX_KEYS_PER_CALL
        t0 = time.monotonic()  # before A exists: its figures' clock starts later
        with kvtier.Client(d.socket_dir, namespace="A", block_bytes=BLOCK, model_uid="m",
                           fast_path=False) as a_writer:  # A has blocks (slots) to read
            a_writer.put([b"a%d" % i for i in range(8)], [b"z" * BLOCK] * 8)
        with kvtier.Client(d.socket_dir, namespace="B", block_bytes=BLOCK, model_uid="m",
                           fast_path=False) as b:
            b.put([b"b1", b"b2"], [b"x" * 1000, b"y" * 3000])
            assert len(b.get([b"b1", b"b2"])) == 2  # an Acquire call: the daemon served it
            b.lookup([b"b1", b"nope"])
            before = d.stats()
            series = _host_series(d.metric_samples(timeout=30))
            dram = next(io for io in before.io if io.tier == pb.TIER_DRAM)
            assert (dram.read_bytes, dram.reads) == (4000, 2)  # the baseline is real
            assert _namespace(before, "A").client_reported.lookups == 0

            sock = os.path.join(d.socket_dir, "kvtier-session.sock")
            for _ in range(PAGES):
                link = SessionLink(sock, 10)
                links.append(link)
                resp, fds = link.request(open_request("A", BLOCK, "m"))
                n = len(resp.opened.segments)
                assert resp.opened.lookup_counters, "no page: the fast path is off"
                page_fd = fds[n + 1]
                pages.append(mmap.mmap(page_fd, os.fstat(page_fd).st_size))
                for fd in fds:
                    os.close(fd)
            words.extend(np.frombuffer(p, dtype=np.uint64, count=7) for p in pages)

            rounds = 0
            deadline = time.monotonic() + ATTACK_SECONDS
            while time.monotonic() < deadline:
                step = STEPS[rounds % len(STEPS)]
                _step(words, step)
                rounds += 1
                s = d.stats()  # Stats folds the pages first
                assert _host_figures(s) == _host_figures(before)
                _within_bound(_namespace(s, "A").client_reported, time.monotonic() - t0,
                              max_keys)
            assert rounds > 2 * len(STEPS), rounds
            samples = d.metric_samples(timeout=30)  # a scrape folds the pages too
            assert _host_series(samples) == series
            s = d.stats()
            assert _host_figures(s) == _host_figures(before)
            a = _namespace(s, "A")
            r = a.client_reported
            _within_bound(r, time.monotonic() - t0, max_keys)
            # The forgery moved A's client-reported figures (so the bound was tested) and
            # is seen as cuts; the daemon counted nothing of A as its own.
            assert r.lookups > 0 and r.acquire_hits > 0 and r.read_bytes > 0, r
            assert r.cut > 0, r
            assert (a.hits, a.misses) == (0, 0)
            assert samples['kvtier_client_reported_read_bytes_total{namespace="A"}'] == r.read_bytes
            assert samples['kvtier_client_reported_cut_total{namespace="A"}'] == r.cut

            # The sessions end (their pages are folded a last time): still nothing moves.
            _step(words, (1 << 40) - 1)
            words.clear()
            for p in pages:
                p.close()
            pages.clear()
            for link in links:
                link.close()
            links.clear()
            deadline = time.monotonic() + 30
            while d.stats().sessions > before.sessions and time.monotonic() < deadline:
                time.sleep(0.1)
            s = d.stats()
            assert s.sessions == before.sessions
            assert _host_figures(s) == _host_figures(before)
            assert _host_series(d.metric_samples(timeout=30)) == series
            _within_bound(_namespace(s, "A").client_reported, time.monotonic() - t0, max_keys)
            # The daemon still counts what it does itself.
            assert len(b.get([b"b1"])) == 1
            dram = next(io for io in d.stats().io if io.tier == pb.TIER_DRAM)
            assert (dram.read_bytes, dram.reads) == (5000, 3)
        assert d.check() == []
    finally:
        try:
            words.clear()
            for p in pages:
                p.close()
            for link in links:
                link.close()
        finally:
            stop_daemon(d)  # whatever failed above: no daemon is left running
