"""The text report: tables of throughput, latency and targets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier._fmt import table
from kvtier.bench.common import KV_BACKENDS, LATENCY_CALLS, TRANSPORT_NAMES, TRANSPORTS, Row, ratio
from kvtier.units import GiB, format_bytes


def fmt_rate(bps: float | None) -> str:
    return "-" if bps is None else f"{bps / GiB:.2f}"


def fmt_x(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}x" if abs(x) < 0.1 else f"{x:.2f}x"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3f}"


def fmt_cpu(value: float | None, ticks: int | None, digits: int) -> str:
    """A server-CPU figure with the clock ticks it comes from: ``41 (8)``."""
    return "-" if value is None or ticks is None else f"{value:.{digits}f} ({ticks})"


def render(res: dict[str, Any]) -> str:
    """The human-readable report (what ``kvtier bench`` prints)."""
    m = res["machine"]
    out = [
        f"kvtier bench: {m['cpu']} ({m['cpus']} CPUs), Python {m['python']}, numpy {m['numpy']}, "
        f"grpcio {m['grpcio']}, native copy {'on' if m['native_copy'] else 'OFF'}",
        f"batch {res['config']['batch']} keys, {res['config']['seconds']} s per measurement, "
        f"run took {res['duration_s']:.0f} s",
    ]
    trs = res.get("transports", {})
    fast = trs.get("fast", {})
    out.append("transports: fast path (FastCall frames on the session socket) and gRPC"
               if fast.get("available") else
               f"transports: gRPC only; fast path UNAVAILABLE ({fast.get('reason', '?')})")
    rd = res["redis"]
    out.append(f"Redis: {rd.get('version')} via redis-py {rd.get('redis_py')} on a Unix socket"
               if rd.get("available") else f"Redis: skipped ({rd.get('reason', '?')})")
    out += ["", "== Baseline: copy throughput (GiB/s) of one batch, 32 distinct resident blocks =="]
    out.append("   (into moving slots: copy_into successive windows of a shared-memory file, "
               "what a put's copy costs with no daemon)")
    rows = [["block", "memcpy 1 thread", "best", "copy_into", "1 block reused",
             "into moving slots", "other CPU"]]
    for mc in res["memcpy"]:
        rows.append([format_bytes(mc["block_bytes"], exact=True), fmt_rate(mc["bytes_per_s"]),
                     fmt_rate(mc["best_bytes_per_s"]), fmt_rate(mc["copy_into_bytes_per_s"]),
                     fmt_rate(mc["one_block_bytes_per_s"]),
                     fmt_rate(mc.get("moving_bytes_per_s")), fmt_pct(mc.get("foreign_cpu"))])
    out.append(table(rows))
    out += ["", render_throughput(res), "", render_latency(res), "", render_targets(res["targets"])]
    d = res["daemon"]
    facts = []
    if d.get("idle_cpu") is not None:
        facts.append(f"CPU when idle {d['idle_cpu']:.1%} of one CPU ({d['idle_cpu_ticks']} ticks "
                     f"in {d['idle_cpu_seconds']:.1f} s)")
    if "evictions" in d:
        facts.append(f"evictions {d['evictions']}, mlocked {d['mlocked']}, "
                     f"pre-fault {d['prefault_seconds']:.2f} s")
    if facts:
        out += ["", "daemon: " + ", ".join(facts)]
    return "\n".join(out)


def render_throughput(res: dict[str, Any]) -> str:
    """The throughput table: per op, size and client count, a row per backend."""
    out = ["== Throughput (GiB/s; fast / gRPC = kvtier over the fast path / over gRPC;",
           "   x memcpy = vs 1-thread memcpy above; x moving = vs the copy into moving slots;",
           "   x gRPC, x Redis = this backend vs that one;",
           "   server CPU = ms of kvtierd's (Redis: redis-server's) CPU per batch over the timed",
           "   loop, for put with its untimed deletes; in parentheses the 10 ms ticks counted;",
           "   other CPU = share of all CPUs busy with work outside this benchmark meanwhile) =="]
    rows = [["op", "block", "clients", "backend", "GiB/s", "x memcpy", "x moving", "x gRPC",
             "x Redis",
             "ms/batch: rpc+copy+rpc", "server CPU ms/batch", "other CPU"]]
    names = {"kvtier-fast": "fast", "kvtier-grpc": "gRPC", "kvtier": "kvtier", "redis": "Redis"}
    order = {b: i for i, b in enumerate(names)}
    groups: dict[tuple[str, int, int], list[Row]] = {}
    for r in res["throughput"]:
        groups.setdefault((r["op"], r["block_bytes"], r["clients"]), []).append(r)
    fast_missing = not res.get("transports", {}).get("fast", {}).get("available", True)
    for op in ("put", "get"):
        for block in res["config"]["sizes"]:
            for n in res["config"]["clients"]:
                group = sorted(groups.get((op, block, n), []), key=lambda r: order.get(r["backend"], 9))
                lead = [op, format_bytes(block, exact=True), str(n)]
                if fast_missing and group:
                    rows.append([*lead, "fast", "unavailable"] + ["-"] * 7)
                    lead = ["", "", ""]
                for r in group:
                    ph = list(r["phase_ms_per_batch"].values())
                    kv = r["backend"] in KV_BACKENDS
                    backend: str = r["backend"]
                    rows.append([*lead, names.get(backend, backend),
                                 fmt_rate(r["bytes_per_s"]), fmt_x(r["x_memcpy"]),
                                 fmt_x(r.get("x_moving")),
                                 fmt_x(r.get("x_grpc")) if backend in ("kvtier-fast", "kvtier")
                                 else "",
                                 fmt_x(r.get("x_redis")) if kv else "",
                                 "+".join(f"{x:.2f}" for x in ph) if kv else f"{ph[0]:.2f}",
                                 fmt_cpu(r.get("server_cpu_ms_per_batch"),
                                          r.get("server_cpu_ticks"), 3),
                                 fmt_pct(r.get("foreign_cpu"))])
                    lead = ["", "", ""]
    return "\n".join([*out, table(rows, left=(0, 3))])


def render_latency(res: dict[str, Any]) -> str:
    """The latency table: the two baselines, then each kvtier call over each transport."""
    fl, raw = res["floor"], res.get("raw_rtt")
    out = [f"== Latency (ms, {fl['n']} samples each; each round: the raw round trip, the empty "
           "gRPC call, then",
           "   the calls over both transports, alternating which goes first; x empty = vs the "
           "empty gRPC call,",
           "   x raw = vs the raw Unix-socket round trip; daemon CPU = us of kvtierd's CPU per "
           "call over all rounds,",
           f"   in parentheses the 10 ms ticks counted; other CPU {fmt_pct(fl.get('foreign_cpu'))})"
           " =="]
    rows = [["call", "via", "RPCs", "p50", "p99", "p50 x empty", "p99 x empty", "p50 x raw",
             "p99/p50", "daemon CPU us"]]
    if raw:
        rows.append([f"raw Unix-socket round trip, {raw['msg_bytes']} B", "socket", "-",
                     fmt_ms(raw["p50_s"]), fmt_ms(raw["p99_s"]), fmt_x(raw["p50_x_floor"]),
                     fmt_x(raw["p99_x_floor"]), "1.00x",
                     fmt_x(ratio(raw["p99_s"], raw["p50_s"])), "-"])
    rows.append(["empty gRPC call (health Check)", "gRPC", "1", fmt_ms(fl["p50_s"]),
                 fmt_ms(fl["p99_s"]), "1.00x", "1.00x", fmt_x(fl.get("p50_x_raw")),
                 fmt_x(ratio(fl["p99_s"], fl["p50_s"])),
                 fmt_cpu(fl.get("daemon_cpu_us"), fl.get("daemon_cpu_ticks"), 0)])
    by = {(r["transport"], r["name"]): r for r in res["latency"]}
    trs = res.get("transports", {})
    for name, (label, rpcs) in LATENCY_CALLS.items():
        first = True
        for tr in TRANSPORTS:
            lead = [label if first else "", TRANSPORT_NAMES[tr], str(rpcs)]
            first = False
            r = by.get((tr, name))
            if r is None:
                why = "unavailable" if not trs.get(tr, {}).get("available", True) else "-"
                rows.append([*lead, why] + ["-"] * 6)
                continue
            rows.append([*lead, fmt_ms(r["p50_s"]), fmt_ms(r["p99_s"]),
                         fmt_x(r["p50_x_floor"]), fmt_x(r["p99_x_floor"]),
                         fmt_x(r.get("p50_x_raw")), fmt_x(r.get("p99_x_p50")),
                         fmt_cpu(r.get("daemon_cpu_us"), r.get("daemon_cpu_ticks"), 0)])
    return "\n".join([*out, table(rows, left=(0, 1))])


def render_targets(targets: Sequence[dict[str, Any]]) -> str:
    """The targets table (transport = the rows a target judges)."""
    rows = [["target", "via", "set by", "goal", "measured", "met"]]
    for t in targets:
        v = t["value"]
        rows.append([t["name"], TRANSPORT_NAMES.get(t.get("transport", ""), "-"),
                     t.get("source", "-"), t["goal"], fmt_x(v),
                     ("not measured" if v is None else "not judged") if t["met"] is None
                     else "yes" if t["met"] else "NO"])
    return "\n".join(["== Targets ==", table(rows, left=(0, 1, 2, 5))])
