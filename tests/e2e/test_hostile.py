"""A hostile writer of namespace A, with every fd and mapping the daemon gives it.

The daemon's promise to a tenant's neighbours: whatever a writer does to its data files —
truncate them, extend them, punch holes, ``madvise(MADV_REMOVE)``, close and
reopen them, scribble over every byte, close its session and come back —
kvtierd stays up, the
other namespaces (B and C, running traffic meanwhile) read every block they
were acknowledged byte-exact, ``check()`` is clean and capacity balances;
then the daemon is SIGKILLed and restarted, and the same holds again (warm
for B and C).  A's own blocks may be lost (its writer destroyed them), never
served wrong: a read of A returns its bytes or a kvtier error.

The daemon runs with an SSD tier and a DRAM pool smaller than the three
namespaces' data, so it demotes and promotes through A's damaged slots
(reads them for the SSD, writes promoted blocks into them) while the abuse
goes on.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np
import pytest

import kvtier
from kvtier import errors
from kvtier._session import SessionLink, open_request
from tests.conftest import DaemonProc, start_daemon, stop_daemon

BLOCK = 256 << 10
N_BLOCKS = 24  # per namespace and round: three namespaces overflow the 16 MiB pool
MODEL = "m"

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MADV_REMOVE = 9


def _keys(ns: str, rnd: int, n: int = N_BLOCKS) -> list[bytes]:
    return [f"{ns}/{rnd}/{i}".encode() for i in range(n)]


def _block(key: bytes) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(key))
    return rng.integers(0, 256, BLOCK, dtype=np.uint8)


# ----------------------------------------------------------------------- abuses
# Each gets the writer's raw data fds of namespace A (as the session channel sent
# them) and their sizes.

def _truncate(fds: list[tuple[int, int]]) -> None:
    for fd, _ in fds:
        os.ftruncate(fd, 0)


def _truncate_half(fds: list[tuple[int, int]]) -> None:
    for fd, size in fds:
        os.ftruncate(fd, size // 2)


def _grow(fds: list[tuple[int, int]]) -> None:
    for fd, size in fds:
        os.ftruncate(fd, size * 4)
        os.pwrite(fd, b"x" * 65536, size * 3)  # and take memory there


def _punch(fds: list[tuple[int, int]]) -> None:
    for fd, size in fds:
        if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size) != 0:
            raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE)")


def _madv_remove(fds: list[tuple[int, int]]) -> None:
    for fd, size in fds:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        mm.madvise(MADV_REMOVE)
        mm.close()


def _scribble(fds: list[tuple[int, int]]) -> None:
    rng = np.random.default_rng(7)
    for fd, size in fds:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        np.frombuffer(mm, dtype=np.uint8)[:] = rng.integers(0, 256, size, dtype=np.uint8)
        mm.close()


def _truncate_then_restore(fds: list[tuple[int, int]]) -> None:
    """Cut and set back at once: the pages are gone, the size looks right to an fstat."""
    for fd, size in fds:
        os.ftruncate(fd, 0)
        os.ftruncate(fd, size)


def _reopen(fds: list[tuple[int, int]]) -> None:
    """Close and reopen: a new open file description of the same data file (through
    /proc/self/fd, the only path a client has), truncating, then scribbling past."""
    for fd, size in fds:
        again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_TRUNC)
        os.pwrite(again, b"\xff" * 4096, size // 2)
        os.close(again)


ABUSES: dict[str, Callable[[list[tuple[int, int]]], None]] = {
    "truncate": _truncate,
    "truncate_half": _truncate_half,
    "grow": _grow,
    "punch_holes": _punch,
    "madv_remove": _madv_remove,
    "scribble": _scribble,
    "truncate_and_restore": _truncate_then_restore,
    "reopen": _reopen,
}


# ----------------------------------------------------------------------- harness
def _daemon(workdir: str, ssd_dir: str, shm_dir: str | None = None) -> DaemonProc:
    return start_daemon(workdir, "--set", f"spill.ssd_dir={ssd_dir}",
                        "--set", "spill.ssd_capacity=256MiB", "--set", "spill.ssd_file_size=32MiB",
                        capacity="16MiB", extent="2MiB", shm_dir=shm_dir)


def _client(d: DaemonProc, ns: str) -> kvtier.Client:
    # Checksums: a block A's writer scribbled over while it was in DRAM can only be
    # told from its bytes by the reader (the daemon never reads payload).
    return kvtier.Client(d.socket_dir, namespace=ns, block_bytes=BLOCK, model_uid=MODEL,
                         checksum=True)


def _write(d: DaemonProc, ns: str, rnd: int) -> list[bytes]:
    """Put a round of blocks; the keys acknowledged (put returned)."""
    keys = _keys(ns, rnd)
    with _client(d, ns) as c:
        for k in keys:
            c.put([k], [_block(k)])
    return keys


def _assert_intact(d: DaemonProc, ns: str, keys: list[bytes]) -> None:
    with _client(d, ns) as c:
        for k in keys:
            (got,) = c.get([k])
            assert np.array_equal(got, _block(k)), f"{ns}: {k!r} is not byte-exact"


def _a_reads_never_wrong(d: DaemonProc, keys: list[bytes]) -> int:
    """A's blocks after the abuse: each read is its bytes or a kvtier error. Returns reads."""
    ok = 0
    try:
        c = _client(d, "A")  # may fail while a file is cut short: A's own damage
    except errors.KVTierError:
        return 0
    with c:
        for k in keys:
            try:
                got = c.get([k])
            except errors.KVTierError:
                continue
            if got:
                assert np.array_equal(got[0], _block(k)), f"A served wrong bytes for {k!r}"
                ok += 1
    return ok


