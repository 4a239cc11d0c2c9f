"""kvtier.vllm_tpu's worker against a real kvtierd, with a stand-in runner (jax on the CPU).

The engine itself runs in tests/jax_engines/test_vllm_tpu.py (tpu-inference needs Python
3.12); these check what that test cannot isolate: the arrays found by layer name, one
namespace for any mesh, the runner's arrays replaced after a load (the old ones were
donated), the bytes moved exactly, a failed load left to vLLM to recompute, saves
stored in the background from a snapshot the next step's donation cannot touch, and
background loads read off the step and written into the arrays by a later one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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

import kvtier  # noqa: E402
from kvtier import jax as kj  # noqa: E402
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
from tests.conftest import DaemonProc, scribble, start_daemon, stop_daemon  # noqa: E402

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


#: A step: the arrays donated, their successors (the same bytes) handed back.
_step = jax.jit(lambda xs: list(xs), donate_argnums=0)


def _bytes(runner: Any) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in runner.kv_caches]


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


KEYS = block_keys(list(range(3, 3 + 3 * BLOCK)), BLOCK, request_salt("", None, None))


def _saved(daemon: DaemonProc) -> list[np.ndarray]:
    """KEYS stored from pages 5, 2, 7 of a runner; its arrays' bytes."""
    src = _runner(0)
    w = _worker(daemon)
    w.register_runner(src)
    w.save(KVTierMetadata(save_keys=KEYS, save_block_ids=[5, 2, 7]))
    w.close()
    return [np.asarray(x).copy() for x in src.kv_caches]


def _loading(daemon: DaemonProc, **extra: Any) -> tuple[_JaxWorker, Any, threading.Event]:
    """A worker of load_mode async on a fresh runner, its load thread held (set the event):
    the loads handed to it wait."""
    w = _worker(daemon, load_mode="async", **extra)
    runner = _runner(1)
    w.register_runner(runner)
    assert w._loader is not None
    go = threading.Event()
    w._loader.submit(go.wait, 30)
    return w, runner, go


def _reported(w: _JaxWorker, runner: Any, req_id: str) -> tuple[set[str], set[int]]:
    """Steps (each donating the runner's arrays) until finished_loads() names ``req_id``:
    every request it named on the way and every load error."""
    done: set[str] = set()
    errors: set[int] = set()
    for _ in range(3000):
        runner.kv_caches = _step(runner.kv_caches)
        done |= w.finished_loads()
        errors |= w.load_errors()
        if req_id in done:
            return done, errors
        threading.Event().wait(0.01)
    raise AssertionError(f"{req_id} was never reported loaded")


def test_a_background_load_is_read_off_the_step_and_written_in_by_a_later_one(
        daemon: DaemonProc) -> None:
    """load_mode async: load() hands the request to the load thread and returns; the thread
    reads the blocks out of kvtier without touching the runner's arrays (the steps go on
    donating them); the first finished_loads() after it writes them into the arrays the
    runner holds then (the old ones donated) and names the request, once.  While the
    runner holds arrays a step donated (tpu-inference's fused decode loop reports before
    it assigns their successors), the request waits for the next step."""
    want = _saved(daemon)
    w, runner, go = _loading(daemon)
    before = _bytes(runner)
    w.load(KVTierMetadata(loads=[LoadSpec("r", KEYS, [1, 9, 4])]))
    assert w.finished_loads() == set() and w.load_errors() == set()
    runner.kv_caches = _step(runner.kv_caches)  # a step while the load waits
    go.set()
    w._loading["r"].result(timeout=30)  # read: the blocks wait for the engine's thread
    assert [len(staged) for _, _, staged in w._staged["r"]] == [3]
    assert _bytes(runner) == before
    successors = _step(runner.kv_caches)  # the runner still holds the donated arrays
    assert w.finished_loads() == set()
    runner.kv_caches = successors
    old = list(runner.kv_caches)
    assert w.finished_loads() == {"r"}
    assert w.load_errors() == set() and w.finished_loads() == set() and w._staged == {}
    assert all(x.is_deleted() for x in old), "the loaded arrays were not donated"
    got = [np.asarray(x) for x in runner.kv_caches]
    untouched = [p for p in range(PAGES) if p not in (1, 9, 4)]
    for layer in range(2):
        for s, d in ((5, 1), (2, 9), (7, 4)):
            assert np.array_equal(got[layer][d], want[layer][s])
        assert got[layer][untouched].tobytes() == \
            np.frombuffer(before[layer], np.float32).reshape(SHAPE)[untouched].tobytes()
    counters = w._counters.take()
    assert counters["loaded_blocks"] == 3 and "failed_blocks" not in counters
    assert w._loaded_async  # the background path ran (and said so in the log)
    w.close()
    assert daemon.check() == []


