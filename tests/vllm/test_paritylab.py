"""The parity bench's bookkeeping: a difference is counted and placed, never missed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")

from tests.vllm.paritylab import (  # noqa: E402
    Differences,
    Prompt,
    Reference,
    at_hit,
    first_difference,
    phase,
)


def run(*answers: tuple[list[int], list[str]]) -> dict[str, object]:
    return {"prompts": [{"tokens": t, "kv": k} for t, k in answers]}


def test_differences_count_each_prompt_and_name_the_first_token_and_block() -> None:
    want = run(([1, 2, 3], ["a", "b"]), ([4, 5, 6], ["c"]), ([7, 8], ["d", "e"]))
    d = Differences()
    d.add(run(([1, 2, 3], ["a", "b"]), ([4, 9, 6], ["c"]), ([7, 8], ["d", "x"])), want)
    assert d.prompts == 3
    assert d.answers == [(1, 1)]
    assert d.blocks == [(2, 1)]
    # Against the second half of the reference (offset), a shorter answer differs at its end.
    tail = Differences()
    tail.add(run(([4, 5], ["c"]), ([7, 8], [])), want, offset=1)
    assert (tail.prompts, tail.answers, tail.blocks) == (2, [(1, 2)], [(2, 0)])
    assert first_difference([1, 2], [1, 2]) == 2


def test_a_phase_batches_prompts_and_passes_their_salt() -> None:
    ps = [Prompt([5] * n, 4, "s" if n % 2 else "") for n in (1, 2, 3, 4, 5)]
    batches = phase(ps, 2)
    assert [len(b["batch"]) for b in batches] == [2, 2, 1]
    assert batches[0]["batch"][0] == {"tokens": [5], "max_tokens": 4, "cache_salt": "s"}
    assert "cache_salt" not in batches[0]["batch"][1]
    assert Prompt([5] * 300).claimable() == 256 and len(Prompt([5] * 300).keys()) == 2
    assert Prompt([5] * 300, salt="x").keys() != Prompt([5] * 300).keys()


def test_a_hit_is_compared_loaded_blocks_with_the_cold_run_and_the_rest_with_vllms_own_hit(
        ) -> None:
    # 384 tokens: 3 full blocks, 2 of them claimable (the third holds the last token);
    # 300 tokens: 2 full blocks, both claimable.
    ps = [Prompt([5] * 384), Prompt([6] * 300)]
    cold = {"prompts": [{"tokens": [1, 2], "kv": ["a", "b", "c"], "cached": 0},
                        {"tokens": [3, 4], "kv": ["d", "e"], "cached": 0}]}
    hit = {"prompts": [{"tokens": [1, 9], "kv": ["a", "b", "x"], "cached": 256},
                       {"tokens": [3, 4], "kv": ["d", "e"], "cached": 256}]}
    assert at_hit([["a", "b", "c"], ["d", "e"]], ps) == ([["a", "b"], ["d", "e"]], [["c"], []])
    ref = Reference(cold, hit)
    assert ref.problems(ps) == []
    want = ref.after_hit(ps)
    assert [r["tokens"] for r in want["prompts"]] == [[1, 9], [3, 4]]  # the answers after a hit
    assert [r["kv"] for r in want["prompts"]] == [["a", "b", "x"], ["d", "e"]]
    # The second prompt of a reference, from an offset.
    assert ref.after_hit(ps[1:], 1)["prompts"] == [{"tokens": [3, 4], "kv": ["d", "e"]}]
    # vLLM's own hit shorter than kvtier's, or a hit block that is not the cold one: said.
    short = Reference(cold, {"prompts": [dict(hit["prompts"][0], cached=128),
                                         dict(hit["prompts"][1], kv=["d", "z"])]})
    said = short.problems(ps)
    assert len(said) == 2 and "hit [128, 256] tokens" in said[0] and "cold" in said[1], said
