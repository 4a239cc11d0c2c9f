"""The cluster tier against Mooncake Store's own reads, between two network namespaces.

Host A (a kvtierd in namespace A, with the Mooncake master) holds 32 blocks per
size in its cluster segment; host B (a kvtierd in namespace B) reads them:

* **kvtier**: an ``acquire`` of the 32 keys on host B, none of them in B's DRAM:
  a Lookup of the cluster (one ``batch_is_exist``), a DRAM reservation, one
  scatter read of the 32 objects straight into B's slots by B's agent, header
  and xxh3 checks of each, the commit -- the blocks leased to the client.
  B's DRAM copies are evicted (untimed) before each round.
* **Mooncake**: a plain Mooncake client in namespace B calling
  ``batch_get_into`` for the same 32 objects into a registered shared-memory
  buffer: the transfer with no checks, no lookup, no lease.

Rounds alternate between the two; the figure is the median GB/s of each and
their ratio.  Then the cost of a lookup that misses in B's DRAM and hits in the
cluster: its median latency against the same lookup of 32 keys B holds in DRAM,
the difference against the median ``batch_is_exist`` of the same 32 names from
namespace B (one master round trip), and the master's own count of existence
requests per lookup.

    sudo .venv/bin/python bench/cluster.py --json bench/results/cluster-2026-12-03.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import kvtier  # noqa: E402
from kvtier._admin import admin_call  # noqa: E402
from kvtier.bench.common import ipc_round_trip_us, write_json  # noqa: E402
from kvtier.cli import evict  # noqa: E402
from kvtier.units import format_bytes, parse_size  # noqa: E402
from kvtier.v1 import kvtier_pb2 as pb  # noqa: E402
from kvtierd.cluster.format import HEADER_BYTES, Naming  # noqa: E402
from kvtierd.spill.format import model_hash  # noqa: E402
from tests.fleet import SECRET, Fleet, wait_for  # noqa: E402

MODEL = "bench-cluster"
BATCH = 32

#: The Mooncake client in namespace B: reads JSON commands on stdin, answers on stdout.
READER = textwrap.dedent("""
    import json, mmap, os, sys, time
    import numpy as np
    from mooncake.store import MooncakeDistributedStore
    cfg = json.loads(sys.argv[1])
    s = MooncakeDistributedStore()
    assert s.setup(cfg["host"], cfg["metadata"], 0, 16 << 20, "tcp", "", cfg["master"]) == 0
    fd = os.open(cfg["buffer"], os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, cfg["bytes"])
    mm = mmap.mmap(fd, cfg["bytes"])
    buf = np.frombuffer(mm, np.uint8)
    buf[::4096] = 1
    base = buf.ctypes.data
    assert s.register_buffer(base, cfg["bytes"]) == 0
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        names, size = cmd["names"], cmd["size"]
        if cmd["op"] == "get":
            ptrs = [base + i * size for i in range(len(names))]
            t0 = time.perf_counter()
            rcs = s.batch_get_into(names, ptrs, [size] * len(names))
            dt = time.perf_counter() - t0
            ok = all(rc == size for rc in rcs)
            print(json.dumps({"seconds": dt, "ok": ok, "rcs": rcs[:3]}), flush=True)
        elif cmd["op"] == "watch":
            # Poll batch_is_exist until every name exists: when each was first seen
            # (time.monotonic, the same clock in every network namespace).
            seen = [None] * len(names)
            deadline, polls = time.monotonic() + cmd["timeout"], 0
            while True:
                rcs = s.batch_is_exist(names)
                now, polls = time.monotonic(), polls + 1
                for i, rc in enumerate(rcs):
                    if rc == 1 and seen[i] is None:
                        seen[i] = now
                if None not in seen or now > deadline:
                    break
                time.sleep(cmd["interval"])
            print(json.dumps({"seen": seen, "polls": polls}), flush=True)
        else:
            out = []
            for _ in range(cmd["n"]):
                t0 = time.perf_counter()
                rcs = s.batch_is_exist(names)
                out.append(time.perf_counter() - t0)
                assert all(rc == 1 for rc in rcs), rcs
            print(json.dumps({"seconds": out}), flush=True)
