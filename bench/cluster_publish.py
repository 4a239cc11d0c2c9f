"""Commit to fetchable: how long after host A commits blocks host B can fetch them.

A kvtierd with ``cluster.write: commit`` publishes every committed block into Mooncake
Store after the commit; a consumer on another host (the decode server of a P/D pair)
holds its request until its lookup finds the blocks there.  This measures that gap,
without vLLM, between two network namespaces (``tests/fleet.py``: a veth pair, a real
``mooncake_master``, a kvtierd in each):

* host A's client puts ``N`` fresh blocks (reserve, copy, commit; the put returns once
  kvtierd A has committed them) -- the commit time is when ``put`` returns;
* **in the cluster**: a plain Mooncake client in namespace B, told to watch before the
  put, polls ``batch_is_exist`` of the ``N`` object names every ``--interval`` and notes
  when each first exists; then one ``batch_get_into`` of all of them (the bytes are
  there, not only the names);
* **on host B's kvtierd**: alternate rounds instead poll host B's ``lookup`` of the keys
  (what a P/D consumer's held request does: one ``batch_is_exist`` through B's agent per
  lookup) until all ``N`` are found.

Commit to all-found is the figure; commit to the first one found shows how the blocks
arrive (block by block, or the batch at once).  ``--set NAME:KEY=VALUE`` gives the
daemons of tree ``NAME`` a setting (two names for one checkout compare a setting on
and off).  ``--tree NAME=PATH`` runs the daemons of
another checkout (``PYTHONPATH`` of its ``client`` and ``daemon``; its native module
built): every tree gets a fleet of its own, all up at once, and each round runs on every
tree in turn (the order alternating), so a before / after pair of rounds sees the same
machine -- on a shared VM the put's own speed drifts by 4x within a minute.  The summary
gives each tree's medians and the median of the per-round ratios.

    sudo .venv/bin/python bench/cluster_publish.py --tree before=/tmp/kvt-before \\
        --tree after=. --json bench/results/cluster-publish-2026-12-04.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import cluster as cluster_bench  # noqa: E402  (bench/cluster.py: the Mooncake reader)
import numpy as np  # noqa: E402

import kvtier  # noqa: E402
from kvtier.bench.common import write_json  # noqa: E402
from kvtier.units import parse_size  # noqa: E402
from kvtierd.cluster.format import HEADER_BYTES, Naming  # noqa: E402
from kvtierd.spill.format import model_hash  # noqa: E402
from tests.fleet import SECRET, Fleet, cluster_note, wait_for  # noqa: E402

MODEL = "bench-cluster-publish"


def one_round(a: kvtier.Client, b: kvtier.Client, reader: cluster_bench.Reader,
              naming: Naming, ns: str, block_bytes: int, data: list[np.ndarray], mode: str,
              interval: float) -> dict[str, Any]:
    keys = [os.urandom(16) for _ in data]
    names = [naming.name(ns, k, block_bytes, model_hash(MODEL)) for k in keys]
    if mode == "cluster":
        reader.send(op="watch", names=names, interval=interval, timeout=30.0, size=0)
    t0 = time.monotonic()
    assert a.put(keys, data) == len(keys)
    committed = time.monotonic()
    out: dict[str, Any] = {"mode": mode, "put_ms": (committed - t0) * 1e3}
    if mode == "cluster":
        seen = reader.answer()["seen"]
        assert None not in seen, f"only {len(seen) - seen.count(None)} of {len(seen)} published"
        got = reader.ask(op="get", names=names, size=block_bytes + HEADER_BYTES)
        assert got["ok"], got
        out["first_ms"] = (min(seen) - committed) * 1e3
        out["all_ms"] = (max(seen) - committed) * 1e3
        out["get_ms"] = got["seconds"] * 1e3
    else:
        first = None
        deadline = committed + 30
        while True:
            n = b.lookup(keys)
            now = time.monotonic()
            if n and first is None:
                first = now
            if n == len(keys):
                break
            assert now < deadline, f"host B found {n} of {len(keys)} in 30 s"
            time.sleep(interval)
        assert first is not None
        out["first_ms"] = (first - committed) * 1e3
        out["all_ms"] = (now - committed) * 1e3
    return out


class Rig:
    """One tree's fleet (master, kvtierd A and B in their own namespaces), its Mooncake
    reader in B, and a client pair per block count."""

    def __init__(self, args: argparse.Namespace, tree: str, path: str, index: int) -> None:
        path = os.path.abspath(path)
        env = {"PYTHONPATH": f"{path}/client:{path}/daemon"}
        extra = [a for kv in args.set if kv.split(":", 1)[0] == tree
                 for a in ("--set", kv.split(":", 1)[1])]
        self.tree = tree
        self.bb = parse_size(args.block)
        self.base = tempfile.mkdtemp(prefix="kvt-bpub-", dir="/tmp")
        self.fleet = Fleet(self.base, index=index)
        self.reader: cluster_bench.Reader | None = None
        self.clients: list[kvtier.Client] = []
        fleet = self.fleet
        fleet.start_master()
        fleet.a = fleet.start_daemon("a", *extra, capacity=args.dram, extent="64MiB",
                                     segment=args.segment, env=env)
        fleet.b = fleet.start_daemon("b", *extra, capacity="256MiB", extent="64MiB",
                                     segment="64MiB", env=env)
        if "cluster.prefault_segment=false" not in extra and "MADV_POPULATE_WRITE" in open(
                os.path.join(path, "daemon/kvtierd/cluster/agent.py")).read():
            host_a = fleet.a
            wait_for(lambda: "pre-fault" in cluster_note(host_a), 60,
                     "host A's segment to be pre-faulted")
            print(f"{tree}: {cluster_note(host_a)}", flush=True)
        counts = [int(c) for c in args.counts.split(",")]
        self.reader = cluster_bench.Reader(fleet, max(counts) * (self.bb + HEADER_BYTES + 4096))

    def pair(self, count: int) -> tuple[kvtier.Client, kvtier.Client]:
        assert self.fleet.a is not None and self.fleet.b is not None
        ns = f"pub-{count}"
        a = kvtier.Client(self.fleet.a.socket_dir, namespace=ns, block_bytes=self.bb,
                          model_uid=MODEL)
        b = kvtier.Client(self.fleet.b.socket_dir, namespace=ns, block_bytes=self.bb,
                          model_uid=MODEL)
        self.clients += [a, b]
        return a, b

    def close(self) -> None:
        for c in self.clients:
            c.close()
        if self.reader is not None:
            self.reader.close()
        self.fleet.close()
        shutil.rmtree(self.base, ignore_errors=True)


def run(args: argparse.Namespace, trees: list[list[str]]) -> list[dict[str, Any]]:
    """Every tree's fleet up at once; each round runs on every tree in turn (the order
    alternating), so a pair of rounds sees the same machine."""
    rigs: list[Rig] = []
    rows: list[dict[str, Any]] = []
    naming = Naming(SECRET)
    try:
        for i, (name, path) in enumerate(trees):
            rigs.append(Rig(args, name, path, i + 1))
        rng = np.random.default_rng(7)
        for count in [int(c) for c in args.counts.split(",")]:
            bb = rigs[0].bb
            data = [rng.integers(0, 256, bb, np.uint8) for _ in range(count)]
            pairs = [rig.pair(count) for rig in rigs]
            for i in range(args.warmup + args.rounds):
                mode = ("cluster", "kvtier")[i % 2]
                order = list(range(len(rigs)))
                if (i // 2) % 2:
                    order.reverse()
                for j in order:
                    rig, (a, b) = rigs[j], pairs[j]
                    assert rig.reader is not None
                    r = one_round(a, b, rig.reader, naming, f"pub-{count}", bb, data, mode,
                                  args.interval)
                    if i < args.warmup:
                        continue
                    r.update(tree=rig.tree, blocks=count, block_bytes=bb, round=i)
                    rows.append(r)
                    print(f"{rig.tree:>8} {count:3d} x {args.block} round {i:2d}: {mode:7s} "
                          f"commit -> first {r['first_ms']:7.1f} ms, all {r['all_ms']:7.1f} ms "
                          f"(put {r['put_ms']:.1f} ms)", flush=True)
    finally:
        for rig in rigs:
            rig.close()
    return rows


def paired(rows: list[dict[str, Any]], trees: list[str]) -> list[dict[str, Any]]:
    """Per block count and mode: the median over rounds of (tree / first tree)."""
    out = []
    for count, mode in sorted({(r["blocks"], r["mode"]) for r in rows}):
        by = {(r["tree"], r["round"]): r["all_ms"] for r in rows
              if (r["blocks"], r["mode"]) == (count, mode)}
        for t in trees[1:]:
            ratios = [by[(t, i)] / by[(trees[0], i)] for (tt, i) in by
                      if tt == t and (trees[0], i) in by and by[(trees[0], i)] > 0]
            if ratios:
                out.append({"blocks": count, "mode": mode, "of": f"{t}/{trees[0]}",
                            "median_ratio": statistics.median(ratios), "n": len(ratios)})
    return out


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for key in sorted({(r["tree"], r["blocks"], r["mode"]) for r in rows}):
        rs = [r for r in rows if (r["tree"], r["blocks"], r["mode"]) == key]
        s: dict[str, Any] = {"tree": key[0], "blocks": key[1], "mode": key[2], "n": len(rs)}
        for f in ("first_ms", "all_ms", "put_ms", "get_ms"):
            v = [r[f] for r in rs if f in r]
            if v:
                s[f] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
        out.append(s)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", default=[],
                   help="NAME=PATH: a checkout whose daemons to run (default: this one)")
    p.add_argument("--set", action="append", default=[],
                   help="NAME:KEY=VALUE: a setting of that tree's daemons (both hosts), e.g. "
                        "off:cluster.prefault_segment=false; a tree may appear twice "
                        "with different settings")
    p.add_argument("--cycles", type=int, default=1, help="fresh fleets, one after another")
    p.add_argument("--block", default="2MiB")
    p.add_argument("--counts", default="7,31", help="blocks per put (a 1k, a 4k prompt)")
    p.add_argument("--rounds", type=int, default=12, help="measured puts per count and fleet")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--interval", type=float, default=0.002, help="seconds between polls")
    p.add_argument("--dram", default="1536MiB", help="host A's DRAM (no eviction in the run)")
    p.add_argument("--segment", default="2GiB", help="host A's cluster segment")
    p.add_argument("--json")
    args = p.parse_args(argv)
    trees = [t.split("=", 1) for t in args.tree] or [["this", ROOT]]
    rows: list[dict[str, Any]] = []
    for _cycle in range(args.cycles):
        rows += run(args, trees)
    summ = summary(rows)
    print("\ntree      blocks mode     commit->first      commit->all   (median, min-max ms)")
    for s in summ:
        f, a = s["first_ms"], s["all_ms"]
        print(f"{s['tree']:>8} {s['blocks']:6d} {s['mode']:8s} {f['median']:6.1f} "
              f"({f['min']:.1f}-{f['max']:.1f})  {a['median']:6.1f} ({a['min']:.1f}-{a['max']:.1f})")
    ratios = paired(rows, [t[0] for t in trees])
    for r in ratios:
        print(f"{r['blocks']:3d} blocks, {r['mode']:7s}: commit -> all, {r['of']} per round: "
              f"median {r['median_ratio']:.2f}x over {r['n']} rounds")
    write_json(args.json, {"command": " ".join(sys.argv), "args": vars(args), "summary": summ,
                           "paired": ratios, "rows": rows, "loadavg": os.getloadavg()},
               indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
