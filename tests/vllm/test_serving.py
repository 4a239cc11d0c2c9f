"""The serving benchmark's workload, short: two users, two rounds, vLLM's OpenAI server.

``bench/vllm_serving.py`` drives multi-round conversations over HTTP (streaming, token ids
in and out) against a server whose own KV cache holds less than the users' histories.  Here
the same driver runs two users for two rounds against a server without a connector and one
with the kvtier connector and a real kvtierd: the second round must load what the first
saved (vLLM's own prefix cache is off here, see ``_serve``), and every answer must be the
same token for token.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")

from tests.conftest import DaemonProc, start_daemon, stop_daemon  # noqa: E402
from tests.vllm import tinymodel  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 128


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location(
        "vllm_serving", os.path.join(ROOT, "bench", "vllm_serving.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm_serving"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def lab() -> Iterator[dict[str, Any]]:
    base = tempfile.mkdtemp(prefix="kvt-serving-", dir="/tmp")
    daemon: DaemonProc | None = None
    try:
        model = str(tinymodel.build(os.path.join(base, "model")))
        daemon = start_daemon(base, capacity="64MiB", extent="16MiB")
        yield {"base": base, "model": model, "daemon": daemon}
    finally:
        if daemon is not None:
            stop_daemon(daemon)
            shutil.rmtree(daemon.shm_dir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def _serve(vs: Any, lab: dict[str, Any], tag: str, wl: Any, ktc: dict[str, Any] | None
           ) -> dict[str, Any]:
    """Run the workload against a fresh server; per (user, round): token ids, cached tokens."""
    max_len = -(-(wl.max_prompt() + wl.answer_tokens) // BLOCK) * BLOCK
    # The benchmark's engines hold a quarter of the users' KV, so vLLM's own prefix cache
    # has lost a user's history by its next round.  Two users cannot do that to each other
    # in an engine that must fit one whole conversation, so here vLLM's prefix cache is off:
    # every block of the second round that is not computed comes from kvtier.
    server = vs.Server(lab["base"], tag, lab["model"], max_model_len=max_len,
                       engine_blocks=max_len // BLOCK + 1, ktc=ktc, dtype="float32",
                       start_timeout=240, prefix_caching=False)
    try:
        before = vs.scrape(server.port)
        run = asyncio.run(vs.run_conversations(server.url, "m", wl, rate=50.0, timeout=240))
        after = vs.scrape(server.port)
        with open(server.log_path, errors="replace") as f:
            log = f.read()  # before the shutdown, which logs the engine core's exit
    finally:
        server.stop()
    assert "Traceback" not in log, log[-4000:]
    assert all(r["error"] is None for r in run["records"]), [r["error"] for r in run["records"]]
    metrics = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {"out": {(r["user"], r["round"]): r["token_ids"] for r in run["records"]},
            "cached": {(r["user"], r["round"]):
                       (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                       for r in run["records"]},
            "metrics": metrics, "log": log}


def test_two_users_two_rounds_load_their_history_and_answer_as_without_kvtier(
        lab: dict[str, Any]) -> None:
    vs = _bench()
    wl = vs.Workload(users=2, rounds=2, system_tokens=256, message_tokens=512, answer_tokens=8,
                     vocab=1000, seed=3)
    plain = _serve(vs, lab, "none", wl, None)
    ktc = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm",
           "kv_role": "kv_both",
           "kv_connector_extra_config": {"socket_dir": lab["daemon"].socket_dir}}
    kv = _serve(vs, lab, "kvtier", wl, ktc)
    assert kv["out"] == plain["out"]
    assert all(len(t) == wl.answer_tokens for t in kv["out"].values())
    m = kv["metrics"]
    assert all(n == 0 for n in plain["cached"].values()), plain["cached"]
    # First round: the second user loads the shared system prompt the first one saved (when
    # the two were not prefilled in the same step).  Second round: each user's whole first
    # prompt (6 blocks) comes back from kvtier.
    history = (256 + 512) // BLOCK * BLOCK
    assert kv["cached"][(0, 0)] == 0
    assert all(kv["cached"][(u, 1)] >= history for u in range(wl.users)), kv["cached"]
    hits = m.get("vllm:external_prefix_cache_hits_total", 0)
    assert hits == sum(kv["cached"].values()) >= 2 * history, (m, kv["cached"])
    assert m.get("vllm:kvtier_loaded_blocks_total", 0) == hits // BLOCK, m
    assert m.get("vllm:kvtier_failed_blocks_total", 0) == 0, m
    assert lab["daemon"].check() == []
