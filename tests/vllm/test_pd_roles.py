"""The connector's P/D roles on the scheduler side, against a real kvtierd (no engine).

A consumer holds a request (vLLM's ``None``: ask again next step) while its kvtierd shows
fewer blocks than the producer announced, for at most ``producer_wait``; never when
kvtierd cannot be asked (waiting would only delay the recompute) nor without an
announcement; a producer's ``request_finished`` announces the prompt blocks kvtier holds.
The roles with real engines are tests/vllm/test_pd.py.
"""

from __future__ import annotations

import dataclasses
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")

from kvtier._vllm_roles import Role, Waits  # noqa: E402
from kvtier.hashing import block_keys  # noqa: E402
from kvtier.vllm import KVTierConnector, request_salt  # noqa: E402
from tests.conftest import DaemonProc  # noqa: E402
from tests.vllm.test_connector import BLOCK, FakeRequest, _scheduler, _store  # noqa: E402


@dataclasses.dataclass
class PDRequest(FakeRequest):
    kv_transfer_params: dict[str, Any] | None = None


def _tokens(blocks: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i) % 900 for i in range(blocks * BLOCK + 5)]


def _consumer(sched: Any, wait: float, idle: bool = False) -> Any:
    return SimpleNamespace(_scheduler=sched, _waits=Waits(wait), _idle=idle)


def matched(conn: Any, req: PDRequest) -> tuple[int | None, bool]:
    return KVTierConnector.get_num_new_matched_tokens(conn, req, 0)  # type: ignore[arg-type]


def test_a_consumer_waits_for_announced_blocks_then_loads_them(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Waits, "RECHECK", 0.5)  # (a slow machine must not look up twice)
    sched, counters = _scheduler(daemon, tp=1)
    tokens = _tokens(4, 1)
    keys = block_keys(tokens, BLOCK, request_salt("", None, None))
    _store(daemon, sched, 0, keys[:1])
    conn = _consumer(sched, 5.0)
    req = PDRequest("r1", tokens, kv_transfer_params={"kvtier": {"blocks": 4}})
    assert matched(conn, req) == (None, False)  # 1 of 4: held
    assert matched(conn, req) == (None, False)  # asked again at once: no new lookup
    lookups = counters.take()["lookups"]
    assert lookups == 1
    _store(daemon, sched, 0, keys[1:])
    time.sleep(0.5)
    assert matched(conn, req) == (4 * BLOCK, False)  # all there: loaded, none recomputed
    sched.close()


def test_an_idle_consumer_waits_for_its_next_lookup_instead_of_spinning(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Waits, "RECHECK", 0.2)
    sched, counters = _scheduler(daemon, tp=1)
    tokens = _tokens(3, 6)
    keys = block_keys(tokens, BLOCK, request_salt("", None, None))
    _store(daemon, sched, 0, keys[:1])
    busy, idle = _consumer(sched, 5.0), _consumer(sched, 5.0, idle=True)
    req = PDRequest("r6", tokens, kv_transfer_params={"kvtier": {"blocks": 3}})
    assert matched(busy, req) == (None, False)  # held
    t0 = time.monotonic()
    assert matched(busy, req) == (None, False)  # other requests run: back at once
    assert time.monotonic() - t0 < 0.1
    _store(daemon, sched, 0, keys[1:])
    idle._waits = busy._waits
    t0 = time.monotonic()
    # Nothing else runs: the call waits for the lookup that was due and takes the blocks.
    assert matched(idle, req) == (3 * BLOCK, False)
    assert 0.05 < time.monotonic() - t0 < 1.5
    got = counters.take()
    assert got["lookups"] == 2
    assert got["wait_seconds"] >= 0.1  # from the first hold to the lookup that found them
    sched.close()


def test_a_consumer_recomputes_what_has_not_come_within_producer_wait(
        daemon: DaemonProc) -> None:
    sched, _ = _scheduler(daemon, tp=1)
    tokens = _tokens(3, 2)
    keys = block_keys(tokens, BLOCK, request_salt("", None, None))
    _store(daemon, sched, 0, keys[:2])
    conn = _consumer(sched, 0.2)
    req = PDRequest("r2", tokens, kv_transfer_params={"kvtier": {"blocks": 3}})
    t0 = time.monotonic()
    while (got := matched(conn, req)) == (None, False):
        assert time.monotonic() - t0 < 2
        time.sleep(0.01)
    assert got == (2 * BLOCK, False)
    assert time.monotonic() - t0 >= 0.2
    # Without an announcement (or a garbage one) a request is never held.
    for params in (None, {"kvtier": {"blocks": "3"}}, {"other": 1}):
        assert matched(conn, PDRequest(f"n{params!r}", _tokens(3, 3),
                                       kv_transfer_params=params)) == (0, False)
    sched.close()


def test_a_consumer_does_not_wait_when_kvtierd_cannot_be_asked(tmp_path: Any) -> None:
    nowhere = SimpleNamespace(socket_dir=os.path.join(str(tmp_path), "no-daemon"))
    sched, counters = _scheduler(nowhere, tp=1)  # type: ignore[arg-type]
    conn = _consumer(sched, 5.0)
    req = PDRequest("r3", _tokens(3, 4), kv_transfer_params={"kvtier": {"blocks": 3}})
    t0 = time.monotonic()
    assert matched(conn, req) == (0, False)
    assert time.monotonic() - t0 < 1
    assert counters.take().get("failures_unavailable", 0) >= 1
    sched.close()


def test_a_producer_announces_the_prompt_blocks_kvtier_holds(daemon: DaemonProc) -> None:
    sched, _ = _scheduler(daemon, tp=1)
    tokens = _tokens(5, 5)  # 5 full blocks and 5 tokens
    keys = block_keys(tokens, BLOCK, request_salt("", None, None))
    _store(daemon, sched, 0, keys)
    role = Role.of("kv_producer", save=True, load=True, async_save=False)
    conn = SimpleNamespace(_scheduler=sched, _waits=None, _kv_role=role)
    req = PDRequest("r4", tokens)
    sched.matched(req, 0)  # type: ignore[arg-type]
    out = KVTierConnector.request_finished(conn, req, [])  # type: ignore[arg-type]
    assert out == (False, {"kvtier": {"blocks": 5}})
    both = SimpleNamespace(_scheduler=sched, _waits=None,
                           _kv_role=Role.of("kv_both", save=True, load=True, async_save=False))
    sched.matched(req, 0)  # type: ignore[arg-type]
    assert KVTierConnector.request_finished(both, req, []) == (False, None)  # type: ignore[arg-type]
    sched.close()
