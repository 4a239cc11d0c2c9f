"""``kvtier bench``'s command line and the run: servers up, baselines, throughput, latency,
targets; everything stopped and removed at the end."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import platform
import signal
import sys
import tempfile
import time
import uuid
from typing import Any

import numpy as np

from kvtier import __version__, _accel
from kvtier._admin import fetch_stats, wait_serving
from kvtier.bench.common import (
    BENCH_EXTENT,
    CLK_TCK,
    DEFAULT_BATCH,
    DEFAULT_CLIENTS,
    DEFAULT_SECONDS,
    DEFAULT_SIZES,
    IDLE_SECONDS,
    LATENCY_SAMPLES,
    LATENCY_WARMUP,
    LOOKUP_KEYS,
    QUICK_EXTENT,
    RAW_MSG_BYTES,
    TRANSPORTS,
    WARMUP_BATCHES,
    capacity_for,
    positive_size,
    progress,
    ratio,
    write_results,
)
from kvtier.bench.copies import measure_memcpy, measure_moving_copy, memcpy_summary
from kvtier.bench.latency import measure_latency
from kvtier.bench.meters import CpuMeter, daemon_idle_cpu
from kvtier.bench.report import fmt_x, render
from kvtier.bench.servers import own_daemon, own_echo_server, own_redis, peer_pid
from kvtier.bench.targets import add_cross_ratios, evaluate_targets
from kvtier.bench.workers import Workers, aggregate
from kvtier.units import GiB, KiB, format_bytes

BENCH_EPILOG = f"""\
what is measured:
  latency     rounds of: a raw round trip ({RAW_MSG_BYTES} B sendall + recv on a blocking Unix
              socket, to an echo server process started here), an empty gRPC call (health
              Check), then lookup of {LOOKUP_KEYS} keys, acquire + release, reserve + commit and
              delete of 1 key with a fast-path client and with a gRPC client, alternating which
              goes first; p50/p99 of each, as multiples of the empty call and the raw round trip
  throughput  put and get of --batch blocks per call, backends kvtier-fast, kvtier-grpc and
              Redis, with 1 and 2 client processes, as multiples of single-thread memcpy
  server CPU  the daemon's (Redis rows: redis-server's) utime+stime from /proc/PID/stat,
              per call (latency; summed over the whole loop per call and transport) and per
              batch (throughput; over the timed loop, for put with the untimed deletes).  It
              comes in clock ticks (10 ms), so it means something only over many calls: the
              tick count is printed beside it; --quick runs count few ticks.  The daemon's
              CPU while idle ({IDLE_SECONDS:g} s before the latency section) is shown too
  targets     issue 14's (on the fast-path rows) and the earlier ones (on the gRPC rows;
              those vs Redis on both)

