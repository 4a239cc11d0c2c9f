"""One vLLM TPU (tpu-inference) engine process for tests/jax_engines: ``python
vllm_tpu_engine.py SPEC.json``.

Runs in the vLLM TPU venv, on the CPU, with the TPU stand-ins of ``tpu_standins.py`` and the
engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).  The spec names the model,
the connector (``"kvtier"``: kvtier's ``TPUOffloadConnector`` with that
``kv_connector_extra_config``; absent: no connector) and a list of phases, each a list of
prompts (token ids).  Before every phase but the first it prints ``READY`` and waits for a
line on stdin, so a test can act (kill the daemon) between phases without another engine
start.  ``"kv_role"`` is the connector's (default ``kv_both``).  After each phase it prints
one ``RESULT {json}`` line: per prompt the generated token ids, vLLM's
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

tpu_standins.install()


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvtier_"):
            out[m.name.removeprefix("vllm:kvtier_")] = float(getattr(m, "value", 0))
    return out


def _settle_saves() -> None:
    """Wait for the connector's background saves (their counters with them); the worker is
    in this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        worker = getattr(get_kv_transfer_group(), "_worker", None)
        if worker is not None:
            worker.settle()


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
    for i, phase in enumerate(spec["phases"]):
        if i:
            print("READY", flush=True)
            if not sys.stdin.readline():
                return
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
        # Saves run in the background: wait for the last ones, then run a prompt shorter
        # than a block (nothing to look up or save) so its step reports the counters.
        if ktc is not None:
            _settle_saves()
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        print("RESULT " + json.dumps({"prompts": results, "counters": _counters(llm)}),
              flush=True)


if __name__ == "__main__":
    main()
