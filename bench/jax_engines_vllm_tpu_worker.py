"""One vLLM TPU (tpu-inference) engine for a JAX-engine benchmark driver:
``python jax_engines_vllm_tpu_worker.py SPEC.json``.

Speaks the protocol of ``jax_engines_worker.py`` (sglang-jax), so one driver can run both
engines: after the engine is up and warmed it prints ``READY``; then each line on stdin is
a request (``{"prompt": [...], "max_tokens": n}``), answered with one ``RESULT {json}``
line: the generated ids, the time to the first token (TTFT: the engine step that produced
it returned), the request's whole time and vLLM's ``num_cached_tokens``.  EOF ends it.

Runs in the vLLM TPU venv (``.venv-vllm-tpu``), on the CPU, the engine in this process,
with the test suite's stand-ins for TPU hardware (``tests/jax_engines/tpu_standins.py``:
a device kind, no TPU-only compiler options, the paged attention in plain JAX).  The spec
names the model, the configuration (``none``: vLLM's prefix cache alone; ``kvtier``:
kvtier's ``TPUOffloadConnector`` with ``spec["kvtier"]`` as its extra config; ``offload``:
tpu-inference's own ``TPUOffloadConnector`` with its ``LocalCPUBackend`` of
``spec["offload_chunks"]`` blocks, its Pallas DMA scatter replaced by the same in plain JAX,
a stand-in for TPU hardware), the block size (``page_size``), the device cache in tokens
(``device_tokens``), the prefill chunk (``chunk``) and warm-up prompts (their shapes
compile before the clock runs).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "jax_engines"))

import tpu_standins  # noqa: E402

tpu_standins.install()


def _request(llm: Any, n: int, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.monotonic()
    engine.add_request(f"r{n}", {"prompt_token_ids": prompt}, params)
    ttft = None
    ids: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                if ttft is None:
                    ttft = time.monotonic() - t0
                ids = list(out.outputs[0].token_ids)
            cached = int(out.num_cached_tokens or cached)
    return {"tokens": ids, "ttft": ttft, "seconds": time.monotonic() - t0, "cached": cached}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM

    ktc = None
    if spec["config"] == "kvtier":
        ktc = {"kv_connector": "TPUOffloadConnector",
               "kv_connector_module_path": "kvtier.vllm_tpu", "kv_role": "kv_both",
               "kv_connector_extra_config": spec["kvtier"]}
    elif spec["config"] == "offload":
        # tpu-inference's own: host blocks in a dict of this process, as many as kvtierd
        # holds in the kvtier configuration; no ahead-of-time compile of its copy buckets.
        os.environ["TPU_OFFLOAD_NUM_CPU_CHUNKS"] = str(spec["offload_chunks"])
        os.environ.setdefault("TPU_OFFLOAD_SKIP_JAX_PRECOMPILE", "1")
        tpu_standins.offload_copies_in_plain_jax()
        ktc = {"kv_connector": "TPUOffloadConnector", "kv_role": "kv_both",
               "kv_connector_module_path": "tpu_inference.offload.tpu_offload_connector"}
    elif spec["config"] != "none":
        sys.exit(f"unknown configuration {spec['config']!r} (none, kvtier, offload)")
    page = int(spec["page_size"])
    # As the tests' engines: synchronous scheduling (asynchronous, tpu-inference's answers on
    # a CPU depend on what was decoded before), no ahead-of-time compilation of every shape.
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec.get("max_model_len", 4096),
              max_num_seqs=2, max_num_batched_tokens=int(spec["chunk"]), block_size=page,
              num_gpu_blocks_override=int(spec["device_tokens"]) // page,
              enable_prefix_caching=True, kv_transfer_config=ktc, seed=0,
              async_scheduling=False, enforce_eager=True,
              additional_config={"sharding": {"sharding_strategy": {"device_indexes": [0]}}})
    n = 0
    for tokens in spec.get("warmup", ()):
        _request(llm, n, tokens, 2)
        n += 1
    llm.reset_prefix_cache()  # the compiled shapes stay, the warm-up's blocks do not
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        out = _request(llm, n, req["prompt"], req["max_tokens"])
        n += 1
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
