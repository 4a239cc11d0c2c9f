"""The cluster agent: the Mooncake Store client, in a process of its own.

``kvtierd`` starts it (``python -m kvtierd.cluster.agent``) with one end of a
``SOCK_SEQPACKET`` socket pair and its settings in the environment, and talks
to it in msgpack messages (:mod:`kvtierd.cluster.tier` has the other end):

* ``[id, "seg", seg_id, size]`` with the DRAM segment's data-file descriptor:
  map it and register it with the transfer engine; ``[id, "drop", seg_id]``
  undoes that (after the transfers using it finish);
* ``[id, "exist", names]``: ``batch_is_exist``, one master round trip;
* ``[id, "get", [[name, seg_id, offset, size], ...]]``: one scatter read per
  object, straight into the segment (``size`` bytes) plus a header slot of the
  agent's own, whose bytes go back in the reply;
* ``[id, "put", names, seg_ids, offsets, lengths, block_bytes, headers,
  replicas]``: a batch in columns (``seg_ids``, ``offsets``, ``lengths``: int64
  arrays as bytes; ``headers``: one :data:`HEADER_BYTES` header per object, one
  after another), written with **one** ``batch_put_from_multi_buffers`` (the
  master allocates and seals the whole batch in one round trip each): one
  gather write per object -- the slot's ``length`` bytes, zeros up to
  ``block_bytes`` (a registered zero mapping, never a copy), the header;
* ``[id, "remove", names]``: ``batch_remove(force=True)``.

Replies are ``[id, result]`` or ``[id, None, error text]``; the agent says
``[0, "ready", segment_name]`` once set up, or ``[0, "failed", why]`` and exits;
and, with ``prefault_segment``, ``[0, "prefaulted", [bytes, seconds, why not]]``
once it has faulted in the segment it lends (in the background, after "ready").

With ``prefault_segment`` the segment it lends is kvtier's own memory: a memfd
the agent creates and hands to Mooncake with ``mount_segment`` (``setup`` then
lends none). Mooncake maps the file itself and does not say where; the agent finds
that mapping in ``/proc/self/maps`` by the memfd's device and inode -- no other
mapping can carry them -- and pre-faults exactly those pages
(``madvise(MADV_POPULATE_WRITE)``). Without it, ``setup`` lends Mooncake's own
anonymous memory as before (first writes into a cold memfd cost more than into
cold anonymous memory: bench/results/HISTORY.md).

It checks every offset against its mapping before a transfer (Mooncake does
not: a read past a buffer's end is a segfault), probes the master's port
before ``setup`` (which otherwise holds the GIL retrying for 90 s), dies with
the daemon (``PR_SET_PDEATHSIG``, and end of file on the socket), and is
otherwise allowed to crash: a client that cut its DRAM file short under a
transfer raises SIGBUS here, and the daemon restarts the agent.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import logging
import mmap
import os
import signal
import socket
import sys
import threading
import time
import urllib.parse
from typing import Any, Final

import msgpack
import numpy as np

log = logging.getLogger("kvtierd.cluster.agent")

#: The environment variables the daemon passes.
ENV_FD: Final = "KVTIER_AGENT_FD"
ENV_CONFIG: Final = "KVTIER_AGENT_CONFIG"
#: The largest message either side sends (the socket buffers are sized for it).
MAX_MESSAGE: Final = 4 << 20
#: Header slots the agent keeps registered (one per object in flight).
HEADER_SLOTS: Final = 4096
#: Zero bytes registered once to pad short blocks (longer pads take it several times).
ZERO_BYTES: Final = 64 << 20
#: Exit codes: setup failed (the master or metadata server unreachable, or refused).
EXIT_UNREACHABLE: Final = 3
EXIT_SETUP: Final = 4
#: A request the agent refused before any transfer (an offset outside the mapping).
RC_BAD_REQUEST: Final = -10001
HEADER_BYTES: Final = 256
#: ``madvise`` advice: fault in a range's pages as if written (Linux 5.14).
MADV_POPULATE_WRITE: Final = 23
#: Pre-fault this much per ``madvise`` call: ~20-40 ms each here, so stopping at exit
#: waits no longer than that.
PREFAULT_STEP: Final = 64 << 20
#: The pre-faulting thread's nice value: the host's serving work comes first.
PREFAULT_NICE: Final = 10
#: The lent segment's memfd name (shown in /proc/PID/maps).
SEGMENT_MEMFD: Final = "kvtier-cluster-segment"
#: Answered on the reading thread (short: one master round trip, no transfer); the
#: transfers run on the pool, several at once.
_INLINE: Final = frozenset({"exist"})


def _address(buf: Any) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        os._exit(0)


def _probe(host: str, port: int, what: str, timeout: float) -> str | None:
    """None when ``host:port`` accepts a connection, else why not."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return f"{what} {host}:{port} is unreachable: {exc.strerror or exc}"
    return None


