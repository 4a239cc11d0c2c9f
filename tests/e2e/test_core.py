"""End-to-end: a real kvtierd process, real clients in other processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import pytest

import kvtier
from kvtier import errors
from kvtier._core import LOCAL_WRITES_ENV
from kvtier._wire import COLUMN_MIN
from kvtier.v1 import kvtier_pb2 as pb
from tests.conftest import DaemonProc, start_daemon, stop_daemon

WORKER = os.path.join(os.path.dirname(__file__), "worker.py")


def run_worker(d: DaemonProc, action: str, **args: object) -> str:
    out = subprocess.run(
        [sys.executable, WORKER, d.socket_dir, action, json.dumps(args)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def spawn_worker(d: DaemonProc, action: str, **args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, d.socket_dir, action, json.dumps(args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def dram(d: DaemonProc) -> dict[str, int]:
    t = d.stats().tiers[0]
    acct = {"total": t.total_bytes, "free": t.free_bytes, "reserved": t.reserved_bytes,
            "granted": t.granted_bytes, "committed": t.committed_bytes}
    assert acct["free"] + acct["reserved"] + acct["granted"] + acct["committed"] == acct["total"]
    return acct


def keys_hex(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:04d}".encode().hex() for i in range(n)]


def test_round_trip_between_processes_is_byte_exact(daemon: DaemonProc) -> None:
    keys = keys_hex("rt", 20)
    assert run_worker(daemon, "put", keys=keys).strip() == "PUT 20"
    # The writer has exited; a fresh process reads every byte back.
    assert run_worker(daemon, "verify", keys=keys).strip() == "VERIFY 20 OK"
    assert daemon.check() == []


def test_lookup_returns_longest_present_prefix(daemon: DaemonProc) -> None:
    with kvtier.Client(daemon.socket_dir, namespace="p", block_bytes=4096, model_uid="m") as c:
        keys = kvtier.block_keys(list(range(160)), 16, salt=b"tenant")
        assert c.put(keys[:6], [np.full(4096, i, np.uint8) for i in range(6)]) == 6
        assert c.lookup(keys) == 6
        assert c.lookup(keys[:3]) == 3
        assert c.lookup(keys[6:]) == 0
        assert c.lookup([keys[0], keys[7], keys[1]]) == 1
        assert c.lookup_tiers(keys) == [kvtier.Tier.DRAM] * 6
        # lookup has no side effects: no lease, nothing reserved
        s = daemon.stats()
        assert (s.leases, s.reservations) == (0, 0)


def test_put_skips_present_keys_and_keeps_exact_lengths(daemon: DaemonProc) -> None:
    with kvtier.Client(daemon.socket_dir, namespace="len", block_bytes=10000, model_uid="m") as c:
        blocks = [np.arange(n, dtype=np.uint8) for n in (1, 4095, 4096, 10000)]
        keys = [b"a", b"b", b"c", b"d"]
        assert c.put(keys, blocks) == 4
        assert c.put(keys, blocks) == 0
        got = c.get(keys)
        assert [len(g) for g in got] == [1, 4095, 4096, 10000]
        assert all(np.array_equal(a, b) for a, b in zip(got, blocks, strict=False))
        with pytest.raises(errors.InvalidArgument, match="a block holds 1..10000 bytes"):
            c.put([b"e"], [np.zeros(10001, np.uint8)])


def test_a_put_of_hundreds_of_blocks_through_the_calls_is_byte_exact(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reserve and Commit calls of COLUMN_MIN keys and more (their slots, lengths and
    checksums go to and from the wire as columns, in C), some of them present already
    (EXISTS), lengths of every size, each block checksummed: what a get reads back is
    exactly what was put."""
    monkeypatch.setenv(LOCAL_WRITES_ENV, "0")  # the calls, not the slots granted ahead
    n = 3 * COLUMN_MIN
    rng = np.random.default_rng(7)
    with kvtier.Client(daemon.socket_dir, namespace="cols", block_bytes=4096,
                       model_uid="m") as c:
        keys = [f"col-{i}".encode() for i in range(n)]
        blocks = [rng.integers(0, 256, int(rng.integers(1, 4097)), dtype=np.uint8)
                  for _ in range(n)]
        assert c.put(keys[::3], blocks[::3]) == n // 3
        assert c.put(keys, blocks) == n - n // 3
        got = c.get(keys)
        assert [g.tobytes() for g in got] == [b.tobytes() for b in blocks]
        assert c.delete(keys) == n
    assert daemon.check() == []


