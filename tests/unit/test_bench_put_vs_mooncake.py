"""bench/put_vs_mooncake.py on one small size: both systems put and get the same
batches (their bytes checked by the script) and the ratios are reported."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from tests.fleet import MASTER_BIN

from .conftest import run_bench_script


@pytest.mark.skipif(not os.path.exists(MASTER_BIN), reason="mooncake_master is not installed")
@pytest.mark.timeout(120)
def test_one_round_of_64k_compares_kvtier_with_mooncake(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "pvm.json"
    run_bench_script(tmp_path, "put_vs_mooncake.py", "--sizes", "64K", "--rounds", "1",
                     "--json", str(out))
    res = json.loads(out.read_text())
    med = res["sizes"][str(64 << 10)]["median"]
    for k in ("kvtier_put", "kvtier_get", "mooncake_put", "mooncake_get"):
        assert med[k] > 0, k
    assert med["put_x_mooncake"] == pytest.approx(med["kvtier_put"] / med["mooncake_put"])
    assert med["get_x_mooncake"] == pytest.approx(med["kvtier_get"] / med["mooncake_get"])
