"""The client's fault guard: a writer truncating a data file does not kill the readers.

A real kvtierd; a writer commits blocks; a reader in a separate process maps
the namespace's segments; then this test, as a hostile writer of the
namespace with its own data fds, truncates every data file to 0 and tells
the reader to go on.  The reader's get, acquire (verifying) and guarded
copies of a lease's views must report misses, its writes errors, and the
process must exit normally (no SIGBUS), well before the daemon's audit
(every 2 s) sets the files back.  Without the guard (``KVTIER_FAULT_GUARD=0``)
the same reader dies of SIGBUS: the truncation really faults.

Segment fds that cannot be mapped (the daemon cuts a
retired extent's file to 0; a writer cuts a live one) are tested on
``SegmentMaps`` directly, and end to end: a client opened while its
namespace's files are cut short opens, misses and recovers.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvtier
from kvtier import _accel, errors
from kvtier._session import SegmentMaps, SessionLink, open_request
from kvtier.v1 import kvtier_pb2 as pb
from tests.conftest import DaemonProc, start_daemon, stop_daemon

NS = "fg/ns"
BLOCK = 64 << 10
N = 6

pytestmark = pytest.mark.skipif(not _accel.NATIVE,
                                reason="the fault guard needs kvtier._native in use")

#: The reader/writer process: opens its client (maps every segment), says READY,
#: waits for GO (the files were cut), runs its phase and prints DONE {results}.
CHILD = r"""
import json, sys
import numpy as np
import kvtier
from kvtier import _accel, errors

sock, action, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
keys = {name: [bytes.fromhex(k) for k in ks] for name, ks in args["keys"].items()}
block = args["block"]
c = kvtier.Client(sock, namespace=args["ns"], block_bytes=block, model_uid="m",
                  checksum=args["checksum"])
r = c.reserve(keys["reserve"]) if action == "write" else None
if action != "aread":  # (the AsyncClient opens first, then says READY)
    print("READY", json.dumps({"guard": c.fault_guard}), flush=True)
    sys.stdin.readline()
out = {}
if action == "read":
    out["get"] = len(c.get(keys["get"]))
    out["get_out"] = len(c.get(keys["get_out"], out=[bytearray(block) for _ in keys["get_out"]]))
    with c.acquire(keys["acquire"]) as lease:
        out["acquire"] = lease.hits
    lease = c.acquire(keys["copy"], verify=False)
    out["copy_hits"] = lease.hits
    dst = bytearray(block)
    copied = 0
    for i, v in enumerate(lease.views):
        try:
            _accel.copy_into(dst, v)
        except OSError as exc:
            assert _accel.is_memory_fault(exc), exc
            lease.drop_gone(i)
            break
        copied += 1
    else:
        lease.release()
    out["copy"] = copied
elif action == "aread":
    import asyncio

    async def main():
        async with kvtier.AsyncClient(sock, namespace=args["ns"], block_bytes=block,
                                      model_uid="m", checksum=args["checksum"]) as a:
            print("READY", json.dumps({"guard": a.fault_guard}), flush=True)
            sys.stdin.readline()
            out["get"] = len(await a.get(keys["get"]))
            out["get_out"] = len(await a.get(keys["get_out"],
                                             out=[bytearray(block) for _ in keys["get_out"]]))
            async with await a.acquire(keys["acquire"]) as lease:
                out["acquire"] = lease.hits
            lease = await a.acquire(keys["copy"], verify=False)
            out["copy"] = 0
            for i, v in enumerate(lease.views):
                try:
                    _accel.copy_into(bytearray(block), v)
                except OSError as exc:
                    assert _accel.is_memory_fault(exc), exc
                    await lease.drop_gone(i)
                    break
                out["copy"] += 1
            else:
                await lease.release()
            try:
                await a.put(keys["put"], [np.ones(block, np.uint8)] * len(keys["put"]))
                out["put"] = "ok"
            except errors.FailedPrecondition:
                out["put"] = "FailedPrecondition"
            out["reservations"] = int((await a.stats())["reservations"])

    asyncio.run(main())
else:
    data = np.full(block, 7, np.uint8)
    try:
        r.write(0, data)
        out["write"] = "ok"
    except errors.FailedPrecondition as exc:
        out["write"] = "FailedPrecondition"
        out["message"] = str(exc)
    try:
        out["commit"] = f"ok {r.commit()}"
    except errors.FailedPrecondition:
        out["commit"] = "FailedPrecondition"
    try:
        out["put"] = f"ok {c.put(keys['put'], [data] * len(keys['put']))}"
    except errors.FailedPrecondition:
        out["put"] = "FailedPrecondition"
    out["reservations"] = int(c.stats()["reservations"])
