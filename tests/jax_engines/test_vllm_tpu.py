"""kvtier as vLLM TPU's offload tier (``kvtier.vllm_tpu``), against the real engine
(tpu-inference 0.32.0) and a real kvtierd.

Every engine is a process of the vLLM TPU venv (Python 3.12, ``make install`` builds it with
``VLLM_TPU``), running ``vllm_tpu_engine.py`` on the tiny random-weight Llama of
``tinyllama.py``, on the CPU, with the stand-ins for TPU hardware of ``tpu_standins.py``.
Engines hold several phases, so the daemon is killed and restarted between two requests
without another engine start (each start costs ~30 s here): four starts in all, run side
by side (the reference, a ``kv_both`` engine, a P/D producer, and a consumer that is also
the first engine restarted and loads in the background).  Every answer is compared with an engine without a connector: kvtier may change how much is
recomputed, never what is generated.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.hashing import block_keys, request_salt
from tests.jax_engines import common
from tests.vllm import driver
from tests.vllm.pdlab import engine_tmp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BLOCK = 16
ENGINE_DEADLINE = 300.0
#: Longer than the connector's connect retries after two failures (0.5 s, then 1 s).
RETRY_WAIT = 2.5


def _engine_python() -> str:
    return common.engine_python("KVTIER_VLLM_TPU_VENV", ".venv-vllm-tpu", "vLLM TPU",
                         "make install")


def _prompt(seed: int, n: int) -> list[int]:
    return [1] + [3 + (i * seed) % 991 for i in range(n - 1)]


#: Prompts of 6 full blocks and a partial one (the last token is always computed).
P1 = _prompt(7919, 6 * BLOCK + 5)
P2 = _prompt(104729, 5 * BLOCK + 9)
P3 = _prompt(1299709, 6 * BLOCK + 3)
P4 = _prompt(2750159, 4 * BLOCK + 2)
FULL = 6 * BLOCK  # the full blocks of P1 and P3 before their last token


class Engine(driver.Engine):
    """A running vllm_tpu_engine.py of the vLLM TPU venv (the vLLM tests' driver)."""

    def __init__(self, python: str, base: str, spec: dict[str, Any], name: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        # This checkout's kvtier, whichever checkout the venv was installed from (its
        # editable finder comes after PYTHONPATH).
        env["PYTHONPATH"] = os.pathsep.join((os.path.join(ROOT, "client"), ROOT))
        env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = engine_tmp()  # what vLLM leaves, removed
        super().__init__(base, spec, name, python=python,
                         script=os.path.join(HERE, "vllm_tpu_engine.py"), env=env)

    def result(self, timeout: float = ENGINE_DEADLINE) -> dict[str, Any]:
        return super().result(timeout)


def _kvtier_frames(log: str) -> list[str]:
    """Traceback frames in kvtier's code (vLLM's own exit-time finalizer raises for JAX
    models, outside kvtier, so a bare "Traceback" proves nothing)."""
    return [line for line in log.splitlines()
            if line.strip().startswith('File "') and "/kvtier/" in line]


def _count(out: dict[str, Any], name: str) -> float:
    return float(out["counters"].get(name, 0))


class Lab(common.Lab):
    def engine(self, name: str, phases: list[list[list[int]]], *, kvtier: bool,
               role: str = "kv_both", **config: Any) -> Engine:
        """An engine; with ``kvtier``, its connector's config is ``config`` besides the
        lab's socket and a short timeout."""
        spec: dict[str, Any] = {"model": self.model, "phases": phases, "block": BLOCK,
                                "kv_role": role}
        if kvtier:
            spec["kvtier"] = {"socket_dir": self.socket_dir, "timeout": 2.0, **config}
        e = Engine(self.python, self.base, spec, name)
        self.engines.append(e)
        return e

    def stored_blocks(self, tokens: list[int]) -> int:
        """Leading full blocks of ``tokens`` kvtierd holds (keyed as the engines key them)."""
        name = self.namespace().name
        assert name.startswith("vllm/model-") and "/tp0of1/" in name, name
        with self.client() as c:
            return c.lookup(block_keys(tokens, BLOCK, request_salt("", None, None)))


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    python = _engine_python()
    base = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    lab = Lab(python, base)
    try:
        yield lab  # the test starts kvtierd (its first kvtier engine starts without one)
    finally:
        lab.close()
        shutil.rmtree(base, ignore_errors=True)
        if lab.shm_dir:
            shutil.rmtree(lab.shm_dir, ignore_errors=True)


def test_vllm_tpu_offload_survives_daemon_kill_and_engine_restart(lab: Lab) -> None:
    """One engine starts with kvtierd down and serves; once kvtierd is up it saves P1
    into kvtierd; kvtierd is SIGKILLed mid-run and the engine answers on, the same; after
    the daemon's restart it saves P3; a P/D producer saves P2; then the engine is
    restarted as a consumer that loads in the background (``load_mode: async``): the fresh
    process reports the full blocks of P1, P3 (the first engine's) and P2 (the producer's)
    as cached, loaded from kvtierd, and saves nothing.  Every answer equals that of an
    engine without a connector."""
    alone = lab.engine("alone", [[P1, P2, P3, P4]], kvtier=False)
    first = lab.engine("first", [[P2], [P1], [P4, P1], [P3]], kvtier=True)
    producer = lab.engine("producer", [[], [P2]], kvtier=True, role="kv_producer")
    # The engine that replaces the first starts now (its start overlaps the first's run) and
    # serves nothing until the first is gone: then it is the restarted engine, a P/D
    # consumer of the producer's blocks, which it loads in the background.
    second = lab.engine("second", [[], [P1, P3, P2]], kvtier=True, role="kv_consumer",
                        load_mode="async")
    ref = dict(zip(("P1", "P2", "P3", "P4"),
                   (r["tokens"] for r in alone.result()["prompts"]), strict=True))
    alone.close()

    out = first.result()  # no kvtierd yet: served all the same
    assert out["prompts"][0]["tokens"] == ref["P2"]
    assert _count(out, "failures_unavailable") >= 1
    assert "is kvtierd running?" in first.log()

    lab.start_daemon()
    time.sleep(RETRY_WAIT)  # past the connector's next connect attempt
    first.next()
    out = first.result()
    assert out["prompts"][0] == {**out["prompts"][0], "tokens": ref["P1"], "cached": 0}
    assert _count(out, "saved_blocks") == len(P1) // BLOCK
    assert lab.stored_blocks(P1) == len(P1) // BLOCK

    assert lab.daemon is not None
    lab.daemon.kill()  # SIGKILL, mid-run
    before = out
    first.next()
    out = first.result()
    assert [r["tokens"] for r in out["prompts"]] == [ref["P4"], ref["P1"]]
    assert out["prompts"][1]["cached"] == FULL  # the engine's own prefix cache still has P1
    assert _count(out, "failures_unavailable") > _count(before, "failures_unavailable")

    lab.start_daemon()  # the same segments: P1's blocks survived the SIGKILL
    assert lab.stored_blocks(P1) == len(P1) // BLOCK
    first.next()
    out = first.result()
    assert out["prompts"][0]["tokens"] == ref["P3"]
    assert lab.stored_blocks(P3) == len(P3) // BLOCK, "no save after the daemon's restart"
    first.close()
    assert _kvtier_frames(first.log()) == []
    assert "saves leave the step" in first.log()

    # The producer (up since the start, kvtierd down then) answers P2: its blocks are
    # committed with the answer, which announces them.
    assert producer.result()["prompts"] == []
    producer.next()
    out = producer.result()
    producer.close()
    assert out["prompts"][0] == {**out["prompts"][0], "tokens": ref["P2"], "cached": 0,
                                 "params": {"kvtier": {"blocks": len(P2) // BLOCK}}}
    assert lab.stored_blocks(P2) == len(P2) // BLOCK
    assert _kvtier_frames(producer.log()) == []
    assert "saves leave the step" not in producer.log()  # its answer waits for its saves

    # The engine restarted: the fresh process, its prefix cache empty, gets the full blocks
    # of every prompt from kvtierd (never the block holding the last token), read by its
    # load thread while the request waits, written into the cache by a later step.
    assert second.result()["prompts"] == []  # up, idle, its prefix cache empty
    second.next()
    out = second.result()
    second.close()
    assert [r["tokens"] for r in out["prompts"]] == [ref["P1"], ref["P3"], ref["P2"]]
    hits = [FULL, FULL, len(P2) // BLOCK * BLOCK]
    assert [r["cached"] for r in out["prompts"]] == hits, \
        "a fresh engine missed kvtier's blocks"
    assert _count(out, "hit_tokens") == sum(hits)
    assert _count(out, "loaded_blocks") == sum(hits) // BLOCK
    assert _count(out, "failed_blocks") == 0
    assert _count(out, "saved_blocks") + _count(out, "skipped_blocks") == 0, \
        "a consumer saved"
    assert _kvtier_frames(second.log()) == []
    assert "loading in the background" in second.log()  # not in the step
    assert lab.daemon.check() == []
