"""One vLLM engine process for the connector tests: ``python engine.py SPEC.json``.

The spec names the model, the connector (``null``: none; ``"example"``: vLLM's in-tree
ExampleConnector; a dict: KVTierConnector with that ``kv_connector_extra_config``, in the
spec's ``kv_role``, default ``kv_both``) and a list of phases, each a list of prompts
(``{"batch": [...]}``: prompts generated together).  Before every phase but the first the
process prints ``READY`` and waits for a line on stdin, so a test can act (kill the daemon,
corrupt a block) between phases without starting another engine.  After each phase it
prints one ``RESULT {json}`` line: per prompt the generated token ids (with ``logprobs``:
the top ``logprobs`` log-probabilities of every step), vLLM's ``num_cached_tokens`` and the
wall time, plus the connector's counters so far.  A one-rank engine runs its engine core
in this process.  With ``kv_digests`` each prompt also reports ``kv``: a digest of every
full block of its KV cache right after its batch (the bytes of each layer's block, layers
in the KV cache group's order: exactly a kvtier slot's bytes), whether computed or loaded.

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

from tests.engine_phases import run_phases, settle_saves, settled_counters  # noqa: E402


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


def _record_block_ids() -> dict[tuple[int, ...], list[int]]:
    """The KV blocks of each finished request (first group), by prompt, as the scheduler
    frees them: their bytes stay as they are until another request is given them."""
    from vllm.v1.core.sched.scheduler import Scheduler

    seen: dict[tuple[int, ...], list[int]] = {}
    free = Scheduler._free_request_blocks

    def recording(self: Any, request: Any) -> Any:
        ids = self.kv_cache_manager.get_block_ids(request.request_id)
        seen[tuple(request.prompt_token_ids)] = list(ids[0])
        return free(self, request)

    Scheduler._free_request_blocks = recording  # type: ignore[method-assign]
    return seen


def _block_digests(wrapper: Any, blocks: list[list[int]]) -> list[list[str]]:
    """In the worker: per list of block ids, each block's digest over its layers."""
    import hashlib

    import torch

    runner = getattr(wrapper, "worker", wrapper).model_runner
    names = runner.kv_cache_config.kv_cache_groups[0].layer_names
    ctx = runner.compilation_config.static_forward_context
    out = []
    for ids in blocks:
        digests = []
        for b in ids:
            h = hashlib.sha256()
            for name in names:
                h.update(ctx[name].kv_cache[b].contiguous().view(-1).view(torch.uint8).numpy())
            digests.append(h.hexdigest())
        out.append(digests)
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if spec.get("connector") == "example":
        # vLLM-CPU reserves one more core when a connector other than kvtier's is
        # configured: keep the model on the threads it has without one.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    # collective_rpc sends this script's functions (_settle_saves) to the engine's worker
    # process: pickled, which vLLM allows only when told (a test harness on loopback).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    digests = bool(spec.get("kv_digests"))
    if digests or spec.get("tp", 1) == 1:
        # The engine core and its worker in this process: the two processes vLLM starts
        # otherwise cost ~18 s of start-up here.  The connector's cross-process path (its
        # metadata to a worker process, the workers' counters back) is run by the tp > 1
        # engines and by the OpenAI servers of the P/D, serving and OpenAI tests.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process
    from vllm import LLM, SamplingParams

    block_ids = _record_block_ids() if digests else {}

    ktc = _kv_transfer(spec.get("connector"), spec.get("kv_role", "kv_both"))
    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=spec.get("max_model_len", 4096),
              dtype=spec.get("dtype", "float32"), enable_prefix_caching=spec.get("prefix_caching", True),
              kv_transfer_config=ktc, disable_log_stats=False,
              tensor_parallel_size=spec.get("tp", 1), seed=0)

    def run(phase: list[dict[str, Any]]) -> dict[str, Any]:
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
            kv: list[list[str]] = []
            if digests:
                full = [block_ids[tuple(p["tokens"])][: len(p["tokens"]) // spec.get("block", 128)]
                        for p in batch]
                kv = llm.collective_rpc(_block_digests, args=(full,))[0]
            for i, out in enumerate(outs):
                r: dict[str, Any] = {"tokens": list(out.outputs[0].token_ids),
                                     "cached": out.num_cached_tokens, "seconds": seconds}
                if spec.get("logprobs"):
                    r["logprobs"] = [{str(t): lp.logprob for t, lp in step.items()}
                                     for step in out.outputs[0].logprobs or []]
                if digests:
                    r["kv"] = kv[i]
                results.append(r)
        # The connector's worker may be another process: settle its saves there.
        return {"prompts": results, "counters": settled_counters(
            llm, None if ktc is None else lambda: llm.collective_rpc(settle_saves))}

    run_phases(spec["phases"], run)


if __name__ == "__main__":
    main()
