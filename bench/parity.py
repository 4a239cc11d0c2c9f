"""Output parity on hundreds of prompts: vLLM engines with kvtier against vLLM alone.

The long form of ``tests/vllm/test_parity.py`` (``tests/vllm/paritylab.py``: the bf16 tiny
Llama, whose near-tied logits turn any change in what the engine computes into another
greedy token).  Prompts are seeded: two thirds end just below, on or just above a block
boundary, a third have any length; they go in batches of ``--concurrent`` requests.

* set A (half the prompts) through one ``kv_both`` engine (``load_mode: auto``): cold
  (computes and saves), again (loads in the step, from DRAM), and again after kvtierd
  drained every block to its SSD tier and dropped it from DRAM (loads in the background,
  promoted from SSD);
* set B (the other half, its own cache salt) through a ``kv_producer`` engine, then a
  ``kv_consumer`` engine that loads what the producer saved; and the bytes kvtierd holds
  for set B's blocks;
* every prompt through an engine without a connector, its own prefix caching on, twice:
  cold, then again, hitting its own cache (``paritylab.Reference``): the reference.

For each run, the number of prompts, of answers that differ from the reference's (with the
first differing token) and of prompts whose KV blocks differ (the digest of each full
block of the request's KV cache, computed or loaded, against the reference's).  A cold run
is compared with vLLM alone's cold run; a run that loads from kvtier, block by block: each
loaded block with vLLM alone's cold bytes, each block computed after the hit and the answer
with what vLLM alone computed after its own hit of the same length (docs/decisions.md,
"Output parity: what a hit is compared with").  One more row, not a failure, counts the
prompts where vLLM alone after its own hit differs from its cold run on this host.  The
exit status is 1 if anything else differs.

    PYTHONPATH=client:daemon .venv/bin/python bench/parity.py --prompts 240 \\
        --json bench/results/parity-2026-12-05.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvtier.bench.common import write_json  # noqa: E402
from tests.vllm.paritylab import (  # noqa: E402
    BLOCK,
    Differences,
    Lab,
    Prompt,
    first_difference,
    phase,
    prompts,
)

#: The row that is not a failure: how often vLLM alone's own hit differs from its cold run.
OWN_HIT = "vLLM alone after its own hit, against its cold run"


def lengths(n: int, seed: int, answer: int, max_model_len: int) -> list[int]:
    """Two thirds next to a block boundary (one below, on, one above), a third anywhere."""
    rng = random.Random(seed)
    top = max_model_len - answer - 1
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append(rng.randrange(16, top))
        else:
            out.append(min(top, rng.randrange(1, top // BLOCK + 1) * BLOCK + rng.choice((-1, 0, 1))))
    return out


def host_cpu() -> dict[str, Any]:
    """The CPU model and what decides vLLM-CPU's kernels here: the ISA torch dispatches to
    and the L2 size it reads (vLLM-CPU's attention tiles are half of it)."""
    import torch

    caps = torch.cpu.get_capabilities()
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f
                      if line.startswith("model name")), platform.processor())
    return {"model": model, "torch_isa": torch.backends.cpu.get_cpu_capability(),
            "l2_cache_size": caps.get("l2_cache_size"),
            "avx512_bf16": bool(caps.get("avx512_bf16"))}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=240, help="prompts in all (half per set)")
    ap.add_argument("--concurrent", type=int, default=3, help="prompts per generate() call")
    ap.add_argument("--answer", type=int, default=24, help="tokens generated per prompt")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--dram", default="1GiB", help="kvtierd's DRAM tier")
    ap.add_argument("--ssd", default="2GiB", help="kvtierd's SSD tier")
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="the engines' max_model_len; prompts go up to it (past vLLM-CPU's "
                    "attention tile, ~2.5k tokens on a 1 MiB-L2 host, a hit computes "
                    "otherwise than a cold run)")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()

    n_a = args.prompts // 2
    every = lengths(args.prompts, args.seed, args.answer, args.max_model_len)
    a = prompts(every[:n_a], args.seed, answer=args.answer)
    b = [Prompt(p.tokens, p.answer, "parity-b")
         for p in prompts(every[n_a:], args.seed + 1, answer=args.answer)]
    c = args.concurrent
    base = tempfile.mkdtemp(prefix="kvt-parity-bench-", dir="/var/tmp")
    runs: dict[str, Differences] = {}
    t0 = time.monotonic()
    lab = Lab(base, dram=args.dram, ssd=args.ssd, max_model_len=args.max_model_len)
    try:
        log(f"{len(a)} prompts in set A, {len(b)} in set B; engines starting")
        # Each set in the batches its kvtier engines get: a prompt long enough to be cut
        # into chunks computes in those chunks, and which chunks depends on its batch.
        lab.start("ref", [phase(a, c) + phase(b, c)] * 2, None, prefix_caching=True)
        both = lab.start("both", [phase(a, c)] * 3, "kv_both", load_mode="auto")
        producer = lab.start("producer", [phase(b, c)], "kv_producer")
        consumer = lab.start("consumer", [[], phase(b, c)], "kv_consumer")
        deadline = 3600.0
        ref = lab.reference("ref", deadline)
        want = ref.cold
        problems = ref.problems(a + b)  # its own hits are as long as kvtier's, the same blocks
        log(f"reference done: {problems or 'its own hits as long as kvtier loads'}")

        def record(name: str, out: dict[str, Any], offset: int,
                   against: dict[str, Any] = want) -> None:
            d = runs[name] = Differences()
            d.add(out, against, offset)
            log(f"{name}: {d.prompts} prompts, {len(d.answers)} answers and "
                f"{len(d.blocks)} KV caches differ")

        record(OWN_HIT, ref.hit, 0)
        after_hit_a, after_hit_b = ref.after_hit(a), ref.after_hit(b, n_a)
        produced = producer.result(deadline)
        record("kv_producer", produced, n_a)
        held = lab.held(b)
        d = runs["kvtierd slots of kv_producer"] = Differences(prompts=len(b))
        for i, (got, w) in enumerate(zip(held, want["prompts"][n_a:], strict=True)):
            if got != w["kv"]:
                d.blocks.append((n_a + i, first_difference(got, w["kv"])))
        log(f"kvtierd's slots for set B: {len(d.blocks)} prompts differ")
        consumer.result(deadline)
        consumer.next()
        record("kv_consumer", consumer.result(deadline), 0, after_hit_b)

        record("kv_both cold", both.result(deadline), 0)
        both.next()
        record("kv_both from DRAM (in the step)", both.result(deadline), 0, after_hit_a)
        lab.to_ssd_only()
        both.next()
        record("kv_both from SSD (background)", both.result(deadline), 0, after_hit_a)
        problems += lab.daemon.check()
    finally:
        lab.close()
        shutil.rmtree(base, ignore_errors=True)

    judged = {name: d for name, d in runs.items() if name != OWN_HIT}
    total = sum(d.prompts for d in judged.values())
    differing = sum(len(d.answers) + len(d.blocks) for d in judged.values())
    print(f"\n{'run':52} {'prompts':>8} {'answers differ':>15} {'KV differs':>11}")
    for name, d in runs.items():
        answers = "-" if name.startswith("kvtierd") else str(len(d.answers))
        print(f"{name:52} {d.prompts:8} {answers:>15} {len(d.blocks):>11}")
    print(f"{'all but the first':52} {total:8}   differences: {differing}; "
          f"problems: {problems or 'none'}")
    result = {
        "date": datetime.date.today().isoformat(), "host": platform.node(),
        "cpus": os.cpu_count(), "args": vars(args), "seconds": round(time.monotonic() - t0),
        "prompts": {"A": len(a), "B": len(b)},
        "lengths": {"A": [len(p.tokens) for p in a], "B": [len(p.tokens) for p in b]},
        "runs": {name: {"prompts": d.prompts, "answers_differ": d.answers,
                        "kv_differs": d.blocks, "judged": name != OWN_HIT}
                 for name, d in runs.items()},
        "host_cpu": host_cpu(),
        "problems": problems,  # the reference's (Reference.problems), then check()'s
    }
    write_json(args.json, result, indent=1)
    return 1 if differing or problems else 0


if __name__ == "__main__":
    sys.exit(main())
