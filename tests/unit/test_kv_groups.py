"""kvtier._kv_groups against vLLM's real KV cache specs: plans, keys, windows, TP replicas.

No engine, no daemon: the rules that decide which blocks of which group are stored, under
which key and namespace, by which rank, and how long a hit every group can serve is.
"""

from __future__ import annotations

import hashlib
import random
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")

import torch  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

from kvtier._kv_groups import (  # noqa: E402
    FULL,
    MAX_WINDOW_CHECKS,
    SLIDING,
    GroupPlan,
    Unsupported,
    load_range,
    longest_hit,
    plan_groups,
)
from kvtier.hashing import block_keys  # noqa: E402
from kvtier.vllm import namespace_args  # noqa: E402

BLOCK = 16


def _full(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                             dtype=torch.float32, **kw)


def _sliding(window: int, **kw: Any) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                             dtype=torch.float32, sliding_window=window, **kw)


def _mla(**kw: Any) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                            dtype=torch.bfloat16, max_tp_shards=1, **kw)


def _config(*specs: Any, layers: int = 2) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"g{g}.l{i}" for i in range(layers)], spec)
              for g, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


TOKENS = list(range(3, 3 + 10 * BLOCK + 5))
PLAIN = block_keys(TOKENS, BLOCK, b"salt")


# ---------------------------------------------------------------- plans and keys
def test_one_group_keeps_the_plain_keys_and_its_namespace() -> None:
    (plan,) = plan_groups(_config(_full()))
    assert (plan.index, plan.kind, plan.tag, plan.replicas) == (0, FULL, b"", 1)
    assert plan.keys(PLAIN) == PLAIN  # caches written before hybrid support stay valid
    assert plan.geometry.describe() == "L2-p16-h2-d32-float32"
    args = namespace_args("vllm", "/m/llama@default", "0123456789abcdef", plan.geometry, 0, 1)
    assert args["namespace"] == "vllm/llama-0123456789abcdef/tp0of1/L2-p16-h2-d32-float32"
    # A lone sliding-window group (Mistral-style) keeps plain keys too.
    (sw,) = plan_groups(_config(_sliding(64)))
    assert (sw.kind, sw.window, sw.tag) == (SLIDING, 64, b"")


def test_each_group_of_a_hybrid_model_has_keys_of_its_own() -> None:
    plans = plan_groups(_config(_sliding(64), _full(), _sliding(64)))
    assert [(p.index, p.kind, p.window) for p in plans] == [(0, SLIDING, 64), (1, FULL, 0),
                                                             (2, SLIDING, 64)]
    assert [p.tag for p in plans] == [b"g0-sliding64:L2-p16-h2-d32-float32",
                                      b"g1-full:L2-p16-h2-d32-float32",
                                      b"g2-sliding64:L2-p16-h2-d32-float32"]
    keys = [p.keys(PLAIN) for p in plans]
    every = [k for ks in keys for k in ks] + PLAIN
    assert len(set(every)) == len(every)  # no group shares a key with another, or plain
    assert all(len(k) == len(PLAIN[0]) for k in every)  # full width, never truncated
    assert plans[1].keys(PLAIN) == plans[1].keys(PLAIN)  # no process state: stable
    assert plans[1].keys(PLAIN[:3]) == keys[1][:3]  # per block: a prefix maps to a prefix
    # Known answer: keys must never change between releases (hits across upgrades).
    # The documented derivation, blake2b(domain ‖ tag ‖ 0 ‖ key) at the key's width:
    tagged = hashlib.blake2b(b"kvtier.vllm.group\x00" + plans[1].tag + b"\x00" + bytes(16),
                             digest_size=16).digest()
    assert plans[1].keys([bytes(16)]) == [tagged]
    assert tagged.hex() == "2af906c7014d99f826a92528c7a1fcdf"
    # Same geometry: one namespace for all three groups (their keys keep them apart).
    names = {namespace_args("v", "m@r", "f" * 16, p.geometry, 0, 1)["namespace"] for p in plans}
    assert len(names) == 1