def _host_port(addr: str, default_port: int) -> tuple[str, int]:
    u = urllib.parse.urlsplit(addr if "//" in addr else f"//{addr}")
    return u.hostname or "127.0.0.1", u.port or default_port


def file_mappings(fd: int, maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """``(start, length)`` of every mapping in this process of the file open at ``fd``
    (matched by device and inode, not by name or size)."""
    st = os.fstat(fd)
    dev = (os.major(st.st_dev), os.minor(st.st_dev))
    found = []
    with open(maps) as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or int(fields[4]) != st.st_ino:
                continue
            major, minor = fields[3].split(":")
            if (int(major, 16), int(minor, 16)) != dev:
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            found.append((lo, hi - lo))
    return found


def prefault(ranges: list[tuple[int, int]], stop: threading.Event,
             step: int = PREFAULT_STEP) -> None:
    """Fault in ``ranges`` for writing, ``step`` bytes per call, until ``stop``;
    raises OSError when the kernel refuses (EINVAL: older than 5.14)."""
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    for start, length in ranges:
        for off in range(0, length, step):
            if stop.is_set():
                return
            if madvise(start + off, min(step, length - off), MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")


class _Segment:
    def __init__(self, mm: mmap.mmap, size: int) -> None:
        self.mm = mm
        self.size = size
        self.base = _address(mm)
        self.users = 0
        self.dropped = False


class Agent:
    def __init__(self, sock: socket.socket, cfg: dict[str, Any]) -> None:
        self.sock = sock
        self.cfg = cfg
        self.store: Any = None
        self.hostname = ""
        self._send_lock = threading.Lock()
        self._segs: dict[int, _Segment] = {}
        self._segs_cv = threading.Condition()
        self._free_headers = list(range(HEADER_SLOTS))
        self._headers_cv = threading.Condition()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=int(cfg.get("threads", 4)), thread_name_prefix="agent")
        self.segment_fd = -1  # the memfd of the segment this host lends (-1: none)
        self.segment_bytes = 0
        self._stopping = threading.Event()
        self._prefaulter: threading.Thread | None = None
        #: Fills the page tables of the DRAM segments the agent maps (``_populate``).
        self._populator = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="agent-populate")

    # ------------------------------------------------------------ setup
    def setup(self) -> str | None:
        """Join the cluster; None, or why it could not."""
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        master = self.cfg["master"]
        why = _probe(*_host_port(master, 50051), "the Mooncake master", 3.0)
        meta = self.cfg["metadata_server"]
        if why is None and meta.startswith("http"):
            why = _probe(*_host_port(meta, 8080), "the metadata server", 3.0)
        if why is not None:
            return why
        store = MooncakeDistributedStore()
        size = int(self.cfg["segment_bytes"])
        # To pre-fault it, the agent lends a segment of its own (below), whose pages it
        # can find; else Mooncake's.
        own = size > 0 and bool(self.cfg.get("prefault_segment"))
        rc = store.setup(self.cfg["local_hostname"], meta, 0 if own else size,
                         int(self.cfg["local_buffer_bytes"]), self.cfg["protocol"],
                         self.cfg.get("device_name", ""), master)
        if rc != 0:
            return f"Mooncake setup returned {rc} (master {master}, metadata server {meta})"
        self.store = store
        if own:
            why = self._lend(size)
            if why is not None:
                return why
        self.hostname = store.get_hostname()
        self.config = ReplicateConfig()
        self.config.replica_num = int(self.cfg.get("replicas", 1))
        # Keep what this host writes in its own memory: the agent's segment, or the
        # standalone owner's (``cluster.segment_owner``).
        self.preferred = self.cfg.get("segment_owner") or self.hostname
        self.config.preferred_segment = self.preferred
        self.headers = mmap.mmap(-1, HEADER_SLOTS * HEADER_BYTES)
        self.headers_base = _address(self.headers)
        self.zeros = mmap.mmap(-1, ZERO_BYTES, prot=mmap.PROT_READ)
        self.zeros_base = _address(self.zeros)
        for base, size in ((self.headers_base, len(self.headers)),
                           (self.zeros_base, ZERO_BYTES)):
            rc = store.register_buffer(base, size)
            if rc != 0:
                return f"register_buffer of {size} bytes returned {rc}"
        return None

    def _lend(self, size: int) -> str | None:
        """Mount a memfd of ``size`` bytes as this host's segment; None, or why not."""
        fd = os.memfd_create(SEGMENT_MEMFD)
        try:
            os.ftruncate(fd, size)
            # Mooncake opens the path itself: this process's descriptor of the memfd.
            r = self.store.mount_segment(f"/proc/self/fd/{fd}", size, 0, self.cfg["protocol"],
                                         "")
        except BaseException:
            os.close(fd)
            raise
        if r.get("ret") != 0:
            os.close(fd)
            return f"mount_segment of {size} bytes returned {r.get('ret')}"
        self.segment_fd, self.segment_bytes = fd, size
        return None

    def _prefault(self) -> None:
        """Fault in the lent segment (a thread of its own, niced); tell the daemon how
        it went. Mooncake's mappings of the memfd must cover it exactly, else nothing
        is touched."""
        t0 = time.monotonic()
        why = ""
        try:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREFAULT_NICE)
            ranges = file_mappings(self.segment_fd)
            page = mmap.PAGESIZE
            want = -(-self.segment_bytes // page) * page
            got = sum(n for _, n in ranges)
            if got != want:
                why = (f"found {len(ranges)} mappings of {got} bytes of the segment's memfd, "
                       f"not {want}")
            else:
                prefault(ranges, self._stopping)
        except (OSError, ValueError) as exc:
            why = str(exc)
        if why:
            log.warning("the segment was not pre-faulted: %s", why)
        if self._stopping.is_set():
            return
        with contextlib.suppress(OSError):
            self.send([0, "prefaulted",
                       [0 if why else self.segment_bytes, time.monotonic() - t0, why]])

    # ------------------------------------------------------------ messages
    def send(self, msg: list[Any]) -> None:
        data = msgpack.packb(msg, use_bin_type=True)
        with self._send_lock:
            self.sock.send(data)

    def run(self) -> int:
        why = self.setup()
        if why is not None:
            self.send([0, "failed", why])
            return EXIT_UNREACHABLE if "unreachable" in why else EXIT_SETUP
        self.send([0, "ready", self.hostname])
        if self.segment_fd >= 0:
            self._prefaulter = threading.Thread(target=self._prefault, daemon=True,
                                                name="agent-prefault")
            self._prefaulter.start()
        try:
            while True:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 4)
                if not data:
                    break  # the daemon went away
                msg = msgpack.unpackb(data, raw=False)
                if msg[1] == "seg":
                    self._reply(msg[0], self._map, msg[2], msg[3], fds[0] if fds else -1)
                    for fd in fds[1:]:
                        os.close(fd)
                    continue
                for fd in fds:
                    os.close(fd)
                if msg[1] in _INLINE:
                    self._dispatch(msg)  # one master round trip: no thread hop
                else:
                    self._pool.submit(self._dispatch, msg)
        finally:
            self._stopping.set()
            if self._prefaulter is not None:
                self._prefaulter.join()  # one step at most: then nothing touches the mapping
            self._pool.shutdown(wait=True)
            self._populator.shutdown(wait=True, cancel_futures=True)
            try:
                self.store.close()
            except Exception:  # noqa: BLE001 (exiting anyway)
                pass
        return 0

    def _dispatch(self, msg: list[Any]) -> None:
        op = msg[1]
        fn = {"drop": self._drop, "exist": self._exist, "get": self._get, "put": self._put,
              "remove": self._remove}.get(op)
        if fn is None:
            self.send([msg[0], None, f"unknown op {op!r}"])
            return
        self._reply(msg[0], fn, *msg[2:])

    def _reply(self, rid: int, fn: Any, *args: Any) -> None:
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 (the daemon counts it)
            self.send([rid, None, f"{type(exc).__name__}: {exc}"])
            return
        self.send([rid, result])

    # ------------------------------------------------------------ segments
    def _map(self, seg_id: int, size: int, fd: int) -> int:
        if fd < 0:
            raise ValueError("no descriptor came with the segment")
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        seg = _Segment(mm, size)
        rc = self.store.register_buffer(seg.base, size)
        if rc != 0:
            mm.close()
            raise OSError(f"register_buffer returned {rc}")
        with self._segs_cv:
            old = self._segs.pop(seg_id, None)
            self._segs[seg_id] = seg
            seg.users += 1  # the populate's (below)
        if old is not None:
            self._unmap(old)
        try:
            self._populator.submit(self._populate, seg)
        except RuntimeError:  # shut down: the agent is exiting
            self._unuse({0: seg})
        return 0

    def _populate(self, seg: _Segment) -> None:
        """Fill this mapping's page tables (the daemon made the pages already), so the
        first transfers through it take no page faults: ~16k per 64 MiB written, one per
        page, since a shared file mapping faults in no neighbours for writes. In the
        background (a thread of its own, niced); a file a client cut short makes madvise
        fail, never fault, and is left to the transfers' own checks."""
        try:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREFAULT_NICE)
            with contextlib.suppress(OSError):
                prefault([(seg.base, seg.size)], self._stopping)
        finally:
            self._unuse({0: seg})

    def _drop(self, seg_id: int) -> int:
        with self._segs_cv:
            seg = self._segs.pop(seg_id, None)
        if seg is not None:
            self._unmap(seg)
        return 0

    def _unmap(self, seg: _Segment) -> None:
        with self._segs_cv:
            seg.dropped = True
            while seg.users:
                self._segs_cv.wait()
        self.store.unregister_buffer(seg.base)
        seg.mm.close()

    def _use(self, seg_ids: set[int]) -> dict[int, _Segment]:
        with self._segs_cv:
            segs = {s: self._segs[s] for s in seg_ids if s in self._segs}
            for seg in segs.values():
                seg.users += 1
            return segs

    def _unuse(self, segs: dict[int, _Segment]) -> None:
        with self._segs_cv:
            for seg in segs.values():
                seg.users -= 1
            self._segs_cv.notify_all()

    def _take_headers(self, n: int) -> list[int]:
        with self._headers_cv:
            while len(self._free_headers) < n:
                self._headers_cv.wait()
            taken, self._free_headers = self._free_headers[:n], self._free_headers[n:]
            return taken

    def _give_headers(self, slots: list[int]) -> None:
        with self._headers_cv:
            self._free_headers.extend(slots)
            self._headers_cv.notify_all()

    # ------------------------------------------------------------ operations
    def _exist(self, names: list[str]) -> list[int]:
        return list(self.store.batch_is_exist(names))

    def _remove(self, names: list[str]) -> list[int]:
        return list(self.store.batch_remove(names, True))

    def _get(self, items: list[list[Any]]) -> list[list[Any]]:
        segs = self._use({it[1] for it in items})
        slots = self._take_headers(len(items))
        try:
            out: list[list[Any]] = [[RC_BAD_REQUEST, None] for _ in items]
            todo = []
            for i, (name, seg_id, off, size) in enumerate(items):
                seg = segs.get(seg_id)
                if seg is None or off < 0 or size <= 0 or off + size > seg.size:
                    continue
                todo.append((i, name, seg.base + off, size))
            if todo:
                hp = [self.headers_base + s * HEADER_BYTES for s in slots]
                rcs = self.store.batch_get_into_multi_buffers(
                    [t[1] for t in todo], [[t[2], hp[t[0]]] for t in todo],
                    [[t[3], HEADER_BYTES] for t in todo])
                for (i, _name, _ptr, _size), rc in zip(todo, rcs, strict=True):
                    s = slots[i] * HEADER_BYTES
                    out[i] = [int(rc), self.headers[s : s + HEADER_BYTES] if rc >= 0 else None]
            return out
        finally:
            self._give_headers(slots)
            self._unuse(segs)

    def _put(self, names: list[str], seg_ids: bytes, offsets: bytes, lengths: bytes,
             block_bytes: int, headers: bytes, replicas: int) -> list[int]:
        n = len(names)
        sid = np.frombuffer(seg_ids, dtype=np.int64)
        off = np.frombuffer(offsets, dtype=np.int64)
        length = np.frombuffer(lengths, dtype=np.int64)
        if not (len(sid) == len(off) == len(length) == n and len(headers) == n * HEADER_BYTES):
            raise ValueError(f"a put of {n} names with columns of {len(sid)}, {len(off)}, "
                             f"{len(length)} and {len(headers)} header bytes")
        if n > HEADER_SLOTS:
            raise ValueError(f"a put of {n} objects (at most {HEADER_SLOTS} at once)")
        segs = self._use(set(sid.tolist()))
        slots = self._take_headers(n)
        try:
            sizes = np.array([segs[s].size if s in segs else -1 for s in sid.tolist()],
                             dtype=np.int64)
            bases = np.array([segs[s].base if s in segs else 0 for s in sid.tolist()],
                             dtype=np.int64)
            ok = ((sizes >= 0) & (off >= 0) & (length > 0) & (length <= block_bytes)
                  & (off + length <= sizes))
            out = np.full(n, RC_BAD_REQUEST, dtype=np.int64)
            idx = np.flatnonzero(ok)
            if len(idx):
                ptrs: list[list[int]] = []
                parts: list[list[int]] = []
                hb, given = self.headers_base, memoryview(headers)
                start, size = (bases + off).tolist(), length.tolist()
                for i in idx.tolist():
                    ptr, ln, h = start[i], size[i], slots[i] * HEADER_BYTES
                    self.headers[h : h + HEADER_BYTES] = \
                        given[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]
                    p, z = [ptr], [ln]
                    pad = block_bytes - ln
                    while pad > 0:
                        k = min(pad, ZERO_BYTES)
                        p.append(self.zeros_base)
                        z.append(k)
                        pad -= k
                    p.append(hb + h)
                    z.append(HEADER_BYTES)
                    ptrs.append(p)
                    parts.append(z)
                config = self.config
                if replicas != config.replica_num:
                    from mooncake.store import ReplicateConfig

                    config = ReplicateConfig()
                    config.replica_num = replicas
                    config.preferred_segment = self.preferred
                todo = names if len(idx) == n else [names[i] for i in idx.tolist()]
                out[idx] = self.store.batch_put_from_multi_buffers(todo, ptrs, parts, config)
            return out.tolist()  # type: ignore[no-any-return]
        finally:
            self._give_headers(slots)
            self._unuse(segs)


def main() -> int:
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="kvtier cluster agent: %(message)s")
    sock = socket.socket(fileno=int(os.environ[ENV_FD]))
    cfg = json.loads(os.environ[ENV_CONFIG])
    return Agent(sock, cfg).run()


if __name__ == "__main__":
    sys.exit(main())
