"""kvtier.vllm without an engine: config, keys and salts, namespaces, geometry, block views,
and the scheduler's bookkeeping (tensor-parallel claim rule included) against a real kvtierd.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import kvtier  # noqa: E402
import kvtier.torch as kt  # noqa: E402
from kvtier.hashing import block_keys  # noqa: E402
from kvtier.vllm import (  # noqa: E402
    CacheGeometry,
    ConnectorConfig,
    KVTierConnector,
    KVTierConnectorStats,
    KVTierMetadata,
    LoadSpec,
    Unsupported,
    _Counters,
    _Scheduler,
    _Throttle,
    _Worker,
    claimable_blocks,
    geometry_of,
    model_fingerprint,
    namespace_args,
    page_views,
    refusal,
    request_salt,
)
from tests.conftest import DaemonProc  # noqa: E402

BLOCK = 16


# ---------------------------------------------------------------- config
def test_config_defaults_work_with_no_extra_config() -> None:
    cfg = ConnectorConfig.from_extra({})
    assert cfg == ConnectorConfig()
    assert (cfg.namespace_prefix, cfg.load_mode, cfg.save, cfg.checksum) == ("vllm", "sync",
                                                                             True, True)
    assert cfg.load_failure_policy == "recompute" and 0 < cfg.timeout <= 5


def test_config_takes_every_key_and_refuses_unknown_or_bad_ones() -> None:
    cfg = ConnectorConfig.from_extra({"socket_dir": "/run/kvtier", "namespace_prefix": "prod",
                                      "salt": "tenant", "load_mode": "off", "save": "false",
                                      "model_id": "llama@r2", "timeout": 1, "checksum": False,
                                      "prefetch": False, "load_failure_policy": "fail"})
    assert cfg.socket_dir == "/run/kvtier" and cfg.save is False and cfg.timeout == 1.0
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) 'sokcet_dir'"
                       r".*known keys: socket_dir"):
        ConnectorConfig.from_extra({"sokcet_dir": "/x"})
    assert ConnectorConfig.from_extra({"load_mode": "async"}).load_mode == "async"
    for bad, match in [({"load_mode": "later"}, "load_mode must be one of sync, async, off"),
                       ({"timeout": 0}, "timeout must be seconds"),
                       ({"timeout": True}, "timeout must be seconds"),
                       ({"save": "maybe"}, "save must be true or false"),
                       ({"salt": 3}, "salt must be a string"),
                       ({"socket_dir": ""}, "socket_dir must be a non-empty string"),
                       ({"namespace_prefix": "a/b"}, "namespace_prefix must be"),
                       ({"load_failure_policy": "ignore"}, "load_failure_policy must be")]:
        with pytest.raises(ValueError, match=match):
            ConnectorConfig.from_extra(bad)


# ---------------------------------------------------------------- keys and salts
def test_salt_separates_tenants_cache_salts_and_lora_adapters_and_is_stable() -> None:
    lora = SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path="/adapters/sql")
    salts = [request_salt("", None, None), request_salt("a", None, None),
             request_salt("", "user-7", None), request_salt("", None, lora),
             request_salt("", None, SimpleNamespace(lora_name="sql", lora_int_id=2,
                                                    lora_path="/adapters/sql"))]
    assert len(set(salts)) == len(salts)
    assert request_salt("", None, None) == request_salt("", "", None)  # no cache_salt == empty
    assert request_salt("a", "b", lora) == request_salt("a", "b", lora)  # no process state
    # Length-prefixed (JSON), so parts cannot run into each other.
    assert request_salt("ab", "c", None) != request_salt("a", "bc", None)
    tokens = list(range(3, 3 + 4 * BLOCK))
    keys = {tuple(block_keys(tokens, BLOCK, s)) for s in salts}
    assert len(keys) == len(salts)
    # Known answer: keys must never change between releases (hits across upgrades and hosts).
    assert block_keys(tokens, BLOCK, request_salt("", None, None))[0].hex() == \
        block_keys(tokens, BLOCK, b'["kvtier.vllm.v1", "", "", null]')[0].hex()


def test_multimodal_requests_and_prompt_embeddings_are_never_matched() -> None:
    plain = SimpleNamespace(prompt_token_ids=[1, 2], prompt_embeds=None, mm_features=[])
    assert refusal(plain) is None  # type: ignore[arg-type]
    mm = SimpleNamespace(prompt_token_ids=[1, 2], prompt_embeds=None, mm_features=[object()])
    assert refusal(mm) == "multimodal inputs"  # type: ignore[arg-type]
    embeds = SimpleNamespace(prompt_token_ids=None, prompt_embeds=torch.zeros(2, 4),
                             mm_features=[])
    assert refusal(embeds) == "prompt embeddings"  # type: ignore[arg-type]


def test_claim_is_what_every_rank_holds_and_never_the_last_token() -> None:
    assert claimable_blocks([5], 5 * BLOCK + 1, BLOCK) == 5
    assert claimable_blocks([5], 5 * BLOCK, BLOCK) == 4  # the last token is always computed
    assert claimable_blocks([5, 3], 10 * BLOCK, BLOCK) == 3  # rank 1 lost two blocks
    assert claimable_blocks([5, 0], 10 * BLOCK, BLOCK) == 0
    assert claimable_blocks([], 10 * BLOCK, BLOCK) == 0
    assert claimable_blocks([3], 0, BLOCK) == 0


# ---------------------------------------------------------------- namespaces and geometry
GEOM = CacheGeometry(num_layers=2, block_tokens=BLOCK, kv_heads=2, head_size=32,
                     dtype="float32", page_bytes=2 * BLOCK * 2 * 32 * 4)


def _vllm_config(**model: Any) -> Any:
    hf = {"hidden_size": 128, "num_hidden_layers": 2, "transformers_version": "5.0"}
    hf.update(model.pop("hf", {}))
    mc = SimpleNamespace(model="/models/llama-tiny", revision=None, dtype="float32",
                         quantization=None, hf_config=SimpleNamespace(to_dict=lambda: dict(hf)))
    for k, v in model.items():
        setattr(mc, k, v)
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto"),
                           attention_config=SimpleNamespace(backend=None),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1))


def test_fingerprint_covers_what_shapes_the_kv_and_ignores_what_does_not() -> None:
    identity, digest = model_fingerprint(_vllm_config(), None)
    assert identity == "/models/llama-tiny@default" and len(digest) == 16
    assert model_fingerprint(_vllm_config(), None) == (identity, digest)
    same = {model_fingerprint(_vllm_config(hf={"transformers_version": "9.9"}), None)[1]}
    assert same == {digest}
    others = {model_fingerprint(c, None)[1] for c in (
        _vllm_config(hf={"rope_theta": 1e6}), _vllm_config(dtype="bfloat16"),
        _vllm_config(revision="r2"), _vllm_config(quantization="fp8"))}
    assert digest not in others and len(others) == 4
    assert model_fingerprint(_vllm_config(), "llama@r1")[0] == "llama@r1"


def test_each_rank_has_its_own_valid_namespace_with_the_same_block_bytes() -> None:
    args = [namespace_args("vllm", "/models/llama-tiny@default", "0123456789abcdef", GEOM, r, 2)
            for r in range(2)]
    assert args[0]["namespace"] == "vllm/llama-tiny-0123456789abcdef/tp0of2/L2-p16-h2-d32-float32"
    assert args[1]["namespace"].split("/")[2] == "tp1of2"
    assert {a["block_bytes"] for a in args} == {GEOM.block_bytes}
    long = namespace_args("p", "org/" + "x" * 300 + "@rev", "f" * 16, GEOM, 0, 1)
    assert len(long["namespace"]) <= 128 and len(long["model_uid"].encode()) <= 256


def test_geometry_comes_from_the_attention_group() -> None:
    spec = SimpleNamespace(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                           page_size_bytes=2 * 128 * 2 * 32 * 2)
    group = SimpleNamespace(layer_names=["l0", "l1", "l2"], kv_cache_spec=spec)
    g = geometry_of(SimpleNamespace(kv_cache_groups=[group]))  # type: ignore[arg-type]
    assert (g.num_layers, g.block_tokens, g.dtype, g.block_bytes) == (3, 128, "bfloat16",
                                                                      3 * spec.page_size_bytes)
    # Hybrid models: one geometry per group (tests/unit/test_kv_groups.py has the rest).
    two = SimpleNamespace(layer_names=["l3", "l4"], kv_cache_spec=spec)
    both = SimpleNamespace(kv_cache_groups=[group, two])
    assert geometry_of(both, 1).num_layers == 2  # type: ignore[arg-type]
    with pytest.raises(Unsupported, match="2 groups, no group 2"):
        geometry_of(both, 2)  # type: ignore[arg-type]
    mamba = SimpleNamespace(layer_names=["m"], kv_cache_spec=SimpleNamespace(
        block_size=1, page_size_bytes=4))
    with pytest.raises(Unsupported, match="has no num_kv_heads, head_size, dtype"):
        geometry_of(SimpleNamespace(kv_cache_groups=[mamba]))  # type: ignore[arg-type]


# ---------------------------------------------------------------- whole-block views
def _filled(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["cpu", "flash_attn"])
def test_blocks_round_trip_byte_exact_for_both_tensor_layouts(daemon: DaemonProc,
                                                              kind: str) -> None:
    nb, heads, dim = 6, 2, 8
    # vLLM's CPU backend: [blocks, kv_heads, block, 2*head]; FlashAttention: [2, blocks, block,
    # kv_heads, head].
    shape = (nb, heads, BLOCK, 2 * dim) if kind == "cpu" else (2, nb, BLOCK, heads, dim)
    src = [_filled(shape, seed) for seed in range(3)]
    dst = [torch.zeros(shape) for _ in range(3)]
    cache_src, layout = page_views(src, nb)
    cache_dst, _ = page_views(dst, nb)
    assert layout.layout == ("single" if kind == "cpu" else "kv")
    assert layout.block_bytes == 3 * 2 * heads * BLOCK * dim * 4
    keys = [b"k%d" % i for i in range(3)]
    with kvtier.Client(daemon.socket_dir, namespace=f"views-{kind}",
                       block_bytes=layout.block_bytes, model_uid="m", checksum=True) as c:
        assert kt.save(c, cache_src, [4, 1, 2], keys, layout=layout) == 3
        assert kt.load(c, keys, cache_dst, [0, 5, 3], layout=layout) == 3
    axis = 0 if kind == "cpu" else 1
    for s, d in zip(src, dst, strict=True):
        for a, b in ((4, 0), (1, 5), (2, 3)):
            assert torch.equal(s.select(axis, a), d.select(axis, b))
        untouched = [i for i in range(nb) if i not in (0, 5, 3)]
        assert all(not d.select(axis, i).any() for i in untouched)


def test_tensors_that_are_not_whole_blocks_are_refused() -> None:
    with pytest.raises(Unsupported, match="no axis of 7 blocks"):
        page_views([torch.zeros(6, 2, 16, 8)], 7)
    strided = torch.zeros(6, 16, 2, 8).transpose(1, 2)  # blocks are not contiguous
    with pytest.raises(Unsupported, match="not contiguous per block"):
        page_views([strided], 6)
    with pytest.raises(Unsupported, match="different layouts"):
        page_views([torch.zeros(6, 2, 16, 8), torch.zeros(2, 6, 16, 2, 4)], 6)


# ---------------------------------------------------------------- scheduler bookkeeping
@dataclasses.dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: list[Any] = dataclasses.field(default_factory=list)
    prompt_embeds: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids


def _scheduler(daemon: DaemonProc, tp: int, **extra: Any) -> tuple[_Scheduler, _Counters]:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    assert spec.page_size_bytes == GEOM.page_bytes
    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["a", "b"],
                                                          kv_cache_spec=spec)])
    vc = _vllm_config()
    vc.parallel_config.tensor_parallel_size = tp
    counters = _Counters()
    cfg = ConnectorConfig.from_extra({"socket_dir": daemon.socket_dir, **extra})
    return _Scheduler(vc, kv, cfg, counters, _Throttle()), counters  # type: ignore[arg-type]


def _store(daemon: DaemonProc, sched: _Scheduler, rank: int, keys: list[bytes]) -> None:
    with kvtier.Client(daemon.socket_dir, **sched._links[rank].args) as c:
        c.put(keys, [b"x"] * len(keys))


def test_tensor_parallel_claims_only_blocks_every_rank_holds(daemon: DaemonProc) -> None:
    sched, counters = _scheduler(daemon, tp=2)
    tokens = list(range(3, 3 + 8 * BLOCK + 5))
    keys = block_keys(tokens, BLOCK, request_salt("", None, None))
    _store(daemon, sched, 0, keys)        # rank 0 has all 8 blocks
    _store(daemon, sched, 1, keys[:5])    # rank 1 only 5
    req = FakeRequest("r1", tokens)
    assert sched.matched(req, 0) == 5 * BLOCK  # type: ignore[arg-type]
    assert sched.matched(req, 2 * BLOCK) == 3 * BLOCK  # beyond vLLM's own 2 blocks
    assert counters.take()["lookups"] == 1  # one lookup per request (per rank, concurrently)
    assert sched.matched(req, 5 * BLOCK) == 0  # type: ignore[arg-type]
    st = sched._reqs["r1"]
    assert st.stored == 5  # what every rank holds need not be saved again
    other_salt = FakeRequest("r2", tokens, cache_salt="tenant-b")
    assert sched.matched(other_salt, 0) == 0  # type: ignore[arg-type]
    sched.close()


def test_scheduler_plans_loads_and_saves_each_full_block_once(daemon: DaemonProc) -> None:
    sched, counters = _scheduler(daemon, tp=1)
    tokens = list(range(3, 3 + 6 * BLOCK + 3))
    keys = block_keys(tokens, BLOCK, request_salt("", None, None))
    _store(daemon, sched, 0, keys[:2])
    req = FakeRequest("r", tokens)
    assert sched.matched(req, 0) == 2 * BLOCK  # type: ignore[arg-type]
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14, 15, 16],))
    sched.after_alloc(req, blocks, 2 * BLOCK)  # type: ignore[arg-type]

    def step(new: list[Any], cached: Any, scheduled: dict[str, int]) -> KVTierMetadata:
        out = SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                              num_scheduled_tokens=scheduled)
        return sched.build_meta(out)  # type: ignore[arg-type]

    no_cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                num_computed_tokens=[])
    # Chunked prefill: the first step computes 2 blocks and 10 tokens after the 2 loaded ones.
    new = SimpleNamespace(req_id="r", block_ids=([10, 11, 12, 13, 14, 15, 16],),
                          num_computed_tokens=2 * BLOCK)
    meta = step([new], no_cached, {"r": 2 * BLOCK + 10})
    assert meta.new_block_ids == [10, 11, 12, 13, 14, 15, 16]  # what this step may write
    assert [(s.keys, s.block_ids) for s in meta.loads] == [(keys[:2], [10, 11])]
    assert (meta.save_keys, meta.save_block_ids) == (keys[2:4], [12, 13])  # only full blocks
    cached = SimpleNamespace(req_ids=["r"], new_block_ids=[None], resumed_req_ids=set(),
                             num_computed_tokens=[4 * BLOCK + 10])
    meta = step([], cached, {"r": len(tokens) - 4 * BLOCK - 10})
    assert meta.loads == [] and meta.new_block_ids == []
    assert (meta.save_keys, meta.save_block_ids) == (keys[4:6], [14, 15])
    meta = step([], cached, {"r": 1})  # a decode step completes no new block
    assert meta.save_keys == []
    # A failed load makes the scheduler save those blocks again once they are recomputed.
    sched.connector_output(SimpleNamespace(invalid_block_ids={11}))  # type: ignore[arg-type]
    cached.num_computed_tokens = [BLOCK]
    meta = step([], cached, {"r": len(tokens) - BLOCK})
    assert meta.save_keys == keys[1:6]
    assert counters.take()["hit_tokens"] == 2 * BLOCK
    sched.finished(req)  # type: ignore[arg-type]
    assert step([], cached, {"r": 1}).save_keys == []  # forgotten
    sched.close()


def test_stats_aggregate_across_workers_and_reduce_for_the_log() -> None:
    a = KVTierConnectorStats(data={"loaded_blocks": 3, "load_seconds": 0.012345})
    b = KVTierConnectorStats(data={"loaded_blocks": 2, "failures_corrupted": 1})
    total = a.aggregate(b)
    assert total.reduce() == {"loaded_blocks": 5, "load_seconds": 0.0123,
                              "failures_corrupted": 1}
    assert not total.is_empty() and KVTierConnectorStats(data={}).is_empty()


# ---------------------------------------------------------------- worker failures
NB, LAYERS = 8, 2
CPU_SHAPE = (NB, 2, BLOCK, 64)  # vLLM's CPU backend: [blocks, kv_heads, block, 2*head]


def _worker(socket_dir: str, tensors: list[torch.Tensor], async_save: bool = False,
            load_mode: str = "sync") -> tuple[_Worker, _Counters]:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    assert spec.page_size_bytes == tensors[0][0].numel() * 4
    kv = SimpleNamespace(num_blocks=NB, kv_cache_groups=[SimpleNamespace(
        layer_names=[f"l{i}" for i in range(len(tensors))], kv_cache_spec=spec)])
    counters = _Counters()
    cfg = ConnectorConfig.from_extra({"socket_dir": socket_dir, "async_save": async_save,
                                      "load_mode": load_mode})
    w = _Worker(_vllm_config(), kv, cfg,
                counters, _Throttle())  # type: ignore[arg-type]
    w.register({f"l{i}": t for i, t in enumerate(tensors)})
    return w, counters


def _save(w: _Worker, keys: list[bytes], ids: list[int]) -> None:
    w.save(KVTierMetadata(save_keys=keys, save_block_ids=ids))
    w.settle()  # CPU caches save in the background; the next step waits like this


def test_blocks_gone_between_lookup_and_load_are_reported_for_recompute(
        daemon: DaemonProc) -> None:
    src = [_filled(CPU_SHAPE, i) for i in range(LAYERS)]
    w, counters = _worker(daemon.socket_dir, src)
    keys = [b"key%d" % i for i in range(4)]
    _save(w, keys, [0, 1, 2, 3])
    assert counters.take()["saved_blocks"] == 4
    _save(w, keys, [0, 1, 2, 3])  # stored already: skipped, not written twice
    assert counters.take()["skipped_blocks"] == 4
    assert w._link is not None
    client = w._link.client()
    assert client is not None and client.delete(keys[2:]) == 2  # evicted meanwhile
    dst = [torch.zeros(CPU_SHAPE) for _ in range(LAYERS)]
    w2, counters2 = _worker(daemon.socket_dir, dst)
    w2.load(KVTierMetadata(loads=[LoadSpec("r", keys, [7, 6, 5, 4])]))
    assert w2.load_errors() == {5, 4} and w2.load_errors() == set()  # reported once
    got = counters2.take()
    assert (got["loaded_blocks"], got["failed_blocks"], got["failures_evicted"]) == (2, 2, 1)
    assert torch.equal(dst[1][7], src[1][0]) and torch.equal(dst[0][6], src[0][1])
    assert not dst[0][5].any()
    w.close()
    w2.close()


def test_async_loads_report_each_request_once_with_its_failed_blocks(
        daemon: DaemonProc) -> None:
    """load_mode async: start_load_kv returns at once; get_finished names a request only
    when its copy is done, and its failed blocks are in the load errors of that same step."""
    src = [_filled(CPU_SHAPE, i) for i in range(LAYERS)]
    w, _ = _worker(daemon.socket_dir, src)
    keys = [b"akey%d" % i for i in range(4)]
    _save(w, keys, [0, 1, 2, 3])
    dst = [torch.zeros(CPU_SHAPE) for _ in range(LAYERS)]
    w2, counters = _worker(daemon.socket_dir, dst, load_mode="async")
    assert w2._loader is not None
    gate = threading.Event()
    w2._loader.submit(gate.wait)  # hold the load thread: the loads below must queue
    w2.load(KVTierMetadata(loads=[LoadSpec("a", keys[:2], [7, 6]),
                                  LoadSpec("b", [keys[2], b"gone"], [5, 4])]))
    assert w2.finished_loads() == set() and w2.load_errors() == set()
    assert not dst[0][7].any()  # nothing copied yet
    gate.set()
    deadline = time.monotonic() + 10
    done: set[str] = set()
    errors: set[int] = set()
    while done != {"a", "b"}:
        assert time.monotonic() < deadline, done
        done |= w2.finished_loads()
        errors |= w2.load_errors()
        time.sleep(0.01)
    assert errors == {4} and w2.finished_loads() == set()  # each request reported once
    assert torch.equal(dst[1][7], src[1][0]) and torch.equal(dst[0][5], src[0][2])
    got = counters.take()
    assert (got["loaded_blocks"], got["failed_blocks"]) == (3, 1)
    w.close()
    w2.close()
    assert daemon.check() == []


def test_a_full_cache_and_an_unexpected_error_are_counted_never_raised(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    w, counters = _worker(daemon.socket_dir, [_filled(CPU_SHAPE, i) for i in range(LAYERS)])
    assert w._link is not None
    args = w._link.args
    slots = (32 << 20) // args["block_bytes"]  # more than the pool holds (extent headers)
    # Another client fills DRAM and holds a lease on every block: nothing can be evicted.
    with kvtier.Client(daemon.socket_dir, **args) as hog:
        filler = [b"fill%d" % i for i in range(slots + 4)]
        for i in range(0, len(filler), 64):
            hog.put(filler[i: i + 64], [b"x"] * len(filler[i: i + 64]))
        # Which blocks were evicted is CLOCK's order, the order their slots were claimed
        # (grants ahead included), not the order they were put: not a leading run of
        # filler (docs/decisions.md, "CLOCK's order is the slots' claims, not the
        # commits").  Lease the blocks that are there, every one of them.
        kept = [k for k in filler if hog.lookup([k])]
        with hog.acquire(kept) as lease:
            [ns] = [n for n in hog.stats()["namespaces"] if n["name"] == args["namespace"]]
            committed = int(ns["committed_blocks"])
            assert 0 < len(kept) < len(filler) and lease.hits == len(kept) == committed, (
                f"{len(kept)} of {len(filler)} keys present, {lease.hits} leased, "
                f"{committed} committed")
            _save(w, [b"new0", b"new1"], [0, 1])
            assert counters.take().get("failures_capacity") == 1

    def boom(*a: Any, **k: Any) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(kt, "load", boom)
    w.load(KVTierMetadata(loads=[LoadSpec("r", [filler[-1]], [3])]))
    assert w.load_errors() == {3}
    assert counters.take()["failures_other"] == 1
    w.close()
    assert daemon.check() == []


def test_without_kvtierd_every_claimed_block_is_a_recompute(tmp_path: Any) -> None:
    w, counters = _worker(str(tmp_path / "no-daemon"), [torch.zeros(CPU_SHAPE)
                                                        for _ in range(LAYERS)])
    w.load(KVTierMetadata(loads=[LoadSpec("r", [b"a", b"b"], [1, 2])]))
    _save(w, [b"c"], [3])  # and a save is dropped, quietly
    assert w.load_errors() == {1, 2}
    got = counters.take()
    assert got["failures_unavailable"] >= 1 and got["failed_blocks"] == 2
    assert "saved_blocks" not in got


def test_a_background_save_is_done_before_the_next_step_can_overwrite_its_blocks(
        daemon: DaemonProc) -> None:
    src = [_filled(CPU_SHAPE, i) for i in range(LAYERS)]
    w, counters = _worker(daemon.socket_dir, src, async_save=True)
    assert w._saver is not None  # CPU caches save off the step
    w.save(KVTierMetadata(save_keys=[b"bg0", b"bg1"], save_block_ids=[2, 3]))
    assert len(w._pending) == 1  # wait_for_save returned with the copy (maybe) still running
    connector = SimpleNamespace(_worker=w)
    # The connector's handle_preemptions is the first call of every step.  A step that hands
    # out other blocks need not wait; one that hands out block 3 again waits for the save.
    KVTierConnector.handle_preemptions(connector, KVTierMetadata(new_block_ids=[5, 6]))  # type: ignore[arg-type]
    KVTierConnector.handle_preemptions(connector, KVTierMetadata(new_block_ids=[9, 3]))  # type: ignore[arg-type]
    assert w._pending == []
    for t in src:
        t[2].zero_()
        t[3].zero_()
    dst = [torch.zeros(CPU_SHAPE) for _ in range(LAYERS)]
    w2, _ = _worker(daemon.socket_dir, dst)
    w2.load(KVTierMetadata(loads=[LoadSpec("r", [b"bg0", b"bg1"], [0, 1])]))
    assert w2.load_errors() == set()
    for i in range(LAYERS):
        assert torch.equal(dst[i][0], _filled(CPU_SHAPE, i)[2])
        assert torch.equal(dst[i][1], _filled(CPU_SHAPE, i)[3])
    assert counters.take()["saved_blocks"] == 2
    w.close()
    w2.close()


def test_the_last_tokens_block_is_recomputed_but_not_offered_again(daemon: DaemonProc) -> None:
    sched, counters = _scheduler(daemon, tp=1)
    tokens = list(range(3, 3 + 3 * BLOCK))  # exactly 3 blocks: the 3rd holds the last token
    keys = block_keys(tokens, BLOCK, request_salt("", None, None))
    _store(daemon, sched, 0, keys)
    req = FakeRequest("r", tokens)
    assert sched.matched(req, 0) == 2 * BLOCK  # type: ignore[arg-type]
    sched.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([4, 5, 6],)),  # type: ignore[arg-type]
                      2 * BLOCK)
    new = SimpleNamespace(req_id="r", block_ids=([4, 5, 6],), num_computed_tokens=2 * BLOCK)
    no_cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                num_computed_tokens=[])
    out = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=no_cached,
                          num_scheduled_tokens={"r": BLOCK})
    meta = sched.build_meta(out)  # type: ignore[arg-type]
    assert [s.block_ids for s in meta.loads] == [[4, 5]]
    assert meta.save_keys == []  # kvtier has block 3: no Reserve for it
    assert counters.take()["lookups"] == 1
    sched.close()


def test_blocks_from_vllms_own_prefix_cache_are_not_saved_again(daemon: DaemonProc) -> None:
    sched, counters = _scheduler(daemon, tp=1)
    tokens = list(range(7, 7 + 3 * BLOCK + 5))
    keys = block_keys(tokens, BLOCK, request_salt("", None, None))
    req = FakeRequest("r", tokens)
    assert sched.matched(req, 3 * BLOCK) == 0  # type: ignore[arg-type]
    assert counters.take().get("lookups", 0) == 0  # nothing kvtier could add: no lookup
    new = SimpleNamespace(req_id="r", block_ids=([4, 5, 6, 7],), num_computed_tokens=3 * BLOCK)
    no_cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                num_computed_tokens=[])
    out = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=no_cached,
                          num_scheduled_tokens={"r": 5})
    meta = sched.build_meta(out)  # type: ignore[arg-type]
    assert meta.save_keys == [] and meta.loads == []  # the 3 local blocks: no Reserve
    # A longer prompt with the same 3 local blocks saves only what it computes.
    longer = FakeRequest("r2", tokens + list(range(BLOCK)))
    assert sched.matched(longer, 3 * BLOCK) == 0  # type: ignore[arg-type]
    new2 = SimpleNamespace(req_id="r2", block_ids=([4, 5, 6, 8, 9],),
                           num_computed_tokens=3 * BLOCK)
    out2 = SimpleNamespace(scheduled_new_reqs=[new2], scheduled_cached_reqs=no_cached,
                           num_scheduled_tokens={"r2": BLOCK + 5})
    meta = sched.build_meta(out2)  # type: ignore[arg-type]
    more = block_keys(longer.prompt_token_ids, BLOCK, request_salt("", None, None))
    assert meta.save_keys == [more[3]] and meta.save_block_ids == [8]
    assert more[:3] == keys[:3]
    sched.close()


def test_auto_load_mode_loads_dram_hits_in_the_step_and_ssd_hits_in_the_background(
        workdir: str) -> None:
    """load_mode auto: a hit all in DRAM is loaded synchronously (vLLM is told so), one with
    a block on the SSD tier in the background; the worker follows each request's flag."""
    import os
    import subprocess
    import sys

    from tests.conftest import start_daemon, stop_daemon

    d = start_daemon(workdir, "--set", f"spill.ssd_dir={os.path.join(workdir, 'ssd')}",
                     "--set", "spill.ssd_capacity=64MiB")
    try:
        sched, _ = _scheduler(d, tp=1, load_mode="auto")
        tokens = list(range(3, 3 + 3 * BLOCK + 3))
        keys = block_keys(tokens, BLOCK, request_salt("", None, None))
        _store(d, sched, 0, keys[:3])
        conn = SimpleNamespace(_scheduler=sched, _waits=None)  # a kv_both connector
        blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13],))
        req = FakeRequest("dram", tokens)
        n, background = KVTierConnector.get_num_new_matched_tokens(conn, req, 0)  # type: ignore[arg-type]
        assert (n, background) == (3 * BLOCK, False)
        sched.after_alloc(req, blocks, n)  # type: ignore[arg-type]
        # Copy every block to SSD, then drop the DRAM copies: the next lookup finds them on SSD.
        ns = sched._links[0].args["namespace"]
        cli = [os.path.join(os.path.dirname(sys.executable), "kvtier"), "--socket", d.socket_dir]
        subprocess.run([*cli, "drain", "--timeout", "60"], check=True, capture_output=True)
        subprocess.run([*cli, "evict", "--namespace", ns, "--all", "--tier", "dram"], check=True,
                       capture_output=True)
        req2 = FakeRequest("ssd", tokens)
        n, background = KVTierConnector.get_num_new_matched_tokens(conn, req2, 0)  # type: ignore[arg-type]
        assert (n, background) == (3 * BLOCK, True)
        sched.after_alloc(req2, blocks, n)  # type: ignore[arg-type]
        meta = sched.build_meta(SimpleNamespace(  # type: ignore[arg-type]
            scheduled_new_reqs=[], num_scheduled_tokens={},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                  resumed_req_ids=set(),
                                                  num_computed_tokens=[])))
        assert [(s.req_id, s.background) for s in meta.loads] == [("dram", False), ("ssd", True)]
        sched.close()
        # The worker: the sync one is in place when load() returns, the other one is reported
        # by finished_loads() (vLLM waits for it), never the sync one.
        src = [_filled(CPU_SHAPE, i) for i in range(LAYERS)]
        w, _ = _worker(d.socket_dir, src)
        _save(w, [b"k0", b"k1"], [0, 1])
        dst = [torch.zeros(CPU_SHAPE) for _ in range(LAYERS)]
        w2, _ = _worker(d.socket_dir, dst, load_mode="auto")
        w2.load(KVTierMetadata(loads=[LoadSpec("now", [b"k0"], [5], False),
                                      LoadSpec("later", [b"k1"], [6], True)]))
        assert torch.equal(dst[0][5], src[0][0])
        deadline = time.monotonic() + 10
        done: set[str] = set()
        while "later" not in done:
            assert time.monotonic() < deadline
            done |= w2.finished_loads()
            time.sleep(0.01)
        assert done == {"later"} and torch.equal(dst[1][6], src[1][1])
        w.close()
        w2.close()
        assert d.check() == []
    finally:
        stop_daemon(d)
