"""Crash tests: SIGKILLed daemons and clients, damaged segment files, warm restarts.

Shared harness: ``Lab`` owns one shm directory reused across daemon restarts
and every process a test starts; the ``lab`` fixture (import ``lab_fixture``) kills them all and
removes the directory whatever happens.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import DaemonProc, start_daemon

WORKER = os.path.join(os.path.dirname(__file__), "crash_worker.py")


class Worker:
    """A crash_worker.py child: lines from its stdout arrive on a queue."""

    def __init__(self, proc: subprocess.Popen[str], name: str, err_path: str) -> None:
        self.proc = proc
        self.name = name
        self.err_path = err_path
        self.anomalies: list[str] = []
        self.notes: list[str] = []  # NOTE lines: tolerated events the test counts
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def stderr(self) -> str:
        try:
            with open(self.err_path) as f:
                return f.read()[-3000:]
        except FileNotFoundError:
            return ""

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout: float = 30) -> str:
        """The next line starting with ``prefix`` (ANOMALY lines are collected on the way)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"worker {self.name}: no {prefix!r} within {timeout} s; "
                                     f"stderr: {self.stderr()}")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait(10)
                raise AssertionError(f"worker {self.name} exited ({self.proc.returncode}) "
                                     f"before {prefix!r}; stderr: {self.stderr()}")
            if line.startswith("ANOMALY"):
                self.anomalies.append(line)
            elif line.startswith("NOTE"):
                self.notes.append(line)
            elif line.startswith(prefix):
                return line

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


class Lab:
    """One shm directory across daemon restarts, plus every process started in it."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.shm_dir = f"/dev/shm/kvtier-crash-{uuid.uuid4().hex[:12]}"
        self.daemons: list[DaemonProc] = []
        self.workers: list[Worker] = []

    @property
    def socket_dir(self) -> str:
        return os.path.join(self.workdir, "sock")

    def start(self, *extra: str, capacity: str = "32MiB", extent: str = "4MiB") -> DaemonProc:
        """A daemon on this lab's shm directory (warm if a previous one left segments)."""
        d = start_daemon(self.workdir, *extra, capacity=capacity, extent=extent,
                         shm_dir=self.shm_dir)
        self.daemons.append(d)
        return d

    def spawn(self, role: str, args: dict[str, Any], name: str = "") -> Worker:
        name = name or role
        err_path = os.path.join(self.workdir, f"worker-{name}-{uuid.uuid4().hex[:6]}.err")
        with open(err_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, WORKER, self.socket_dir, role, json.dumps(args)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                env={k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")},
            )
        w = Worker(proc, name, err_path)
        self.workers.append(w)
        return w

    def run(self, role: str, args: dict[str, Any], timeout: float = 120) -> str:
        """Run a one-shot step in a new process; its stdout."""
        out = subprocess.run(
            [sys.executable, WORKER, self.socket_dir, role, json.dumps(args)],
            capture_output=True, text=True, timeout=timeout,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    def segment_files(self) -> list[str]:
        """Every extent file in the shm directory: both halves of each extent (format 2 keeps
        an extent as ``<digest>.<index>.meta`` + ``<digest>.<index>.seg``), so a half left
        behind shows up too."""
        return sorted(f for f in os.listdir(self.shm_dir) if f.endswith((".meta", ".seg")))

    def close(self) -> None:
        for w in self.workers:
            try:
                w.kill()
            except Exception:  # best effort: keep cleaning up
                pass
        for d in self.daemons:
            if d.proc.poll() is None:
                d.proc.kill()
                try:
                    d.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        shutil.rmtree(self.shm_dir, ignore_errors=True)


@pytest.fixture(name="lab")
def lab_fixture(workdir: str) -> Iterator[Lab]:
    the_lab = Lab(workdir)
    try:
        yield the_lab
    finally:
        the_lab.close()
