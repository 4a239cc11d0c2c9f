"""The protocol of the engine processes the tests drive with ``tests/vllm/driver.py``:
``tests/vllm/engine.py`` (vLLM on the CPU), ``tests/jax_engines/vllm_tpu_engine.py`` (vLLM
TPU) and ``tests/jax_engines/engine.py`` (sglang-jax).

An engine runs a spec's phases, each a list of prompts.  Before every phase but the first
it prints ``READY`` and waits for a line on stdin (end of input: it stops), so a test can
act between phases (kill the daemon, corrupt a block) without another engine start.  After
each phase it prints one ``RESULT {json}`` line; a vLLM engine's holds the connector's
counters so far, read once its background saves are done.

Each engine's venv imports this module (the engines' PYTHONPATH holds the checkout's
root), so it imports nothing but the standard library at module level.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

Phase = TypeVar("Phase")


def run_phases(phases: Iterable[Phase], run: Callable[[Phase], dict[str, Any]]) -> None:
    """``run`` each phase, printing ``READY`` and waiting for stdin before every one but
    the first (end of input: return), and ``RESULT`` with what ``run`` returned after it."""
    for i, phase in enumerate(phases):
        if i:
            print("READY", flush=True)
            if not sys.stdin.readline():
                return
        print("RESULT " + json.dumps(run(phase)), flush=True)


def counters(llm: Any) -> dict[str, float]:
    """The kvtier connector's counters so far (vLLM's ``vllm:kvtier_*`` metrics)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvtier_"):
            out[m.name.removeprefix("vllm:kvtier_")] = float(getattr(m, "value", 0))
    return out


def settle_saves(*_: Any) -> None:
    """Wait for the kvtier connector's background saves (their counters with them).

    Runs where the connector's worker is: called in an engine whose worker is in its
    process, or sent there with ``llm.collective_rpc(settle_saves)`` (which passes the
    worker, ignored)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        worker = getattr(get_kv_transfer_group(), "_worker", None)
        if worker is not None:
            worker.settle()


def settled_counters(llm: Any, settle: Callable[[], object] | None) -> dict[str, float]:
    """:func:`counters` after ``settle`` (None: no connector) has waited for the saves and
    a prompt shorter than a block (nothing to look up or save) has run, so that its step
    reports them."""
    from vllm import SamplingParams

    if settle is not None:
        settle()
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1),
                 use_tqdm=False)
    return counters(llm)
