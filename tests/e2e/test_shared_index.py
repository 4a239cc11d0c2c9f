"""The shared index: lookups answered in the client from the daemon's published table.

That a lookup really makes no call; that its answer is the daemon's under random
puts, deletes, evictions and table replacements; that a miss is not taken as final
where a tier below DRAM may hold the key; that no client can write or resize the
table, and garbage in its counters page moves no metric backwards; and that a
killed daemon's table answers nothing.
"""

from __future__ import annotations

import mmap
import os
import random
import re

import numpy as np
import pytest

import kvtier
from kvtier import errors
from kvtier._session import SessionLink, open_request
from tests.conftest import DaemonProc, start_daemon, stop_daemon

pytestmark = pytest.mark.one_transport  # each test picks its clients' transports

BB = 4096


def _client(d: DaemonProc, ns: str = "idx", **kw: object) -> kvtier.Client:
    kw.setdefault("timeout", 10)
    return kvtier.Client(d.socket_dir, namespace=ns, block_bytes=BB, model_uid="m",
                         **kw)  # type: ignore[arg-type]


def _no_lookup_calls(c: kvtier.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    real = c._call

    def call(method: str, request: object, **kw: object) -> object:
        assert method != "Lookup", "a lookup went to the daemon"
        return real(method, request, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(c, "_call", call)


def test_a_lookup_makes_no_call_and_is_counted(daemon: DaemonProc,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [b"%016d" % i for i in range(64)]  # 16-byte keys: stored as themselves
    with _client(daemon) as c:
        assert c.put(keys[:40], [b"x"] * 40) == 40
        assert c._maps.index is not None
        _no_lookup_calls(c, monkeypatch)
        assert c.lookup(keys) == 40
        assert c.lookup_tiers(keys[:3]) == [kvtier.Tier.DRAM] * 3
        assert c.lookup([b"short", *keys]) == 0  # other lengths: fingerprinted
        assert c.lookup(keys[39:]) == 1
        samples = daemon.metric_samples()  # the counters page is read before the scrape
        # The client's counts: series of their own, never the daemon's.
        assert samples['kvtier_client_reported_lookups_total{namespace="idx"}'] == 4
        blocks = 'kvtier_client_reported_blocks_total{namespace="idx",op="lookup",result="%s"}'
        assert samples[blocks % "hit"] == 40 + 3 + 1
        assert samples[blocks % "miss"] == 24 + 65 + 24
        assert 'kvtier_lookups_total{namespace="idx"}' not in samples  # no Lookup call
        with pytest.raises(errors.InvalidArgument):  # as the daemon would say
            c.lookup(b"one bytes object")
    with _client(daemon, fast_path=False) as g:  # gRPC only: no table, a Lookup call
        assert g._maps.index is None and g.lookup(keys) == 40
    assert daemon.check() == []


def test_lookups_agree_with_the_daemon_under_random_traffic(workdir: str) -> None:
    """A 4 MiB pool of 4 KiB blocks (~1000 slots) and 2500 keys: evictions, deletes, and
    tombstones that make the daemon replace its table several times (it starts at 1024
    entries), while a reader compares its local answers with the daemon's."""
    d = start_daemon(workdir, capacity="4MiB", extent="1MiB")
    rng = random.Random(5)
    universe = [b"%016d" % i for i in range(2500)] + [b"k%d" % i for i in range(200)]
    try:
        with _client(d) as w, _client(d) as here, _client(d, fast_path=False) as there:
            assert here._maps.index is not None and there._maps.index is None
            first_table = here._maps.index._table
            for step in range(300):
                op = rng.random()
                batch = rng.sample(universe, rng.randint(1, 32))
                if op < 0.6:
                    w.put(batch, [np.full(BB, step % 256, np.uint8)] * len(batch))
                elif op < 0.8:
                    w.delete(batch)
                else:
                    w.get(batch)
                for _ in range(3):
                    probe = rng.sample(universe, rng.randint(1, 64))
                    # Hits first, so the prefix is long enough to mean something.
                    present = [k for k in probe if there.lookup([k]) == 1]
                    probe = present + probe
                    assert here.lookup_tiers(probe) == there.lookup_tiers(probe), step
            assert here._maps.index._table is not first_table  # it followed a replacement
        assert d.check() == []
        assert "Traceback" not in d.log()
    finally:
        stop_daemon(d)


def test_a_writer_keeps_its_table_while_extents_and_the_table_grow(
        workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer maps new extents (MapSegments) while the table it holds is replaced
    several times; it keeps searching the current table, never drops it."""
    d = start_daemon(workdir, capacity="64MiB", extent="1MiB")
    try:
        with _client(d) as c:
            keys = [b"%016d" % i for i in range(6000)]
            for at in range(0, len(keys), 500):
                assert c.put(keys[at:at + 500], [b"v"] * 500) == 500
            assert c._maps.index is not None
            _no_lookup_calls(c, monkeypatch)
            for at in range(0, len(keys), 1000):
                assert c.lookup(keys[at:at + 1000]) == 1000
            assert len(c._maps.index._table) >= 64 + 8192 * 32  # 6000 keys: 8192 entries
        assert d.check() == []
    finally:
        stop_daemon(d)


def test_a_miss_is_not_final_when_a_tier_below_dram_may_hold_the_key(
        workdir: str, tmp_path: object) -> None:
    ssd = os.path.join(str(tmp_path), "ssd")
    d = start_daemon(workdir, "--set", f"spill.ssd_dir={ssd}", "--set", "spill.ssd_capacity=64MiB",
                     "--set", "spill.ssd_file_size=16MiB", capacity="4MiB", extent="1MiB")
    try:
        keys = [b"%016d" % i for i in range(1500)]  # more than DRAM holds: most go to SSD
        with _client(d) as c:
            for i in range(0, len(keys), 100):
                c.put(keys[i:i + 100], [np.full(BB, 7, np.uint8)] * 100)
            tiers = c.lookup_tiers(keys)
            assert len(tiers) == len(keys)  # the table's misses were asked of the daemon
            assert kvtier.Tier.SSD in tiers and tiers[-1] == kvtier.Tier.DRAM
        assert d.check() == []
    finally:
        stop_daemon(d)


def test_no_client_can_write_or_resize_the_table(daemon: DaemonProc) -> None:
    with _client(daemon) as owner:
        owner.put([b"a" * 16], [b"1"])
    link = SessionLink(os.path.join(daemon.socket_dir, "kvtier-session.sock"), 10)
    try:
        resp, fds = link.request(open_request("idx", BB, "m"))
        n = len(resp.opened.segments)
        assert resp.opened.shared_index and resp.opened.lookup_counters
        assert len(fds) == n + 2 + resp.opened.write_doorbell  # + the write doorbell
        index_fd, page_fd = fds[n], fds[n + 1]
        size = os.fstat(index_fd).st_size
        with pytest.raises(PermissionError):
            mmap.mmap(index_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # Reopened read-write through /proc (which a memfd allows): the seals still hold.
        again = os.open(f"/proc/self/fd/{index_fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(again, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(again, b"\xff" * 64, 0)
            for bad in (0, size * 2):
                with pytest.raises(PermissionError):
                    os.ftruncate(again, bad)
        finally:
            os.close(again)
        # The counters page is the client's to write, never to resize.
        for bad in (0, 1 << 20):
            with pytest.raises(PermissionError):
                os.ftruncate(page_fd, bad)
        page = mmap.mmap(page_fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        counters = np.frombuffer(page, dtype=np.uint64, count=3)
        counters[:] = [5, 7, 9]
        before = daemon.metric_samples()
        lookups = before['kvtier_client_reported_lookups_total{namespace="idx"}']
        hits = 'kvtier_client_reported_blocks_total{namespace="idx",op="lookup",result="hit"}'
        counters[:] = [2**64 - 1, 3, 2**63]  # a huge jump and a step back: believed as 0
        after = daemon.metric_samples()
        assert after['kvtier_client_reported_lookups_total{namespace="idx"}'] == lookups
        assert after[hits] == before[hits]
        assert (after['kvtier_client_reported_cut_total{namespace="idx"}']
                > before['kvtier_client_reported_cut_total{namespace="idx"}'])
        del counters
        page.close()
        for fd in fds:
            os.close(fd)
    finally:
        link.close()
    with _client(daemon) as c:  # the daemon serves on, its table intact
        assert c.lookup([b"a" * 16]) == 1
    assert daemon.check() == []


def test_a_killed_daemon_is_not_answered_from_its_table(workdir: str) -> None:
    d = start_daemon(workdir)
    try:
        c = _client(d, timeout=2, reconnect_max=0.2)
        c.put([b"k" * 16], [b"v"])
        assert c.lookup([b"k" * 16]) == 1 and c._maps.index is not None
        shm_dir = d.shm_dir
        d.kill()
        with pytest.raises(errors.Unavailable):
            c.lookup([b"k" * 16])  # the connection's hang-up is seen: no stale answer
        d = start_daemon(workdir, shm_dir=shm_dir)  # warm: the block is back
        assert c.lookup([b"k" * 16]) == 1 and c._maps.index is not None
        c.close()
        assert re.search(r"warm", d.log())
    finally:
        stop_daemon(d)


# ------------------------------------------------------------ leases without a call
def test_local_leases_survive_eviction_pressure_byte_exact(
        workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stress workers leasing through the table (the default) in an 8 MiB pool
    that evicts all the time: what they read under a lease is always the bytes of
    its key (a slot reused under a hazard would show another key's bytes)."""
    from tests.e2e.test_core import dram, spawn_worker

    d = start_daemon(workdir, capacity="8MiB", extent="1MiB")
    try:
        workers = [spawn_worker(d, "stress", seed=seed, universe=200, seconds=5,
                                block_bytes=65536, namespace="stress/local")
                   for seed in range(3)]
        for p in workers:
            out, err = p.communicate(timeout=125)
            assert p.returncode == 0, err[-2000:]
            assert out.startswith("STRESS "), out
        s = d.stats()
        assert (s.leases, s.hazard_blocks, s.reservations) == (0, 0, 0)
        assert s.evictions > 0
        ns = next(n for n in s.namespaces if n.name == "stress/local")
        assert ns.client_reported.acquire_hits > 0  # the pages' counts: the clients' word
        dram(d)
        assert d.check() == []
        assert "Traceback" not in d.log()
    finally:
        stop_daemon(d)


def test_a_local_lease_makes_no_call(daemon: DaemonProc,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """(A SIGKILLed holder's hazards: test_core's test_sigkill_of_client_returns_its_capacity.)"""
    with _client(daemon, "local") as c:
        keys = [b"%016d" % i for i in range(8)]
        data = [np.full(BB, i, np.uint8) for i in range(8)]
        c.put(keys, data)
        real = c._call

        def call(method: str, request: object, **kw: object) -> object:
            assert method not in ("Acquire", "Release"), f"{method} went to the daemon"
            return real(method, request, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(c, "_call", call)
        with c.acquire(keys[:3] + [b"missing"] + keys[3:]) as lease:
            assert lease.local and lease.hits == 3
            assert daemon.stats().hazard_blocks == 3
        assert daemon.stats().hazard_blocks == 0
        got = c.get(keys)
        assert all(np.array_equal(g, x) for g, x in zip(got, data, strict=True))
