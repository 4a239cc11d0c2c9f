"""A hostile fast-path client of namespace A, for tests/e2e/test_hostile_fast_path.py.

Usage: fast_path_attacker.py SOCKET_DIR MODE SECONDS

Imports everything as the caller (root), then drops to nice 10 and uid/gid 65534, which the
daemon's rules let use namespace A only, and attacks through the real client
library's sessions, mappings, pages and doorbells (and the raw session channel
for the fds the library closes).  Prints ``READY`` once the attack runs, stops
after SECONDS (or at a line on stdin in ``hoard`` mode), and prints one JSON line
of what it did.  Modes:

* ``doorbell``: clears ``O_NONBLOCK`` on its doorbell and its data fds' open file
  descriptions (and sets ``O_APPEND``), tries to drain the doorbell, rings it in
  a loop from threads, and writes through it.
* ``hazards``: opens as many sessions as the daemon allows and keeps every
  page's hazard entries full of distinct values, rewritten every 50 ms, with a
  doorbell rung every 50 ms and puts (commits and refills) going on.
* ``counters``: adds 2^40 - 1 to every counter of its page every 10 ms.
* ``hoard``: fills A, then keeps an fd and a mapping of every segment A ever had
  while another namespace's writes reclaim them; reports the bytes the files it
  holds still take (``fstat``).
* ``truncate``: cuts A's data files to nothing every 100 ms (readers of A must
  survive it: their library's copies run under the fault guard).
* ``calls``: sends FastCalls that never wait (1-key deletes of nothing, no_reply)
  packed 20,000 to a write, as fast as the daemon reads them.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import secrets  # noqa: F401
import select
import struct
import sys
import threading
import time
from typing import Any

import numpy as np
import numpy.random  # noqa: F401  (imported before the uid drop: the stdlib may be unreadable after)

import kvtier
from kvtier import _page, errors
from kvtier._session import SessionLink, open_request
from kvtier._wire import FRAME_LEN
from kvtier.v1 import kvtier_pb2 as pb

BLOCK = 64 << 10
UID = 65534
_HAZARDS = _page.HAZARDS
_HI = _page.HAZARD_HI


def _client(sock: str) -> kvtier.Client:
    return kvtier.Client(sock, namespace="A", block_bytes=BLOCK, model_uid="m")


def _raw_fds(sock: str) -> tuple[SessionLink, list[tuple[int, int]]]:
    """A session opened by hand: A's data fds as the daemon sent them, with sizes."""
    link = SessionLink(os.path.join(sock, "kvtier-session.sock"), 10)
    resp, fds = link.request(open_request("A", BLOCK, "m"))
    n = len(resp.opened.segments)
    for fd in fds[n:]:
        os.close(fd)
    return link, [(fd, s.data_bytes) for fd, s in zip(fds[:n], resp.opened.segments, strict=True)]


def _put_loop(sock: str, stop: threading.Event, out: dict[str, Any], tag: str) -> None:
    """Writes of A in a loop (commits from the page, refills); its own errors are its own."""
    rng = np.random.default_rng(1)
    i = 0
    try:
        with _client(sock) as c:
            while not stop.is_set():
                keys = [f"{tag}/{i}/{j}".encode() for j in range(4)]
                try:
                    c.put(keys, [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in keys])
                    out["puts"] = out.get("puts", 0) + 1
                except errors.KVTierError as exc:
                    out["put_errors"] = out.get("put_errors", 0) + 1
                    out["last_put_error"] = repr(exc)[:200]
                i += 1
                time.sleep(0.01)
    except errors.KVTierError as exc:
        out["client_error"] = repr(exc)[:200]


