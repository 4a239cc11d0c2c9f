"""Throughput: client processes that put and get batches together (started at a
barrier), and their figures summed into one row per backend, op, size and client count."""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier import _accel
from kvtier.bench.common import (
    BACKEND_TRANSPORT,
    BARRIER_TIMEOUT,
    KV_BACKENDS,
    MODEL_UID,
    TASK_TIMEOUT,
    WARMUP_BATCHES,
    Row,
    percentile,
    ratio,
)
from kvtier.bench.meters import ProcCpu, cpu_per


def _bufs(block: int, batch: int, fill: int) -> npt.NDArray[np.uint8]:
    """``batch`` resident blocks (one array, written once so every page is faulted in)."""
    a = np.empty((batch, block), dtype=np.uint8)
    a[:] = fill & 0xFF
    return a


class Worker:
    """One benchmark client process: kvtier Clients (one per transport) of one namespace
    at a time, a Redis connection."""

    def __init__(self, wid: int, socket_dir: str, redis_path: str | None,
                 barriers: dict[int, Any]) -> None:
        self.wid = wid
        self.socket_dir = socket_dir
        self.redis_path = redis_path
        self.barriers = barriers
        self.clients: dict[tuple[int, bool | None], Any] = {}
        self.redis: Any = None
        self.buf_key: tuple[int, int] | None = None
        self.buf: npt.NDArray[np.uint8] | None = None
        self.counter = 0

    def close(self) -> None:
        for c in self.clients.values():
            with contextlib.suppress(Exception):
                c.close()
        self.clients.clear()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                self.redis.close()

    def client(self, block: int, fast_path: bool | None = None) -> Any:
        """The Client of namespace ``bench-<block>`` with that ``fast_path`` argument; a
        client asked for the fast path that did not get it raises RuntimeError."""
        from kvtier.client import Client

        c = self.clients.get((block, fast_path))
        if c is None:
            for other in [k for k in self.clients if k[0] != block]:
                self.clients.pop(other).close()  # one namespace at a time keeps mappings small
            c = Client(self.socket_dir, namespace=f"bench-{block}", block_bytes=block,
                       model_uid=MODEL_UID, fast_path=fast_path)
            self.clients[(block, fast_path)] = c
        if fast_path and not c.fast_path:
            raise RuntimeError("the daemon does not offer the fast path")
        return c

    def redis_conn(self) -> Any:
        if self.redis is None:
            if self.redis_path is None:
                raise RuntimeError("no Redis server in this run")
            redis = importlib.import_module("redis")
            self.redis = redis.Redis(unix_socket_path=self.redis_path, socket_timeout=120)
        return self.redis

    def blocks(self, block: int, batch: int) -> npt.NDArray[np.uint8]:
        if self.buf_key != (block, batch) or self.buf is None:
            self.buf = None  # free the previous size first
            self.buf = _bufs(block, batch, 17 + self.wid)
            self.buf_key = (block, batch)
        return self.buf

    def fresh_keys(self, run: str, block: int, batch: int) -> list[bytes]:
        base = self.counter
        self.counter += batch
        return [f"{run}-p{self.wid}-{block}-{base + i}".encode() for i in range(batch)]

    # ---------------------------------------------------------------- tasks
    def run(self, t: dict[str, Any]) -> dict[str, Any]:
        kind = t["kind"]
        if kind == "ping":
            return {"pid": os.getpid()}
        block, batch, backend = t["block"], t["batch"], t["backend"]
        bufs = self.blocks(block, batch)
        get_keys = [f"{t['run']}-g-{block}-{i}".encode() for i in range(batch)]
        kv = backend in KV_BACKENDS
        if kind == "prep_get":
            if kv:
                c = self.client(block, KV_BACKENDS[backend])
                c.put(get_keys, list(bufs))
                hits = c.lookup(get_keys)
            else:
                r = self.redis_conn()
                p = r.pipeline(transaction=False)
                for k, b in zip(get_keys, bufs, strict=True):
                    p.set(k, b.data)
                p.execute()
                hits = int(r.exists(*get_keys))
            if hits != batch:
                raise RuntimeError(f"{backend}: only {hits}/{batch} get keys present after put")
            return {"keys": batch}
        if kind == "drop_get":
            if kv:
                self.client(block, KV_BACKENDS[backend]).delete(get_keys)
            else:
                self.redis_conn().delete(*get_keys)
            return {}
        if kind not in ("put", "get"):
            raise ValueError(f"unknown task kind {kind!r}")

        op: Callable[[list[bytes]], tuple[float, ...]]
        after: Callable[[list[bytes]], None]
        if kv:
            c = self.client(block, KV_BACKENDS[backend])
            op = self._kv_put(c, bufs) if kind == "put" else self._kv_get(c, bufs)
            after = (lambda keys: c.delete(keys)) if kind == "put" else (lambda keys: None)
        else:
            r = self.redis_conn()
            op = self._redis_put(r, bufs) if kind == "put" else self._redis_get(r, block)
            after = (lambda keys: r.delete(*keys)) if kind == "put" else (lambda keys: None)

        def next_keys() -> list[bytes]:
            return self.fresh_keys(t["run"], block, batch) if kind == "put" else get_keys

        n_clients = t["clients"]
        if kind == "put" and kv and self.wid == 0:
            # Grow the namespace to the slots all clients hold at once, so no timed
            # reserve waits for a new extent to be created and pre-faulted.
            self._prealloc(c, t["run"], block, batch, n_clients)
        if n_clients > 1:
            self.barriers[n_clients].wait(BARRIER_TIMEOUT)
        for _ in range(WARMUP_BATCHES):
            keys = next_keys()
            op(keys)
            after(keys)
        if n_clients > 1:
            self.barriers[n_clients].wait(BARRIER_TIMEOUT)
        iters: int | None = t.get("iters")
        seconds: float = t["seconds"]
        min_iters: int = t["min_iters"]
        parts: list[tuple[float, ...]] = []
        server = ProcCpu.open(t.get("server_pid"))  # the daemon's (Redis') CPU over the loop
        ticks0 = server.read() if server is not None else None
        start = time.perf_counter()
        while True:
            keys = next_keys()
            parts.append(op(keys))
            after(keys)
            n = len(parts)
            if iters is not None:
                if n >= iters:
                    break
            elif n >= min_iters and time.perf_counter() - start >= seconds:
                break
        wall = time.perf_counter() - start
        server_ticks = None
        if server is not None and ticks0 is not None:
            server_ticks = [ticks0, server.read()]
            server.close()
        batch_s = [sum(p) for p in parts]
        timed = sum(batch_s)
        nbytes = len(parts) * batch * block
        phases = [sum(p[i] for p in parts) for i in range(len(parts[0]))]
        return {
            "wid": self.wid, "iters": len(parts), "bytes": nbytes, "timed_s": timed,
            "wall_s": wall, "bytes_per_s": nbytes / timed, "phase_s": phases,
            "batch_p50_s": percentile(batch_s, 50), "batch_p99_s": percentile(batch_s, 99),
            "server_ticks": server_ticks,
        }

    def _prealloc(self, c: Any, run: str, block: int, batch: int, n_clients: int) -> None:
        held = []
        try:
            for _ in range(n_clients):
                held.append(c.reserve(self.fresh_keys(run, block, batch)))
        finally:
            for r in held:
                r.abort()

    @staticmethod
    def _kv_put(c: Any, bufs: npt.NDArray[np.uint8]) -> Callable[[list[bytes]], tuple[float, ...]]:
        def op(keys: list[bytes]) -> tuple[float, ...]:
            t0 = time.perf_counter()
            with c.reserve(keys) as r:
                t1 = time.perf_counter()
                r.write_blocks(bufs)  # what Client.put does: copied and hashed in one pass
                t2 = time.perf_counter()
                n = r.commit()
            t3 = time.perf_counter()
            if n != len(keys):
                raise RuntimeError(f"put stored {n} of {len(keys)} fresh keys")
            return (t1 - t0, t2 - t1, t3 - t2)

        return op

    @staticmethod
    def _kv_get(c: Any, bufs: npt.NDArray[np.uint8]) -> Callable[[list[bytes]], tuple[float, ...]]:
        def op(keys: list[bytes]) -> tuple[float, ...]:
            t0 = time.perf_counter()
            lease = c.acquire(keys)
            t1 = time.perf_counter()
            for dst, view in zip(bufs, lease.views, strict=False):
                _accel.copy_into(dst, view)  # what Client.get(keys, out=...) does
            t2 = time.perf_counter()
            hits = lease.hits
            lease.release(wait=False)  # as Client.get: the answer is reaped by the next call
            t3 = time.perf_counter()
            if hits != len(keys):
                raise RuntimeError(f"get found {hits} of {len(keys)} keys")
            return (t1 - t0, t2 - t1, t3 - t2)

        return op

    @staticmethod
    def _redis_put(r: Any, bufs: npt.NDArray[np.uint8]) -> Callable[[list[bytes]], tuple[float, ...]]:
        views = [b.data for b in bufs]  # redis-py sends memoryviews without copying them

        def op(keys: list[bytes]) -> tuple[float, ...]:
            t0 = time.perf_counter()
            p = r.pipeline(transaction=False)
            for k, v in zip(keys, views, strict=True):
                p.set(k, v)
            p.execute()
            return (time.perf_counter() - t0,)

        return op

    @staticmethod
    def _redis_get(r: Any, block: int) -> Callable[[list[bytes]], tuple[float, ...]]:
        def op(keys: list[bytes]) -> tuple[float, ...]:
            t0 = time.perf_counter()
            vals = r.mget(keys)
            t1 = time.perf_counter()
            if any(v is None or len(v) != block for v in vals):
                raise RuntimeError("redis MGET returned missing or short values")
            return (t1 - t0,)

        return op


