"""Wiring: build the store, the gRPC server, the session channel and metrics.

``create_daemon(config)`` returns a started ``Daemon`` with its bound
addresses (tests use temp directories and metrics port 0); ``Daemon.stop()``
stops it gracefully.  Ordering at start: directories and the instance lock,
then the store, then the sockets; systemd hears READY=1 only after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import functools
import logging
import os
import resource
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from prometheus_client import CollectorRegistry, start_http_server

from kvtier import __version__, _accel
from kvtier._paths import GRPC_SOCKET_NAME, SESSION_SOCKET_NAME
from kvtier.errors import FailedPrecondition
from kvtierd import shared_index, systemd
from kvtierd.access import AdminSessions
from kvtierd.cluster.format import Naming, load_secret
from kvtierd.cluster.tier import ClusterSettings, ClusterTier
from kvtierd.config import ClusterConfig, Config, ConfigError
from kvtierd.events import EventPublisher
from kvtierd.lease_watch import LeaseWatch
from kvtierd.logs import Throttle, event, more
from kvtierd.metrics import Metrics
from kvtierd.recovery import RecoveryReport, log_problems, recover
from kvtierd.segments import Segment, SegmentLayout
from kvtierd.service import KVTierService, add_to_server, methods
from kvtierd.session_channel import SessionChannel
from kvtierd.spill.shared import SharedTier
from kvtierd.spill.ssd import SsdTier
from kvtierd.store import Namespace, Store, StoreOptions
from kvtierd.tiering import SpillPolicy, Tiering

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_throttle = Throttle(60.0)

#: How often leases and reservations are checked against their TTL.
EXPIRY_INTERVAL = 1.0
#: How often the event loop's lateness is measured (``_probe_loop_forever``), and the
#: lateness that is logged: every call and every commit from a page waits that long.
LOOP_PROBE_INTERVAL = 0.25
LOOP_LATE_WARNING = 1.0
#: How often the segments' data files are checked for a client's truncation,
#: extension or holes (an fstat per extent, in a worker thread).
AUDIT_INTERVAL = 2.0
#: Seconds after READY before a warm start's housekeeping (the cross-check of what was
#: adopted, the mlock of the adopted extents) begins: the clients that come back right
#: after a restart find the event loop and the cores free (the check's snapshot holds the
#: loop ~0.1 s per million blocks, the rest runs at nice 19 but still shares the cores).
HOUSEKEEPING_DELAY = 2.0
SERVICE_NAME = "kvtier.v1.KVTier"


@dataclasses.dataclass
class Daemon:
    """A running kvtierd: what it serves and where."""

    config: Config
    store: Store
    tiering: Tiering
    metrics: Metrics
    server: grpc.aio.Server
    channel: SessionChannel
    health: Any
    grpc_path: str
    session_path: str
    metrics_port: int | None
    tcp_port: int | None
    _http: Any
    _lock_fd: int
    _tasks: list[asyncio.Task[None]]  # expiry, background mlock, systemd watchdog
    events: EventPublisher | None = None
    _stopped: bool = False

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting work, let in-flight calls finish (bounded), release everything."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.server.grace if grace is None else grace
        systemd.notify("STOPPING=1")
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.channel.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.tiering.stop()
        if self.events is not None:
            self.tiering.watch(None)
            await self.events.stop()
        await self.store.stop_growth()  # extents being made: done, and removed by drain
        await self.store.drain()
        self.store.close_all()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.grpc_path)
        os.close(self._lock_fd)
        log.info("kvtierd stopped", extra=event("stop"))


def _lock_instance(shm_dir: str, instance: str) -> int:
    """Hold an flock on the instance; the kernel drops it when we die (even by SIGKILL)."""
    path = os.path.join(shm_dir, "kvtierd.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise FailedPrecondition(
            f"another kvtierd (pid {holder}) is running instance {instance!r} on {shm_dir}"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _next_boot_epoch(shm_dir: str) -> int:
    """A counter in the instance directory, bumped at every start."""
    path = os.path.join(shm_dir, "epoch")
    try:
        with open(path) as f:
            epoch = int(f.read().strip() or 0) + 1
    except (FileNotFoundError, ValueError):
        epoch = 1
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as f:
        f.write(f"{epoch}\n")
    os.replace(tmp, path)
    return epoch


def _make_dir(path: str, mode: int) -> list[str]:
    """Create ``path``; set its mode when it is ours (a volume root owned by root is not).

    Returns the directories this call created, deepest first (a failed start removes them).
    """
    created: list[str] = []
    p = os.path.abspath(path)
    while not os.path.exists(p):
        created.append(p)
        p = os.path.dirname(p)
    os.makedirs(path, mode=mode, exist_ok=True)
    if os.stat(path).st_uid == os.geteuid():
        os.chmod(path, mode)
    return created


def _remove_created(dirs: list[str]) -> None:
    """Undo ``_make_dir`` after a failed start: what it created held only this start's files."""
    for d in dirs:
        with contextlib.suppress(OSError):
            if d == dirs[0]:
                for name in os.listdir(d):
                    os.unlink(os.path.join(d, name))
            os.rmdir(d)


