"""bench/ssd_index_scale.py on a few thousand entries: it runs and reports sane figures."""

from __future__ import annotations

import json
import pathlib

import pytest

from .conftest import run_bench_script


@pytest.mark.timeout(120)
def test_quick_run_adopts_every_entry_and_reports_memory(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "ssd.json"
    run_bench_script(tmp_path, "ssd_index_scale.py", "--entries", "3k", "--per-file", "2k",
                     "--impl", "after", "--json", str(out))
    (row,) = json.loads(out.read_text())
    assert row["entries"] == 3 * 1024 and row["mirror_per_entry"] >= 256
    assert row["adopt_s"] > 0 and row["held_4096_p50_ms"] > 0
    assert row["held_many_4096_p50_ms"] > 0 and row["find_many_4096_p50_ms"] > 0
    assert row["locate_4096_p50_ms"] > 0 and row["walk_4096_p50_ms"] > 0
