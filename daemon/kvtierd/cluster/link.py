"""The cluster agent's process and the requests to it: start, join, supervise, ask.

:class:`AgentLink` starts the agent (:mod:`kvtierd.cluster.agent`) from a
supervisor thread, restarts it with back-off whenever it fails to join the
cluster or dies, and kills it when a request has been outstanding for
``cluster.request_timeout`` (Mooncake's own calls give up after about 4 s when
the master is gone; a longer wait is a hung agent).  Every request waits for
its answer or for the agent's death, never for a timer alone: the agent may
be writing into a DRAM slot, and the slot is only given back once nothing can
write into it any more.

While no agent is ready, every call fails at once with ``ClusterDown``
(``OSError`` ENOTCONN).  So do calls in the :data:`COOL_SECONDS` after the
master failed to answer one (:class:`MasterBreaker`; Mooncake blocks ~4 s per
call then): a lookup that misses locally waits for an unreachable master at
most once per period, not every time; after it, one call tries again while the
others keep failing fast.

This module knows nothing of blocks, slots or namespaces: :mod:`.tier` turns
tier calls into requests, :mod:`.slots` names DRAM slots to the agent.
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
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgpack

from kvtierd.cluster import agent as agent_mod
from kvtierd.config import ClusterConfig
from kvtierd.logs import Throttle, event, more

log = logging.getLogger("kvtierd.cluster.tier")  # the name operators' log filters know
_throttle = Throttle()

#: Mooncake's return code for "the master is unreachable" (mooncake-store's ErrorCode).
RC_RPC: Final = -900
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



_Waiter = concurrent.futures.Future[Any] | asyncio.Future[Any]


class AgentProcess:
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



class MasterBreaker:
    """Fails master calls fast for :data:`COOL_SECONDS` after the master did not answer,
    then lets one call through to try again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cool_until = 0.0  # 0: the master answered last time
        self._probing = False
        self._cool_why = ""

    def enter(self) -> bool:
        """Whether this call is the one that tries the master again; raises ClusterDown
        while the breaker is open."""
        with self._lock:
            if not self._cool_until:
                return False
            left = self._cool_until - time.monotonic()
            if left > 0 or self._probing:
                raise ClusterDown(f"the Mooncake master did not answer ({self._cool_why}); "
                                  f"trying again in {max(left, 0):.1f} s")
            self._probing = True
            return True

    def leave(self, probe: bool, unreachable: bool) -> None:
        with self._lock:
            if probe:
                self._probing = False
            if unreachable:
                if not self._cool_until:
                    self._cool_why = time.strftime("since %H:%M:%S")
                self._cool_until = time.monotonic() + COOL_SECONDS
            elif probe:
                self._cool_until = 0.0



