#!/usr/bin/env python3
"""The cost of the checks: access control and quotas on vs off, in the same run.

Issue 6's target: put/get throughput and lookup latency with access control
and quotas on within 5% of the same daemon with them off.  This starts two
``kvtierd`` that differ only in their ``access`` section:

* **ON**: ``access.enabled=true``, explicit ``admin`` and ``default`` lists,
  8 namespace rules with globs (uid, gid and group principals, quotas on
  most), the benchmark's namespaces (``bench-<block bytes>``) matching the
  *last* rule, whose DRAM quota is the whole pool (so it never evicts);
  ``limits`` at their defaults.  A probe checks that the policy is in force:
  root may not open a session on ``locked/probe`` (rule 1 grants it only to
  uid 4242) on ON, and may on OFF.
* **OFF**: ``access.enabled=false``.

Both: the same capacity and extent size, SSD tier off, metrics off, text
logs, fresh ``/dev/shm/kvtier-bench-access-*`` directories.  Each round starts
a fresh pair (the first one started alternates), so a fixed difference
between two daemon processes (memory layout, hash seed) is noise across
rounds rather than a bias of one configuration.  In each round, one client
process holding a client of each daemon times, with ``kvtier bench``'s own
batch functions:

* put and get throughput of 32-key batches of 2 MiB and of 64 KiB blocks
  (1 client): batches go to ON and OFF alternately, ABBA (ON, OFF, OFF, ON,
  ...), ``--seconds`` for each configuration, after an untimed pass (extents
  grown, keys stored) and a wait for both daemons to go idle;
* ``kvtier bench``'s latency round (empty gRPC call, ``lookup`` of 64 present
  keys, acquire+release, reserve+commit, delete of 1 key), the daemon order
  alternating ABBA from round to round of calls; judged: lookup p50 and p99.

Each round gives one ON/OFF ratio per metric; the verdict is on the median
over the rounds: throughput ratio >= 0.95, latency ratio <= 1.05.  The empty
call (the health ``Check``, which no access rule touches) is reported as a
control.  ``--aa`` runs the same with access off on both daemons: the
method's own noise.

    .venv/bin/python bench/access.py [--quick] [--rounds 6] [--aa] [--json FILE]

Both daemons are stopped and their shm and temp directories removed at the
end, also on an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import grp
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

from kvtier import bench as kb
from kvtier._admin import fetch_stats
from kvtier._fmt import table
from kvtier.bench.private_daemon import (
    daemon_args,
    start_private_daemon,
    stop_private_daemon,
)
from kvtier.errors import KVTierError, PermissionDenied
from kvtier.units import GiB, format_bytes
from kvtierd.config import config_to_dict, load_config

CONFIGS = ("on", "off")
DEFAULT_SIZES = "2MiB,64KiB"
DEFAULT_ROUNDS = 6
DEFAULT_CAPACITY = "1536MiB"
THROUGHPUT_GOAL = 0.95  # ON/OFF throughput ratio at least this
LATENCY_GOAL = 1.05  # ON/OFF latency ratio at most this
PROBE_NAMESPACE = "locked/probe"

#: (latency row name, statistic, label, short label, judged) of the latency figures reported.
LATENCY_METRICS = (
    ("lookup", "p50_s", f"lookup {kb.LOOKUP_KEYS} keys p50", "lookup p50", True),
    ("lookup", "p99_s", f"lookup {kb.LOOKUP_KEYS} keys p99", "lookup p99", True),
    ("empty", "p50_s", "empty call p50 (control)", "empty p50", False),
    ("acquire_release", "p50_s", "acquire+release 1 key p50", "acq+rel p50", False),
    ("reserve_commit", "p50_s", "reserve+commit 1 key p50", "res+com p50", False),
)


def access_overrides(capacity: int) -> list[str]:
    """``--set`` items of the ON daemon: a realistic policy; ``bench-*`` is the last rule."""
    group = grp.getgrgid(os.getgid()).gr_name  # a group that resolves on any host
    rules: list[dict[str, Any]] = [
        # Root may not read or write here (the probe); it still administers it (access.admin).
        {"match": "locked/*", "read": ["uid:4242"], "write": ["uid:4242"],
         "admin": ["uid:4242"]},
        {"match": "tenant-a/*", "read": ["gid:4100", "uid:4101"], "write": ["uid:4101"],
         "admin": ["uid:4102"], "dram_quota": "64GiB", "ssd_quota": "1TiB"},
        {"match": "tenant-b/*/bf16", "read": ["gid:4200"], "write": ["uid:4201", "uid:4202"],
         "dram_quota": "32GiB", "ssd_quota": "512GiB"},
        {"match": "qwen3-*/tp[1248]/*", "read": ["gid:4300", f"group:{group}"],
         "write": ["uid:4301"], "dram_quota": "16GiB"},
        {"match": "llama-3-??b/*", "read": ["*"], "write": ["uid:4401"],
         "dram_quota": "16GiB", "ssd_quota": "256GiB"},
        {"match": "prod/*/kv", "read": ["gid:4500"], "write": ["gid:4500"],
         "admin": ["uid:4502"], "dram_quota": "8GiB"},
        {"match": "staging/*", "read": ["gid:4600", "uid:4601"], "write": ["uid:4601"],
         "ssd_quota": "64GiB"},
        # The benchmark's namespaces: root matches last in each list, and through a group.
        {"match": "bench-*", "read": ["uid:4701", f"group:{group}", "uid:0"],
         "write": ["uid:4701", "uid:0"], "admin": ["uid:4702"],
         "dram_quota": capacity, "ssd_quota": "64GiB"},
    ]
    return [
        "access.enabled=true",
        "access.admin=" + json.dumps(["uid:0", f"group:{group}"]),
        "access.default=" + json.dumps(["uid:0"]),
        "access.namespaces=" + json.dumps(rules),
    ]


def daemon_overrides(name: str, socket_dir: str, shm_dir: str, capacity: int,
                     extent: int, aa: bool = False) -> list[str]:
    common = [
        f"server.socket_dir={socket_dir}",
        f"dram.shm_dir={shm_dir}",
        f"dram.capacity={capacity}",
        f"dram.extent_size={extent}",
        "metrics.address=",
        "spill.ssd_dir=",  # DRAM only
        "log.format=text",
    ]
    on = name == "on" and not aa
    return common + (access_overrides(capacity) if on else ["access.enabled=false"])


def check_config(name: str, overrides: list[str], sizes: list[int],
                 aa: bool = False) -> dict[str, Any]:
    """Load the daemon's config here first: it must parse, and ON must route the bench
    namespaces to the last rule.  Returns its effective access and limits sections."""
    cfg = load_config(None, env={}, overrides=overrides)
    if name == "on" and not aa:
        rules = cfg.access.namespaces
        if not cfg.access.enabled or len(rules) != 8:
            raise RuntimeError("the ON config does not have access enabled with 8 rules")
        for block in sizes:
            rule = cfg.access.rule_for(f"bench-{block}")
            if rule is not rules[-1]:
                raise RuntimeError(f"bench-{block} does not match the last rule but {rule}")
    elif cfg.access.enabled:
        raise RuntimeError("the OFF config has access enabled")
    d = config_to_dict(cfg)
    return {"access": d["access"], "limits": d["limits"]}


@contextlib.contextmanager
def own_daemon(name: str, workdir: str, capacity: int, extent: int, sizes: list[int],
               info: dict[str, Any], aa: bool = False) -> Iterator[str]:
    """One private kvtierd on temp sockets and a fresh shm directory; yields its socket dir."""
    socket_dir = os.path.join(workdir, f"sock-{name}")
    shm_dir = f"{kb.SHM_PREFIX}access-{name}-{uuid.uuid4().hex[:12]}"
    overrides = daemon_overrides(name, socket_dir, shm_dir, capacity, extent, aa)
    info.update(check_config(name, overrides, sizes, aa))
    info.update(capacity=capacity, extent_size=extent, shm_dir=shm_dir, socket_dir=socket_dir,
                args=daemon_args(socket_dir, shm_dir, overrides)[1:])
    kb.progress(f"starting kvtierd {name.upper()} (capacity {format_bytes(capacity, exact=True)}, "
                f"extents {format_bytes(extent, exact=True)}, shm {shm_dir})")
    d = start_private_daemon(socket_dir, *overrides, shm_dir=shm_dir,
                             log_path=os.path.join(workdir, f"kvtierd-{name}.log"),
                             bound_to_parent=True)
    info["pid"] = d.pid
    try:
        yield socket_dir
    finally:
        stop_private_daemon(d)
        info["exit_status"] = d.proc.returncode
        if d.proc.returncode not in (0, None):
            kb.progress(f"kvtierd {name.upper()} exited with status {d.proc.returncode}; "
                        f"log tail:\n{d.log_tail(4000)}")


def probe(socket_dir: str) -> str:
    """Open (and close) a session on PROBE_NAMESPACE: "ok" or the error's class name."""
    from kvtier.client import Client

    try:
        with Client(socket_dir, namespace=PROBE_NAMESPACE, block_bytes=4096,
                    model_uid=kb.MODEL_UID) as c:
            c.lookup([b"probe"])
    except PermissionDenied:
        return "PermissionDenied"
    except KVTierError as exc:
        return type(exc).__name__
    return "ok"


