"""Disaggregated prefill/decode through kvtier: TTFT and the cross-host KV transfer.

Every figure comes from vLLM OpenAI servers (the random-weight model of
``tests/vllm/tinymodel.py``, ``enforce_eager``, one prompt per step) and real kvtierds:

* **TTFT, one host**: a streaming ``/v1/completions`` through ``kvtier pd-proxy`` in front of
  a prefill server (``kv_producer``) and a decode server (``kv_consumer``) sharing one
  kvtierd, against the same request to one colocated server without a connector.  A fresh
  prompt every round (no cache hit anywhere but the P/D hand-off), the two alternating.
* **TTFT, two hosts**: the prefill server, its kvtierd and the proxy in network namespace A,
  the decode server and its kvtierd in namespace B (a veth pair; the kvtierds joined through
  the cluster tier to a real ``mooncake_master``, ``tests/fleet.py``); the colocated server
  is the same one as above.
* **The partial block**: the decode server's own TTFT (a direct request after the prefill
  server has seen the prompt) for prompts that end 1, 64, 127 and 128 tokens past a block
  boundary: what recomputing the last block costs, the most a key over the exact tail
  tokens could save.
* **KV transfer, two hosts**: the decode server's load of a 4k prompt's blocks from host A
  (its connector's counters per phase: the wait for announced blocks, lookups, the load's
  Acquire and copies), and right after a prefill in the same rounds, the same hand-off
  without vLLM on B (a plain kvtier client's ``acquire``; Mooncake's ``batch_get_into`` of
  the same objects); then, on the last prompt's blocks, rounds alternating: host B's
  kvtierd leasing them from the cluster (an ``acquire`` with B's DRAM copies evicted
  first) against a plain Mooncake client in namespace B calling ``batch_get_into`` for the
  same objects (``bench/cluster.py``'s reader).  ``--fill-dram`` measures the steady
  state: every kvtierd extent made before the rounds (a fresh kvtierd makes and pre-faults
  one inside a request every ``--extent`` bytes).

    sudo PYTHONPATH=client:daemon .venv/bin/python bench/vllm_pd.py \\
        --json bench/results/vllm-pd-2026-12-04.json
    sudo PYTHONPATH=client:daemon .venv/bin/python bench/vllm_pd.py --skip-one-host \\
        --load-mode sync --dram 256MiB --segment 2GiB --fill-dram \\
        --json bench/results/vllm-pd-2026-12-04-two-hosts-sync-steady-paced.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
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

import kvtier  # noqa: E402
from kvtier.bench.common import write_json  # noqa: E402
from kvtier.hashing import block_keys  # noqa: E402
from kvtier.units import parse_size  # noqa: E402
from kvtier.vllm import request_salt  # noqa: E402
from kvtierd.cluster.format import HEADER_BYTES, Naming  # noqa: E402
from kvtierd.spill.format import model_hash  # noqa: E402
from tests.conftest import DaemonProc, start_daemon, stop_daemon  # noqa: E402
from tests.fleet import MASTER_BIN, SECRET, Fleet  # noqa: E402
from tests.vllm import tinymodel  # noqa: E402
from tests.vllm.pdlab import (  # noqa: E402
    BLOCK,
    ProxyProc,
    VllmServer,
    call,
    completion,
    kvtier_ktc,
    start_all,
    stream,
)

TAILS = (1, 64, 127, 128)


class Prompts:
    """Fresh seeded prompts: never two alike, so nothing but the P/D hand-off hits."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return [self._rng.randrange(3, 32000) for _ in range(n)]


