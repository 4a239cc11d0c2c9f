"""Eviction policy study: exact LRU against the native block table's sampled
LRU and CLOCK, on a prefix-reuse trace; and the native cost of choosing a victim.
With ``--study prefix``: prefix-hit policies against the offline optimum.

The trace (seeded): multi-round conversations of ``--users`` users whose
popularity is Zipf(``--zipf``); each conversation starts from one of
``--prompts`` shared system prompts (``--prompt-blocks`` blocks), and each
round appends 2-8 blocks (the user's turn and the answer) to it; a user starts
a new conversation with probability 0.15 per request or after 12 rounds.
Blocks are keyed by prefix (system prompt, block i) or (conversation, block
j), so a request reads the system prompt, the whole conversation so far and
writes its new blocks.  A request's hits are the longest cached prefix of its
blocks (what a prefix cache serves); the blocks after the first miss are
recomputed: present ones count as read, absent ones are inserted.

Each policy replays the trace against a cache of a fixed number of blocks
(``--sizes``: fractions of the trace's distinct blocks):

* exact LRU: an ``OrderedDict``, the reference;
* native sampled LRU (``Policy.LRU``), K = 5, 10, 16 samples per victim,
  with and without the 16-entry pool;
* native CLOCK (``Policy.CLOCK``).

The native replays drive ``kvtierd.block_table.BlockTable`` as the store
would, one batch call per step and request: touch and pin the hits, claim the
free slots, ``victims`` + ``evict(reserve=True)`` for the rest, commit, unpin.

Then the cost of choosing: a full table of ``--cost-slots`` slots (random
ages), ``--cost-rounds`` rounds of choosing 64 victims, evicting them into new
blocks and reading 256 random blocks; the ns per victim of the ``victims``
calls alone (the median call's, and the mean), the p99 call, and the native
bytes per slot.  Last, what the store's batch calls cost per block from Python
(``--ops-batch`` blocks a call) and adoption and ``check`` per slot, at the same
table sizes.

    .venv/bin/python bench/eviction_policy.py --json bench/results/eviction-policy.json

``--study prefix`` (bench/prefix_eviction.py, pure Python, no native table):
seven seeded traces (the two above, long agentic sessions, many users under shared system
prompts, one-off long documents, and bench/vllm_serving.py's requests replayed at its
defaults and at 48 users x 8 rounds), each replayed at ``--sizes`` of its distinct blocks by
exact LRU, CLOCK as csrc/blocks.c implements it, S3-FIFO, chain-aware CLOCK candidates and
the offline optimum of prefix hits (exact, see prefix_eviction's docstring).  Reported per
cell: the prefix-hit ratio, minus exact LRU in points, the share of the LRU-to-optimum gap
closed, prefix-hit tokens per GiB of cache (``--bytes-per-token`` of KV: Llama-3.1-8B in
bf16 by default, 32 layers x 8 KV heads x 128 x K and V x 2 B = 128 KiB; the blocks'
tokens are the trace's: 16, and vLLM CPU's 128 for the serving replay), and records
examined and simulator ns per victim (relative to CLOCK's: a rough figure only).

    .venv/bin/python bench/eviction_policy.py --study prefix \
        --json bench/results/eviction-policy-prefix.json
"""

from __future__ import annotations

import argparse
import collections
import platform
import sys
import time
from typing import Any

import numpy as np

from kvtier.bench.common import write_json
from kvtierd.block_table import BlockTable, Policy

sys.path.insert(0, __import__("os").path.dirname(__file__))
import prefix_eviction  # noqa: E402 -- bench/ is not a package

BLOCK = 4096
ROUND_BLOCKS = (2, 8)  # blocks a round adds: the user's turn and the answer
NEW_CONVERSATION = 0.15
MAX_ROUNDS = 12


