"""SSD-tier index scale benchmark: the daemon's memory per SSD-tier entry and
its re-adoption time, with millions of entries, before and after the compact index.

For each entry count N: write spill files of 4 KiB slots holding N committed entries
(16-byte keys, one namespace; each file's header and slot table in the real format,
its data region left sparse: re-adoption reads no data), then, in a fresh process per
implementation, open an ``SsdTier`` over them and measure

* the process's anonymous memory (RssAnon, /proc) before and after ``open()``, per
  entry: the tier's heap.  The slot-table mirror (256 B an entry, the format's; the
  tier keeps it to write table pages, as the DRAM store keeps the segments' slot
  tables -- the "shared table" of the issue's target) is an anonymous *shared*
  mapping (``mmap(-1)``): RssShmem, reported apart, the same in both;
* the time ``open()`` takes (re-adoption: read and validate every table, index it);
* ``find()`` of 4096 present keys, and the length of each (``SsdAdapter.held``: what
  the tiering asked on the event loop, key by key, for the keys a lookup finds below
  DRAM), p50 of 20 rounds;
* where the module has them (this tree), the same 4096 keys asked at once:
  ``find_many`` and ``SsdAdapter.held_many`` (one native call: what the tiering asks
  now, once per lookup), in the same rounds as the per-key ``held``, on the same keys;
  and the tiering's own lookup of 4096 keys that miss DRAM and hit the SSD tier
  (``Promoter.locate`` over a DRAM index that holds none of them: one ``held_many``),
  against the per-key walk it made before (``Below.local_copy`` a key: ``held``
  through the adapter, key by key), the same keys in the same round.

``--impl before`` loads ``daemon/kvtierd/spill/ssd.py`` as of ``--before-ref`` (git;
default ``main``) in place of the working tree's; both run against the same files, in
the same conditions (buffered I/O: ``direct="false"``, the tables in the page cache).

    .venv/bin/python bench/ssd_index_scale.py --entries 1M,4M --json bench/results/ssd.json

Needs ~N x 256 B of disk for the tables (the data is sparse) and RAM for the tier.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOT = 4096
NAMESPACE = "bench/ssd"


def parse_count(text: str) -> int:
    mult = {"k": 1 << 10, "m": 1 << 20}.get(text[-1].lower(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def keys_of(start: int, n: int) -> list[bytes]:
    return [b"%016d" % i for i in range(start, start + n)]


def make_files(root: str, n: int, per_file: int) -> int:
    """Spill files of ``SLOT``-byte slots holding ``n`` committed entries; their bytes."""
    from kvtier import _accel
    from kvtierd.spill import format as fmt

    total = 0
    for index, start in enumerate(range(0, n, per_file)):
        count = min(per_file, n - start)
        layout = fmt.SpillLayout(SLOT, count)
        raw = np.zeros((count, fmt.ENTRY_BYTES), np.uint8)
        rows = raw.view(fmt.ENTRY_DTYPE).reshape(count)
        rows["state"] = fmt.EntryState.COMMITTED
        rows["key_len"] = 16
        rows["ns_len"] = len(NAMESPACE)
        rows["length"] = SLOT
        rows["checksum"] = np.arange(start, start + count, dtype=np.uint64) * 2654435761
        rows["block_bytes"] = SLOT
        rows["model_hash"] = fmt.model_hash("bench")
        rows["seq"] = np.arange(start + 1, start + count + 1, dtype=np.uint64)
        keys = np.frombuffer(b"".join(keys_of(start, count)), np.uint8).reshape(count, 16)
        raw[:, fmt.KEY_AT : fmt.KEY_AT + 16] = keys
        raw[:, fmt.NS_AT : fmt.NS_AT + len(NAMESPACE)] = np.frombuffer(NAMESPACE.encode(),
                                                                      np.uint8)
        rows["entry_sum"] = np.frombuffer(_accel.hash_rows(
            raw, fmt.ENTRY_BYTES, 0, fmt.ENTRY_SUM_AT, np.zeros(count, np.uint64)), np.uint64)
        path = os.path.join(root, f"spill-{SLOT}-{index}.kvt")
        with open(path, "wb") as f:
            f.write(fmt.pack_spill_header(layout, index, time.time_ns()))
            f.write(raw.tobytes())
            f.write(bytes(layout.table_bytes - raw.nbytes))
            f.truncate(layout.file_bytes)
        total += layout.file_bytes
    return total


def rss(field: str = "RssAnon") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def load_ssd(impl: str, ref: str) -> Any:
    if impl == "after":
        from kvtierd.spill import ssd

        return ssd
    src = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:daemon/kvtierd/spill/ssd.py"],
                         check=True, capture_output=True).stdout
    tmp = tempfile.mkdtemp(prefix="kvt-ssd-before-")
    path = os.path.join(tmp, "ssd_before.py")
    with open(path, "wb") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("kvtierd.spill.ssd_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    shutil.rmtree(tmp)
    return module


def child(root: str, impl: str, ref: str, n: int, capacity: int) -> dict[str, float]:
    from kvtierd.spill import format as fmt

    ssd_mod = load_ssd(impl, ref)
    gc.collect()
    before, shmem0 = rss(), rss("RssShmem")
    tier = ssd_mod.SsdTier(root, capacity=capacity, file_bytes=capacity, direct="false")
    t0 = time.perf_counter()
    tier.open()
    adopt_s = time.perf_counter() - t0
    gc.collect()
    after, shmem1 = rss(), rss("RssShmem")
    assert tier.counters.adopted == n, (tier.counters.adopted, n)
    mirror = sum(f.layout.table_bytes for fs in tier.files.values() for f in fs)
    mhash = fmt.model_hash("bench")
    rng = np.random.default_rng(1)
    times = []
    for _ in range(20):
        keys = keys_of(int(rng.integers(0, max(1, n - 4096))), min(4096, n))
        t1 = time.perf_counter()
        hits = sum(tier.find(NAMESPACE, k, SLOT, mhash) is not None for k in keys)
        times.append(time.perf_counter() - t1)
        assert hits == len(keys)
    # What the tiering asks on the event loop for a key below DRAM (``SsdAdapter.held``).
    if hasattr(tier, "length_of"):
        def held(k: bytes) -> object:
            return tier.length_of(NAMESPACE, k, (SLOT, mhash))
    else:
        def held(k: bytes) -> object:
            e = tier.find(NAMESPACE, k, SLOT, mhash)
            return None if e is None else e.length
    batched = hasattr(tier, "length_of_many")
    if batched:  # (this tree) the batch lookups, through the adapter the tiering uses
        from kvtierd.spill.tier import Geometry, SsdAdapter

        adapter, geometry = SsdAdapter(tier), Geometry(SLOT, mhash)
    held_times, many_times, find_many_times, locate_times, walk_times = [], [], [], [], []
    if batched:
        tiering, dram_miss, loop = _tiering_over(tier)
    for _ in range(20):
        keys = keys_of(int(rng.integers(0, max(1, n - 4096))), min(4096, n))
        t1 = time.perf_counter()
        hits = sum(held(k) is not None for k in keys)
        held_times.append(time.perf_counter() - t1)
        assert hits == len(keys)
        if batched:
            t1 = time.perf_counter()
            lengths = adapter.held_many(NAMESPACE, keys, geometry)
            many_times.append(time.perf_counter() - t1)
            assert all(x == SLOT for x in lengths)
            t1 = time.perf_counter()
            entries = tier.find_many(NAMESPACE, keys, SLOT, mhash)
            find_many_times.append(time.perf_counter() - t1)
            assert all(e is not None for e in entries)
            geometry_t = tiering.below.geometry(dram_miss)
            t1 = time.perf_counter()
            walk = [tiering.below.local_copy(NAMESPACE, k, geometry_t) for k in keys]
            walk_times.append(time.perf_counter() - t1)
            assert all(c is not None for c in walk)
            t1 = time.perf_counter()
            tiers = loop.run_until_complete(tiering.promoter.locate(dram_miss, keys))
            locate_times.append(time.perf_counter() - t1)
            assert len(tiers) == len(keys)
    if batched:
        tiering.work.pool.shutdown()
        loop.close()
    tier.close()
    row = {"entries": n, "adopt_s": adopt_s, "anon_bytes": after - before,
           "anon_per_entry": (after - before) / n,
           "mirror_per_entry": mirror / n,
           "shmem_per_entry": (shmem1 - shmem0) / n,
           "find_4096_p50_ms": statistics.median(times) * 1e3,
           "held_4096_p50_ms": statistics.median(held_times) * 1e3}
    if batched:
        row["held_many_4096_p50_ms"] = statistics.median(many_times) * 1e3
        row["find_many_4096_p50_ms"] = statistics.median(find_many_times) * 1e3
        row["locate_4096_p50_ms"] = statistics.median(locate_times) * 1e3
        row["walk_4096_p50_ms"] = statistics.median(walk_times) * 1e3
    return row


class _NoDram:
    """A namespace's DRAM index that holds none of the keys asked."""

    def find(self, keys: Any) -> np.ndarray:
        return np.zeros(len(keys), np.uint64)


