"""``kvtier bench``: put/get throughput and call latency against baselines of the same run.

Everything is reported as a ratio to something measured in the same run on
the same machine, because absolute numbers on a shared box are noise:

* **memcpy**: single-thread ``numpy.copyto`` of each block of a batch (32
  distinct, resident source blocks into 32 distinct, pre-faulted destination
  blocks: the same working set a put or a get moves).  Throughputs are given
  as a multiple of it.  ``copy_into`` (the native, possibly multi-threaded
  copy the put path uses) and a single-block copy (source and destination
  reused, so cache-resident up to a few MiB) are reported beside it.
* **the empty gRPC call**: the gRPC health ``Check`` on the daemon's socket,
  the cheapest unary call Python can make there (the "floor").  Each kvtier
  call's p50/p99 is given as a multiple of it.
* **the raw Unix-socket round trip**: ``sendall`` of 64 bytes and ``recv`` of
  the echo on a blocking Unix stream socket, from Python, to a tiny echo
  server (a separate Python process on a socket in the run's temp directory):
  the least any call over a socket can cost from Python.
* **Redis**: ``redis-server`` started here on a Unix socket (no persistence),
  driven with redis-py: put = one pipeline of ``batch`` SETs, get = one MGET.

Both client transports are measured in the same run: ``fast`` is a
``kvtier.Client(fast_path=True)`` (its calls are FastCall frames on the
session socket), ``gRPC`` one with ``fast_path=False``.  If the daemon does
not offer the fast path (``server.fast_path: false``, an older daemon), the
fast rows are reported as unavailable.  Throughput backends are
``kvtier-fast``, ``kvtier-grpc`` and ``redis``.

Latency: ``--latency-samples`` rounds (after some unrecorded warm-up rounds),
each of one raw round trip, one empty gRPC call, then the kvtier calls
(lookup of 64 present keys, acquire + release of 1, reserve + commit of 1,
delete of 1) with the fast client and with the gRPC client, alternating which
of the two goes first, so both see the same noise of the machine.

A put is ``reserve`` -> copy each block into its shared-memory slot ->
``commit``; a get is ``acquire`` -> ``np.copyto`` each leased view into a
pre-faulted buffer -> ``release``.  The keys of each put batch are deleted
after it, outside the timed region, so the store never has to evict; before
timing, the namespace is grown to the slots every client holds at once (so
no timed reserve waits for a new extent) and each client does
``WARMUP_BATCHES`` untimed batches.  Two client processes (``--clients
1,2``) start together at a barrier and do the same number of batches (half
the single client's each); their aggregate throughput is the bytes of both
over the timed seconds of the slower one.  The measurements of one op, size
and client count run back to back for every backend.  Each figure also
records how busy the machine was with other work meanwhile (``foreign_cpu``).

Server CPU: the daemon's (for Redis rows redis-server's) utime + stime from
``/proc/PID/stat``, read before and after each call of the latency rounds
(outside the timed region; summed per call and transport over the whole
loop) and at the start and end of each throughput loop (for put it includes
the delete of each batch's keys, which the loop does untimed).  The kernel
reports it in clock ticks (``SC_CLK_TCK``, 10 ms at 100 Hz), so a single call
is charged 0 or a whole tick and only the sum over many calls means
something: the tick count is reported beside each figure, and figures from
few ticks (``--quick``) are rough.  The daemon's CPU while nobody calls it
(over ``IDLE_SECONDS`` before the latency section) is reported too: the
background every figure includes.  None when the pid is unknown or /proc
cannot be read (e.g. a ``--socket`` daemon of another user).

With no ``--socket`` the benchmark starts its own ``kvtierd`` (temp sockets,
a fresh ``/dev/shm/kvtier-bench-*`` directory, metrics off) and stops it and
removes its directory at the end, also on an error or Ctrl-C; so it does
with the echo server and Redis.

The modules: ``run`` (the command line and the run), ``servers`` (its own kvtierd,
Redis, the echo server), ``private_daemon`` (the one way a benchmark or a test starts
a kvtierd of its own), ``workers`` (throughput), ``latency``, ``copies`` (the memcpy
baselines), ``meters`` (``/proc`` CPU), ``targets`` (pass/fail goals), ``report``
(the text tables) and ``common`` (defaults and statistics).
"""

from __future__ import annotations

from kvtier.bench.common import (
    BACKEND_TRANSPORT,
    CLK_TCK,
    DEFAULT_BATCH,
    DEFAULT_SECONDS,
    LATENCY_CALLS,
    LATENCY_SAMPLES,
    LATENCY_WARMUP,
    LOOKUP_KEYS,
    MODEL_UID,
    RAW_MSG_BYTES,
    TASK_TIMEOUT,
    WARMUP_BATCHES,
    capacity_for,
    percentile,
    positive_size,
    progress,
    ratio,
    slots_per_extent,
    summarize,
    write_json,
    write_results,
)
from kvtier.bench.copies import measure_moving_copy
from kvtier.bench.latency import NO_FAST_PATH, latency_rows, latency_sample
from kvtier.bench.meters import CpuMeter, ProcCpu, cpu_per
from kvtier.bench.private_daemon import (
    SHM_PREFIX,
    die_with_parent,
    remove_stale_shm_dirs,
    stop_process,
)
from kvtier.bench.report import fmt_pct, render
from kvtier.bench.run import machine, main, run_bench
from kvtier.bench.servers import own_echo_server, raw_rtt_sample, tail
from kvtier.bench.targets import add_cross_ratios, evaluate_targets
from kvtier.bench.workers import Worker, aggregate, serve_tasks

__all__ = [
    "BACKEND_TRANSPORT", "CLK_TCK", "DEFAULT_BATCH", "DEFAULT_SECONDS", "LATENCY_CALLS",
    "LATENCY_SAMPLES", "LATENCY_WARMUP", "LOOKUP_KEYS", "MODEL_UID", "NO_FAST_PATH",
    "RAW_MSG_BYTES", "SHM_PREFIX", "TASK_TIMEOUT", "WARMUP_BATCHES", "CpuMeter", "ProcCpu",
    "Worker", "add_cross_ratios", "aggregate", "capacity_for", "cpu_per", "die_with_parent",
    "evaluate_targets", "fmt_pct", "latency_rows", "latency_sample", "machine", "main",
    "measure_moving_copy", "own_echo_server", "percentile", "positive_size", "progress",
    "ratio", "raw_rtt_sample", "remove_stale_shm_dirs", "render", "run_bench", "serve_tasks",
    "slots_per_extent", "stop_process", "summarize", "tail",
    "write_json", "write_results",
]