def _tamper_gone(daemon: DaemonProc, w: _JaxWorker) -> None:
    with kvtier.Client(daemon.socket_dir, **w._links[0].args) as c:
        assert c.delete([KEYS[1]]) == 1


def _tamper_corrupted(daemon: DaemonProc, w: _JaxWorker) -> None:
    with kvtier.Client(daemon.socket_dir, **w._links[0].args) as c:
        scribble(c, KEYS[1])


@pytest.mark.parametrize(("tamper", "failure"), [(_tamper_gone, "failures_evicted"),
                                                 (_tamper_corrupted, "failures_corrupted")])
def test_a_background_load_that_finds_a_block_gone_or_corrupted_reports_it_and_the_rest(
        daemon: DaemonProc, tamper: Callable[[DaemonProc, _JaxWorker], None],
        failure: str) -> None:
    """The second of three blocks deleted or scribbled over after the lookup: the first
    block loads, the second and third are reported failed (vLLM recomputes them) with the
    request, and their pages keep their bytes -- never a wrong block."""
    want = _saved(daemon)
    w, runner, go = _loading(daemon)
    before = [np.asarray(x).copy() for x in runner.kv_caches]
    w.load(KVTierMetadata(loads=[LoadSpec("r", KEYS, [1, 9, 4])]))
    tamper(daemon, w)
    go.set()
    done, errors = _reported(w, runner, "r")
    assert done == {"r"} and errors == {9, 4}
    got = [np.asarray(x) for x in runner.kv_caches]
    for layer in range(2):
        assert np.array_equal(got[layer][1], want[layer][5])
        assert np.array_equal(got[layer][[9, 4]], before[layer][[9, 4]])
    counters = w._counters.take()
    assert (counters["loaded_blocks"], counters["failed_blocks"], counters[failure]) == (1, 2, 1)
    w.close()
    assert daemon.check() == []


def test_a_background_load_whose_daemon_is_killed_reports_every_block_failed(
        workdir: str) -> None:
    """kvtierd SIGKILLed while the load waits for the load thread: the request is reported
    with every block failed, the runner's arrays keep their bytes, nothing is raised."""
    daemon = start_daemon(workdir)
    try:
        _saved(daemon)
        w, runner, go = _loading(daemon)
        before = _bytes(runner)
        w.load(KVTierMetadata(loads=[LoadSpec("r", KEYS, [1, 9, 4])]))
        daemon.kill()
        go.set()
        done, errors = _reported(w, runner, "r")
        assert done == {"r"} and errors == {1, 9, 4}
        assert _bytes(runner) == before
        counters = w._counters.take()
        assert counters["failed_blocks"] == 3 and counters["failures_unavailable"] >= 1
        assert "loaded_blocks" not in counters
        w.close()
    finally:
        stop_daemon(daemon)


def test_shutdown_waits_for_the_load_under_way_and_drops_the_queued_ones(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() with one background load being read and another queued: it waits for the
    first (its lease ends), never starts the second, raises nothing, and writes neither
    into the runner's arrays (no step is left to)."""
    _saved(daemon)
    w = _worker(daemon, load_mode="async")
    runner = _runner(1)
    w.register_runner(runner)
    before = _bytes(runner)
    reading, go = threading.Event(), threading.Event()
    staged: list[int] = []
    real = kj.stage

    def slow(*args: Any, **kw: Any) -> kj.Staged:
        out = real(*args, **kw)
        staged.append(len(out))
        reading.set()
        go.wait(30)
        return out

    monkeypatch.setattr(kj, "stage", slow)
    w.load(KVTierMetadata(loads=[LoadSpec("r", KEYS, [1, 9, 4]),
                                 LoadSpec("q", KEYS[:2], [3, 6])]))
    assert reading.wait(30)
    raised: list[BaseException] = []

    def close() -> None:
        try:
            w.close()
        except BaseException as exc:  # noqa: BLE001 (the test's verdict)
            raised.append(exc)

    closer = threading.Thread(target=close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive(), "close() did not wait for the load under way"
    go.set()
    closer.join(30)
    assert not closer.is_alive() and raised == []
    assert staged == [3]  # "q" never started
    assert _bytes(runner) == before and not any(x.is_deleted() for x in runner.kv_caches)
    assert daemon.check() == []
