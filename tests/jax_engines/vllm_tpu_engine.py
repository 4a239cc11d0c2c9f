"""One vLLM TPU (tpu-inference) engine process for tests/jax_engines: ``python
vllm_tpu_engine.py SPEC.json``.

Runs in the vLLM TPU venv, on the CPU, with the TPU stand-ins of ``tpu_standins.py`` and the
engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).  The spec names the model,
the connector (``"kvtier"``: kvtier's ``TPUOffloadConnector`` with that
``kv_connector_extra_config``; absent: no connector) and a list of phases, each a list of
prompts (token ids), run in the protocol of ``tests/engine_phases.py`` (``READY`` before
each phase but the first, a ``RESULT`` line after each).  ``"kv_role"`` is the connector's
(default ``kv_both``).  A ``RESULT`` holds per prompt the generated token ids, vLLM's
``num_cached_tokens``, the request's ``kv_transfer_params`` and the wall time, plus the
connector's counters so far (``vllm:kvtier_*``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tpu_standins  # noqa: E402

from tests.engine_phases import run_phases, settle_saves, settled_counters  # noqa: E402

tpu_standins.install()


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    kv = spec.get("kvtier")
    ktc = None if kv is None else {
        "kv_connector": "TPUOffloadConnector", "kv_connector_module_path": "kvtier.vllm_tpu",
        "kv_role": spec.get("kv_role", "kv_both"), "kv_connector_extra_config": kv}
    block = spec.get("block", 16)
    # async_scheduling=False: with tpu-inference's asynchronous scheduling on this CPU, a
    # request's decode depends on what the engine decoded before it (measured without any
    # connector: the same prompt, run second, answered differently from HF's greedy
    # tokens); synchronous, every answer is HF's whatever ran before.
    # enforce_eager: no precompilation of every batch shape at start, only the shapes the
    # prompts need, when they need them (a third of an engine's start here).
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=128, block_size=block, enforce_eager=True,
              num_gpu_blocks_override=spec.get("blocks", 64), enable_prefix_caching=True,
              kv_transfer_config=ktc, disable_log_stats=False, seed=0, async_scheduling=False,
              additional_config={"sharding": {"sharding_strategy": {"device_indexes": [0]}}})

    def run(phase: list[list[int]]) -> dict[str, Any]:
        results = []
        for tokens in phase:
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": tokens}],
                               SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8),
                                              ignore_eos=True), use_tqdm=False)[0]
            results.append({"tokens": list(out.outputs[0].token_ids),
                            "cached": out.num_cached_tokens,
                            "params": out.kv_transfer_params,
                            "seconds": time.perf_counter() - t0})
        # The connector's worker is in this process.
        return {"prompts": results,
                "counters": settled_counters(llm, None if ktc is None else settle_saves)}

    run_phases(spec["phases"], run)


if __name__ == "__main__":
    main()
