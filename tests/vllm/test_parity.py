"""Output parity: a vLLM engine with kvtier answers exactly as the same engine without it.

Engines (``paritylab``: the bf16 tiny Llama, each a fresh process started once for the
module; together, since each start costs ~13 s of CPU):

* ``ref``: no connector: vLLM alone, the answers and KV bytes to match;
* ``both`` (``kv_both``, ``load_mode: auto``): set A cold (computes and saves), again
  (loads in the step, from DRAM), and again after kvtierd drained the blocks to its SSD
  tier and dropped them from DRAM (loads in the background, promoted from SSD);
* ``producer`` (``kv_producer``): set B cold;
* ``consumer`` (``kv_consumer``): set B, loading what the producer saved.

Prompts are seeded, their lengths just below, on and just above block boundaries, sent in
batches of concurrent requests.  Every answer equals vLLM alone's token for token, and
every full block in the engine's KV cache after its request, computed or loaded from
kvtier, holds the bytes vLLM alone computed for it; so do the slots kvtierd keeps.  The
P/D proxy, hybrid and MLA models have their parity tests in test_pd.py and
test_hybrid.py; ``bench/parity.py`` runs the same on hundreds of prompts.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")

from tests.vllm.paritylab import BLOCK, Lab, count, kv, phase, prompts, tokens  # noqa: E402

pytestmark = [pytest.mark.timeout(900)]

#: Set A (kv_both) and set B (producer/consumer): lengths around block boundaries.
A = prompts((127, 128, 129, 383, 384, 385, 1023, 1024, 1025, 1407, 1408, 1900), 1)
B = prompts((255, 256, 257, 1151, 1152, 1153), 2)
CONCURRENT = 3  # prompts per generate() call


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    base = tempfile.mkdtemp(prefix="kvt-parity-", dir="/tmp")
    lab = Lab(base)
    try:
        lab.start("ref", [phase(A + B, CONCURRENT)], None)
        lab.start("both", [phase(A, CONCURRENT)] * 3, "kv_both", load_mode="auto")
        lab.start("producer", [phase(B, CONCURRENT)], "kv_producer")
        lab.start("consumer", [[], phase(B, CONCURRENT)], "kv_consumer")
        yield lab
    finally:
        lab.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def ref(lab: Lab) -> dict[str, Any]:
    out = lab.engines["ref"].result()
    assert len({str(t) for t in tokens(out)}) == len(A) + len(B)  # answers depend on input
    assert [len(d) for d in kv(out)] == [len(p.tokens) // BLOCK for p in A + B]
    assert len({d for ds in kv(out) for d in ds}) == sum(len(p.tokens) // BLOCK for p in A + B)
    return out


def test_a_producer_and_its_consumer_answer_as_vllm_alone(
        lab: Lab, ref: dict[str, Any]) -> None:
    want, want_kv = tokens(ref)[len(A):], kv(ref)[len(A):]
    produced = lab.engines["producer"].result()
    assert tokens(produced) == want
    assert kv(produced) == want_kv
    assert lab.held(B) == want_kv  # what kvtierd keeps is what vLLM alone computes

    consumer = lab.engines["consumer"]
    consumer.result()  # the empty first phase: the engine is up
    consumer.next()
    consumed = consumer.result()
    assert tokens(consumed) == want
    assert kv(consumed) == want_kv  # the loaded blocks hold the bytes vLLM alone computes
    assert [r["cached"] for r in consumed["prompts"]] == [p.claimable() for p in B]
    assert count(consumed, "saved_blocks") == 0
    assert count(consumed, "failed_blocks") == 0


def test_kv_both_answers_as_vllm_alone_cold_from_dram_and_from_ssd(
        lab: Lab, ref: dict[str, Any]) -> None:
    want, want_kv = tokens(ref)[:len(A)], kv(ref)[:len(A)]
    both = lab.engines["both"]
    cold = both.result()
    assert tokens(cold) == want
    assert kv(cold) == want_kv
    assert count(cold, "hit_tokens") == 0
    # Every block full once computed: the prompt's and those its answer filled (the last
    # answer token's KV is never computed).
    assert count(cold, "saved_blocks") == sum((len(p.tokens) + p.answer - 1) // BLOCK for p in A)

    both.next()  # in the step, from DRAM
    dram = both.result()
    assert tokens(dram) == want
    assert kv(dram) == want_kv
    assert [r["cached"] for r in dram["prompts"]] == [p.claimable() for p in A]
    assert count(dram, "failed_blocks") == 0

    lab.to_ssd_only()
    both.next()  # in the background, promoted from SSD
    ssd = both.result()
    assert tokens(ssd) == want
    assert kv(ssd) == want_kv
    assert [r["cached"] for r in ssd["prompts"]] == [p.claimable() for p in A]
    assert count(ssd, "lower_blocks") - count(dram, "lower_blocks") == \
        sum(p.claimable() // BLOCK for p in A)
    assert count(ssd, "failed_blocks") == 0
    assert lab.daemon.check() == []
