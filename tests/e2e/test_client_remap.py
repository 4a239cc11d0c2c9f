"""Clients never see a segment the daemon retired as an error.

Under eviction pressure the daemon reclaims extents from one namespace for
another: it unlinks the extent's data file, and cuts it to
0 bytes right away so its memory goes even while clients keep fds.  A client
that was sent the fd just before, or maps it just after, finds a file shorter
than its ``SegmentInfo``.  Here a watcher in the test does the cutting for
every data file the moment it is unlinked (whether the daemon does it itself
or not), while client processes of three namespaces on a tiny pool put, get,
acquire and reopen their sessions; none may see an error other than
``CapacityExhausted`` (the pool is full of pinned blocks), none may die, every
read is byte-exact, and the daemon's ``check()`` is clean at the end.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import start_daemon, stop_daemon

#: The client process: random puts, gets, verifying acquires and reopened sessions
#: for SECONDS; prints ERROR lines for any error but CapacityExhausted, then REMAP.
WORKER = r"""
import random, sys, time
import numpy as np
import kvtier
from kvtier import _accel, errors

faults = 0
_is_fault = _accel.is_memory_fault

def _counting(exc):  # how many copies hit memory that was gone (guarded, survived)
    global faults
    hit = _is_fault(exc)
    faults += hit
    return hit

_accel.is_memory_fault = _counting
sock, ns, bb, seed, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
rng = random.Random(seed)
universe = [f"{seed}-{i}".encode() for i in range(120)]

def block(key):
    return np.random.default_rng(int.from_bytes(key[:8].ljust(8, b"0"), "little")).integers(
        0, 256, bb, dtype=np.uint8)

def client():
    return kvtier.Client(sock, namespace=ns, block_bytes=bb, model_uid="m", checksum=True)

c = client()
ops = errors_seen = kept = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    keys = rng.sample(universe, rng.randint(1, 8))
    op = rng.random()
    try:
        if op < 0.15:
            c.close()
            c = client()
        elif op < 0.55:
            c.put(keys, [block(k) for k in keys])
        elif op < 0.85:
            for k, got in zip(keys, c.get(keys)):
                if not np.array_equal(got, block(k)):
                    print(f"CORRUPT {k!r}", flush=True)
                    sys.exit(1)
        else:
            with c.acquire(keys) as lease:
                pass
    except errors.CapacityExhausted:
        pass
    except errors.KVTierError as exc:
        errors_seen += 1
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
    kept += bool(getattr(c._maps, "_unmapped", None))
    ops += 1
c.close()
print(f"REMAP ops={ops} errors={errors_seen} kept_fds={kept} faults={faults}", flush=True)
"""


class Cutter:
    """Cuts every data file of ``shm_dir`` to 0 bytes as soon as it is unlinked (what the
    daemon does to a retired extent's file after a grace period), from a thread."""

    def __init__(self, shm_dir: str) -> None:
        self.shm_dir = shm_dir
        self.cut = 0
        self._fds: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Cutter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for fd in self._fds.values():
            os.close(fd)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(self.shm_dir):
                    if name.endswith(".seg") and name not in self._fds:
                        with contextlib.suppress(FileNotFoundError):
                            self._fds[name] = os.open(os.path.join(self.shm_dir, name), os.O_RDWR)
            for name, fd in list(self._fds.items()):
                if os.fstat(fd).st_nlink == 0:  # retired: unlinked by the daemon
                    os.ftruncate(fd, 0)
                    os.close(fd)
                    del self._fds[name]
                    self.cut += 1


@pytest.mark.parametrize("seconds", [6])
def test_clients_never_see_a_retired_segment_under_eviction_pressure(workdir: str,
                                                                    seconds: int) -> None:
    # 8 MiB pool, 1 MiB extents, three namespaces: extents move between them all the time.
    d = start_daemon(workdir, capacity="8MiB", extent="1MiB")
    try:
        with Cutter(d.shm_dir) as cutter:
            started = time.monotonic()
            workers = [
                subprocess.Popen([sys.executable, "-c", WORKER, d.socket_dir, f"remap/{seed % 3}",
                                  str((16384, 65536, 200000)[seed % 3]), str(seed), str(seconds)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for seed in range(6)
            ]
            results = [p.communicate(timeout=seconds + 120) for p in workers]
            assert time.monotonic() - started < 60
        print(f"{cutter.cut} data files cut;", " ".join(out.strip().splitlines()[-1]
                                                      for out, _ in results if out.strip()))
        for p, (out, err) in zip(workers, results, strict=True):
            assert p.returncode == 0, (p.returncode, out[-2000:], err[-3000:])
            assert "ERROR" not in out, out[-3000:]
            assert "REMAP" in out, (out, err[-3000:])
        assert cutter.cut > 0, "no extent was retired: no pressure"
        s = d.stats()
        assert (s.leases, s.reservations) == (0, 0)
        assert d.alive(), d.log()[-3000:]
        assert d.check() == []
    finally:
        stop_daemon(d)
