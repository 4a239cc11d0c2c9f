"""``kvtier``: the admin commands and the front door of the tools.

Commands: stats, ls, evict, drain, health, check, config.  Tools: bench,
doctor, top, demo -- modules of their own that this one dispatches to.  What
they share with the commands here (admin calls, tier names, tables, byte
sizes) lives in ``kvtier._admin``, ``kvtier._fmt`` and ``kvtier.units``, so
imports run one way: cli -> tools -> shared helpers, never back into cli.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from typing import Any

from google.protobuf.json_format import MessageToDict

from kvtier._admin import admin_call, fetch_stats, health, run_check
from kvtier._core import DEFAULT_TIMEOUT
from kvtier._fmt import table
from kvtier._wire import TIER_NAMES, TIER_OF_NAME
from kvtier.errors import InvalidArgument, KVTierError
from kvtier.units import format_bytes
from kvtier.v1 import kvtier_pb2 as pb


def _tier_note(s: pb.StatsResponse, t: pb.TierStats) -> str:
    """The daemon's note; for the SSD tier it always says which I/O mode is in use."""
    note = " ".join(t.note.split())
    if t.tier == pb.TIER_SSD and not re.search(r"direct|buffered", note, re.IGNORECASE):
        mode = "O_DIRECT" if s.ssd_direct_io else "buffered I/O"
        note = f"{mode} {note}".strip()
    return note


def render_tiers(s: pb.StatsResponse) -> str:
    """One row per tier; the shared tier is unbounded (its filesystem's quota governs it)."""
    rows = [["tier", "total", "free", "reserved", "granted", "committed", "blocks", "note"]]
    for t in s.tiers:
        name = TIER_NAMES.get(t.tier, f"tier {t.tier}")
        if t.tier == pb.TIER_SHARED and not t.total_bytes:
            sizes = ["-"] * 6
        elif t.tier == pb.TIER_CLUSTER:  # what this host lends it; the rest is the master's
            sizes = [format_bytes(t.total_bytes)] + ["-"] * 5
        else:
            sizes = [format_bytes(t.total_bytes), format_bytes(t.free_bytes),
                     format_bytes(t.reserved_bytes),
                     format_bytes(t.granted_bytes) if t.tier == pb.TIER_DRAM else "-",
                     format_bytes(t.committed_bytes), str(t.committed_blocks)]
        rows.append([name, *sizes, _tier_note(s, t)])
    return table(rows, left=(0, 7))


def render_spill(s: pb.StatsResponse) -> str:
    """The spill counters, as label/value rows (empty when the daemon has no spill tier)."""
    has_ssd = any(t.tier == pb.TIER_SSD for t in s.tiers)
    if not any(t.tier in (pb.TIER_SSD, pb.TIER_SHARED, pb.TIER_CLUSTER) for t in s.tiers):
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
    out = ["spill:"] + ["  " + line for line in table(rows, left=(0, 1)).splitlines()]
    out += [f"  dropped spill file: {f}" for f in s.dropped_spill_files]
    return "\n".join(out)