""")


class Reader:
    def __init__(self, fleet: Fleet, nbytes: int) -> None:
        self.buffer = f"/dev/shm/kvt-bench-cluster-{os.getpid()}-{fleet.ns_b}"
        cfg = {"host": fleet.addr_b, "metadata": f"http://{fleet.addr_a}:{fleet.http_port}/metadata",
               "master": fleet.master_address, "buffer": self.buffer, "bytes": nbytes}
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": fleet.addr_b}
        self.proc = subprocess.Popen([*fleet.in_ns("b"), sys.executable, "-c", READER,
                                      json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        assert json.loads(self._line())["ready"]

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the Mooncake reader exited")
        return line

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.answer()

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self._line())
        return out

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)
        if os.path.exists(self.buffer):
            os.unlink(self.buffer)


def namespace(size: int) -> str:
    return f"bench-{size}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    largest = max(sizes)
    base = tempfile.mkdtemp(prefix="kvt-bcl-", dir="/tmp")
    fleet = Fleet(base)
    reader = None
    try:
        fleet.start_master()
        fleet.a = fleet.start_daemon("a", capacity=args.dram, extent="64MiB",
                                     segment=args.segment)
        fleet.b = fleet.start_daemon("b", "--set", f"spill.ssd_dir={base}/ssd-b",
                                     "--set", "spill.ssd_capacity=256MiB",
                                     capacity=args.dram, extent="64MiB", segment="64MiB")
        reader = Reader(fleet, BATCH * (largest + HEADER_BYTES + 4096))
        naming = Naming(SECRET)
        rows = []
        lookup: dict[str, Any] = {}
        for size in sizes:
            ns = namespace(size)
            rng = np.random.default_rng(size)
            keys = [os.urandom(16) for _ in range(BATCH)]
            data = [rng.integers(0, 256, size, np.uint8) for _ in range(BATCH)]
            names = [naming.name(ns, k, size, model_hash(MODEL)) for k in keys]
            with kvtier.Client(fleet.a.socket_dir, namespace=ns, block_bytes=size,
                               model_uid=MODEL) as a, \
                    kvtier.Client(fleet.b.socket_dir, namespace=ns, block_bytes=size,
                                  model_uid=MODEL) as b:
                assert a.put(keys, data) == BATCH
                wait_for(lambda b=b, keys=keys: b.lookup(keys) == BATCH, 60,
                         "host B to find the blocks in the cluster")
                got = b.get(keys)  # byte-exact once before timing
                assert all(np.array_equal(g, d) for g, d in zip(got, data, strict=True))
                kv, mc = timed_reads(b, reader, fleet.b.socket_dir, ns, keys, names, size,
                                     args.rounds)
                nbytes = BATCH * size
                row = {"block_bytes": size, "batch": BATCH, "rounds": args.rounds,
                       "kvtier_gbps": nbytes / statistics.median(kv) / 1e9,
                       "mooncake_gbps": nbytes / statistics.median(mc) / 1e9}
                row["ratio"] = row["kvtier_gbps"] / row["mooncake_gbps"]
                rows.append(row)
                print(f"{format_bytes(size):>8} x {BATCH}: kvtier {row['kvtier_gbps']:.3f} GB/s, "
                      f"Mooncake batch_get_into {row['mooncake_gbps']:.3f} GB/s, "
                      f"ratio {row['ratio']:.2f}", flush=True)
                if size == sizes[0]:
                    lookup = measure_lookup(fleet, reader, b, ns, size, keys, names,
                                            args.lookups)
        return {"netns": fleet.netns, "rows": rows, "lookup": lookup,
                "command": " ".join(sys.argv)}
    finally:
        if reader is not None:
            reader.close()
        fleet.close()
        shutil.rmtree(base, ignore_errors=True)


def timed_reads(b: kvtier.Client, reader: Reader, socket_dir: str, ns: str, keys: list[bytes],
                names: list[str], block_bytes: int, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds of each of ``rounds`` reads of ``keys`` from the cluster on host B: kvtier's
    acquire (B's DRAM copies evicted first, over ``socket_dir``), then the Mooncake reader's
    batch_get_into of the same objects (``names``)."""
    kv, mc = [], []
    for _ in range(rounds):
        evict(socket_dir, ns, keys, ["dram"])
        t0 = time.perf_counter()
        with b.acquire(keys, verify=False) as lease:
            dt = time.perf_counter() - t0
            assert lease.hits == len(keys), lease.hits
        kv.append(dt)
        r = reader.ask(op="get", names=names, size=block_bytes + HEADER_BYTES)
        assert r["ok"], r
        mc.append(r["seconds"])
    return kv, mc