def test_eviction_at_capacity_keeps_most_recent(daemon: DaemonProc) -> None:
    bb = 1 << 20  # 32 MiB pool: about 30 such blocks fit
    with kvtier.Client(daemon.socket_dir, namespace="evict", block_bytes=bb, model_uid="m") as c:
        keys = [f"k{i}".encode() for i in range(80)]
        for i in range(0, 80, 8):
            assert c.put(keys[i : i + 8], [np.full(bb, i, np.uint8)] * 8) == 8
        s = daemon.stats()
        assert s.evictions > 0
        present = [k for k in keys if c.lookup([k]) == 1]
        assert 0 < len(present) < 80
        assert keys[-1] in present and keys[0] not in present
        assert dram(daemon)["committed"] <= dram(daemon)["total"]
    assert daemon.check() == []


def test_leased_block_survives_filling_the_pool(daemon: DaemonProc) -> None:
    bb = 1 << 20
    with kvtier.Client(daemon.socket_dir, namespace="lease", block_bytes=bb, model_uid="m") as c:
        c.put([b"pinned"], [np.full(bb, 7, np.uint8)])
        with c.acquire([b"pinned"]) as lease:
            view = lease.views[0]
            for i in range(0, 100, 10):
                c.put([f"f{i + j}".encode() for j in range(10)], [np.full(bb, 1, np.uint8)] * 10)
            assert daemon.stats().evictions > 0
            assert np.all(view == 7)  # never overwritten while leased
            assert c.lookup([b"pinned"]) == 1
    assert daemon.check() == []


def test_sigkill_of_client_returns_its_capacity(daemon: DaemonProc, transport: str) -> None:
    keys = keys_hex("held", 4)
    run_worker(daemon, "put", keys=keys)
    before = dram(daemon)
    p = spawn_worker(daemon, "hold", lease=keys, reserve=keys_hex("new", 5))
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "HELD 4 5"
    s = daemon.stats()
    # Over the session channel the lease is made without a call: 4 hazards in the page.
    assert (s.leases, s.hazard_blocks, s.reservations) == (1, 4 if transport == "fast" else 0, 1)
    assert dram(daemon)["reserved"] > 0
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = daemon.stats()
        if (s.leases, s.hazard_blocks, s.reservations, s.sessions) == (0, 0, 0, 0):
            break
        time.sleep(0.05)
    assert (s.leases, s.hazard_blocks, s.reservations, s.sessions) == (0, 0, 0, 0)
    assert dram(daemon) == before
    assert daemon.check() == []
    # The reserved keys were never committed: not visible, and writable again.
    assert run_worker(daemon, "put", keys=keys_hex("new", 5)).strip() == "PUT 5"