def _cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return 0


def wait_idle(pids: list[int], window: float = 0.3, timeout: float = 10.0) -> float:
    """Wait until ``pids`` used no CPU for ``window`` seconds (or ``timeout``); the seconds waited."""
    t0 = time.monotonic()
    last = sum(_cpu_ticks(p) for p in pids)
    while time.monotonic() - t0 < timeout:
        time.sleep(window)
        now = sum(_cpu_ticks(p) for p in pids)
        if now == last:
            break
        last = now
    return time.monotonic() - t0


def machine() -> dict[str, Any]:
    m = kb.machine()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        m["git_head"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True, text=True, timeout=10, check=False).stdout.strip() or None
    with contextlib.suppress(OSError):
        with open("/proc/loadavg") as f:
            m["proc_loadavg_at_start"] = f.read().strip()
    return m


def median(xs: list[float]) -> float:
    return kb.percentile(xs, 50)


# =====================================================================  client worker
def abba(i: int, first: int = 0) -> tuple[str, str]:
    """The order of pair ``i``: ON, OFF, OFF, ON, ON, OFF, ... (shifted by ``first``)."""
    return CONFIGS if (i + first) % 2 == 0 else (CONFIGS[1], CONFIGS[0])


class _PairWorker(kb.Worker):
    """``kvtier bench``'s client worker with one client per daemon.

    A ``pair`` task times put or get batches (``kvtier bench``'s own batch
    functions) on both daemons alternately, ABBA, so drift hits both alike;
    one process for both, so no difference between two client processes can
    pass for one between the daemons.
    """

    def __init__(self) -> None:
        super().__init__(0, "", None, {})
        self.pair_clients: dict[tuple[str, int], Any] = {}

    def close(self) -> None:
        for c in self.pair_clients.values():
            with contextlib.suppress(Exception):
                c.close()
        self.pair_clients.clear()
        super().close()

    def client_of(self, sock: str, block: int) -> Any:
        from kvtier.client import Client

        c = self.pair_clients.get((sock, block))
        if c is None:
            for key in [k for k in self.pair_clients if k[1] != block or not os.path.exists(k[0])]:
                with contextlib.suppress(Exception):  # other sizes, daemons of past rounds
                    self.pair_clients.pop(key).close()
            c = Client(sock, namespace=f"bench-{block}", block_bytes=block, model_uid=kb.MODEL_UID)
            self.pair_clients[(sock, block)] = c
        return c

    def run(self, t: dict[str, Any]) -> dict[str, Any]:
        if t["kind"] != "pair":
            return super().run(t)
        op_name, block, batch, run = t["op"], t["block"], t["batch"], t["run"]
        sockets: dict[str, str] = t["sockets"]
        first: int = t.get("first", 0)
        bufs = self.blocks(block, batch)
        get_keys = [f"{run}-g-{block}-{i}".encode() for i in range(batch)]
        ops: dict[str, Any] = {}
        afters: dict[str, Any] = {}
        for name in abba(0, first):  # who goes first alternates, even here
            c = self.client_of(sockets[name], block)
            if op_name == "put":
                # Grow the namespace first, as kvtier bench does: no timed reserve waits
                # for a new extent.
                self._prealloc(c, run, block, batch, 1)
                ops[name] = self._kv_put(c, bufs)
                afters[name] = c.delete
            else:
                c.put(get_keys, list(bufs))  # stores only what is not there yet
                if c.lookup(get_keys) != batch:
                    raise RuntimeError(f"{name}: get keys missing after put")
                ops[name] = self._kv_get(c, bufs)
                afters[name] = lambda keys: None

        def one(name: str) -> tuple[float, ...]:
            keys = self.fresh_keys(run, block, batch) if op_name == "put" else get_keys
            parts = ops[name](keys)
            afters[name](keys)
            return tuple(parts)

        for i in range(2 * kb.WARMUP_BATCHES):
            for name in abba(i, first):
                one(name)
        parts: dict[str, list[tuple[float, ...]]] = {n: [] for n in CONFIGS}
        start = time.perf_counter()
        i = 0
        while True:
            for name in abba(i, first):
                parts[name].append(one(name))
            i += 1
            if i >= t["min_iters"] and i % 2 == 0 and time.perf_counter() - start >= t["seconds"]:
                break  # an even number of pairs: each configuration went first as often
        out: dict[str, Any] = {"pairs": i, "wall_s": time.perf_counter() - start}
        for name in CONFIGS:
            ps = parts[name]
            batch_s = [sum(p) for p in ps]
            nbytes = len(ps) * batch * block
            out[name] = {
                "iters": len(ps), "bytes": nbytes, "timed_s": sum(batch_s),
                "bytes_per_s": nbytes / sum(batch_s),
                "phase_s": [sum(p[k] for p in ps) for k in range(len(ps[0]))],
                "batch_p50_s": kb.percentile(batch_s, 50), "batch_p99_s": kb.percentile(batch_s, 99),
            }
        return out


