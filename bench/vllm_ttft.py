"""TTFT of vLLM (CPU build) with and without a KV connector: kvtier against vLLM's own.

    .venv/bin/python bench/vllm_ttft.py --small --repeat 1      # smoke run, ~4 minutes
    .venv/bin/python bench/vllm_ttft.py                         # 1k, 4k, 8k, 2 rounds: ~25 min
    .venv/bin/python bench/vllm_ttft.py --tokens 4096 --repeat 3 --configs cold floor \\
        --json bench/results/vllm-ttft-4k.json

The model is a random-weight Llama written by ``tests/vllm/tinymodel.py`` into
a temp dir once per run (default: 8 layers, hidden 1024, 16 heads / 8 KV heads
of 64, bf16; ``--small``: 2 layers, hidden 128).  Every TTFT is measured in a
FRESH engine process (one subprocess per measurement), as the wall time of
``llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))``, after
one warm-up request with an unrelated prompt (``--warmup-tokens``; it shares no
128-token block with the measured prompt).  Configurations:

* ``cold``              no connector;
* ``cold_connector``    the kvtier connector, kvtierd running, no block of the
                        prompt stored (its miss overhead: lookup + store);
* ``kvtier_dram``       a fresh process whose prompt KV a previous process stored
                        through the connector (the ``cold_connector`` run is that
                        writer): the hit comes from kvtier DRAM;
* ``kvtier_ssd``        the same after ``kvtier drain`` (copy to the SSD tier) and
                        ``kvtier evict --tier dram --all``: the hit comes from SSD
                        (checked with ``kvtier ls --keys``);
* ``example_connector`` vLLM's in-tree ExampleConnector (safetensors files in a
                        temp dir): a writer process (its TTFT is reported as
                        ``example_miss``), then a fresh measuring process;
* ``noop_connector``    a connector that does nothing (``bench/noop_connector.py``):
                        what vLLM's own connector path costs, which every
                        connector pays before its first lookup or save;
* ``floor``             vLLM's in-process prefix cache: the same prompt twice in one
                        engine, TTFT of the second (the first is reported as
                        ``cold_inproc``).

Each round (``--repeat``) uses new prompts (seeded by round and length) and a
new kvtier namespace, and rotates the order of the configurations, so first-run
and ordering effects spread over all of them; the table shows medians and the
min-max over rounds, with ratios against ``cold`` and ``floor`` of the same run.
A private kvtierd (temp sockets, /dev/shm/kvtier-bench-*, an SSD tier in
/var/tmp) is started for the kvtier configurations and removed at the end.

Like with like: every engine gets the same settings -- prefix caching on,
``max_num_batched_tokens`` = max_model_len (a prompt is prefilled in one step;
with vLLM's default of 4096 the ExampleConnector stores only a longer prompt's
first chunk and its hit crashes), and ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: vLLM's
CPU thread binding reserves one more core whenever a KV connector is configured,
which on a 2-CPU host means the model runner gets both cores with a connector and
one without (``--reserved-cpus auto`` shows it; the bound cores are in the table's
log and the JSON as ``omp_cores``).

Targets (printed with pass/fail): at 4k tokens every hit <= 0.1x cold; kvtier
DRAM hit <= 1.1x floor and <= the ExampleConnector hit at every length; kvtier
SSD hit <= 1.3x floor; kvtier miss overhead (cold_connector - cold) <= 5% of cold.
With ``noop_connector`` measured too, the targets also compare cold_connector with
it: kvtier's own miss overhead, over what vLLM's connector path costs.
``--kvtier-extra '{"save": false, "load_mode": "off"}'`` makes the kvtier engines
connect and do nothing (and ``kvtier_dram`` then has nothing to hit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
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
MiB = 1 << 20
GiB = 1 << 30
BLOCK = 128  # vLLM CPU block size (tokens)

ALL_CONFIGS = ["cold", "cold_connector", "kvtier_dram", "kvtier_ssd", "example_connector",
               "noop_connector", "floor"]
#: Rows of the table: the configurations plus the side measurements.
ROWS = ["cold", "cold_inproc", "cold_connector", "noop_connector", "example_miss",
        "kvtier_dram", "kvtier_ssd", "example_connector", "floor"]
KVTIER_CONFIGS = {"cold_connector", "kvtier_dram", "kvtier_ssd"}

BIG = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 8, "vocab": 32000}
SMALL = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "vocab": 1000}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# --------------------------------------------------------------------------- worker
def worker(spec_path: str) -> int:
    """One engine process: warm-up, then the measured prompt (twice for ``floor``)."""
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kv_space_gib"]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if spec.get("kv_transfer_config"):
        kw["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=spec["max_model_len"],
              dtype=spec["dtype"], enable_prefix_caching=True, disable_log_stats=False,
              seed=0, **kw)
    startup = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=1)

    def gen(tokens: list[int]) -> dict[str, Any]:
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        o = out[0]
        return {"ttft_s": dt, "num_cached_tokens": o.num_cached_tokens,
                "prompt_tokens": len(tokens), "token": o.outputs[0].token_ids[0]}

    res: dict[str, Any] = {"startup_s": startup}
    res["warmup"] = gen(spec["warmup"])
    metrics_before = _metrics(llm)
    runs = [gen(spec["prompt"]) for _ in range(spec.get("times", 1))]
    res["runs"] = runs
    res["metrics_before"] = metrics_before
    res["metrics"] = _metrics(llm)
    with open(spec["out"], "w") as f:
        json.dump(res, f)
    return 0


def _metrics(llm: Any) -> dict[str, float]:
    """vLLM's KV/prefix/connector metrics, as floats.

    ``llm.get_metrics()`` turns every counter into an int (so a ``*_seconds`` counter
    under 1 s reads 0); the counters are read from this process's Prometheus registry
    instead (where the offline engine's stat loggers keep them), and ``get_metrics()``
    only for what the registry does not have.
    """
    out: dict[str, float] = {}
    try:
        import prometheus_client

        for fam in prometheus_client.REGISTRY.collect():
            if not any(w in fam.name for w in ("kv", "prefix", "connector")):
                continue
            for smp in fam.samples:
                if smp.name.endswith(("_created", "_bucket")):
                    continue
                name = smp.name.removesuffix("_total") if fam.type == "counter" else smp.name
                out[name] = out.get(name, 0.0) + float(smp.value)
    except Exception as exc:  # noqa: BLE001 -- best effort
        out["registry_error"] = float("nan")
        log(f"prometheus registry: {exc}")
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 -- best effort
        return out
    for m in metrics:
        name = getattr(m, "name", "")
        if name in out or not any(w in name for w in ("kv", "prefix", "connector")):
            continue
        if hasattr(m, "value"):
            out[name] = out.get(name, 0.0) + float(m.value)
    return out


# --------------------------------------------------------------------------- driver
class EngineFailed(RuntimeError):
    def __init__(self, tag: str, reason: str) -> None:
        super().__init__(reason)
        self.tag, self.reason = tag, reason


class Bench:
    def __init__(self, args: argparse.Namespace, base: str) -> None:
        self.args = args
        self.base = base
        self.model_dir = os.path.join(base, "model")
        self.shape = SMALL if args.small else BIG
        self.daemon: Any = None
        self.n_proc = 0
        self.procs: list[dict[str, Any]] = []

    # -- processes
    def run_engine(self, label: str, prompt: list[int], warmup: list[int],
                   ktc: dict[str, Any] | None, times: int = 1) -> dict[str, Any]:
        self.n_proc += 1
        tag = f"{self.n_proc:03d}-{label}"
        spec = {"model": self.model_dir, "max_model_len": self.max_model_len,
                "dtype": "bfloat16", "kv_space_gib": self.args.kv_space, "prompt": prompt,
                "warmup": warmup, "kv_transfer_config": ktc, "times": times,
                "max_num_batched_tokens": self.max_batched,
                "out": os.path.join(self.base, f"{tag}.out.json")}
        spec_path = os.path.join(self.base, f"{tag}.spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        logf = os.path.join(self.base, f"{tag}.log")
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.args.kv_space)
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        if self.args.reserved_cpus != "auto":
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = self.args.reserved_cpus
        env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
        t0 = time.perf_counter()
        with open(logf, "wb") as lf:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--_worker", spec_path],
                               stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=env, timeout=self.args.proc_timeout, check=False)
        wall = time.perf_counter() - t0
        if self.args.keep_logs:
            shutil.copy(logf, os.path.join(self.args.keep_logs, f"{tag}.log"))
        if p.returncode != 0 or not os.path.exists(spec["out"]):
            with open(logf, errors="replace") as f:
                lines = f.readlines()
            errs = [ln.strip() for ln in lines if "Error" in ln and ":" in ln]
            reason = errs[-1][:400] if errs else f"rc {p.returncode}"
            raise EngineFailed(tag, f"engine process {tag} failed (rc {p.returncode}): {reason}")
        with open(spec["out"]) as f:
            res: dict[str, Any] = json.load(f)
        res["process_wall_s"] = wall
        res["log_notes"] = _log_notes(logf)
        res["omp_cores"] = _omp_cores(logf)
        if self.args.keep_logs:
            shutil.copy(spec["out"], os.path.join(self.args.keep_logs, f"{tag}.out.json"))
        self.procs.append({"tag": tag, "wall_s": wall, "startup_s": res["startup_s"]})
        r0 = res["runs"][-1]
        log(f"  {tag:<28} ttft {r0['ttft_s'] * 1e3:9.1f} ms  cached {r0['num_cached_tokens']:>5}"
            f"/{r0['prompt_tokens']}  (warm-up {res['warmup']['ttft_s'] * 1e3:.0f} ms, "
            f"startup {res['startup_s']:.1f} s, OMP cores {res['omp_cores']})")
        return res

    @property
    def max_batched(self) -> int | None:
        """None: vLLM's default (4096 on CPU: longer prompts are prefilled in chunks)."""
        v = self.args.max_num_batched_tokens
        if v == "model-len":
            return self.max_model_len
        return int(v) or None

    @property
    def max_model_len(self) -> int:
        return int(max(max(self.args.tokens), self.args.warmup_tokens)) + BLOCK

    # -- connector configs
    def example_ktc(self, path: str) -> dict[str, Any]:
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": path}}

    def kvtier_ktc(self, prefix: str) -> dict[str, Any]:
        extra: dict[str, Any] = {**self.args.kvtier_extra, "socket_dir": self.daemon.socket_dir,
                                 "namespace_prefix": prefix}
        return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": extra}

    @staticmethod
    def noop_ktc() -> dict[str, Any]:
        return {"kv_connector": "NoopConnector", "kv_connector_module_path": "bench.noop_connector",
                "kv_role": "kv_both"}

    # -- one round of one length
    def round(self, r: int, n: int, configs: list[str]) -> dict[str, dict[str, Any]]:
        vocab = self.shape["vocab"]
        prompt = make_prompt(n, vocab, seed=1000 * r + n)
        warmup = make_prompt(self.args.warmup_tokens, vocab, seed=10**6 + 1000 * r + n)
        assert prompt[0] != warmup[0]  # no shared first block (hence none at all)
        units: list[str] = []
        for c in configs:
            u = "kvtier" if c in KVTIER_CONFIGS else c
            if u not in units:
                units.append(u)
        k = r % len(units)
        units = units[k:] + units[:k]  # rotate: interleave the order over rounds
        out: dict[str, dict[str, Any]] = {}

        def keep(row: str, res: dict[str, Any], run: int = -1) -> None:
            x = dict(res["runs"][run])
            x["startup_s"] = res["startup_s"]
            x["metrics"] = res["metrics"]
            x["metrics_before"] = res["metrics_before"]
            x["log_notes"] = res["log_notes"]
            x["omp_cores"] = res["omp_cores"]
            out[row] = x

        log(f"round {r + 1}/{self.args.repeat}, {n} tokens: {' -> '.join(units)}")
        for u in units:
            try:
                self.unit(u, r, n, configs, prompt, warmup, out, keep)
            except EngineFailed as exc:
                log(f"  {u}: {exc.reason}")
                errs = out.setdefault("_errors", {})
                errs[u] = {"process": exc.tag, "reason": exc.reason}
        return out

    def unit(self, u: str, r: int, n: int, configs: list[str], prompt: list[int],
             warmup: list[int], out: dict[str, dict[str, Any]], keep: Any) -> None:
        if u == "cold":
            keep("cold", self.run_engine(f"cold-{n}", prompt, warmup, None))
        elif u == "floor":
            res = self.run_engine(f"floor-{n}", prompt, warmup, None, times=2)
            keep("cold_inproc", res, 0)
            keep("floor", res, 1)
        elif u == "noop_connector":
            keep("noop_connector", self.run_engine(f"noop-{n}", prompt, warmup, self.noop_ktc()))
        elif u == "example_connector":
            d = tempfile.mkdtemp(prefix="example-", dir=self.spill_root)
            try:
                ktc = self.example_ktc(d)
                keep("example_miss", self.run_engine(f"example-writer-{n}", prompt, warmup,
                                                     ktc))
                keep("example_connector", self.run_engine(f"example-hit-{n}", prompt,
                                                          warmup, ktc))
            finally:
                shutil.rmtree(d, ignore_errors=True)
        elif u == "kvtier":
            prefix = f"bench-{uuid.uuid4().hex[:8]}-r{r}-{n}"
            ktc = self.kvtier_ktc(prefix)
            before = set(self.namespaces())
            res = self.run_engine(f"kvtier-writer-{n}", prompt, warmup, ktc)
            if "cold_connector" in configs:
                keep("cold_connector", res)
            new = sorted(set(self.namespaces()) - before)
            if "kvtier_dram" in configs:
                keep("kvtier_dram", self.run_engine(f"kvtier-dram-{n}", prompt, warmup, ktc))
            if "kvtier_ssd" in configs:
                out["_ssd_check"] = self.push_to_ssd(new)
                keep("kvtier_ssd", self.run_engine(f"kvtier-ssd-{n}", prompt, warmup, ktc))
                out["kvtier_ssd"]["ssd_check"] = out.pop("_ssd_check")
            out.setdefault("_meta", {})["kvtier_namespaces"] = new

    # -- kvtier admin
    def kvtier_cli(self, *argv: str) -> str:
        cmd = [os.path.join(os.path.dirname(sys.executable), "kvtier"), "--socket",
               self.daemon.socket_dir, *argv]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: rc {p.returncode}\n{p.stdout}\n{p.stderr}")
        return p.stdout

    def namespaces(self) -> list[str]:
        return [ns.name for ns in self.daemon.stats().namespaces]

    def key_tiers(self, ns: str) -> dict[str, int]:
        tiers: dict[str, int] = {}
        for line in self.kvtier_cli("ls", "--keys", "--namespace", ns, "--all",
                                    "--json").splitlines():
            for k in json.loads(line)["keys"]:
                tiers[k["tier"]] = tiers.get(k["tier"], 0) + 1
        return tiers

    def push_to_ssd(self, namespaces: list[str]) -> dict[str, Any]:
        """kvtier drain, then evict every block of ``namespaces`` from DRAM; verify."""
        if not namespaces:
            raise RuntimeError("the kvtier writer created no namespace in kvtierd: the "
                               "connector stored nothing")
        t0 = time.perf_counter()
        drain = self.kvtier_cli("drain", "--timeout", "300").strip()
        t_drain = time.perf_counter() - t0
        evicted = {}
        for ns in namespaces:
            evicted[ns] = self.kvtier_cli("evict", "--namespace", ns, "--all", "--tier",
                                          "dram").strip()
        tiers = {ns: self.key_tiers(ns) for ns in namespaces}
        ok = all(set(t) == {"ssd"} for t in tiers.values())
        log(f"  drain {t_drain:.1f} s: {drain}; evict: {evicted}; key tiers now {tiers}"
            f" -> {'SSD only' if ok else 'NOT SSD-only'}")
        if not ok:
            raise RuntimeError(f"blocks are not on SSD only after drain + evict: {tiers}")
        return {"drain": drain, "drain_s": t_drain, "evict": evicted, "key_tiers": tiers,
                "ssd_only": ok}

    # -- whole run
    def start_daemon(self) -> None:
        from kvtier.demo.run import Daemon

        blocks = sum(-(-n // BLOCK) for n in self.args.tokens) + 1
        blocks += -(-self.args.warmup_tokens // BLOCK) * len(self.args.tokens)
        per_block = self.block_bytes()
        need = blocks * per_block * (self.args.repeat + 1)
        capacity = max(256 * MiB, 1 << (need - 1).bit_length())
        shm = f"/dev/shm/kvtier-bench-{uuid.uuid4().hex[:12]}"
        self.daemon = Daemon(base=os.path.join(self.base, "kvtierd"), shm_dir=shm,
                             ssd_dir=os.path.join(self.spill_root, "ssd"), capacity=capacity,
                             extent=self.args.extent_mib * MiB, ssd_capacity=2 * capacity,
                             ssd_file=256 * MiB)
        os.makedirs(self.daemon.base, exist_ok=True)
        log(f"kvtierd: DRAM {capacity // MiB} MiB, SSD {2 * capacity // MiB} MiB in "
            f"{self.daemon.ssd_dir}, block {per_block / MiB:.2f} MiB")
        self.daemon.start()

    def block_bytes(self) -> int:
        s = self.shape
        head_dim = s["hidden"] // s["heads"]
        return s["layers"] * 2 * BLOCK * s["kv_heads"] * head_dim * 2

    def run(self) -> dict[str, Any]:
        a = self.args
        sys.path.insert(0, os.path.join(ROOT, "tests", "vllm"))
        import tinymodel

        self.spill_root = tempfile.mkdtemp(prefix="kvt-vllm-", dir="/var/tmp")
        t0 = time.perf_counter()
        tinymodel.build(self.model_dir, dtype="bfloat16",
                        max_positions=max(16384, self.max_model_len), **self.shape)
        log(f"model {self.shape} built in {time.perf_counter() - t0:.1f} s")
        configs = [c for c in ALL_CONFIGS if c in a.configs]
        if KVTIER_CONFIGS & set(configs):
            self.start_daemon()
        rounds: dict[int, list[dict[str, dict[str, Any]]]] = {n: [] for n in a.tokens}
        try:
            for r in range(a.repeat):
                for n in a.tokens:
                    rounds[n].append(self.round(r, n, configs))
            daemon_stats = None
            if self.daemon is not None:
                from google.protobuf.json_format import MessageToDict

                daemon_stats = MessageToDict(self.daemon.stats(),
                                             preserving_proto_field_name=True)
        finally:
            if self.daemon is not None:
                self.daemon.stop()
                shutil.rmtree(self.daemon.shm_dir, ignore_errors=True)
            shutil.rmtree(self.spill_root, ignore_errors=True)
        return {"rounds": {str(n): v for n, v in rounds.items()}, "configs": configs,
                "kvtierd_stats_end": daemon_stats, "processes": self.procs}


# --------------------------------------------------------------------------- report
def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for n, rs in rounds.items():
        rows: dict[str, Any] = {}
        for row in ROWS:
            xs = [r[row] for r in rs if row in r]
            if not xs:
                continue
            t = [x["ttft_s"] for x in xs]
            load = [_connector_load(x) for x in xs]
            rows[row] = {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                         "runs_s": t, "num_cached_tokens": [x["num_cached_tokens"] for x in xs],
                         "connector_load": load}
        summary[n] = rows
    return summary


def _connector_load(x: dict[str, Any]) -> dict[str, float]:
    """The kvtier connector's own counters of the measured request (after - before)."""
    m, b = x.get("metrics", {}), x.get("metrics_before", {})
    out = {}
    for k, v in m.items():
        if "kvtier" in k and isinstance(v, float):
            out[k] = v - b.get(k, 0.0)
    return out


def render(summary: dict[str, dict[str, Any]]) -> tuple[str, list[tuple[str, bool | None, str]]]:
    lines = []
    hdr = (f"{'tokens':>6}  {'config':<18} {'median ms':>10} {'min-max ms':>19} {'x cold':>7} "
           f"{'x floor':>8}  {'cached':>12}  connector load")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for n, rows in summary.items():
        cold = rows.get("cold", {}).get("median_s")
        floor = rows.get("floor", {}).get("median_s")
        for row, s in rows.items():
            med = s["median_s"]
            rc = f"{med / cold:7.3f}" if cold else f"{'-':>7}"
            rf = f"{med / floor:8.2f}" if floor else f"{'-':>8}"
            cached = ",".join(str(c) for c in sorted(set(s["num_cached_tokens"])))
            load = _load_text(s["connector_load"])
            lines.append(f"{n:>6}  {row:<18} {med * 1e3:10.1f} "
                         f"{s['min_s'] * 1e3:9.1f}-{s['max_s'] * 1e3:<9.1f} {rc} {rf}  "
                         f"{cached:>12}  {load}")
        lines.append("")
    return "\n".join(lines), targets(summary)


def _load_text(loads: list[dict[str, float]]) -> str:
    """Median connector load (or, for a miss, save) of the measured request."""
    def med(name: str) -> float | None:
        xs = [d[k] for d in loads for k in d if k.removesuffix("_total").endswith(name)]
        return statistics.median(xs) if xs else None

    parts = []
    for what in ("load", "save"):
        n = med("loaded_blocks" if what == "load" else "saved_blocks")
        t = med(f"{what}_seconds")
        if n:
            parts.append(f"{what} {n:.0f} blk {t * 1e3 if t is not None else float('nan'):.1f} ms")
    return ", ".join(parts) or "-"


def targets(summary: dict[str, dict[str, Any]]) -> list[tuple[str, bool | None, str]]:
    out: list[tuple[str, bool | None, str]] = []

    def med(n: str, row: str) -> float | None:
        v = summary.get(n, {}).get(row, {}).get("median_s")
        return float(v) if v is not None else None

    def check(name: str, a: float | None, b: float | None, factor: float, what: str) -> None:
        if a is None or b is None:
            out.append((name, None, "not measured"))
            return
        out.append((name, a <= factor * b, f"{a * 1e3:.1f} ms vs {factor:g} x {what} "
                    f"{b * 1e3:.1f} ms = {factor * b * 1e3:.1f} ms ({a / b:.3f}x)"))

    if "4096" in summary:
        for row in ("kvtier_dram", "kvtier_ssd", "example_connector", "floor"):
            if row in summary["4096"]:
                check(f"4k: {row} <= 0.1x cold", med("4096", row), med("4096", "cold"), 0.1,
                      "cold")
    for n in summary:
        check(f"{n}: kvtier_dram <= 1.1x floor", med(n, "kvtier_dram"), med(n, "floor"), 1.1,
              "floor")
        check(f"{n}: kvtier_dram <= example_connector", med(n, "kvtier_dram"),
              med(n, "example_connector"), 1.0, "example")
        check(f"{n}: kvtier_ssd <= 1.3x floor", med(n, "kvtier_ssd"), med(n, "floor"), 1.3,
              "floor")
        check(f"{n}: cold_connector <= 1.05x cold (miss overhead <= 5%)",
              med(n, "cold_connector"), med(n, "cold"), 1.05, "cold")
        if med(n, "noop_connector") is not None:
            check(f"{n}: cold_connector <= 1.05x noop_connector (kvtier's own miss overhead)",
                  med(n, "cold_connector"), med(n, "noop_connector"), 1.05, "noop")
    return out


def _omp_cores(path: str) -> list[int] | None:
    """The CPU ids vLLM bound the model runner's OpenMP threads to (its log)."""
    with open(path, errors="replace") as f:
        for line in f:
            m = re.search(r"core ids=\[([0-9, ]*)\]", line)
            if m:
                return [int(c) for c in m.group(1).split(",") if c.strip()]
    return None


_NOTE_WORDS = ("core ids", "reserve_cpu_num", "reserved CPU", "RESERVED_CPU",
               "hybrid kv cache manager", "OMP threads", "omp threads", "chunked prefill",
               "max_num_batched_tokens", "prefix caching", "KVTier", "kvtier", "External Cache",
               "Traceback", "Error", "WARNING")


def _log_notes(path: str) -> list[str]:
    notes = []
    with open(path, errors="replace") as f:
        for line in f:
            if any(w in line for w in _NOTE_WORDS):
                notes.append(line.rstrip()[:300])
    return notes[:60]


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--_worker":
        return worker(sys.argv[2])
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="prompt lengths (default 1024 4096 8192; --small: 512)")
    p.add_argument("--repeat", type=int, default=2, help="rounds (fresh processes each)")
    p.add_argument("--configs", nargs="+", choices=ALL_CONFIGS, default=ALL_CONFIGS)
    p.add_argument("--small", action="store_true",
                   help="tiny model (2 layers, hidden 128) and short prompts: a smoke run")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="length of the unrelated warm-up prompt (default 1024; --small 384)")
    p.add_argument("--reserved-cpus", default="1",
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine: cores kept off the "
                   "model runner's OpenMP threads (default 1: the runner gets 1 core of 2 "
                   "with or without a connector; 'auto': vLLM's default, which reserves one "
                   "more core when a KV connector is configured)")
    p.add_argument("--max-num-batched-tokens", default="model-len", metavar="N",
                   help="for every engine (default model-len: each prompt is prefilled in one "
                   "step; 0: vLLM's default 4096, with which the ExampleConnector stores only "
                   "the first chunk of a longer prompt and its hit fails)")
    p.add_argument("--kv-space", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--proc-timeout", type=float, default=900, help="per engine process (s)")
    p.add_argument("--extent-mib", type=int, default=64, metavar="MIB",
                   help="the private kvtierd's extent size (default 64, its own default): "
                   "how much a namespace's DRAM grows at a time")
    p.add_argument("--kvtier-extra", type=json.loads, default={}, metavar="JSON",
                   help="more kv_connector_extra_config for the kvtier engines, e.g. "
                   "'{\"save\": false, \"load_mode\": \"off\"}' (a kvtier connector that "
                   "connects and does nothing)")
    p.add_argument("--keep-logs", metavar="DIR", help="copy every engine process's log here")
    p.add_argument("--json", help="write the results here (default "
                   "bench/results/vllm-ttft-<UTC date-time>.json; '-' for none)")
    args = p.parse_args()
    if not isinstance(args.kvtier_extra, dict):
        p.error("--kvtier-extra must be a JSON object")
    if args.tokens is None:
        args.tokens = [512] if args.small else [1024, 4096, 8192]
    if args.warmup_tokens is None:
        args.warmup_tokens = 384 if args.small else 1024
    if args.keep_logs:
        os.makedirs(args.keep_logs, exist_ok=True)
    if KVTIER_CONFIGS & set(args.configs):
        try:
            import kvtier.vllm  # noqa: F401
        except ImportError as exc:
            p.error(f"the kvtier configurations need kvtier.vllm: {exc}")
    base = tempfile.mkdtemp(prefix="kvt-vllm-", dir="/tmp")
    started = datetime.datetime.now(datetime.UTC)
    results: dict[str, Any] = {
        "command": " ".join([os.path.relpath(sys.executable, ROOT), *sys.argv]),
        "started_utc": started.isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "loadavg_start": os.getloadavg()},
    }
    try:
        import torch
        import vllm

        results["machine"].update(vllm=vllm.__version__, torch=torch.__version__)
    except ImportError:
        pass
    bench = Bench(args, base)
    results["model"] = dict(bench.shape, dtype="bfloat16", block_tokens=BLOCK,
                            block_bytes=bench.block_bytes())
    results["tokens"], results["repeat"] = args.tokens, args.repeat
    results["warmup_tokens"] = args.warmup_tokens
    results["reserved_cpus"] = args.reserved_cpus
    results["max_num_batched_tokens"] = bench.max_batched
    t0 = time.perf_counter()
    try:
        results.update(bench.run())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - t0
    results["machine"]["loadavg_end"] = os.getloadavg()
    summary = summarize(results["rounds"])
    results["summary"] = summary
    table, checks = render(summary)
    results["targets"] = [{"target": t, "pass": ok, "detail": d} for t, ok, d in checks]
    print(f"vLLM {results['machine'].get('vllm')} CPU, model {results['model']}, "
          f"{args.repeat} rounds, fresh process per measurement, wall {results['wall_s']:.0f} s")
    print(table)
    failed = [(n, u, e["reason"]) for n, rs in results["rounds"].items() for r in rs
              for u, e in r.get("_errors", {}).items()]
    if failed:
        print("failed engine processes (their rows lack those rounds):")
        for n, u, why in failed:
            print(f"  {n} tokens, {u}: {why}")
    print("targets:")
    for t, ok, d in checks:
        mark = "n/a " if ok is None else ("PASS" if ok else "FAIL")
        print(f"  [{mark}] {t}: {d}")
    out = args.json
    if out is None:
        out = os.path.join(HERE, "results", f"vllm-ttft-{started:%Y-%m-%d-%H%M}.json")
    if out != "-":
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
