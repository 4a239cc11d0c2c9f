"""CPU meters from ``/proc``: a process's ticks per call, and how busy the machine was
with other work while a figure was taken."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.bench.common import CLK_TCK


def cpu_per(ticks: int | None, calls: int, scale: float) -> float | None:
    """``ticks`` of CPU time spread over ``calls``, in seconds x ``scale`` (1e6: us)."""
    if ticks is None or calls <= 0:
        return None
    return ticks / CLK_TCK / calls * scale


class ProcCpu:
    """utime + stime of one process (all its threads), in clock ticks, from
    ``/proc/PID/stat`` (kept open; each read is one ``pread``, a few us).

    ``start()`` then ``mark(name)`` after each call charges the ticks since the
    previous read to ``name`` (in ``ticks``).  The kernel counts in ticks of
    1/``CLK_TCK`` s (10 ms), so one call gets 0 or a tick or more: only sums
    over many calls mean anything.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        self.ticks: dict[str, int] = {}
        try:
            self._last = self.read()
        except BaseException:
            os.close(self._fd)
            raise

    @classmethod
    def open(cls, pid: int | None) -> ProcCpu | None:
        """A reader of ``pid``, or None when there is no pid or its stat cannot be read."""
        if pid is None:
            return None
        try:
            return cls(pid)
        except (OSError, ValueError, IndexError):
            return None

    def read(self) -> int:
        fields = os.pread(self._fd, 4096, 0).rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime

    def start(self) -> None:
        self._last = self.read()

    def mark(self, name: str) -> None:
        now = self.read()
        self.ticks[name] = self.ticks.get(name, 0) + now - self._last
        self._last = now

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class CpuMeter:
    """How busy the machine was with *other* work while something was measured.

    Reads ``/proc/stat`` (all CPUs, steal included) and ``/proc/PID/stat`` of
    the processes of this run; ``foreign`` = (busy CPU time not spent by
    them) / (elapsed time x CPUs).  0 on a quiet machine; 0.5 on two CPUs
    means one was taken by someone else.  None when /proc cannot be read.
    """

    def __init__(self, pids: Callable[[], Sequence[int]]) -> None:
        self._pids = pids
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._start: tuple[float, float, float] | None = None

    @staticmethod
    def machine() -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
        return float(sum(v[:8]) - idle)

    def _ours(self) -> float:
        total = 0.0
        for pid in self._pids():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total

    def start(self) -> None:
        try:
            self._start = (time.monotonic(), self.machine(), self._ours())
        except OSError:
            self._start = None

    def stop(self) -> float | None:
        if self._start is None:
            return None
        try:
            t1, busy1, ours1 = time.monotonic(), self.machine(), self._ours()
        except OSError:
            return None
        t0, busy0, ours0 = self._start
        cpus = os.cpu_count() or 1
        elapsed = (t1 - t0) * self._tick * cpus
        if elapsed <= 0:
            return None
        return max(0.0, ((busy1 - busy0) - (ours1 - ours0)) / elapsed)


def daemon_idle_cpu(pid: int | None, seconds: float) -> dict[str, Any]:
    """The daemon's CPU while nobody calls it, over ``seconds``: ``idle_cpu`` (share of one
    CPU) and ``idle_cpu_ticks``; what the per-call figures include as background."""
    cpu = ProcCpu.open(pid)
    if cpu is None:
        return {"idle_cpu": None, "idle_cpu_ticks": None}
    try:
        t0 = time.monotonic()
        cpu.start()
        time.sleep(seconds)
        cpu.mark("idle")
        elapsed = time.monotonic() - t0
    finally:
        cpu.close()
    ticks = cpu.ticks["idle"]
    return {"idle_cpu": ticks / CLK_TCK / elapsed, "idle_cpu_ticks": ticks,
            "idle_cpu_seconds": elapsed}
