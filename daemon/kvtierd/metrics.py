"""Prometheus metrics: event counters/histograms plus a scrape-time collector.

Takes an injected ``CollectorRegistry`` (tests assert with
``registry.get_sample_value``).  Occupancy is not tracked as gauges that could
drift: the collector reads the store's counters when Prometheus scrapes.
The HTTP endpoint runs in prometheus_client's own thread, but the store and the
tiers belong to the event loop: the scrape-time collectors run on the loop
(``_OnLoop``), so a scrape never walks a dict the loop is changing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvtierd.counters import saturating_add
from kvtierd.lease_watch import active_leases, held_by_namespace, leased_blocks

if TYPE_CHECKING:
    from kvtierd.events import EventCounters
    from kvtierd.lease_watch import LeaseWatch
    from kvtierd.store import Store
    from kvtierd.tiering import Tiering

#: RPC latency buckets: from well under the ~0.3 ms floor of a Python unary
#: call on a Unix socket up to a second (an extent growth that pre-faults).
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: Spill I/O buckets: a 4 KiB NVMe read (~100 us) up to a stalled network filesystem.
IO_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
              2.5, 10.0)


#: How long a scrape waits for the event loop to compute the occupancy figures.
SCRAPE_TIMEOUT = 10.0

#: How many recent calls of each method the Stats RPC's latency figures cover.
RPC_WINDOW = 1024


@dataclass
class TierIO:
    """Bytes and blocks moved through one tier since start (what ``kvtier top`` rates),
    as the daemon moved or served them (never what a client reports); each saturates
    (``kvtierd.counters``)."""

    read_bytes: int = 0
    written_bytes: int = 0
    reads: int = 0
    writes: int = 0


@dataclass
class RpcWindow:
    """One method's call counts and its most recent latencies (and its child of
    ``kvtier_rpc_duration_seconds``, looked up once)."""

    latency: Histogram
    calls: int = 0
    errors: int = 0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RPC_WINDOW))

    def summary(self) -> tuple[float, float, float]:
        """(p50, p99, max) of the recent latencies, nearest-rank; zeros when none."""
        if not self.recent:
            return 0.0, 0.0, 0.0
        xs = sorted(self.recent)
        n = len(xs)
        return xs[(n - 1) // 2], xs[min(n - 1, (99 * n) // 100)], xs[-1]


class Metrics:
    """Every metric kvtierd exports, registered on one registry.

    Beside the Prometheus series it keeps two small in-process tallies for
    the Stats RPC (and so ``kvtier top``): bytes per tier and direction
    (``io``) and per-method latency windows (``rpcs``).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        #: Run (on the loop) at the start of every scrape, before any series is read:
        #: where counts kept outside this object are added (the sessions' lookup pages).
        self.before_scrape: list[Callable[[], None]] = []
        # Registered first: a registry collects in registration order.
        self._prelude = _OnLoop(_Hooks(self.before_scrape), None)
        registry.register(self._prelude)
        # The daemon's own counts: what clients report without a call has series of its
        # own (kvtier_client_reported_*, collected from the namespaces at scrape time).
        self.lookups = Counter("kvtier_lookups", "Lookup calls the daemon answered",
                               ["namespace"], registry=registry)
        self.hit_blocks = Counter(
            "kvtier_hit_blocks", "Blocks found by Lookup/Acquire calls", ["namespace", "op"],
            registry=registry,
        )
        self.missed_blocks = Counter(
            "kvtier_missed_blocks", "Blocks asked for by Lookup/Acquire calls and not found",
            ["namespace", "op"], registry=registry,
        )
        self.reserved_blocks = Counter(
            "kvtier_reserved_blocks", "Slots handed out by reserve", ["namespace"],
            registry=registry,
        )
        self.committed_blocks = Counter(
            "kvtier_committed_blocks", "Blocks made visible by commit", ["namespace"],
            registry=registry,
        )
        self.aborted_blocks = Counter(
            "kvtier_aborted_blocks",
            "Reserved slots returned (abort, session close or expiry)", ["namespace", "reason"],
            registry=registry,
        )
        #: (namespace, tier) -> its ``evicted_blocks`` child (``evicted``).
        self._evicted: dict[tuple[str, str], Counter] = {}
        self.evicted_blocks = Counter(
            "kvtier_evicted_blocks", "Blocks evicted from a tier", ["namespace", "tier"],
            registry=registry,
        )
        self.checksum_failures = Counter(
            "kvtier_checksum_failures", "Blocks whose bytes failed their checksum (never served)",
            ["namespace", "tier"], registry=registry,
        )
        self.segment_faults = Counter(
            "kvtier_segment_faults", "Data files of a namespace's segments that a client "
            "changed under the daemon (kind: shrunk, grown, holes; sigbus: a daemon copy or "
            "checksum faulted on a slot), each repaired and its lost blocks dropped",
            ["namespace", "kind"], registry=registry,
        )
        self.dropped_slots = Counter(
            "kvtier_recovery_dropped_slots", "Slots of a previous run's segments that failed "
            "validation at a warm start and were freed, by reason", ["reason"],
            registry=registry,
        )
        self.refused_blocks = Counter(
            "kvtier_refused_blocks", "Blocks of Reserve calls refused for lack of room or a "
            "limit (the writer's save is dropped)", ["namespace"], registry=registry,
        )
        self.expired_leases = Counter(
            "kvtier_expired_leases", "Leases ended by their TTL", registry=registry
        )
        self.sessions_closed = Counter(
            "kvtier_sessions_closed", "Sessions ended (client closed or died)", registry=registry
        )
        self.lease_seconds = Histogram(
            "kvtier_lease_hold_seconds", "Acquire to Release of a lease (how long a reader "
            "took to copy its blocks out)", ["namespace"], buckets=RPC_BUCKETS,
            registry=registry,
        )
        self.reservation_seconds = Histogram(
            "kvtier_reservation_hold_seconds", "Reserve to Commit or Abort of a reservation "
            "(how long a writer took to copy its blocks in)", ["namespace", "outcome"],
            buckets=RPC_BUCKETS, registry=registry,
        )
        self.rpc_seconds = Histogram(
            "kvtier_rpc_duration_seconds", "Server-side RPC latency", ["method"],
            buckets=RPC_BUCKETS, registry=registry,
        )
        self.loop_lateness = Histogram(
            "kvtier_loop_lateness_seconds", "How late the event loop ran a 0.25 s timer: what "
            "every call and page commit waited for the loop meanwhile", buckets=IO_BUCKETS,
            registry=registry,
        )
        self.rpc_errors = Counter(
            "kvtier_rpc_errors", "RPCs that ended in an error status", ["method", "code"],
            registry=registry,
        )

        self.spill_io_seconds = Histogram(
            "kvtier_spill_io_duration_seconds", "Latency of one spill I/O (a block read or "
            "write, or a batch's fdatasync)", ["tier", "op"], buckets=IO_BUCKETS,
            registry=registry,
        )
        self.spill_io_bytes = Counter(
            "kvtier_spill_io_bytes", "Bytes moved to and from the spill tiers", ["tier", "op"],
            registry=registry,
        )
        self.spill_faults = Counter(
            "kvtier_spill_faults", "Spill I/O that failed (the daemon kept serving from DRAM)",
            ["tier", "kind"], registry=registry,
        )
        self.background_errors = Counter(
            "kvtier_background_errors", "Unexpected exceptions in background work (expiry, "
            "demotion, prefetch); the work keeps running", ["task"], registry=registry,
        )
        self.io: dict[str, TierIO] = {}
        self.rpcs: dict[str, RpcWindow] = {}
        #: The leases made without a call, as the daemon's looks saw them (``watch_leases``).
        self.lease_watch: LeaseWatch | None = None

    def tier_io(self, tier: str, op: str, nbytes: int, blocks: int = 1) -> None:
        """Count ``blocks`` blocks of ``nbytes`` in all read from or written to ``tier``."""
        io = self.io.setdefault(tier, TierIO())
        if op == "read":
            io.read_bytes = saturating_add(io.read_bytes, nbytes)
            io.reads = saturating_add(io.reads, blocks)
        elif op == "write":
            io.written_bytes = saturating_add(io.written_bytes, nbytes)
            io.writes = saturating_add(io.writes, blocks)

    def rpc_done(self, method: str, seconds: float, error_code: str | None) -> None:
        """Record one finished call: the histogram, the error counter and the window."""
        w = self.rpcs.get(method)
        if w is None:  # (the methods are the service's: a bounded set)
            w = self.rpcs[method] = RpcWindow(self.rpc_seconds.labels(method))
        w.latency.observe(seconds)
        w.calls += 1
        w.recent.append(seconds)
        if error_code is not None:
            w.errors += 1
            self.rpc_errors.labels(method, error_code).inc()

    def evicted(self, namespace: str, tier: str, n: int) -> None:
        """Count ``n`` blocks of ``namespace`` evicted from ``tier`` (the series' child
        kept: an eviction on the commit path, per claim, did a labels() lookup)."""
        child = self._evicted.get((namespace, tier))
        if child is None:
            child = self._evicted[namespace, tier] = self.evicted_blocks.labels(namespace, tier)
        child.inc(n)

    def forget_namespace(self, name: str) -> None:
        """Drop every series labelled with namespace ``name`` (the store forgot it)."""
        for key in [k for k in self._evicted if k[0] == name]:
            del self._evicted[key]
        for metric in (self.lookups, self.hit_blocks, self.missed_blocks, self.reserved_blocks,
                       self.committed_blocks, self.aborted_blocks, self.evicted_blocks,
                       self.checksum_failures, self.lease_seconds, self.reservation_seconds):
            # prometheus_client has remove(*labels) but no way to list a metric's
            # children; its _metrics dict (labels -> child) is that list.
            for labels in [k for k in list(metric._metrics) if k[0] == name]:
                metric.remove(*labels)

    def spill_io(self, tier: str, op: str, seconds: float, nbytes: int) -> None:
        self.spill_io_seconds.labels(tier, op).observe(seconds)
        if nbytes:
            self.spill_io_bytes.labels(tier, op).inc(nbytes)
            self.tier_io(tier, op, nbytes)

    def spill_fault(self, tier: str, kind: str) -> None:
        self.spill_faults.labels(tier, kind).inc()

    def background_error(self, task: str) -> None:
        self.background_errors.labels(task).inc()

    def slot_fault(self, namespace: str) -> None:
        """A daemon copy or checksum of one of the namespace's slots faulted (SIGBUS)."""
        self.segment_faults.labels(namespace, "sigbus").inc()

    def watch(self, store: Store, tiering: Tiering | None = None) -> None:
        """Export the store's occupancy, computed at scrape time on the running loop."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None  # a test without a loop: collect in the scraping thread
        self._prelude.loop = loop
        self.registry.register(_OnLoop(_StoreCollector(store), loop))
        if tiering is not None:
            self.registry.register(_OnLoop(_TieringCollector(tiering), loop))

    def watch_leases(self, watch: LeaseWatch) -> None:
        """Export what ``watch``'s looks saw of the leases made without a call (the
        ``kvtier_fast_path_*_seen`` totals), collected on the loop like the store's."""
        self.lease_watch = watch
        self.registry.register(_OnLoop(_LeaseCollector(watch), self._prelude.loop))

    def watch_events(self, counters: EventCounters) -> None:
        """Export the KV events publisher's counters (``kvtierd.events``)."""
        self.registry.register(_EventsCollector(counters))


