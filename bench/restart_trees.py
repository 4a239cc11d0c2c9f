"""Warm restart at N blocks, source trees side by side (issue 53, item 5).

Per tree: a kvtierd run on that tree's code (``PYTHONPATH`` = its ``client`` and
``daemon``; its native module built in place) is filled once with N 4 KiB blocks
and SIGKILLed.  Then, round by round, the trees alternating in order
(``bench/tree_runs.rounds``), each tree measures one restart:

* ``empty_serving_s``: an empty daemon (its own pool directory), process start until
  a client has opened a session (the floor: starting at all);
* ``warm_all_found_s``: a daemon on the filled pool, process start until a client has
  found every block (lookups of 4096 keys, retried while it does not serve yet);
* ``lookups_s``: right after, one more pass of the same lookups by that client, the
  daemon idle (one pass of N lookups);
* ``extra_s`` = ``warm_all_found_s - empty_serving_s - lookups_s``: what a restart
  costs beyond starting at all and beyond looking every block up once;
* the warm daemon's own figures: spawn to READY=1, and ``recovery_seconds``.

The client of each measurement is a child process on the same tree, its imports done
before the clock starts (a client coming back after a restart is already running).
Every time is ``time.monotonic`` (CLOCK_MONOTONIC: the same clock in every process).

    .venv/bin/python bench/restart_trees.py --tree today=. --tree ae70d60=/tmp/ae70d60 \\
        --blocks 1M --rounds 5 --json bench/results/FILE.json

Needs N * 4 KiB of /dev/shm per tree (plus ~12%), and the trees' native modules built
(``python setup.py build_ext --inplace`` in an old tree).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

BATCH = 4096  # keys per reserve/commit and per lookup (the default max_keys_per_call)
BLOCK = 4096
NAMESPACE = "bench/index"


def keys_of(start: int, n: int) -> list[bytes]:
    return [b"%016d" % i for i in range(start, start + n)]  # 16 bytes, as index_scale.py


# --- the child: runs on one tree's kvtier -------------------------------------------------

def _client(sock_dir: str) -> Any:
    import kvtier
    return kvtier.Client(sock_dir, namespace=NAMESPACE, block_bytes=BLOCK, model_uid="b",
                         fast_path=True, timeout=60)


def _child(mode: str, sock_dir: str, n: int) -> None:
    import numpy as np

    import kvtier
    if mode == "fill":
        data = np.frombuffer(bytes(range(256)) * (BLOCK // 256), np.uint8)
        with _client(sock_dir) as c:
            for at in range(0, n, BATCH):
                keys = keys_of(at, min(BATCH, n - at))
                with c.reserve(keys) as r:
                    for i in r.reserved:
                        r.buffers[i][: len(data)] = data
                    r.commit()
            assert c.lookup(keys_of(0, BATCH)) == BATCH
        print(json.dumps({}), flush=True)
        return
    batches = [keys_of(at, min(BATCH, n - at)) for at in range(0, n, BATCH)] if mode == "find" else []
    print("ready", flush=True)
    sys.stdin.readline()  # "go": the daemon has been spawned
    while True:
        try:
            c = _client(sock_dir)
            break
        except kvtier.errors.KVTierError:
            time.sleep(0.01)
    with c:
        opened = time.monotonic()
        for keys in batches:
            while c.lookup(keys) != len(keys):
                time.sleep(0.001)
        found = time.monotonic()
        t0 = time.monotonic()
        for keys in batches:
            assert c.lookup(keys) == len(keys)
        lookups = time.monotonic() - t0
    print(json.dumps({"opened": opened, "found": found, "lookups_s": lookups}), flush=True)


# --- the parent ---------------------------------------------------------------------------

def _env(tree: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = f"{tree / 'client'}{os.pathsep}{tree / 'daemon'}"
    env.update(extra or {})
    return env


class Tree:
    def __init__(self, label: str, path: Path, n: int, capacity: int) -> None:
        self.label, self.path, self.n, self.capacity = label, path, n, capacity
        self.tmp = tempfile.mkdtemp(prefix=f"kvt-trees-{label}-", dir="/tmp")
        self.shm = f"/dev/shm/kvtier-bench-trees-{uuid.uuid4().hex[:8]}"
        self.sock = os.path.join(self.tmp, "sock")
        self.notify_path = os.path.join(self.tmp, "notify")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(self.notify_path)
        self.notify.settimeout(600)
        self.owns_pool = True

    def daemon(self, shm: str, log_path: str) -> tuple[subprocess.Popen[bytes], float]:
        args = [sys.executable, "-m", "kvtierd"]
        for item in (f"server.socket_dir={self.sock}", f"dram.shm_dir={shm}",
                     "metrics.address=", "spill.ssd_dir=", f"dram.capacity={self.capacity}",
                     "dram.extent_size=256MiB", "log.level=info"):
            args += ["--set", item]
        with open(log_path, "wb") as log:
            t0 = time.monotonic()
            proc = subprocess.Popen(args, env=_env(self.path, {"NOTIFY_SOCKET": self.notify_path}),
                                    stdout=subprocess.DEVNULL, stderr=log)
        return proc, t0

    def ready(self) -> float:
        while True:
            if "READY=1" in self.notify.recv(4096).decode().split("\n"):
                return time.monotonic()

    def child(self, mode: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, __file__, "--child", mode, self.sock,
                                 str(self.n)], env=_env(self.path), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)

    def fill(self) -> None:
        proc, _ = self.daemon(self.shm, os.path.join(self.tmp, "fill.log"))
        try:
            self.ready()
            out = subprocess.run([sys.executable, __file__, "--child", "fill", self.sock,
                                  str(self.n)], env=_env(self.path), check=True,
                                 capture_output=True, text=True)
            del out
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)

    def measure(self, shm: str, r: int, what: str) -> dict[str, float]:
        """Spawn a daemon on ``shm``; the times until READY and until a client found
        every block (none for an empty pool); then SIGKILL (warm) or SIGTERM (empty)."""
        finder = self.child("find" if what == "warm" else "open")
        assert finder.stdout is not None and finder.stdin is not None
        assert finder.stdout.readline().strip() == "ready"
        proc, t0 = self.daemon(shm, os.path.join(self.tmp, f"{what}-{r}.log"))
        finder.stdin.write("go\n")
        finder.stdin.flush()
        try:
            ready = self.ready()
            cpu = _cpu_seconds(proc.pid)
            got = json.loads(finder.stdout.readline())
            finder.wait(60)
            row = {"ready_s": ready - t0, "cpu_at_ready_s": cpu, "opened_s": got["opened"] - t0,
                   "found_s": got["found"] - t0, "lookups_s": got["lookups_s"]}
            if what == "warm":
                row["recovery_s"] = _recovery_seconds(os.path.join(self.tmp, f"{what}-{r}.log"))
        finally:
            proc.send_signal(signal.SIGKILL if what == "warm" else signal.SIGTERM)
            proc.wait(60)
        return row

    def round(self, r: int) -> dict[str, float]:
        empty_shm = self.shm + "-empty"
        try:
            empty = self.measure(empty_shm, r, "empty")
        finally:
            shutil.rmtree(empty_shm, ignore_errors=True)
        warm = self.measure(self.shm, r, "warm")
        return {"empty_ready_s": empty["ready_s"], "empty_serving_s": empty["opened_s"],
                "empty_cpu_at_ready_s": empty["cpu_at_ready_s"],
                "warm_cpu_at_ready_s": warm["cpu_at_ready_s"],
                "warm_ready_s": warm["ready_s"], "warm_opened_s": warm["opened_s"],
                "warm_all_found_s": warm["found_s"], "lookups_s": warm["lookups_s"],
                "recovery_s": warm["recovery_s"],
                "found_after_empty_s": warm["found_s"] - empty["opened_s"],
                "extra_s": warm["found_s"] - empty["opened_s"] - warm["lookups_s"]}

    def close(self, keep: str | None = None) -> None:
        self.notify.close()
        if keep:
            for name in os.listdir(self.tmp):
                if name.endswith(".log"):
                    shutil.copy(os.path.join(self.tmp, name), os.path.join(keep, f"{self.label}-{name}"))
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.owns_pool:
            shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.shm + "-empty", ignore_errors=True)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _recovery_seconds(log_path: str) -> float:
    with open(log_path) as f:
        for line in f:
            if "recovery: warm start" in line:
                return float(line.rsplit(" in ", 1)[1].split()[0])
    return float("nan")


def _cpu() -> dict[str, Any]:
    model, flags = "", ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    return {"model": model, "cpus": os.cpu_count(), "flags": flags,
            "avx512": sorted(f for f in flags.split() if f.startswith("avx512")),
            "kernel": platform.release()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--child", nargs=3, metavar=("MODE", "SOCK", "N"), help=argparse.SUPPRESS)
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                   help="a source tree to run (repeat); default: this checkout")
    p.add_argument("--pool-of", action="append", default=[], metavar="LABEL=OTHER",
                   help="tree LABEL restarts on tree OTHER's filled pool (the same segment "
                        "format: no fill of its own)")
    p.add_argument("--blocks", default="1M", help="blocks of 4 KiB (1M = 2**20)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--keep-logs", metavar="DIR", help="copy the daemons' logs there")
    args = p.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    shift = {"K": 10, "M": 20}.get(args.blocks[-1:], 0)
    n = int(args.blocks[:-1] if shift else args.blocks) << shift
    capacity = -(-(n * (BLOCK + 256) + (256 << 20)) // (1 << 20)) << 20
    specs = args.tree or [f"this={Path(__file__).resolve().parent.parent}"]
    trees = [Tree(label, Path(path).resolve(), n, capacity)
             for label, path in (s.split("=", 1) for s in specs)]
    runs: dict[str, list[dict[str, float]]] = {t.label: [] for t in trees}
    load = [os.getloadavg()[0]]  # (another's work on the host: noted, not subtracted)
    by_label = {t.label: t for t in trees}
    for spec in args.pool_of:
        label, other = spec.split("=", 1)
        by_label[label].shm, by_label[label].owns_pool = by_label[other].shm, False
    try:
        for t in (t for t in trees if t.owns_pool):
            t0 = time.monotonic()
            t.fill()
            print(f"{t.label}: filled {n} blocks in {time.monotonic() - t0:.1f} s",
                  file=sys.stderr, flush=True)
        for r in range(args.rounds):
            for t in trees if r % 2 == 0 else reversed(trees):
                row = t.round(r)
                runs[t.label].append(row)
                print(f"round {r + 1} {t.label}: {json.dumps(row)}", file=sys.stderr, flush=True)
    finally:
        for t in trees:
            t.close(args.keep_logs)
    load.append(os.getloadavg()[0])
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for label, rows in runs.items():
        summary[label] = {}
        for name in rows[0] if rows else []:
            xs = [row[name] for row in rows]
            summary[label][name] = {"min": min(xs), "median": statistics.median(xs),
                                    "max": max(xs)}
    print(f"{'tree':>10} {'':>18} {'min':>7} {'median':>7} {'max':>7}")
    for label, figures in summary.items():
        for name in ("extra_s", "found_after_empty_s", "lookups_s", "recovery_s",
                     "warm_cpu_at_ready_s", "empty_cpu_at_ready_s",
                     "warm_ready_s", "empty_ready_s", "empty_serving_s"):
            if name in figures:
                f = figures[name]
                print(f"{label:>10} {name:>18} {f['min']:7.3f} {f['median']:7.3f} {f['max']:7.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"command": " ".join(["bench/restart_trees.py", *sys.argv[1:]]),
                       "blocks": n, "block_bytes": BLOCK, "cpu": _cpu(),
                       "load_1min_before_after": load,
                       "trees": {t.label: str(t.path) for t in trees},
                       "pool_of": args.pool_of,
                       "summary": summary, "runs": runs}, out, indent=1)
            out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