def _start_metrics(cfg: Config, host: str, registry: CollectorRegistry) -> tuple[Any, int]:
    try:
        http, _thread = start_http_server(cfg.metrics.port, addr=host,
                                          registry=registry)
    except OSError as exc:
        raise FailedPrecondition(
            f"cannot listen on metrics.address {cfg.metrics.address!r}: "
            f"{exc.strerror or exc} (choose another port, or set metrics.address to '' "
            f"to turn the endpoint off)") from None
    return http, int(http.server_port)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _add_tcp_listener(server: grpc.aio.Server, cfg: Config) -> int:
    """Bind ``server.tcp_address`` with TLS (config loading already refused it without).

    With ``tls_client_auth: required`` every client presents a certificate the
    CA verifies, and an admin call over TCP is authorized by its common name
    (``cert:NAME`` principals); with ``none`` TCP callers have no identity.
    """
    s = cfg.server
    creds = grpc.ssl_server_credentials(
        [(_read(s.tls_key), _read(s.tls_cert))],
        root_certificates=_read(s.tls_client_ca) if s.tls_client_ca else None,
        require_client_auth=s.tls_client_auth == "required",
    )
    try:
        port = server.add_secure_port(s.tcp_address, creds)
    except RuntimeError:  # grpcio >= 1.60 raises instead of returning 0
        port = 0
    if port == 0:
        raise FailedPrecondition(f"cannot listen on server.tcp_address {s.tcp_address!r} "
                                 "(in use, or not an address of this host)")
    return int(port)