class AgentLink:
    """The agent process, its supervisor thread and the requests sent to it."""

    def __init__(self, settings: ClusterSettings, counters: ClusterCounters, *,
                 on_joined: Callable[[], None]) -> None:
        """``on_joined``: called on the supervisor thread each time an agent joins."""
        self.settings = settings
        self.counters = counters
        self._on_joined = on_joined
        self._agent: AgentProcess | None = None
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._on_fault: Callable[[str], None] = lambda kind: None
        self._breaker = MasterBreaker()
        #: Why the agent is not ready (None while it is): doctor, stats, logs.
        self.down_reason: str | None = NOT_JOINED

    def report_faults_to(self, on_fault: Callable[[str], None]) -> None:
        """Where the faults the supervisor sees (agent deaths, kills) are counted."""
        self._on_fault = on_fault

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def agent(self) -> AgentProcess | None:
        """The agent while it is ready, else None."""
        a = self._agent
        return a if a is not None and a.ready else None

    def ready_agent(self) -> AgentProcess:
        """The agent; raises ``ClusterDown`` when none is ready."""
        a = self._agent
        if a is None or not a.ready:
            raise ClusterDown(self.down_reason or "the cluster agent is not ready")
        return a

    def open(self) -> None:
        """Start the supervisor; returns at once (joining may take seconds or fail)."""
        self._supervisor = threading.Thread(target=self._supervise, name="kvtier-cluster",
                                            daemon=True)
        self._supervisor.start()

    def stop(self) -> None:
        """Tell the agent to leave; returns at once (``join`` waits for it)."""
        self._stop.set()
        a = self._agent
        if a is not None:
            with contextlib.suppress(OSError):
                a.sock.shutdown(socket.SHUT_RDWR)  # the agent sees EOF and leaves

    def join(self) -> None:
        """Wait for the supervisor, then make sure the agent is dead."""
        if self._supervisor is not None:
            self._supervisor.join(timeout=15)
        a = self._agent
        if a is not None and a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait()

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
                    self._on_joined()  # e.g. map the extents made before it joined
                    self._serve(a)
            except Exception:  # noqa: BLE001 (a bug: the agent goes, the tier stays)
                log.exception("cluster: the agent's supervisor failed; restarting the agent")
            finally:
                self._reap(a, joined)
            if not self._stop.is_set():
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF[1])

    def _start_agent(self) -> AgentProcess | None:
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
        a = AgentProcess(proc, ours)
        threading.Thread(target=self._log_agent, args=(a,), name="kvtier-cluster-log",
                         daemon=True).start()
        return a

    def _log_agent(self, a: AgentProcess) -> None:
        """The agent's stderr (Mooncake's own log): at debug level, and its last lines
        kept for the message when the agent fails."""
        assert a.proc.stderr is not None
        for raw in a.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            a.stderr_tail.append(line)
            log.debug("agent: %s", line)
        a.proc.stderr.close()

    def _handshake(self, a: AgentProcess) -> bool:
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

    def _serve(self, a: AgentProcess) -> None:
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

    def _dispatch(self, a: AgentProcess, n: int) -> None:
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

    def _news(self, a: AgentProcess, msg: list[Any]) -> None:
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

    def _hand_to_loop(self, a: AgentProcess) -> None:
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

    def _loop_read(self, a: AgentProcess) -> None:
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

    def _watchdog(self, a: AgentProcess) -> None:
        now = time.monotonic()
        with a.lock:
            oldest = min((t for _f, t in a.pending.values()), default=now)
        if now - oldest > self.settings.config.request_timeout and a.proc.poll() is None:
            self.counters.agent_kills += 1
            self._down(f"a request to the cluster agent was outstanding for more than "
                       f"{self.settings.config.request_timeout:g} s; killed it", "timeout")
            a.proc.kill()

    def _reap(self, a: AgentProcess, joined: bool) -> None:
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
    def call(self, op: str, *args: Any, fds: Sequence[int] = (),
              agent: AgentProcess | None = None) -> Any:
        if op not in _MASTER_OPS:
            return self._send(op, *args, fds=fds, agent=agent)
        probe = self._breaker.enter()
        unreachable = False
        try:
            result = self._send(op, *args, fds=fds, agent=agent)
            unreachable = any((r[0] if isinstance(r, list) else r) == RC_RPC for r in result)
            return result
        finally:
            self._breaker.leave(probe, unreachable)

    def _send(self, op: str, *args: Any, fds: Sequence[int] = (),
              agent: AgentProcess | None = None) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(agent or self._agent, fut, op, args, fds)
        return fut.result()  # the agent answers, or _reap fails it once the agent is dead

    def _post(self, a: AgentProcess | None, fut: _Waiter, op: str, args: Sequence[Any],
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

    async def call_async(self, op: str, *args: Any) -> Any:
        """``call`` from the event loop, answered on it (no worker thread, no hop)."""
        a = self._agent
        if a is not None and a.loop is None:
            a.loop = asyncio.get_running_loop()  # the supervisor hands the reading over
        probe = self._breaker.enter()
        unreachable = False
        try:
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._post(a, fut, op, args)
            result = await fut
            unreachable = any((r[0] if isinstance(r, list) else r) == RC_RPC for r in result)
            return result
        finally:
            self._breaker.leave(probe, unreachable)


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