def make_trace(requests: int, users: int, zipf: float, prompts: int, prompt_blocks: int,
               seed: int) -> list[list[int]]:
    """Each request's block keys, in prefix order (ints: keys only need identity): the
    conversations trace of bench/prefix_eviction.py with this study's round shape."""
    return prefix_eviction.conversations(requests, users, zipf, prompts, prompt_blocks, seed,
                                         round_blocks=ROUND_BLOCKS, new_conv=NEW_CONVERSATION,
                                         max_rounds=MAX_ROUNDS)


def replay_exact_lru(trace: list[list[int]], cap: int) -> tuple[int, int]:
    lru: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = total = 0
    for keys in trace:
        prefix = True
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
                hits += prefix
            else:
                prefix = False
                lru[k] = None
                if len(lru) > cap:
                    lru.popitem(last=False)
        total += len(keys)
    return hits, total


def replay_native(trace: list[list[int]], cap: int, policy: Policy, sample: int, pool: bool,
                  seed: int) -> tuple[int, int, float, int]:
    """(prefix hits, blocks read, seconds in victims calls, calls that found none)."""
    t = BlockTable(BLOCK, BLOCK, seed=seed)
    meta = bytearray(cap * 128)
    t.add_extent(1, cap, meta, 1)
    where: dict[int, int] = {}  # key -> slot
    key_at = [0] * cap
    free = cap
    seq = 1
    hits = total = short_calls = 0
    pick_s = 0.0
    for keys in trace:
        total += len(keys)
        slots = [where.get(k) for k in keys]
        h = next((i for i, s in enumerate(slots) if s is None), len(keys))
        hits += h
        held = np.array([s for s in slots if s is not None], dtype=np.uint64) | np.uint64(1 << 32)
        new = [k for k, s in zip(keys, slots, strict=True) if s is None]
        if len(held):
            t.touch(held, seq)
            seq += len(held)
            t.pin(held)
        if new:
            take = min(free, len(new))
            refs = t.claim(take)[0] if take else np.empty(0, dtype=np.uint64)
            free -= take
            short = len(new) - take
            empty = 0
            while short:
                t0 = time.perf_counter()
                got = t.victims(short, policy, sample=sample, pool=pool)
                pick_s += time.perf_counter() - t0
                if not len(got):
                    # The call's work bound ran out (CLOCK: a hand clearing a table of set
                    # bits); the next call goes on from there, as the store's would.
                    empty += 1
                    short_calls += 1
                    if empty > 64:
                        raise RuntimeError("no victim: the cache is smaller than a request")
                    continue
                t.evict(got, reserve=True)
                for s in (got & np.uint64(0xFFFF_FFFF)).tolist():
                    del where[key_at[s]]
                refs = np.concatenate([refs, got])
                short -= len(got)
            t.commit(refs, [b"k"] * len(new), np.full(len(new), BLOCK), None,
                     first_access=seq, epoch=1)
            seq += len(new)
            for k, s in zip(new, (refs & np.uint64(0xFFFF_FFFF)).tolist(), strict=True):
                where[k] = s
                key_at[s] = k
        if len(held):
            t.unpin(held)
    problems = t.check()
    if problems:
        raise RuntimeError(f"check() after the replay: {problems[:3]}")
    return hits, total, pick_s, short_calls


