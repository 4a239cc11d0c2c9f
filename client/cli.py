"""``kvtier``: admin and tools (stats, ls, bench)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Collection
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


def _table(rows: list[list[str]], left: Collection[int] = (0,)) -> str:
    """Columns two spaces apart: those in ``left`` left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=False))).rstrip()
             for r in rows]
    return "\n".join(lines)


TIER_NAMES = {pb.TIER_DRAM: "dram", pb.TIER_SSD: "ssd", pb.TIER_SHARED: "shared"}


def _tier_note(s: pb.StatsResponse, t: pb.TierStats) -> str:
    """The daemon's note; for the SSD tier it always says which I/O mode is in use."""
    note = " ".join(t.note.split())
    if t.tier == pb.TIER_SSD and not re.search(r"direct|buffered", note, re.IGNORECASE):
        mode = "O_DIRECT" if s.ssd_direct_io else "buffered I/O"
        note = f"{mode} {note}".strip()
    return note


def render_tiers(s: pb.StatsResponse) -> str:
    """One row per tier; the shared tier is unbounded (its filesystem's quota governs it)."""
    rows = [["tier", "total", "free", "reserved", "committed", "blocks", "note"]]
    for t in s.tiers:
        name = TIER_NAMES.get(t.tier, f"tier {t.tier}")
        if t.tier == pb.TIER_SHARED and not t.total_bytes:
            sizes = ["-"] * 5
        else:
            sizes = [human_bytes(t.total_bytes), human_bytes(t.free_bytes),
                     human_bytes(t.reserved_bytes), human_bytes(t.committed_bytes),
                     str(t.committed_blocks)]
        rows.append([name, *sizes, _tier_note(s, t)])
    return _table(rows, left=(0, 6))


def render_spill(s: pb.StatsResponse) -> str:
    """The spill counters, as label/value rows (empty when the daemon has no spill tier)."""
    has_ssd = any(t.tier == pb.TIER_SSD for t in s.tiers)
    if not any(t.tier in (pb.TIER_SSD, pb.TIER_SHARED) for t in s.tiers):
        return ""
    faults = ", ".join(f"{k} {v}" for k, v in sorted(s.spill_faults.items())) or "none"
    rows = [
        ["demotions", str(s.demotions)],
        ["promotions", str(s.promotions)],
        ["prefetches", f"{s.prefetches} ({s.prefetch_hits} found in DRAM by acquire)"],
        ["spill queue", f"{s.spill_queue_depth} blocks in flight"],
        ["backpressure waits", str(s.backpressure_waits)],
        ["checksum failures", str(s.spill_checksum_failures)],
        ["faults", faults],
    ]
    if has_ssd:
        rows += [
            ["ssd direct I/O", "yes" if s.ssd_direct_io else "no (buffered)"],
            ["ssd adopted", f"{s.ssd_adopted_blocks} blocks in {s.ssd_adopt_seconds:.3f} s"],
        ]
    out = ["spill:"] + ["  " + line for line in _table(rows, left=(0, 1)).splitlines()]
    out += [f"  dropped spill file: {f}" for f in s.dropped_spill_files]
    return "\n".join(out)


def render_stats(s: pb.StatsResponse) -> str:
    out = [
        f"kvtierd {s.daemon_version}  epoch {s.boot_epoch}  up {s.uptime_seconds:.0f} s  "
        f"sessions {s.sessions}  leases {s.leases}  reservations {s.reservations}  "
        f"evictions {s.evictions}",
        f"memory locked: {'yes' if s.mlocked else 'NO: ' + s.mlock_error}  "
        f"pre-fault time: {s.prefault_seconds:.2f} s",
        "",
        render_tiers(s),
    ]
    spill = render_spill(s)
    if spill:
        out += ["", spill]
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


def check_config(path: str, *, as_json: bool = False) -> int:
    """``kvtier config --check FILE``: 0 and the effective config, or 2 and the error."""
    from kvtierd.config import ConfigError, config_to_dict, load_config

    try:
        cfg = load_config(path)
    except ConfigError as exc:
        print(f"kvtier: invalid config: {exc}", file=sys.stderr)
        return 2
    effective = config_to_dict(cfg)
    if as_json:
        print(json.dumps(effective, indent=2))
    else:
        print(f"{path}: OK")
        for section, body in effective.items():
            if isinstance(body, dict):
                for key, value in body.items():
                    print(f"  {section}.{key} = {value}")
            else:
                print(f"  {section} = {body}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # the demo parses its own options (kvtier demo --help)
        from kvtier.demo.run import main as demo_main

        return demo_main(argv[1:])
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
    cfg = sub.add_parser("config", help="validate a kvtierd config without starting a daemon")
    cfg.add_argument("--check", metavar="FILE", required=True,
                     help="the YAML file; KVTIER_* variables apply as they would to kvtierd")
    cfg.add_argument("--json", action="store_true", help="print the effective config as JSON")
    sub.add_parser("demo", help="TTFT demo: a JAX model reuses its prompt's KV through a private "
                   "kvtierd (kvtier demo --help; needs kvtier[demo])")
    args = p.parse_args(argv)
    if args.cmd == "demo":  # `kvtier --socket DIR demo`: the demo runs a daemon of its own
        from kvtier.demo.run import main as demo_main

        return demo_main([])
    if args.cmd == "config":
        return check_config(args.check, as_json=args.json)
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
