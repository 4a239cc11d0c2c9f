"""The test side of ``engine.py``: start one engine process and drive its phases.

Used by the connector's engine tests, the parity tests and ``bench/parity.py``.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from tests.engine_zygote import Forked
from tests.vllm.logs import failure_excerpt
from tests.vllm.pdlab import child_env, vllm_zygote

HERE = os.path.dirname(os.path.abspath(__file__))
#: Seconds an engine may take to start or to answer one phase.
ENGINE_DEADLINE = 240.0
#: The connector's deadline (``timeout``) in the engines of labs that start several side
#: by side: a deadline measures the host, and six engines starting on a 2-core machine
#: have kept one kvtierd call waiting past 5 s (the CI failure of a MLA save, all of its
#: blocks "not stored").  The tests of what a deadline does set their own.
LAB_CONNECTOR_TIMEOUT = 30.0
#: Characters of a hung engine's stacks a failure message keeps (its last ones).
HANG_STACKS_LIMIT = 40000


def _process_group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (from ``/proc``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the command (which may hold spaces): state, ppid, pgrp, ...
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
            pids.append(int(entry))
    return pids


class Engine:
    """A running engine.py: phases are driven with ``result()`` and ``next()``."""

    def __init__(self, base: str, spec: dict[str, Any], name: str, *,
                 python: str = sys.executable, script: str = os.path.join(HERE, "engine.py"),
                 env: dict[str, str] | None = None) -> None:
        """``script`` (vLLM's engine.py) run by ``python`` on ``spec``; ``env`` replaces
        the vLLM child's environment (``pdlab.child_env``) for other engines."""
        path = os.path.join(base, f"{name}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        self.log_path = os.path.join(base, f"{name}.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        if env is None:
            env = child_env(spec.pop("env", {}))
        # A hung engine's processes print every thread's Python stack on SIGABRT
        # (``stacks()``): the only account of where a hang sits that CI keeps.
        env.setdefault("PYTHONFAULTHANDLER", "1")
        self.proc: subprocess.Popen[str] | Forked
        vllm_engine = python == sys.executable and script == os.path.join(HERE, "engine.py")
        zygote = vllm_zygote() if vllm_engine else None
        if zygote is not None:  # forked from a process that imported vLLM already
            self.proc = zygote.fork([script, path], env, stdin=None, stdout=None,
                                    stderr=self._log.fileno())
        else:
            self.proc = subprocess.Popen([python, script, path],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._log, text=True, env=env,
                                         start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        """Protocol lines to the queue; everything else (vLLM logs to stdout) to the log."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(("RESULT ", "READY")):
                self._lines.put(line.rstrip("\n"))
            else:
                self._log.write(line)
                self._log.flush()
        self._lines.put(None)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def diagnosis(self) -> str:
        """Why the engine failed: every traceback and error in its log, then the tail."""
        return failure_excerpt(self.log())

    def stacks(self, pause: float = 1.0) -> str:
        """Abort the engine's processes (its process group) one at a time, newest first,
        and return the Python stacks they printed (``PYTHONFAULTHANDLER``): where a hung
        engine was waiting."""
        start = os.path.getsize(self.log_path)
        for pid in sorted(_process_group(self.proc.pid), reverse=True):
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                continue
            time.sleep(pause)  # one process's stacks at a time in the shared log
        with open(self.log_path, "rb") as f:
            f.seek(start)
            dumped = f.read().decode(errors="replace")
        return dumped[-HANG_STACKS_LIMIT:] or "(no stacks printed)"

    def result(self, timeout: float = ENGINE_DEADLINE) -> dict[str, Any]:
        """The next phase's RESULT (the engine started, or went on after ``next()``)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                why = self.diagnosis()
                raise AssertionError(f"no result from the engine in {timeout} s:\n{why}\n"
                                     f"--- its processes' stacks ---\n{self.stacks()}")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, f"the engine exited:\n{self.diagnosis()}"
            if line.startswith("RESULT "):
                out: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
                return out

    def next(self) -> None:
        """Let the engine run its next phase."""
        while True:
            line = self._lines.get(timeout=ENGINE_DEADLINE)
            assert line is not None, f"the engine exited:\n{self.diagnosis()}"
            if line == "READY":
                break
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # engine.py returns at its next READY
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
