"""``kvtier config --check FILE``: validate a daemon config without starting one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtier.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_check_ok(capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)
    for path in (ROOT / "config" / "kvtier.yaml", ROOT / "config" / "production.yaml"):
        assert main(["config", "--check", str(path)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"{path}: OK")
    assert main(["config", "--check", str(ROOT / "config" / "production.yaml"), "--json"]) == 0
    effective = json.loads(capsys.readouterr().out)
    assert effective["dram"]["capacity"] == "64GiB"
    assert effective["spill"]["ssd_dir"] == "/var/lib/kvtier/spill"


def test_a_bad_config_exits_2_naming_the_key(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("spill:\n  ssd_capasity: 1TiB\n")
    assert main(["config", "--check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'spill.ssd_capasity'" in err and "ssd_capacity" in err
    bad.write_text("spill:\n  clean_ahead: 2\n")
    assert main(["config", "--check", str(bad)]) == 2
    assert "spill.clean_ahead: expected a number in 0..0.9, got 2" in capsys.readouterr().err
    assert main(["config", "--check", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
