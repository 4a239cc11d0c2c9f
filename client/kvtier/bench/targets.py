"""Pass/fail targets: the goals each figure is held to, and the ratios between
transports and backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.bench.common import (
    DEFAULT_BATCH,
    KV_BACKENDS,
    LATENCY_CALLS,
    LOOKUP_KEYS,
    TRANSPORTS,
    Row,
    ratio,
)
from kvtier.units import KiB, MiB, format_bytes


def add_cross_ratios(rows: list[Row]) -> None:
    """Each kvtier row's ``x_redis`` (vs Redis at the same op, size and clients) and
    ``x_grpc`` (vs kvtier-grpc there); None where the other was not measured."""
    by = {(r["backend"], r["op"], r["block_bytes"], r["clients"]): r for r in rows}
    for r in rows:
        if r["backend"] in KV_BACKENDS:
            key = (r["op"], r["block_bytes"], r["clients"])
            other = by.get(("redis", *key))
            r["x_redis"] = ratio(r["bytes_per_s"], other["bytes_per_s"]) if other else None
            g = by.get(("kvtier-grpc", *key))
            r["x_grpc"] = ratio(r["bytes_per_s"], g["bytes_per_s"]) if g else None


#: Issue 14's throughput goals: put and get of one client, batches of 32, vs 1-thread memcpy.
FAST_MEMCPY_GOALS = ((64 * KiB, 0.4), (512 * KiB, 0.8), (2 * MiB, 0.9), (8 * MiB, 0.9))
#: Issue 14: two clients' aggregate vs one client, at this size.
FAST_SCALING_BLOCK, FAST_SCALING_GOAL = 64 * KiB, 1.5
#: Issue 14's latency goals (fast path): p50 as a multiple of the empty gRPC call.
FAST_LOOKUP_X_FLOOR, FAST_LOOKUP_X_RAW, FAST_PAIR_X_FLOOR, FAST_P99_X_P50 = 0.05, 1.0, 0.2, 3.0
#: Issue 26 (the native block core): put of 64 KiB vs the copy into moving slots, of
#: 512 KiB vs memcpy; two clients' aggregate put vs one at both.  (Its reserve + commit
#: goal, <= 0.2x the empty call, is issue 14's.)
NATIVE_MOVING_GOAL, NATIVE_PUT_512K_GOAL, NATIVE_SCALING_GOAL = 0.8, 0.8, 1.6
#: The single calls whose p99/p50 issue 14 bounds.
FAST_P99_CALLS = ("lookup", "acquire", "release", "reserve", "commit", "delete")


def evaluate_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target, each with the transport whose rows it judges.

    The earlier targets (``source`` "core": 2 MiB vs memcpy and Redis, lookup(64)
    p50 <= 1.5x the empty call) judge the gRPC rows they were set on, the Redis
    ones also the fast rows; issue 14's judge the fast rows.  Throughput targets
    are judged only for batches of DEFAULT_BATCH; a figure not measured (a size
    not run, the fast path unavailable) has value None.
    """
    by = {(r["backend"], r["op"], r["block_bytes"], r["clients"]): r for r in res["throughput"]}
    lat = {(r["transport"], r["name"]): r for r in res["latency"]}
    batch = res["config"]["batch"]
    # The throughput targets are stated for batches of DEFAULT_BATCH; other batches are shown
    # but not judged (the per-call RPC cost is amortized over more or fewer bytes).
    judged = batch == DEFAULT_BATCH
    out: list[dict[str, Any]] = []

    def add(source: str, transport: str, name: str, goal: str, value: float | None,
            ok: Callable[[float], bool], judge: bool = True) -> None:
        met = None if value is None or not judge else ok(value)
        out.append({"source": source, "transport": transport, "name": name, "goal": goal,
                    "value": value, "met": met})

    def size(n: int) -> str:  # "64 KiB", as the earlier targets' "2 MiB"
        text = format_bytes(n, exact=True)
        num = text.rstrip("KMGTPEiB")
        return f"{num} {text[len(num):]}"

    def at_least(goal: float) -> Callable[[float], bool]:
        return lambda v: v >= goal

    def tput(tr: str, op: str, block: int, clients: int = 1) -> Row | None:
        return by.get((f"kvtier-{tr}", op, block, clients))

    def field(row: Row | None, key: str) -> float | None:
        return None if row is None else row.get(key)

    # ---- the earlier targets
    for op in ("put", "get"):
        add("core", "grpc", f"{op} 2 MiB x{batch}, 1 client, vs single-thread memcpy", ">= 0.7x",
            field(tput("grpc", op, 2 * MiB), "x_memcpy"), lambda v: v >= 0.7, judged)
    for tr in TRANSPORTS:
        for op in ("put", "get"):
            add("core", tr, f"{op} 2 MiB x{batch}, 1 client, vs Redis", ">= 5x",
                field(tput(tr, op, 2 * MiB), "x_redis"), lambda v: v >= 5.0, judged)
    add("core", "grpc", f"lookup {LOOKUP_KEYS} keys p50 vs empty gRPC call p50", "<= 1.5x",
        field(lat.get(("grpc", "lookup")), "p50_x_floor"), lambda v: v <= 1.5)

    # ---- issue 14, on the fast path
    lk = lat.get(("fast", "lookup"))
    add("issue 14", "fast", f"lookup {LOOKUP_KEYS} keys p50 vs empty gRPC call p50",
        f"<= {FAST_LOOKUP_X_FLOOR}x", field(lk, "p50_x_floor"), lambda v: v <= FAST_LOOKUP_X_FLOOR)
    add("issue 14", "fast", f"lookup {LOOKUP_KEYS} keys p50 vs raw Unix-socket round trip p50",
        f"<= {FAST_LOOKUP_X_RAW:g}x", field(lk, "p50_x_raw"), lambda v: v <= FAST_LOOKUP_X_RAW)
    for name in ("acquire_release", "reserve_commit"):
        label = LATENCY_CALLS[name][0]
        add("issue 14", "fast", f"{label} p50 vs empty gRPC call p50", f"<= {FAST_PAIR_X_FLOOR}x",
            field(lat.get(("fast", name)), "p50_x_floor"), lambda v: v <= FAST_PAIR_X_FLOOR)
    for op in ("put", "get"):
        for block, goal in FAST_MEMCPY_GOALS:
            add("issue 14", "fast",
                f"{op} {size(block)} x{batch}, 1 client, vs single-thread memcpy",
                f">= {goal}x", field(tput("fast", op, block), "x_memcpy"),
                at_least(goal), judged)
    for op in ("put", "get"):
        one, two = tput("fast", op, FAST_SCALING_BLOCK), tput("fast", op, FAST_SCALING_BLOCK, 2)
        add("issue 14", "fast",
            f"{op} {size(FAST_SCALING_BLOCK)} x{batch}, 2 clients aggregate "
            "vs 1 client", f">= {FAST_SCALING_GOAL}x",
            ratio(field(two, "bytes_per_s"), field(one, "bytes_per_s")),
            lambda v: v >= FAST_SCALING_GOAL, judged)
    for name in FAST_P99_CALLS:
        add("issue 14", "fast", f"{LATENCY_CALLS[name][0].strip()}: p99 vs its p50",
            f"<= {FAST_P99_X_P50:g}x", field(lat.get(("fast", name)), "p99_x_p50"),
            lambda v: v <= FAST_P99_X_P50)

    # ---- issue 26, on the fast path
    add("issue 26", "fast", f"put {size(64 * KiB)} x{batch}, 1 client, vs the copy into "
        "moving shared-memory slots", f">= {NATIVE_MOVING_GOAL}x",
        field(tput("fast", "put", 64 * KiB), "x_moving"), at_least(NATIVE_MOVING_GOAL), judged)
    add("issue 26", "fast", f"put {size(512 * KiB)} x{batch}, 1 client, vs single-thread "
        "memcpy", f">= {NATIVE_PUT_512K_GOAL}x", field(tput("fast", "put", 512 * KiB), "x_memcpy"),
        at_least(NATIVE_PUT_512K_GOAL), judged)
    for block in (64 * KiB, 512 * KiB):
        one, two = tput("fast", "put", block), tput("fast", "put", block, 2)
        add("issue 26", "fast", f"put {size(block)} x{batch}, 2 clients aggregate vs 1 client",
            f">= {NATIVE_SCALING_GOAL}x", ratio(field(two, "bytes_per_s"),
                                                field(one, "bytes_per_s")),
            at_least(NATIVE_SCALING_GOAL), judged)
    return out
