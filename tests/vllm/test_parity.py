"""Output parity: a vLLM engine with kvtier answers exactly as the same engine without it.

The model is the tiny random Llama in bfloat16 (3 layers, 128-token blocks): its logits
are nearly tied, so any change in how the engine computes (a thread count, a kernel, a
chunking, a byte of KV) shows as a different greedy token within a few steps.  Engines,
each a fresh process started once for the module (together: each start costs 30-60 s):

* ``ref``: no connector: vLLM alone, the answers to match;
* ``both`` (``kv_both``, ``load_mode: auto``): set A cold (computes and saves), again
  (loads in the step, from DRAM), and again after kvtierd drained the blocks to its SSD
  tier and dropped them from DRAM (loads in the background, promoted from SSD);
* ``producer`` (``kv_producer``): set B cold;
* ``consumer`` (``kv_consumer``): set B, loading what the producer saved.

Prompts are seeded, their lengths just below, on and just above block boundaries, sent in
batches of concurrent requests.  Every answer equals vLLM alone's token for token.  The P/D proxy, hybrid and MLA models have their parity
tests in test_pd.py and test_hybrid.py; bench/parity.py runs the same on hundreds of prompts.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")

import kvtier.v1.kvtier_pb2 as pb  # noqa: E402
from kvtier._admin import admin_call  # noqa: E402
from tests.conftest import DaemonProc, start_daemon, stop_daemon  # noqa: E402
from tests.vllm import tinymodel  # noqa: E402
from tests.vllm.test_engine import Engine  # noqa: E402

pytestmark = [pytest.mark.timeout(900)]

BLOCK = 128
ANSWER = 24
LAYERS = 3
#: Set A (kv_both) and set B (producer/consumer): lengths around block boundaries.
LENGTHS_A = (127, 128, 129, 383, 384, 385, 1023, 1024, 1025, 1407, 1408, 1900)
LENGTHS_B = (255, 256, 257, 1151, 1152, 1153)
CONCURRENT = 3  # prompts per generate() call


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1000) for _ in range(n)] for n in lengths]


def phase(batch: list[list[int]]) -> list[dict[str, Any]]:
    return [{"batch": [{"tokens": p, "max_tokens": ANSWER} for p in batch[i:i + CONCURRENT]]}
            for i in range(0, len(batch), CONCURRENT)]


def claimable(p: list[int]) -> int:
    """Tokens a loading engine reports cached: every full block but the one holding the
    last prompt token (vLLM computes that token again)."""
    return (len(p) - 1) // BLOCK * BLOCK


def tokens(out: dict[str, Any]) -> list[list[int]]:
    return [r["tokens"] for r in out["prompts"]]


def count(out: dict[str, Any], name: str) -> float:
    return float(out["counters"].get(name, 0))


A = prompts(LENGTHS_A, 1)
B = prompts(LENGTHS_B, 2)


class Lab:
    def __init__(self, base: str) -> None:
        self.base = base
        self.model = str(tinymodel.build(os.path.join(base, "model"), layers=LAYERS,
                                         dtype="bfloat16"))
        self.daemon: DaemonProc = start_daemon(
            base, "--set", f"spill.ssd_dir={os.path.join(base, 'ssd')}",
            "--set", "spill.ssd_capacity=512MiB", capacity="256MiB", extent="16MiB")
        self.engines: dict[str, Engine] = {}

    @property
    def socket_dir(self) -> str:
        return os.path.join(self.base, "sock")

    def start(self, name: str, phases: list[list[dict[str, Any]]], role: str | None,
              **extra: Any) -> None:
        spec: dict[str, Any] = {
            "model": self.model, "phases": phases, "dtype": "bfloat16", "max_model_len": 2048,
            "prefix_caching": False,
            "connector": None if role is None else {"socket_dir": self.socket_dir,
                                                    "timeout": 5.0, **extra}}
        if role is not None:
            spec["kv_role"] = role
        self.engines[name] = Engine(self.base, spec, name)

    def namespace(self) -> pb.NamespaceStats:
        (ns,) = [n for n in self.daemon.stats().namespaces if n.name.startswith("vllm/model-")]
        return ns

    def to_ssd_only(self) -> None:
        """Every DRAM block of the namespace copied to the SSD tier, then dropped from DRAM."""
        drained = admin_call(self.socket_dir, "Drain", pb.DrainRequest(wait_ms=60000), 90)
        assert drained.done and drained.failed_blocks == 0, drained
        evicted = admin_call(self.socket_dir, "Evict", pb.EvictRequest(
            namespace=self.namespace().name, all=True, tiers=[pb.TIER_DRAM]), 30)
        assert evicted.evicted > 0 and evicted.skipped_leased == 0, evicted

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
        stop_daemon(self.daemon)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    base = tempfile.mkdtemp(prefix="kvt-parity-", dir="/tmp")
    lab = Lab(base)
    try:
        lab.start("ref", [phase(A + B)], None)
        lab.start("both", [phase(A), phase(A), phase(A)], "kv_both", load_mode="auto")
        lab.start("producer", [phase(B)], "kv_producer")
        lab.start("consumer", [[], phase(B)], "kv_consumer")
        yield lab
    finally:
        lab.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def ref(lab: Lab) -> dict[str, Any]:
    out = lab.engines["ref"].result()
    assert len({str(t) for t in tokens(out)}) == len(A) + len(B)  # answers depend on input
    return out


def test_kv_both_answers_as_vllm_alone_cold_from_dram_and_from_ssd(
        lab: Lab, ref: dict[str, Any]) -> None:
    want = tokens(ref)[:len(A)]
    both = lab.engines["both"]
    cold = both.result()
    assert tokens(cold) == want
    assert count(cold, "hit_tokens") == 0
    # Every block full once computed: the prompt's and those its answer filled (the last
    # answer token's KV is never computed).
    assert count(cold, "saved_blocks") == sum((len(p) + ANSWER - 1) // BLOCK for p in A)

    both.next()  # in the step, from DRAM
    dram = both.result()
    assert tokens(dram) == want
    assert [r["cached"] for r in dram["prompts"]] == [claimable(p) for p in A]
    assert count(dram, "failed_blocks") == 0

    lab.to_ssd_only()
    both.next()  # in the background, promoted from SSD
    ssd = both.result()
    assert tokens(ssd) == want
    assert [r["cached"] for r in ssd["prompts"]] == [claimable(p) for p in A]
    assert count(ssd, "lower_blocks") - count(dram, "lower_blocks") == \
        sum(claimable(p) // BLOCK for p in A)
    assert count(ssd, "failed_blocks") == 0
    assert lab.daemon.check() == []


def test_a_producer_and_its_consumer_answer_as_vllm_alone(
        lab: Lab, ref: dict[str, Any]) -> None:
    want = tokens(ref)[len(A):]
    produced = lab.engines["producer"].result()
    assert tokens(produced) == want

    consumer = lab.engines["consumer"]
    consumer.result()  # the empty first phase: the engine is up
    consumer.next()
    consumed = consumer.result()
    assert tokens(consumed) == want
    assert [r["cached"] for r in consumed["prompts"]] == [claimable(p) for p in B]
    assert count(consumed, "saved_blocks") == 0
    assert count(consumed, "failed_blocks") == 0