def test_many_client_processes_at_once_stay_consistent(daemon: DaemonProc) -> None:
    procs = [
        spawn_worker(daemon, "stress", seed=seed, universe=60, seconds=4, block_bytes=65536,
                     namespace=f"stress/{seed % 2}")
        for seed in range(4)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.startswith("STRESS "), out
        assert int(out.split()[1]) > 0
    s = daemon.stats()
    assert (s.leases, s.reservations) == (0, 0)
    dram(daemon)
    assert daemon.check() == []


def test_async_client_round_trip(daemon: DaemonProc) -> None:
    async def go() -> None:
        async with kvtier.AsyncClient(daemon.socket_dir, namespace="aio", block_bytes=8192,
                                      model_uid="m") as c:
            keys = [b"x1", b"x2", b"x3"]
            blocks = [np.full(8192 - i, i, np.uint8) for i in range(3)]
            assert await c.put(keys, blocks) == 3
            assert await c.lookup(keys) == 3
            got = await c.get(keys)
            assert all(np.array_equal(a, b) for a, b in zip(got, blocks, strict=False))
            async with await c.reserve([b"x1", b"y"]) as r:
                assert r.statuses == [kvtier.KeyStatus.EXISTS, kvtier.KeyStatus.RESERVED]
                r.write(1, b"hello")
                assert await r.commit() == 1
            async with await c.acquire([b"y"]) as lease:
                assert bytes(lease.views[0]) == b"hello"
            assert await c.delete([b"y", b"nope"]) == 1
            assert (await c.stats())["sessions"] >= 1

    asyncio.run(go())
    assert daemon.check() == []


def test_async_client_copies_hashes_and_maps_off_its_event_loop(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """Big blocks: every copy and checksum, and every segment mapping, runs on a worker
    thread, never on the caller's event loop; small ones stay inline (cheaper)."""
    from kvtier import _accel, _session

    seen: dict[str, set[int]] = {"copy": set(), "sum": set(), "map": set()}

    def spy(kind: str, fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            for one in kind.split("+"):
                seen[one].add(threading.get_ident())
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(_accel, "copy_into", spy("copy", _accel.copy_into))
    monkeypatch.setattr(_accel, "checksum", spy("sum", _accel.checksum))
    # A put copies and hashes each block in one pass.
    monkeypatch.setattr(_accel, "scatter_hash", spy("copy+sum", _accel.scatter_hash))
    monkeypatch.setattr(_session.SegmentMaps, "update",
                        spy("map", _session.SegmentMaps.update))
    big = 1 << 20

    async def go() -> int:
        async with kvtier.AsyncClient(daemon.socket_dir, namespace="aio-big", block_bytes=big,
                                      model_uid="m", checksum=True) as c:
            blocks = [np.full(big, i, np.uint8) for i in range(2)]
            assert await c.put([b"a", b"b"], blocks) == 2
            got = await c.get([b"a", b"b"])
            assert all(np.array_equal(x, y) for x, y in zip(got, blocks, strict=True))
        return threading.get_ident()

    loop_thread = asyncio.run(go())
    for kind, threads in seen.items():
        assert threads and loop_thread not in threads, (kind, threads, loop_thread)
    assert daemon.check() == []


def test_reserve_views_are_writable_and_acquire_views_read_only(daemon: DaemonProc) -> None:
    with kvtier.Client(daemon.socket_dir, namespace="views", block_bytes=4096, model_uid="m") as c:
        with c.reserve([b"k"]) as r:
            buf = r.buffers[0]
            assert buf is not None and buf.flags.writeable and len(buf) == 4096
            buf[:3] = [1, 2, 3]
            r.lengths[0] = 3
            r.commit()
        with c.acquire([b"k"]) as lease:
            assert not lease.views[0].flags.writeable
            assert lease.views[0].tolist() == [1, 2, 3]
        # Leaving a reservation without commit aborts it: nothing becomes visible.
        with c.reserve([b"never"]) as r:
            r.write(0, b"abc")
        assert c.lookup([b"never"]) == 0
        assert daemon.stats().reservations == 0


def test_corrupted_block_is_never_served_and_becomes_a_miss(daemon: DaemonProc) -> None:
    with kvtier.Client(daemon.socket_dir, namespace="sum", block_bytes=4096, model_uid="m",
                       checksum=True) as c:
        c.put([b"k"], [b"payload"])
        with c.acquire([b"k"]) as lease:
            assert bytes(lease.views[0]) == b"payload"
        with c.reserve([b"bad"]) as r:
            r.write(0, b"good bytes")
            scribble = r.buffers[0]
            r.commit()
        assert scribble is not None
        scribble[0] = ord("X")  # a buggy writer scribbles over a committed block
        with pytest.raises(errors.Corrupted, match="failed its checksum"):
            c.acquire([b"bad"])
        assert c.lookup([b"bad"]) == 0  # now a miss
        assert daemon.stats().leases == 0
        port = daemon.metrics_port()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert b'kvtier_checksum_failures_total{namespace="sum",tier="dram"} 1.0' in text
    assert daemon.check() == []


def test_get_verifies_what_it_copied_not_the_slot_before_the_copy(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer of the namespace changes a committed block's bytes after the get leased
    it and before its copy (as a cut data file, given back as zeros by the audit, does):
    the get raises Corrupted rather than return the changed bytes, and the block is a
    miss from then on."""
    import kvtier._core as core

    with kvtier.Client(daemon.socket_dir, namespace="sum2", block_bytes=4096, model_uid="m",
                       checksum=True) as c:
        with c.reserve([b"k"]) as r:
            r.write(0, b"good bytes")
            scribble = r.buffers[0]
            r.commit()
        assert scribble is not None
        assert bytes(c.get([b"k"])[0][:10]) == b"good bytes"
        real = core.copy_out

        def copy_after_a_scribble(views: Any, out: Any) -> Any:
            scribble[0] = ord("X")  # between the lease and the copy
            return real(views, out)

        monkeypatch.setattr(core, "copy_out", copy_after_a_scribble)
        with pytest.raises(errors.Corrupted, match="failed its checksum"):
            c.get([b"k"])
        monkeypatch.setattr(core, "copy_out", real)
        assert c.lookup([b"k"]) == 0
        assert daemon.stats().leases == 0
    assert daemon.check() == []


def test_metrics_endpoint_reports_occupancy_and_events(daemon: DaemonProc, transport: str) -> None:
    with kvtier.Client(daemon.socket_dir, namespace="met", block_bytes=4096, model_uid="m") as c:
        c.put([b"a", b"b"], [b"1", b"2"])
        c.lookup([b"a", b"b", b"c"])
        c.get([b"a"])
        with c.acquire([b"a", b"b"]):
            pass  # released (and waited for) on exit
        with c.reserve([b"z"]):
            pass  # aborted on exit
    with kvtier.Client(daemon.socket_dir, namespace="met-big", block_bytes=8 << 20,
                       model_uid="m") as big:
        with pytest.raises(errors.CapacityExhausted):
            big.reserve([b"%d" % i for i in range(5)])  # 40 MiB of a 32 MiB pool: refused
        port = daemon.metrics_port()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    assert samples['kvtier_committed_blocks_total{namespace="met"}'] == 2
    # A lookup call is the daemon's to count; one answered from the shared index (the
    # fast path) is what the client reports, in series of its own.
    if transport == "grpc":
        assert samples['kvtier_hit_blocks_total{namespace="met",op="lookup"}'] == 2
        assert samples['kvtier_missed_blocks_total{namespace="met",op="lookup"}'] == 1
    else:
        assert 'kvtier_hit_blocks_total{namespace="met",op="lookup"}' not in samples
        reported = 'kvtier_client_reported_blocks_total{namespace="met",op="lookup",result="%s"}'
        assert samples[reported % "hit"] == 2 and samples[reported % "miss"] == 1
        assert samples['kvtier_client_reported_lookups_total{namespace="met"}'] == 1
    assert samples['kvtier_refused_blocks_total{namespace="met-big"}'] == 5  # a dropped save
    assert samples['kvtier_namespace_blocks{namespace="met",state="committed",tier="dram"}'] == 2
    total = samples['kvtier_tier_bytes{state="total",tier="dram"}']
    assert total == 32 << 20
    parts = sum(samples[f'kvtier_tier_bytes{{state="{s}",tier="dram"}}']
                for s in ("free", "reserved", "granted", "committed"))
    assert parts == total
    assert samples['kvtier_rpc_duration_seconds_count{method="Reserve"}'] >= 1
    assert samples["kvtier_active_sessions"] >= 0
    # How long readers hold leases and writers reservations (a connector's load and save
    # time); a lease made without a call (the fast path's) is not timed, its reads counted.
    if transport == "grpc":
        assert samples['kvtier_lease_hold_seconds_count{namespace="met"}'] >= 1
        assert 0 < samples['kvtier_lease_hold_seconds_sum{namespace="met"}'] < 10
    else:  # read without a call: reported by the client, not counted as the daemon's
        assert samples['kvtier_client_reported_blocks_total'
                       '{namespace="met",op="acquire",result="hit"}'] >= 1
    assert samples['kvtier_reservation_hold_seconds_count{namespace="met",outcome="commit"}'] == 1
    abort = 'kvtier_reservation_hold_seconds_count{namespace="met",outcome="abort"}'
    if transport == "grpc":
        assert samples[abort] == 1
    else:
        # The put's Reserve call left the session slots granted ahead (writes without a
        # call): the second reserve took one and its abort gave it back in the page,
        # without the daemon (not timed, as a lease made without a call).
        assert abort not in samples


def test_second_daemon_on_same_instance_refuses_to_start(daemon: DaemonProc, workdir: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtierd", "--set", f"server.socket_dir={workdir}/other",
         "--set", f"dram.shm_dir={daemon.shm_dir}", "--set", "metrics.address="],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert f"another kvtierd (pid {daemon.proc.pid}) is running instance 'default'" in proc.stderr
    assert daemon.alive()


def _taken_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, int(s.getsockname()[1])


def test_a_taken_metrics_port_is_one_line_naming_the_key_and_leaves_nothing(
        workdir: str) -> None:
    """A second instance on a host whose metrics port is taken: one line that names
    metrics.address, exit status 1, and no socket or directory left behind."""
    holder, port = _taken_port()
    sock_dir, shm_dir = f"{workdir}/second/sock", f"/dev/shm/kvtier-test-second-{os.getpid()}"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvtierd", "--set", "instance=second",
             "--set", f"server.socket_dir={sock_dir}", "--set", f"dram.shm_dir={shm_dir}",
             "--set", f"metrics.address=127.0.0.1:{port}", "--set", "dram.mlock=false"],
            capture_output=True, text=True, timeout=60)
    finally:
        holder.close()
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("kvtierd: ")]
    assert errors == [f"kvtierd: cannot listen on metrics.address '127.0.0.1:{port}': Address "
                      "already in use (choose another port, or set metrics.address to '' to "
                      "turn the endpoint off)"], proc.stderr
    assert not os.path.exists(f"{workdir}/second")  # the socket dir and its parent it made
    assert not os.path.exists(shm_dir)


def test_sigkilled_daemon_does_not_block_its_successor(workdir: str) -> None:
    d = start_daemon(workdir)
    try:
        d.kill()
        d2 = start_daemon(workdir, shm_dir=d.shm_dir)
        stop_daemon(d2)
        assert d2.proc.returncode == 0
    finally:
        stop_daemon(d)


def test_sigterm_stops_daemon_gracefully(workdir: str) -> None:
    d = start_daemon(workdir)
    t0 = time.monotonic()
    stop_daemon(d)
    assert d.proc.returncode == 0
    assert time.monotonic() - t0 < 5
    assert "kvtierd stopped" in d.log()


def test_config_error_stops_daemon_naming_the_key(workdir: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtierd", "--set", "dram.capasity=1GiB"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "dram.capasity" in proc.stderr


def test_cli_stats_and_ls(daemon: DaemonProc) -> None:
    with kvtier.Client(daemon.socket_dir, namespace="cli/ns", block_bytes=4096, model_uid="m") as c:
        c.put([b"a"], [b"x"])
        kv = [sys.executable, "-m", "kvtier.cli", "--socket", daemon.socket_dir]
        out = subprocess.run([*kv, "stats"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "dram" in out.stdout and "cli/ns" in out.stdout
        js = subprocess.run([*kv, "stats", "--json"], capture_output=True, text=True, timeout=60)
        data = json.loads(js.stdout)
        assert data["tiers"][0]["committed_blocks"] == "1"
        ls = subprocess.run([*kv, "ls"], capture_output=True, text=True, timeout=60)
        assert "cli/ns" in ls.stdout
        chk = subprocess.run([*kv, "check"], capture_output=True, text=True, timeout=60)
        assert chk.returncode == 0 and "consistent" in chk.stdout


def test_stats_counts_bytes_per_tier_and_rpc_latency(daemon: DaemonProc, transport: str) -> None:
    with kvtier.Client(daemon.socket_dir, namespace="io", block_bytes=4096, model_uid="m") as c:
        c.put([b"a", b"b"], [b"x" * 1000, b"y" * 3000])
        c.get([b"a", b"b"])
        with pytest.raises(errors.InvalidArgument):
            c.lookup([b""])
    s = daemon.stats()
    io = {t.tier: t for t in s.io}
    assert (io[pb.TIER_DRAM].written_bytes, io[pb.TIER_DRAM].writes) == (4000, 2)
    ns = next(n for n in s.namespaces if n.name == "io")
    if transport == "grpc":  # an Acquire call: the daemon served the read
        assert (io[pb.TIER_DRAM].read_bytes, io[pb.TIER_DRAM].reads) == (4000, 2)
        assert ns.client_reported.read_bytes == 0
    else:  # read without a call: the client's report, per namespace, not the host's
        assert io[pb.TIER_DRAM].read_bytes == io[pb.TIER_DRAM].reads == 0
        assert (ns.client_reported.read_bytes, ns.client_reported.acquire_hits) == (4000, 2)
    rpcs = {r.method: r for r in s.rpcs}
    assert rpcs["Commit"].calls == 1 and rpcs["Commit"].errors == 0
    assert rpcs["Lookup"].errors == 1
    assert 0 < rpcs["Commit"].p50_seconds <= rpcs["Commit"].p99_seconds <= rpcs["Commit"].max_seconds
    assert rpcs["Commit"].window == 1


def test_cli_reports_unreachable_daemon(workdir: str) -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "--socket", workdir, "stats"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "Unavailable" in out.stderr


def test_leases_and_reservations_expire(workdir: str) -> None:
    d = start_daemon(workdir, "--set", "leases.ttl=1s", "--set", "reservations.ttl=1s")
    try:
        with kvtier.Client(d.socket_dir, namespace="ttl", block_bytes=4096, model_uid="m") as c:
            c.put([b"a"], [b"x"])
            lease = c.acquire([b"a"])
            r = c.reserve([b"b"])
            assert (d.stats().leases, d.stats().reservations) == (1, 1)
            time.sleep(2.5)
            # A lease made without a call is seen by the daemon's once-a-second sweep,
            # so it may end up to a sweep later than a call's: wait for it, briefly.
            deadline = time.monotonic() + 5
            while (s := d.stats()).leases and time.monotonic() < deadline:
                time.sleep(0.1)
            assert (s.leases, s.reservations) == (0, 0)
            with pytest.raises(errors.NotFound, match=f"lease {lease.lease_id} is not held"):
                lease.release()
            # (A reservation from slots granted ahead has no id on the wire.)
            rid = f"{r.reservation_id} " if r.reservation_id else ""
            with pytest.raises(errors.NotFound, match=f"reservation {rid}is not open"):
                r.commit()
            assert c.lookup([b"b"]) == 0
            assert c.put([b"b"], [b"y"]) == 1  # the expired key is writable again
        assert d.check() == []
    finally:
        stop_daemon(d)


def test_session_only_receives_its_own_namespace_segments(daemon: DaemonProc) -> None:
    from kvtier._index import LocalIndex
    from kvtier._session import SessionLink, map_request, open_request

    with kvtier.Client(daemon.socket_dir, namespace="iso/a", block_bytes=4096, model_uid="m") as a:
        a.put([b"secret"], [b"tenant a bytes"])
        link = SessionLink(os.path.join(daemon.socket_dir, "kvtier-session.sock"), 10)
        try:
            resp, fds = link.request(open_request("iso/b", 4096, "m"))
            assert list(resp.opened.segments) == []
            # No segment fd; with the fast path, B's own shared index and counters page
            # (and the daemon's doorbell for writes without a call).
            extra = (2 if resp.opened.shared_index else 0) + int(resp.opened.write_doorbell)
            assert len(fds) == extra and resp.opened.lookup_counters == bool(extra)
            if extra:
                index = LocalIndex(fds[0], fds[1], 64)
                assert index.lookup([b"secret"]) == (b"", True)  # A's key is not in B's table
                index.close()
            for fd in fds:
                os.close(fd)
            # Ask for every segment id there could be, and the index again: none of A's
            # may come back, nor B's table a second time.
            resp, fds = link.request(map_request(list(range(1, 64)), index=True))
            assert fds == [] and list(resp.mapped.fd_segment_ids) == []
            assert not resp.mapped.shared_index
        finally:
            link.close()
        with kvtier.Client(daemon.socket_dir, namespace="iso/b", block_bytes=4096,
                           model_uid="m") as b:
            assert b.lookup([b"secret"]) == 0
            assert b.get([b"secret"]) == []


def test_cli_health_reports_serving(daemon: DaemonProc) -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "--socket", daemon.socket_dir,
                          "health"], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "SERVING", out.stderr


def test_get_into_caller_buffers_and_release_without_waiting(daemon: DaemonProc) -> None:
    with kvtier.Client(daemon.socket_dir, namespace="out", block_bytes=8192, model_uid="m") as c:
        blocks = [np.full(8192 - i, i, np.uint8) for i in range(4)]
        keys = [f"o{i}".encode() for i in range(4)]
        c.put(keys, blocks)
        out = [bytearray(8192) for _ in keys]
        for _ in range(3):  # the previous release is reaped by the next one
            got = c.get(keys, out=out)
            assert [len(g) for g in got] == [8192 - i for i in range(4)]
            assert all(np.array_equal(g, b) for g, b in zip(got, blocks, strict=True))
            assert np.shares_memory(got[0], np.frombuffer(out[0], np.uint8))
        with pytest.raises(errors.InvalidArgument, match=r"out\[0\] holds 10 bytes"):
            c.get(keys[:1], out=[bytearray(10)])
        with pytest.raises(errors.InvalidArgument, match="keys and out differ in length"):
            c.get(keys, out=out[:1])
    deadline = time.monotonic() + 10
    while daemon.stats().leases and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.stats().leases == 0
    assert daemon.check() == []


def _scribbled(c: kvtier.Client, keys: list[bytes], blocks: list[bytes], bad: int) -> None:
    """Commit ``blocks`` under ``keys``, then scribble over block ``bad`` (a buggy writer)."""
    with c.reserve(keys) as r:
        for i, block in enumerate(blocks):
            r.write(i, block)
        scribble = r.buffers[bad]
        r.commit()
    assert scribble is not None
    scribble[0] ^= 0xFF


def _checksum_failures(d: DaemonProc, namespace: str) -> bytes:
    port = d.metrics_port()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    line = [ln for ln in text.splitlines()
            if ln.startswith(f'kvtier_checksum_failures_total{{namespace="{namespace}"'.encode())]
    return line[0].split()[-1] if line else b""


def test_acquire_without_verify_leaves_the_checksums_to_the_reader(daemon: DaemonProc) -> None:
    import xxhash

    keys = [b"v0", b"v1", b"v2"]
    blocks = [bytes([i]) * (3000 + i) for i in range(3)]
    with kvtier.Client(daemon.socket_dir, namespace="noverify", block_bytes=4096,
                       model_uid="m", checksum=True) as c:
        _scribbled(c, keys, blocks, bad=1)
        with pytest.raises(errors.Corrupted):  # the lease's own check still runs by default
            with c.acquire(keys[1:2]):
                pass
        with c.reserve(keys[1:2]) as r:  # write it again
            r.write(0, blocks[1])
            r.commit()
        _scribbled(c, [b"v3"], [b"three"], bad=0)
        with c.acquire(keys + [b"v3"], verify=False) as lease:  # served unchecked
            assert lease.hits == 4
            assert lease.checksums == [xxhash.xxh3_64_intdigest(b)
                                       for b in blocks + [b"three"]]
            sums = [xxhash.xxh3_64_intdigest(bytes(v)) for v in lease.views]
            bad = [i for i, (got, want) in enumerate(zip(sums, lease.checksums, strict=True))
                   if got != want]
            assert bad == [3]
            with pytest.raises(errors.Corrupted,
                               match=rf"^block {b'v3'.hex()} failed its checksum$") as exc:
                lease.drop_corrupted(bad)
            assert exc.value.key == b"v3"
            assert lease.views == []  # released
        assert c.lookup(keys + [b"v3"]) == 3  # the bad block is now a miss
        assert daemon.stats().leases == 0
    assert _checksum_failures(daemon, "noverify") == b"2.0"  # one per way of finding it
    with kvtier.Client(daemon.socket_dir, namespace="nosum", block_bytes=4096,
                       model_uid="m") as c:  # committed without checksums: none to compare
        c.put([b"k"], [b"plain"])
        with c.acquire([b"k"], verify=False) as lease:
            assert lease.checksums == [None]
    assert daemon.check() == []


def test_async_acquire_without_verify_and_drop_corrupted(daemon: DaemonProc) -> None:
    import xxhash

    with kvtier.Client(daemon.socket_dir, namespace="anoverify", block_bytes=4096,
                       model_uid="m", checksum=True) as c:
        _scribbled(c, [b"a", b"b"], [b"good", b"soon bad"], bad=1)

    async def go() -> None:
        async with kvtier.AsyncClient(daemon.socket_dir, namespace="anoverify",
                                      block_bytes=4096, model_uid="m", checksum=True) as c:
            with pytest.raises(errors.Corrupted, match=rf"^block {b'b'.hex()} failed"):
                await c.acquire([b"a", b"b"])  # verify=True: the lease checks
            _ = await c.put([b"b"], [b"soon bad"])
        with kvtier.Client(daemon.socket_dir, namespace="anoverify", block_bytes=4096,
                           model_uid="m", checksum=True) as sync:
            _scribbled(sync, [b"c"], [b"bad now"], bad=0)
        async with kvtier.AsyncClient(daemon.socket_dir, namespace="anoverify",
                                      block_bytes=4096, model_uid="m", checksum=True) as c:
            lease = await c.acquire([b"a", b"b", b"c"], verify=False)
            async with lease:
                assert lease.hits == 3
                assert lease.checksums == [xxhash.xxh3_64_intdigest(b)
                                           for b in (b"good", b"soon bad", b"bad now")]
                assert xxhash.xxh3_64_intdigest(bytes(lease.views[2])) != lease.checksums[2]
                with pytest.raises(errors.Corrupted, match=rf"^block {b'c'.hex()} failed") as exc:
                    await lease.drop_corrupted([2])
                assert exc.value.key == b"c"
            assert await c.lookup([b"a", b"b", b"c"]) == 2

    asyncio.run(go())
    assert daemon.stats().leases == 0
    assert _checksum_failures(daemon, "anoverify") == b"2.0"
    assert daemon.check() == []