class _EventsCollector(Collector):
    def __init__(self, counters: EventCounters) -> None:
        self._c = counters

    def collect(self) -> Iterator[CounterMetricFamily]:
        c = self._c
        yield CounterMetricFamily("kvtier_kv_event_messages", "KV event messages published "
                                  "(heartbeats included)", value=c.messages)
        yield CounterMetricFamily("kvtier_kv_event_dropped", "KV event messages the PUB socket "
                                  "refused (its queue was full)", value=c.dropped)
        requests = CounterMetricFamily("kvtier_kv_event_requests", "Replay requests answered, "
                                       "by answer", labels=["answer"])
        requests.add_metric(["replay"], c.replays)
        requests.add_metric(["snapshot"], c.snapshots)
        requests.add_metric(["malformed"], c.bad_requests)
        yield requests


class _LeaseCollector(Collector):
    """The leases made without a call that the daemon's looks verified
    (``kvtierd.lease_watch``): facts, unlike ``kvtier_client_reported_*``."""

    def __init__(self, watch: LeaseWatch) -> None:
        self._w = watch

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        w = self._w
        note = (" (verified: a hazard in a client's session page naming a committed block "
                "of the namespace when kvtierd looked, every "
                f"{w.interval * 1e3:g} ms; a lease held between two looks only is not seen)")
        leases = CounterMetricFamily("kvtier_fast_path_leases_seen",
                                     "Leases made without a call that kvtierd saw held" + note,
                                     labels=["namespace"])
        blocks = CounterMetricFamily("kvtier_fast_path_leased_blocks_seen",
                                     "Blocks of those leases (each hazard once)" + note,
                                     labels=["namespace"])
        nbytes = CounterMetricFamily("kvtier_fast_path_leased_bytes_seen",
                                     "Committed bytes of those blocks, from kvtierd's own slot "
                                     "table" + note, labels=["namespace"])
        bad = CounterMetricFamily("kvtier_fast_path_unverified_hazards",
                                  "New hazards in clients' session pages that named no "
                                  "committed block of the namespace (garbage or a freed slot): "
                                  "never counted as leases", labels=["namespace"])
        for name in w.namespaces():
            t = w.tally(name)
            leases.add_metric([name], t.leases)
            blocks.add_metric([name], t.blocks)
            nbytes.add_metric([name], t.nbytes)
            bad.add_metric([name], t.unverified)
        yield from (leases, blocks, nbytes, bad)
        yield CounterMetricFamily("kvtier_fast_path_lease_looks", "Looks kvtierd made at its "
                                  "clients' hazards to count the leases made without a call",
                                  value=w.looks)
        yield GaugeMetricFamily("kvtier_fast_path_lease_look_interval_seconds",
                                "Seconds between those looks", value=w.interval)