def ttft(url: str, tokens: list[int], answer: int, ns: str | None = None,
         params: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streaming request: seconds to the first token, cached tokens, the token ids."""
    extra: dict[str, Any] = {"kv_transfer_params": params} if params else {}
    res = stream(url + "/v1/completions",
                 completion(tokens, answer, stream=True, stream_options={"include_usage": True},
                            **extra), ns=ns, timeout=600)
    if res["status"] != 200 or not res["done"]:
        raise RuntimeError(f"request to {url} failed: {res}")
    first = next(t for t, e in zip(res["times"], res["events"], strict=False)
                 if any(c.get("token_ids") for c in e.get("choices") or []))
    usage: dict[str, Any] = next((e["usage"] for e in reversed(res["events"]) if e.get("usage")), {})
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    ids = [t for e in res["events"] for c in e.get("choices") or [] for t in c.get("token_ids")
           or []]
    return {"ttft_s": first, "cached": int(cached), "ids": ids}


def prefill(url: str, tokens: list[int], ns: str | None = None) -> dict[str, Any]:
    """A producer's one-token request, as the proxy sends it; its ``kv_transfer_params``."""
    status, out = call(url + "/v1/completions", completion(tokens, 1), ns=ns, timeout=600)
    if status != 200:
        raise RuntimeError(f"prefill at {url}: {status} {out}")
    return dict(out.get("kv_transfer_params") or {})


def counters(server: VllmServer) -> dict[str, float]:
    return {k.removeprefix("vllm:kvtier_").removesuffix("_total"): v
            for k, v in server.metrics().items()
            if k.startswith("vllm:kvtier_") and not k.endswith("_created")}


#: The decode connector's counters per phase of a cross-host load (kvtier.vllm.COUNTERS).
PHASES = ("wait_seconds", "lookup_seconds", "load_seconds", "load_acquire_seconds",
          "load_copy_seconds")


def daemon_counters(daemon: Any) -> dict[str, float]:
    """A kvtierd's promotion and prefetch counters, its cluster-tier reads and the seconds
    it spent pre-faulting new DRAM extents."""
    st = daemon.stats()
    out = {"promotions": float(st.promotions), "prefetches": float(st.prefetches),
           "prefetch_hits": float(st.prefetch_hits),
           "prefault_seconds": float(st.prefault_seconds)}
    for io in st.io:
        if io.reads:
            out[f"tier{int(io.tier)}_reads"] = float(io.reads)
    return out


def summary(xs: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(xs) * 1e3, "min_ms": min(xs) * 1e3,
            "max_ms": max(xs) * 1e3}


def server_args(args: argparse.Namespace) -> dict[str, Any]:
    max_len = max(args.sizes) + max(TAILS) + args.answer + BLOCK
    return {"max_model_len": max_len, "dtype": args.dtype,
            "extra_args": ["--max-num-batched-tokens", str(max_len)],
            "env": {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib),
                    **json.loads(args.server_env)}}


def fill_dram(args: argparse.Namespace, fleet: Fleet, prompts: Prompts, proxy: ProxyProc,
              ns_a: str | None) -> dict[str, Any]:
    """P/D requests of the largest size until both kvtierds' namespaces hold every DRAM extent
    their budget allows: the steady state of a daemon that has run a while, where a new block
    takes a slot of an extent made earlier (a fresh daemon makes and pre-faults an extent in
    the middle of a request every ``--extent`` bytes until DRAM is full)."""
    assert fleet.a is not None and fleet.b is not None
    want = parse_size(args.dram) // parse_size(args.extent)

    def extents() -> list[int]:
        out = []
        for d in (fleet.a, fleet.b):
            got = [n.segments for n in d.stats().namespaces if n.name.startswith("vllm/")]
            out.append(got[0] if got else 0)
        return out

    t0 = time.perf_counter()
    n = 0
    while min(extents()) < want and n < 4 * want:
        ttft(proxy.url, prompts(max(args.sizes)), 1, ns_a)
        n += 1
    got = extents()
    print(f"[fill DRAM] {n} requests, {time.perf_counter() - t0:.0f} s: extents A {got[0]}, "
          f"B {got[1]} (of {want})", flush=True)
    return {"requests": n, "extents_a": got[0], "extents_b": got[1], "extents_wanted": want}