def _worker_main(conn: multiprocessing.connection.Connection) -> None:
    """Entry point of the spawned client process: run tasks from ``conn`` until None or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    kb.serve_tasks(conn, _PairWorker())


class Worker:
    """The spawned client process, driven over a pipe."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), name="kvtier-bench-access",
                                daemon=True)
        self.proc.start()
        child.close()

    def call(self, task: dict[str, Any]) -> dict[str, Any]:
        self.conn.send(task)
        deadline = time.monotonic() + kb.TASK_TIMEOUT
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(f"bench worker died (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench worker took over {kb.TASK_TIMEOUT:.0f} s for one task")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"bench worker failed:\n{value}")
        return dict(value)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


# =====================================================================  latency
LATENCY_CALLS = ("empty", "lookup", "acquire_release", "acquire", "release",
                 "reserve_commit", "reserve", "commit", "delete")


def measure_latency_pair(sockets: dict[str, str], block: int, run: str, samples: int,
                         warmup: int, first: int, pool: dict[str, dict[str, list[float]]],
                         ) -> dict[str, dict[str, dict[str, float]]]:
    """``kvtier bench``'s latency round (empty call, lookup of 64 keys, acquire+release,
    reserve+commit and delete of 1 key) on both daemons, the daemon order of each round
    ABBA; per daemon and call: n, p50, p99, mean, min, max.  The samples are also
    appended to ``pool[daemon][call]``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvtier._core import grpc_options, socket_paths
    from kvtier.client import Client

    t: dict[str, dict[str, list[float]]] = {n: {c: [] for c in LATENCY_CALLS} for n in CONFIGS}
    keys = [f"{run}-l-{i}".encode() for i in range(kb.LOOKUP_KEYS)]
    req = health_pb2.HealthCheckRequest(service="")
    with contextlib.ExitStack() as stack:
        health, clients = {}, {}
        for name in abba(0, first):
            ch = stack.enter_context(grpc.insecure_channel(
                f"unix:{socket_paths(sockets[name])[0]}", options=grpc_options()))
            health[name] = health_pb2_grpc.HealthStub(ch)
            c = clients[name] = stack.enter_context(Client(
                sockets[name], namespace=f"bench-{block}", block_bytes=block,
                model_uid=kb.MODEL_UID))
            c.put(keys, [b"\x01"] * len(keys))
            if c.lookup(keys) != len(keys):
                raise RuntimeError(f"{name}: latency keys are not all present")
        for i in range(warmup + samples):
            for name in abba(i, first):
                try:
                    sample = kb.latency_sample(health[name], req, clients[name], keys,
                                               f"{run}-r-{i}".encode())
                except RuntimeError as exc:
                    raise RuntimeError(f"{name}: {exc}") from None
                if i >= warmup:
                    for call, dt in sample.items():
                        t[name][call].append(dt)
        for c in clients.values():
            c.delete(keys)
    for n in CONFIGS:
        for call, v in t[n].items():
            pool.setdefault(n, {}).setdefault(call, []).extend(v)
    return {n: {call: kb.summarize(v) for call, v in t[n].items()} for n in CONFIGS}


# =====================================================================  the run
def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.time()
    sizes: list[int] = args.size_list
    run_id = uuid.uuid4().hex[:8]
    res: dict[str, Any] = {
        "format": 1,
        "command": ["bench/access.py", *args.argv],
        "started": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(),
        "machine": machine(),
        "config": {"sizes": sizes, "batch": args.batch, "seconds": args.seconds,
                   "clients": 1, "rounds": args.rounds, "quick": args.quick,
                   "latency_samples": args.latency_samples, "latency_warmup": args.warmup,
                   "aa_control": args.aa,
                   "warmup_batches": kb.WARMUP_BATCHES, "capacity": args.capacity_bytes,
                   "extent_size": args.extent_bytes,
                   "goals": {"throughput_ratio_min": THROUGHPUT_GOAL,
                             "latency_ratio_max": LATENCY_GOAL}},
        "daemons": {name: {} for name in CONFIGS},
        "rounds": [],
    }
    for stale in kb.remove_stale_shm_dirs():
        kb.progress(f"removed {stale} (left by a benchmark that was killed)")
    expected_probe = {"on": "ok" if args.aa else "PermissionDenied", "off": "ok"}
    with contextlib.ExitStack() as outer:
        workdir = outer.enter_context(tempfile.TemporaryDirectory(prefix="kvtb-access-",
                                                                  dir="/tmp"))
        worker = Worker()
        outer.callback(worker.close)
        worker.call({"kind": "ping"})
        pids: list[int] = []
        meter = kb.CpuMeter(lambda: pids)
        pool: dict[str, dict[str, list[float]]] = {}  # every latency sample of every round
        for rnd in range(args.rounds):
            # Fresh daemons every round, started in alternating order: a fixed difference
            # between two daemon processes (where they landed in memory, their hash seeds)
            # becomes noise across rounds instead of a bias of one configuration.
            first = abba(rnd)
            rec: dict[str, Any] = {"round": rnd, "started_first": first[0],
                                   "loadavg": list(os.getloadavg()), "daemons": {},
                                   "throughput": {}, "latency": {}}
            kb.progress(f"round {rnd + 1}/{args.rounds}: loadavg {rec['loadavg'][0]:.2f}")
            rdir = os.path.join(workdir, f"r{rnd}")
            os.mkdir(rdir)
            with contextlib.ExitStack() as stack:
                sockets = {}
                for name in first:
                    info: dict[str, Any] = {}
                    rec["daemons"][name] = info
                    sockets[name] = stack.enter_context(own_daemon(
                        name, rdir, args.capacity_bytes, args.extent_bytes, sizes, info, args.aa))
                    if not res["daemons"][name]:
                        res["daemons"][name] = {k: info[k] for k in ("access", "limits", "args")}
                    info.pop("access")
                    info.pop("limits")
                probes = {name: probe(sockets[name]) for name in first}
                rec["probe"] = probes
                if probes != expected_probe:
                    raise RuntimeError(f"access policy not in force as configured: probe {probes}")
                pids[:] = [os.getpid(), worker.proc.pid or 0,
                           *(rec["daemons"][n]["pid"] for n in CONFIGS)]
                common = {"kind": "pair", "batch": args.batch, "run": run_id,
                          "sockets": sockets, "min_iters": 2 if args.quick else 3}
                # Untimed: one short pass of every measurement (extents created, keys
                # stored, mappings made, code paths warm), then let the daemons go idle.
                for block in sizes:
                    for op in ("put", "get"):
                        worker.call({**common, "op": op, "block": block, "seconds": 0.0,
                                     "min_iters": 1, "first": rnd})
                rec["settle_s"] = wait_idle([rec["daemons"][n]["pid"] for n in CONFIGS])
                j = 0
                for block in sizes:
                    for op in ("put", "get"):
                        key = f"{op} {format_bytes(block, exact=True)}"
                        meter.start()
                        out = worker.call({**common, "op": op, "block": block,
                                           "seconds": 2 * args.seconds, "first": rnd + j})
                        out["foreign_cpu"] = meter.stop()
                        rec["throughput"][key] = out
                        j += 1
                        kb.progress(f"  {key}: ON {out['on']['bytes_per_s'] / GiB:.2f} OFF "
                                     f"{out['off']['bytes_per_s'] / GiB:.2f} GiB/s (ON/OFF "
                                     f"{out['on']['bytes_per_s'] / out['off']['bytes_per_s']:.3f}"
                                     f", {out['pairs']} pairs)")
                meter.start()
                lat = measure_latency_pair(sockets, min(sizes), f"{run_id}-{rnd}",
                                           args.latency_samples, args.warmup, rnd + j, pool)
                rec["latency"] = {"foreign_cpu": meter.stop(), **lat}
                lk = {n: lat[n]["lookup"] for n in CONFIGS}
                kb.progress(
                    f"  lookup p50: ON {lk['on']['p50_s'] * 1e3:.3f} OFF "
                    f"{lk['off']['p50_s'] * 1e3:.3f} ms; p99: ON "
                    f"{lk['on']['p99_s'] * 1e3:.3f} OFF {lk['off']['p99_s'] * 1e3:.3f} ms")
                for name in CONFIGS:
                    with contextlib.suppress(Exception):
                        st = fetch_stats(sockets[name], timeout=10)
                        rec["daemons"][name].update(evictions=st.evictions, mlocked=st.mlocked,
                                                    prefault_seconds=st.prefault_seconds)
            res["rounds"].append(rec)
    res["pooled_latency"] = {n: {call: kb.summarize(v) for call, v in calls.items()}
                             for n, calls in pool.items()}
    res["metrics"] = summarize(res)
    res["duration_s"] = time.time() - started
    res["machine"]["loadavg_at_end"] = list(os.getloadavg())
    return res


def summarize(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per metric: each round's ON and OFF value and ratio, their medians, the verdict."""
    rounds = res["rounds"]
    out: list[dict[str, Any]] = []
    batch = res["config"]["batch"]

    def add(name: str, short: str, kind: str, unit: str, judged: bool, on: list[float],
            off: list[float], other_cpu: list[float], pooled: float | None) -> None:
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        r = median(ratios)
        if kind == "throughput":
            goal, met = f">= {THROUGHPUT_GOAL}", r >= THROUGHPUT_GOAL
        else:
            goal, met = f"<= {LATENCY_GOAL}", r <= LATENCY_GOAL
        out.append({
            "name": name, "short": short, "kind": kind, "unit": unit, "judged": judged,
            "on": on, "off": off, "ratios": ratios,
            "on_median": median(on), "off_median": median(off),
            "ratio_median": r, "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratio_of_medians": median(on) / median(off),
            # throughput: all bytes / all timed seconds of every round, ON over OFF;
            # latency: the statistic over the samples of every round together, ON over OFF
            "ratio_pooled": pooled,
            "other_cpu_median": median(other_cpu) if other_cpu else None,
            "goal": goal, "met": met if judged else None,
        })

    for block in res["config"]["sizes"]:
        for op in ("put", "get"):
            key = f"{op} {format_bytes(block, exact=True)}"
            on = [rd["throughput"][key]["on"]["bytes_per_s"] for rd in rounds]
            off = [rd["throughput"][key]["off"]["bytes_per_s"] for rd in rounds]
            cpu = [rd["throughput"][key]["foreign_cpu"] for rd in rounds
                   if rd["throughput"][key]["foreign_cpu"] is not None]
            short = f"{op} {format_bytes(block, exact=True).replace('i', '')}"
            figs = [rd["throughput"][key] for rd in rounds]
            pooled = {n: sum(f[n]["bytes"] for f in figs) / sum(f[n]["timed_s"] for f in figs)
                      for n in CONFIGS}
            add(f"{key} x{batch}, 1 client", short, "throughput", "GiB/s", True, on, off, cpu,
                pooled["on"] / pooled["off"])
    for row, stat, label, short, judged in LATENCY_METRICS:
        on = [rd["latency"]["on"][row][stat] for rd in rounds]
        off = [rd["latency"]["off"][row][stat] for rd in rounds]
        cpu = [rd["latency"]["foreign_cpu"] for rd in rounds
               if rd["latency"]["foreign_cpu"] is not None]
        pl = res.get("pooled_latency") or {}
        add(label, short, "latency", "ms", judged, on, off, cpu,
            pl["on"][row][stat] / pl["off"][row][stat] if pl else None)
    return out