class _Hooks(Collector):
    """Runs ``hooks`` and exports nothing."""

    def __init__(self, hooks: list[Callable[[], None]]) -> None:
        self._hooks = hooks

    def collect(self) -> list[Metric]:
        for hook in self._hooks:
            hook()
        return []

    def describe(self) -> list[Metric]:
        return []  # never run at registration


class _OnLoop(Collector):
    """Runs ``inner.collect()`` on ``loop``, the only thread that changes what it reads."""

    def __init__(self, inner: Collector, loop: asyncio.AbstractEventLoop | None) -> None:
        self._inner, self.loop = inner, loop

    def collect(self) -> list[Metric]:
        loop = self.loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or here is loop:
            return list(self._inner.collect())
        fut: concurrent.futures.Future[list[Metric]] = concurrent.futures.Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(list(self._inner.collect()))
                except BaseException as exc:  # noqa: BLE001 (handed to the scraping thread)
                    fut.set_exception(exc)

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:
            return []  # the loop is closed: the daemon has stopped
        try:
            return fut.result(timeout=SCRAPE_TIMEOUT)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"the event loop did not answer a scrape in {SCRAPE_TIMEOUT} s "
                               "(kvtierd is stuck)") from None


class _TieringCollector(Collector):
    def __init__(self, tiering: Tiering) -> None:
        self._t = tiering

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        t = self._t
        c = t.counters
        tier_bytes = GaugeMetricFamily(
            "kvtier_spill_tier_bytes", "Bytes of a spill tier by state", labels=["tier", "state"])
        tier_blocks = GaugeMetricFamily("kvtier_spill_tier_blocks", "Blocks held by a spill tier",
                                        labels=["tier"])
        sums = CounterMetricFamily("kvtier_spill_checksum_failures",
                                   "Spilled blocks read back with bad bytes (dropped, never "
                                   "served)", labels=["tier"])
        if t.ssd is not None:
            st = t.ssd.stats()
            for state in ("total", "free", "reserved", "committed"):
                tier_bytes.add_metric(["ssd", state], st[state])
            tier_blocks.add_metric(["ssd"], st["blocks"])
            sums.add_metric(["ssd"], t.ssd.counters.checksum_failures)
        if t.shared is not None:
            sums.add_metric(["shared"], t.shared.counters.checksum_failures)
        joined = GaugeMetricFamily("kvtier_cluster_joined", "1 while the cluster tier's agent "
                                   "is joined to Mooncake's master, 0 while not (no sample "
                                   "without a cluster tier)")
        if t.cluster is not None:
            sums.add_metric(["cluster"], t.cluster.counters.checksum_failures)
            joined.add_metric([], 1 if t.cluster.ready else 0)
        yield joined
        yield tier_bytes
        yield tier_blocks
        yield sums
        dem = CounterMetricFamily("kvtier_demotions", "Blocks copied down a tier",
                                  labels=["path"])
        for path, n in list(c.demotions.items()):
            dem.add_metric([path], n)
        yield dem
        pro = CounterMetricFamily("kvtier_promotions", "Blocks brought back into DRAM",
                                  labels=["tier"])
        for tier, n in list(c.promotions.items()):
            pro.add_metric([tier], n)
        yield pro
        yield CounterMetricFamily("kvtier_prefetches", "Lower-tier hits a Lookup prefetched",
                                  value=c.prefetches)
        yield CounterMetricFamily("kvtier_prefetch_hits", "Acquires that found a prefetched "
                                  "block in DRAM",
                                  value=c.prefetch_hits + t.store.prefetched_reads)
        yield CounterMetricFamily("kvtier_backpressure_waits", "Reserves that waited for "
                                  "demotion", value=c.backpressure_waits)
        yield CounterMetricFamily("kvtier_skipped_prefetches", "Lookups that did not prefetch "
                                  "because too many prefetches were queued",
                                  value=c.skipped_prefetches)
        yield CounterMetricFamily("kvtier_skipped_publishes", "Write-through publishes skipped "
                                  "because the queue was full", value=c.skipped_publishes)
        yield GaugeMetricFamily("kvtier_spill_queue_depth", "Blocks being demoted or published",
                                value=t.queue_depth())