def test_groups_of_different_layouts_get_namespaces_of_their_own() -> None:
    cfg = _config(_full())
    cfg.kv_cache_groups.append(KVCacheGroupSpec(["x.l0"], _sliding(64)))  # one layer, not 2
    a, b = plan_groups(cfg)
    assert a.geometry.block_bytes == 2 * b.geometry.block_bytes
    assert namespace_args("v", "m", "f" * 16, a.geometry, 0, 1)["namespace"] != \
        namespace_args("v", "m", "f" * 16, b.geometry, 0, 1)["namespace"]


def test_specs_kvtier_cannot_store_are_refused_by_name() -> None:
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(Unsupported, match="MambaSpec is not supported by kvtier"):
        plan_groups(_config(_full(), mamba))
    chunked = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                                        dtype=torch.float32, attention_chunk_size=64)
    with pytest.raises(Unsupported, match="ChunkedLocalAttentionSpec is not supported"):
        plan_groups(_config(chunked))
    sink = SinkFullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                                 dtype=torch.float32, sink_len=4)
    with pytest.raises(Unsupported, match="SinkFullAttentionSpec is not supported"):
        plan_groups(_config(sink))
    other = FullAttentionSpec(block_size=2 * BLOCK, num_kv_heads=1, head_size=32,
                              dtype=torch.float32)
    with pytest.raises(Unsupported, match=r"different block sizes \(16, 32 tokens"):
        plan_groups(_config(_full(), other))
    cfg = _config(_full(), _full())
    cfg.kv_cache_groups[1].is_eagle_group = True
    with pytest.raises(Unsupported, match="group 1 holds EAGLE/MTP drafter layers"):
        plan_groups(cfg)
    # A group vLLM rebuilds itself after a load (not transferred) is not stored at all.
    cfg = _config(_full(), _sliding(64))
    cfg.kv_cache_groups[1].enable_kv_transfer = False
    assert [p.index for p in plan_groups(cfg)] == [0]


# ---------------------------------------------------------------- sliding windows
@pytest.mark.parametrize("window", [1, 15, 16, 17, 48, 64, 100])
@pytest.mark.parametrize("retained", [0, 5])
def test_a_windows_first_block_is_the_first_one_vllm_keeps(window: int, retained: int) -> None:
    (plan,) = plan_groups(_config(_sliding(window, extra_retained_tokens=retained)))
    vllm_manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=retained)
    for hit in range(0, 12):
        skipped = SlidingWindowManager.get_num_skipped_tokens(
            vllm_manager, hit * BLOCK)  # type: ignore[arg-type]
        assert plan.first_block(hit) == skipped // BLOCK, (hit, window, retained)
    assert plan_groups(_config(_full()))[0].first_block(9) == 0


def test_only_the_window_is_loaded() -> None:
    sw, full = plan_groups(_config(_sliding(48), _full()))
    # A 10-block hit: tokens 0..159 computed, the next one attends to 113..160 (48 tokens),
    # so the sliding-window group needs blocks 7, 8, 9; full attention all ten.
    assert load_range(sw, 0, 10) == (7, 10) and load_range(full, 0, 10) == (0, 10)
    assert load_range(sw, 8, 10) == (8, 10)  # vLLM has blocks 0..7 itself
    assert load_range(sw, 0, 2) == (0, 2)  # the window reaches back to the start


def _brute_force(plans: list[GroupPlan], held: dict[int, set[int]], local: int,
                 usable: int) -> int:
    for hit in range(usable, local, -1):
        if all(all(b in held[p.index] for b in range(*load_range(p, local, hit)))
               for p in plans):
            return hit
    return local


