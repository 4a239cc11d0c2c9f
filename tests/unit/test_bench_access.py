"""``bench/access.py`` (access control on vs off): one quick real run.

The 5% target is not asserted here (the machine is shared and noisy; a quick
run's ratios mean little): the run only has to start both daemons, prove the
policy is in force on one of them, produce positive numbers for both and a
ratio per metric, and clean up.  docs/benchmarks.md holds the measured ones.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_quick_run_measures_both_configurations_and_their_ratios(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "access.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    cmd = [sys.executable, str(ROOT / "bench" / "access.py"), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=55, env=env, check=False,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "ON/OFF per metric" in proc.stdout

    res = json.loads(out.read_text())
    on, off = res["daemons"]["on"], res["daemons"]["off"]
    assert on["access"]["enabled"] is True and len(on["access"]["namespaces"]) == 8
    assert on["access"]["namespaces"][-1]["match"] == "bench-*"
    assert off["access"]["enabled"] is False
    assert on["limits"] == off["limits"]

    rounds = res["rounds"]
    assert len(rounds) == res["config"]["rounds"] >= 2
    assert [r["started_first"] for r in rounds[:2]] == ["on", "off"]
    for rd in rounds:
        assert rd["probe"] == {"on": "PermissionDenied", "off": "ok"}
        assert len(rd["throughput"]) == 2 * len(res["config"]["sizes"])
        for fig in rd["throughput"].values():
            for name in ("on", "off"):
                assert fig[name]["iters"] >= 2 and fig[name]["bytes_per_s"] > 0
            assert fig["on"]["iters"] == fig["off"]["iters"] == fig["pairs"]  # ABBA batches
            assert fig["pairs"] % 2 == 0
        for name in ("on", "off"):
            lookup = rd["latency"][name]["lookup"]
            assert lookup["n"] == res["config"]["latency_samples"]
            assert lookup["p99_s"] >= lookup["p50_s"] > 0
        for name in ("on", "off"):
            assert rd["daemons"][name]["evictions"] == 0
            assert not os.path.exists(rd["daemons"][name]["shm_dir"])  # removed at the end

    metrics = {m["name"]: m for m in res["metrics"]}
    judged = [m for m in metrics.values() if m["judged"]]
    assert len(judged) == 2 * len(res["config"]["sizes"]) + 2  # put/get per size, lookup p50/p99
    for m in metrics.values():
        assert len(m["ratios"]) == len(rounds)
        assert m["ratio_median"] > 0 and m["ratio_min"] <= m["ratio_median"] <= m["ratio_max"]
        assert m["met"] in ((True, False) if m["judged"] else (None,))
    assert res["machine"]["loadavg_at_start"] and res["machine"]["loadavg_at_end"]