def _worker_main(conn: multiprocessing.connection.Connection, wid: int, socket_dir: str,
                 redis_path: str | None, barriers: dict[int, Any]) -> None:
    """Entry point of a spawned client process: run tasks from ``conn`` until None or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    serve_tasks(conn, Worker(wid, socket_dir, redis_path, barriers))


def serve_tasks(conn: multiprocessing.connection.Connection, w: Any) -> None:
    """Run tasks from ``conn`` on ``w`` (``w.run(task)``) until None or EOF, answering
    ``("ok", result)`` or ``("err", traceback)``; then ``w.close()``."""
    try:
        while True:
            try:
                task = conn.recv()
            except (EOFError, OSError):
                break
            if task is None:
                break
            try:
                conn.send(("ok", w.run(task)))
            except BaseException:
                conn.send(("err", traceback.format_exc()))
    finally:
        w.close()


class Workers:
    """Persistent spawned client processes, driven over pipes."""

    def __init__(self, n: int, socket_dir: str, redis_path: str | None,
                 client_counts: Sequence[int]) -> None:
        ctx = multiprocessing.get_context("spawn")
        barriers = {k: ctx.Barrier(k) for k in sorted(set(client_counts)) if k > 1}
        self.barriers = barriers  # alive until the children have unpickled them
        self.procs: list[Any] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        for wid in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(child, wid, socket_dir, redis_path, barriers),
                            name=f"kvtier-bench-{wid}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def call(self, tasks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Send ``tasks[i]`` to worker ``i`` (all at once), then collect every answer.

        The first failure breaks the barriers, so a partner waiting at one fails
        fast instead of timing out, and raises with the worker's traceback.
        """
        for conn, task in zip(self.conns, tasks, strict=False):
            conn.send(task)
        results: list[dict[str, Any] | None] = [None] * len(tasks)
        pending = {id(self.conns[i]): i for i in range(len(tasks))}
        deadline = time.monotonic() + TASK_TIMEOUT
        while pending:
            ready = multiprocessing.connection.wait(
                [self.conns[i] for i in pending.values()], timeout=0.5)
            for obj in ready:
                i = pending.pop(id(obj))
                status, value = self.conns[i].recv()
                if status != "ok":
                    self._break_barriers()
                    raise RuntimeError(f"bench worker {i} failed:\n{value}")
                results[i] = value
            if ready:
                continue
            for i in pending.values():
                if not self.procs[i].is_alive():
                    self._break_barriers()
                    raise RuntimeError(f"bench worker {i} died (exit code {self.procs[i].exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench workers took over {TASK_TIMEOUT:.0f} s for one task")
        return [r for r in results if r is not None]

    def _break_barriers(self) -> None:
        for b in self.barriers.values():
            with contextlib.suppress(Exception):
                b.abort()

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()