def doorbell(sock: str, seconds: float, out: dict[str, Any]) -> None:
    c = _client(sock)
    c.put([f"bell/{os.getpid()}".encode()], [np.zeros(BLOCK, np.uint8)])  # fds to flag
    index = c._maps.index
    assert index is not None and index.writes is not None, "no writes without a call"
    bell = index.writes._bell
    fcntl.fcntl(bell, fcntl.F_SETFL, 0)  # blocking, on the open file description we got
    link, fds = _raw_fds(sock)
    for fd, _ in fds:
        fcntl.fcntl(fd, fcntl.F_SETFL, os.O_APPEND)
    out["data_fds_flagged"] = len(fds)
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            try:
                os.read(bell, 8)  # an eventfd shared with the daemon could be drained
                out["drained"] = out.get("drained", 0) + 1
            except OSError as exc:
                out["drain_error"] = exc.strerror
                return

    def ring() -> None:
        # Now and then, so that a drainer sharing the daemon's open file description
        # (the eventfd there was) would empty it between the daemon's wakeup and read;
        # and then in bursts that fill a pipe.
        n = 0
        while not stop.is_set():
            try:
                os.write(bell, struct.pack("<Q", 1))
                out["rings"] = out.get("rings", 0) + 1
            except OSError as exc:
                out["ring_error"] = exc.strerror
                return
            n += 1
            if n % 1000 < 100:
                time.sleep(0.001)

    threads = [threading.Thread(target=drain, daemon=True),
               threading.Thread(target=ring, daemon=True),
               threading.Thread(target=_put_loop, args=(sock, stop, out, "bell"), daemon=True)]
    for t in threads:
        t.start()
    print("READY", flush=True)
    time.sleep(seconds)
    stop.set()
    # The ringing thread may sit blocked in write() on the full pipe: its own problem.
    for t in threads[2:]:
        t.join(30)
    for fd, _ in fds:
        os.close(fd)
    link.close()


