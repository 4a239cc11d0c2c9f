"""One sglang-jax engine process for tests/jax_engines: ``python engine.py SPEC.json``.

Runs in the sglang-jax venv.  The spec names the model, whether HiCache's host tier is
kvtier (``"kvtier"``: its ``KVTIER_SGLANG_JAX`` config; absent: the engine alone, no
HiCache) and a list of phases, each a list of prompts (token ids), run in the protocol of
``tests/engine_phases.py`` (``READY`` before each phase but the first, a ``RESULT`` line
after each).  A ``RESULT`` holds per prompt the generated token ids, sglang-jax's
``cached_tokens`` and the wall time.

``import kvtier.sglang_jax`` is at the top on purpose: the scheduler is a spawned process
that imports this script again, and with it kvtier's plugin point (as a user's script
would).  No TPU stand-in is needed: kvtier's transfers are plain JAX, and the engine runs
with its native attention on the CPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _record_semaphores() -> None:
    """Append the name of every POSIX semaphore multiprocessing registers to the file in
    ``$KVTIER_TEST_SEMS``: sglang-jax's shutdown kills its process tree, multiprocessing's
    resource tracker with it, which leaves them in /dev/shm; the test unlinks them."""
    from multiprocessing import resource_tracker

    path = os.environ.get("KVTIER_TEST_SEMS")
    register = resource_tracker.register
    if path is None or getattr(register, "recording", False):
        return

    def recording(name: str, rtype: str) -> None:
        if rtype == "semaphore":
            with open(path, "a") as f:
                f.write(name + "\n")
        register(name, rtype)

    recording.recording = True  # type: ignore[attr-defined]
    resource_tracker.register = recording


_record_semaphores()

import kvtier.sglang_jax  # noqa: E402,F401  (the plugin point, in every process)
from tests.engine_phases import run_phases  # noqa: E402


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from sgl_jax.srt.entrypoints.engine import Engine

    kv = spec.get("kvtier")
    if kv is not None:
        os.environ["KVTIER_SGLANG_JAX"] = json.dumps(kv)
    hicache = kv is not None
    engine = Engine(model_path=spec["model"], device="cpu", attention_backend="native",
                    grammar_backend="none", page_size=spec.get("page_size", 16),
                    dtype="float32", skip_server_warmup=True, disable_precompile=True,
                    max_total_tokens=spec.get("max_total_tokens", 2048),
                    chunked_prefill_size=512, max_running_requests=4,
                    hicache_storage="none" if hicache else "disable",
                    enable_unified_radix_tree=hicache, log_level="warning",
                    random_seed=0)

    def run(phase: list[list[int]]) -> dict[str, Any]:
        results = []
        for tokens in phase:
            t0 = time.monotonic()
            out = engine.generate(input_ids=tokens, sampling_params={
                "temperature": 0, "max_new_tokens": spec.get("max_tokens", 8)})
            results.append({"tokens": out["output_ids"],
                            "cached": out["meta_info"]["cached_tokens"],
                            "seconds": time.monotonic() - t0})
        return {"prompts": results}

    try:
        run_phases(spec["phases"], run)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
