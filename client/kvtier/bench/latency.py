"""Call latency: interleaved rounds of a raw round trip, the empty gRPC call and each
kvtier call over both transports, with the daemon's CPU per call."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Sequence
from typing import Any

from kvtier.bench.common import (
    LATENCY_CALLS,
    LOOKUP_KEYS,
    MODEL_UID,
    RAW_MSG_BYTES,
    TRANSPORTS,
    Row,
    ratio,
    summarize,
)
from kvtier.bench.meters import ProcCpu, cpu_per
from kvtier.bench.servers import raw_rtt_sample


def latency_sample(health: Any, req: Any, c: Any, keys: Sequence[bytes], fresh: bytes,
                   cpu: ProcCpu | None = None) -> dict[str, float]:
    """One round of the latency calls with client ``c``: an empty health Check (unless
    ``health`` is None), a lookup of ``keys``, acquire + release of the first,
    reserve + commit + delete of ``fresh``.  Seconds per call (and per pair of calls),
    by name.  With ``cpu`` the daemon's CPU ticks are read before and after each call
    (outside the timed region) and added to ``cpu.ticks`` under the same names."""
    pc = time.perf_counter
    out: dict[str, float] = {}
    if cpu is not None:
        cpu.start()
    if health is not None:
        t0 = pc()
        health.Check(req, timeout=10)
        out["empty"] = pc() - t0
        if cpu is not None:
            cpu.mark("empty")
    t0 = pc()
    hits = c.lookup(keys)
    out["lookup"] = pc() - t0
    if cpu is not None:
        cpu.mark("lookup")
    t0 = pc()
    lease = c.acquire(keys[:1])
    out["acquire"] = pc() - t0
    if cpu is not None:
        cpu.mark("acquire")
    leased = lease.hits
    t0 = pc()
    lease.release()
    out["release"] = pc() - t0
    if cpu is not None:
        cpu.mark("release")
    t0 = pc()
    r = c.reserve([fresh])
    out["reserve"] = pc() - t0
    if cpu is not None:
        cpu.mark("reserve")
    t0 = pc()
    r.commit()
    out["commit"] = pc() - t0
    if cpu is not None:
        cpu.mark("commit")
    t0 = pc()
    c.delete([fresh])
    out["delete"] = pc() - t0
    if cpu is not None:
        cpu.mark("delete")
    if hits != len(keys) or leased != 1:
        raise RuntimeError("latency keys went missing during the run")
    out["acquire_release"] = out["acquire"] + out["release"]
    out["reserve_commit"] = out["reserve"] + out["commit"]
    return out


#: Why the fast rows are missing when the daemon did not grant the fast path.
NO_FAST_PATH = ("the daemon does not offer the fast path (server.fast_path: false, "
                "or a daemon without it)")


def latency_rows(t: dict[str, dict[str, list[float]]], floor: dict[str, Any],
                 raw: dict[str, Any] | None,
                 ticks: dict[str, dict[str, int] | None]) -> list[Row]:
    """One row per kvtier call and transport (the transports in ``t``), in
    LATENCY_CALLS order: its summary, ratios to the empty gRPC call (``floor``) and
    the raw round trip (``raw``), p99/p50, and the daemon CPU per call when
    ``ticks[transport]`` has it (a composite row: the sum of its calls')."""
    parts = {"acquire_release": ("acquire", "release"), "reserve_commit": ("reserve", "commit")}
    rows: list[Row] = []
    for name, (label, rpcs) in LATENCY_CALLS.items():
        for tr in TRANSPORTS:
            if tr not in t:
                continue
            s = summarize(t[tr][name])
            tk = ticks.get(tr)
            n_ticks = None if tk is None else sum(tk.get(k, 0) for k in parts.get(name, (name,)))
            rows.append({
                "name": name, "label": label, "rpcs": rpcs, "transport": tr, **s,
                "p50_x_floor": ratio(s["p50_s"], floor["p50_s"]),
                "p99_x_floor": ratio(s["p99_s"], floor["p99_s"]),
                "p50_x_raw": ratio(s["p50_s"], raw["p50_s"]) if raw else None,
                "p99_x_raw": ratio(s["p99_s"], raw["p99_s"]) if raw else None,
                "p99_x_p50": ratio(s["p99_s"], s["p50_s"]),
                "daemon_cpu_ticks": n_ticks,
                "daemon_cpu_us": cpu_per(n_ticks, int(s["n"]), 1e6),
            })
    return rows


def measure_latency(socket_dir: str, block: int, run: str, samples: int, warmup: int,
                    raw_path: str | None = None, daemon_pid: int | None = None) -> dict[str, Any]:
    """Interleaved rounds of: the raw round trip (with ``raw_path``), the empty gRPC call,
    then lookup(64), acquire+release(1), reserve+commit(1), delete(1) with a fast-path
    client and a gRPC client, alternating which goes first.

    Returns ``floor`` (the empty call), ``raw_rtt`` (None without ``raw_path``),
    ``rows`` (:func:`latency_rows`) and ``transports`` (per transport: available, and
    why not).  With ``daemon_pid`` the daemon's CPU per call is counted over the
    recorded rounds.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvtier._core import grpc_options, socket_paths
    from kvtier.client import Client

    grpc_path, _ = socket_paths(socket_dir)
    keys = [f"{run}-l-{i}".encode() for i in range(LOOKUP_KEYS)]
    transports: dict[str, dict[str, Any]] = {}
    clients: dict[str, Any] = {}
    empty: list[float] = []
    raw: list[float] = []
    with contextlib.ExitStack() as stack:
        ch = stack.enter_context(grpc.insecure_channel(f"unix:{grpc_path}", options=grpc_options()))
        health = health_pb2_grpc.HealthStub(ch)
        req = health_pb2.HealthCheckRequest(service="")
        for tr in TRANSPORTS:
            c = stack.enter_context(Client(socket_dir, namespace=f"bench-{block}",
                                           block_bytes=block, model_uid=MODEL_UID,
                                           fast_path=tr == "fast"))
            if tr == "fast" and not c.fast_path:
                transports[tr] = {"available": False, "reason": NO_FAST_PATH}
                continue
            transports[tr] = {"available": True}
            clients[tr] = c
        sock: socket.socket | None = None
        if raw_path is not None:
            sock = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            sock.connect(raw_path)
        msg, buf = b"x" * RAW_MSG_BYTES, bytearray(RAW_MSG_BYTES)
        cpus: dict[str, ProcCpu | None] = {}
        for name in ("floor", *clients):
            cpus[name] = ProcCpu.open(daemon_pid)
            cpu = cpus[name]
            if cpu is not None:
                stack.callback(cpu.close)
        first = next(iter(clients.values()))
        first.put(keys, [b"\x01"] * len(keys))
        for tr, c in clients.items():
            if c.lookup(keys) != len(keys):
                raise RuntimeError(f"{tr}: latency keys are not all present")
        t: dict[str, dict[str, list[float]]] = {tr: {n: [] for n in LATENCY_CALLS} for tr in clients}
        order = list(clients)
        pc = time.perf_counter
        for i in range(warmup + samples):
            rec = i >= warmup
            if sock is not None:
                dt = raw_rtt_sample(sock, msg, buf)
                if rec:
                    raw.append(dt)
            floor_cpu = cpus["floor"] if rec else None
            if floor_cpu is not None:
                floor_cpu.start()
            t0 = pc()
            health.Check(req, timeout=10)
            dt = pc() - t0
            if floor_cpu is not None:
                floor_cpu.mark("empty")
            if rec:
                empty.append(dt)
            for tr in order if i % 2 == 0 else order[::-1]:
                sample = latency_sample(None, None, clients[tr], keys, f"{run}-r-{tr}-{i}".encode(),
                                        cpus[tr] if rec else None)
                if rec:
                    for name in LATENCY_CALLS:
                        t[tr][name].append(sample[name])
        if "fast" in clients and not clients["fast"].fast_path:
            raise RuntimeError("the fast-path client fell back to gRPC during the run")
        first.delete(keys)
    fc = cpus.get("floor")
    floor: dict[str, Any] = summarize(empty)
    floor_ticks = fc.ticks.get("empty", 0) if fc is not None else None
    floor.update(daemon_cpu_ticks=floor_ticks, daemon_cpu_us=cpu_per(floor_ticks, len(empty), 1e6))
    raw_rtt: dict[str, Any] | None = None
    if raw:
        raw_rtt = {**summarize(raw), "msg_bytes": RAW_MSG_BYTES}
        raw_rtt.update(p50_x_floor=ratio(raw_rtt["p50_s"], floor["p50_s"]),
                       p99_x_floor=ratio(raw_rtt["p99_s"], floor["p99_s"]))
    floor.update(p50_x_raw=ratio(floor["p50_s"], raw_rtt["p50_s"]) if raw_rtt else None)
    ticks = {tr: (None if (cp := cpus.get(tr)) is None else cp.ticks) for tr in clients}
    return {"floor": floor, "raw_rtt": raw_rtt, "rows": latency_rows(t, floor, raw_rtt, ticks),
            "transports": transports}