def _client_reported(store: Store) -> Iterator[CounterMetricFamily]:
    """What each namespace's clients report doing without a call (``kvtierd.counters``):
    series of their own, named ``kvtier_client_reported_*``, so that no sum of the
    daemon's series (``kvtier_lookups``, ``kvtier_hit_blocks``, ...) includes them."""
    note = (" (client-reported: what the namespace's clients say they did without a call, "
            "bounded by what the host could do, never verified)")
    lookups = CounterMetricFamily("kvtier_client_reported_lookups",
                                  "Lookups answered from the shared index" + note,
                                  labels=["namespace"])
    acquires = CounterMetricFamily("kvtier_client_reported_acquires",
                                   "Acquires leased without a call" + note, labels=["namespace"])
    blocks = CounterMetricFamily("kvtier_client_reported_blocks",
                                 "Keys those lookups and acquires found (result=hit) and did "
                                 "not (result=miss)" + note, labels=["namespace", "op", "result"])
    nbytes = CounterMetricFamily("kvtier_client_reported_read_bytes",
                                 "Bytes of the blocks leased without a call" + note,
                                 labels=["namespace"])
    cut = CounterMetricFamily("kvtier_client_reported_cut",
                              "Folds of a namespace's page counters in which a reported count "
                              "was cut to its bound (a client that lies, or a bug)",
                              labels=["namespace"])
    for ns in list(store.namespaces.values()):
        r = ns.reported
        if r is None:
            continue
        lookups.add_metric([ns.name], r.lookups)
        acquires.add_metric([ns.name], r.acquires)
        for op, result, n in (("lookup", "hit", r.lookup_hits), ("lookup", "miss", r.lookup_misses),
                              ("acquire", "hit", r.acquire_hits),
                              ("acquire", "miss", r.acquire_misses)):
            blocks.add_metric([ns.name, op, result], n)
        nbytes.add_metric([ns.name], r.read_bytes)
        cut.add_metric([ns.name], r.cut)
    yield from (lookups, acquires, blocks, nbytes, cut)