def _timed_lookups(b: kvtier.Client, keys: list[bytes], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert b.lookup(keys) == BATCH
        out.append(time.perf_counter() - t0)
    return out


def measure_lookup(fleet: Fleet, reader: Reader, b: kvtier.Client, ns: str, size: int,
                   keys: list[bytes], names: list[str], n: int) -> dict[str, Any]:
    assert fleet.b is not None
    b.get(keys)  # into B's DRAM: answered by the client itself, from the shared index
    local = _timed_lookups(b, keys, n)
    evict(fleet.b.socket_dir, ns, keys, ["dram"])  # now only in the cluster
    # B's own blocks on its SSD tier: the daemon answers from its own index, no I/O --
    # the same call a cluster lookup makes, less the cluster.
    own = [os.urandom(16) for _ in range(BATCH)]
    assert b.put(own, [np.zeros(size, np.uint8)] * BATCH) == BATCH
    while not admin_call(fleet.b.socket_dir, "Drain", pb.DrainRequest(wait_ms=5000), 30).done:
        pass
    evict(fleet.b.socket_dir, ns, own, ["dram"])
    assert b.lookup_tiers(own) == [kvtier.Tier.SSD] * BATCH
    assert b.lookup_tiers(keys) == [kvtier.Tier.CLUSTER] * BATCH
    before = fleet.master_metrics()
    remote, daemon = [], []
    for _ in range(n):  # alternating, so both see the same machine
        remote += _timed_lookups(b, keys, 1)
        daemon += _timed_lookups(b, own, 1)
    after = fleet.master_metrics()
    rtt = reader.ask(op="exist", names=names, size=0, n=n)["seconds"]
    ipc = ipc_round_trip_us(n)
    asked = (after.get("master_batch_exist_key_requests_total", 0)
             - before.get("master_batch_exist_key_requests_total", 0))
    out = {"keys": BATCH, "lookups": n,
           "local_hit_us": statistics.median(local) * 1e6,
           "daemon_hit_us": statistics.median(daemon) * 1e6,
           "cluster_hit_us": statistics.median(remote) * 1e6,
           "master_rtt_us": statistics.median(rtt) * 1e6,
           "master_requests_per_lookup": asked / n,
           "ipc_round_trip_us": ipc}
    out["extra_us"] = out["cluster_hit_us"] - out["daemon_hit_us"]
    out["extra_over_rtt"] = out["extra_us"] / out["master_rtt_us"]
    print(f"lookup of {BATCH} keys on B: in DRAM {out['local_hit_us']:.0f} us (no call), on "
          f"B's SSD {out['daemon_hit_us']:.0f} us (a daemon call), in the cluster "
          f"{out['cluster_hit_us']:.0f} us: {out['extra_us']:.0f} us more than B's SSD; one "
          f"batch_is_exist from B {out['master_rtt_us']:.0f} us, so the cluster costs "
          f"{out['extra_over_rtt']:.2f}x a master round trip; master requests per lookup "
          f"{out['master_requests_per_lookup']:.2f}; a round trip to another process "
          f"(kvtierd -> agent) {ipc:.0f} us", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64K,2M,8M")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--lookups", type=int, default=200)
    p.add_argument("--dram", default="768MiB", help="each daemon's DRAM capacity")
    p.add_argument("--segment", default="1GiB", help="host A's cluster segment")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    result = run(args)
    if not result["netns"]:
        print("note: network namespaces unavailable; ran on loopback")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
