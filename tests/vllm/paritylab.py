"""Output parity between vLLM engines with kvtier and vLLM alone: shared by
``test_parity.py`` and ``bench/parity.py``.

The model is the tiny random Llama in bfloat16 (3 layers, 128-token blocks): its logits
are nearly tied, so any change in how the engine computes (a thread count, a kernel, a
chunking, a byte of KV) shows as a different greedy token within a few steps.  Every engine
runs ``engine.py`` with ``kv_digests``, so each answer also carries a digest of each full
block of the request's KV cache, computed or loaded, comparable with a kvtier slot's bytes.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import kvtier
import kvtier.v1.kvtier_pb2 as pb
from kvtier._admin import admin_call
from kvtier.hashing import block_keys
from kvtier.vllm import request_salt
from tests.conftest import DaemonProc, start_daemon, stop_daemon
from tests.vllm import tinymodel
from tests.vllm.driver import LAB_CONNECTOR_TIMEOUT, Engine

BLOCK = 128
LAYERS = 3


@dataclass(frozen=True)
class Prompt:
    """A prompt, its answer length and its cache salt (its keys in kvtier)."""

    tokens: list[int]
    answer: int = 24
    salt: str = ""

    def keys(self) -> list[bytes]:
        """kvtier's keys of its full blocks."""
        keys = block_keys(self.tokens, BLOCK, request_salt("", self.salt or None, None))
        return keys[: len(self.tokens) // BLOCK]

    def claimable(self) -> int:
        """Tokens a loading engine reports cached: every full block but the one holding
        the last prompt token (vLLM computes that token again)."""
        return (len(self.tokens) - 1) // BLOCK * BLOCK

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": self.tokens, "max_tokens": self.answer}
        if self.salt:
            out["cache_salt"] = self.salt
        return out


def prompts(lengths: list[int] | tuple[int, ...], seed: int, *, answer: int = 24,
            salt: str = "") -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt([rng.randrange(4, 1000) for _ in range(n)], answer, salt) for n in lengths]


def phase(batch: list[Prompt], concurrent: int) -> list[dict[str, Any]]:
    """The prompts as engine.py's phase: ``concurrent`` of them per generate() call."""
    return [{"batch": [p.spec() for p in batch[i:i + concurrent]]}
            for i in range(0, len(batch), concurrent)]


def tokens(out: dict[str, Any]) -> list[list[int]]:
    return [r["tokens"] for r in out["prompts"]]


def kv(out: dict[str, Any]) -> list[list[str]]:
    """Per prompt, the digest of each full block of its KV cache (layer by layer)."""
    return [r["kv"] for r in out["prompts"]]


def count(out: dict[str, Any], name: str) -> float:
    return float(out["counters"].get(name, 0))


@dataclass
class Differences:
    """What one engine run did not match, prompt by prompt, against vLLM alone."""

    prompts: int = 0
    answers: list[tuple[int, int]] = field(default_factory=list)  # (prompt, first token)
    blocks: list[tuple[int, int]] = field(default_factory=list)  # (prompt, first block)

    def add(self, got: dict[str, Any], want: dict[str, Any], offset: int = 0) -> None:
        for i, (g, w) in enumerate(zip(got["prompts"], want["prompts"][offset:], strict=False)):
            self.prompts += 1
            if g["tokens"] != w["tokens"]:
                self.answers.append((offset + i, first_difference(g["tokens"], w["tokens"])))
            if g["kv"] != w["kv"]:
                self.blocks.append((offset + i, first_difference(g["kv"], w["kv"])))


def first_difference(a: list[Any], b: list[Any]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


class Lab:
    """A bf16 model, one kvtierd with an SSD tier, and engines by name."""

    def __init__(self, base: str, *, dram: str = "256MiB", ssd: str = "512MiB") -> None:
        self.base = base
        self.model = str(tinymodel.build(os.path.join(base, "model"), layers=LAYERS,
                                         dtype="bfloat16"))
        self.daemon: DaemonProc = start_daemon(
            base, "--set", f"spill.ssd_dir={os.path.join(base, 'ssd')}",
            "--set", f"spill.ssd_capacity={ssd}", capacity=dram, extent="16MiB")
        self.engines: dict[str, Engine] = {}

    @property
    def socket_dir(self) -> str:
        return os.path.join(self.base, "sock")

    def start(self, name: str, phases: list[list[dict[str, Any]]], role: str | None,
              **extra: Any) -> Engine:
        """An engine (None: vLLM alone) that runs ``phases``, the first at once."""
        spec: dict[str, Any] = {
            "model": self.model, "phases": phases, "dtype": "bfloat16", "max_model_len": 2048,
            "prefix_caching": False, "kv_digests": True,
            "connector": None if role is None else {"socket_dir": self.socket_dir,
                                                    "timeout": LAB_CONNECTOR_TIMEOUT,
                                                    **extra}}
        if role is not None:
            spec["kv_role"] = role
        engine = self.engines[name] = Engine(self.base, spec, name)
        return engine

    def namespace(self) -> pb.NamespaceStats:
        (ns,) = [n for n in self.daemon.stats().namespaces if n.name.startswith("vllm/model-")]
        return ns

    def held(self, batch: list[Prompt], timeout: float = 30.0) -> list[list[str]]:
        """Per prompt, the digest of each slot kvtierd holds for its full blocks (those
        on the SSD tier brought up first)."""
        ns = self.namespace()
        with kvtier.Client(self.socket_dir, namespace=ns.name, block_bytes=ns.block_bytes,
                           model_uid=ns.model_uid) as c:
            out = []
            for p in batch:
                keys = p.keys()
                if not keys:  # shorter than a block: nothing to keep
                    out.append([])
                    continue
                c.lookup(keys, prefetch=True)
                deadline = time.monotonic() + timeout
                while len(got := c.get(keys)) < len(keys) and time.monotonic() < deadline:
                    time.sleep(0.05)
                out.append([hashlib.sha256(a).hexdigest() for a in got])
            return out

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
