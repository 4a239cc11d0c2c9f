"""The servers a run starts: its own kvtierd (``private_daemon``), Redis, and a
Unix-socket echo server (the raw round trip every call pays)."""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvtier.bench.common import RAW_MSG_BYTES, progress
from kvtier.bench.private_daemon import (
    SHM_PREFIX,
    die_with_parent,
    remove_stale_shm_dirs,
    start_private_daemon,
    stop_private_daemon,
    stop_process,
)
from kvtier.units import format_bytes


def tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def peer_pid(unix_path: str) -> int | None:
    """The pid of the process listening on a Unix socket (SO_PEERCRED), if it can be had."""
    import socket
    import struct

    with contextlib.suppress(OSError):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(unix_path)
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            return int(struct.unpack("3i", creds)[0])
    return None


@contextlib.contextmanager
def own_daemon(workdir: str, capacity: int, extent: int, info: dict[str, Any],
               settings: Sequence[str] = ()) -> Iterator[str]:
    """A private kvtierd on temp sockets and a fresh shm directory, with ``settings``
    (``KEY=VALUE`` each, as ``kvtierd --set``), DRAM only (the figures are about shared
    memory); yields its socket dir."""
    for stale in remove_stale_shm_dirs():
        progress(f"removed {stale} (left by a benchmark that was killed)")
    shm_dir = f"{SHM_PREFIX}{uuid.uuid4().hex[:12]}"
    progress(f"starting kvtierd (capacity {format_bytes(capacity, exact=True)}, extents "
             f"{format_bytes(extent, exact=True)}, shm {shm_dir})")
    d = start_private_daemon(os.path.join(workdir, "sock"), f"dram.capacity={capacity}",
                             f"dram.extent_size={extent}", *settings, shm_dir=shm_dir,
                             log_path=os.path.join(workdir, "kvtierd.log"),
                             bound_to_parent=True)
    info.update(own=True, capacity=capacity, extent_size=extent, shm_dir=shm_dir,
                args=d.args[1:], pid=d.pid)
    try:
        yield d.socket_dir
    finally:
        stop_private_daemon(d)
        info["exit_status"] = d.proc.returncode
        if d.proc.returncode not in (0, None):
            progress(f"kvtierd exited with status {d.proc.returncode}; log tail:\n"
                     f"{d.log_tail(4000)}")


@contextlib.contextmanager
def own_redis(workdir: str, info: dict[str, Any]) -> Iterator[str | None]:
    """redis-server on a Unix socket, no persistence; yields the socket path (None if missing)."""
    binary = shutil.which("redis-server")
    if binary is None:
        info.update(available=False, reason="redis-server not found on PATH "
                    "(Debian: apt-get install redis-server)")
        yield None
        return
    try:
        redis = importlib.import_module("redis")
    except ImportError:
        info.update(available=False, reason="redis-py is not installed "
                    "(pip install 'redis>=5', or the kvtier[bench] extra)")
        yield None
        return
    path = os.path.join(workdir, "redis.sock")
    log_path = os.path.join(workdir, "redis.log")
    args = [binary, "--port", "0", "--unixsocket", path, "--unixsocketperm", "700",
            "--save", "", "--appendonly", "no", "--dir", workdir, "--logfile", log_path,
            "--daemonize", "no"]
    progress(f"starting {binary} on {path}")
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    info["pid"] = proc.pid

    def up() -> bool:
        if not os.path.exists(path):
            return False
        try:
            r = redis.Redis(unix_socket_path=path, socket_timeout=5)
            r.ping()
        except redis.exceptions.ConnectionError:
            return False
        info.update(available=True, binary=binary,
                    version=r.info("server").get("redis_version"),
                    redis_py=getattr(redis, "__version__", "?"), args=args[1:])
        r.close()
        return True

    try:
        wait_up(proc, log_path, "redis-server", up)
        yield path
    finally:
        stop_process(proc)


def wait_up(proc: subprocess.Popen[bytes], log_path: str, what: str,
             up: Callable[[], bool], timeout: float = 20.0) -> None:
    """Until ``up()``: a server this benchmark started is serving (raises if it exits
    or takes longer than ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not up():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}: "
                               f"{tail(log_path)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come up in {timeout:.0f} s")
        time.sleep(0.02)


#: The echo server of the raw round trip: one connection at a time, each byte sent back.

ECHO_SERVER = """\
import signal, socket, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the benchmark stops it with SIGTERM
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[1])
srv.listen(8)
while True:
    conn, _ = srv.accept()
    with conn:
        while True:
            data = conn.recv(65536)
            if not data:
                break
            conn.sendall(data)
"""


@contextlib.contextmanager
def own_echo_server(workdir: str, info: dict[str, Any]) -> Iterator[str]:
    """The raw round trip's echo server: a Python process on ``workdir/echo.sock``;
    yields the socket path, stops the process at the end (also on an error or Ctrl-C)."""
    path = os.path.join(workdir, "echo.sock")
    log_path = os.path.join(workdir, "echo.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-I", "-c", ECHO_SERVER, path], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=die_with_parent)
    info.update(pid=proc.pid, path=path, msg_bytes=RAW_MSG_BYTES)

    def up() -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
        except OSError:
            return False
        return True

    try:
        wait_up(proc, log_path, "the echo server", up)
        yield path
    finally:
        stop_process(proc, 5)


def raw_rtt_sample(sock: socket.socket, msg: bytes, buf: bytearray) -> float:
    """Seconds for ``sendall(msg)`` and ``recv`` of its echo (into ``buf``, ``len(msg)``
    bytes) on a blocking socket."""
    need = len(msg)
    t0 = time.perf_counter()
    sock.sendall(msg)
    got = sock.recv_into(buf)
    while 0 < got < need:
        n = sock.recv_into(memoryview(buf)[got:])
        if n == 0:
            break
        got += n
    dt = time.perf_counter() - t0
    if got != need:
        raise ConnectionError("the echo server closed the connection")
    return dt


# =====================================================================  workers
