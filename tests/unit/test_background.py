"""Background work never dies silently: expiry, demotion and prefetch count and log their
unexpected errors and keep running; prefetch is bounded; scrapes read the store on its loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtierd import app, tiering
from kvtierd.logs import Throttle
from kvtierd.metrics import Metrics, _OnLoop
from kvtierd.tiering import TIER_SSD

from .spill_harness import tiered


class _Probe(Collector):
    """Records which thread collected."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.threads.append(threading.get_ident())
        yield GaugeMetricFamily("probe", "which thread collected", value=1)


def test_a_scrape_from_another_thread_collects_on_the_event_loop() -> None:
    probe = _Probe()

    async def go() -> tuple[int, list[Any]]:
        collector = _OnLoop(probe, asyncio.get_running_loop())
        got = await asyncio.to_thread(collector.collect)  # the HTTP thread's view
        return threading.get_ident(), got

    loop_thread, got = asyncio.run(go())
    assert [m.name for m in got] == ["probe"]
    assert probe.threads == [loop_thread]


def test_a_scrape_after_the_loop_closed_returns_nothing() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    assert _OnLoop(_Probe(), loop).collect() == []


def test_expiry_counts_an_unexpected_error_and_keeps_expiring(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    class Store:
        def expire(self) -> tuple[dict[str, int], int]:
            calls.append(1)
            if len(calls) == 2:
                raise KeyError("a bug")
            return {"ns": 1}, 2

    monkeypatch.setattr(app, "EXPIRY_INTERVAL", 0.01)
    registry = CollectorRegistry()
    metrics = Metrics(registry)

    async def go() -> None:
        task = asyncio.get_running_loop().create_task(
            app._expire_forever(Store(), metrics))  # type: ignore[arg-type]
        while len(calls) < 4:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert registry.get_sample_value("kvtier_background_errors_total", {"task": "expiry"}) == 1
    assert registry.get_sample_value("kvtier_expired_leases_total") >= 6  # before and after


@pytest.mark.parametrize("held_by", ["work", "sleep"])
def test_a_late_event_loop_is_measured_and_logged_with_its_own_share(
        held_by: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(app, "LOOP_PROBE_INTERVAL", 0.01)
    monkeypatch.setattr(app, "LOOP_LATE_WARNING", 0.15)
    monkeypatch.setattr(app, "_throttle", Throttle(60.0))
    registry = CollectorRegistry()

    async def go() -> None:
        task = asyncio.get_running_loop().create_task(app._probe_loop_forever(Metrics(registry)))
        await asyncio.sleep(0.05)
        await asyncio.sleep(0)  # the probe's timer is due while the loop is held
        if held_by == "sleep":
            time.sleep(0.3)
        else:  # 0.3 s of this thread's CPU time, however busy the host is
            cpu0, t0 = time.thread_time(), time.monotonic()
            while time.thread_time() - cpu0 < 0.3 and time.monotonic() - t0 < 10:
                pass
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.WARNING, logger="kvtierd.app"):
        asyncio.run(go())
    (record,) = [r for r in caplog.records if "event loop ran" in r.getMessage()]
    message = record.getMessage()
    late = float(message.split("ran ")[1].split(" s late")[0])
    ran = float(message.split("thread ran ")[1].split(" s on a CPU")[0])
    assert late >= 0.25 and ran <= late + 0.05
    assert ran >= 0.25 if held_by == "work" else ran < 0.1
    assert registry.get_sample_value("kvtier_loop_lateness_seconds_count") >= 5


def test_prefetches_are_bounded_and_a_failing_one_is_counted(
        shm_dir: str, disk_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    errors: list[str] = []

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            env.t.observer.background_error = errors.append  # type: ignore[method-assign]
            s, ks = await env.spilled(60)
            first = ks[:3]
            assert all(k not in s.ns.index for k in first)
            # A full queue: the lookup answers but does not add a prefetch.
            env.t.promoter.queued_prefetches = tiering.MAX_QUEUED_PREFETCHES
            assert await env.t.lookup(s, first, prefetch=True) == [TIER_SSD] * 3
            assert env.t.counters.skipped_prefetches == 1 and not env.t.work.tasks
            env.t.promoter.queued_prefetches = 0

            async def broken(*a: Any, **k: Any) -> None:
                raise RuntimeError("a bug in promotion")

            monkeypatch.setattr(env.t.promoter, "promote", broken)
            assert await env.t.lookup(s, first, prefetch=True) == [TIER_SSD] * 3
            while env.t.work.tasks:
                await asyncio.sleep(0.01)
            assert errors == ["prefetch"] and env.t.promoter.queued_prefetches == 0
            monkeypatch.undo()
            assert await env.t.lookup(s, first, prefetch=True) == [TIER_SSD] * 3  # still works
            while env.t.work.tasks:
                await asyncio.sleep(0.01)
            assert all(k in s.ns.index for k in first)

    asyncio.run(go())


def test_evictions_count_per_namespace_and_start_again_after_a_forget() -> None:
    """``Metrics.evicted`` keeps each series' child; a namespace the store forgot has no
    series left, and its next eviction starts a new one (not the dropped child)."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)

    def value(ns: str, tier: str) -> float | None:
        return registry.get_sample_value("kvtier_evicted_blocks_total",
                                         {"namespace": ns, "tier": tier})

    metrics.evicted("a", "dram", 3)
    metrics.evicted("a", "dram", 2)
    metrics.evicted("b", "ssd", 1)
    assert (value("a", "dram"), value("b", "ssd")) == (5.0, 1.0)
    metrics.forget_namespace("a")
    assert value("a", "dram") is None and value("b", "ssd") == 1.0
    metrics.evicted("a", "dram", 4)
    assert value("a", "dram") == 4.0
