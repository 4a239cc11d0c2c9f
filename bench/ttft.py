"""TTFT with and without a kvtier prefix hit, and adapter throughput against memcpy.

    .venv/bin/python bench/ttft.py                       # 1k, 4k and 16k-token prompts
    .venv/bin/python bench/ttft.py --tokens 1024 4096 --repeat 3 --json out.json

Part 1 (TTFT): the demo's model (``kvtier.demo.model``: 4 layers, d_model 256,
GQA 8/2 x 32, float32, 16-token pages) on this machine's CPU.  For each prompt
length, after compiling both prefill chunk shapes:

* cold: prefill the whole prompt, then ``kvtier.jax.save`` its full pages;
* hit: a fresh cache and page table, ``plan_prefix`` + ``kvtier.jax.load`` of
  the prefix + prefill of the rest (at least the last token) -- timed from the
  request to the first token's logits, after one warm-up request with a
  different salt so the measured path is compiled but not cached.

The figure is the ratio hit / cold (target at 4k tokens: <= 0.1).  Next-token
logits of both paths are compared (atol = rtol = 1e-4).

Part 2 (adapter throughput): a 32-layer bf16 "kv" cache with 2 MiB pages;
``kvtier.jax.save`` / ``load`` and ``kvtier.torch.save`` / ``load`` (if torch
is installed) of 64 pages (128 MiB) against ``np.copyto`` of the same bytes
in the same run (target >= 0.7x).  The daemon is a private one (its DRAM holds
the whole set; SSD off), best of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any

import numpy as np

import kvtier
from kvtier.bench.common import write_json
from kvtier.demo.run import Daemon

MiB = 1 << 20


def _daemon(base: str, capacity: int) -> Daemon:
    shm = f"/dev/shm/kvtier-bench-{uuid.uuid4().hex[:12]}"
    d = Daemon(base=base, shm_dir=shm, ssd_dir="", capacity=capacity, extent=64 * MiB,
               ssd_capacity=MiB, ssd_file=MiB)
    d.start()
    return d


def ttft(socket_dir: str, n_tokens: int, repeat: int) -> dict[str, Any]:
    import jax.numpy as jnp

    import kvtier.jax as kj
    from kvtier.demo.model import CONFIGS, Model, make_prompt

    cfg = CONFIGS["default"]
    model = Model(cfg, seed=0, prompt_tokens=n_tokens)
    model.warm_up()
    tokens = make_prompt(cfg, n_tokens, seed=0)
    pt = cfg.page_tokens
    table = list(range(model.pages))
    ns = kj.namespace_for(kj.layout_of(model.new_cache()), f"bench-ttft-{n_tokens}")
    colds, hits = [], []
    with kvtier.Client(socket_dir, **ns) as client:
        for r in range(repeat):
            salt = f"run-{r}".encode()
            cache = model.new_cache()
            t0 = time.perf_counter()
            cache, cold_logits = model.prefill(cache, table, tokens, 0)
            colds.append(time.perf_counter() - t0)
            keys = kvtier.block_keys(tokens, pt, salt)
            kj.save(client, cache, table[: len(keys)], keys)
            # Warm-up of the hit path (compiles the load and the short prefill), other salt.
            wkeys = kvtier.block_keys(tokens, pt, salt + b"-warm")
            kj.save(client, cache, table[: len(wkeys)], wkeys)
            del cache
            for s in (salt + b"-warm", salt):
                cache = model.new_cache()
                rng = np.random.default_rng(r)
                ptable = [int(p) for p in rng.permutation(model.pages)]
                t0 = time.perf_counter()
                plan = kvtier.plan_prefix(client, tokens, block_tokens=pt, salt=s)
                cache, n = kj.load(client, plan.load_keys, cache, ptable[: plan.load_blocks])
                cache, hit_logits = model.prefill(cache, ptable, tokens[n * pt :], n * pt)
                elapsed = time.perf_counter() - t0
            hits.append(elapsed)
            ok = bool(jnp.allclose(hit_logits, cold_logits, atol=1e-4, rtol=1e-4))
            if not ok:
                raise SystemExit(f"{n_tokens} tokens: hit logits differ from cold")
    cold, hit = min(colds), min(hits)
    return {"tokens": n_tokens, "cold_ms": cold * 1e3, "hit_ms": hit * 1e3,
            "ratio": hit / cold, "loaded_tokens": n * pt, "logits_match": True,
            "cold_runs_ms": [c * 1e3 for c in colds], "hit_runs_ms": [h * 1e3 for h in hits]}


def _save_load_rows(what: str, nbytes: int, save_s: float, load_s: float,
                    memcpy: float) -> list[dict[str, Any]]:
    """The rows of one adapter's best save and load: GB/s and the multiple of memcpy's."""
    return [{"what": f"{what}.{op}", "GBps": nbytes / s / 1e9, "vs_memcpy": nbytes / s / memcpy}
            for op, s in (("save", save_s), ("load", load_s))]


def adapter_throughput(socket_dir: str, repeat: int, pages: int = 64) -> list[dict[str, Any]]:
    import jax.numpy as jnp
    import ml_dtypes

    import kvtier.jax as kj

    layers, page_tokens, heads, dim = 32, 16, 8, 128  # 32 x 2 x 16 x 8 x 128 x 2 B = 2 MiB
    shape = (pages, page_tokens, heads, dim)
    rng = np.random.default_rng(0)
    host = [(rng.integers(0, 2**16, shape, dtype=np.uint16).view(ml_dtypes.bfloat16),
             rng.integers(0, 2**16, shape, dtype=np.uint16).view(ml_dtypes.bfloat16))
            for _ in range(layers)]
    nbytes = sum(k.nbytes + v.nbytes for k, v in host)
    out: list[dict[str, Any]] = []
    # Baseline: the same bytes copied once by numpy (page-sized pieces, like the adapters).
    dst = [(np.empty_like(k), np.empty_like(v)) for k, v in host]
    for dk, dv in dst:  # fault the destination in first: the adapters' slots are prefaulted
        dk.view(np.uint16).fill(0)
        dv.view(np.uint16).fill(0)
    best = float("inf")
    for _ in range(max(3, repeat)):
        t0 = time.perf_counter()
        for (k, v), (dk, dv) in zip(host, dst, strict=True):
            np.copyto(dk, k)
            np.copyto(dv, v)
        best = min(best, time.perf_counter() - t0)
    memcpy = nbytes / best
    out.append({"what": "memcpy (np.copyto)", "GBps": memcpy / 1e9})

    cache = [(jnp.asarray(k), jnp.asarray(v)) for k, v in host]
    layout = kj.layout_of(cache)
    ns = kj.namespace_for(layout, "bench-adapter")
    with kvtier.Client(socket_dir, **ns) as client:
        save_best = load_best = float("inf")
        for r in range(repeat + 1):  # the first round also grows the daemon's extents
            keys = [f"jax-{r}-{i}".encode() for i in range(pages)]
            t0 = time.perf_counter()
            assert kj.save(client, cache, list(range(pages)), keys) == pages
            t_save = time.perf_counter() - t0
            target = [(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
                      for _ in range(layers)]
            t0 = time.perf_counter()
            target, n = kj.load(client, keys, target, list(range(pages)))
            for k, v in target:
                k.block_until_ready()
                v.block_until_ready()
            t_load = time.perf_counter() - t0
            assert n == pages
            if r:
                save_best, load_best = min(save_best, t_save), min(load_best, t_load)
            client.delete(keys)
        out += _save_load_rows("kvtier.jax", nbytes, save_best, load_best, memcpy)
    try:
        import torch

        import kvtier.torch as kt
    except ImportError:
        return out
    tcache = [(torch.from_numpy(k.view(np.uint16)).view(torch.bfloat16),
               torch.from_numpy(v.view(np.uint16)).view(torch.bfloat16)) for k, v in host]
    tlayout = kt.layout_of(tcache)
    with kvtier.Client(socket_dir, **kt.namespace_for(tlayout, "bench-adapter-t")) as client:
        save_best = load_best = float("inf")
        ttarget = [(torch.empty_like(k), torch.empty_like(v)) for k, v in tcache]
        for r in range(repeat + 1):
            keys = [f"torch-{r}-{i}".encode() for i in range(pages)]
            t0 = time.perf_counter()
            assert kt.save(client, tcache, list(range(pages)), keys) == pages
            t_save = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert kt.load(client, keys, ttarget, list(range(pages))) == pages
            t_load = time.perf_counter() - t0
            if r:
                save_best, load_best = min(save_best, t_save), min(load_best, t_load)
            client.delete(keys)
        out += _save_load_rows("kvtier.torch", nbytes, save_best, load_best, memcpy)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--skip-adapter", action="store_true")
    p.add_argument("--pages", type=int, default=64,
                   help="pages of 2 MiB per adapter save/load (64 = 1k tokens of a "
                        "Llama-3-8B-shaped cache, 256 = 4k)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    from kvtier.demo.model import setup_jax

    setup_jax()
    base = tempfile.mkdtemp(prefix="kvt-ttft-", dir="/tmp")
    d = _daemon(base, capacity=1024 * MiB)
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                           "loadavg_start": os.getloadavg()},
                               "command": " ".join([sys.executable, *sys.argv])}
    try:
        if not args.skip_ttft:
            results["ttft"] = []
            for n in args.tokens:
                r = ttft(d.socket_dir, n, args.repeat)
                results["ttft"].append(r)
                print(f"{n:>6} tokens: cold {r['cold_ms']:9.1f} ms   hit {r['hit_ms']:7.1f} ms   "
                      f"ratio {r['ratio']:.4f}   (loaded {r['loaded_tokens']} tokens, logits "
                      "match)", flush=True)
        if not args.skip_adapter:
            results["adapter"] = adapter_throughput(d.socket_dir, args.repeat, args.pages)
            for row in results["adapter"]:
                extra = f"   {row['vs_memcpy']:.2f}x memcpy" if "vs_memcpy" in row else ""
                print(f"{row['what']:<22} {row['GBps']:6.2f} GB/s{extra}", flush=True)
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(d.shm_dir, ignore_errors=True)
    results["machine"]["loadavg_end"] = os.getloadavg()
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