If the daemon does not offer the fast path, the fast rows are reported as unavailable."""


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvtier bench",
        description="kvtier put/get throughput and call latency over both client transports\n"
        "(the fast path on the session socket, and gRPC), as ratios to single-thread memcpy,\n"
        "the empty gRPC call, a raw Unix-socket round trip and Redis, all measured in the\n"
        "same run (docs/benchmarks.md).",
        epilog=BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--socket", metavar="DIR",
                   help="use the running daemon at DIR instead of starting one")
    p.add_argument("--sizes", default=None, help=f"block sizes (default {DEFAULT_SIZES})")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="keys per call (default 32)")
    p.add_argument("--seconds", type=float, default=None,
                   help=f"time budget of each throughput measurement (default {DEFAULT_SECONDS})")
    p.add_argument("--clients", default=DEFAULT_CLIENTS,
                   help="client process counts to run (default 1,2)")
    p.add_argument("--latency-samples", type=int, default=None,
                   help=f"latency rounds: samples per call and transport (default {LATENCY_SAMPLES})")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis comparison")
    p.add_argument("--require-redis", action="store_true",
                   help="fail (exit 1) when Redis cannot be run, instead of skipping it")
    p.add_argument("--capacity", default=None,
                   help="DRAM capacity of the daemon started here (default: computed)")
    p.add_argument("--extent-size", default=None,
                   help=f"extent size of the daemon started here (default {format_bytes(BENCH_EXTENT, exact=True)})")
    p.add_argument("--daemon-set", metavar="KEY=VALUE", action="append", default=[],
                   help="a setting of the daemon started here, as kvtierd --set (repeatable; "
                        "e.g. server.write_grant_bytes=64MiB for writes without a call)")
    p.add_argument("--quick", action="store_true",
                   help="tiny run for tests: one size, short budgets, few samples")
    p.add_argument("--json", metavar="FILE", help="write every raw number to FILE")
    args = p.parse_args(argv)
    try:
        sizes_text = args.sizes or ("64KiB" if args.quick else DEFAULT_SIZES)
        args.size_list = [positive_size(s) for s in sizes_text.split(",") if s.strip()]
        args.client_list = sorted({int(c) for c in args.clients.split(",") if c.strip()})
        args.capacity_bytes = positive_size(args.capacity) if args.capacity else None
        args.extent_bytes = (positive_size(args.extent_size) if args.extent_size
                             else QUICK_EXTENT if args.quick else BENCH_EXTENT)
    except ValueError as exc:
        p.error(str(exc))
    if args.quick and args.sizes is None:
        args.size_list = args.size_list[:1]
    if not args.size_list or not args.client_list or min(args.client_list) < 1:
        p.error("--sizes and --clients need at least one positive value each")
    if args.batch < 1:
        p.error("--batch must be >= 1")
    if args.seconds is None:
        args.seconds = 0.25 if args.quick else DEFAULT_SECONDS
    if args.latency_samples is None:
        args.latency_samples = 200 if args.quick else LATENCY_SAMPLES
    if args.no_redis and args.require_redis:
        p.error("--no-redis and --require-redis contradict each other")
    return args


def machine() -> dict[str, Any]:
    import grpc

    cpu = platform.processor() or ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) * KiB
    load = os.getloadavg()
    return {
        "hostname": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "mem_bytes": mem,
        "kernel": platform.release(), "python": platform.python_version(),
        "numpy": np.__version__, "grpcio": grpc.__version__, "kvtier": __version__,
        "native_copy": _accel.NATIVE, "loadavg_at_start": list(load),
    }


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every section; returns the raw results (what ``--json`` writes)."""
    run = uuid.uuid4().hex[:8]
    started = time.time()
    sizes: list[int] = args.size_list
    clients: list[int] = args.client_list
    quick = args.quick
    warmup = LATENCY_WARMUP // 10 if quick else LATENCY_WARMUP
    res: dict[str, Any] = {
        "format": 2,
        "command": ["kvtier", "bench", *args.argv],
        "started": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(),
        "machine": machine(),
        "config": {"sizes": sizes, "batch": args.batch, "seconds": args.seconds,
                   "clients": clients, "quick": quick, "warmup_batches": WARMUP_BATCHES,
                   "latency_samples": args.latency_samples, "latency_warmup": warmup,
                   "raw_msg_bytes": RAW_MSG_BYTES, "clk_tck": CLK_TCK},
        "daemon": {"own": args.socket is None},
        "redis": {"available": False, "reason": "--no-redis"} if args.no_redis else {},
        "echo_server": {},
        "transports": {},
        "memcpy": [], "floor": None, "raw_rtt": None, "latency": [], "throughput": [],
        "targets": [],
    }
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtb-", dir="/tmp"))
        redis_path: str | None = None
        if not args.no_redis:
            redis_path = stack.enter_context(own_redis(workdir, res["redis"]))
            if redis_path is None:
                if args.require_redis:
                    raise RuntimeError(f"Redis is required but unavailable: {res['redis']['reason']}")
                progress(f"skipping Redis: {res['redis']['reason']}")
        progress("starting the echo server of the raw Unix-socket round trip")
        echo_path = stack.enter_context(own_echo_server(workdir, res["echo_server"]))
        if args.socket is None:
            # Live slots per namespace: every client's batch at once, or the latency
            # section's lookup keys plus the one each client reserves (in the smallest size).
            live = max(max(clients) * args.batch, LOOKUP_KEYS + len(TRANSPORTS))
            capacity = args.capacity_bytes or capacity_for(sizes, live, args.extent_bytes)
            socket_dir = stack.enter_context(own_daemon(workdir, capacity, args.extent_bytes,
                                                        res["daemon"], args.daemon_set))
        else:
            socket_dir = args.socket
            wait_serving(socket_dir, None, timeout=5)
            res["daemon"].update(socket_dir=socket_dir,
                                 pid=peer_pid(os.path.join(socket_dir, "kvtier.sock")))
        daemon_pid: int | None = res["daemon"].get("pid")
        redis_pid: int | None = res["redis"].get("pid")
        progress(f"starting {max(clients)} client process(es)")
        workers = Workers(max(clients), socket_dir, redis_path, clients)
        stack.callback(workers.close)
        workers.call([{"kind": "ping"}] * max(clients))
        ours = [os.getpid(), *(p.pid for p in workers.procs)] + [
            pid for pid in (daemon_pid, redis_pid, res["echo_server"].get("pid")) if pid]
        meter = CpuMeter(lambda: ours)
        res["daemon"].update(daemon_idle_cpu(daemon_pid, 0.5 if quick else IDLE_SECONDS))

        progress(f"latency: {args.latency_samples} rounds of raw round trip, empty gRPC call, "
                  f"then lookup({LOOKUP_KEYS}), acquire/release, reserve/commit, delete over "
                  "the fast path and over gRPC")
        meter.start()
        lat = measure_latency(socket_dir, min(sizes), run, args.latency_samples, warmup,
                              echo_path, daemon_pid)
        res["floor"], res["raw_rtt"] = lat["floor"], lat["raw_rtt"]
        res["latency"], res["transports"] = lat["rows"], lat["transports"]
        res["floor"]["foreign_cpu"] = meter.stop()
        if not res["transports"]["fast"]["available"]:
            progress(f"fast path unavailable: {res['transports']['fast']['reason']}")

        kv_backends = [f"kvtier-{tr}" for tr in TRANSPORTS if res["transports"][tr]["available"]]
        server_pid = {b: daemon_pid for b in kv_backends} | {"redis": redis_pid}
        for si, block in enumerate(sizes):
            progress(f"{format_bytes(block, exact=True)}: memcpy baselines")
            mc_budget, mc_reps = (0.05, 3) if quick else (0.4, 5)
            meter.start()
            before = measure_memcpy(block, args.batch, mc_budget, mc_reps)
            before["foreign_cpu"] = meter.stop()
            # Provisional denominator for the progress lines; the final one adds the after-run reps.
            mc = memcpy_summary(before, None)
            for oi, op in enumerate(("put", "get")):
                # Both transports back to back (which goes first alternates), then Redis.
                backends = (kv_backends if (si + oi) % 2 == 0 else kv_backends[::-1]) + (
                    ["redis"] if redis_path else [])
                common = {"kind": op, "block": block, "batch": args.batch, "run": run,
                          "seconds": args.seconds, "min_iters": 2 if quick else 3}
                stores = kv_backends[:1] + (["redis"] if redis_path else [])
                if op == "get":  # the get keys, once per store
                    for b in stores:
                        workers.call([{**common, "kind": "prep_get", "backend": b}])
                n1: dict[str, int] = {}
                for n in clients:
                    for backend in backends:
                        task: dict[str, Any] = {**common, "backend": backend, "clients": n,
                                                "server_pid": server_pid.get(backend)}
                        if n > 1:
                            if backend in n1:
                                task["iters"] = max(common["min_iters"], math.ceil(n1[backend] / n))
                            else:  # no 1-client run to size it by: calibrate on time
                                task["seconds"] = args.seconds / n
                        progress(f"{format_bytes(block, exact=True)}: {backend} {op}, {n} client(s)")
                        meter.start()
                        per = workers.call([task] * n)
                        row = aggregate(backend, op, block, args.batch, per, mc["bytes_per_s"])
                        row["foreign_cpu"] = meter.stop()
                        n1.setdefault(backend, max(1, row["iters"]))
                        res["throughput"].append(row)
                        progress(f"{format_bytes(block, exact=True)}: {backend} {op}, {n} client(s): "
                                  f"{row['bytes_per_s'] / GiB:.2f} GiB/s "
                                  f"({fmt_x(row['x_memcpy'])} memcpy)")
                if op == "get":
                    for b in stores:
                        workers.call([{**common, "kind": "drop_get", "backend": b}])
            progress(f"{format_bytes(block, exact=True)}: memcpy baseline again")
            mc = memcpy_summary(before, measure_memcpy(block, args.batch, mc_budget, mc_reps,
                                                       one_block=False))
            mc["moving_bytes_per_s"] = measure_moving_copy(block, args.batch, mc_budget, mc_reps)
            res["memcpy"].append(mc)
            for row in res["throughput"]:
                if row["block_bytes"] == block:
                    row["x_memcpy"] = ratio(row["bytes_per_s"], mc["bytes_per_s"])
                    row["x_moving"] = ratio(row["bytes_per_s"], mc["moving_bytes_per_s"])

        with contextlib.suppress(Exception):
            s = fetch_stats(socket_dir, timeout=10)
            res["daemon"].update(evictions=s.evictions, mlocked=s.mlocked,
                                 mlock_error=s.mlock_error, prefault_seconds=s.prefault_seconds,
                                 daemon_version=s.daemon_version)
    add_cross_ratios(res["throughput"])
    res["targets"] = evaluate_targets(res)
    res["duration_s"] = time.time() - started
    res["machine"]["loadavg_at_end"] = list(os.getloadavg())
    return res


def main(argv: list[str]) -> int:
    """``kvtier bench [options]``; see ``--help``.

    A leading ``--`` is dropped (older scripts wrote ``kvtier bench -- ...``).
    """
    argv = list(argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    args = _parse_args(argv)
    args.argv = list(argv)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        res = run_bench(args)
    except KeyboardInterrupt:
        print("kvtier bench: interrupted (daemon, echo server and Redis stopped, shm removed)", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"kvtier bench: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)
    print(render(res))
    write_results(args.json, res)
    return 0
