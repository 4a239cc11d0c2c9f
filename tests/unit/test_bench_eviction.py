"""bench/eviction_policy.py on a small trace: the study runs and reports sane figures."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from kvtierd import block_table

from .conftest import run_bench_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not block_table.AVAILABLE, reason="kvtier._native is not built")
@pytest.mark.timeout(120)
def test_quick_run_compares_every_policy_with_exact_lru(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "eviction.json"
    run_bench_script(tmp_path, "eviction_policy.py", "--requests", "1500", "--users", "500",
                     "--sizes", "0.1,0.5", "--cost-slots", "4k", "--cost-rounds", "50",
                     "--json", str(out))
    res = json.loads(out.read_text())
    assert res["trace"]["requests"] == 1500 and res["trace"]["distinct"] > 0
    exact, *native = res["hit_ratio"]
    assert exact["policy"] == "exact LRU"
    small, large = exact["hit_ratio"]
    assert 0 < small < large <= 1  # a bigger cache hits more
    assert len(native) == 7
    for row in native:
        # approximations: not better than exact LRU by much, not far worse
        assert all(-10 < d < 2 for d in row["minus_exact_points"]), row
    assert len(res["cost"]) == 7
    for row in res["cost"]:
        assert row["slots"] == 4096 and row["ns_per_victim"] > 0
        assert row["native_bytes_per_slot"] <= 16


# ----------------------------------------------------------------------------- the prefix study:
# the prefix-hit simulators of bench/prefix_eviction.py (pure Python, no native table)

sys.path.insert(0, str(ROOT / "bench"))
import prefix_eviction as pe  # noqa: E402

SMALL = pe.default_traces(scale=0.01)


def brute_force_optimum(trace: list[list[int]], cap: int) -> int:
    """The most prefix hits any policy can get: every cache content reachable at every
    request (any subset of cache + request of at most cap keys), by dynamic programming."""
    import itertools

    best: dict[frozenset[int], int] = {frozenset(): 0}
    for keys in trace:
        keys = keys[:cap]
        nxt: dict[frozenset[int], int] = {}
        for state, score in best.items():
            score += pe.lead(keys, state)
            pool = sorted(state | set(keys))
            for r in range(min(cap, len(pool)) + 1):
                for keep in itertools.combinations(pool, r):
                    f = frozenset(keep)
                    if nxt.get(f, -1) < score:
                        nxt[f] = score
        best = nxt
    return max(best.values())


def test_the_optimum_is_exact_on_tiny_traces() -> None:
    import random

    rng = random.Random(40)
    for _ in range(25):
        # chains of a small prefix tree: requests are root paths of random length
        trace = []
        for _ in range(6):
            branch = rng.randrange(3)
            trace.append([100 * branch + j for j in range(rng.randint(1, 3))] if branch
                         else [j for j in range(rng.randint(1, 4))])
        pe.check_prefix_keyed(trace)
        for cap in (1, 2, 3):
            assert pe.replay_opt(trace, cap).hits == brute_force_optimum(trace, cap), (trace, cap)


def test_the_bound_is_above_every_policy_on_small_traces() -> None:
    for ti in SMALL:
        pe.check_prefix_keyed(ti.trace)
        distinct = len({k for keys in ti.trace for k in keys})
        for size in (0.10, 0.25):
            cap = max(1, int(size * distinct))
            bound = pe.replay_opt(ti.trace, cap)
            assert bound.hits == bound.block_hits  # prefix-closed: every cached key is a hit
            demand = pe.replay_opt(ti.trace, cap, admit_all=True)
            assert demand.hits <= bound.hits
            for p in pe.POLICIES:
                r = p.run(ti.trace, cap)
                assert r.reads == bound.reads
                assert r.hits <= r.block_hits
                assert r.hits <= bound.hits, (ti.name, size, p.name)
                if p.kind != "offline":
                    assert r.block_hits <= bound.hits, (ti.name, size, p.name)


def test_exact_lru_on_a_hand_made_trace() -> None:
    trace = [[1, 2], [3], [1, 2], [4, 5], [1, 2, 3]]
    # cap 3, head first: [1 2] -> [1 2 3] -> hits 2, [3 1 2] -> 4 evicts 3, 5 evicts 1:
    # [2 4 5] -> request [1 2 3]: 1 missing, no prefix hit (2 is a block hit)
    r = pe.replay_lru(trace, 3)
    assert (r.hits, r.block_hits, r.reads, r.victims) == (2, 3, 10, 4)
    # tail first: [2 1] -> [2 1 3] -> touched 2 then 1: [3 2 1] -> 4 evicts 3, 5 evicts 2:
    # [1 5 4] -> request [1 2 3]: key 1 is a prefix hit
    r = pe.replay_lru(trace, 3, tail_first=True)
    assert (r.hits, r.block_hits) == (3, 3)
    # the bound keeps [1 2] through the one-off [4 5] (bypassed) and 3 as well
    assert pe.replay_opt(trace, 3).hits == 2 + 3
    # bench/eviction_policy.py's native-policy replay is the same LRU
    if block_table.AVAILABLE:
        sys.path.insert(0, str(ROOT / "bench"))
        import eviction_policy

        assert eviction_policy.replay_exact_lru(trace, 3) == (2, 10)


@pytest.mark.skipif(not block_table.AVAILABLE, reason="kvtier._native is not built")
def test_the_clock_simulator_is_the_native_clock() -> None:
    import eviction_policy

    trace = pe.conversations(600, 200, 1.1, 4, 8, 3)
    distinct = len({k for keys in trace for k in keys})
    for size in (0.1, 0.3):
        cap = int(size * distinct)
        native = eviction_policy.replay_native(trace, cap, block_table.Policy.CLOCK, 1, False, 3)
        sim = pe.replay_clock(trace, cap)
        assert (sim.hits, sim.reads) == native[:2]


def test_chain_aware_victims_on_a_hand_made_chain() -> None:
    # A chain of 4 fills the cache; a one-off key needs a victim; the chain comes back.
    trace = [[1, 2, 3, 4], [9], [1, 2, 3]]
    # CLOCK: no bit at commit, the hand takes slot 0: the chain's head, so no prefix hit
    assert pe.replay_clock(trace, 4).hits == 0
    # deepest of a window of 4: the tail (key 4) goes, the chain's 3 keys hit; of 2 (the
    # slots of keys 1 and 2), key 2 goes; leaf first: the only leaf, key 4, goes
    assert pe.replay_clock(trace, 4, window=4).hits == 3
    assert pe.replay_clock(trace, 4, window=2).hits == 1
    assert pe.replay_clock(trace, 4, leaf_first=True).hits == 3
    # the leaf bit: read once, the head has two chances and the tail one
    trace = [[1, 2, 3, 4], [1, 2, 3, 4], [9], [1, 2, 3]]
    assert pe.replay_clock(trace, 4).hits == 4 + 0
    assert pe.replay_clock(trace, 4, pe.leaf_bit).hits == 4 + 3
    # probation: a new key read again leaves the ring; one never read is taken first
    trace = [[1, 2], [1, 2], [7], [8], [1, 2]]
    assert pe.replay_clock(trace, 3, probation=0.3).hits == 2 + 2


def test_serving_replay_matches_the_bench_workload() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_serving", ROOT / "bench" / "vllm_serving.py")
    assert spec and spec.loader
    vs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vs)
    wl = vs.Workload(users=12, rounds=5, system_tokens=1024, message_tokens=256,
                     answer_tokens=16, vocab=1000, seed=0)
    trace = pe.serving_replay()
    assert len(trace) == 12 * 5
    assert max(map(len, trace)) == wl.max_prompt() // vs.BLOCK
    assert len({k for keys in trace for k in keys}) <= -(-wl.distinct_tokens() // vs.BLOCK)
    assert all(keys[:8] == trace[0][:8] for keys in trace)  # the shared system prompt