def render_stats(s: pb.StatsResponse) -> str:
    out = [
        f"kvtierd {s.daemon_version}  epoch {s.boot_epoch}  up {s.uptime_seconds:.0f} s  "
        f"sessions {s.sessions}  leases {s.leases}  reservations {s.reservations}  "
        f"granted {s.granted_blocks}  evictions {s.evictions}",
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
        fast = render_fast_path(s)
        if fast:
            out += ["", fast]
    return "\n".join(out)


def render_fast_path(s: pb.StatsResponse) -> str:
    """The reads made without a call (the fast path) that the daemon verified itself:
    leases whose hazards name committed blocks, held now and seen at its looks since
    it started (``kvtierd.lease_watch``): facts, unlike the client-reported figures.
    Empty from a daemon that does not look (older, or without the fast path)."""
    if not s.lease_looks or not s.namespaces:
        return ""
    rows = [["namespace", "leases now", "blocks now", "bytes now", "leases seen",
             "blocks seen", "bytes seen", "unverified"]]
    for ns in s.namespaces:
        f = ns.fast_path_leases
        rows.append([ns.name, str(f.leases), str(f.blocks), format_bytes(f.bytes),
                     str(f.leases_seen), str(f.blocks_seen), format_bytes(f.bytes_seen),
                     str(f.unverified)])
    every = f"{s.lease_look_interval_seconds * 1e3:g} ms"
    head = (f"leases without a call, verified by kvtierd (hazards naming committed blocks; "
            f"'seen' counts those held at its looks, every {every}, {s.lease_looks} so far: "
            "a lower bound of the reads):")
    return "\n".join([head] + ["  " + line for line in table(rows).splitlines()])


def render_namespaces(s: pb.StatsResponse) -> str:
    """The namespaces: the daemon's own figures ("hit ratio": its Acquire calls), and
    apart, what their clients report of reads without a call ("client-reported hit":
    bounded, never verified; docs/security.md)."""
    rows = [["namespace", "block", "blocks", "leased", "free slots", "sessions", "hit ratio",
             "client-reported hit"]]
    for ns in s.namespaces:
        r = ns.client_reported
        reported = _ratio(r.lookup_hits + r.acquire_hits, r.lookup_misses + r.acquire_misses)
        rows.append([ns.name, format_bytes(ns.block_bytes), str(ns.committed_blocks),
                     str(ns.leased_blocks), str(ns.free_slots), str(ns.sessions),
                     _ratio(ns.hits, ns.misses), reported])
    return table(rows)


def _ratio(hits: int, misses: int) -> str:
    asked = hits + misses
    return f"{hits / asked:.1%}" if asked else "-"


def _as_json(s: pb.StatsResponse) -> str:
    d: dict[str, Any] = MessageToDict(s, preserving_proto_field_name=True,
                                      always_print_fields_with_no_presence=True)
    return json.dumps(d, indent=2)


# --------------------------------------------------------------------------- admin: keys
#: Keys per Evict call of ``kvtier evict --keys-from``: within the daemon's default
#: server.max_keys_per_call (4096) with room to spare; ``--batch`` for other limits.
EVICT_BATCH = 1024
#: Deadline of ``kvtier evict --all``: one call covers the whole namespace, and its
#: shared-tier files are removed one by one on a possibly slow network filesystem.
EVICT_ALL_TIMEOUT = 600.0
#: ``kvtier ls --keys`` page size: a screenful when reading, larger when streaming.
LS_PAGE = 100
LS_PAGE_ALL = 1000
#: How long one Drain call of ``kvtier drain`` waits for progress: the plain
#: progress output prints one line per call, so one line a second.
DRAIN_POLL_MS = 1000


def read_keys(path: str) -> list[bytes]:
    """Keys for ``kvtier evict --keys-from``: one hex key per line (``-``: stdin).

    Blank lines are skipped; anything else that is not 1..64 bytes of hex is an
    ``InvalidArgument`` naming the file and line.
    """
    name = "<stdin>" if path == "-" else path
    if path == "-":
        lines = sys.stdin.read().splitlines()
    else:
        with open(path) as f:
            lines = f.read().splitlines()
    out: list[bytes] = []
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise InvalidArgument(f"{name}:{n}: not a hex key: {text[:80]!r}") from None
        if not 1 <= len(key) <= 64:
            raise InvalidArgument(f"{name}:{n}: a key is 1..64 bytes, this one {len(key)}")
        out.append(key)
    return out


def list_keys(socket: str | None, namespace: str, page_size: int, page_token: bytes = b"",
              timeout: float = DEFAULT_TIMEOUT) -> pb.ListKeysResponse:
    """One ListKeys page."""
    resp: pb.ListKeysResponse = admin_call(
        socket, "ListKeys",
        pb.ListKeysRequest(namespace=namespace, page_size=page_size, page_token=page_token),
        timeout)
    return resp


def evict(socket: str | None, namespace: str, keys: list[bytes] | None, tiers: list[str],
          *, batch: int = EVICT_BATCH, timeout: float = DEFAULT_TIMEOUT) -> tuple[int, int]:
    """Evict ``keys`` (None: the whole namespace) from ``tiers`` (empty: every tier),
    ``batch`` keys per call.  Returns (evicted, skipped because leased or moving)."""
    wire = [TIER_OF_NAME[t] for t in tiers]
    if keys is None:
        resp = admin_call(socket, "Evict",
                           pb.EvictRequest(namespace=namespace, all=True, tiers=wire), timeout)
        return int(resp.evicted), int(resp.skipped_leased)
    evicted = skipped = 0
    for i in range(0, len(keys), batch):
        try:
            resp = admin_call(socket, "Evict", pb.EvictRequest(
                namespace=namespace, keys=keys[i : i + batch], tiers=wire), timeout)
        except KVTierError as exc:
            if i:
                print(f"kvtier: evict stopped after {i} of {len(keys)} keys ({evicted} evicted, "
                      f"{skipped} skipped)", file=sys.stderr)
            raise exc from None
        evicted += resp.evicted
        skipped += resp.skipped_leased
    return evicted, skipped


def _key_rows(resp: pb.ListKeysResponse) -> list[list[str]]:
    return [[k.key.hex(), TIER_NAMES.get(k.tier, f"tier {k.tier}"), str(k.length),
             "yes" if k.leased else "no", "yes" if k.spilled else "no"] for k in resp.keys]


def _key_json(resp: pb.ListKeysResponse) -> str:
    return json.dumps({
        "keys": [{"key": k.key.hex(), "tier": TIER_NAMES.get(k.tier, str(k.tier)),
                  "length": k.length, "leased": k.leased, "spilled": k.spilled}
                 for k in resp.keys],
        "next_page_token": resp.next_page_token.hex(),
    })


_KEYS_HEADER = ["key", "tier", "length", "leased", "spilled"]


def run_ls_keys(socket: str | None, namespace: str, *, page_size: int | None,
                page_token: bytes, every_page: bool, as_json: bool) -> int:
    """``kvtier ls --keys``: one page and how to get the next, or (``every_page``) all.

    Text: a table (key hex, tier, length, leased, spilled), the header once.
    ``--json``: one JSON object per page and line (``keys``, ``next_page_token``).
    """
    size = page_size or (LS_PAGE_ALL if every_page else LS_PAGE)
    token = page_token
    first = True
    while True:
        resp = list_keys(socket, namespace, size, token)
        if as_json:
            print(_key_json(resp), flush=True)
        elif resp.keys or first:
            rows = [_KEYS_HEADER, *_key_rows(resp)]
            lines = table(rows, left=(0, 1, 3, 4)).splitlines()
            print("\n".join(lines if first else lines[1:]), flush=True)
        first = False
        token = resp.next_page_token
        if not token:
            return 0
        if not every_page:
            if not as_json:
                print(f"more: kvtier ls --keys --namespace {namespace} --page-size {size} "
                      f"--page-token {token.hex()}", file=sys.stderr)
            return 0


class _PlainProgress:
    """One line a second on stderr (no TTY, or no ``rich``)."""

    def __init__(self) -> None:
        self._last = 0.0

    def update(self, r: pb.DrainResponse) -> None:
        now = time.monotonic()
        if now - self._last < 0.95 and not r.done:
            return
        self._last = now
        print(f"drain: {r.done_blocks}/{r.total_blocks} blocks, {format_bytes(r.done_bytes)}/"
              f"{format_bytes(r.total_bytes)}, {r.failed_blocks} failed"
              + (", done" if r.done else ""), file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class _RichProgress:
    """A ``rich`` progress bar on the terminal."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._bar = Progress(TextColumn("drain"), BarColumn(), DownloadColumn(binary_units=True),
                             TextColumn("{task.fields[blocks]}"), TimeElapsedColumn())
        self._task = self._bar.add_task("drain", total=None, blocks="")
        self._bar.start()

    def update(self, r: pb.DrainResponse) -> None:
        self._bar.update(self._task, total=r.total_bytes or None, completed=r.done_bytes,
                         blocks=f"{r.done_blocks}/{r.total_blocks} blocks, "
                                f"{r.failed_blocks} failed")

    def close(self) -> None:
        self._bar.stop()


def _progress_display() -> _PlainProgress | _RichProgress:
    if sys.stdout.isatty():
        try:
            return _RichProgress()
        except ImportError:
            pass
    return _PlainProgress()


def run_drain(socket: str | None, timeout: float | None) -> int:
    """``kvtier drain``: start (or join) the daemon's drain and follow it to the end.

    0 when every block got its copy; 1 when some failed (with the daemon's spill
    faults), when ``timeout`` seconds pass first (the drain goes on in the
    daemon), or on an error.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    show = _progress_display()
    try:
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait_ms = DRAIN_POLL_MS if left is None else int(min(DRAIN_POLL_MS, left * 1000))
            r: pb.DrainResponse = admin_call(socket, "Drain", pb.DrainRequest(wait_ms=wait_ms),
                                              wait_ms / 1000 + DEFAULT_TIMEOUT)
            show.update(r)
            if r.done or (left is not None and left <= wait_ms / 1000):
                break
    finally:
        show.close()
    size = f"{r.done_blocks} of {r.total_blocks} blocks ({format_bytes(r.done_bytes)} of " \
           f"{format_bytes(r.total_bytes)})"
    if not r.done:
        print(f"kvtier: the drain is not done after {timeout:g} s: {size} durable below DRAM "
              "so far; it goes on in the daemon (run kvtier drain again to follow it)",
              file=sys.stderr)
        return 1
    if r.failed_blocks:
        print(f"drain done: {size} durable below DRAM; {r.failed_blocks} failed")
        print(f"kvtier: {r.failed_blocks} blocks could not be copied below DRAM (the lower "
              "tier is full or faulting); they stay in DRAM only", file=sys.stderr)
        faults: dict[str, int] = {}
        with contextlib.suppress(KVTierError):
            faults = dict(fetch_stats(socket).spill_faults)
        for kind, n in sorted(faults.items()):
            print(f"  spill fault {kind}: {n}", file=sys.stderr)
        return 1
    print(f"drain done: {size} durable below DRAM")
    return 0


def check_config(path: str, *, as_json: bool = False) -> int:
    """``kvtier config --check FILE``: 0 and the effective config, or 2 and the error."""
    # The daemon's own loader, so the check is exactly what kvtierd will do; imported
    # here, not at the top, so a client-only install runs every other command.
    try:
        from kvtierd.config import ConfigError, config_to_dict, load_config
    except ImportError as exc:
        print(f"kvtier: config --check needs the daemon package (kvtierd): {exc}",
              file=sys.stderr)
        return 2
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
    if argv[:1] == ["pd-proxy"]:  # the proxy parses its own options (kvtier pd-proxy --help)
        from kvtier.pd_proxy import main as proxy_main

        return proxy_main(argv[1:])
    # doctor and top parse their own options too; a --socket before the word passes on.
    for word in ("doctor", "top"):
        if word in argv:
            at = argv.index(word)
            pre = argparse.ArgumentParser(prog="kvtier", add_help=False)
            pre.add_argument("--socket")
            known, unknown = pre.parse_known_args(argv[:at])
            if not unknown:
                extra = ["--socket", known.socket] if known.socket else []
                if word == "doctor":
                    from kvtier.doctor import main as doctor_main

                    return doctor_main(extra + argv[at + 1 :])
                from kvtier.top import main as top_main

                return top_main(extra + argv[at + 1 :])
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
    ls = sub.add_parser("ls", help="namespaces; with --keys, a namespace's blocks")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--keys", action="store_true",
                    help="list the blocks of --namespace in DRAM and on the SSD tier, in key "
                    "order, a page at a time (the shared tier is not listed)")
    ls.add_argument("--namespace", help="with --keys: the namespace")
    ls.add_argument("--page-size", type=int, metavar="K",
                    help=f"with --keys: keys per page (default {LS_PAGE}; {LS_PAGE_ALL} "
                    "with --all)")
    ls.add_argument("--page-token", metavar="TOKEN",
                    help="with --keys: continue where the page that printed it ended")
    ls.add_argument("--all", action="store_true", help="with --keys: every page")
    ev = sub.add_parser("evict", help="drop a namespace's blocks from some or all tiers")
    ev.add_argument("--namespace", required=True)
    ev.add_argument("--tier", action="append", choices=sorted(TIER_OF_NAME), default=[],
                    help="only the copies on this tier (repeatable; default: every tier)")
    which = ev.add_mutually_exclusive_group(required=True)
    which.add_argument("--keys-from", metavar="FILE",
                       help="one hex key per line; - reads stdin")
    which.add_argument("--all", action="store_true",
                       help="every block DRAM or the SSD tier holds (and their shared copies)")
    ev.add_argument("--batch", type=int, default=EVICT_BATCH,
                    help=f"keys per call (default {EVICT_BATCH}; at most the daemon's "
                    "server.max_keys_per_call)")
    dr = sub.add_parser("drain", help="copy every DRAM block to durable storage below DRAM "
                        "(before maintenance), showing progress")
    dr.add_argument("--timeout", type=float, metavar="S",
                    help="give up following after S seconds (the drain goes on); default: "
                    "until it is done")
    sub.add_parser("health", help="exit 0 when the daemon answers SERVING (for health checks)")
    sub.add_parser("check", help="cross-check the daemon's index and slot tables (exit 1 on problems)")
    sub.add_parser("bench", help="throughput and latency benchmark (kvtier bench --help)")
    sub.add_parser("doctor", help="check this host against the config: shm, memlock, spill "
                   "disk, sockets, daemon (kvtier doctor --help)")
    sub.add_parser("top", help="live view of tiers, throughput, namespaces and slow RPCs "
                   "(kvtier top --help; --once for scripts)")
    cfg = sub.add_parser("config", help="validate a kvtierd config without starting a daemon")
    cfg.add_argument("--check", metavar="FILE", required=True,
                     help="the YAML file; KVTIER_* variables apply as they would to kvtierd")
    cfg.add_argument("--json", action="store_true", help="print the effective config as JSON")
    sub.add_parser("pd-proxy", help="OpenAI proxy for disaggregated prefill/decode over vLLM "
                   "servers (kvtier pd-proxy --help; needs kvtier[pd])")
    sub.add_parser("demo", help="TTFT demo: a JAX model reuses its prompt's KV through a private "
                   "kvtierd (kvtier demo --help; needs kvtier[demo])")
    args = p.parse_args(argv)
    page_token = b""
    if args.cmd == "ls":
        if not args.keys and (args.namespace is not None or args.page_size is not None
                              or args.page_token is not None or args.all):
            p.error("ls: --namespace, --page-size, --page-token and --all go with --keys")
        if args.keys and not args.namespace:
            p.error("ls --keys: --namespace is required")
        if args.page_size is not None and args.page_size < 1:
            p.error(f"ls --keys: --page-size must be at least 1, got {args.page_size}")
        try:
            page_token = bytes.fromhex(args.page_token or "")
        except ValueError:
            p.error(f"ls --keys: --page-token is not hex: {args.page_token!r}")
    if args.cmd == "evict" and args.batch < 1:
        p.error(f"evict: --batch must be at least 1, got {args.batch}")
    if args.cmd == "drain" and args.timeout is not None and args.timeout < 0:
        p.error(f"drain: --timeout must not be negative, got {args.timeout:g}")
    if args.cmd == "demo":  # `kvtier --socket DIR demo`: the demo runs a daemon of its own
        from kvtier.demo.run import main as demo_main

        return demo_main([])
    if args.cmd == "config":
        return check_config(args.check, as_json=args.json)
    if args.cmd == "pd-proxy":  # `kvtier --socket DIR pd-proxy`: the proxy needs no daemon
        from kvtier.pd_proxy import main as proxy_main

        return proxy_main([])
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
        if args.cmd == "ls" and args.keys:
            return run_ls_keys(args.socket, args.namespace, page_size=args.page_size,
                               page_token=page_token, every_page=args.all, as_json=args.json)
        if args.cmd == "evict":
            keys = None if args.all else read_keys(args.keys_from)
            if keys == []:
                print(f"kvtier: no keys in {args.keys_from}", file=sys.stderr)
                return 1
            evicted, skipped = evict(args.socket, args.namespace, keys, args.tier,
                                     batch=args.batch,
                                     timeout=EVICT_ALL_TIMEOUT if args.all else DEFAULT_TIMEOUT)
            print(f"evicted {evicted} keys; skipped {skipped} (leased or being moved)")
            return 0
        if args.cmd == "drain":
            return run_drain(args.socket, args.timeout)
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
    except OSError as exc:  # kvtier evict --keys-from FILE
        print(f"kvtier: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