def _tiering_over(tier: Any) -> tuple[Any, Any, Any]:
    """A ``Tiering`` over the SSD tier alone, not started (its lookups need no store but
    the namespace's DRAM index: ``_NoDram``), a namespace and an event loop."""
    import asyncio
    import types

    from kvtierd.tiering import Tiering

    tiering = Tiering(types.SimpleNamespace(attach_tiering=lambda **told: None), ssd=tier,  # type: ignore[arg-type]
                      io_threads=1)
    ns = types.SimpleNamespace(name=NAMESPACE, block_bytes=SLOT, model_uid="bench",
                               index=_NoDram())
    return tiering, ns, asyncio.new_event_loop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", default="1M,4M", help="entry counts (k, M suffixes)")
    ap.add_argument("--per-file", default="1M", help="slots per spill file")
    ap.add_argument("--impl", default="before,after", help="before, after or both")
    ap.add_argument("--before-ref", default="main", help="git ref of the 'before' ssd.py")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", nargs=4, metavar=("DIR", "IMPL", "N", "CAPACITY"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        root, impl, n, cap = args.child
        print(json.dumps(child(root, impl, args.before_ref, int(n), int(cap))))
        return
    ref = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.before_ref],
                         check=True, capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                          check=True, capture_output=True, text=True).stdout.strip()
    results = []
    for n in map(parse_count, args.entries.split(",")):
        root = tempfile.mkdtemp(prefix="kvt-ssd-scale-", dir="/var/tmp")
        try:
            capacity = make_files(root, n, parse_count(args.per_file))
            for impl in args.impl.split(","):
                out = subprocess.run(
                    [sys.executable, __file__, "--before-ref", args.before_ref,
                     "--child", root, impl, str(n), str(capacity)],
                    check=True, capture_output=True, text=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                row["impl"] = f"{impl} ({ref if impl == 'before' else head})"
                results.append(row)
                print(f"{row['impl']:>18} {n:>9} entries: {row['anon_per_entry']:7.1f} B/entry "
                      f"anon (+ the slot-table mirror, {row['mirror_per_entry']:.0f} B, "
                      f"RssShmem {row['shmem_per_entry']:.0f}), adoption "
                      f"{row['adopt_s']:6.2f} s, find x4096 p50 "
                      f"{row['find_4096_p50_ms']:.2f} ms, held x4096 "
                      f"{row['held_4096_p50_ms']:.2f} ms" + (
                          f"; at once: held_many {row['held_many_4096_p50_ms']:.2f} ms, "
                          f"find_many {row['find_many_4096_p50_ms']:.2f} ms; tiering lookup "
                          f"past DRAM {row['locate_4096_p50_ms']:.2f} ms (key by key "
                          f"{row['walk_4096_p50_ms']:.2f} ms)"
                          if "held_many_4096_p50_ms" in row else ""),
                      flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
