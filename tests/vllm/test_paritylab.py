"""The parity bench's bookkeeping: a difference is counted and placed, never missed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")

from tests.vllm.paritylab import Differences, Prompt, first_difference, phase  # noqa: E402


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
