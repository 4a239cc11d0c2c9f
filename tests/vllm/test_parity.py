"""Output parity: a vLLM engine with kvtier answers exactly as the same engine without it.

Engines (``paritylab``: the bf16 tiny Llama, each a fresh process started once for the
module; together, since each start costs ~13 s of CPU):

* ``ref``: no connector, vLLM's own prefix caching on: every prompt cold, then every
  prompt again, hitting its own cache (``paritylab.Reference``);
* ``both`` (``kv_both``, ``load_mode: auto``): set A cold (computes and saves), again
  (loads in the step, from DRAM), and again after kvtierd drained the blocks to its SSD
  tier and dropped them from DRAM (loads in the background, promoted from SSD);
* ``producer`` (``kv_producer``): set B cold;
* ``consumer`` (``kv_consumer``): set B, loading what the producer saved.

Prompts are seeded, their lengths just below, on and just above block boundaries, sent in
batches of concurrent requests.  A cold run answers as vLLM alone's cold run, every full
block holding the bytes vLLM alone computed; so do the slots kvtierd keeps.  A run that
loads from kvtier holds in every block it loaded the bytes vLLM alone computed cold, and
in every block it computed after the hit, and in its answer, what vLLM alone computed
after its own prefix-cache hit of the same length: that is the reference of a hit, not
the cold run (where the two differ depends on the host: ``paritylab``'s docstring).  The
prompts of 2560 and 3072 tokens are past the length where they differ on a 1 MiB-L2 host.
The P/D proxy, hybrid and MLA models have their parity tests in test_pd.py and
test_hybrid.py; ``bench/parity.py`` runs the same on hundreds of prompts.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")

from tests.vllm.paritylab import (  # noqa: E402
    BLOCK,
    Lab,
    Prompt,
    Reference,
    at_hit,
    count,
    kv,
    phase,
    prompts,
    tokens,
)

pytestmark = [pytest.mark.timeout(900)]

#: Set A (kv_both) and set B (producer/consumer): lengths around block boundaries, and
#: some longer than vLLM-CPU's attention tile on hosts with 1 MiB of L2 a core.
A = prompts((127, 128, 129, 383, 384, 385, 1023, 1024, 1025, 1407, 1408, 1900, 2560, 3072), 1)
B = prompts((255, 256, 257, 1151, 1152, 1153, 2560), 2)
CONCURRENT = 3  # prompts per generate() call
MAX_MODEL_LEN = 4096
#: What a failed block comparison means, and what it may depend on.
LOADED = ("a block loaded from kvtier must hold the bytes vLLM alone computed cold "
          "(this holds on every host)")
COMPUTED = ("a block computed after a kvtier hit must hold the bytes vLLM alone computes "
            "after its own prefix-cache hit of the same length (not its cold run's: those "
            "differ on hosts whose L2 makes vLLM-CPU's attention tiles shorter than the "
            "prompt)")
ANSWERS = "after a hit, the answer must be vLLM alone's after its own prefix-cache hit"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    base = tempfile.mkdtemp(prefix="kvt-parity-", dir="/tmp")
    lab = Lab(base, max_model_len=MAX_MODEL_LEN)
    try:
        # Each set in the batches its kvtier engines get: a prompt long enough to be cut
        # into chunks computes in those chunks, and which chunks depends on its batch.
        lab.start("ref", [phase(A, CONCURRENT) + phase(B, CONCURRENT)] * 2, None,
                  prefix_caching=True)
        lab.start("both", [phase(A, CONCURRENT)] * 3, "kv_both", load_mode="auto")
        lab.start("producer", [phase(B, CONCURRENT)], "kv_producer")
        lab.start("consumer", [[], phase(B, CONCURRENT)], "kv_consumer")
        yield lab
    finally:
        lab.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def ref(lab: Lab) -> Reference:
    out = lab.reference("ref")
    cold = out.cold
    assert len({str(t) for t in tokens(cold)}) == len(A) + len(B)  # answers depend on input
    assert [len(d) for d in kv(cold)] == [len(p.tokens) // BLOCK for p in A + B]
    assert len({d for ds in kv(cold) for d in ds}) == sum(len(p.tokens) // BLOCK for p in A + B)
    assert out.problems(A + B) == []
    return out


def check_hit(got: dict[str, Any], ref: Reference, batch: list[Prompt], offset: int) -> None:
    """``got``, a run that loaded each prompt's ``claimable()`` tokens from kvtier, against
    vLLM alone: loaded blocks against its cold run, the rest against its own hit."""
    want = ref.after_hit(batch, offset)
    got_loaded, got_computed = at_hit(kv(got), batch)
    want_loaded, want_computed = at_hit(kv(want), batch)
    assert got_loaded == want_loaded, LOADED
    assert got_computed == want_computed, COMPUTED
    assert tokens(got) == tokens(want), ANSWERS


def test_a_producer_and_its_consumer_answer_as_vllm_alone(lab: Lab, ref: Reference) -> None:
    want, want_kv = tokens(ref.cold)[len(A):], kv(ref.cold)[len(A):]
    produced = lab.engines["producer"].result()
    assert tokens(produced) == want
    assert kv(produced) == want_kv, "a cold run's blocks must be vLLM alone's cold bytes"
    assert lab.held(B) == want_kv  # what kvtierd keeps is what vLLM alone computes

    consumer = lab.engines["consumer"]
    consumer.result()  # the empty first phase: the engine is up
    consumer.next()
    consumed = consumer.result()
    assert [r["cached"] for r in consumed["prompts"]] == [p.claimable() for p in B]
    check_hit(consumed, ref, B, len(A))
    assert count(consumed, "saved_blocks") == 0
    assert count(consumed, "failed_blocks") == 0


def test_kv_both_answers_as_vllm_alone_cold_from_dram_and_from_ssd(
        lab: Lab, ref: Reference) -> None:
    want, want_kv = tokens(ref.cold)[:len(A)], kv(ref.cold)[:len(A)]
    both = lab.engines["both"]
    cold = both.result()
    assert tokens(cold) == want
    assert kv(cold) == want_kv, "a cold run's blocks must be vLLM alone's cold bytes"
    assert count(cold, "hit_tokens") == 0
    # Every block full once computed: the prompt's and those its answer filled (the last
    # answer token's KV is never computed).
    assert count(cold, "saved_blocks") == sum((len(p.tokens) + p.answer - 1) // BLOCK for p in A)

    both.next()  # in the step, from DRAM
    dram = both.result()
    assert [r["cached"] for r in dram["prompts"]] == [p.claimable() for p in A]
    check_hit(dram, ref, A, 0)
    assert count(dram, "failed_blocks") == 0

    lab.to_ssd_only()
    both.next()  # in the background, promoted from SSD
    ssd = both.result()
    assert [r["cached"] for r in ssd["prompts"]] == [p.claimable() for p in A]
    check_hit(ssd, ref, A, 0)
    assert count(ssd, "lower_blocks") - count(dram, "lower_blocks") == \
        sum(p.claimable() // BLOCK for p in A)
    assert count(ssd, "failed_blocks") == 0
    assert lab.daemon.check() == []
