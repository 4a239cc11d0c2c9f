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
* every prompt through an engine without a connector: the reference.

For each run, the number of prompts, of answers that differ from the reference's (with the
first differing token) and of prompts whose KV blocks differ (the digest of each full
block of the request's KV cache, computed or loaded, against the reference's).  The exit
status is 1 if anything differs.

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

MAX_MODEL_LEN = 2048


def lengths(n: int, seed: int, answer: int) -> list[int]:
    """Two thirds next to a block boundary (one below, on, one above), a third anywhere."""
    rng = random.Random(seed)
    top = MAX_MODEL_LEN - answer - 1
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append(rng.randrange(16, top))
        else:
            out.append(min(top, rng.randrange(1, top // BLOCK + 1) * BLOCK + rng.choice((-1, 0, 1))))
    return out


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
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()

    n_a = args.prompts // 2
    every = lengths(args.prompts, args.seed, args.answer)
    a = prompts(every[:n_a], args.seed, answer=args.answer)
    b = [Prompt(p.tokens, p.answer, "parity-b")
         for p in prompts(every[n_a:], args.seed + 1, answer=args.answer)]
    c = args.concurrent
    base = tempfile.mkdtemp(prefix="kvt-parity-bench-", dir="/var/tmp")
    runs: dict[str, Differences] = {}
    t0 = time.monotonic()
    lab = Lab(base, dram=args.dram, ssd=args.ssd)
    try:
        log(f"{len(a)} prompts in set A, {len(b)} in set B; engines starting")
        ref = lab.start("ref", [phase(a + b, c)], None)
        both = lab.start("both", [phase(a, c)] * 3, "kv_both", load_mode="auto")
        producer = lab.start("producer", [phase(b, c)], "kv_producer")
        consumer = lab.start("consumer", [[], phase(b, c)], "kv_consumer")
        deadline = 3600.0
        want = ref.result(deadline)
        log("reference done")

        def record(name: str, out: dict[str, Any], offset: int) -> None:
            d = runs[name] = Differences()
            d.add(out, want, offset)
            log(f"{name}: {d.prompts} prompts, {len(d.answers)} answers and "
                f"{len(d.blocks)} KV caches differ")

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
        record("kv_consumer", consumer.result(deadline), n_a)

        record("kv_both cold", both.result(deadline), 0)
        both.next()
        record("kv_both from DRAM (in the step)", both.result(deadline), 0)
        lab.to_ssd_only()
        both.next()
        record("kv_both from SSD (background)", both.result(deadline), 0)
        problems = lab.daemon.check()
    finally:
        lab.close()
        shutil.rmtree(base, ignore_errors=True)

    total = sum(d.prompts for d in runs.values())
    differing = sum(len(d.answers) + len(d.blocks) for d in runs.values())
    print(f"\n{'run':40} {'prompts':>8} {'answers differ':>15} {'KV differs':>11}")
    for name, d in runs.items():
        answers = "-" if name.startswith("kvtierd") else str(len(d.answers))
        print(f"{name:40} {d.prompts:8} {answers:>15} {len(d.blocks):>11}")
    print(f"{'all':40} {total:8}   differences: {differing}; check(): {problems or 'clean'}")
    result = {
        "date": datetime.date.today().isoformat(), "host": platform.node(),
        "cpus": os.cpu_count(), "args": vars(args), "seconds": round(time.monotonic() - t0),
        "prompts": {"A": len(a), "B": len(b)},
        "lengths": {"A": [len(p.tokens) for p in a], "B": [len(p.tokens) for p in b]},
        "runs": {name: {"prompts": d.prompts, "answers_differ": d.answers,
                        "kv_differs": d.blocks} for name, d in runs.items()},
        "check": problems,
    }
    write_json(args.json, result, indent=1)
    return 1 if differing or problems else 0


if __name__ == "__main__":
    sys.exit(main())
