"""kvtier.vllm_tpu's worker against a real kvtierd, with a stand-in runner (jax on the CPU).

The engine itself runs in tests/jax_engines/test_vllm_tpu.py (tpu-inference needs Python
3.12); these check what that test cannot isolate: the arrays found by layer name, one
namespace for any mesh, the runner's arrays replaced after a load (the old ones were
donated), the bytes moved exactly, a failed load left to vLLM to recompute, and saves
stored in the background from a snapshot the next step's donation cannot touch.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")
pytest.importorskip("jax", reason="kvtier.vllm_tpu needs kvtier[jax] (make install)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from kvtier._kv_groups import Unsupported  # noqa: E402
from kvtier.hashing import block_keys, request_salt  # noqa: E402
from kvtier.vllm import (  # noqa: E402
    ConnectorConfig,
    KVTierConnector,
    KVTierMetadata,
    LoadSpec,
    _Counters,
    _Scheduler,
    _Throttle,
)
from kvtier.vllm_tpu import TPUOffloadConnector, _JaxWorker  # noqa: E402
from tests.conftest import DaemonProc, start_daemon, stop_daemon  # noqa: E402

BLOCK = 16
PAGES = 12
#: tpu-inference's layout of a 2-KV-head, head_dim-32 float32 layer: [pages, block, 2*2, 1, 32].
SHAPE = (PAGES, BLOCK, 4, 1, 32)


def _configs(tp: int = 1, head_size: int = 32) -> tuple[Any, Any]:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=head_size,
                             dtype=torch.float32)
    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"],
                                                          kv_cache_spec=spec)],
                         num_blocks=PAGES)
    mc = SimpleNamespace(model="/models/llama-tiny", revision=None, dtype="float32",
                         quantization=None, hf_config=SimpleNamespace(to_dict=lambda: {}))
    vc = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto"),
                         attention_config=SimpleNamespace(backend=None),
                         parallel_config=SimpleNamespace(tensor_parallel_size=tp))
    return vc, kv


def _runner(seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    # Layer "l1" first in the runner's list: the worker must go by name, not position.
    arrays = [jnp.asarray(rng.standard_normal(SHAPE, dtype=np.float32)) for _ in range(2)]
    return SimpleNamespace(kv_caches=arrays, layer_name_to_kvcache_index={"l0": 1, "l1": 0})


def _worker(daemon: DaemonProc, tp: int = 1, **extra: Any) -> _JaxWorker:
    vc, kv = _configs(tp)
    cfg = ConnectorConfig.from_extra({"socket_dir": daemon.socket_dir, **extra})
    return _JaxWorker(vc, kv, cfg, _Counters(), _Throttle())


#: Every page of every array set to ``value``, the arrays donated (as a step does).
_overwrite = jax.jit(lambda xs, value: [jnp.full_like(x, value) for x in xs], donate_argnums=0)


def _hold(w: _JaxWorker) -> threading.Event:
    """Keep ``w``'s save thread busy until the returned event is set."""
    go = threading.Event()
    assert w._saver is not None
    w._saver.submit(go.wait, 30)
    return go


def test_blocks_round_trip_by_layer_name_and_the_runner_gets_the_new_arrays(
        daemon: DaemonProc) -> None:
    tokens = list(range(3, 3 + 3 * BLOCK))
    keys = block_keys(tokens, BLOCK, request_salt("", None, None))
    src = _runner(0)
    a = _worker(daemon, tp=4)  # any mesh: the arrays are global, one namespace
    a.register_runner(src)
    assert [io.link.args["namespace"].split("/")[2] for io in a._groups.values()] == ["tp0of1"]
    a.save(KVTierMetadata(save_keys=keys, save_block_ids=[5, 2, 7]))
    a.close()

    dst = _runner(1)
    before = [np.asarray(x).copy() for x in dst.kv_caches]
    old = list(dst.kv_caches)
    b = _worker(daemon)
    b.register_runner(dst)
    b.load(KVTierMetadata(loads=[LoadSpec("r", keys, [1, 9, 4])]))
    assert b.load_errors() == set()
    assert all(x.is_deleted() for x in old), "the loaded arrays were not donated"
    assert all(not x.is_deleted() for x in dst.kv_caches)
    got = [np.asarray(x) for x in dst.kv_caches]
    want = [np.asarray(x) for x in src.kv_caches]
    for layer in range(2):
        for s, d in ((5, 1), (2, 9), (7, 4)):
            assert np.array_equal(got[layer][d], want[layer][s])
        untouched = [p for p in range(PAGES) if p not in (1, 9, 4)]
        assert np.array_equal(got[layer][untouched], before[layer][untouched])
    b.close()


def test_the_scheduler_of_the_tpu_connector_looks_up_one_namespace(daemon: DaemonProc) -> None:
    vc, kv = _configs(tp=4)
    cfg = ConnectorConfig.from_extra({"socket_dir": daemon.socket_dir})
    sched = _Scheduler(vc, kv, cfg, _Counters(), _Throttle(), tp_size=1)
    torch_like = _Scheduler(vc, kv, cfg, _Counters(), _Throttle())
    try:
        assert [link.args["namespace"].split("/")[2] for link in sched._links] == ["tp0of1"]
        assert len(torch_like._links) == 4  # the torch connector: one namespace per rank
        w = _worker(daemon, tp=4)
        w.register_runner(_runner())
        assert sched._links[0].args == w._links[0].args
        w.close()
    finally:
        sched.close()
        torch_like.close()