# =====================================================================  output
def render(res: dict[str, Any]) -> str:
    m, c = res["machine"], res["config"]
    la0, la1 = m["loadavg_at_start"], m["loadavg_at_end"]
    on = res["daemons"]["on"]
    rules = on["access"]["namespaces"]
    out = [
        f"kvtier access bench: {m['cpu']} ({m['cpus']} CPUs), Python {m['python']}, "
        f"grpcio {m['grpcio']}, native copy {'on' if m['native_copy'] else 'OFF'}",
        f"{c['rounds']} rounds (fresh daemons each), ON/OFF alternating ABBA batch by batch and "
        f"sample by sample; batch {c['batch']} keys, 1 client, {c['seconds']} s per throughput "
        f"figure, {c['latency_samples']} latency samples; capacity {format_bytes(c['capacity'], exact=True)}, extents "
        f"{format_bytes(c['extent_size'], exact=True)}; run took {res['duration_s']:.0f} s",
        f"loadavg at start {la0[0]:.2f} {la0[1]:.2f} {la0[2]:.2f}, at end "
        f"{la1[0]:.2f} {la1[1]:.2f} {la1[2]:.2f}",
        ("A/A CONTROL (--aa): 'ON' is a second daemon with access.enabled=false" if c["aa_control"]
         else f"ON: access.enabled=true, {len(rules)} namespace rules, bench-* is rule "
         f"{len(rules)} ({rules[-1]['match']!r}, dram_quota {rules[-1]['dram_quota']}); limits "
         + ", ".join(f"{k} {v}" for k, v in on["limits"].items())),
        f"OFF: access.enabled=false.  Probe every round (root opens {PROBE_NAMESPACE!r}): "
        f"ON {res['rounds'][0]['probe']['on']}, OFF {res['rounds'][0]['probe']['off']}",
        "",
        "== ON/OFF per metric: ON, OFF = medians over rounds; ON/OFF = median of the rounds' "
        "ratios (judged), [min-max] of them;",
        "   pooled = ON/OFF of all rounds together (bytes / seconds; the percentile over every "
        "sample) ==",
    ]
    rows = [["metric", "unit", "ON", "OFF", "ON/OFF", "[min-max]", "pooled", "other CPU", "goal",
             "met"]]
    for x in res["metrics"]:
        scale = 1 / GiB if x["unit"] == "GiB/s" else 1e3
        rows.append([
            x["name"], x["unit"], f"{x['on_median'] * scale:.3f}", f"{x['off_median'] * scale:.3f}",
            f"{x['ratio_median']:.3f}", f"[{x['ratio_min']:.3f}-{x['ratio_max']:.3f}]",
            "-" if x["ratio_pooled"] is None else f"{x['ratio_pooled']:.3f}",
            kb.fmt_pct(x["other_cpu_median"]), x["goal"] if x["judged"] else "-",
            ("PASS" if x["met"] else "FAIL") if x["judged"] else "info"])
    out.append(table(rows))
    out += ["", "== ON/OFF ratio per round =="]
    rows = [["round", "1st start", "load1", *(x["short"] for x in res["metrics"])]]
    for i, rd in enumerate(res["rounds"]):
        rows.append([str(i + 1), rd["started_first"].upper(), f"{rd['loadavg'][0]:.2f}",
                     *(f"{x['ratios'][i]:.3f}" for x in res["metrics"])])
    out.append(table(rows))
    ev = {n: sum(rd["daemons"][n].get("evictions", 0) for rd in res["rounds"]) for n in CONFIGS}
    ml = {n: all(rd["daemons"][n].get("mlocked") for rd in res["rounds"]) for n in CONFIGS}
    out += ["", f"fresh daemons every round; evictions over all rounds ON {ev['on']}, OFF "
                f"{ev['off']}; mlocked ON {ml['on']}, OFF {ml['off']}"]
    judged = [x for x in res["metrics"] if x["judged"]]
    failed = [x["name"] for x in judged if not x["met"]]
    out.append(f"verdict: {len(judged) - len(failed)}/{len(judged)} judged metrics within 5%"
               + (f"; FAIL: {', '.join(failed)}" if failed else ""))
    return "\n".join(out)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/access.py",
        description="put/get throughput and lookup latency with access control and quotas on "
        "vs off, two daemons in the same run, interleaved (docs/benchmarks.md).")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"measurements of each configuration per metric (default {DEFAULT_ROUNDS})")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"block sizes (default {DEFAULT_SIZES})")
    p.add_argument("--batch", type=int, default=kb.DEFAULT_BATCH, help="keys per call (default 32)")
    p.add_argument("--seconds", type=float, default=None,
                   help=f"budget of each throughput figure (default {kb.DEFAULT_SECONDS})")
    p.add_argument("--latency-samples", type=int, default=None,
                   help=f"latency rounds per figure (default {kb.LATENCY_SAMPLES})")
    p.add_argument("--capacity", default=None,
                   help=f"DRAM capacity of each daemon (default {DEFAULT_CAPACITY})")
    p.add_argument("--extent-size", default=None, help="extent size (default 256 MiB)")
    p.add_argument("--quick", action="store_true",
                   help="tiny run for tests: 2 rounds, short budgets, small pools")
    p.add_argument("--aa", action="store_true",
                   help="A/A control: both daemons with access off (shows the method's noise)")
    p.add_argument("--json", metavar="FILE", help="write every raw number to FILE")
    args = p.parse_args(argv)
    q = args.quick
    try:
        args.size_list = [kb.positive_size(s) for s in args.sizes.split(",") if s.strip()]
        args.extent_bytes = kb.positive_size(args.extent_size or ("32MiB" if q else "256MiB"))
        # Live slots per namespace: the get keys, a put batch (or its pre-growth), the
        # latency section's lookup keys and the one key it reserves.
        need = kb.capacity_for(args.size_list, 2 * args.batch + kb.LOOKUP_KEYS + 1,
                               args.extent_bytes)
        args.capacity_bytes = (kb.positive_size(args.capacity) if args.capacity
                               else need if q else kb.positive_size(DEFAULT_CAPACITY))
    except ValueError as exc:
        p.error(str(exc))
    if args.capacity_bytes < need:
        p.error(f"--capacity must be at least {format_bytes(need, exact=True)} for these sizes")
    if not args.size_list or args.batch < 1:
        p.error("--sizes needs at least one size and --batch must be >= 1")
    args.rounds = args.rounds if args.rounds is not None else 2 if q else DEFAULT_ROUNDS
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.seconds is None:
        args.seconds = 0.1 if q else kb.DEFAULT_SECONDS
    if args.latency_samples is None:
        args.latency_samples = 50 if q else kb.LATENCY_SAMPLES
    args.warmup = 10 if q else kb.LATENCY_WARMUP
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.argv = list(argv)

    def on_signal(signum: int, frame: object) -> None:
        # The first Ctrl-C or SIGTERM stops the run; later ones (a second Ctrl-C, or
        # `timeout`, which signals the child and then its whole group) must not cut the
        # cleanup short, so they are ignored from here on.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        res = run(args)
    except KeyboardInterrupt:
        print("bench/access.py: interrupted (daemons stopped, shm removed)", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"bench/access.py: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print(render(res), flush=True)
    kb.write_results(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
