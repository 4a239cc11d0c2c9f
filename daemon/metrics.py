"""Prometheus metrics: event counters/histograms plus a scrape-time collector.

Takes an injected ``CollectorRegistry`` (tests assert with
``registry.get_sample_value``).  Occupancy is not tracked as gauges that could
drift: the collector reads the store's counters when Prometheus scrapes.
The HTTP endpoint runs in prometheus_client's own thread; the collector only
reads integers and copies small dicts, which is safe under the GIL.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvtierd.store import Store

#: RPC latency buckets: from well under the ~0.3 ms floor of a Python unary
#: call on a Unix socket up to a second (an extent growth that pre-faults).
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    """Every metric kvtierd exports, registered on one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.lookups = Counter("kvtier_lookups", "Lookup calls", ["namespace"], registry=registry)
        self.hit_blocks = Counter(
            "kvtier_hit_blocks", "Blocks found by lookup/acquire", ["namespace", "op"],
            registry=registry,
        )
        self.missed_blocks = Counter(
            "kvtier_missed_blocks", "Blocks asked for by lookup/acquire and not found",
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
        self.evicted_blocks = Counter(
            "kvtier_evicted_blocks", "Blocks evicted from a tier", ["namespace", "tier"],
            registry=registry,
        )
        self.checksum_failures = Counter(
            "kvtier_checksum_failures", "Blocks whose bytes failed their checksum (never served)",
            ["namespace", "tier"], registry=registry,
        )
        self.expired_leases = Counter(
            "kvtier_expired_leases", "Leases ended by their TTL", registry=registry
        )
        self.sessions_closed = Counter(
            "kvtier_sessions_closed", "Sessions ended (client closed or died)", registry=registry
        )
        self.rpc_seconds = Histogram(
            "kvtier_rpc_duration_seconds", "Server-side RPC latency", ["method"],
            buckets=RPC_BUCKETS, registry=registry,
        )
        self.rpc_errors = Counter(
            "kvtier_rpc_errors", "RPCs that ended in an error status", ["method", "code"],
            registry=registry,
        )

    def watch(self, store: Store) -> None:
        """Export the store's occupancy, computed at scrape time."""
        self.registry.register(_StoreCollector(store))


class _StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        store = self._store
        acct = store.dram_bytes()
        tier_bytes = GaugeMetricFamily(
            "kvtier_tier_bytes", "Bytes of a tier by state (free + reserved + committed = total)",
            labels=["tier", "state"],
        )
        for state in ("total", "free", "reserved", "committed"):
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
        for ns in list(store.namespaces.values()):
            free = ns.free_slots()
            for state, n in (("committed", ns.committed), ("reserved", ns.reserved),
                             ("leased", ns.leased), ("free", free)):
                ns_blocks.add_metric([ns.name, "dram", state], n)
                ns_bytes.add_metric([ns.name, "dram", state], n * ns.slot_bytes)
            ns_sessions.add_metric([ns.name], ns.sessions)
        yield ns_blocks
        yield ns_bytes
        yield ns_sessions
        recovered = GaugeMetricFamily(
            "kvtier_recovered_blocks", "Blocks re-adopted from a previous run at start",
            labels=["namespace"],
        )
        for ns in list(store.namespaces.values()):
            recovered.add_metric([ns.name], ns.recovered)
        yield recovered
        yield GaugeMetricFamily("kvtier_recovery_seconds", "Time the start spent re-adopting "
                                "segments", value=store.recovery_seconds)
        yield GaugeMetricFamily("kvtier_active_sessions", "Open sessions", value=len(store.sessions))
        yield GaugeMetricFamily("kvtier_active_leases", "Leases held", value=store.lease_count)
        yield GaugeMetricFamily(
            "kvtier_active_reservations", "Open reservations", value=store.reservation_count
        )
        yield GaugeMetricFamily(
            "kvtier_dram_mlocked", "1 when every DRAM extent is mlocked",
            value=0 if store.mlock_errors else 1,
        )