def test_a_failed_load_is_left_to_vllm_and_the_runner_keeps_valid_arrays(
        workdir: str) -> None:
    keys = block_keys(list(range(3, 3 + 2 * BLOCK)), BLOCK, request_salt("", None, None))
    runner = _runner()
    before = [np.asarray(x).copy() for x in runner.kv_caches]
    daemon = start_daemon(workdir)
    try:
        w = _worker(daemon)
        w.register_runner(runner)
        daemon.kill()  # SIGKILL between the lookup and the load
        w.load(KVTierMetadata(loads=[LoadSpec("r", keys, [3, 4])]))
        assert w.load_errors() == {3, 4}  # vLLM recomputes them
        assert [np.asarray(x).tobytes() for x in runner.kv_caches] == \
            [b.tobytes() for b in before]
        w.save(KVTierMetadata(save_keys=keys, save_block_ids=[3, 4]))  # lost, never raised
        w.close()
    finally:
        stop_daemon(daemon)


def test_arrays_that_do_not_match_the_spec_turn_the_connector_off(daemon: DaemonProc) -> None:
    vc, kv = _configs(head_size=64)  # the spec's pages are twice the arrays'
    w = _JaxWorker(vc, kv, ConnectorConfig.from_extra({"socket_dir": daemon.socket_dir}),
                   _Counters(), _Throttle())
    with pytest.raises(Unsupported, match="KV cache spec says"):
        w.register_runner(_runner())
    with pytest.raises(Unsupported, match="layers"):
        _worker(daemon).register_runner(SimpleNamespace(
            kv_caches=_runner().kv_caches, layer_name_to_kvcache_index={"x": 0, "y": 1}))
    with pytest.raises(Unsupported, match="jax.Array"):
        _worker(daemon).register_runner(SimpleNamespace(kv_caches=[]))
    split = _runner()
    split.dp_size = 2
    with pytest.raises(Unsupported, match="data-parallel"):
        _worker(daemon).register_runner(split)


def test_a_save_leaves_the_step_with_a_snapshot_the_next_step_cannot_touch(
        daemon: DaemonProc) -> None:
    """Saves run in the background (the step only starts the device-to-host copy of the
    blocks): what is stored is the blocks as the step left them, though the next step
    donates and overwrites every array before the save thread writes a byte; settle()
    waits for it; the save holds no vLLM block (settling for reused blocks waits for
    nothing)."""
    tokens = list(range(3, 3 + 3 * BLOCK))
    keys = block_keys(tokens, BLOCK, request_salt("", None, None))
    src = _runner(0)
    want = [np.asarray(x).copy() for x in src.kv_caches]
    w = _worker(daemon, async_save=True)
    w.register_runner(src)
    go = _hold(w)
    w.save(KVTierMetadata(save_keys=keys, save_block_ids=[5, 2, 7]))
    assert [blocks for _, blocks in w._pending] == [frozenset()]
    src.kv_caches = _overwrite(src.kv_caches, 0.0)  # the next step, before the save ran
    w.settle({5, 2, 7})  # the blocks handed out again: nothing to wait for
    assert w._pending and "saved_blocks" not in w._counters.take()
    go.set()
    w.settle()
    assert w._pending == []
    counters = w._counters.take()
    assert counters["saved_blocks"] == 3 and "failures_other" not in counters
    w.close()

    dst = _runner(1)
    b = _worker(daemon)
    b.register_runner(dst)
    b.load(KVTierMetadata(loads=[LoadSpec("r", keys, [1, 9, 4])]))
    assert b.load_errors() == set()
    got = [np.asarray(x) for x in dst.kv_caches]
    for layer in range(2):
        for s, d in ((5, 1), (2, 9), (7, 4)):
            assert np.array_equal(got[layer][d], want[layer][s])
    b.close()


def test_a_background_save_that_fails_is_a_later_miss(workdir: str) -> None:
    keys = block_keys(list(range(3, 3 + 2 * BLOCK)), BLOCK, request_salt("", None, None))
    daemon = start_daemon(workdir)
    try:
        w = _worker(daemon, async_save=True)
        w.register_runner(_runner())
        go = _hold(w)
        w.save(KVTierMetadata(save_keys=keys, save_block_ids=[3, 4]))
        daemon.kill()  # SIGKILL under the save
        go.set()
        w.close()  # settles: never raises
        counters = w._counters.take()
        assert counters.get("failures_unavailable", 0) >= 1
        assert "saved_blocks" not in counters
    finally:
        stop_daemon(daemon)


@pytest.mark.parametrize(("role", "background"), [
    ("kv_both", True), ("kv_producer", False), ("kv_consumer", False)])
def test_only_a_producer_saves_in_the_step(role: str, background: bool) -> None:
    """A producer's answer waits for its blocks (P/D: the consumer asks for them the
    moment it arrives); other roles save off the step whatever async_save says."""
    cfg = ConnectorConfig.from_extra({})
    assert TPUOffloadConnector._role_policy(role, cfg).async_save is background
    assert KVTierConnector._role_policy(role, cfg).async_save is False  # torch: async_save's