def test_the_hit_is_the_longest_every_group_can_serve() -> None:
    rng = random.Random(7)
    plans = plan_groups(_config(_full(), _sliding(40), _sliding(40)))
    for _ in range(400):
        n = 24
        held = {}
        for p in plans:
            present = set(range(rng.randrange(n // 2, n + 1)))
            for _ in range(rng.randrange(3)):  # a few evicted blocks
                present.discard(rng.randrange(n))
            held[p.index] = present
        local, usable = rng.choice([0, 0, 3, 9]), rng.randrange(10, n + 1)
        calls: list[tuple[int, int, int]] = []

        def present(plan: GroupPlan, start: int, stop: int,
                    held: dict[int, set[int]] = held,
                    calls: list[tuple[int, int, int]] = calls) -> int:
            calls.append((plan.index, start, stop))
            return next((i - start for i in range(start, stop) if i not in held[plan.index]),
                        stop - start)

        got = longest_hit(plans, present, local, usable)
        assert got == _brute_force(plans, held, local, usable), (held, local, usable)
        assert len(calls) <= 1 + 2 * MAX_WINDOW_CHECKS


def test_a_full_attention_hit_the_caller_looked_up_is_used_as_is() -> None:
    plans = plan_groups(_config(_full(), _sliding(40)))
    asked: list[int] = []

    def present(plan: GroupPlan, start: int, stop: int) -> int:
        asked.append(plan.index)
        return stop - start  # every window block is there

    assert longest_hit(plans, present, 0, 20, full_hits=[6]) == 6
    assert asked == [1]  # only the window was looked up
    assert longest_hit(plans, present, 8, 20, full_hits=[6]) == 8  # vLLM has more: nothing
    with pytest.raises(ValueError, match="full_hits has 2 entries for 1"):
        longest_hit(plans, present, 0, 20, full_hits=[6, 6])


def test_a_window_with_gaps_everywhere_gives_up_after_a_bounded_number_of_lookups() -> None:
    (sw,) = plan_groups(_config(_sliding(20)))
    calls = []

    def present(plan: GroupPlan, start: int, stop: int) -> int:
        calls.append(start)
        return 1 if stop - start > 1 else 0  # every other block missing

    assert longest_hit([sw], present, 0, 200) == 0
    assert len(calls) == MAX_WINDOW_CHECKS


# ---------------------------------------------------------------- tensor-parallel copies
def test_an_mla_latent_has_one_namespace_for_all_ranks_and_one_writer() -> None:
    (plan,) = plan_groups(_config(_mla()), tp_size=4)
    assert plan.replicas == 4
    assert [plan.shard(r) for r in range(4)] == [0, 0, 0, 0]
    assert [plan.writes(r) for r in range(4)] == [True, False, False, False]
    names = {namespace_args("vllm", "ds@r", "f" * 16, plan.geometry, plan.shard(r), 4,
                            plan.replicas)["namespace"] for r in range(4)}
    assert names == {"vllm/ds-ffffffffffffffff/tp0-3of4/L2-p16-h1-d576-bfloat16"}
    # TP=1: the name MLA namespaces always had.
    (one,) = plan_groups(_config(_mla()), tp_size=1)
    assert one.replicas == 1 and namespace_args("vllm", "ds@r", "f" * 16, one.geometry, 0, 1,
                                                one.replicas)["namespace"].count("/tp0of1/") == 1


def test_sharded_heads_keep_a_namespace_per_rank_and_replicated_heads_share() -> None:
    (sharded,) = plan_groups(_config(_full()), tp_size=4)
    assert sharded.replicas == 1 and all(sharded.writes(r) for r in range(4))
    assert [sharded.shard(r) for r in range(4)] == [0, 1, 2, 3]
    # Two KV heads over four ranks: ranks 0,1 hold head 0, ranks 2,3 head 1.
    (gqa,) = plan_groups(_config(_full(max_tp_shards=2)), tp_size=4)
    assert gqa.replicas == 2
    assert [gqa.shard(r) for r in range(4)] == [0, 0, 2, 2]
    assert [gqa.writes(r) for r in range(4)] == [True, False, True, False]
    names = [namespace_args("v", "m", "f" * 16, gqa.geometry, gqa.shard(r), 4,
                            gqa.replicas)["namespace"].split("/")[2] for r in range(4)]
    assert names == ["tp0-1of4", "tp0-1of4", "tp2-3of4", "tp2-3of4"]
    with pytest.raises(Unsupported, match="do not split into groups of 2 replicas"):
        plan_groups(_config(_full(max_tp_shards=3)), tp_size=6 + 1)


def test_loads_fail_whole_with_several_groups_or_a_window() -> None:
    from kvtier._kv_groups import fails_whole

    assert not fails_whole(_config(_full()))  # vLLM takes block ids and recomputes from there
    assert not fails_whole(_config(_mla()))
    assert fails_whole(_config(_sliding(64)))  # a window vLLM would recompute on, unloaded
    assert fails_whole(_config(_full(), _full()))  # vLLM takes no block ids from these
