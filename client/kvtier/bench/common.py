"""The benchmark's defaults, its statistics (percentiles, ratios) and sizes."""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvtier.units import MiB, parse_size

DEFAULT_SIZES = "64KiB,512KiB,2MiB,8MiB"
DEFAULT_BATCH = 32
DEFAULT_SECONDS = 1.5
DEFAULT_CLIENTS = "1,2"
#: Latency samples per call kind (after LATENCY_WARMUP unrecorded rounds).
LATENCY_SAMPLES = 2000
LATENCY_WARMUP = 200
#: Keys per lookup in the latency section (the issue's "lookup of 64 keys").
LOOKUP_KEYS = 64
#: How long the daemon's idle CPU is measured before the latency section.
IDLE_SECONDS = 2.0
#: Untimed batches before each throughput measurement (extent growth, mapping, caches).
WARMUP_BATCHES = 2
#: Extent size of the daemon the benchmark starts (quick runs use a smaller one).
BENCH_EXTENT = 256 * MiB
QUICK_EXTENT = 32 * MiB
#: Namespaces are ``bench-<block bytes>`` under this model uid.
MODEL_UID = "kvtier-bench"
#: How long a worker may take for one task before the run is declared stuck.
TASK_TIMEOUT = 600.0
BARRIER_TIMEOUT = 120.0
#: Client transports measured side by side: ``fast`` (FastCall frames on the session
#: socket, ``Client(fast_path=True)``) and ``grpc`` (``Client(fast_path=False)``).
TRANSPORTS = ("fast", "grpc")
TRANSPORT_NAMES = {"fast": "fast", "grpc": "gRPC"}
#: Throughput backend -> the Client's ``fast_path`` argument ("kvtier": the client's default).
KV_BACKENDS: dict[str, bool | None] = {"kvtier-fast": True, "kvtier-grpc": False, "kvtier": None}
BACKEND_TRANSPORT = {"kvtier-fast": "fast", "kvtier-grpc": "grpc"}
#: Bytes per message of the raw Unix-socket round trip.
RAW_MSG_BYTES = 64
#: Clock ticks per second of /proc/PID/stat's utime and stime.
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: The kvtier calls of a latency round: name -> (label, RPCs).
LATENCY_CALLS: dict[str, tuple[str, int]] = {
    "lookup": (f"lookup {LOOKUP_KEYS} keys", 1),
    "acquire_release": ("acquire + release, 1 key", 2),
    "acquire": ("  acquire, 1 key", 1),
    "release": ("  release", 1),
    "reserve_commit": ("reserve + commit, 1 key", 2),
    "reserve": ("  reserve, 1 key", 1),
    "commit": ("  commit", 1),
    "delete": ("delete, 1 key", 1),
}

Row = dict[str, Any]


# =====================================================================  helpers

def positive_size(text: str) -> int:
    """A size from the command line (:func:`kvtier.units.parse_size`: ``64K`` is 64 KiB), > 0."""
    try:
        n = parse_size(text)
    except ValueError as exc:
        raise ValueError(f"bad size: {exc}") from None
    if n <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return n


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in 0..100, got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is missing or the denominator is not positive."""
    if num is None or den is None or not den > 0 or math.isnan(num):
        return None
    return num / den


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """n, p50, p99, mean, min, max of a list of seconds."""
    return {
        "n": len(samples),
        "p50_s": percentile(samples, 50),
        "p99_s": percentile(samples, 99),
        "mean_s": sum(samples) / len(samples),
        "min_s": min(samples),
        "max_s": max(samples),
    }


def slots_per_extent(block_bytes: int, extent_bytes: int) -> int:
    """How many slots of ``block_bytes`` one extent holds (mirrors the daemon's layout)."""
    page = 4096
    slot = -(-block_bytes // page) * page
    n = max(0, (extent_bytes - page) // (slot + 128))
    while n > 0 and -(-(page + n * 128) // page) * page + n * slot > extent_bytes:
        n -= 1
    return max(n, 1)  # a block larger than an extent gets a one-slot extent of its own


def capacity_for(sizes: Sequence[int], slots: int, extent_bytes: int) -> int:
    """DRAM budget for ``slots`` live blocks of every size at once, plus one spare extent.

    Each size is its own namespace with its own extents, and extents are not
    given back when their keys are deleted, so the budget is the sum.
    """
    total = 0
    for size in sizes:
        per = slots_per_extent(size, extent_bytes)
        one = max(extent_bytes, size + 2 * 4096)
        total += -(-slots // per) * one
    return total + extent_bytes


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_json(path: str | None, doc: Any, indent: int | None = 2, end: str = "") -> None:
    """``doc`` as JSON at ``path`` (then ``end``); nothing when ``path`` is empty (no ``--json``)."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump(doc, f, indent=indent)
        f.write(end)


def write_results(path: str | None, res: Any) -> None:
    """A run's raw results at ``path`` (``--json``; nothing without it), and a line saying so."""
    if path:
        write_json(path, res, end="\n")
        progress(f"raw results written to {path}")


def ipc_round_trip_us(n: int, msg_bytes: int = 512) -> float:
    """The median round trip of a small message to another process and back (a
    SOCK_SEQPACKET socket pair, as between kvtierd and its agent or a client): what any
    hop between two processes costs on this machine, the floor of every answer."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    echo = subprocess.Popen(
        [sys.executable, "-c", "import socket,sys\ns=socket.socket(fileno=int(sys.argv[1]))\n"
         "while (d := s.recv(65536)):\n    s.send(d)", str(theirs.fileno())],
        pass_fds=[theirs.fileno()])
    theirs.close()
    try:
        ts = []
        msg = b"x" * msg_bytes
        for _ in range(n):
            t0 = time.perf_counter()
            ours.send(msg)
            ours.recv(65536)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6
    finally:
        ours.close()
        echo.wait(10)