def ttft_rounds(args: argparse.Namespace, prompts: Prompts, colocated: VllmServer,
                proxy: ProxyProc, decode: VllmServer, ns: str | None, where: str
                ) -> list[dict[str, Any]]:
    rows = []
    for size in args.sizes:
        co, pd, cached = [], [], []
        same: bool | None = True if args.check_answers else None
        loads: list[dict[str, float]] = []
        for r in range(args.rounds):
            order = ("co", "pd") if r % 2 == 0 else ("pd", "co")
            tokens = {"co": prompts(size), "pd": prompts(size)}
            for which in order:
                if which == "co":
                    co.append(ttft(colocated.url, tokens["co"], args.answer)["ttft_s"])
                else:
                    before = counters(decode)
                    res = ttft(proxy.url, tokens["pd"], args.answer, ns)
                    after = counters(decode)
                    pd.append(res["ttft_s"])
                    cached.append(res["cached"])
                    loads.append({k: after.get(k, 0) - before.get(k, 0) for k in after})
                    if args.check_answers:
                        want = ttft(colocated.url, tokens["pd"], args.answer)["ids"]
                        same = bool(same) and want == res["ids"]
        row = {"where": where, "tokens": size, "rounds": args.rounds,
               "colocated": summary(co), "pd": summary(pd),
               "pd_over_colocated": statistics.median(pd) / statistics.median(co),
               "decode_cached_tokens": cached, "answers_identical": same,
               "decode_connector": loads}
        rows.append(row)
        print(f"[{where}] {size} tokens: TTFT colocated {row['colocated']['median_ms']:.0f} ms, "
              f"P/D {row['pd']['median_ms']:.0f} ms ({row['pd_over_colocated']:.2f}x); "
              f"decode cached {cached}; answers identical: "
              f"{'not checked' if same is None else same}", flush=True)
    return rows


def tail_rounds(args: argparse.Namespace, prompts: Prompts, prefill_srv: VllmServer,
                decode: VllmServer) -> list[dict[str, Any]]:
    base = min(args.sizes)
    rows = []
    per: dict[int, list[float]] = {t: [] for t in TAILS}
    for _ in range(args.rounds):
        for tail in TAILS:
            tokens = prompts(base + tail)
            params = prefill(prefill_srv.url, tokens)
            per[tail].append(ttft(decode.url, tokens, args.answer, params=params)["ttft_s"])
    for tail in TAILS:
        computed = tail if tail < BLOCK else BLOCK
        rows.append({"prompt_tokens": base + tail, "tail": tail, "recomputed_tokens": computed,
                     "decode_ttft": summary(per[tail])})
        print(f"[partial block] {base}+{tail} tokens: decode TTFT "
              f"{statistics.median(per[tail]) * 1e3:.1f} ms ({computed} tokens computed)",
              flush=True)
    return rows


def _after_prefill(b: kvtier.Client, keys: list[bytes], timeout: float = 30.0) -> float:
    """Wait until kvtierd B sees every one of ``keys`` (a lookup, no prefetch, at most every
    5 ms, as a held consumer does); returns the seconds waited."""
    t0 = time.perf_counter()
    while b.lookup(keys) < len(keys):
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"the producer's blocks did not reach host B in {timeout} s")
        time.sleep(0.005)
    return time.perf_counter() - t0


