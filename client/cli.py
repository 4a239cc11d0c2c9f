"""``kvtier``: admin and tools (stats, ls, bench)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from kvtier._core import DEFAULT_TIMEOUT, grpc_options, socket_paths
from kvtier.errors import KVTierError, from_rpc_error
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc


def _admin_call(socket: str | None, method: str, request: Any, timeout: float) -> Any:
    grpc_path, _ = socket_paths(socket)
    with grpc.insecure_channel(f"unix:{grpc_path}", options=grpc_options()) as channel:
        try:
            return getattr(pb_grpc.KVTierStub(channel), method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None


def health(socket: str | None, timeout: float = 5.0) -> str:
    """The gRPC health status of the KVTier service ("SERVING" when all is well)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    grpc_path, _ = socket_paths(socket)
    with grpc.insecure_channel(f"unix:{grpc_path}", options=grpc_options()) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvtier.v1.KVTier"), timeout=timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def wait_serving(socket: str, proc: subprocess.Popen[Any] | None = None,
                 timeout: float = 30) -> None:
    """Poll the daemon's health until SERVING; raise if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"kvtierd exited with status {proc.returncode}")
        try:
            if health(socket, timeout=1) == "SERVING":
                return
        except KVTierError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"kvtierd on {socket} did not become ready in {timeout:.0f} s")


def fetch_stats(socket: str | None, timeout: float = DEFAULT_TIMEOUT) -> pb.StatsResponse:
    """One Stats call (needs no session)."""
    resp: pb.StatsResponse = _admin_call(socket, "Stats", pb.StatsRequest(), timeout)
    return resp


def run_check(socket: str | None, timeout: float = DEFAULT_TIMEOUT) -> list[str]:
    """The daemon's consistency check: the problems it found (empty when consistent)."""
    resp: pb.CheckResponse = _admin_call(socket, "Check", pb.CheckRequest(), timeout)
    return list(resp.problems)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False)))
             for r in rows]
    return "\n".join(lines)


def render_stats(s: pb.StatsResponse) -> str:
    tier_names = {pb.TIER_DRAM: "dram", pb.TIER_SSD: "ssd", pb.TIER_SHARED: "shared"}
    out = [
        f"kvtierd {s.daemon_version}  epoch {s.boot_epoch}  up {s.uptime_seconds:.0f} s  "
        f"sessions {s.sessions}  leases {s.leases}  reservations {s.reservations}  "
        f"evictions {s.evictions}",
        f"memory locked: {'yes' if s.mlocked else 'NO: ' + s.mlock_error}  "
        f"pre-fault time: {s.prefault_seconds:.2f} s",
        "",
    ]
    rows = [["tier", "total", "free", "reserved", "committed", "blocks"]]
    for t in s.tiers:
        rows.append([tier_names.get(t.tier, "?"), human_bytes(t.total_bytes),
                     human_bytes(t.free_bytes), human_bytes(t.reserved_bytes),
                     human_bytes(t.committed_bytes), str(t.committed_blocks)])
    out.append(_table(rows))
    if s.namespaces:
        out.append("")
        out.append(render_namespaces(s))
    return "\n".join(out)


def render_namespaces(s: pb.StatsResponse) -> str:
    rows = [["namespace", "block", "blocks", "leased", "free slots", "sessions", "hit ratio"]]
    for ns in s.namespaces:
        asked = ns.hits + ns.misses
        ratio = f"{ns.hits / asked:.1%}" if asked else "-"
        rows.append([ns.name, human_bytes(ns.block_bytes), str(ns.committed_blocks),
                     str(ns.leased_blocks), str(ns.free_slots), str(ns.sessions), ratio])
    return _table(rows)


def _as_json(s: pb.StatsResponse) -> str:
    d: dict[str, Any] = MessageToDict(s, preserving_proto_field_name=True,
                                      always_print_fields_with_no_presence=True)
    return json.dumps(d, indent=2)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "bench" in argv:  # everything after the word goes to the benchmark untouched
        at = argv.index("bench")
        head, rest = argv[:at], argv[at + 1 :]
        pre = argparse.ArgumentParser(prog="kvtier", add_help=False)
        pre.add_argument("--socket")
        known, unknown = pre.parse_known_args(head)
        if not unknown:
            from kvtier import bench as bench_mod

            extra = ["--socket", known.socket] if known.socket else []
            return int(bench_mod.main(extra + rest))
    p = argparse.ArgumentParser(prog="kvtier", description="kvtier admin and tools")
    p.add_argument("--socket", help="daemon socket directory (default: as kvtierd)")
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stats", help="tiers, namespaces and counters")
    st.add_argument("--json", action="store_true")
    ls = sub.add_parser("ls", help="namespaces")
    ls.add_argument("--json", action="store_true")
    sub.add_parser("health", help="exit 0 when the daemon answers SERVING (for health checks)")
    sub.add_parser("check", help="cross-check the daemon's index and slot tables (exit 1 on problems)")
    sub.add_parser("bench", help="throughput and latency benchmark (kvtier bench --help)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "health":
            status = health(args.socket)
            print(status)
            return 0 if status == "SERVING" else 1
        if args.cmd == "check":
            problems = run_check(args.socket)
            for line in problems:
                print(line)
            print("consistent" if not problems else f"{len(problems)} problems")
            return 1 if problems else 0
        s = fetch_stats(args.socket)
        if args.cmd == "stats":
            print(_as_json(s) if args.json else render_stats(s))
        else:
            if args.json:
                print(json.dumps([MessageToDict(n, preserving_proto_field_name=True)
                                  for n in s.namespaces], indent=2))
            else:
                print(render_namespaces(s) if s.namespaces else "no namespaces")
    except KVTierError as exc:
        print(f"kvtier: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