def victim_cost(slots: int, policy: Policy, sample: int, pool: bool, rounds: int,
                seed: int) -> dict[str, float]:
    """ns per victim of ``victims(64)`` in a full table under steady eviction."""
    rng = np.random.default_rng(seed)
    t = BlockTable(BLOCK, BLOCK, seed=seed)
    meta = bytearray(slots * 128)
    t.add_extent(1, slots, meta, 1)
    refs = t.claim(slots)[0]
    t.commit(refs, [b"k"] * slots, np.full(slots, BLOCK), None, first_access=1, epoch=1)
    t.touch(refs[rng.permutation(slots)], slots + 1)  # random ages
    seq = 2 * slots + 1
    keys64, len64 = [b"k"] * 64, np.full(64, BLOCK)
    calls: list[tuple[int, int]] = []  # (ns, victims) of each round's calls
    extra = 0
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        got = t.victims(64, policy, sample=sample, pool=pool)
        while len(got) < 64:  # a call's work bound ran out: the next goes on from there
            extra += 1
            more = t.victims(64 - len(got), policy, sample=sample, pool=pool)
            got = np.concatenate([got, more])
        calls.append((time.perf_counter_ns() - t0, len(got)))
        t.evict(got, reserve=True)
        t.commit(got, keys64[:len(got)], len64[:len(got)], None, first_access=seq, epoch=1)
        seq += len(got)
        t.touch(refs[rng.integers(0, slots, 256)], seq)  # reads: ages and CLOCK bits move
        seq += 256
    ns = np.array([c[0] for c in calls], dtype=np.float64)
    chosen = np.array([c[1] for c in calls], dtype=np.float64)
    # The median call: a shared machine preempts a few calls for milliseconds.
    return {"ns_per_victim": float(np.median(ns / chosen)),
            "ns_per_victim_mean": float(ns.sum() / chosen.sum()),
            "p99_call_us": float(np.percentile(ns, 99) / 1e3),
            "first_call_us": float(ns[0] / 1e3),
            "extra_calls": extra,
            "native_bytes_per_slot": t.native_bytes / slots}