def transfer(args: argparse.Namespace, fleet: Fleet, prompts: Prompts, prefill_srv: VllmServer,
             decode: VllmServer) -> dict[str, Any]:
    """The decode server's cross-host load of a prompt, and kvtier vs Mooncake on its blocks.

    Each round prefills three fresh prompts on host A and moves each one's blocks to host B
    right after its prefill answered, in three ways: the decode server's own load (its
    connector's counters), a plain kvtier client on B (wait until B sees the blocks, then one
    ``acquire`` of them, checksums verified), and Mooncake's ``batch_get_into`` of the same
    objects (after the same wait).  Then, on the last prompt's blocks, rounds alternating B's
    ``acquire`` (its DRAM copies evicted first) with ``batch_get_into``, nothing else running.
    """
    assert fleet.a is not None and fleet.b is not None
    size = max(args.sizes)
    ns_a = fleet.ns_a if fleet.netns else None
    ns_b = fleet.ns_b if fleet.netns else None
    found = [(n.name, n.block_bytes, n.model_uid) for n in fleet.a.stats().namespaces
             if n.name.startswith("vllm/")]
    name, block_bytes, uid = found[0]
    naming = Naming(SECRET)
    salt = request_salt("", None, None)
    nkeys = (size - 1) // BLOCK

    def keys_names(tokens: list[int]) -> tuple[list[bytes], list[str]]:
        keys = block_keys(tokens, BLOCK, salt)[:nkeys]
        return keys, [naming.name(name, k, block_bytes, model_hash(uid)) for k in keys]

    engine = []
    fresh_kv: list[dict[str, float]] = []
    fresh_mc: list[dict[str, float]] = []
    tokens: list[int] = []
    reader = cluster_bench.Reader(fleet, nkeys * (block_bytes + HEADER_BYTES + 4096))
    try:
        with kvtier.Client(fleet.b.socket_dir, namespace=name, block_bytes=block_bytes,
                           model_uid=uid) as b:
            for _ in range(args.rounds):
                tokens = prompts(size)
                # The producer's kv_transfer_params, as the proxy passes them: the decode
                # server waits for blocks still on their way to the cluster instead of
                # recomputing them.
                params = prefill(prefill_srv.url, tokens, ns_a)
                before, b_before = counters(decode), daemon_counters(fleet.b)
                res = ttft(decode.url, tokens, 1, ns_b, params)
                after, b_after = counters(decode), daemon_counters(fleet.b)
                d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                d["cached"] = res["cached"]
                d["ttft_s"] = res["ttft_s"]
                d["kvtierd_b"] = {k: b_after[k] - b_before.get(k, 0) for k in b_after}
                engine.append(d)
                # The same hand-off without vLLM on B: a kvtier client, then Mooncake.
                fresh = prompts(size)
                keys, _ = keys_names(fresh)
                prefill(prefill_srv.url, fresh, ns_a)
                wait = _after_prefill(b, keys)
                t0 = time.perf_counter()
                with b.acquire(keys) as lease:
                    dt = time.perf_counter() - t0
                    assert lease.hits == len(keys), lease.hits
                fresh_kv.append({"wait_s": wait, "acquire_s": dt})
                fresh = prompts(size)
                keys, names = keys_names(fresh)
                prefill(prefill_srv.url, fresh, ns_a)
                wait = _after_prefill(b, keys)
                r = reader.ask(op="get", names=names, size=block_bytes + HEADER_BYTES)
                assert r["ok"], r
                fresh_mc.append({"wait_s": wait, "get_s": r["seconds"]})
                print(f"[transfer] right after a prefill: engine load "
                      f"{d.get('load_seconds', 0) * 1e3:.0f} ms (acquire "
                      f"{d.get('load_acquire_seconds', 0) * 1e3:.0f}), client acquire "
                      f"{dt * 1e3:.0f} ms, batch_get_into {r['seconds'] * 1e3:.0f} ms",
                      flush=True)
            keys, names = keys_names(tokens)
            kv, mc = cluster_bench.timed_reads(b, reader, fleet.b.socket_dir, name, keys, names,
                                               block_bytes, args.transfer_rounds)
    finally:
        reader.close()
    nbytes = len(keys) * block_bytes
    eng = [(e.get("lookup_seconds", 0) + e.get("load_seconds", 0), e.get("loaded_blocks", 0))
           for e in engine]
    eng_s = statistics.median(s for s, _ in eng)
    # The decode server's time per phase (medians over the rounds): its wait for blocks the
    # producer announced but the cluster did not show yet, its Lookup calls, and its load's
    # Acquire (kvtierd B promoting from the cluster) and copies into the paged cache.
    phases = {name: statistics.median(e.get(name, 0) for e in engine) * 1e3
              for name in PHASES}
    load_s = statistics.median(e.get("load_seconds", 0) for e in engine)
    out = {"prompt_tokens": size, "blocks": len(keys), "block_bytes": block_bytes,
           "bytes": nbytes, "engine_rounds": engine,
           "engine_phases_ms": phases,
           "engine_load_only_ms": load_s * 1e3,
           "engine_load_only_gbps": nbytes / load_s / 1e9 if load_s else None,
           "engine_load_ms": eng_s * 1e3, "engine_gbps": nbytes / eng_s / 1e9,
           "kvtier_acquire_ms": statistics.median(kv) * 1e3,
           "mooncake_get_ms": statistics.median(mc) * 1e3,
           "kvtier_gbps": nbytes / statistics.median(kv) / 1e9,
           "mooncake_gbps": nbytes / statistics.median(mc) / 1e9,
           "rounds": args.transfer_rounds}
    out["ratio"] = out["kvtier_gbps"] / out["mooncake_gbps"]
    out["engine_ratio"] = out["engine_gbps"] / out["mooncake_gbps"]
    out["fresh_client"] = fresh_kv
    out["fresh_mooncake"] = fresh_mc
    out["fresh_client_acquire_ms"] = statistics.median(x["acquire_s"] for x in fresh_kv) * 1e3
    out["fresh_mooncake_get_ms"] = statistics.median(x["get_s"] for x in fresh_mc) * 1e3
    out["engine_load_vs_fresh_mooncake"] = (out["fresh_mooncake_get_ms"]
                                            / out["engine_load_only_ms"] if load_s else None)
    out["engine_load_only_ratio"] = (out["mooncake_get_ms"] / out["engine_load_only_ms"]
                                     if load_s else None)
    print("[transfer] decode server's phases (median ms): "
          + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()), flush=True)
    print(f"[transfer] {len(keys)} blocks of {block_bytes >> 10} KiB: decode server's load "
          f"{out['engine_load_ms']:.1f} ms ({out['engine_gbps']:.3f} GB/s, "
          f"{out['engine_ratio']:.2f}x Mooncake; its load alone "
          f"{out['engine_load_only_ms']:.1f} ms, {out['engine_load_only_ratio'] or 0:.2f}x); "
          f"B's acquire {out['kvtier_acquire_ms']:.1f} ms "
          f"({out['kvtier_gbps']:.3f} GB/s) vs batch_get_into {out['mooncake_get_ms']:.1f} ms "
          f"({out['mooncake_gbps']:.3f} GB/s): {out['ratio']:.2f}x", flush=True)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix="kvt-bpd-", dir="/tmp")
    prompts = Prompts(args.seed)
    sargs = server_args(args)
    result: dict[str, Any] = {"command": " ".join(sys.argv), "machine": platform.node(),
                              "cpus": os.cpu_count()}
    daemon: DaemonProc | None = None
    servers: list[VllmServer] = []
    proxies: list[ProxyProc] = []
    fleet: Fleet | None = None
    try:
        model = str(tinymodel.build(os.path.join(base, "model"), layers=args.layers,
                                    hidden=args.hidden, heads=args.heads,
                                    kv_heads=args.kv_heads, vocab=32000,
                                    intermediate=2 * args.hidden, dtype=args.dtype))
        result["model"] = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                           "kv_heads": args.kv_heads, "dtype": args.dtype}
        colocated = VllmServer(base, "colocated", model, None, **sargs)
        servers.append(colocated)
        if args.skip_one_host:
            start_all(servers, 600)
        else:
            daemon = start_daemon(base, capacity=args.dram, extent="64MiB")
            sock = daemon.socket_dir
            pre = VllmServer(base, "prefill", model, kvtier_ktc("kv_producer", sock), **sargs)
            dec = VllmServer(base, "decode", model, kvtier_ktc("kv_consumer", sock), **sargs)
            servers += [pre, dec]
            start_all(servers, 600)
            proxy = ProxyProc(base, "proxy", [pre.url], [dec.url], timeout=600)
            proxies.append(proxy)
            ttft(proxy.url, prompts(min(args.sizes)), 2)  # warm-up: an engine's first request
            result["one_host"] = ttft_rounds(args, prompts, colocated, proxy, dec, None,
                                             "one host")
            result["partial_block"] = tail_rounds(args, prompts, pre, dec)
            for s in (pre, dec):
                s.stop()
            proxy.stop()
            servers = [colocated]
        ttft(colocated.url, prompts(min(args.sizes)), 2)
        if args.one_host_only or not os.path.exists(MASTER_BIN):
            result["two_hosts"] = None if args.one_host_only else f"{MASTER_BIN} missing"
            return result

        os.makedirs(os.path.join(base, "fleet"))
        fleet = Fleet(os.path.join(base, "fleet"))
        fleet.start_master()
        fleet.a = fleet.start_daemon("a", capacity=args.dram, extent=args.extent,
                                     segment=args.segment)
        fleet.b = fleet.start_daemon("b", capacity=args.dram, extent=args.extent,
                                     segment="64MiB")
        ns_a = fleet.ns_a if fleet.netns else None
        ns_b = fleet.ns_b if fleet.netns else None
        pre = VllmServer(base, "prefill-a", model, kvtier_ktc("kv_producer", fleet.a.socket_dir),
                         ns=ns_a, prefix=fleet.in_ns("a"), host=fleet.addr_a, **sargs)
        dec = VllmServer(base, "decode-b", model,
                         kvtier_ktc("kv_consumer", fleet.b.socket_dir, load_mode=args.load_mode,
                                    **json.loads(args.consumer_config)),
                         ns=ns_b, prefix=fleet.in_ns("b"), host=fleet.addr_b, **sargs)
        servers += [pre, dec]
        start_all([pre, dec], 600)
        proxy = ProxyProc(base, "proxy-a", [pre.url], [dec.url], ns=ns_a,
                          prefix=fleet.in_ns("a"), host=fleet.addr_a, timeout=600)
        proxies.append(proxy)
        ttft(proxy.url, prompts(min(args.sizes)), 2, ns_a)
        if args.fill_dram:
            result["fill_dram"] = fill_dram(args, fleet, prompts, proxy, ns_a)
        result["netns"] = fleet.netns
        result["load_mode"] = args.load_mode
        result["extent"] = args.extent
        result["consumer_config"] = json.loads(args.consumer_config)
        result["two_hosts"] = ttft_rounds(args, prompts, colocated, proxy, dec, ns_a,
                                          "two hosts")
        result["transfer"] = transfer(args, fleet, prompts, pre, dec)
        return result
    finally:
        for p in proxies:
            p.stop()
        for s in servers:
            s.stop()
        if fleet is not None:
            fleet.close()
        if daemon is not None:
            stop_daemon(daemon)
        if args.keep_logs:
            os.makedirs(args.keep_logs, exist_ok=True)
            for f in os.listdir(base):
                if f.endswith(".log"):
                    shutil.copy(os.path.join(base, f), args.keep_logs)
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1024,4096", help="prompt tokens (comma-separated)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--transfer-rounds", type=int, default=7)
    p.add_argument("--answer", type=int, default=8, help="tokens generated per request")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--dram", default="1GiB", help="each kvtierd's DRAM")
    p.add_argument("--extent", default="64MiB",
                   help="the two-host kvtierds' dram.extent_size (an extent is created and "
                        "pre-faulted when a reserve or promotion first needs it: with 64MiB, "
                        "inside every 4k-token request until DRAM is full; with --dram, once, "
                        "at the warm-up request)")
    p.add_argument("--segment", default="1GiB", help="host A's cluster segment")
    p.add_argument("--fill-dram", action="store_true",
                   help="before the two-host rounds, P/D requests until both kvtierds have "
                        "made every DRAM extent (the steady state; use a small --dram)")
    p.add_argument("--load-mode", default="auto", help="the cross-host consumer's load_mode")
    p.add_argument("--consumer-config", default="{}",
                   help="more kv_connector_extra_config of the cross-host consumer (JSON)")
    p.add_argument("--server-env", default="{}",
                   help="more environment of every vLLM server (JSON)")
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--check-answers", action="store_true",
                   help="also compare every P/D answer with the colocated server's")
    p.add_argument("--one-host-only", action="store_true")
    p.add_argument("--skip-one-host", action="store_true", help="the two-host part alone")
    p.add_argument("--keep-logs", help="copy the servers' logs here")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    result = run(args)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