# =====================================================================  measurements

def aggregate(backend: str, op: str, block: int, batch: int, per: list[dict[str, Any]],
               memcpy_bps: float) -> Row:
    """One throughput row from the results of the clients that ran together.

    Server CPU: the server's ticks from the first client's start to the last one's end
    of the timed loop, over all their batches (None unless every client read them)."""
    total = sum(p["bytes"] for p in per)
    slowest = max(p["timed_s"] for p in per)
    slowest_wall = max(p["wall_s"] for p in per)
    iters = sum(p["iters"] for p in per)
    bps = total / slowest
    phase_names = (["reserve", "copy", "commit"] if op == "put" else ["acquire", "copy", "release"]
                   ) if backend in KV_BACKENDS else (["pipeline_set"] if op == "put" else ["mget"])
    phases_ms = {
        name: sum(p["phase_s"][i] for p in per) / iters * 1e3 for i, name in enumerate(phase_names)
    }
    spans = [p.get("server_ticks") for p in per]
    ticks = (max(s[1] for s in spans if s) - min(s[0] for s in spans if s)
             if all(spans) else None)
    return {
        "backend": backend, "transport": BACKEND_TRANSPORT.get(backend), "op": op,
        "block_bytes": block, "batch": batch, "clients": len(per),
        "iters": iters, "bytes": total, "timed_s": slowest, "wall_s": slowest_wall,
        "bytes_per_s": bps, "bytes_per_s_wall": total / slowest_wall,
        "x_memcpy": ratio(bps, memcpy_bps),
        "batch_ms_p50": percentile([p["batch_p50_s"] for p in per], 50) * 1e3,
        "batch_ms_p99": max(p["batch_p99_s"] for p in per) * 1e3,
        "phase_ms_per_batch": phases_ms,
        "server_cpu_ticks": ticks,
        "server_cpu_ms_per_batch": cpu_per(ticks, iters, 1e3),
        "per_client": per,
    }


# =====================================================================  driver
