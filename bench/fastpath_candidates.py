"""Round-trip floors of the fast-path candidates, measured side by side.

Each row is the p50/p99 of one request/answer round trip from a Python client
(blocking Unix stream socket, 64-byte messages unless said), in one run,
rounds interleaved so every row sees the same machine noise:

* ``raw echo (threaded)``: a Python echo server process, one blocking thread;
  the floor any design with a Python peer pays.
* ``asyncio sock_recv echo (uvloop)``: the daemon's event loop reading with
  ``loop.sock_recv`` as the session channel does.
* ``asyncio Protocol echo (uvloop)``: the same loop with a Protocol (the
  transport reads; no coroutine per read).
* ``FastCall Lookup, 1 key`` / ``gRPC Lookup, 1 key``: a real kvtierd started
  here, the same call both ways; ``gRPC health Check``: the empty call.

    .venv/bin/python bench/fastpath_candidates.py [--samples 3000] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable

MSG = b"x" * 64


def _echo_threaded(path: str, ready: multiprocessing.synchronize.Event) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    ready.set()
    conn, _ = srv.accept()
    while True:
        data = conn.recv(65536)
        if not data:
            return
        conn.sendall(data)


def _echo_asyncio(path: str, ready: multiprocessing.synchronize.Event, protocol: bool) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        if protocol:
            class Echo(asyncio.Protocol):
                def connection_made(self, transport: asyncio.BaseTransport) -> None:
                    self.t = transport

                def data_received(self, data: bytes) -> None:
                    self.t.write(data)  # type: ignore[attr-defined]

            await loop.create_unix_server(Echo, path)
            ready.set()
            await asyncio.Event().wait()
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        srv.setblocking(False)
        ready.set()
        conn, _ = await loop.sock_accept(srv)
        conn.setblocking(False)
        while True:
            data = await loop.sock_recv(conn, 65536)
            if not data:
                return
            await loop.sock_sendall(conn, data)

    uvloop.run(main())


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s


def _rtt(s: socket.socket) -> Callable[[], None]:
    def once() -> None:
        s.sendall(MSG)
        got = 0
        while got < len(MSG):
            got += len(s.recv(65536))

    return once


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    import kvtier
    from kvtier.bench.common import write_json
    from kvtier.bench.private_daemon import private_daemon
    from kvtier.v1 import kvtier_pb2 as pb
    from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

    base = tempfile.mkdtemp(prefix="kvt-cand-")
    procs: list[multiprocessing.Process] = []
    stack = contextlib.ExitStack()
    try:
        calls: dict[str, Callable[[], None]] = {}
        for name, target, extra in [
            ("raw echo (threaded)", _echo_threaded, ()),
            ("asyncio sock_recv echo (uvloop)", _echo_asyncio, (False,)),
            ("asyncio Protocol echo (uvloop)", _echo_asyncio, (True,)),
        ]:
            path = os.path.join(base, f"{len(procs)}.sock")
            ready = multiprocessing.Event()
            p = multiprocessing.Process(target=target, args=(path, ready, *extra), daemon=True)
            p.start()
            procs.append(p)
            ready.wait(10)
            calls[name] = _rtt(_connect(path))

        daemon = stack.enter_context(private_daemon("cand", "dram.capacity=64MiB",
                                             "dram.extent_size=16MiB", "log.level=warning"))
        sock_dir = daemon.socket_dir
        fast = kvtier.Client(sock_dir, namespace="cand", block_bytes=4096, model_uid="m",
                             fast_path=True)
        slow = kvtier.Client(sock_dir, namespace="cand", block_bytes=4096, model_uid="m",
                             fast_path=False)
        assert fast.fast_path and not slow.fast_path
        fast.put([b"k"], [b"v"])
        ch = grpc.insecure_channel(f"unix://{daemon.grpc_path}")
        health = health_pb2_grpc.HealthStub(ch)
        stub = pb_grpc.KVTierStub(ch)
        hreq = health_pb2.HealthCheckRequest(service="")
        lreq = pb.LookupRequest(keys=[b"k"])
        calls["FastCall Lookup, 1 key"] = lambda: fast.lookup([b"k"])  # noqa: E731
        calls["gRPC Lookup, 1 key (Client)"] = lambda: slow.lookup([b"k"])  # noqa: E731
        md = (("kvtier-session", slow.token),)
        calls["gRPC Lookup, 1 key (bare stub)"] = lambda: stub.Lookup(lreq, metadata=md)  # noqa: E731
        calls["gRPC health Check (empty call)"] = lambda: health.Check(hreq)  # noqa: E731

        samples: dict[str, list[float]] = {n: [] for n in calls}
        for _ in range(200):  # warm-up
            for fn in calls.values():
                fn()
        names = list(calls)
        pc = time.perf_counter
        for i in range(args.samples):
            for name in names[i % len(names):] + names[: i % len(names)]:
                t0 = pc()
                calls[name]()
                samples[name].append(pc() - t0)
        fast.close()
        slow.close()
        ch.close()
    finally:
        stack.close()  # the daemon
        for p in procs:
            p.kill()
        shutil.rmtree(base, ignore_errors=True)

    raw = sorted(samples[names[0]])[len(samples[names[0]]) // 2]
    rows = []
    print(f"{'round trip':<36} {'p50 us':>8} {'p99 us':>8} {'x raw':>7}")
    for name in names:
        xs = sorted(samples[name])
        p50, p99 = xs[len(xs) // 2], xs[int(len(xs) * 0.99)]
        rows.append({"name": name, "p50_s": p50, "p99_s": p99, "x_raw": p50 / raw})
        print(f"{name:<36} {p50 * 1e6:8.1f} {p99 * 1e6:8.1f} {p50 / raw:6.2f}x")
    write_json(args.json, {"samples": args.samples, "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
