"""kvtier as sglang-jax's HiCache host tier, against the real engine and a real kvtierd.

Every engine is a process of the sglang-jax venv (Python 3.12, ``make install`` builds it
with ``SGLANG_JAX``), running ``engine.py`` on a tiny random-weight Llama built here.
Engines hold several phases, so the daemon can be killed or restarted between two requests
without another engine start (each start costs ~15 s here).  Every answer is compared with
an engine without kvtier and without HiCache: kvtier may change how much is recomputed,
never what is generated.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
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
PAGE = 16
ENGINE_DEADLINE = 300.0


def _jax_python() -> str:
    return common.engine_python("KVTIER_JAX_VENV", ".venv-jax", "sglang-jax", "make install")


def _prompt(seed: int, n: int) -> list[int]:
    return [1] + [3 + (i * seed) % 991 for i in range(n - 1)]


#: Prompts of 6 full pages and a partial one (the last token is always computed).
P1 = _prompt(7919, 6 * PAGE + 5)
P2 = _prompt(104729, 5 * PAGE + 9)
P3 = _prompt(1299709, 6 * PAGE + 3)
P4 = _prompt(2750159, 4 * PAGE + 2)
FULL = 6 * PAGE  # the full pages of P1 and P3 before their last token
#: Prompts that push P1 and P3 out of a small device cache (their pages stay on the host).
FILLERS = [_prompt(seed, 6 * PAGE + 5) for seed in (15485863, 32452843, 49979687, 67867967,
                                                      86028121, 104395301)]
#: The device cache of the engine that must evict: 40 pages (P1 and P3 take 7 each).
SMALL_DEVICE = 40 * PAGE
#: The longest wait between the engines' connect attempts while kvtierd is down, s.
RETRY = 1.0


class Engine(driver.Engine):
    """A running engine.py of the sglang-jax venv (the vLLM tests' driver)."""

    def __init__(self, python: str, base: str, spec: dict[str, Any], name: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env["PYTHONPATH"] = ROOT
        self.sems_path = os.path.join(base, f"{name}.sems")
        env["KVTIER_TEST_SEMS"] = self.sems_path
        # sglang-jax names its ZMQ sockets after NamedTemporaryFile(delete=False) files
        # in TMPDIR and removes neither: a directory of the test process's, removed at
        # its exit.
        env["TMPDIR"] = engine_tmp()
        super().__init__(base, spec, name, python=python, script=os.path.join(HERE, "engine.py"),
                         env=env)

    def result(self, timeout: float = ENGINE_DEADLINE) -> list[dict[str, Any]]:  # type: ignore[override]
        """The next phase's answers (the engine started, or went on after ``next()``)."""
        out: list[dict[str, Any]] = super().result(timeout)["prompts"]
        return out

    def close(self) -> None:
        """End the engine: it shuts down at its next READY (its stdin closed); whatever of
        its process group is left after that (or after 60 s) is killed."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        # sglang-jax's children (scheduler, detokenizer, multiprocessing's resource
        # tracker, which unlinks its semaphores in /dev/shm) leave on their own first.
        deadline = time.monotonic() + 15
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()
        if os.path.exists(self.sems_path):  # what the engine's tree kill left in /dev/shm
            with open(self.sems_path) as f:
                for name in f.read().split():
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink("/dev/shm/sem." + name.lstrip("/"))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class Lab(common.Lab):
    def engine(self, name: str, phases: list[list[list[int]]], *, kvtier: bool,
               max_total_tokens: int = 2048) -> Engine:
        spec: dict[str, Any] = {"model": self.model, "phases": phases,
                                "max_total_tokens": max_total_tokens}
        if kvtier:
            # retry_max: the engine tries kvtierd again within RETRY s of its coming up.
            spec["kvtier"] = {"socket_dir": self.socket_dir, "timeout": 2.0,
                              "retry_max": RETRY}
        e = Engine(self.python, self.base, spec, name)
        self.engines.append(e)
        return e

    def stored_pages(self, tokens: list[int]) -> int:
        """Leading full pages of ``tokens`` kvtierd holds (keyed as the engines key them)."""
        with self.client() as c:
            return c.lookup(block_keys(tokens, PAGE, request_salt("", None, None)))

    def delete_pages(self, tokens: list[int]) -> int:
        with self.client() as c:
            return c.delete(block_keys(tokens, PAGE, request_salt("", None, None)))


def test_plugin_point() -> None:
    """The hook in sglang-jax's kv_cache_builder, the option that selects kvtier's pool,
    and the fall-back to the engine's own pool (check_plugin.py, in the engine's venv)."""
    python = _jax_python()
    out = subprocess.run([python, os.path.join(HERE, "check_plugin.py")], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    python = _jax_python()
    base = tempfile.mkdtemp(prefix="kvj-", dir="/tmp")
    lab = Lab(python, base)
    try:
        yield lab  # the test starts kvtierd (its first engine starts without one)
    finally:
        lab.close()
        shutil.rmtree(base, ignore_errors=True)
        if lab.shm_dir:
            shutil.rmtree(lab.shm_dir, ignore_errors=True)


def test_sglang_jax_host_tier_survives_daemon_kill_and_engine_restart(lab: Lab) -> None:
    """One engine starts with kvtierd down and serves; once kvtierd is up it saves P1
    through HiCache into kvtierd; kvtierd is SIGKILLed mid-run and the engine answers on,
    the same; after a daemon restart it saves P3; a second, fresh
    engine process (a replica started beside it, and what is left once the first is gone:
    the engine restarted) loads P1's and P3's full pages from kvtierd and reports them as
    cached; pages gone from kvtierd are recomputed, never served; every answer equals the
    engine's alone."""
    alone = lab.engine("alone", [[P1, P2, P3, P4, *FILLERS]], kvtier=False)
    answers = [r["tokens"] for r in alone.result()]
    ref = dict(zip(("P1", "P2", "P3", "P4"), answers, strict=False))
    ref_fillers = answers[4:]
    alone.close()

    first = lab.engine("first", [[P2], [P1], [P4, P1], [P3]], kvtier=True)
    out = first.result()  # no kvtierd yet: served all the same
    assert out[0]["tokens"] == ref["P2"]
    assert "kvtier: connect failed" in first.log()

    lab.start_daemon()
    time.sleep(RETRY)  # past the engine's next connect attempt
    first.next()
    out = first.result()
    assert out[0]["tokens"] == ref["P1"]
    assert out[0]["cached"] == 0
    assert lab.stored_pages(P1) == FULL // PAGE, "HiCache's backup did not reach kvtierd"

    assert lab.daemon is not None
    lab.daemon.kill()  # SIGKILL, mid-run
    first.next()
    out = first.result()
    assert [r["tokens"] for r in out] == [ref["P4"], ref["P1"]]
    assert out[1]["cached"] == FULL  # the engine's own device cache still serves P1
    assert "kvtier: save failed" in first.log(), "P4's backup never met the dead daemon"

    lab.start_daemon()  # the same segments: P1's pages survived the SIGKILL
    assert lab.stored_pages(P1) == FULL // PAGE
    first.next()
    out = first.result()
    assert out[0]["tokens"] == ref["P3"]
    assert lab.stored_pages(P3) == FULL // PAGE, "no save after the daemon's restart"

    # A replica beside it (a fresh process, its tree empty) gets P1's and P3's pages
    # from kvtierd; then the first engine goes, and the replica serves on.
    second = lab.engine("second", [[P1, P3], FILLERS, [P1, P3]], kvtier=True,
                        max_total_tokens=SMALL_DEVICE)
    out = second.result()
    assert [r["tokens"] for r in out] == [ref["P1"], ref["P3"]]
    assert [r["cached"] for r in out] == [FULL, FULL], "a fresh engine missed kvtier's pages"
    first.close()

    second.next()  # the fillers push P1 and P3 out of the device cache, to the host tier
    assert [r["tokens"] for r in second.result()] == ref_fillers
    # P1's pages leave kvtierd behind the engine's back (as kvtierd's eviction would do):
    # its host tombstones now name missing blocks.  The load must not use them.
    assert lab.delete_pages(P1) == FULL // PAGE
    second.next()
    out = second.result()
    assert out[0]["tokens"] == ref["P1"]
    assert out[0]["cached"] == 0, "P1 was served from pages kvtierd no longer holds"
    assert "kvtier: load failed (6 of 6 host pages are gone" in second.log()
    assert out[1]["tokens"] == ref["P3"]
    assert out[1]["cached"] == FULL, "P3's host pages did not come back from kvtierd"
    second.close()
    assert lab.daemon.check() == []
