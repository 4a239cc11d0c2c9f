"""A hostile fast-path client of namespace A cannot stall, starve or bloat the daemon.

The attacker (``fast_path_attacker.py``) is its own process, runs as uid 65534
with rights on namespace A only, and attacks through the real client library's
sessions, mappings, session pages and doorbells: its doorbell and data fds made
blocking / append-only, hazard pages full of distinct values rewritten every
50 ms from as many sessions as it may open, counters stepped by 2^40 every
10 ms, every fd and mapping of A's segments kept while another namespace's
writes reclaim them, and A's data files cut under A's honest readers.

Meanwhile clients of B and C (root) run traffic.  For each attack, against the
same daemon before and after a SIGKILL and warm restart:

* the daemon stays responsive: the p99 of a health call and of B's put+get while
  A attacks is at most ``SLOWDOWN`` times the p99 of the same probes in the same
  run without A (generous for a busy 2-core machine; the stalls this catches were
  a second and more, or forever);
* ``Stats`` works, and what it reports of A is bounded (hazards within
  ``limits.max_hazards_per_uid``, read bytes within the page counters' rate bound);
* /dev/shm holds no more than ``dram.capacity`` plus ``SHM_SLACK`` for this
  daemon (its files and the unlinked files the attacker still holds);
* B and C read every block they were acknowledged, byte-exact; ``check()`` is
  clean; A's honest readers survive (and, checksumming, never take a cut block's
  zeros for its bytes) and a block leased by one is not evicted;
* after it all, SIGTERM stops the daemon (a blocked loop would ignore it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvtier
from kvtier._admin import fetch_stats
from kvtier._core import socket_paths
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.counters import HOST_READ_BYTES_PER_SECOND
from kvtierd.shared_index import SessionPage
from tests.conftest import DaemonProc, start_daemon, stop_daemon

BLOCK = 64 << 10
CAPACITY = 16 << 20
EXTENT = 2 << 20
#: /dev/shm beyond dram.capacity that one daemon may hold (docs/security.md): one
#: extent being made while another is retired.
SHM_SLACK = EXTENT
#: How much slower the probes may get while A attacks (p99 against p99).
SLOWDOWN = 8.0
ATTACK_SECONDS = 3.0
ATTACKER = os.path.join(os.path.dirname(__file__), "fast_path_attacker.py")
RULES = """\
access:
  namespaces:
    - match: "A"
      read: ["uid:65534", "uid:0"]
      write: ["uid:65534", "uid:0"]
