"""The load of a vLLM prefix hit from kvtier DRAM, outside vLLM: verify-then-copy vs verify-while-copying.

    .venv/bin/python bench/load_probe.py                        # 31 blocks, 40 rounds
    .venv/bin/python bench/load_probe.py --repeat 100 --json bench/results/load-probe.json

The geometry of ``bench/vllm_ttft.py``'s model and of vLLM's CPU backend: 8 layers,
each a bf16 tensor ``[num_blocks, kv_heads 8, block 128, 2 * head 64]`` (the
connector views it as ``[num_blocks, 1, 1, 128 Ki elements]``, layout "single",
as ``kvtier.vllm.page_views`` does), so one vLLM block is 2 MiB over all layers
and a 4k-token prefix hit loads 31 of them (62 MiB).  A private kvtierd (its
DRAM in /dev/shm, no SSD tier) holds them, saved by ``kvtier.torch.save``
through a ``checksum=True`` client (the connector's default).

Each round runs every variant once, in an order rotated from round to round:

* ``old``     what ``kvtier.torch.load`` did before: ``acquire`` (the lease checks
              each block's XXH3-64: one pass over the slots), then one
              ``_accel.scatter`` per block into its pages (a second pass);
* ``new``     ``kvtier.torch.load`` now: ``acquire(verify=False)``, then one
              ``_accel.scatter_hash`` for all blocks (copy and hash in one pass);
* ``acquire`` ``acquire(verify=False)`` and release, no copy: the RPC part of both;

and, inside one held lease (no RPC), the copies alone:

* ``verify+scatter``  ``_accel.checksum`` of each slot, then the per-block scatters;
* ``scatter_hash``    the fused call;
* ``scatter``         the per-block scatters without any hash;
* ``memcpy``          ``np.copyto`` of each slot into one flat, prefaulted buffer of
                      anonymous memory (the same bytes, one plain copy each).

Both loads are checked byte-exact against the saved pages before timing.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import kvtier
import kvtier.torch as kt
from kvtier import _accel
from kvtier.bench.common import write_json
from kvtier.demo.run import Daemon
from kvtier.paged import PagedKVLayout

MiB = 1 << 20
LAYERS, KV_HEADS, HEAD, BLOCK = 8, 8, 64, 128  # bench/vllm_ttft.py's BIG model, vLLM CPU block
#: Pages per layer of each fake cache: room for the 31 blocks and a shuffle.
NUM_BLOCKS = 64


def fake_cache(seed: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """vLLM CPU tensors (random bf16 bits, or zeros) and the connector's page views of them."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    tensors = []
    for _ in range(LAYERS):
        t = torch.zeros((NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD), dtype=torch.bfloat16)
        if gen is not None:
            raw = t.view(torch.int16)
            raw.copy_(torch.randint(-(2**15), 2**15, raw.shape, generator=gen, dtype=torch.int16))
        tensors.append(t)
    return tensors, [t.view(NUM_BLOCKS, 1, 1, -1) for t in tensors]


def page_bytes(views: list[torch.Tensor], page: int) -> bytes:
    return b"".join(v[page].view(torch.uint8).numpy().tobytes() for v in views)


def old_load(client: kvtier.Client, keys: list[bytes], host: list[np.ndarray],
             pages: list[int]) -> int:
    """``kvtier.torch.load`` before verify-while-copying (its CPU native path)."""
    with client.acquire(keys) as lease:
        for view, page in zip(lease.views, pages, strict=False):
            _accel.scatter(view, [h[page] for h in host])
        n = lease.hits
        lease.release(wait=False)
    return n