def hazards(sock: str, seconds: float, out: dict[str, Any]) -> None:
    clients: list[kvtier.Client] = []
    try:
        for _ in range(240):
            clients.append(_client(sock))
    except errors.KVTierError as exc:  # limits.max_sessions_per_uid, say
        out["open_error"] = repr(exc)[:200]
    out["sessions"] = len(clients)
    pages = [c._maps.index._page for c in clients if c._maps.index is not None]
    segs = sorted(clients[0]._maps.mappings().keys())[:4] if clients else [1]
    segs = segs or [1]
    words = [np.frombuffer(p, dtype=np.uint64, count=_page.HAZARDS_N, offset=_HAZARDS) for p in pages]
    bells = [c._maps.index.writes for c in clients
             if c._maps.index is not None and c._maps.index.writes is not None]
    stop = threading.Event()
    putter = threading.Thread(target=_put_loop, args=(sock, stop, out, "hz"), daemon=True)
    putter.start()
    rng = np.random.default_rng(5)
    rounds = 0
    print("READY", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for p, w in zip(pages, words, strict=True):
            struct.pack_into("<Q", p, _HI, 768)
            seg = np.uint64(segs[rounds % len(segs)])
            w[:] = (np.uint64(1 << 63) | (seg << np.uint64(32))
                    | rng.integers(0, 1 << 20, 768, dtype=np.uint64))
        for b in bells[:8]:
            b.ring()
        rounds += 1
        time.sleep(0.05)
    out["rounds"] = rounds
    stop.set()
    putter.join(30)
    for c in clients:
        c.close()


def counters(sock: str, seconds: float, out: dict[str, Any]) -> None:
    with _client(sock) as c:
        index = c._maps.index
        assert index is not None
        page = np.frombuffer(index._page, dtype=np.uint64, count=7)
        steps = 0
        print("READY", flush=True)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            page += np.uint64((1 << 40) - 1)
            steps += 1
            time.sleep(0.01)
        out["steps"] = steps


def hoard(sock: str, seconds: float, out: dict[str, Any]) -> None:
    """Fill A, keep every fd and mapping; the test then makes the daemon reclaim A."""
    held: dict[int, tuple[int, mmap.mmap]] = {}  # inode -> (fd, mapping)
    links = []
    rng = np.random.default_rng(3)
    with _client(sock) as c:
        for i in range(160):  # 10 MiB of the 16 MiB pool
            keys = [f"hoard/{os.getpid()}/{i}".encode()]
            c.put(keys, [rng.integers(0, 256, BLOCK, dtype=np.uint8)])
    # The writer is gone (its grants with it); a session opened by hand keeps every fd.
    link, fds = _raw_fds(sock)
    links.append(link)
    for fd, size in fds:
        ino = os.fstat(fd).st_ino
        if ino in held:
            os.close(fd)
            continue
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        mm.madvise(mmap.MADV_WILLNEED)
        held[ino] = (fd, mm)
    out["held_files"] = len(held)
    out["held_bytes_before"] = sum(os.fstat(fd).st_blocks * 512 for fd, _ in held.values())
    print("READY", flush=True)
    select.select([sys.stdin], [], [], seconds)
    stats = [os.fstat(fd) for fd, _ in held.values()]
    out["held_bytes_after"] = sum(st.st_blocks * 512 for st in stats)
    out["unlinked_files"] = sum(st.st_nlink == 0 for st in stats)
    out["unlinked_bytes"] = sum(st.st_blocks * 512 for st in stats if st.st_nlink == 0)
    for fd, mm in held.values():
        mm.close()
        os.close(fd)
    for link in links:
        link.close()


def truncate(sock: str, seconds: float, out: dict[str, Any]) -> None:
    link, fds = _raw_fds(sock)
    cuts = 0
    print("READY", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for fd, _ in fds:
            os.ftruncate(fd, 0)
        cuts += 1
        time.sleep(0.1)
    out["cuts"] = cuts
    for fd, _ in fds:
        os.close(fd)
    link.close()


def calls(sock: str, seconds: float, out: dict[str, Any]) -> None:
    """FastCalls that never wait, packed as tight as frames go and never answered
    (no_reply): tens of thousands in each read of the daemon's, which serves a call in
    the turn that read it."""
    link, fds = _raw_fds(sock)
    for fd, _ in fds:
        os.close(fd)
    body = pb.DeleteRequest(keys=[b"calls/none"]).SerializeToString()
    burst = b"".join(
        FRAME_LEN.pack(len(f)) + f for f in (
            pb.SessionRequest(call_id=i + 1, call=pb.FastCall(
                method="Delete", request=body, no_reply=True)).SerializeToString()
            for i in range(20000)))
    print("READY", flush=True)
    end = time.monotonic() + seconds
    link._sock.settimeout(0.1)
    view, at = memoryview(burst), 0
    while time.monotonic() < end:
        try:
            # (send, not sendall: a timeout must resume where the stream stopped -- a
            # burst sent again from its start would cut a frame, and the daemon would
            # rightly end the session for it)
            at += link._sock.send(view[at:])
        except TimeoutError:  # the daemon reads at its own pace
            continue
        except OSError as exc:  # the daemon ended the session: the attack is over
            out["send_error"] = type(exc).__name__
            break
        if at == len(view):
            out["bursts"] = out.get("bursts", 0) + 1
            at = 0
    link.close()


MODES = {"doorbell": doorbell, "hazards": hazards, "counters": counters, "hoard": hoard,
         "truncate": truncate, "calls": calls}


def main() -> None:
    sock, mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    # A tenant's CPU is its own (a cgroup's share on a real host): at nice 10 what the
    # test measures is what the attack costs the daemon, not the CPU it burns itself.
    os.nice(10)
    os.setgroups([])
    os.setgid(UID)
    os.setuid(UID)
    out: dict[str, Any] = {"mode": mode}
    MODES[mode](sock, seconds, out)
    print(json.dumps(out), flush=True)
    os._exit(0)  # a ringing thread may still be blocked on its own full doorbell


if __name__ == "__main__":
    main()
