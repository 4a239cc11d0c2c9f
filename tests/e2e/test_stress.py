"""Stress: many client processes, eviction pressure, cross-namespace reclaim; ends with check()."""

from __future__ import annotations

import pytest

from tests.conftest import start_daemon, stop_daemon
from tests.e2e.test_core import dram, spawn_worker


@pytest.mark.parametrize(
    ("procs", "seconds"),
    [pytest.param(4, 5, id="short"), pytest.param(8, 60, id="long", marks=pytest.mark.slow)],
)
def test_stress_many_clients_under_eviction_pressure(workdir: str, procs: int, seconds: int) -> None:
    # 8 MiB pool, 1 MiB extents: constant eviction and extents moving between namespaces.
    d = start_daemon(workdir, capacity="8MiB", extent="1MiB")
    try:
        workers = [
            spawn_worker(d, "stress", seed=seed, universe=200, seconds=seconds,
                         block_bytes=(16384, 65536, 200000)[seed % 3],
                         namespace=f"stress/{seed % 3}")
            for seed in range(procs)
        ]
        for p in workers:
            out, err = p.communicate(timeout=seconds + 120)
            assert p.returncode == 0, err[-2000:]
            assert out.startswith("STRESS "), out
        s = d.stats()
        assert (s.leases, s.reservations) == (0, 0)
        assert s.evictions > 0
        dram(d)
        assert d.check() == []
    finally:
        stop_daemon(d)