class _StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self._store = store
        self._started = time.time()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        store = self._store
        idle = store.idle_grants()
        acct = store.dram_bytes(idle)
        tier_bytes = GaugeMetricFamily(
            "kvtier_tier_bytes", "Bytes of a tier by state (free + reserved + granted + "
            "committed = total; granted: slots granted ahead to writers, not taken yet)",
            labels=["tier", "state"],
        )
        for state in ("total", "free", "reserved", "granted", "committed"):
            tier_bytes.add_metric(["dram", state], acct[state])
        yield tier_bytes
        ns_blocks = GaugeMetricFamily(
            "kvtier_namespace_blocks", "Blocks of a namespace by state",
            labels=["namespace", "tier", "state"],
        )
        ns_bytes = GaugeMetricFamily(
            "kvtier_namespace_bytes", "Slot bytes of a namespace by state",
            labels=["namespace", "tier", "state"],
        )
        ns_sessions = GaugeMetricFamily(
            "kvtier_namespace_sessions", "Open sessions per namespace", labels=["namespace"]
        )
        fast_leases = GaugeMetricFamily(
            "kvtier_fast_path_leases", "Leases clients hold without a call now, verified: "
            "distinct leases of a session page whose hazards name committed blocks of the "
            "namespace", labels=["namespace"])
        fast_blocks = GaugeMetricFamily(
            "kvtier_fast_path_leased_blocks", "Distinct committed blocks those leases name now",
            labels=["namespace"])
        fast_bytes = GaugeMetricFamily(
            "kvtier_fast_path_leased_bytes", "Committed bytes of those blocks (kvtierd's own "
            "slot table)", labels=["namespace"])
        held = held_by_namespace(store)
        for ns in list(store.namespaces.values()):
            h = held[ns.name]
            free = ns.free_slots()
            granted = idle.get(ns.name, 0)
            for state, n in (("committed", ns.committed), ("reserved", ns.reserved - granted),
                             ("granted", granted), ("leased", leased_blocks(ns, h)),
                             ("free", free)):
                ns_blocks.add_metric([ns.name, "dram", state], n)
                ns_bytes.add_metric([ns.name, "dram", state], n * ns.slot_bytes)
            ns_sessions.add_metric([ns.name], ns.sessions)
            fast_leases.add_metric([ns.name], h.leases)
            fast_blocks.add_metric([ns.name], h.blocks)
            fast_bytes.add_metric([ns.name], h.nbytes)
        yield ns_blocks
        yield ns_bytes
        yield ns_sessions
        yield from (fast_leases, fast_blocks, fast_bytes)
        yield from _client_reported(store)
        recovered = GaugeMetricFamily(
            "kvtier_recovered_blocks", "Blocks re-adopted from a previous run at start",
            labels=["namespace"],
        )
        for ns in list(store.namespaces.values()):
            recovered.add_metric([ns.name], ns.recovered)
        yield recovered
        yield GaugeMetricFamily("kvtier_recovery_seconds", "Time the start spent re-adopting "
                                "segments", value=store.recovery_seconds)
        yield GaugeMetricFamily("kvtier_start_time_seconds", "When this daemon process started "
                                "(Unix time)", value=self._started)
        yield GaugeMetricFamily(
            "kvtier_warm_start", "1 when this start re-adopted blocks of a previous run, 0 when "
            "it started cold (the DRAM cache was lost)",
            value=1 if any(ns.recovered for ns in list(store.namespaces.values())) else 0)
        yield GaugeMetricFamily("kvtier_active_sessions", "Open sessions", value=len(store.sessions))
        yield GaugeMetricFamily(
            "kvtier_active_leases", "Leases held: by Acquire calls, and without a call as "
            "verified (kvtier_fast_path_leases)",
            value=active_leases(store, held))
        yield GaugeMetricFamily(
            "kvtier_active_reservations", "Open reservations", value=store.reservation_count
        )
        yield GaugeMetricFamily(
            "kvtier_dram_mlocked", "1 when every DRAM extent is mlocked",
            value=0 if store.mlock_errors else 1,
        )