print("DONE", json.dumps(out), flush=True)
c.close()
"""


@pytest.fixture
def kvd() -> Iterator[DaemonProc]:
    base = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    d = start_daemon(base)
    yield d
    stop_daemon(d)
    shutil.rmtree(base, ignore_errors=True)


def _keys(tag: str, n: int = N) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def _put(d: DaemonProc, keys: list[bytes]) -> None:
    with kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BLOCK, model_uid="m",
                       checksum=True) as c:
        assert c.put(keys, [np.full(BLOCK, i + 1, np.uint8) for i in range(len(keys))]) == len(keys)


def _truncate_all(d: DaemonProc, ns: str = NS, block: int = BLOCK, model: str = "m") -> int:
    """As a hostile writer of the namespace: cut every data file of it to 0 (its own fds)."""
    link = SessionLink(os.path.join(d.socket_dir, "kvtier-session.sock"), 10)
    try:
        resp, fds = link.request(open_request(ns, block, model))
        n = len(resp.opened.segments)
        assert n and not resp.opened.read_only
        for fd in fds[:n]:
            os.ftruncate(fd, 0)
        for fd in fds:
            os.close(fd)
    finally:
        link.close()
    return n


def _child(d: DaemonProc, action: str, keys: dict[str, list[bytes]], checksum: bool,
           guard: bool = True) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env[_accel.FAULT_GUARD_ENV] = "1" if guard else "0"
    args = {"ns": NS, "block": BLOCK, "checksum": checksum,
            "keys": {k: [x.hex() for x in v] for k, v in keys.items()}}
    return subprocess.Popen([sys.executable, "-c", CHILD, d.socket_dir, action, json.dumps(args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _cut_under(d: DaemonProc, p: subprocess.Popen[str]) -> tuple[dict[str, object], str]:
    """Wait for READY, cut the files, say GO; (the child's results, its stderr)."""
    assert p.stdout is not None and p.stdin is not None
    line = p.stdout.readline()
    assert line.startswith("READY"), (line, p.stderr.read() if p.stderr else "")
    _truncate_all(d)
    p.stdin.write("GO\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=60)
    done = [x for x in out.splitlines() if x.startswith("DONE ")]
    return (json.loads(done[0][5:]) if done else {}), err


@pytest.mark.parametrize("action", ["read", "aread"], ids=["Client", "AsyncClient"])
@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksum"])
def test_a_reader_survives_a_truncation_under_its_reads_and_misses(kvd: DaemonProc,
                                                                   checksum: bool,
                                                                   action: str) -> None:
    keys = {"get": _keys("get"), "get_out": _keys("out"), "acquire": _keys("acq"),
            "copy": _keys("copy")}
    _put(kvd, [k for ks in keys.values() for k in ks])
    if action == "aread":
        keys["put"] = _keys("aput", 2)
    p = _child(kvd, action, keys, checksum)
    got, err = _cut_under(kvd, p)
    assert p.returncode == 0, (p.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    # Every block's memory is gone: each read misses from its first block on.
    assert got["get"] == 0 and got["get_out"] == 0, got
    assert got["copy"] == 0, got
    # A verifying acquire touches the slots (and misses); a plain one does not.
    assert got["acquire"] == (0 if checksum else N), got
    if action == "aread":  # a write elsewhere, or the error; never left open
        assert got["put"] in ("ok", "FailedPrecondition") and got["reservations"] == 0, got
    assert kvd.alive(), kvd.log()[-3000:]
    # The blocks whose memory was gone under a read are not served again.
    with kvtier.Client(kvd.socket_dir, namespace=NS, block_bytes=BLOCK, model_uid="m") as c:
        assert c.lookup(keys["get"]) == 0
        assert c.lookup(keys["copy"]) == 0


def test_a_writer_into_a_truncated_slot_gets_an_error_and_its_reservation_is_aborted(
        kvd: DaemonProc) -> None:
    _put(kvd, _keys("first"))  # the namespace has a segment with blocks in it
    for attempt in range(3):  # the daemon's audit may set the files back before the write
        keys = {"reserve": _keys(f"res{attempt}", 1), "put": _keys(f"put{attempt}", 3)}
        p = _child(kvd, "write", keys, checksum=True)
        got, err = _cut_under(kvd, p)
        assert p.returncode == 0, (p.returncode, err[-3000:])
        assert "Traceback" not in err, err[-3000:]
        assert got["reservations"] == 0, got  # nothing left open: aborted or committed
        # A put writes elsewhere (a Reserve call after a faulting grant) or fails clearly.
        assert got["put"] in ("ok 3", "FailedPrecondition"), got
        if got["write"] == "FailedPrecondition":
            assert "truncated" in str(got["message"]), got
            assert got["commit"] == "FailedPrecondition", got  # never committed
            break
        time.sleep(0.5)
    else:
        pytest.fail("the write never faulted (the audit was quicker three times)")
    assert kvd.alive(), kvd.log()[-3000:]
    with kvtier.Client(kvd.socket_dir, namespace=NS, block_bytes=BLOCK, model_uid="m") as c:
        assert c.lookup(keys["reserve"]) == 0


def test_without_the_guard_the_same_reader_dies_of_sigbus(kvd: DaemonProc) -> None:
    keys = {"get": _keys("get"), "get_out": _keys("out"), "acquire": _keys("acq"),
            "copy": _keys("copy")}
    _put(kvd, [k for ks in keys.values() for k in ks])
    p = _child(kvd, "read", keys, checksum=False, guard=False)
    _cut_under(kvd, p)
    assert p.returncode == -signal.SIGBUS, p.returncode


def test_a_client_opens_while_its_files_are_cut_short_and_recovers(kvd: DaemonProc) -> None:
    """Segment fds that cannot be mapped are no error: the session opens, reads of
    blocks there miss, and once the audit set the files back the client maps them."""
    keys = _keys("open")
    _put(kvd, keys)
    _truncate_all(kvd)
    with kvtier.Client(kvd.socket_dir, namespace=NS, block_bytes=BLOCK, model_uid="m") as c:
        # (Unless the audit was quicker, the segments are kept unmapped.)
        assert c.get(keys) == []  # a miss: cut short, or dropped by the audit
        deadline = time.monotonic() + 15
        while True:  # the audit sets the files back (blocks lost dropped): writes work again
            try:
                assert c.put(_keys("later", 2), [np.ones(BLOCK, np.uint8)] * 2) == 2
                break
            except errors.FailedPrecondition as exc:
                assert "truncated" in str(exc) or "not mapped" in str(exc), exc
                assert time.monotonic() < deadline, exc
                time.sleep(0.2)
        got = c.get(_keys("later", 2))
        assert [int(g[0]) for g in got] == [1, 1]
        assert c._maps.mappings()  # mapped again on use


def test_an_async_client_opens_while_its_files_are_cut_short_and_recovers(
        kvd: DaemonProc) -> None:
    keys = _keys("aopen")
    _put(kvd, keys)
    _truncate_all(kvd)

    async def main() -> None:
        async with kvtier.AsyncClient(kvd.socket_dir, namespace=NS, block_bytes=BLOCK,
                                      model_uid="m") as c:
            assert await c.get(keys) == []
            deadline = time.monotonic() + 15
            while True:
                try:
                    assert await c.put(_keys("alater", 2), [np.ones(BLOCK, np.uint8)] * 2) == 2
                    break
                except errors.FailedPrecondition as exc:
                    assert "truncated" in str(exc) or "not mapped" in str(exc), exc
                    assert time.monotonic() < deadline, exc
                    await asyncio.sleep(0.2)
            got = await c.get(_keys("alater", 2))
            assert [int(g[0]) for g in got] == [1, 1]
            assert c._maps.mappings()  # mapped again on use

    asyncio.run(main())


# ------------------------------------------------------------------- adapters
#: A torch or JAX serving process: saves pages, says READY (with its namespace), waits
#: for GO (the files were cut), then loads (expecting misses) and saves again.
ADAPTER_CHILD = r"""
import json, sys
import numpy as np
import kvtier
from kvtier import errors

sock, which, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
keys_a = [b"a%d" % i for i in range(4)]
keys_b = [b"b%d" % i for i in range(4)]
out = {}
if which == "torch":
    import torch
    import kvtier.torch as kt
    def array():
        if args["noncontig"]:  # each page strided: the private-block path
            return torch.randn(8, 2, 16, 64).transpose(1, 2)
        return torch.randn(8, 16, 2, 64)
    cache = [(array(), array()) for _ in range(2)]
    lay = kt.layout_of(cache)
    c = kvtier.Client(sock, **kt.namespace_for(lay, "m"), checksum=args["checksum"])
    assert kt.save(c, cache, [0, 1, 2, 3], keys_a) == 4
    print("READY", json.dumps(kt.namespace_for(lay, "m")), flush=True)
    sys.stdin.readline()
    out["load"] = kt.load(c, keys_a, cache, [4, 5, 6, 7])
    try:
        out["save"] = f"ok {kt.save(c, cache, [0, 1], [b'n0', b'n1'])}"
    except errors.FailedPrecondition:
        out["save"] = "FailedPrecondition"
else:
    import jax.numpy as jnp
    import kvtier.jax as kj
    rng = np.random.default_rng(1)
    cache = [(jnp.asarray(rng.standard_normal((8, 16, 2, 64), np.float32)),
              jnp.asarray(rng.standard_normal((8, 16, 2, 64), np.float32))) for _ in range(2)]
    lay = kj.layout_of(cache)
    c = kvtier.Client(sock, **kj.namespace_for(lay, "m"), checksum=args["checksum"])
    assert kj.save(c, cache, [0, 1, 2, 3], keys_a) == 4
    assert kj.save(c, cache, [0, 1, 2, 3], keys_b) == 4
    print("READY", json.dumps(kj.namespace_for(lay, "m")), flush=True)
    sys.stdin.readline()
    cache, out["load"] = kj.load(c, keys_a, cache, [4, 5, 6, 7])
    cache, out["load_copy"] = kj.load(c, keys_b, cache, [4, 5, 6, 7], donate=False)
    try:
        out["save"] = f"ok {kj.save(c, cache, [0, 1], [b'n0', b'n1'])}"
    except errors.FailedPrecondition:
        out["save"] = "FailedPrecondition"
out["reservations"] = int(c.stats()["reservations"])
print("DONE", json.dumps(out), flush=True)
c.close()
"""


@pytest.mark.parametrize(("which", "checksum", "noncontig"), [
    ("torch", False, False), ("torch", True, False), ("torch", False, True),
    ("jax", False, False), ("jax", True, False)],
    ids=["torch", "torch-checksum", "torch-strided", "jax", "jax-checksum"])
def test_an_adapter_load_under_a_truncation_misses_and_its_save_fails_cleanly(
        kvd: DaemonProc, which: str, checksum: bool, noncontig: bool) -> None:
    pytest.importorskip(which)
    args = {"checksum": checksum, "noncontig": noncontig}
    p = subprocess.Popen([sys.executable, "-c", ADAPTER_CHILD, kvd.socket_dir, which,
                          json.dumps(args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdin is not None
    line = p.stdout.readline()
    assert line.startswith("READY"), (line, p.stderr.read() if p.stderr else "")
    ns = json.loads(line[6:])
    _truncate_all(kvd, ns["namespace"], ns["block_bytes"], ns["model_uid"])
    p.stdin.write("GO\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, (p.returncode, err[-3000:])
    got = json.loads([x for x in out.splitlines() if x.startswith("DONE ")][0][5:])
    assert got["load"] == 0, got
    assert got.get("load_copy", 0) == 0, got
    assert got["save"] in ("FailedPrecondition", "ok 2"), got
    assert got["reservations"] == 0, got
    assert kvd.alive(), kvd.log()[-3000:]


# ------------------------------------------------------------------- SegmentMaps
@pytest.fixture
def shm_file() -> Iterator[str]:
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="kvt-maps-")
    os.close(fd)
    yield path
    os.unlink(path)


def _info(seg_id: int, size: int) -> pb.SegmentInfo:
    return pb.SegmentInfo(segment_id=seg_id, data_offset=0, data_bytes=size)


def test_an_fd_that_cannot_be_mapped_is_kept_mapped_on_use_and_closed_when_unlisted(
        shm_file: str) -> None:
    size = 4 * mmap.PAGESIZE
    maps = SegmentMaps()
    fd = os.open(shm_file, os.O_RDWR)  # size 0: a retired extent's file, cut to 0
    maps.update(1, [_info(7, size)], [7], [fd])  # no error
    assert 7 not in maps and maps.unmappable([7]) == [7] and maps.to_ask([7, 8]) == [8]
    assert maps.missing([7]) == [7]
    assert maps.mapped_prefix([pb.SlotRef(segment_id=7)]) == 0
    with pytest.raises(errors.FailedPrecondition, match="truncated"):
        maps.view(pb.SlotRef(segment_id=7, offset=0), 16, writable=False)
    assert maps.retry([7]) == [7]  # still too short
    os.truncate(shm_file, size)  # set back (the audit, for a live segment)
    assert maps.retry([7]) == []
    assert 7 in maps and not maps.unmappable([7])
    maps.close()

    maps = SegmentMaps()
    fd = os.open(shm_file, os.O_RDWR)
    os.truncate(shm_file, 0)
    maps.update(1, [_info(7, size)], [7], [fd])
    assert maps.unmappable([7]) == [7]
    maps.update(2, [], [], [])  # the daemon's list no longer has it: the fd goes
    assert not maps.unmappable([7]) and maps.version == 2
    with pytest.raises(OSError):
        os.fstat(fd)
    maps.close()
