"""Page faults in host B's cluster agent while it promotes 31 x 2 MiB from host A.

Two namespaces and a real master (``tests/fleet.py``); host A's client puts 31 fresh
blocks of 2 MiB per round, host B's client ``get``s them (a promotion from the cluster:
B's agent writes them into B's DRAM slots). Each round prints B's ``get`` time, the
agent's minor faults during it, and which of the agent's mappings grew resident then
(from ``/proc/PID/smaps``): a DRAM extent written through a mapping whose page tables
are empty grows by the 62 MiB of the transfer (~15.9k faults, one per 4 KiB page); one
the agent populated ahead shows nothing, and the extent grown ahead for the next round
may show instead (its populate, in the background, during this round's get).

    sudo PYTHONPATH=client:daemon .venv/bin/python bench/cluster_faults.py [--tree PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def resident(pid: int) -> dict[tuple[str, str], int]:
    """KiB resident per mapping (address range, path)."""
    out: dict[tuple[str, str], int] = {}
    cur = ("", "")
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if line[0] in "0123456789abcdef" and "-" in fields[0]:
                cur = (fields[0], fields[5] if len(fields) > 5 else "[anon]")
            elif line.startswith("Rss:"):
                out[cur] = int(fields[1])
    return out


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", default=ROOT, help="the checkout whose daemons to run")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    tree = os.path.abspath(args.tree)
    sys.path.insert(0, tree)
    import numpy as np

    import kvtier
    from tests.fleet import Fleet, wait_for

    base = tempfile.mkdtemp(prefix="kvt-flt-", dir="/tmp")
    fleet = Fleet(base)
    env = {"PYTHONPATH": f"{tree}/client:{tree}/daemon"}
    bb, n = 2 << 20, 31
    try:
        fleet.start_master()
        fleet.a = fleet.start_daemon("a", capacity="768MiB", extent="64MiB",
                                     segment="512MiB", env=env)
        fleet.b = fleet.start_daemon("b", capacity="768MiB", extent="64MiB",
                                     segment="64MiB", env=env)
        time.sleep(2)
        (agent,) = children(fleet.b.proc.pid)
        rng = np.random.default_rng(1)
        with kvtier.Client(fleet.a.socket_dir, namespace="flt", block_bytes=bb,
                           model_uid="m") as a, \
             kvtier.Client(fleet.b.socket_dir, namespace="flt", block_bytes=bb,
                           model_uid="m") as b:
            for r in range(args.rounds):
                keys = [os.urandom(16) for _ in range(n)]
                data = [rng.integers(0, 256, bb, np.uint8) for _ in range(n)]
                assert a.put(keys, data) == n
                wait_for(lambda keys=keys: b.lookup(keys) == n, 20, "B to see the blocks")
                time.sleep(0.3)
                before = resident(agent)
                m0, t0 = minor_faults(agent), time.perf_counter()
                got = b.get(keys)
                dt, m1 = time.perf_counter() - t0, minor_faults(agent)
                assert all(np.array_equal(g, d) for g, d in zip(got, data, strict=True))
                print(f"round {r}: B get {dt * 1e3:.1f} ms, B agent minor faults {m1 - m0}",
                      flush=True)
                for k, v in resident(agent).items():
                    if v - before.get(k, 0) > 1024:
                        print(f"    resident +{(v - before.get(k, 0)) >> 10} MiB: "
                              f"{os.path.basename(k[1])}", flush=True)
    finally:
        fleet.close()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