def op_costs(slots: int, batch: int, seed: int) -> dict[str, float]:
    """ns per block of the store's batch calls on a table of ``slots`` slots, from Python
    (numpy refs in): claim + commit, touch + pin + unpin, victims + evict (reserve),
    delete; and ns per slot of adopt (a full table, every entry checksum verified)
    and of check."""
    rng = np.random.default_rng(seed)
    t = BlockTable(BLOCK, BLOCK, seed=seed)
    meta = bytearray(slots * 128)
    t.add_extent(1, slots, meta, 1)
    keys, lengths = [b"%016d" % i for i in range(batch)], np.full(batch, BLOCK)
    seq = 1
    out: dict[str, float] = {}
    t0 = time.perf_counter_ns()
    for _ in range(slots // batch):
        refs = t.claim(batch)[0]
        t.commit(refs, keys, lengths, None, first_access=seq, epoch=1)
        seq += batch
    out["claim_commit_ns"] = (time.perf_counter_ns() - t0) / (slots // batch * batch)
    every = t.committed(1)
    picks = [every[rng.integers(0, len(every), batch)] for _ in range(2000)]
    picks = [np.unique(p) for p in picks]
    n = sum(len(p) for p in picks)
    t0 = time.perf_counter_ns()
    for p in picks:
        t.touch(p, seq)
        seq += len(p)
        t.pin(p)
        t.unpin(p)
    out["touch_pin_unpin_ns"] = (time.perf_counter_ns() - t0) / n
    t0 = time.perf_counter_ns()
    for _ in range(2000):
        got = t.victims(batch, Policy.LRU, sample=5, pool=True)
        t.evict(got, reserve=True)
        t.commit(got, keys[:len(got)], lengths[:len(got)], None, first_access=seq, epoch=1)
        seq += len(got)
    out["victims_evict_commit_ns"] = (time.perf_counter_ns() - t0) / (2000 * batch)
    t0 = time.perf_counter_ns()
    problems = t.check()
    out["check_ns_per_slot"] = (time.perf_counter_ns() - t0) / slots
    if problems:
        raise RuntimeError(f"check(): {problems[:3]}")
    t.remove_extent(1)
    again = BlockTable(BLOCK, BLOCK)
    again.add_extent(1, slots, meta, 1)
    t0 = time.perf_counter_ns()
    got_adopt = again._t.adopt(1, 1, slots * BLOCK)
    out["adopt_ns_per_slot"] = (time.perf_counter_ns() - t0) / slots
    if got_adopt["adopted"] != slots:
        raise RuntimeError(f"adopt: {got_adopt}")
    t0 = time.perf_counter_ns()
    again.delete(again.committed(1))
    out["delete_ns"] = (time.perf_counter_ns() - t0) / slots
    return out


POLICIES: list[tuple[str, Policy, int, bool]] = [
    ("sampled LRU K=5 + pool", Policy.LRU, 5, True),
    ("sampled LRU K=10 + pool", Policy.LRU, 10, True),
    ("sampled LRU K=16 + pool", Policy.LRU, 16, True),
    ("sampled LRU K=5", Policy.LRU, 5, False),
    ("sampled LRU K=10", Policy.LRU, 10, False),
    ("sampled LRU K=16", Policy.LRU, 16, False),
    ("CLOCK", Policy.CLOCK, 1, False),
]


def parse_sizes(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def parse_count(text: str) -> int:
    text = text.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20}.get(text[-1], 1)
    return int(text.rstrip("km")) * mult


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", choices=("native", "prefix"), default="native",
                    help="native: sampled LRU and CLOCK against exact LRU (default); "
                         "prefix: prefix-hit policies against the exact optimum")
    ap.add_argument("--scale", type=float, default=1.0, help="prefix study: multiplies the "
                    "traces' request counts")
    ap.add_argument("--traces", default="", help="prefix study: comma-separated trace names "
                    "(default: all)")
    ap.add_argument("--bytes-per-token", type=int, default=131072, help="prefix study: KV "
                    "bytes per token (default Llama-3.1-8B, bf16)")
    ap.add_argument("--requests", type=int, default=30_000)
    ap.add_argument("--users", type=int, default=3000)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-blocks", type=int, default=32)
    ap.add_argument("--sizes", type=parse_sizes, default=[0.10, 0.25, 0.50],
                    help="cache sizes as fractions of the trace's distinct blocks")
    ap.add_argument("--seed", type=int, default=26)
    ap.add_argument("--cost-slots", default="256k,1M", help="table sizes of the cost "
                    "measurements ('none': skip them)")
    ap.add_argument("--cost-rounds", type=int, default=2000)
    ap.add_argument("--ops-batch", type=int, default=64, help="blocks per call of the batch "
                    "call costs")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.study == "prefix":
        return prefix_study(args)

    t0 = time.perf_counter()
    trace = make_trace(args.requests, args.users, args.zipf, args.prompts, args.prompt_blocks,
                       args.seed)
    distinct = len({k for keys in trace for k in keys})
    reads = sum(len(keys) for keys in trace)
    print(f"trace: {len(trace)} requests, {reads} block reads, {distinct} distinct blocks "
          f"(seed {args.seed}, built in {time.perf_counter() - t0:.1f} s)")
    out: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                    "processor": platform.processor()},
        "trace": {"requests": len(trace), "reads": reads, "distinct": distinct},
        "hit_ratio": [], "cost": [],
    }
    header = f"{'policy':<26}" + "".join(f"{f'{s:.0%} cache':>22}" for s in args.sizes)
    print("\nhit ratio (prefix hits / block reads); in brackets: minus exact LRU, points")
    print(header)
    caps = [max(1, int(s * distinct)) for s in args.sizes]
    exact = [replay_exact_lru(trace, cap) for cap in caps]
    ref = [h / n for h, n in exact]
    print(f"{'exact LRU (OrderedDict)':<26}" + "".join(f"{r:>22.4f}" for r in ref))
    out["hit_ratio"].append({"policy": "exact LRU", "sizes": args.sizes, "caps": caps,
                             "hit_ratio": ref})
    for name, policy, sample, pool in POLICIES:
        got = [replay_native(trace, cap, policy, sample, pool, args.seed) for cap in caps]
        ratios = [h / n for h, n, _, _ in got]
        cells = "".join(f"{r:>12.4f} ({100 * (r - e):+5.2f})" for r, e in zip(ratios, ref,
                                                                              strict=True))
        print(f"{name:<26}{cells}")
        out["hit_ratio"].append({"policy": name, "sizes": args.sizes, "caps": caps,
                                 "hit_ratio": ratios,
                                 "minus_exact_points": [100 * (r - e) for r, e in
                                                        zip(ratios, ref, strict=True)],
                                 "victims_seconds": [g[2] for g in got],
                                 "empty_victims_calls": [g[3] for g in got]})
    slot_counts = [parse_count(x) for x in args.cost_slots.split(",") if x not in ("", "none")]
    if slot_counts:
        print("\nnative cost of choosing victims (victims(64) calls, full table, steady "
              "eviction)\nns per victim: of the median call (and the mean over all calls); "
              "p99 of a call")
        print(f"{'policy':<26}" + "".join(
            f"{f'{n >> 10}k slots: ns/victim (mean), p99 call':>40}" for n in slot_counts))
    for name, policy, sample, pool in POLICIES if slot_counts else []:
        cells = []
        for n in slot_counts:
            c = victim_cost(n, policy, sample, pool, args.cost_rounds, args.seed)
            cells.append(f"{c['ns_per_victim']:>18.0f} ({c['ns_per_victim_mean']:>6.0f}) "
                         f"{c['p99_call_us']:>8.0f} us")
            out["cost"].append({"policy": name, "slots": n, **c})
        print(f"{name:<26}" + "".join(f"{c:>40}" for c in cells))
    per_slot = {c["slots"]: c["native_bytes_per_slot"] for c in out["cost"]}
    if per_slot:
        print("\nnative memory: " + ", ".join(f"{n >> 10}k slots {b:.2f} B/slot"
                                             for n, b in per_slot.items()))
    if slot_counts:
        print(f"\nbatch calls, {args.ops_batch} blocks a call (ns per block; adopt and check: "
              "per slot)")
    out["ops"] = []
    for n in slot_counts:
        ops = op_costs(n, args.ops_batch, args.seed)
        out["ops"].append({"slots": n, "batch": args.ops_batch, **ops})
        print(f"{n >> 10}k slots: " + ", ".join(f"{k} {v:.0f}" for k, v in ops.items()))
    print(f"total {time.perf_counter() - t0:.0f} s")
    write_json(args.json, out, indent=1)
    return 0


