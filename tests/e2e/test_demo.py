"""``kvtier demo`` at its tiny size: every path reproduces the cold logits, and it fails loudly.

The demo runs in a subprocess as users run it (``python -m kvtier.cli demo``),
with a private kvtierd of its own.  No timing is asserted: only that the
prefix came from the tier each path is about and that the logits match.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

#: What these tests check does not depend on the client transport (the adapters,
#: the tools and the daemon's own interfaces); they run once, on the default (fast).
pytestmark = pytest.mark.one_transport

pytest.importorskip("jax")
pytest.importorskip("rich")

#: Where the demo puts its temp directories (sockets/logs, shared memory, SSD tier).
LEFTOVERS = ("/tmp/kvtier-demo-*", "/dev/shm/kvtier-demo-*", "/var/tmp/kvtier-demo-*")


def _leftovers() -> set[str]:
    return {p for pattern in LEFTOVERS for p in glob.glob(pattern)}


def _cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "kvtier.cli", "demo", "--tiny", "--json", *extra]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}


def run_demo(*extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    before = _leftovers()
    out = subprocess.run(_cmd(*extra), capture_output=True, text=True, timeout=180, env=_env())
    assert _leftovers() - before == set(), "the demo left temp directories behind"
    try:
        result: dict[str, Any] = json.loads(out.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"no JSON on stdout (exit {out.returncode}):\n{out.stdout}\n"
                             f"{out.stderr}") from None
    return out, result


def test_every_path_reproduces_the_cold_logits() -> None:
    out, res = run_demo()
    assert out.returncode == 0, out.stderr
    assert res["ok"] and res["failures"] == []
    tol = res["tolerance"]
    assert (tol["atol"], tol["rtol"], tol["dtype"]) == (1e-4, 1e-4, "float32")
    paths = {p["key"]: p for p in res["paths"]}
    assert list(paths) == ["cold", "dram", "restart", "ssd"]
    n, pt = res["prompt_tokens"], res["page_tokens"]
    usable = (n - 1) // pt  # the last token is always prefilled
    cold = paths["cold"]
    assert (cold["load_tokens"], cold["prefill_tokens"]) == (0, n)
    expect_tier = {"dram": "DRAM", "restart": "DRAM", "ssd": "SSD"}
    for key, tier in expect_tier.items():
        p = paths[key]
        assert p["allclose"], p
        assert p["max_abs_diff"] <= tol["atol"], p
        assert p["next_token"] == cold["next_token"]
        assert (p["load_tokens"], p["prefill_tokens"]) == (usable * pt, n - usable * pt), p
        # The whole prefix was found on the tier the path is about.
        assert p["tiers"] == [tier] * usable, p
    assert res["daemon"]["warm_restart"]["warm_start"] is True
    assert res["daemon"]["warm_restart"]["recovered_blocks"] >= usable
    assert res["daemon"]["ssd"]["demotions"] >= usable
    assert res["daemon"]["ssd"]["promotions"] >= usable
    assert "every path reproduced the cold path's logits" in out.stderr


def test_a_corrupted_block_fails_the_demo_loudly() -> None:
    # A stored page is replaced by a perturbed copy after the cold run: the daemon serves
    # it faithfully, so only the demo's logits comparison can catch it.
    out, res = run_demo("--corrupt-for-test")
    assert out.returncode == 1, out.stderr
    assert not res["ok"]
    hits = [p for p in res["paths"] if p["key"] != "cold"]
    assert len(hits) == 3 and not any(p["allclose"] for p in hits)
    assert all(p["max_abs_diff"] > res["tolerance"]["atol"] for p in hits)
    assert len(res["failures"]) == 3
    assert all("logits differ from the cold path" in f for f in res["failures"])
    assert "FAILED" in out.stderr and "logits differ" in out.stderr


def test_ctrl_c_stops_the_daemon_and_removes_everything() -> None:
    before = _leftovers()
    # SIGINT at its default in the child, as from a terminal (a test run started in the
    # background by a non-interactive shell inherits it ignored, and Python keeps it so).
    proc = subprocess.Popen(_cmd(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # Wait until the first fresh process runs: the daemon is up, a worker is alive.
        deadline = time.monotonic() + 120
        workers: list[str] = []
        while not workers:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the demo never started its first hit path"
            workers = [w for w in glob.glob("/tmp/kvtier-demo-*/worker-dram.stderr")
                       if os.path.dirname(w) not in before]  # ours, not another run's
            time.sleep(0.05)
        base = os.path.dirname(workers[0])
        locks = [p for p in glob.glob("/dev/shm/kvtier-demo-*/kvtierd.lock")
                 if os.path.dirname(p) not in before]
        assert len(locks) == 1, locks
        pids = [int(open(p).read().split()[0]) for p in locks]
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not os.path.exists(base)
    assert _leftovers() - before == set()
    for pid in pids:  # the daemon is gone (not merely orphaned)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
