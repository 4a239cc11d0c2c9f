"""bench/ssd_index_scale.py on a few thousand entries: it runs and reports sane figures."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_quick_run_adopts_every_entry_and_reports_memory(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "ssd.json"
    path = os.pathsep.join(filter(None, [str(ROOT / "client"), str(ROOT / "daemon"),
                                         os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, str(ROOT / "bench" / "ssd_index_scale.py"), "--entries", "3k",
           "--per-file", "2k", "--impl", "after", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, check=False,
                          env={**os.environ, "PYTHONPATH": path}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (row,) = json.loads(out.read_text())
    assert row["entries"] == 3 * 1024 and row["mirror_per_entry"] >= 256
    assert row["adopt_s"] > 0 and row["held_4096_p50_ms"] > 0
    assert row["held_many_4096_p50_ms"] > 0 and row["find_many_4096_p50_ms"] > 0
    assert row["locate_4096_p50_ms"] > 0 and row["walk_4096_p50_ms"] > 0