def _writer_fds(d: DaemonProc) -> tuple[SessionLink, list[tuple[int, int]]]:
    link = SessionLink(os.path.join(d.socket_dir, "kvtier-session.sock"), 10)
    resp, fds = link.request(open_request("A", BLOCK, MODEL))
    assert not resp.opened.read_only and fds
    by_id = {s.segment_id: s for s in resp.opened.segments}
    n = len(resp.opened.segments)
    for fd in fds[n:]:  # the shared index and lookup counters: tests/e2e/test_shared_index.py
        os.close(fd)
    sized = [(fd, by_id[s.segment_id].data_bytes)
             for fd, s in zip(fds[:n], resp.opened.segments, strict=True)]
    return link, sized


def _traffic(d: DaemonProc, ns: str, rounds: range, acked: list[bytes],
             stop: threading.Event, failures: list[BaseException]) -> None:
    try:
        for rnd in rounds:
            if stop.is_set():
                break
            acked.extend(_write(d, ns, rnd))
            _assert_intact(d, ns, acked[-N_BLOCKS:])
    except BaseException as exc:  # surfaced by the test thread
        failures.append(exc)


def _healthy(d: DaemonProc, acked: dict[str, list[bytes]]) -> None:
    assert d.alive(), d.log()[-4000:]
    assert "Traceback" not in d.log(), d.log()[-4000:]
    for ns in ("B", "C"):
        _assert_intact(d, ns, acked[ns])
    assert d.check() == []


@pytest.mark.parametrize("abuse", list(ABUSES), ids=list(ABUSES))
def test_a_hostile_writer_cannot_hurt_the_daemon_or_other_namespaces(
    workdir: str, disk_dir: str, abuse: str
) -> None:
    d = _daemon(workdir, disk_dir)
    try:
        acked: dict[str, list[bytes]] = {"A": [], "B": [], "C": []}
        for ns in acked:
            acked[ns] += _write(d, ns, 0)
        link, fds = _writer_fds(d)
        stop, failures = threading.Event(), []
        threads = [threading.Thread(target=_traffic, args=(d, ns, range(1, 3), acked[ns], stop,
                                                          failures)) for ns in ("B", "C")]
        for t in threads:
            t.start()
        try:
            ABUSES[abuse](fds)
            # A keeps working through its damaged files: the daemon demotes, promotes
            # and writes through them (its own errors are its own).
            for rnd in (1, 2):
                try:
                    acked["A"] += _write(d, "A", rnd)
                except errors.KVTierError:
                    pass
                _a_reads_never_wrong(d, acked["A"])
        finally:
            for t in threads:
                t.join(120)
            stop.set()
            for fd, _ in fds:
                os.close(fd)
            link.close()
        assert not failures, failures
        time.sleep(2.5)  # one audit period: the daemon repairs what the writer changed
        _healthy(d, acked)
        _a_reads_never_wrong(d, acked["A"])
        if abuse == "grow":
            for name in os.listdir(d.shm_dir):
                if name.endswith(".seg"):
                    size = os.stat(os.path.join(d.shm_dir, name)).st_size
                    assert size <= 16 << 20, f"{name} is still {size} bytes"

        for ns in ("B", "C"):  # their newest blocks are in DRAM at the kill
            _assert_intact(d, ns, acked[ns][-8:])
        shm_dir = d.shm_dir
        d.kill()
        d = _daemon(workdir, disk_dir, shm_dir=shm_dir)
        # Warm for B and C: their DRAM blocks were re-adopted, not promoted again.
        assert re.search(r"namespace 'B': warm, [1-9]", d.log()), d.log()[-3000:]
        assert re.search(r"namespace 'C': warm, [1-9]", d.log()), d.log()[-3000:]
        _healthy(d, acked)
        _a_reads_never_wrong(d, acked["A"])
        # The store's own check over what was adopted ran right after READY, clean.
        deadline = time.monotonic() + 15
        while not re.search(r"recovery check: \d+ blocks cross-checked in \S+ s, 0 problems",
                            d.log()):
            assert time.monotonic() < deadline, d.log()[-3000:]
            time.sleep(0.2)
    finally:
        stop_daemon(d)
