"""A fresh serving process that finds a prompt's prefix in kvtier.

``python -m kvtier.demo.worker JSON`` -- started by ``kvtier demo`` for every
"hit" path, so that nothing of the cold run is in its memory.  It builds the
same seeded model, compiles and warms up the whole request path (on a copy of
the prompt under another salt, so the real prefix is not touched), then
serves the prompt once, timed: ``plan_prefix`` -> ``kvtier.jax.load`` of the
cached pages -> prefill of the rest.  Progress and the result go to stdout as
JSON lines; the logits go to an ``.npy`` file.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import kvtier
from kvtier import jax as kvjax
from kvtier.demo.model import CONFIGS, Cache, Model, make_prompt, setup_jax

#: The warm-up request's salt: same shapes and code path, different keys.
WARMUP_SALT = b"kvtier-demo-warmup"


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


@dataclasses.dataclass
class Served:
    """One request's outcome."""

    tiers: list[str]
    load_tokens: int
    loaded_blocks: int
    prefill_tokens: int
    plan_s: float
    load_s: float
    prefill_s: float
    ttft_s: float
    logits: jax.Array


def serve(client: kvtier.Client, model: Model, tokens: np.ndarray, cache: Cache,
          page_table: Sequence[int], salt: bytes) -> Served:
    """The hit path, timed from the request to the first token's logits."""
    pt = model.cfg.page_tokens
    t0 = time.perf_counter()
    plan = kvtier.plan_prefix(client, tokens, block_tokens=pt, salt=salt)
    t1 = time.perf_counter()
    cache, loaded = kvjax.load(client, plan.load_keys, cache, list(page_table[: plan.load_blocks]))
    for layer in cache:  # the load is done (for the breakdown; prefill would wait anyway)
        for a in layer:
            a.block_until_ready()
    t2 = time.perf_counter()
    start = loaded * pt  # a block evicted since the plan is simply prefilled
    cache, logits = model.prefill(cache, page_table, tokens[start:], start)
    t3 = time.perf_counter()
    return Served([t.name for t in plan.tiers[: plan.load_blocks]], start, loaded,
                  len(tokens) - start, t1 - t0, t2 - t1, t3 - t2, t3 - t0, logits)


def run(args: dict[str, Any]) -> dict[str, Any]:
    cfg = CONFIGS[args["model"]]
    n, seed = int(args["prompt_tokens"]), int(args["seed"])
    emit(phase="started")
    model = Model(cfg, seed, n)
    model.warm_up()
    emit(phase="compiled")
    tokens = make_prompt(cfg, n, seed)
    # Pages land wherever this process's allocator puts them (here: shuffled).
    page_table = [int(p) for p in np.random.default_rng([seed, 7]).permutation(model.pages)]
    ns = kvjax.namespace_for(kvjax.layout_of(model.new_cache()), args["model_uid"])
    with kvtier.Client(args["socket"], **ns) as client:
        warm_keys = kvtier.block_keys(tokens, cfg.page_tokens, WARMUP_SALT)
        kvjax.save(client, model.new_cache(), page_table[: len(warm_keys)], warm_keys)
        serve(client, model, tokens, model.new_cache(), page_table, WARMUP_SALT)
        emit(phase="warmed")
        cache = model.new_cache()
        got = serve(client, model, tokens, cache, page_table, b"")
    np.save(args["logits_out"], np.asarray(got.logits))
    return {f.name: getattr(got, f.name) for f in dataclasses.fields(got) if f.name != "logits"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = json.loads(argv[0])
    setup_jax(args.get("compilation_cache"))
    emit(result=run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
