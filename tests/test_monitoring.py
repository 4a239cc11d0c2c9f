"""deploy/: the alerting rules (promtool-checked, every alert unit-tested) and the Grafana
dashboard (schema-checked); every metric either uses is one kvtierd exports.

``promtool`` comes from Debian's prometheus package (.ci/run installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvtierd.metrics import Metrics
from tests.conftest import DaemonProc, start_daemon, stop_daemon

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed "
                                    "(apt-get install prometheus; .ci/run does)")


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    out = subprocess.run([str(PROMTOOL), "check", "rules", "alerts.yaml"], cwd=RULES,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    rules = sum(len(g["rules"]) for g in yaml.safe_load((RULES / "alerts.yaml").read_text())["groups"])
    assert rules >= 8 and f"SUCCESS: {rules} rules found" in out.stdout


@needs_promtool
def test_every_alert_fires_in_its_unit_test() -> None:
    out = subprocess.run([str(PROMTOOL), "test", "rules", "alerts_test.yaml"], cwd=RULES,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    rules = yaml.safe_load((RULES / "alerts.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((RULES / "alerts_test.yaml").read_text())
    fired = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]
             if t["exp_alerts"]}
    assert fired == alerts  # no alert without a test that makes it fire


def _exported_names(daemon: DaemonProc) -> set[str]:
    """Every sample name kvtierd can export: a live scrape plus the labelled metrics
    that have no samples until their first event."""
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port()}/metrics",
                                timeout=10) as resp:
        text = resp.read().decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}
    # Families with no sample yet still have a TYPE line in the scrape...
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)  # counters: already "..._total" here
            names.update(name + s for s in suffixes.get(kind, [""]))
    # ...and the labelled metrics registered up front are all in Metrics.
    for family in Metrics(CollectorRegistry()).registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, [""]))
    return names


def test_alerts_use_only_metrics_the_daemon_exports(workdir: str) -> None:
    d = start_daemon(workdir, "--set", f"spill.ssd_dir={workdir}/ssd")  # spill metrics too
    try:
        exported = _exported_names(d) | {"up"}
    finally:
        stop_daemon(d)
    text = (RULES / "alerts.yaml").read_text()
    exprs = [r["expr"] for g in yaml.safe_load(text)["groups"] for r in g["rules"]]
    used = {m for e in exprs for m in re.findall(r"\b(kvtier_[a-z_]+|up)\b", e)}
    assert used and used <= exported, sorted(used - exported)


DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "kvtier.json"


def test_grafana_dashboard_is_well_formed() -> None:
    """Schema check (Grafana's own validator does not install from the registries here)."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "kvtier" and isinstance(dash["schemaVersion"], int)
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for p in dash["panels"]:
        assert p["type"] in ("timeseries", "stat") and p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])


def test_dashboard_uses_only_metrics_the_daemon_exports(workdir: str) -> None:
    d = start_daemon(workdir, "--set", f"spill.ssd_dir={workdir}/ssd")
    try:
        exported = _exported_names(d) | {"up"}
    finally:
        stop_daemon(d)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(kvtier_[a-z_]+|up)\b", e)}
    assert len(used) >= 15 and used <= exported, sorted(used - exported)
