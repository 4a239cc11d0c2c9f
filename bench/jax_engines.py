"""TTFT and throughput of a JAX serving engine with kvtier as its host tier, against the
engine alone and against the engine's own host tier, on a multi-round chat workload with
an engine restart in the middle.

    .venv/bin/python bench/jax_engines.py                      # sglang-jax, every configuration
    .venv/bin/python bench/jax_engines.py --small              # a smoke run, a few minutes
    .venv/bin/python bench/jax_engines.py --repeat 2 --json bench/results/jax-engines.json
    .venv/bin/python bench/jax_engines.py --engine vllm-tpu    # vLLM TPU: none, offload, kvtier

**Engines**: ``--engine vllm-tpu`` runs tpu-inference (``.venv-vllm-tpu``, built by ``make
install``) through ``jax_engines_vllm_tpu_worker.py`` (the tests' stand-ins for TPU
hardware), with vLLM's prefix cache alone (``none``), tpu-inference's own offload
connector (``offload``: ``TPUOffloadConnector`` with its in-process ``LocalCPUBackend`` of
``--hicache-ratio`` × the device cache; its Pallas DMA scatter runs as tpu-inference's
plain-JAX one, a stand-in for TPU hardware) or kvtier as its offload tier (``kvtier``:
``kvtier.vllm_tpu``).  Otherwise (the default, and below): sglang-jax (``.venv-jax``, built by
``make install``) on the CPU, a random-weight
Llama built here (``--layers``/``--hidden``; larger than the tests' so that a prefill costs
what a load saves), ``page_size`` 16, a device cache of ``--device-tokens`` tokens (smaller
than the users' histories: they leave the device and come back from the host tier), one
request at a time (an offline ``Engine``, streamed: TTFT is the first chunk's arrival).

**Configurations**, each with fresh engine processes:

* ``none``     the engine's radix cache alone (no HiCache);
* ``hicache``  HiCache with the engine's own ``LRUHostKVPool`` (``--hicache-ratio`` × the
               device cache): an in-process host tier, gone when the engine restarts.  Its
               host→device scatter is a Pallas TPU kernel; on this CPU it runs as the same
               scatter in plain JAX (``jax_engines_worker.py``, a stand-in for TPU hardware);
* ``kvtier``   HiCache with its host tier in kvtierd (``kvtier.sglang_jax``), one kvtierd
               for the whole run, so the pages outlive the engine's restart; kvtierd's
               DRAM is the size of the engine's own host tier (``--kvtier-dram``).

**Workload** (seeded, the same ids in every configuration): ``--users`` users share a
system prompt of ``--system-tokens``; each holds ``--rounds`` rounds; round r's prompt is
the user's whole history (every earlier message and answer) plus a new message of
``--message-tokens``; the answer is ``--answer-tokens`` tokens (greedy, ``ignore_eos``).
Users take turns (round r of every user, then round r+1), so each user's history is pushed
out of the device cache by the others'.  After round ``--restart-after`` the engine process
is replaced by a fresh one (an upgrade, a crash): what the host tier kept is what the new
engine does not recompute.  Every configuration must generate the same tokens (checked).

Reported per configuration: TTFT mean and p50 over all requests, over the rounds before the
restart and after it; output tokens/s over the requests' time (engine starts excluded,
the same for all); cached tokens / prompt tokens; and ratios of kvtier against the others.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import kvtier
from kvtier._admin import fetch_stats
from kvtier.bench.common import write_json
from kvtier.bench.private_daemon import private_daemon
from kvtier.hashing import block_keys, request_salt

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIGS = ("none", "hicache", "offload", "kvtier")
PAGE = 16


@dataclasses.dataclass(frozen=True)
class EngineKind:
    worker: str  # the worker script in bench/
    venv_variable: str  # the environment variable naming its venv (as make test sets it)
    venv: str  # its venv by default
    make: str  # how to build that venv
    configs: tuple[str, ...]


ENGINES = {
    "sglang-jax": EngineKind("jax_engines_worker.py", "KVTIER_JAX_VENV", ".venv-jax",
                             "make install (SGLANG_JAX)", CONFIGS),
    # vLLM's prefix cache alone, tpu-inference's own offload connector, or kvtier.vllm_tpu.
    "vllm-tpu": EngineKind("jax_engines_vllm_tpu_worker.py", "KVTIER_VLLM_TPU_VENV",
                           ".venv-vllm-tpu", "make install",
                           ("none", "offload", "kvtier")),
}


def engine_python(kind: EngineKind, venv: str | None) -> str:
    venv = venv or os.environ.get(kind.venv_variable) or os.path.join(ROOT, kind.venv)
    python = os.path.join(venv if os.path.isabs(venv) else os.path.join(ROOT, venv),
                          "bin", "python")
    if not os.path.exists(python):
        sys.exit(f"no engine venv at {venv}: `{kind.make}` builds it")
    return python


def build_model(python: str, path: str, args: argparse.Namespace) -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tinyllama import build; "
            "build(sys.argv[2], layers=int(sys.argv[3]), hidden=int(sys.argv[4]), "
            "heads=int(sys.argv[5]), kv_heads=int(sys.argv[5]), "
            "intermediate=int(sys.argv[6]))")
    subprocess.run([python, "-c", code, os.path.join(ROOT, "tests", "jax_engines"), path,
                    str(args.layers), str(args.hidden), str(args.hidden // 128),
                    str(args.hidden * 11 // 4)],
                   check=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


class Worker:
    """One engine process (``jax_engines_worker.py``) answering requests on stdin."""

    def __init__(self, python: str, script: str, spec: dict[str, Any], base: str,
                 name: str) -> None:
        path = os.path.join(base, f"{name}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        self.log_path = os.path.join(base, f"{name}.log")
        self.sems_path = os.path.join(base, f"{name}.sems")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env.update(PYTHONPATH=os.path.join(ROOT, "client"),
                   KVTIER_BENCH_CONFIG=spec["config"], JAX_PLATFORMS="cpu",
                   KVTIER_TEST_SEMS=self.sems_path)
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (closed in close())
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [python, os.path.join(HERE, script), path], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            start_new_session=True)
        self._expect("READY")
        self.start_seconds = time.monotonic() - self.t0

    def _expect(self, word: str) -> str:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self._log.flush()
                with open(self.log_path, errors="replace") as f:
                    tail = f.read()[-4000:]
                raise RuntimeError(f"engine ended before {word}: {tail}")
            if line.startswith(word):
                return line[len(word):].strip()

    def ask(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        out: dict[str, Any] = json.loads(self._expect("RESULT"))
        return out

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, 9)  # what the engine's shutdown left of its tree
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()
        if os.path.exists(self.sems_path):  # what the engine's tree kill left in /dev/shm
            with open(self.sems_path) as f:
                for sem in f.read().split():
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink("/dev/shm/sem." + sem.lstrip("/"))


def workload(args: argparse.Namespace) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(args.seed)
    system = [1] + [rng.randrange(3, 900) for _ in range(args.system_tokens - 1)]
    messages = [[[rng.randrange(3, 900) for _ in range(args.message_tokens)]
                 for _ in range(args.rounds)] for _ in range(args.users)]
    return system, messages


def warmup_prompts(longest: int) -> list[list[int]]:
    """Prompts of other tokens (ids 900+) whose prefills compile the shapes the workload's
    will use (full prompts, and the remainders after a partial hit), up to ``longest``."""
    rng = random.Random(1)
    return [[1] + [rng.randrange(900, 999) for _ in range(n)]
            for n in (9, 40, 100, 230, 500, 900) if n < longest]


def kvtier_dram(args: argparse.Namespace) -> str:
    """kvtierd's DRAM: ``--kvtier-dram``, else as much as the engine's own host tier holds
    (``--hicache-ratio`` × the device cache; a token is 2 × layers × kv heads × 128 × 4 B),
    in whole extents of 16 MiB."""
    if args.kvtier_dram:
        return str(args.kvtier_dram)
    token_bytes = 2 * args.layers * (args.hidden // 128) * 128 * 4
    mib = -(-int(args.hicache_ratio * args.device_tokens * token_bytes) // (16 << 20)) * 16
    return f"{mib}MiB"


def run_config(config: str, python: str, script: str, model: str, args: argparse.Namespace,
               base: str) -> dict[str, Any]:
    system, messages = workload(args)
    longest = args.system_tokens + args.rounds * (args.message_tokens + args.answer_tokens)
    spec: dict[str, Any] = {
        "config": config, "model": model, "page_size": PAGE, "chunk": args.chunk,
        "device_tokens": args.device_tokens, "hicache_ratio": args.hicache_ratio,
        "offload_chunks": int(args.hicache_ratio * args.device_tokens) // PAGE,
        "max_model_len": -(-longest // PAGE) * PAGE,
        "warmup": warmup_prompts(args.device_tokens // 2)}
    stack = None
    if config == "kvtier":
        stack = private_daemon("jax-engines", f"dram.capacity={kvtier_dram(args)}",
                               "dram.extent_size=16MiB")
        daemon = stack.__enter__()
        spec["kvtier"] = {"socket_dir": daemon.socket_dir}
    def held() -> int:  # the pages kvtierd holds now
        if stack is None:
            return 0
        return sum(n.committed_blocks for n in fetch_stats(daemon.socket_dir).namespaces)

    def stored(prompt: list[int]) -> int:  # leading full pages of ``prompt`` kvtierd holds
        if stack is None:
            return 0
        spaces = fetch_stats(daemon.socket_dir).namespaces
        if not spaces:
            return 0
        st = spaces[0]
        with kvtier.Client(daemon.socket_dir, namespace=st.name, block_bytes=st.block_bytes,
                           model_uid=st.model_uid) as c:
            return c.lookup(block_keys(prompt, PAGE, request_salt("", None, None)))

    histories = [list(system) for _ in range(args.users)]
    requests: list[dict[str, Any]] = []
    starts: list[float] = []
    try:
        worker = Worker(python, script, spec, base, f"{config}-0")
        starts.append(worker.start_seconds)
        for r in range(args.rounds):
            if r == args.restart_after:
                worker.close()
                worker = Worker(python, script, spec, base, f"{config}-1")
                starts.append(worker.start_seconds)
            for u in range(args.users):
                prompt = histories[u] + messages[u][r]
                pages = stored(prompt)
                out = worker.ask(prompt, args.answer_tokens)
                out.update(user=u, round=r, prompt_tokens=len(prompt), kvtierd_pages=pages)
                requests.append(out)
                histories[u] = prompt + out["tokens"]
            print(f"  {config}: round {r + 1}/{args.rounds} done"
                  + (f", kvtierd holds {held()} pages" if stack else ""), file=sys.stderr)
        worker.close()
    finally:
        if stack is not None:
            stack.__exit__(None, None, None)
    return summarize(config, requests, starts, args)


def summarize(config: str, requests: list[dict[str, Any]], starts: list[float],
              args: argparse.Namespace) -> dict[str, Any]:
    def ttft(rows: list[dict[str, Any]]) -> dict[str, float]:
        values = [r["ttft"] for r in rows]
        return {"mean": statistics.fmean(values), "p50": statistics.median(values)}

    before = [r for r in requests if r["round"] < args.restart_after]
    after = [r for r in requests if r["round"] >= args.restart_after]
    seconds = sum(r["seconds"] for r in requests)
    return {
        "config": config,
        "ttft_s": ttft(requests), "ttft_before_restart_s": ttft(before),
        "ttft_after_restart_s": ttft(after),
        "output_tokens_per_s": sum(len(r["tokens"]) for r in requests) / seconds,
        "request_seconds": seconds,
        "cached_fraction": sum(r["cached"] for r in requests)
        / sum(r["prompt_tokens"] for r in requests),
        "cached_fraction_after_restart": sum(r["cached"] for r in after)
        / sum(r["prompt_tokens"] for r in after),
        "engine_start_s": starts,
        "answers": [r["tokens"] for r in requests],
        "requests": [{k: r[k] for k in ("user", "round", "prompt_tokens", "cached", "ttft",
                                        "seconds", "kvtierd_pages")} for r in requests],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=sorted(ENGINES), default="sglang-jax")
    p.add_argument("--configs", nargs="+", choices=CONFIGS,
                   help="default: every configuration the engine has")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--small", action="store_true", help="a smoke run (2 users, 3 rounds)")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--restart-after", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--message-tokens", type=int, default=128)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--device-tokens", type=int, default=2048)
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--kvtier-dram", help="kvtierd's DRAM (default: the engine's own host "
                   "tier's size, --hicache-ratio x the device cache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--venv", help="the engine's venv (default: as make test finds it)")
    p.add_argument("--json")
    p.add_argument("--keep-logs", action="store_true", help="keep the engines' logs")
    args = p.parse_args()
    if args.small:
        args.users, args.rounds, args.restart_after = 2, 3, 2
        args.system_tokens, args.device_tokens = 256, 768
    kind = ENGINES[args.engine]
    args.configs = args.configs or list(kind.configs)
    if unknown := [c for c in args.configs if c not in kind.configs]:
        sys.exit(f"{args.engine} has no configuration {unknown[0]} (it has {kind.configs})")
    python = engine_python(kind, args.venv)
    base = tempfile.mkdtemp(prefix="kvt-jax-engines-")
    try:
        model = os.path.join(base, "model")
        build_model(python, model, args)
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in args.configs}
        for rep in range(args.repeat):
            for config in args.configs:  # configurations alternate within each repeat
                print(f"[{rep + 1}/{args.repeat}] {config}", file=sys.stderr)
                runs[config].append(run_config(config, python, kind.worker, model, args, base))
    except BaseException:
        print(f"(engine logs kept in {base})", file=sys.stderr)
        raise
    if args.keep_logs:
        print(f"(engine logs in {base})", file=sys.stderr)
    else:
        shutil.rmtree(base, ignore_errors=True)
    reference = next(iter(runs.values()))[0]["answers"]
    differ = {c: sum(a != b for run in rs for a, b in zip(run["answers"], reference,
                                                         strict=True))
              for c, rs in runs.items()}
    report(runs, differ)
    write_json(args.json, {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "argv": sys.argv,
        "args": vars(args), "answers_that_differ": differ,
        "runs": {c: [{k: v for k, v in r.items() if k != "answers"} for r in rs]
                 for c, rs in runs.items()}}, indent=1)


def report(runs: dict[str, list[dict[str, Any]]], differ: dict[str, int]) -> None:
    def med(c: str, *path: str) -> float:
        values = []
        for r in runs[c]:
            v: Any = r
            for k in path:
                v = v[k]
            values.append(v)
        return statistics.median(values)

    for c, rs in runs.items():
        for row in rs[-1]["requests"]:
            print(f"  {c} user {row['user']} round {row['round']}: {row['prompt_tokens']} tokens, "
                  f"{row['cached']} cached ({row['kvtierd_pages']} pages in kvtierd before), "
                  f"TTFT {row['ttft'] * 1e3:.0f} ms")
    print(f"{'config':10} {'TTFT mean':>10} {'p50':>8} {'before':>8} {'after':>8} "
          f"{'tok/s':>7} {'cached':>7} {'cached after':>13} {'differ':>6}")
    for c in runs:
        print(f"{c:10} {med(c, 'ttft_s', 'mean') * 1e3:8.0f}ms {med(c, 'ttft_s', 'p50') * 1e3:6.0f}ms "
              f"{med(c, 'ttft_before_restart_s', 'mean') * 1e3:6.0f}ms "
              f"{med(c, 'ttft_after_restart_s', 'mean') * 1e3:6.0f}ms "
              f"{med(c, 'output_tokens_per_s'):7.1f} {med(c, 'cached_fraction'):7.2f} "
              f"{med(c, 'cached_fraction_after_restart'):13.2f} {differ[c]:6d}")
    if "kvtier" in runs:
        for other in runs:
            if other == "kvtier":
                continue
            print(f"kvtier / {other}: TTFT mean "
                  f"{med('kvtier', 'ttft_s', 'mean') / med(other, 'ttft_s', 'mean'):.2f}x, "
                  f"after the restart "
                  f"{med('kvtier', 'ttft_after_restart_s', 'mean') / med(other, 'ttft_after_restart_s', 'mean'):.2f}x, "
                  f"throughput {med('kvtier', 'output_tokens_per_s') / med(other, 'output_tokens_per_s'):.2f}x")


if __name__ == "__main__":
    main()
