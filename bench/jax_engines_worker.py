"""One sglang-jax engine for ``bench/jax_engines.py``: ``python jax_engines_worker.py SPEC.json``.

Runs in the sglang-jax venv (``.venv-jax``).  The spec names the model, the configuration
(``none``: the engine's radix cache alone; ``hicache``: HiCache with the engine's own
``LRUHostKVPool``; ``kvtier``: HiCache with its host tier in kvtierd, ``KVTIER_SGLANG_JAX``)
and the engine's sizes.  After the engine is up and warmed it prints ``READY``; then each
line on stdin is a request (``{"prompt": [...], "max_tokens": n}``), answered with one
``RESULT {json}`` line: the generated ids, the time to the first streamed chunk (TTFT),
the request's whole time and sglang-jax's ``cached_tokens``.  EOF ends the engine.

**Stand-in for TPU hardware (the ``hicache`` configuration only).**  The engine's own pool
scatters host pages into the device cache with a Pallas TPU kernel (``write_kv_layer``),
which does not run on a CPU (and in Pallas' interpret mode it is far slower than the copy
it stands for).  Here it is replaced by the same scatter in plain JAX, so the engine's
own host tier costs on this CPU what a copy costs.  kvtier's pool needs no stand-in: its
copy is plain JAX already.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvtier.sglang_jax  # noqa: E402,F401  (the plugin point, in every process)

# The engine's tree kill leaves multiprocessing's semaphores in /dev/shm: the tests'
# engine records their names in $KVTIER_TEST_SEMS (importing it does), the bench unlinks them.
import tests.jax_engines.engine  # noqa: E402,F401


def _scatter_stand_in() -> None:
    """``memory_pool.write_kv_layer`` as a plain-JAX scatter (see the module's docstring)."""
    import jax
    import jax.numpy as jnp
    from sgl_jax.srt.mem_cache import memory_pool

    @jax.jit
    def scatter(layer_kv: jax.Array, loc: jax.Array, kv_cache: jax.Array) -> jax.Array:
        page_size = kv_cache.shape[1]
        data = layer_kv.reshape((loc.shape[0], *kv_cache.shape[2:]))
        page = jnp.where(loc < 0, kv_cache.shape[0], loc // page_size)  # padding: dropped
        return kv_cache.at[page, loc % page_size].set(
            data, mode="drop", out_sharding=jax.typeof(kv_cache).sharding)

    def write_kv_layer(layer_kv: Any, loc: Any, kv_cache: Any, page_size: int,
                       kv_partition_axis: Any, attention_data_partition_axis: Any,
                       mesh: Any) -> Any:
        return scatter(layer_kv, loc, kv_cache)

    memory_pool.write_kv_layer = write_kv_layer


if os.environ.get("KVTIER_BENCH_CONFIG") == "hicache":
    _scatter_stand_in()  # (the scheduler process imports this script again: here too)


def _request(engine: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    t0 = time.monotonic()
    ttft = None
    ids: list[int] = []
    cached = 0
    for chunk in engine.generate(input_ids=prompt, stream=True, sampling_params={
            "temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True}):
        if ttft is None:
            ttft = time.monotonic() - t0
        ids = list(chunk.get("output_ids") or ids)
        cached = int(chunk.get("meta_info", {}).get("cached_tokens", cached))
    return {"tokens": ids, "ttft": ttft, "seconds": time.monotonic() - t0, "cached": cached}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from sgl_jax.srt.entrypoints.engine import Engine

    config = spec["config"]
    hicache = config in ("hicache", "kvtier")
    if config == "kvtier":
        os.environ["KVTIER_SGLANG_JAX"] = json.dumps(spec["kvtier"])
    engine = Engine(model_path=spec["model"], device="cpu", attention_backend="native",
                    grammar_backend="none", page_size=spec["page_size"], dtype="float32",
                    skip_server_warmup=True, disable_precompile=True,
                    max_total_tokens=spec["device_tokens"],
                    chunked_prefill_size=spec["chunk"], max_running_requests=2,
                    hicache_storage="none" if hicache else "disable",
                    hicache_ratio=spec["hicache_ratio"],
                    enable_unified_radix_tree=hicache, log_level="warning", random_seed=0)
    try:
        for tokens in spec["warmup"]:  # the shapes' compilations, before the clock runs
            _request(engine, tokens, 2)
        # ... and not their pages: the device cache starts empty (HiCache loads a host hit
        # only into free device memory, so warm-up pages left there would refuse loads).
        engine.flush_cache()
        print("READY", flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            out = _request(engine, req["prompt"], req["max_tokens"])
            print("RESULT " + json.dumps(out), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