"""


def _block(key: bytes) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(key))
    return rng.integers(0, 256, BLOCK, dtype=np.uint8)


def _daemon(workdir: str, ssd_dir: str, shm_dir: str | None = None) -> DaemonProc:
    os.chmod(workdir, 0o755)  # the attacker (uid 65534) reaches the sockets
    path = os.path.join(workdir, "rules.yaml")
    with open(path, "w") as f:
        f.write(RULES)
    return start_daemon(workdir, "--config", path, "--set", "server.socket_mode=0666",
                        "--set", f"spill.ssd_dir={ssd_dir}", "--set", "spill.ssd_capacity=1GiB",
                        "--set", "spill.ssd_file_size=32MiB",
                        capacity=f"{CAPACITY >> 20}MiB", extent=f"{EXTENT >> 20}MiB",
                        shm_dir=shm_dir)


def _client(d: DaemonProc, ns: str) -> kvtier.Client:
    return kvtier.Client(d.socket_dir, namespace=ns, block_bytes=BLOCK, model_uid="m")


class _Traffic:
    """Clients of B and C writing and reading back, the keys acknowledged, and the probes:
    B's put+get and a health call, timed one after the other."""

    def __init__(self, d: DaemonProc) -> None:
        self.d = d
        self.acked: dict[str, list[bytes]] = {"B": [], "C": []}
        self.errors: list[BaseException] = []
        self._n = 0

    def probe(self, seconds: float) -> tuple[float, float]:
        """p99 of B's put+get and of a health call over ``seconds``."""
        grpc_path, _ = socket_paths(self.d.socket_dir)
        putget: list[float] = []
        health: list[float] = []
        with grpc.insecure_channel(f"unix:{grpc_path}") as channel, _client(self.d, "B") as b:
            stub = health_pb2_grpc.HealthStub(channel)
            req = health_pb2.HealthCheckRequest(service="kvtier.v1.KVTier")
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                key = f"B/{self._n}".encode()
                self._n += 1
                t0 = time.perf_counter()
                b.put([key], [_block(key)])
                (got,) = b.get([key])
                putget.append(time.perf_counter() - t0)
                assert np.array_equal(got, _block(key)), f"B read wrong bytes for {key!r}"
                self.acked["B"].append(key)
                t0 = time.perf_counter()
                assert stub.Check(req, timeout=30).status == health_pb2.HealthCheckResponse.SERVING
                health.append(time.perf_counter() - t0)
                time.sleep(0.005)  # a steady rate: every block B writes fits the SSD tier
        return float(np.percentile(putget, 99)), float(np.percentile(health, 99))

    def c_writes(self, stop: threading.Event, n: int = CAPACITY // BLOCK) -> None:
        """C writes (and reads back) until ``stop`` or ``n`` blocks: load and DRAM pressure."""
        try:
            with _client(self.d, "C") as c:
                i = 0
                while not stop.is_set() and i < n:
                    keys = [f"C/{len(self.acked['C'])}/{j}".encode() for j in range(4)]
                    c.put(keys, [_block(k) for k in keys])
                    self.acked["C"] += keys
                    got = c.get(keys[:1])
                    assert np.array_equal(got[0], _block(keys[0]))
                    i += 4
                    time.sleep(0.02)
        except BaseException as exc:
            self.errors.append(exc)

    def assert_intact(self) -> None:
        for ns, keys in self.acked.items():
            with _client(self.d, ns) as c:
                for at in range(0, len(keys), 32):
                    chunk = keys[at:at + 32]
                    got = c.get(chunk)
                    assert len(got) == len(chunk), f"{ns}: acknowledged blocks missing"
                    for k, g in zip(chunk, got, strict=True):
                        assert np.array_equal(g, _block(k)), f"{ns}: {k!r} is not byte-exact"


class _Attacker:
    def __init__(self, d: DaemonProc, mode: str, seconds: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, ATTACKER, d.socket_dir, mode, str(seconds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "READY", line + self.proc.communicate(timeout=30)[1][-3000:]

    def finish(self) -> dict[str, Any]:
        out, err = self.proc.communicate("stop\n", timeout=120)
        assert self.proc.returncode == 0, err[-3000:]
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result


def _shm_bytes(d: DaemonProc, holders: list[int]) -> int:
    """Bytes of shared memory this daemon's segments take: the files in its directory and
    the unlinked ones the ``holders`` still have open (each inode once)."""
    seen: dict[int, int] = {}
    for name in os.listdir(d.shm_dir):
        st = os.stat(os.path.join(d.shm_dir, name))
        seen[st.st_ino] = st.st_blocks * 512
    for pid in holders:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(d.shm_dir):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    seen[st.st_ino] = st.st_blocks * 512
            except OSError:
                continue
    return sum(seen.values())


def _daemon_data_fd_flags(d: DaemonProc) -> list[int]:
    """The open-file-description flags of the daemon's own fds of its data files."""
    flags = []
    for fd in os.listdir(f"/proc/{d.proc.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{d.proc.pid}/fd/{fd}")
            if target.startswith(d.shm_dir) and ".seg" in target:
                with open(f"/proc/{d.proc.pid}/fdinfo/{fd}") as f:
                    m = re.search(r"flags:\s+([0-7]+)", f.read())
                assert m is not None
                flags.append(int(m.group(1), 8))
        except OSError:
            continue
    return flags


_READER = textwrap.dedent("""
    import sys, time, numpy as np, kvtier
    from kvtier import errors
    sock, seconds = sys.argv[1], float(sys.argv[2])
    keys = [f"honest/{i}".encode() for i in range(16)]
    reads = misses = errs = 0
    # Checksums on: a block the attacker cut is zeros once the daemon sets its file back,
    # until the daemon drops it; a reader that trusts A's writers (checksums off) may read
    # them (docs/security.md), one with checksums gets a Corrupted miss.
    with kvtier.Client(sock, namespace="A", block_bytes=65536, model_uid="m",
                       checksum=True) as c:
        c.put(keys, [np.full(65536, i, np.uint8) for i in range(16)])
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for i, k in enumerate(keys):
                try:
                    got = c.get([k])
                except errors.KVTierError:
                    errs += 1
                    continue
                if not got:
                    misses += 1
                    continue
                reads += 1
                assert (got[0] == i).all(), "an honest reader of A read wrong bytes"
    print(reads, misses, errs)
""")


def _baseline(traffic: _Traffic) -> tuple[float, float]:
    """The probes' p99 with C's traffic going and no A: what an attack is compared to."""
    stop = threading.Event()
    c_thread = threading.Thread(target=traffic.c_writes, args=(stop,), daemon=True)
    c_thread.start()
    try:
        return traffic.probe(ATTACK_SECONDS)
    finally:
        stop.set()
        c_thread.join(120)


def _attack(d: DaemonProc, traffic: _Traffic, mode: str, base: tuple[float, float]) -> None:
    """One attack while B and C run traffic, and every check of the module docstring."""
    stop = threading.Event()
    c_thread = threading.Thread(target=traffic.c_writes, args=(stop,), daemon=True)
    reader = None
    if mode == "truncate":  # an honest reader of A in its own process, as A's fleet would be
        reader = subprocess.Popen([sys.executable, "-c", _READER, d.socket_dir,
                                   str(ATTACK_SECONDS + 2)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
    attacker = _Attacker(d, mode, ATTACK_SECONDS if mode != "hoard" else 120)
    c_thread.start()
    held_block = None
    try:
        if mode == "hoard":
            # An honest reader of A leases a block without a call and holds it while C's
            # writes make the daemon reclaim A's extents.
            honest = _client(d, "A")
            hkey = f"A/held/{time.monotonic_ns()}".encode()  # new: in DRAM, leased locally
            honest.put([hkey], [_block(hkey)])
            held_block = honest.acquire([hkey])
            assert len(held_block.views) == 1 and held_block._local is not None  # no call
        p_putget, p_health = traffic.probe(ATTACK_SECONDS)
        if mode == "hoard":
            stop.set()
            c_thread.join(120)
            # C fills DRAM twice over: everything of A that nobody holds is reclaimed.
            traffic.c_writes(threading.Event(), n=2 * CAPACITY // BLOCK)
            shm = _shm_bytes(d, [attacker.proc.pid])
            assert shm <= CAPACITY + SHM_SLACK, f"/dev/shm holds {shm} bytes for this daemon"
            assert held_block is not None
            assert np.array_equal(np.asarray(held_block.views[0]), _block(hkey))
            held_block.release()
            honest.close()
        result = attacker.finish()
    finally:
        stop.set()
        c_thread.join(120)
        if attacker.proc.poll() is None:
            attacker.proc.kill()
            attacker.proc.wait(10)
    assert not traffic.errors, traffic.errors
    print(f"{mode}: p99 put+get {p_putget * 1e3:.1f} ms / {base[0] * 1e3:.1f} ms without A "
          f"({p_putget / base[0]:.1f}x), health {p_health * 1e3:.1f} / {base[1] * 1e3:.1f} ms "
          f"({p_health / base[1]:.1f}x); {result}")
    if p_putget > SLOWDOWN * base[0] or p_health > SLOWDOWN * base[1]:
        # The machine's own load may have changed since the first baseline (CI shares
        # two cores): measure the run without A again, now, and take the slower one.
        again = _baseline(traffic)
        base = (max(base[0], again[0]), max(base[1], again[1]))
        print(f"{mode}: baseline again: {again[0] * 1e3:.1f} / {again[1] * 1e3:.1f} ms")
    limit_putget, limit_health = SLOWDOWN * base[0], SLOWDOWN * base[1]
    assert p_putget <= limit_putget and p_health <= limit_health, (
        f"{mode}: p99 put+get {p_putget * 1e3:.1f} ms (without A {base[0] * 1e3:.1f} ms), "
        f"health {p_health * 1e3:.1f} ms (without A {base[1] * 1e3:.1f} ms); {result}")
    stats = fetch_stats(d.socket_dir, timeout=30)
    if mode == "doorbell":
        assert result.get("drain_error") == "Bad file descriptor", result  # a write end only
        assert result["data_fds_flagged"] > 0
        flags = _daemon_data_fd_flags(d)
        assert flags and not any(f & os.O_APPEND for f in flags), flags
    elif mode == "hazards":
        assert result["sessions"] > 21 and result["rounds"] > 10, result
        # A's leases (all of them the attacker's hazards: the share of its uid) -- the
        # host-wide hazard_blocks also counts B's and C's reads in flight.
        # (A is gone when, its attacker done, C's writes reclaimed its cold extents and
        # nobody used it any more: then it leases nothing.)
        a = next((n for n in stats.namespaces if n.name == "A"), None)
        assert a is None or a.leased_blocks <= 16384, a.leased_blocks
    elif mode == "counters":
        dram = [io for io in stats.io if io.tier == pb.TIER_DRAM]
        # The attack steps A's page counters by 2^40 every 10 ms: they reach only A's
        # client-reported figures, never the host's DRAM reads (which count
        # the Acquire calls the daemon served: B's and C's reads here are without one).
        bound = (ATTACK_SECONDS + 10) * SessionPage.MAX_BLOCKS_PER_SECOND * BLOCK
        assert not dram or dram[0].read_bytes <= bound, dram
        a = next((n for n in stats.namespaces if n.name == "A"), None)
        assert a is None or a.client_reported.read_bytes <= (
            stats.uptime_seconds * HOST_READ_BYTES_PER_SECOND), a.client_reported
        assert a is None or a.client_reported.read_bytes <= (
            a.client_reported.acquire_hits * BLOCK), a.client_reported
    elif mode == "hoard":
        assert result["unlinked_files"] > 0, result  # the daemon did reclaim A's extents
        assert result["unlinked_bytes"] <= SHM_SLACK, result
    elif mode == "calls":
        # The flood went on for the whole attack: the daemon read every frame and never
        # ended A's session (a frame cut by a resent burst would have ended it).
        assert "send_error" not in result and result.get("bursts", 0) >= 1, result
    elif mode == "truncate":
        assert reader is not None
        out, err = reader.communicate(timeout=60)
        assert reader.returncode == 0, f"an honest reader of A died ({reader.returncode}): {err}"
        assert result["cuts"] > 5
    shm = _shm_bytes(d, [])
    assert shm <= CAPACITY + SHM_SLACK, f"/dev/shm holds {shm} bytes for this daemon"
    time.sleep(2.5)  # one audit period: data files A damaged are set back
    assert d.alive(), d.log()[-3000:]
    traffic.assert_intact()
    assert d.check() == []


@pytest.mark.one_transport  # the attack is the fast path's; B and C use it too
@pytest.mark.parametrize("mode", ["doorbell", "hazards", "counters", "hoard", "truncate",
                                  "calls"])
def test_a_hostile_fast_path_client_costs_only_itself(workdir: str, disk_dir: str,
                                                      mode: str) -> None:
    d = _daemon(workdir, disk_dir)
    try:
        traffic = _Traffic(d)
        traffic.probe(0.5)  # warm: segments made, connections open
        base = _baseline(traffic)
        _attack(d, traffic, mode, base)
        shm_dir = d.shm_dir
        d.kill()
        d = _daemon(workdir, disk_dir, shm_dir=shm_dir)
        traffic.d = d
        traffic.assert_intact()
        _attack(d, traffic, mode, base)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(20)
        assert time.monotonic() - t0 < 20
    finally:
        stop_daemon(d)