def _raise_nofile_limit() -> None:
    """One fd per extent: take the hard NOFILE limit as the soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _create_extent(
    cfg: Config, boot_epoch: int, ns: Namespace, index: int, layout: SegmentLayout, seg_id: int
) -> Segment:
    return Segment.create(
        cfg.dram.shm_dir,
        segment_id=seg_id,
        namespace=ns.name,
        model_uid=ns.model_uid,
        index=index,
        layout=layout,
        boot_epoch=boot_epoch,
        mlock=cfg.dram.mlock,
        prefault_threads=cfg.dram.prefault_threads,
    )


async def _in_background(fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)`` in a thread of its own at the lowest CPU priority (nice 19; only that
    thread's), awaited: housekeeping that must not take a core from the loop or from the
    clients (the default executor's threads are not lowered: they serve requests too)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(value: _T | None, exc: BaseException | None) -> None:
        if done.cancelled():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(value)  # type: ignore[arg-type]

    def run() -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        value: _T | None = None
        error: BaseException | None = None
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 -- handed to the awaiting task
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown)
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name="kvtier-background", daemon=True).start()
    return await done


async def _lock_adopted(store: Store, mlock: bool) -> None:
    """mlock re-adopted extents after READY (it faults every page in: seconds for big pools)."""
    if any(ext.segment.adopted for ns in store.namespaces.values() for ext in ns.extents):
        await asyncio.sleep(HOUSEKEEPING_DELAY)
    for ns in list(store.namespaces.values()):
        for ext in list(ns.extents):
            seg = ext.segment
            if not seg.adopted:
                continue  # created by this run: locked when created
            t0 = time.perf_counter()
            # at the lowest CPU priority: the clients coming back go first
            await _in_background(functools.partial(seg.lock_and_populate, mlock=mlock))
            store.note_prefault(time.perf_counter() - t0, seg.mlock_error)


async def _watchdog_forever(interval: float) -> None:
    """Ping systemd from the event loop itself: a stuck loop stops the pings."""
    while True:
        systemd.notify("WATCHDOG=1")
        await asyncio.sleep(interval)


async def _probe_loop_forever(metrics: Metrics) -> None:
    """How late the event loop runs a timer (``kvtier_loop_lateness_seconds``).  Late by
    ``LOOP_LATE_WARNING`` or more, it is logged with how much of that time the loop's
    thread ran on a CPU (its own work); the rest it waited for a CPU (a busy host) or
    for the GIL (another thread of kvtierd)."""
    loop = asyncio.get_running_loop()
    while True:
        t0, cpu0 = loop.time(), time.thread_time()
        await asyncio.sleep(LOOP_PROBE_INTERVAL)
        late = max(0.0, loop.time() - t0 - LOOP_PROBE_INTERVAL)
        metrics.loop_lateness.observe(late)
        if late < LOOP_LATE_WARNING:
            continue
        ran = time.thread_time() - cpu0
        held = _throttle("loop-late")
        if held is not None:
            log.warning("the event loop ran %.2f s late (every call waited as long); its "
                        "thread ran %.2f s on a CPU meanwhile (its own work), and waited "
                        "the rest for a CPU (a busy host) or for the GIL (another kvtierd "
                        "thread)%s", late, ran, more(held),
                        extra=event("loop_late", seconds=round(late, 3), cpu=round(ran, 3)))


async def _expire_forever(store: Store, metrics: Metrics) -> None:
    while True:
        await asyncio.sleep(EXPIRY_INTERVAL)
        try:
            aborted, leases = store.expire()
        except Exception:  # a bug: count and log it; expiry must keep running
            metrics.background_error("expiry")
            held = _throttle("expiry")
            if held is not None:
                log.exception("lease/reservation expiry failed; it keeps running%s", more(held))
            continue
        for ns_name, n in aborted.items():
            metrics.aborted_blocks.labels(ns_name, "expired").inc(n)
        if leases:
            metrics.expired_leases.inc(leases)


async def _look_at_leases_forever(watch: LeaseWatch, metrics: Metrics) -> None:
    """Count the leases clients make without a call, at the daemon's pace
    (``kvtierd.lease_watch``): a look every ``watch.interval``."""
    while True:
        await asyncio.sleep(watch.interval)
        try:
            watch.look()
        except Exception:  # a bug: count and log it; the looks must keep running
            metrics.background_error("lease_watch")
            held = _throttle("lease_watch")
            if held is not None:
                log.exception("looking at the fast path's leases failed; it keeps "
                              "running%s", more(held))


async def _check_after_recovery(store: Store, metrics: Metrics, report: RecoveryReport) -> None:
    """Cross-check what a warm start adopted, once, soon after READY (off the loop).

    Adoption validated every slot; this is the store's own ``check()`` over the
    result (index, block table, free lists and slot tables agree, capacity adds up).  A
    problem is a bug: logged at ERROR and counted (``kvtier_background_errors_total
    {task="recovery_check"}``); the daemon keeps serving.  The check runs in a thread of
    its own at the lowest CPU priority: clients coming back after the restart go first.
    """
    if not report.warm:
        return
    await asyncio.sleep(HOUSEKEEPING_DELAY)
    t0 = time.perf_counter()
    snapshot = store.check_snapshot()
    problems = await _in_background(store.check_from, snapshot)
    report.problems = problems
    log_problems(problems)
    if problems:
        metrics.background_error("recovery_check")
    log.info("recovery check: %d blocks cross-checked in %.3f s, %d problems",
             sum(report.blocks.values()), time.perf_counter() - t0, len(problems),
             extra=event("recovery_check", problems=len(problems),
                         seconds=round(time.perf_counter() - t0, 6)))


def _audit(segments: list[Segment]) -> list[tuple[Segment, str, int]]:
    """Worker thread: repair the data files clients changed; (segment, kind, intact bytes)."""
    found = []
    for seg in segments:
        try:
            fault = seg.audit_data_file()
        except OSError as exc:  # the kernel refused (a segment closed meanwhile answers None)
            log.debug("audit of %s skipped: %s", seg.path, exc)
            continue
        if fault is not None:
            found.append((seg, *fault))
    return found


async def _audit_forever(store: Store, metrics: Metrics) -> None:
    """Every AUDIT_INTERVAL: data files set back to their size and allocation.

    A writer can shrink, extend or punch holes in its namespace's data file
    (its fd reaches it); the daemon never faults on it (guarded copies), but
    blocks whose bytes were cut off must go, and shared memory a client added
    must be given back.  Runs off the event loop; the store changes on it.
    """
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(AUDIT_INTERVAL)
        try:
            segments = [e.segment for ns in store.namespaces.values() for e in ns.extents]
            for seg, kind, intact in await loop.run_in_executor(None, _audit, segments):
                lost = store.drop_lost(seg, intact) if kind == "shrunk" else []
                metrics.segment_faults.labels(seg.namespace, kind).inc()
                held = _throttle(f"audit/{seg.namespace}/{kind}")
                if held is not None:
                    log.warning("namespace %r: a client %s the data file of extent %d; "
                                "repaired, %d blocks whose bytes were lost dropped%s",
                                seg.namespace, {"shrunk": "truncated", "grown": "extended",
                                                "holes": "punched holes into"}[kind],
                                seg.index, len(lost), more(held),
                                extra=event("segment_fault", namespace=seg.namespace,
                                            kind=kind, extent=seg.index, lost=len(lost),
                                            held_back=held))
        except Exception:  # a bug: count and log it; the audit must keep running
            metrics.background_error("audit")
            held = _throttle("audit")
            if held is not None:
                log.exception("segment audit failed; it keeps running%s", more(held))


def _make_tiering(cfg: Config, store: Store, metrics: Metrics) -> Tiering:
    sp = cfg.spill
    ssd = None
    if sp.ssd_dir:
        _make_dir(sp.ssd_dir, 0o700)
        ssd = SsdTier(sp.ssd_dir, capacity=sp.ssd_capacity, file_bytes=sp.ssd_file_size,
                      direct=sp.ssd_direct_io)
        ssd.quota_of = lambda namespace: cfg.access.quotas(namespace)[1]
    shared = SharedTier(sp.shared_dir) if sp.shared_dir else None
    policy = SpillPolicy.from_config(sp, cfg.cluster)
    cluster = _make_cluster(cfg.cluster, store) if cfg.cluster.enabled else None
    return Tiering(store, ssd=ssd, shared=shared, cluster=cluster, policy=policy,
                   io_threads=sp.io_threads, observer=metrics)


def _make_cluster(cc: ClusterConfig, store: Store) -> ClusterTier:
    """The cluster tier: its settings resolved, its secret read (a start without a
    readable secret fails here, with the setting's name)."""
    try:
        naming = Naming(load_secret(cc.secret_file))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cluster.secret_file: {exc}") from None
    cluster = ClusterTier(ClusterSettings.from_config(cc), naming, segments=store.live_segments)
    store.attach_cluster(cluster.premap)
    return cluster


async def create_daemon(cfg: Config, *, registry: CollectorRegistry | None = None) -> Daemon:
    """Build and start a daemon for ``cfg``; returns once every socket is bound.

    A start that fails undoes what it did: no socket, directory or listener is left behind
    (the segments of a previous run stay: they are the cache a later start re-adopts).
    """
    t0 = time.monotonic()
    async with contextlib.AsyncExitStack() as undo:
        created = _make_dir(cfg.server.socket_dir, 0o755)
        undo.callback(_remove_created, created)
        created = _make_dir(cfg.dram.shm_dir, 0o700)
        undo.callback(_remove_created, created)
        lock_fd = _lock_instance(cfg.dram.shm_dir, cfg.instance)
        undo.callback(os.close, lock_fd)
        _raise_nofile_limit()
        # Clients can truncate or punch holes in their data files: a SIGBUS in the
        # daemon's own copies and checksums of slots becomes an OSError (EFAULT).
        _accel.install_fault_guard()
        boot_epoch = _next_boot_epoch(cfg.dram.shm_dir)

        registry = registry if registry is not None else CollectorRegistry()
        metrics = Metrics(registry)

        def on_evicted(namespace: str, n: int) -> None:
            metrics.evicted(namespace, "dram", n)

        store = Store(
            capacity=cfg.dram.capacity,
            extent_size=cfg.dram.extent_size,
            extent_factory=functools.partial(_create_extent, cfg, boot_epoch),
            lease_ttl=cfg.leases.ttl,
            reservation_ttl=cfg.reservations.ttl,
            boot_epoch=boot_epoch,
            on_evicted=on_evicted,
            # Clients search the keys themselves (a Lookup without a call): fast path only.
            publish=cfg.server.fast_path and shared_index.AVAILABLE,
            grant_bytes=(min(cfg.server.write_grant_bytes, cfg.dram.capacity // 16)
                         if cfg.server.fast_path and shared_index.AVAILABLE else 0),
            options=StoreOptions(dram_quota_of=lambda name: cfg.access.quotas(name)[0],
                                 grow_ahead=cfg.dram.grow_ahead,
                                 on_forget=metrics.forget_namespace),
        )
        # Nothing is served yet, so recovery may block: READY comes after it.
        report = recover(store, cfg.dram.shm_dir, check=False)
        for reason, n in report.dropped_slots.items():
            metrics.dropped_slots.labels(reason).inc(n)
        undo.callback(store.close_all)
        store.set_recovery_report(report.seconds, report.dropped)
        tiering = _make_tiering(cfg, store, metrics)
        await tiering.start()
        undo.push_async_callback(tiering.stop)
        metrics.watch(store, tiering)
        lease_watch = LeaseWatch(store)
        metrics.watch_leases(lease_watch)
        events = None
        if cfg.events.enabled:
            events = EventPublisher(cfg.events, first_seq=boot_epoch << 32,
                                    blocks=tiering.blocks_by_tier,
                                    socket_mode=cfg.server.socket_mode)
            await events.start()
            undo.push_async_callback(events.stop)
            metrics.watch_events(events.counters)
            tiering.watch(events.changed)
            undo.callback(tiering.watch, None)

        grpc_path = os.path.join(cfg.server.socket_dir, GRPC_SOCKET_NAME)
        session_path = os.path.join(cfg.server.socket_dir, SESSION_SOCKET_NAME)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(grpc_path)
        limit = cfg.server.max_message_bytes
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                # A second daemon must not share a TCP port with the first one silently.
                ("grpc.so_reuseport", 0),
            ]
        )
        admins = AdminSessions()
        service = KVTierService(tiering, metrics, max_keys=cfg.server.max_keys_per_call,
                                started=t0, policy=cfg.access, admins=admins,
                                limits=cfg.limits)
        add_to_server(service, server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        server.add_insecure_port(f"unix:{grpc_path}")
        undo.callback(_unlink, grpc_path)
        tcp_port = _add_tcp_listener(server, cfg) if cfg.server.tcp_address else None
        await server.start()
        undo.push_async_callback(server.stop, 0)
        os.chmod(grpc_path, cfg.server.socket_mode)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

        channel = SessionChannel(store, metrics, session_path, cfg.server.socket_mode,
                                 policy=cfg.access, limits=cfg.limits, admins=admins,
                                 methods=methods(service) if cfg.server.fast_path else None,
                                 commit_from_page=service.commit_from_page,
                                 max_message_bytes=cfg.server.max_message_bytes,
                                 max_keys=cfg.server.max_keys_per_call,
                                 busy_poll=cfg.server.busy_poll)
        if cfg.server.busy_poll:
            log.info("busy polling: the event loop polls for %.0f us after each commit and "
                     "call on the session socket (server.busy_poll)",
                     cfg.server.busy_poll * 1e6)
        undo.callback(_unlink, session_path)
        await channel.start()
        undo.push_async_callback(channel.stop)

        http = None
        metrics_port: int | None = None
        if cfg.metrics.host is not None:
            http, metrics_port = _start_metrics(cfg, cfg.metrics.host, registry)
            undo.callback(http.server_close)
            undo.callback(http.shutdown)

        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(_expire_forever(store, metrics)),
            loop.create_task(_look_at_leases_forever(lease_watch, metrics)),
            loop.create_task(_probe_loop_forever(metrics)),
            loop.create_task(_audit_forever(store, metrics)),
            loop.create_task(_check_after_recovery(store, metrics, report)),
            loop.create_task(_lock_adopted(store, cfg.dram.mlock)),
        ]
        interval = systemd.watchdog_interval()
        if interval is not None:
            tasks.append(loop.create_task(_watchdog_forever(interval)))
        undo.pop_all()  # started: from here on Daemon.stop() releases everything
    daemon = Daemon(
        config=cfg, store=store, tiering=tiering, metrics=metrics, server=server, channel=channel, health=health,
        grpc_path=grpc_path, session_path=session_path, metrics_port=metrics_port,
        tcp_port=tcp_port, _http=http,
        _lock_fd=lock_fd, _tasks=tasks, events=events,
    )
    log.info(
        "kvtierd ready in %.2f s: grpc %s, sessions %s, metrics %s, DRAM %.1f MiB in %s "
        "(epoch %d)%s%s",
        time.monotonic() - t0, grpc_path, session_path,
        f"{cfg.metrics.host}:{metrics_port}" if metrics_port is not None else "off",
        cfg.dram.capacity / 2**20, cfg.dram.shm_dir, boot_epoch,
        f", tcp+tls {cfg.server.tcp_address.rpartition(':')[0]}:{tcp_port} (client "
        f"certificates {cfg.server.tls_client_auth})" if tcp_port is not None else "",
        "" if cfg.access.enabled else ", ACCESS CONTROL OFF (access.enabled=false)",
        extra=event("ready", seconds=round(time.monotonic() - t0, 6), grpc=grpc_path,
                    sessions=session_path, metrics_port=metrics_port, epoch=boot_epoch,
                    dram_bytes=cfg.dram.capacity, version=__version__, tcp_port=tcp_port,
                    access_control=cfg.access.enabled),
    )
    systemd.notify("READY=1")
    return daemon
