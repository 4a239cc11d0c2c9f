"""Disaggregated prefill/decode lab for tests/vllm/test_pd.py and bench/vllm_pd.py.

vLLM OpenAI servers (the tiny model, ``enforce_eager``) with the kvtier connector in a
``kv_role``, ``kvtier pd-proxy`` in front, each optionally inside a network namespace
(``tests.fleet.Fleet``).  The test process reaches a namespace's addresses from a thread
that has joined that namespace (``setns(2)`` moves only the calling thread), so a test
talks HTTP to servers on either side of the veth pair without a helper process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import http.client
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tests.engine_zygote import ZYGOTE_ENV, Forked, Zygote
from tests.vllm.logs import failure_excerpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: vLLM-CPU's default block size (tokens): what the tiny model's engines use.
BLOCK = 128
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def in_netns(ns: str | None, fn: Callable[[], T]) -> T:
    """``fn()`` run in network namespace ``ns`` (None: here), from a thread of its own."""
    if ns is None:
        return fn()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({ns}): {os.strerror(err)}")
            finally:
                os.close(fd)
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller)
            box["exc"] = exc

    t = threading.Thread(target=run, name=f"netns-{ns}")
    t.start()
    t.join()
    if "exc" in box:
        raise box["exc"]
    return box["out"]  # type: ignore[no-any-return]


def call(url: str, body: Any = None, *, ns: str | None = None, timeout: float = 120,
         method: str | None = None) -> tuple[int, Any]:
    """(status, JSON answer or text) of one request; ``body``: JSON to POST."""
    parts = urllib.parse.urlsplit(url)

    def go() -> tuple[int, Any]:
        conn = http.client.HTTPConnection(parts.netloc, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method or ("GET" if body is None else "POST"), parts.path, body=data,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return resp.status, raw.decode(errors="replace")

    return in_netns(ns, go)


def stream(url: str, body: dict[str, Any], *, ns: str | None = None, timeout: float = 120,
           on_first: Callable[[], Any] | None = None) -> dict[str, Any]:
    """One streaming request: the events (JSON), when each arrived, the content type;
    ``on_first()`` runs when the first event has arrived (its result: ``at_first``)."""
    parts = urllib.parse.urlsplit(url)

    def go() -> dict[str, Any]:
        conn = http.client.HTTPConnection(parts.netloc, timeout=timeout)
        events: list[Any] = []
        times: list[float] = []
        at_first = None
        try:
            t0 = time.perf_counter()
            conn.request("POST", parts.path, body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            ctype = resp.getheader("Content-Type") or ""
            done = False
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                times.append(time.perf_counter() - t0)
                if payload == b"[DONE]":
                    done = True
                    break
                events.append(json.loads(payload))
                if on_first is not None and len(events) == 1:
                    at_first = on_first()
        finally:
            conn.close()
        return {"status": resp.status, "content_type": ctype, "events": events,
                "times": times, "done": done, "at_first": at_first}

    return in_netns(ns, go)


def stop_group(proc: subprocess.Popen[bytes] | Forked, grace: float = 30) -> None:
    """SIGINT a process group, SIGKILL it if it is not gone within ``grace``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    else:  # the leader is gone; its children may not be
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


#: vLLM picks the port of its torch.distributed store by binding port 0 and closing it;
#: the worker binds it again later (vLLM #39015).  Engines that start together can pick
#: the same port, or a client's connection can take it meanwhile, and the engine then fails
#: with "WorkerProc initialization failed" (the fresh-clone failure of the MLA test).  Each
#: engine gets its own VLLM_PORT, from which vLLM scans upward, below the kernel's
#: ephemeral range (32768 up), where no port is handed out by itself.
_ENGINE_PORTS = itertools.count()
ENGINE_PORT_BASE, ENGINE_PORT_SPAN, ENGINE_PORT_SLOTS = 20000, 40, 250


_engine_tmp: str | None = None


def engine_tmp() -> str:
    """One directory for the temporary files and ZMQ sockets of every engine this test
    process starts (their ``TMPDIR`` and ``VLLM_RPC_BASE_PATH``): vLLM leaves its IPC
    sockets behind, hundreds per suite, and this process removes the directory at exit."""
    global _engine_tmp
    if _engine_tmp is None:
        _engine_tmp = f"/tmp/kvt-engines-{os.getpid()}"
        os.makedirs(_engine_tmp, exist_ok=True)
        atexit.register(shutil.rmtree, _engine_tmp, ignore_errors=True)
    return _engine_tmp


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for an engine or server: its PYTHONPATH first (the
    worktree wins), a VLLM_PORT of its own, and the temporary directory ``engine_tmp``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = engine_tmp()
    env["PYTHONPATH"] = os.pathsep.join([*filter(None, [env.get("PYTHONPATH")]), ROOT])
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    slot = next(_ENGINE_PORTS) % ENGINE_PORT_SLOTS
    env["VLLM_PORT"] = str(ENGINE_PORT_BASE + slot * ENGINE_PORT_SPAN)
    # vLLM-CPU's core reservation is left as it is: a server with kvtier's connector must
    # compute on the threads a server without one has by itself (kvtier._vllm_plugin).
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.update(extra or {})
    return env


#: What the vLLM zygote imports before it forks the tests' engines and servers
#: (``tests/engine_zygote.py``): 9 of a tiny engine's 13 s start here are ``import vllm``
#: and what ``LLM`` pulls in; a server's API process imports its own part on top.
VLLM_PRELOAD = ("torch", "vllm", "vllm.v1.engine.llm_engine", "vllm.entrypoints.llm",
                "vllm.v1.core.sched.scheduler", "vllm.v1.worker.cpu_model_runner",
                "vllm.entrypoints.openai.api_server")


