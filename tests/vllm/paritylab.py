"""Output parity between vLLM engines with kvtier and vLLM alone: shared by
``test_parity.py`` and ``bench/parity.py``.

The model is the tiny random Llama in bfloat16 (3 layers, 128-token blocks): its logits
are nearly tied, so any change in how the engine computes (a thread count, a kernel, a
chunking, a byte of KV) shows as a different greedy token within a few steps.  Every engine
runs ``engine.py`` with ``kv_digests``, so each answer also carries a digest of each full
block of the request's KV cache, computed or loaded, comparable with a kvtier slot's bytes.

What parity means (docs/decisions.md, "Output parity: what a hit is compared with"):

* a block **loaded** from kvtier holds the bytes vLLM alone computed for it (its cold run);
* what vLLM **computes after a hit** (the blocks past it and the answer) equals what vLLM
  alone computes after its own prefix-cache hit of the same length, not its cold run.
  A chunk computed behind a cached prefix can round differently from the same tokens in
  one whole-prompt prefill, in vLLM alone as with kvtier: vLLM-CPU's attention walks the
  KV in tiles sized from the host's L2 cache (half of it), so where that happens depends
  on the host (an AVX2-only EPYC, 512 KiB of L2 a core, from 1152 tokens; the 1 MiB-L2
  EPYC of 2026-12-07 from 2560, not at 2048 or below).

So the reference engine runs every prompt twice with its own prefix caching on
(:class:`Reference`): cold, then again, hitting what it cached.
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
from tests.vllm.driver import ENGINE_DEADLINE, LAB_CONNECTOR_TIMEOUT, Engine

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


def hit_blocks(p: Prompt) -> int:
    """Full blocks a loading engine takes from the cache: those of ``claimable()``."""
    return p.claimable() // BLOCK


def at_hit(kvs: list[list[str]], batch: list[Prompt]
           ) -> tuple[list[list[str]], list[list[str]]]:
    """Per prompt, its full blocks' digests cut where a hit of ``claimable()`` tokens ends:
    (the blocks a loading engine takes from the cache, the blocks it computes after)."""
    assert len(kvs) == len(batch), (len(kvs), len(batch))
    return ([d[:hit_blocks(p)] for d, p in zip(kvs, batch, strict=True)],
            [d[hit_blocks(p):] for d, p in zip(kvs, batch, strict=True)])


@dataclass(frozen=True)
class Reference:
    """vLLM alone (no connector, its own prefix caching on) on every prompt twice: ``cold``
    computes each prompt whole; ``hit`` runs them again, each hitting the ``claimable()``
    tokens its own cache kept and computing the rest after that hit."""

    cold: dict[str, Any]
    hit: dict[str, Any]

    def problems(self, batch: list[Prompt]) -> list[str]:
        """What keeps ``hit`` from being the reference of a kvtier hit: its own hits must
        be as long as kvtier's, and the blocks it hit must be those its cold run computed."""
        out = []
        cached = [r["cached"] for r in self.hit["prompts"]]
        if cached != [p.claimable() for p in batch]:
            out.append(f"vLLM alone's own prefix cache hit {cached} tokens, not the "
                       f"{[p.claimable() for p in batch]} a kvtier hit loads")
        if at_hit(kv(self.hit), batch)[0] != at_hit(kv(self.cold), batch)[0]:
            out.append("vLLM alone's prefix-cache hit gave blocks other than those it "
                       "computed cold")
        return out

    def after_hit(self, batch: list[Prompt], offset: int = 0) -> dict[str, Any]:
        """What an engine that loaded each prompt's ``claimable()`` tokens from kvtier must
        give for ``batch`` (the reference's prompts from ``offset``): the answers vLLM alone
        gave after its own hit; the loaded blocks' bytes from the cold run, the blocks
        computed after the hit from the run that hit."""
        rows = []
        for i, p in enumerate(batch):
            cold, hit = self.cold["prompts"][offset + i], self.hit["prompts"][offset + i]
            n = hit_blocks(p)
            rows.append({"tokens": hit["tokens"], "kv": cold["kv"][:n] + hit["kv"][n:]})
        return {"prompts": rows}


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

    def __init__(self, base: str, *, dram: str = "256MiB", ssd: str = "512MiB",
                 max_model_len: int = 2048) -> None:
        self.base = base
        self.max_model_len = max_model_len
        self.model = str(tinymodel.build(os.path.join(base, "model"), layers=LAYERS,
                                         dtype="bfloat16"))
        self.daemon: DaemonProc = start_daemon(
            base, "--set", f"spill.ssd_dir={os.path.join(base, 'ssd')}",
            "--set", f"spill.ssd_capacity={ssd}", capacity=dram, extent="16MiB")
        self.engines: dict[str, Engine] = {}

    @property
    def socket_dir(self) -> str:
        return os.path.join(self.base, "sock")

    def start(self, name: str, phases: list[list[dict[str, Any]]], role: str | None, *,
              prefix_caching: bool = False, **extra: Any) -> Engine:
        """An engine (None: vLLM alone) that runs ``phases``, the first at once.  vLLM's own
        prefix caching is off unless asked for, so every hit of an engine with the
        connector is kvtier's."""
        spec: dict[str, Any] = {
            "model": self.model, "phases": phases, "dtype": "bfloat16",
            "max_model_len": self.max_model_len,
            "prefix_caching": prefix_caching, "kv_digests": True,
            "connector": None if role is None else {"socket_dir": self.socket_dir,
                                                    "timeout": LAB_CONNECTOR_TIMEOUT,
                                                    **extra}}
        if role is not None:
            spec["kv_role"] = role
        engine = self.engines[name] = Engine(self.base, spec, name)
        return engine

    def reference(self, name: str, timeout: float = ENGINE_DEADLINE) -> Reference:
        """The two phases of the reference engine ``name`` (started with both phases the
        same batch and ``prefix_caching=True``)."""
        engine = self.engines[name]
        cold = engine.result(timeout)
        engine.next()
        return Reference(cold, engine.result(timeout))

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
