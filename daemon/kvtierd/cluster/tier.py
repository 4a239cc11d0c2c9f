"""The cluster tier, daemon side: a ``spill.tier.Tier`` over the agent process.

:class:`ClusterTier` starts the agent (:mod:`kvtierd.cluster.agent`) from a
supervisor thread, restarts it with back-off whenever it fails to join the
cluster or dies, and kills it when a request has been outstanding for
``cluster.request_timeout`` (Mooncake's own calls give up after about 4 s when
the master is gone; a longer wait is a hung agent).  Every request waits for
its answer or for the agent's death, never for a timer alone: the agent may
be writing into a DRAM slot, and the slot is only given back once nothing can
write into it any more.

While no agent is ready, every call fails at once with ``ClusterDown``
(``OSError`` ENOTCONN): the tiering policy counts it and goes on with the
local tiers.  So do calls in the :data:`COOL_SECONDS` after the master failed
to answer one (Mooncake blocks ~4 s per call then): a lookup that misses
locally waits for an unreachable master at most once per period, not every
time; after it, one call tries again while the others keep failing fast.  Mooncake's answers become misses (-704: not there), ``SpillFull``
(-200: no room), or ``OSError`` with a kind for the metrics (-900: master
unreachable, -800: the transfer failed, e.g. the owning host is gone).

Every read checks the object's tagged header and the data's xxh3 (``format``)
before the block counts as read; an object that fails is removed from the
cluster (for every host: it is bad for all of them) and counted as
``checksum``.

The DRAM slots are named to the agent as (segment id, offset): it maps each
segment's data file once (its descriptor passed over the socket) and
registers it with the transfer engine, so bytes move between the cluster and
the slot with no copy in either process.  Before a transfer the segment's
data file is checked for its size (``fstat``): a client that cut it short
would make the agent fault (SIGBUS); its slot is the writer's loss
(``EFAULT``), as on the other tiers.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import itertools
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import msgpack
import numpy as np

from kvtier import _accel
from kvtier.errors import Corrupted
from kvtierd.cluster import agent as agent_mod
from kvtierd.cluster.format import HEADER_BYTES, BadObject, Naming
from kvtierd.config import ClusterConfig
from kvtierd.logs import Throttle, event, more
from kvtierd.segments import Segment
from kvtierd.spill.ssd import SpillFull
from kvtierd.spill.tier import TIER_CLUSTER, Geometry, HandOff

log = logging.getLogger(__name__)
_throttle = Throttle()

#: Mooncake's return codes (mooncake-store's ErrorCode).
RC_NO_SPACE: Final = -200
RC_NOT_FOUND: Final = -704
RC_TRANSFER: Final = -800
RC_RPC: Final = -900
#: Objects per message to the agent (bounded messages; each still one Mooncake batch).
BATCH: Final = 256
#: Objects per put message (~0.5 KiB each: name, header, three int64s; one Mooncake
#: batch each): a commit of up to this many blocks is published in one batch.
PUT_BATCH: Final = 1024
#: How often the segments the agent maps are compared with the live ones.
DROP_CHECK_SECONDS: Final = 1.0
NOT_JOINED: Final = "joining (first try)"
#: Restart back-off of the agent: from the first to the last, doubling.
BACKOFF: Final = (0.5, 30.0)
#: After the master failed to answer (-900: each such call blocks ~4 s in Mooncake),
#: cluster calls fail at once for this long; then one call tries again.
COOL_SECONDS: Final = 5.0
#: The operations that reach the master (the breaker applies to them).
_MASTER_OPS: Final = frozenset({"exist", "get", "put", "remove"})


class ClusterDown(OSError):
    """No agent is ready (not started yet, restarting, or the master unreachable)."""

    def __init__(self, why: str) -> None:
        super().__init__(errno.ENOTCONN, why)


def _rc_error(rc: int, what: str) -> OSError:
    """The OSError for a Mooncake error code (its errno picks the metrics' kind)."""
    if rc == RC_RPC:
        return OSError(errno.EHOSTDOWN, f"{what}: the Mooncake master is unreachable (-900)")
    if rc == RC_TRANSFER:
        return OSError(errno.ECOMM, f"{what}: the transfer failed (-800; the host holding "
                                    "the object gone or unreachable)")
    if rc == agent_mod.RC_BAD_REQUEST:
        return OSError(errno.EINVAL, f"{what}: refused by the agent (offset outside its "
                                     "mapping of the segment)")
    return OSError(errno.EIO, f"{what}: Mooncake error {rc}")


#: The agent's registered local buffer (Mooncake's staging memory for transfers).
LOCAL_BUFFER_BYTES: Final = 16 << 20
#: The agent's worker threads for batched puts and gets.
AGENT_THREADS: Final = 4


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterSettings:
    """What the agent needs: the ``cluster`` section (``config``), its metadata server
    resolved, and the agent's own sizes."""

    config: ClusterConfig
    #: ``cluster.metadata_server``, or the master's host on port 8080 when that is "".
    metadata_server: str
    local_buffer_bytes: int = LOCAL_BUFFER_BYTES
    threads: int = AGENT_THREADS

    @classmethod
    def from_config(cls, cc: ClusterConfig) -> ClusterSettings:
        metadata = cc.metadata_server or f"http://{cc.master.rpartition(':')[0]}:8080/metadata"
        return cls(config=cc, metadata_server=metadata)

    def agent_config(self) -> dict[str, Any]:
        cc = self.config
        return {"master": cc.master, "metadata_server": self.metadata_server,
                "protocol": cc.protocol, "device_name": cc.device_name,
                "segment_bytes": 0 if cc.segment_owner else cc.segment_bytes,
                "segment_owner": cc.segment_owner,
                "prefault_segment": cc.prefault_segment and not cc.segment_owner,
                "local_buffer_bytes": self.local_buffer_bytes,
                "local_hostname": cc.hostname or cc.bind_address or socket.gethostname(),
                "replicas": cc.replicas, "threads": self.threads}


@dataclasses.dataclass
class ClusterCounters:
    agent_starts: int = 0
    agent_failures: int = 0  # failed to join (master down, setup refused)
    agent_deaths: int = 0  # died or was killed after joining
    agent_kills: int = 0  # killed for a request outstanding past request_timeout
    writes: int = 0
    write_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    checksum_failures: int = 0
    removed: int = 0


#: A request's future: a thread's (``concurrent.futures``) or the event loop's.
_Waiter = concurrent.futures.Future[Any] | asyncio.Future[Any]


class _Agent:
    """One agent process and its side of the socket.

    One reader at a time: the supervisor thread, until the event loop asks the
    agent something itself (``present_async``); then the loop reads every
    answer (no thread hop for its own, a thread's future set from the loop for
    the others) and the supervisor only watches for a hung or dead agent."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock
        self.ready = False
        self.segment_name = ""
        self.pending: dict[int, tuple[_Waiter, float]] = {}
        self.lock = threading.Lock()  # pending, sends
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop wants to read
        self.loop_reads = threading.Event()  # ... and does: the supervisor stopped
        self.gone = threading.Event()  # the loop's reader saw the end
        self.buffer = bytearray(agent_mod.MAX_MESSAGE)
        self.mapped: set[int] = set()
        self.map_lock = threading.Lock()
        self.last_drop_check = 0.0
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=8)
        #: What became of pre-faulting the lent segment ("" until the agent says).
        self.prefault = ""

    def tail(self) -> str:
        lines = [x for x in self.stderr_tail if x]
        return ("; its last words: " + " | ".join(lines[-3:])) if lines else ""


class ClusterTier:
    """:class:`~kvtierd.spill.tier.Tier` over Mooncake Store (through the agent)."""

    tier = TIER_CLUSTER
    name = "cluster"
    local = False
    cross_host = True
    durable_writes = False  # cache-only: the cluster may drop any object (eviction, hosts)
    batched = True

    def __init__(self, settings: ClusterSettings, naming: Naming, *,
                 segments: Callable[[], Iterable[Segment]]) -> None:
        """``segments``: the daemon's live DRAM segments (called on worker threads)."""
        self.settings = settings
        self.naming = naming
        self.counters = ClusterCounters()
        self._segments = segments
        self._by_map: dict[int, Segment] = {}
        self._agent: _Agent | None = None
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._on_fault: Callable[[str], None] = lambda kind: None
        #: Why the agent is not ready (None while it is): doctor, stats, logs.
        self.down_reason: str | None = NOT_JOINED
        self._gate_lock = threading.Lock()
        self._cool_until = 0.0  # 0: the master answered last time
        self._probing = False
        self._cool_why = ""
        #: Maps new DRAM extents into the agent ahead of their first publish.
        self._mapper = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvtier-cluster-map")

    # ------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """Start the supervisor; returns at once (joining may take seconds or fail)."""
        self._supervisor = threading.Thread(target=self._supervise, name="kvtier-cluster",
                                            daemon=True)
        self._supervisor.start()

    def close(self) -> None:
        self._stop.set()
        a = self._agent
        if a is not None:
            with contextlib.suppress(OSError):
                a.sock.shutdown(socket.SHUT_RDWR)  # the agent sees EOF and leaves
        self._mapper.shutdown(wait=False, cancel_futures=True)
        if self._supervisor is not None:
            self._supervisor.join(timeout=15)
        a = self._agent
        if a is not None and a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait()

    @property
    def segment_name(self) -> str:
        """This host's segment in the cluster (Mooncake's ``host:port``), "" when down."""
        a = self._agent
        return a.segment_name if a is not None and a.ready else ""

    @property
    def ready(self) -> bool:
        a = self._agent
        return a is not None and a.ready

    @property
    def prefault(self) -> str:
        """What the agent said of pre-faulting its segment ("" : nothing yet, or off)."""
        a = self._agent
        return a.prefault if a is not None and a.ready else ""

    def connect(self, *, on_fault: Callable[[str], None], hand_off: HandOff | None,
                on_lost: Callable[[str, bytes], None] | None) -> None:
        self._on_fault = on_fault  # faults the supervisor sees (agent deaths, kills)

    # ------------------------------------------------------------ supervisor
    def _supervise(self) -> None:
        delay = BACKOFF[0]
        while not self._stop.is_set():
            a = self._start_agent()
            if a is None:
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF[1])
                continue
            self._agent = a
            joined = False
            try:
                joined = self._handshake(a)
                if joined:
                    delay = BACKOFF[0]
                    for seg in self._segments():  # the extents made before it joined
                        self.premap(seg)
                    self._serve(a)
            except Exception:  # noqa: BLE001 (a bug: the agent goes, the tier stays)
                log.exception("cluster: the agent's supervisor failed; restarting the agent")
            finally:
                self._reap(a, joined)
            if not self._stop.is_set():
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF[1])

    def _start_agent(self) -> _Agent | None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (ours, theirs):
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, agent_mod.MAX_MESSAGE)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, agent_mod.MAX_MESSAGE)
        env = dict(os.environ)
        env[agent_mod.ENV_FD] = str(theirs.fileno())
        env[agent_mod.ENV_CONFIG] = json.dumps(self.settings.agent_config())
        env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
        if self.settings.config.bind_address:
            env["MC_TCP_BIND_ADDRESS"] = self.settings.config.bind_address
        try:
            proc = subprocess.Popen([sys.executable, "-m", "kvtierd.cluster.agent"], env=env,
                                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as exc:
            ours.close()
            self._down(f"cannot start the cluster agent: {exc}", "agent")
            return None
        finally:
            theirs.close()
        self.counters.agent_starts += 1
        a = _Agent(proc, ours)
        threading.Thread(target=self._log_agent, args=(a,), name="kvtier-cluster-log",
                         daemon=True).start()
        return a

    def _log_agent(self, a: _Agent) -> None:
        """The agent's stderr (Mooncake's own log): at debug level, and its last lines
        kept for the message when the agent fails."""
        assert a.proc.stderr is not None
        for raw in a.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            a.stderr_tail.append(line)
            log.debug("agent: %s", line)
        a.proc.stderr.close()

    def _handshake(self, a: _Agent) -> bool:
        a.sock.settimeout(1.0)
        deadline = time.monotonic() + self.settings.config.setup_timeout
        while not self._stop.is_set():
            try:
                data = a.sock.recv(agent_mod.MAX_MESSAGE)
            except TimeoutError:
                if time.monotonic() > deadline:
                    self.counters.agent_failures += 1
                    self._down(f"the cluster agent did not join within "
                               f"{self.settings.config.setup_timeout:g} s", "setup")
                    return False
                continue
            except OSError:
                data = b""
            if not data:
                self.counters.agent_failures += 1
                self._down(f"the cluster agent exited before joining (status "
                           f"{a.proc.wait()}){a.tail()}", "setup")
                return False
            msg = msgpack.unpackb(data, raw=False)
            if msg[1] == "ready":
                a.segment_name = msg[2]
                a.ready = True
                was = self.down_reason
                self.down_reason = None
                log.info("cluster: joined %s as segment %s%s", self.settings.config.master,
                         a.segment_name, f" (after: {was})" if was != NOT_JOINED else "",
                         extra=event("cluster_up", segment=a.segment_name))
                return True
            self.counters.agent_failures += 1
            self._down(f"cannot join the cluster: {msg[2]}",
                       "unreachable" if "unreachable" in str(msg[2]) else "setup")
            return False
        return False

    def _serve(self, a: _Agent) -> None:
        """Read answers until the agent goes or the event loop takes over reading; kill
        the agent if a request hangs."""
        a.sock.settimeout(0.05)  # short: notice the loop's wish to read soon
        while not self._stop.is_set():
            if a.loop is not None:
                self._hand_to_loop(a)
                while not (self._stop.is_set() or a.gone.wait(0.5)):
                    self._watchdog(a)
                return
            try:
                n = a.sock.recv_into(a.buffer)
            except TimeoutError:
                self._watchdog(a)
                continue
            except OSError:
                n = 0
            if not n:
                return
            self._dispatch(a, n)

    def _dispatch(self, a: _Agent, n: int) -> None:
        try:
            msg = msgpack.unpackb(memoryview(a.buffer)[:n], raw=False)
            rid = msg[0]
            if not isinstance(rid, int) or not 2 <= len(msg) <= 3:
                raise ValueError(f"not an answer: {msg!r:.80}")
            if rid == 0:  # news of the agent's own, not an answer
                self._news(a, msg)
                return
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            # Not what the agent sends: it is not to be trusted any more.
            self._down(f"the cluster agent sent a malformed message ({exc}); killed it",
                       "protocol")
            a.proc.kill()
            return
        with a.lock:
            entry = a.pending.pop(rid, None)
        if entry is not None:
            if len(msg) > 2:
                _settle(entry[0], exc=OSError(errno.EPROTO, f"cluster agent: {msg[2]}"))
            else:
                _settle(entry[0], msg[1])

    def _news(self, a: _Agent, msg: list[Any]) -> None:
        """``[0, "prefaulted", [bytes, seconds, why not]]``: the segment is pre-faulted
        (``why not`` empty) or was left as it was."""
        if msg[1] != "prefaulted" or len(msg) != 3:
            raise ValueError(f"unknown news: {msg!r:.80}")
        nbytes, seconds, why = msg[2]
        if why:
            a.prefault = f"segment not pre-faulted: {why}"
            log.warning("cluster: the agent's segment was not pre-faulted: %s", why)
        else:
            a.prefault = (f"segment pre-faulted ({nbytes / (1 << 20):.0f} MiB in "
                          f"{seconds:.2f} s)")
            log.info("cluster: %s", a.prefault)

    def _hand_to_loop(self, a: _Agent) -> None:
        """Stop reading here and let the event loop read (called once, supervisor)."""
        loop = a.loop
        assert loop is not None
        a.sock.settimeout(0.0)

        def start() -> None:
            loop.add_reader(a.sock.fileno(), self._loop_read, a)
            a.loop_reads.set()

        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop is closed: the daemon is stopping
            a.gone.set()

    def _loop_read(self, a: _Agent) -> None:
        """Event loop: every answer waiting on the socket."""
        while True:
            try:
                n = a.sock.recv_into(a.buffer)
            except BlockingIOError:
                return
            except OSError:
                n = 0
            if not n:
                with contextlib.suppress(OSError, ValueError):
                    asyncio.get_running_loop().remove_reader(a.sock.fileno())
                a.gone.set()
                return
            self._dispatch(a, n)

    def _watchdog(self, a: _Agent) -> None:
        now = time.monotonic()
        with a.lock:
            oldest = min((t for _f, t in a.pending.values()), default=now)
        if now - oldest > self.settings.config.request_timeout and a.proc.poll() is None:
            self.counters.agent_kills += 1
            self._down(f"a request to the cluster agent was outstanding for more than "
                       f"{self.settings.config.request_timeout:g} s; killed it", "timeout")
            a.proc.kill()

    def _reap(self, a: _Agent, joined: bool) -> None:
        """The agent is gone or going: make sure it is dead, then fail what waited on it
        (only now can nothing write into the slots those requests named)."""
        a.ready = False
        if a.proc.poll() is None:
            a.proc.kill()
        status = a.proc.wait()
        if a.loop_reads.is_set() and not a.gone.is_set() and a.loop is not None:
            # The loop still watches the socket: it must let go before the fd closes.
            loop, fd = a.loop, a.sock.fileno()

            def stop_reading() -> None:
                loop.remove_reader(fd)
                a.gone.set()

            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop_reading)
                a.gone.wait(5)
        a.sock.close()
        with a.lock:
            pending, a.pending = list(a.pending.values()), {}
        err = ClusterDown("the cluster agent exited")
        for fut, _t in pending:
            _settle(fut, exc=err)
        if joined and not self._stop.is_set():
            self.counters.agent_deaths += 1
            self._down(f"the cluster agent died (status {status}){a.tail()}; restarting it",
                       "agent")
        self._agent = None

    def _down(self, why: str, kind: str) -> None:
        self.down_reason = why
        self._on_fault(kind)
        held = _throttle(f"cluster/{kind}")
        if held is not None:
            log.warning("cluster: %s; serving from the local tiers meanwhile%s", why,
                        more(held), extra=event("cluster_down", kind=kind, held_back=held))

    # ------------------------------------------------------------ requests
    def _call(self, op: str, *args: Any, fds: Sequence[int] = (),
              agent: _Agent | None = None) -> Any:
        if op not in _MASTER_OPS:
            return self._send(op, *args, fds=fds, agent=agent)
        probe = self._enter()
        unreachable = False
        try:
            result = self._send(op, *args, fds=fds, agent=agent)
            unreachable = any((r[0] if isinstance(r, list) else r) == RC_RPC for r in result)
            return result
        finally:
            self._leave(probe, unreachable)

    def _enter(self) -> bool:
        """Whether this call is the one that tries the master again; raises ClusterDown
        while the breaker is open."""
        with self._gate_lock:
            if not self._cool_until:
                return False
            left = self._cool_until - time.monotonic()
            if left > 0 or self._probing:
                raise ClusterDown(f"the Mooncake master did not answer ({self._cool_why}); "
                                  f"trying again in {max(left, 0):.1f} s")
            self._probing = True
            return True

    def _leave(self, probe: bool, unreachable: bool) -> None:
        with self._gate_lock:
            if probe:
                self._probing = False
            if unreachable:
                if not self._cool_until:
                    self._cool_why = time.strftime("since %H:%M:%S")
                self._cool_until = time.monotonic() + COOL_SECONDS
            elif probe:
                self._cool_until = 0.0

    def _send(self, op: str, *args: Any, fds: Sequence[int] = (),
              agent: _Agent | None = None) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(agent or self._agent, fut, op, args, fds)
        return fut.result()  # the agent answers, or _reap fails it once the agent is dead

    def _post(self, a: _Agent | None, fut: _Waiter, op: str, args: Sequence[Any],
              fds: Sequence[int] = ()) -> None:
        """Send a request whose answer settles ``fut``."""
        if a is None or not a.ready:
            raise ClusterDown(self.down_reason or "the cluster agent is not ready")
        rid = next(self._ids)
        data = msgpack.packb([rid, op, *args], use_bin_type=True)
        with a.lock:
            if not a.ready:
                raise ClusterDown(self.down_reason or "the cluster agent is not ready")
            a.pending[rid] = (fut, time.monotonic())
            try:
                _send_message(a.sock, data, fds)
            except OSError as exc:
                a.pending.pop(rid, None)
                raise ClusterDown(f"the cluster agent is gone ({exc.strerror})") from None

    async def _call_async(self, op: str, *args: Any) -> Any:
        """``_call`` from the event loop, answered on it (no worker thread, no hop)."""
        a = self._agent
        if a is not None and a.loop is None:
            a.loop = asyncio.get_running_loop()  # the supervisor hands the reading over
        probe = self._enter()
        unreachable = False
        try:
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._post(a, fut, op, args)
            result = await fut
            unreachable = any((r[0] if isinstance(r, list) else r) == RC_RPC for r in result)
            return result
        finally:
            self._leave(probe, unreachable)

    def _slot(self, a: _Agent, view: memoryview,
              checked: set[int] | None = None) -> tuple[int, int]:
        """(segment id, offset) of a DRAM slot view, its segment mapped by the agent;
        ``checked``: the segments whose size this batch has checked already."""
        mm = view.obj
        seg = self._by_map.get(id(mm))
        if seg is None or seg.mm is not mm:
            self._by_map = {id(s.mm): s for s in self._segments()}
            seg = self._by_map.get(id(mm))
            if seg is None:
                raise OSError(errno.EINVAL, "cluster tier: a buffer outside the DRAM segments")
        size = seg.layout.data_bytes
        if checked is None or seg.segment_id not in checked:
            if os.fstat(seg.fd).st_size < size:  # a client cut it short: the agent would fault
                raise OSError(errno.EFAULT,
                              f"segment {os.path.basename(seg.path)} was cut short")
            if checked is not None:
                checked.add(seg.segment_id)
        offset = _address(view) - _address(mm)
        if seg.segment_id not in a.mapped:
            with a.map_lock:
                if seg.segment_id not in a.mapped:
                    self._call("seg", seg.segment_id, size, fds=[seg.fd], agent=a)
                    a.mapped.add(seg.segment_id)
        return seg.segment_id, offset

    def premap(self, seg: Segment) -> None:
        """Have the agent map a DRAM extent now, on a thread of its own, rather than at
        the extent's first publish (which then waits for the mapping: 1-10 ms); the
        store calls this for every extent it makes (``Store.on_extent``), from the
        event loop. Whatever goes wrong is left to that first publish."""
        a = self._agent
        if a is None or not a.ready or self._stop.is_set():
            return
        with contextlib.suppress(RuntimeError):  # shut down: the daemon is stopping
            self._mapper.submit(self._premap, a, seg)

    def _premap(self, a: _Agent, seg: Segment) -> None:
        if seg.segment_id in a.mapped or not a.ready:
            return
        if seg.segment_id not in {s.segment_id for s in self._segments()}:
            return  # retired meanwhile: its descriptor may be gone
        size = seg.layout.data_bytes
        try:
            if os.fstat(seg.fd).st_size < size:
                return  # cut short: the publish path says so
            with a.map_lock:
                if seg.segment_id not in a.mapped:
                    self._call("seg", seg.segment_id, size, fds=[seg.fd], agent=a)
                    a.mapped.add(seg.segment_id)
        except (OSError, ClusterDown):
            pass

    def _drop_retired(self, a: _Agent) -> None:
        """Let the agent unmap segments the daemon retired (their memory is freed only
        when no process maps them)."""
        now = time.monotonic()
        if now - a.last_drop_check < DROP_CHECK_SECONDS or not a.mapped:
            return
        a.last_drop_check = now
        live = {s.segment_id for s in self._segments()}
        with a.map_lock:
            for sid in a.mapped - live:
                self._call("drop", sid, agent=a)
                a.mapped.discard(sid)

    # ------------------------------------------------------------ Tier
    def held(self, namespace: str, key: bytes, geometry: Geometry | None) -> int | None:
        return None

    def held_many(self, namespace: str, keys: Sequence[bytes],
                  geometry: Geometry | None) -> list[int | None]:
        return [None] * len(keys)

    def present(self, namespace: str, keys: Sequence[bytes],
                geometry: Geometry | None) -> list[bool]:
        """One ``batch_is_exist`` per :data:`BATCH` keys (one master round trip)."""
        if geometry is None or not keys:
            return [False] * len(keys)
        names = [self.naming.name(namespace, k, *geometry) for k in keys]
        out: list[bool] = []
        for i in range(0, len(names), BATCH):
            rcs = self._call("exist", names[i : i + BATCH])
            if any(rc < 0 for rc in rcs):
                raise _rc_error(min(rcs), "existence check")
            out.extend(rc == 1 for rc in rcs)
        return out

    async def present_async(self, namespace: str, keys: Sequence[bytes],
                            geometry: Geometry | None) -> list[bool]:
        """``present`` on the event loop: the same one query per :data:`BATCH` keys,
        its answer read by the loop itself."""
        if geometry is None or not keys:
            return [False] * len(keys)
        names = [self.naming.name(namespace, k, *geometry) for k in keys]
        out: list[bool] = []
        for i in range(0, len(names), BATCH):
            rcs = await self._call_async("exist", names[i : i + BATCH])
            if any(rc < 0 for rc in rcs):
                raise _rc_error(min(rcs), "existence check")
            out.extend(rc == 1 for rc in rcs)
        return out

    def read_into(self, namespace: str, key: bytes, dst: memoryview,
                  geometry: Geometry) -> tuple[int, int]:
        (res,) = self.read_many(namespace, [(key, dst)], geometry)
        if isinstance(res, BaseException):
            raise res
        return res

    def read_many(self, namespace: str, items: Sequence[tuple[bytes, memoryview]],
                  geometry: Geometry) -> list[tuple[int, int] | BaseException]:
        """Read each block into its slot, verified: (length, checksum), or the exception
        ``read_into`` would raise for it.  Raises ``OSError`` when none could be tried."""
        a = self._agent
        if a is None or not a.ready:
            raise ClusterDown(self.down_reason or "the cluster agent is not ready")
        self._drop_retired(a)
        bb = geometry.block_bytes
        out: list[tuple[int, int] | BaseException] = []
        for i in range(0, len(items), BATCH):
            chunk = items[i : i + BATCH]
            req: list[list[Any]] = []
            names: list[str] = []
            early: dict[int, BaseException] = {}
            for j, (key, dst) in enumerate(chunk):
                try:
                    if len(dst) < bb:
                        raise OSError(errno.EINVAL, f"slot of {len(dst)} bytes < block_bytes")
                    sid, off = self._slot(a, dst)
                except OSError as exc:
                    early[j] = exc
                    continue
                name = self.naming.name(namespace, key, *geometry)
                names.append(name)
                req.append([name, sid, off, bb])
            answers = iter(self._call("get", req, agent=a) if req else [])
            for j, (key, dst) in enumerate(chunk):
                if j in early:
                    out.append(early[j])
                    continue
                rc, raw = next(answers)
                out.append(self._verify(namespace, key, dst, geometry, rc, raw))
        return out

    def _verify(self, namespace: str, key: bytes, dst: memoryview, geometry: Geometry,
                rc: int, raw: bytes | None) -> tuple[int, int] | BaseException:
        if rc == RC_NOT_FOUND:
            return KeyError(key)
        if rc < 0:
            return _rc_error(rc, f"read of {key.hex()}")
        try:
            if rc != geometry.block_bytes + HEADER_BYTES or raw is None:
                raise BadObject(f"object of {rc} bytes, not {geometry.block_bytes} + "
                                f"{HEADER_BYTES}")
            head = self.naming.unpack(namespace, raw, key, *geometry)
            try:
                got = _accel.checksum(dst[: head.length])
            except OSError as exc:
                return exc  # EFAULT: the slot, not the copy
            if got != head.checksum:
                raise BadObject("data failed its checksum")
        except BadObject as exc:
            self.counters.checksum_failures += 1
            held = _throttle("cluster/read/checksum")
            if held is not None:
                log.warning("cluster tier: block %s of %r: %s; removing it from the cluster%s",
                            key.hex(), namespace, exc, more(held),
                            extra=event("spill_fault", tier="cluster", op="read",
                                        kind="checksum", namespace=namespace,
                                        held_back=held))
            with contextlib.suppress(OSError):
                self._call("remove", [self.naming.name(namespace, key, *geometry)])
            return Corrupted(f"cluster block {key.hex()} of {namespace!r}: {exc}")
        self.counters.reads += 1
        self.counters.read_bytes += head.length
        return head.length, head.checksum

    def write(self, namespace: str, key: bytes, src: memoryview, length: int,
              checksum: int | None, geometry: Geometry) -> bool:
        (res,) = self.write_many(namespace, [(key, src, length, checksum)], geometry)
        if isinstance(res, BaseException):
            raise res
        return res

    def write_many(self, namespace: str,
                   items: Sequence[tuple[bytes, memoryview, int, int | None]],
                   geometry: Geometry) -> list[bool | BaseException]:
        """``write`` of each (key, src, length, checksum) as one Mooncake batch per
        :data:`PUT_BATCH` objects: one message to the agent, one
        ``batch_put_from_multi_buffers`` (the master allocates and seals the whole
        batch in one round trip each).  Each result is True or the exception ``write``
        would have raised for that block: EFAULT (its slot), ``SpillFull``, or the
        ``OSError`` of a failed put -- a batch that failed as a whole (the agent gone,
        the master unreachable) gives each of its blocks that error, as writing them
        one by one would have.  Raises ``ClusterDown`` when no agent is ready."""
        a = self._agent
        if a is None or not a.ready:
            raise ClusterDown(self.down_reason or "the cluster agent is not ready")
        self._drop_retired(a)
        bb, mh = geometry.block_bytes, geometry.model_hash
        out: list[bool | BaseException] = [True] * len(items)
        checked: set[int] = set()
        todo: list[int] = []  # the items that reach the agent
        sids: list[int] = []
        offs: list[int] = []
        sums: list[int] = []
        for i, (_key, src, length, checksum) in enumerate(items):
            try:
                if checksum is None:
                    checksum = _accel.checksum(src[:length])  # EFAULT: the slot's loss
                sid, off = self._slot(a, src, checked)
            except OSError as exc:
                out[i] = exc
                continue
            todo.append(i)
            sids.append(sid)
            offs.append(off)
            sums.append(checksum)
        prefix = self.naming.prefix(namespace, bb, mh)
        written = time.time_ns()
        for c in range(0, len(todo), PUT_BATCH):
            idx = todo[c : c + PUT_BATCH]
            keys = [items[i][0] for i in idx]
            lengths = np.array([items[i][2] for i in idx], dtype=np.int64)
            headers = self.naming.pack_many(namespace, keys, lengths.tolist(),
                                            sums[c : c + PUT_BATCH], bb, mh, written)
            try:
                rcs = self._call("put", [prefix + k.hex() for k in keys],
                                 np.array(sids[c : c + PUT_BATCH], dtype=np.int64).tobytes(),
                                 np.array(offs[c : c + PUT_BATCH], dtype=np.int64).tobytes(),
                                 lengths.tobytes(), bb, headers, self.settings.config.replicas,
                                 agent=a)
            except OSError as exc:  # the whole batch: each block's error, as one by one
                for i in idx:
                    out[i] = exc
                continue
            for i, key, rc in zip(idx, keys, rcs, strict=True):
                if rc == RC_NO_SPACE:
                    out[i] = SpillFull(f"the cluster has no room for {key.hex()} (-200)")
                elif rc < 0:
                    out[i] = _rc_error(rc, f"write of {key.hex()}")
                else:
                    self.counters.writes += 1
                    self.counters.write_bytes += items[i][2]
        return out

    def sync(self) -> None:
        pass  # a put is complete when it returns

    def remove(self, namespace: str, keys: Sequence[bytes]) -> int:
        return 0

    def flush(self) -> None:
        pass

    def delete(self, namespace: str, keys: Sequence[bytes],
               geometry: Geometry | None = None) -> set[bytes]:
        if geometry is None or not keys:
            return set()
        found: set[bytes] = set()
        for i in range(0, len(keys), BATCH):
            chunk = list(keys[i : i + BATCH])
            rcs = self._call("remove", [self.naming.name(namespace, k, *geometry)
                                        for k in chunk])
            bad = [rc for rc in rcs if rc < 0 and rc != RC_NOT_FOUND]
            if bad:
                raise _rc_error(bad[0], "remove")
            found.update(k for k, rc in zip(chunk, rcs, strict=True) if rc == 0)
        self.counters.removed += len(found)
        return found

    def keys_of(self, namespace: str, geometry: Geometry | None) -> list[bytes]:
        return []

    def check(self) -> list[str]:
        return []



def _address(buf: Any) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _send_message(sock: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    """One message, waiting for room when the socket is full (it is non-blocking once
    the loop reads it)."""
    while True:
        try:
            if fds:
                socket.send_fds(sock, [data], list(fds))
            else:
                sock.send(data)
            return
        except (BlockingIOError, TimeoutError):
            select.select([], [sock], [], 1.0)


def _settle(fut: _Waiter, result: Any = None, exc: BaseException | None = None) -> None:
    """Complete a request's future from any thread (a loop's future on its loop)."""
    if isinstance(fut, concurrent.futures.Future):
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
        return

    def done() -> None:
        if not fut.done():
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    loop = fut.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        done()
    else:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(done)