def prefix_study(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    sizes = args.sizes if args.sizes != [0.10, 0.25, 0.50] else [0.10, 0.25]
    traces = prefix_eviction.default_traces(args.scale)
    if args.traces:
        want = args.traces.split(",")
        traces = [t for t in traces if t.name in want]
    print(f"prefix-hit ratio per policy; in brackets minus exact LRU (points), then the share "
          f"of the gap from exact LRU to {prefix_eviction.BOUND} closed")
    rows = prefix_eviction.study(traces, sizes, args.bytes_per_token)
    verdict = prefix_eviction.verdicts(rows, tuple(s for s in sizes if s <= 0.25))
    print("\ncandidates: >= half the gap and never below exact LRU, at 10 % and 25 % on "
          "every trace?")
    for name, v in verdict.items():
        print(f"  {name:<26} {'yes' if v['meets'] else 'no ':<4} {v['cells_meeting']}/"
              f"{v['cells']} cells; worst: {100 * v['worst_gap_closed']:.0f}% of the gap, "
              f"{v['worst_minus_lru_points']:+.2f} points vs LRU")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        out = {"study": "prefix", "issue": 40,
               "args": {k: v for k, v in vars(args).items() if k != "json"} | {"sizes": sizes},
               "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                           "processor": platform.processor()},
               "traces": [{"name": t.name, "about": t.about, "params": t.params,
                           "block_tokens": t.block_tokens, "requests": len(t.trace),
                           "reads": sum(map(len, t.trace)),
                           "distinct": len({k for keys in t.trace for k in keys})}
                          for t in traces],
               "policies": [{"name": p.name, "kind": p.kind, "state": p.state}
                            for p in prefix_eviction.POLICIES],
               "rows": rows, "verdicts": verdict}
        write_json(args.json, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
