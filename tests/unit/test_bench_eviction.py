"""bench/eviction_policy.py on a small trace: the study runs and reports sane figures."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from kvtierd import block_table

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not block_table.AVAILABLE, reason="kvtier._native is not built")
@pytest.mark.timeout(120)
def test_quick_run_compares_every_policy_with_exact_lru(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "eviction.json"
    path = os.pathsep.join(filter(None, [str(ROOT / "client"), str(ROOT / "daemon"),
                                         os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, str(ROOT / "bench" / "eviction_policy.py"), "--requests", "1500",
           "--users", "500", "--sizes", "0.1,0.5", "--cost-slots", "4k", "--cost-rounds", "50",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, check=False,
                          env={**os.environ, "PYTHONPATH": path}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["trace"]["requests"] == 1500 and res["trace"]["distinct"] > 0
    exact, *native = res["hit_ratio"]
    assert exact["policy"] == "exact LRU"
    small, large = exact["hit_ratio"]
    assert 0 < small < large <= 1  # a bigger cache hits more
    assert len(native) == 7
    for row in native:
        # approximations: not better than exact LRU by much, not far worse
        assert all(-10 < d < 2 for d in row["minus_exact_points"]), row
    assert len(res["cost"]) == 7
    for row in res["cost"]:
        assert row["slots"] == 4096 and row["ns_per_victim"] > 0
        assert row["native_bytes_per_slot"] <= 16
