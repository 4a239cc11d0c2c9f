"""The write path's round trip: reserve + commit of one key with writes without a call
(slots granted ahead, commits through the session page), alone and after other traffic.

Starts its own kvtierd (granting, on a temp socket dir and a fresh shm dir) and,
in the same run, measures the empty gRPC call (health Check) as the baseline.
Modes, ``--samples`` each:

* ``alone``: reserve + commit back to back;
* ``after-grpc``: each right after an empty gRPC call on another channel;
* ``after-grpc-sleep``: each after an empty gRPC call and 1 ms asleep (both
  processes' CPUs idle, as between a serving engine's steps).

Usage: ``.venv/bin/python bench/write_path.py [--samples N] [--json FILE]``
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvtier
from kvtier.bench.common import write_json
from kvtier.bench.private_daemon import private_daemon


def _p(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * q))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1500)
    ap.add_argument("--grant-bytes", default="64MiB")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    out: dict[str, Any] = {"command": sys.argv, "samples": args.samples, "modes": {}}
    with private_daemon("wp", "dram.capacity=256MiB", "dram.extent_size=64MiB",
                 f"server.write_grant_bytes={args.grant_bytes}") as daemon:
        channel = grpc.insecure_channel(f"unix://{daemon.grpc_path}")
        health = health_pb2_grpc.HealthStub(channel)
        req = health_pb2.HealthCheckRequest()
        health.Check(req, timeout=10)
        with kvtier.Client(daemon.socket_dir, namespace="wp", block_bytes=65536, model_uid="m") as c:
            c.put([b"prime"], [np.zeros(16, np.uint8)])  # a call: the daemon grants after it
            time.sleep(0.2)
            empty = []
            for _ in range(args.samples):
                t0 = time.perf_counter()
                health.Check(req, timeout=10)
                empty.append(time.perf_counter() - t0)
            out["empty_grpc_p50_s"] = _p(empty, 0.5)
            print(f"empty gRPC call p50 {_p(empty, 0.5) * 1e3:.3f} ms")
            for mode in ("alone", "after-grpc", "after-grpc-sleep"):
                both: list[float] = []
                commit: list[float] = []
                local = 0
                for i in range(args.samples):
                    if mode != "alone":
                        health.Check(req, timeout=10)
                    if mode == "after-grpc-sleep":
                        time.sleep(0.001)
                    t0 = time.perf_counter()
                    r = c.reserve([f"{mode}-{i}".encode()])
                    t1 = time.perf_counter()
                    local += r.reservation_id == 0
                    r.write(0, b"x" * 64)
                    t2 = time.perf_counter()
                    r.commit()
                    t3 = time.perf_counter()
                    both.append((t1 - t0) + (t3 - t2))
                    commit.append(t3 - t2)
                row = {"reserve_commit_p50_s": _p(both, 0.5), "reserve_commit_p99_s": _p(both, 0.99),
                       "commit_p50_s": _p(commit, 0.5), "from_grants": local,
                       "x_empty": _p(both, 0.5) / out["empty_grpc_p50_s"]}
                out["modes"][mode] = row
                print(f"{mode:18s} reserve+commit p50 {row['reserve_commit_p50_s'] * 1e3:.3f} ms "
                      f"({row['x_empty']:.2f}x the empty call), p99 "
                      f"{row['reserve_commit_p99_s'] * 1e3:.3f} ms, commit p50 "
                      f"{row['commit_p50_s'] * 1e3:.3f} ms, {local}/{args.samples} from grants")
        channel.close()
    write_json(args.json, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
