"""``kvtier bench``: one quick real run (no Redis) and the pure helpers.

Performance targets are not asserted here (the machine is shared and noisy):
the run only has to produce sane, positive numbers; docs/benchmarks.md holds
the measured ones.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kvtier import bench
from kvtierd.segments import SegmentLayout


def test_quick_run_reports_positive_throughputs_and_latencies(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "--quick", "--no-redis", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Throughput" in proc.stdout and "Latency" in proc.stdout

    res = json.loads(out.read_text())
    (block,) = res["config"]["sizes"]
    assert res["redis"]["available"] is False

    (mc,) = res["memcpy"]
    assert mc["block_bytes"] == block
    assert mc["bytes_per_s"] > 0 and mc["best_bytes_per_s"] >= mc["bytes_per_s"]
    assert mc["copy_into_bytes_per_s"] > 0 and mc["one_block_bytes_per_s"] > 0

    rows = res["throughput"]
    assert {(r["backend"], r["op"], r["clients"]) for r in rows} == {
        ("kvtier", "put", 1), ("kvtier", "put", 2), ("kvtier", "get", 1), ("kvtier", "get", 2)
    }
    for r in rows:
        assert r["block_bytes"] == block
        assert r["iters"] >= 2 and r["bytes"] == r["iters"] * r["batch"] * block
        assert r["bytes_per_s"] > 0 and r["x_memcpy"] > 0
        assert r["x_redis"] is None
        assert len(r["per_client"]) == r["clients"]
        assert all(v >= 0 for v in r["phase_ms_per_batch"].values())
        assert r["batch_ms_p99"] >= r["batch_ms_p50"] > 0

    floor = res["floor"]
    assert floor["p99_s"] >= floor["p50_s"] > 0
    lat = {r["name"]: r for r in res["latency"]}
    assert {"empty", "lookup", "acquire_release"} <= lat.keys()
    for r in lat.values():
        assert r["n"] == res["config"]["latency_samples"]
        assert r["p99_s"] >= r["p50_s"] > 0
        assert r["p50_x_floor"] > 0 and r["p99_x_floor"] > 0
    assert lat["empty"]["p50_x_floor"] == pytest.approx(1.0)

    lookup_target = [t for t in res["targets"] if t["name"].startswith("lookup")]
    assert lookup_target and lookup_target[0]["value"] > 0
    assert res["daemon"]["own"] is True and res["daemon"]["evictions"] == 0
    assert not os.path.exists(res["daemon"]["shm_dir"])  # removed at the end


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    rng = np.random.default_rng(7)
    values = list(rng.exponential(1e-3, size=517))
    assert bench.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges() -> None:
    assert bench.percentile([3.0], 50) == 3.0
    assert bench.percentile([3.0], 99) == 3.0
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # order does not matter
    assert bench.percentile([1.0, 2.0], 0) == 1.0
    assert bench.percentile([1.0, 2.0], 100) == 2.0
    with pytest.raises(ValueError):
        bench.percentile([], 50)
    with pytest.raises(ValueError):
        bench.percentile([1.0], 101)


def test_summarize_orders_its_percentiles() -> None:
    s = bench.summarize([0.5, 0.1, 0.3, 0.2, 10.0])
    assert s["n"] == 5
    assert s["min_s"] <= s["p50_s"] <= s["p99_s"] <= s["max_s"]
    assert s["p50_s"] == 0.3
    assert s["mean_s"] == pytest.approx(2.22)


def test_ratio() -> None:
    assert bench.ratio(3.0, 2.0) == 1.5
    assert bench.ratio(0.0, 2.0) == 0.0
    assert bench.ratio(1.0, 0.0) is None
    assert bench.ratio(1.0, -1.0) is None
    assert bench.ratio(None, 2.0) is None
    assert bench.ratio(1.0, None) is None
    assert bench.ratio(float("nan"), 1.0) is None


def test_sizes_parse_as_the_config_does() -> None:
    assert [bench.positive_size(s) for s in ("64KiB", "512KiB", "2MiB", "8MiB", "2M", "64K",
                                             "4096")] == [
        64 << 10, 512 << 10, 2 << 20, 8 << 20, 2 << 20, 64 << 10, 4096
    ]
    for bad in ("", "2 XB", "-1MiB", "0", "64k"):
        with pytest.raises(ValueError):
            bench.positive_size(bad)


@pytest.mark.parametrize("block", [4096, 64 << 10, 512 << 10, 2 << 20, 8 << 20, (8 << 20) + 1])
@pytest.mark.parametrize("extent", [32 << 20, 256 << 20])
def test_slots_per_extent_matches_the_daemon_layout(block: int, extent: int) -> None:
    layout = SegmentLayout.fit(block, extent)
    assert layout is not None
    assert bench.slots_per_extent(block, extent) == layout.n_slots


def test_capacity_covers_every_namespace() -> None:
    sizes = [64 << 10, 2 << 20, 8 << 20]
    extent = 256 << 20
    cap = bench.capacity_for(sizes, 64, extent)
    need = sum(-(-64 // SegmentLayout.fit(s, extent).n_slots) * extent  # type: ignore[union-attr]
               for s in sizes)
    assert need + extent == cap