def vllm_zygote() -> Zygote | None:
    """The zygote that forks this process's vLLM engines and servers (started at the first
    one, in an engine's environment: what import time reads is ``child_env``'s for every
    one; each child gets exactly its own).  The suite forks them (tests/conftest.py sets
    ``KVTIER_TEST_ZYGOTE=1`` unless it is set); benchmarks start each afresh, as a user
    would, unless they set it."""
    if os.environ.get(ZYGOTE_ENV, "0") != "1":
        return None
    return Zygote.get(sys.executable, VLLM_PRELOAD, child_env())


def kvtier_ktc(role: str, socket_dir: str, **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` of the kvtier connector in ``role``."""
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm",
            "kv_role": role, "kv_connector_extra_config": {"socket_dir": socket_dir, **extra}}


class Proc:
    """A child in its own process group, its output in a log file; started by subclasses."""

    proc: subprocess.Popen[bytes] | Forked
    log_path: str
    ns: str | None
    host: str
    port: int

    def _spawn(self, cmd: Sequence[str], env: dict[str, str]) -> None:
        api = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        zygote = vllm_zygote() if list(cmd[:3]) == api else None
        with open(self.log_path, "wb") as log:
            if zygote is not None:  # `python -m ...` here, forked with vLLM imported
                with open(os.devnull) as null:
                    self.proc = zygote.fork(list(cmd[1:]), env, stdin=null.fileno(),
                                            stdout=log.fileno(), stderr=log.fileno())
                return
            self.proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def tail(self, n: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def _wait_up(self, what: str, timeout: float, path: str, ok: Sequence[int]) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited (rc {self.proc.returncode}):\n"
                                   f"{failure_excerpt(self.log())}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{what} not up in {timeout:.0f} s:\n{failure_excerpt(self.log())}")
            try:
                status, _ = call(self.url + path, ns=self.ns, timeout=2)
                if status in ok:
                    return
            except OSError:
                pass
            time.sleep(0.5)

    def stop(self) -> None:
        stop_group(self.proc)


class VllmServer(Proc):
    """vLLM's OpenAI server on the tiny model; ``ktc`` None: no connector."""

    def __init__(self, base: str, tag: str, model: str, ktc: dict[str, Any] | None, *,
                 ns: str | None = None, prefix: Sequence[str] = (), host: str = "127.0.0.1",
                 max_model_len: int = 4096, engine_blocks: int = 0, dtype: str = "float32",
                 prefix_caching: bool = True, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, start: bool = True) -> None:
        self.tag, self.ns, self.host, self.port = tag, ns, host, free_port()
        self.log_path = os.path.join(base, f"{tag}.log")
        self.cmd = [*prefix, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                    "--model", model, "--served-model-name", "m", "--enforce-eager",
                    "--dtype", dtype, "--max-model-len", str(max_model_len),
                    "--enable-prefix-caching" if prefix_caching else
                    "--no-enable-prefix-caching",
                    "--host", host, "--port", str(self.port),
                    "--enable-prompt-tokens-details", "--seed", "0"]
        if engine_blocks:
            self.cmd += ["--num-gpu-blocks-override", str(engine_blocks)]
        if ktc is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(ktc)]
        self.cmd += list(extra_args)
        self.env = child_env(env)
        if start:
            self.start()

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self._spawn(self.cmd, self.env)

    def wait(self, timeout: float = 300) -> None:
        self._wait_up(f"vLLM server {self.tag}", timeout, "/health", (200,))
        self.startup_s = time.perf_counter() - self.t0

    def metrics(self) -> dict[str, float]:
        """Prometheus samples (name with labels stripped -> sum over label sets)."""
        status, text = call(self.url + "/metrics", ns=self.ns, timeout=30)
        assert status == 200, text
        out: dict[str, float] = {}
        for line in str(text).splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(value)
        return out


def start_all(servers: Sequence[VllmServer], timeout: float = 300) -> None:
    """Wait for servers started together (engine starts overlap: most of one is imports)."""
    try:
        for s in servers:
            s.wait(timeout)
    except BaseException:
        for s in servers:
            s.stop()
        raise


class ProxyProc(Proc):
    """``kvtier pd-proxy`` as a user runs it (``python -m kvtier.cli pd-proxy ...``)."""

    def __init__(self, base: str, tag: str, prefill: Sequence[str], decode: Sequence[str], *,
                 ns: str | None = None, prefix: Sequence[str] = (), host: str = "127.0.0.1",
                 timeout: float = 120) -> None:
        self.ns, self.host, self.port = ns, host, free_port()
        self.log_path = os.path.join(base, f"{tag}.log")
        self._spawn([*prefix, sys.executable, "-m", "kvtier.cli", "pd-proxy",
                     "--prefill", *prefill, "--decode", *decode, "--host", host,
                     "--port", str(self.port), "--timeout", str(timeout)], child_env())
        # 200 or 503: it answers (its /health is 503 while a server of a phase is down).
        self._wait_up(f"pd-proxy {tag}", 60, "/health", (200, 503))


def completion(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body of token ids, answering token ids and usage."""
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}


def answer_ids(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def cached_tokens(answer: dict[str, Any]) -> int:
    usage = answer.get("usage") or {}
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def full_blocks(prompt_tokens: int, block: int = BLOCK) -> int:
    """The prompt's blocks a consumer loads: every full block not holding the last token."""
    return max(0, prompt_tokens - 1) // block


def clean(base: str) -> None:
    shutil.rmtree(base, ignore_errors=True)