def copy_variants(views: list[np.ndarray], pieces: list[list[np.ndarray]],
                  flat: np.ndarray) -> dict[str, Callable[[], object]]:
    """The copies alone, from the slot views of a held lease into the pages (or ``flat``)."""
    def verify_scatter() -> None:
        for v in views:
            _accel.checksum(v)
        for v, p in zip(views, pieces, strict=True):
            _accel.scatter(v, p)

    def scatter() -> None:
        for v, p in zip(views, pieces, strict=True):
            _accel.scatter(v, p)

    def memcpy() -> None:
        at = 0
        for v in views:
            np.copyto(flat[at : at + v.nbytes], v)
            at += v.nbytes

    return {
        "verify+scatter": verify_scatter,
        "scatter_hash": lambda: _accel.scatter_hash(views, pieces),
        "scatter": scatter,
        "memcpy": memcpy,
    }


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def summary(ms: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=31, help="vLLM blocks loaded (default 31: 4k "
                    "tokens less the last block)")
    ap.add_argument("--repeat", type=int, default=40, help="rounds (default 40)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    if not 1 <= args.blocks <= NUM_BLOCKS // 2:
        ap.error(f"--blocks must be 1..{NUM_BLOCKS // 2}")

    _, src = fake_cache(seed=0)
    dst_tensors, dst = fake_cache(seed=None)
    lay = PagedKVLayout("single", LAYERS, 1, 1, int(src[0].shape[-1]), "bfloat16")
    assert lay.block_bytes == 2 * MiB
    host = kt._host_u8(dst)
    assert host is not None
    n = args.blocks
    rng = np.random.default_rng(0)
    src_pages = [int(p) for p in rng.permutation(NUM_BLOCKS)[:n]]
    dst_pages = [int(p) for p in rng.permutation(NUM_BLOCKS)[:n]]
    keys = [uuid.uuid4().bytes for _ in range(n)]
    flat = np.zeros(n * lay.block_bytes, dtype=np.uint8)  # memcpy's destination, prefaulted

    base = tempfile.mkdtemp(prefix="kvtier-load-probe-")
    shm = f"/dev/shm/kvtier-bench-{uuid.uuid4().hex[:12]}"
    daemon = Daemon(base=base, shm_dir=shm, ssd_dir="", capacity=256 * MiB, extent=64 * MiB,
                    ssd_capacity=MiB, ssd_file=MiB)
    daemon.start()
    results: dict[str, list[float]] = {}
    try:
        ns = kt.namespace_for(lay, f"load-probe-{uuid.uuid4().hex[:8]}")
        with kvtier.Client(daemon.socket_dir, **ns, checksum=True) as client:
            assert kt.save(client, src, src_pages, keys, layout=lay) == n
            want = {d: page_bytes(src, s) for s, d in zip(src_pages, dst_pages, strict=True)}
            for load in (lambda: old_load(client, keys, host, dst_pages),
                         lambda: kt.load(client, keys, dst, dst_pages, layout=lay)):
                for t in dst_tensors:
                    t.zero_()
                assert load() == n
                assert all(page_bytes(dst, d) == b for d, b in want.items()), "not byte-exact"

            def acquire_only() -> None:
                with client.acquire(keys, verify=False) as lease:
                    lease.release(wait=False)

            e2e: dict[str, Callable[[], object]] = {
                "old": lambda: old_load(client, keys, host, dst_pages),
                "new": lambda: kt.load(client, keys, dst, dst_pages, layout=lay),
                "acquire": acquire_only,
            }
            with client.acquire(keys, verify=False) as lease:
                pieces = [[h[p] for h in host] for p in dst_pages]
                copies = copy_variants(list(lease.views), pieces, flat)
                for group in (e2e, copies):  # one untimed pass of each: warm caches, code
                    for fn in group.values():
                        fn()
                names = list(e2e) + list(copies)
                results = {name: [] for name in names}
                for r in range(args.repeat):
                    for group in (e2e, copies):
                        order = list(group)
                        k = r % len(order)
                        for name in order[k:] + order[:k]:
                            results[name].append(timed(group[name]))
                copies = {}  # drop the closures' slot views before the lease ends
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    table = {name: summary(ms) for name, ms in results.items()}
    paired = [o / w for o, w in zip(results["old"], results["new"], strict=True)]
    paired_copy = [o / w for o, w in zip(results["verify+scatter"], results["scatter_hash"],
                                         strict=True)]
    load = os.getloadavg()
    print(f"{n} blocks x {lay.block_bytes // MiB} MiB = {n * lay.block_bytes / MiB:.0f} MiB, "
          f"{args.repeat} rounds, {os.cpu_count()} CPUs, native={_accel.NATIVE}, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'variant':<16} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for name, s in table.items():
        print(f"{name:<16} {s['median_ms']:>10.2f} {s['min_ms']:>8.2f} {s['max_ms']:>8.2f}")
    print(f"old/new load: median {statistics.median(paired):.2f}x (paired per round), "
          f"min {table['old']['min_ms'] / table['new']['min_ms']:.2f}x")
    print(f"verify+scatter / scatter_hash: median {statistics.median(paired_copy):.2f}x, "
          f"min {table['verify+scatter']['min_ms'] / table['scatter_hash']['min_ms']:.2f}x")
    if args.json:
        out: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(),
            "python": sys.version.split()[0], "cpus": os.cpu_count(), "native": _accel.NATIVE,
            "blocks": n, "block_bytes": lay.block_bytes, "repeat": args.repeat,
            "loadavg": load,
            "summary": table, "runs_ms": results,
            "old_over_new_paired_median": statistics.median(paired),
            "verify_scatter_over_scatter_hash_paired_median": statistics.median(paired_copy),
        }
        write_json(args.json, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
