"""A kvtierd for a benchmark: its own socket and pool directories, the caller's ``--set``
overrides, the environment's ``KVTIER_*`` settings left out (a benchmark measures the
configuration it names); serving before the caller's block runs, stopped and its
files removed after.

    from _kvtierd import kvtierd  # (bench/ is a script's directory: on sys.path)

    with kvtierd("cp", "dram.capacity=512MiB", "dram.extent_size=64MiB") as d:
        with kvtier.Client(d.socket_dir, ...) as c: ...
        ticks = d.cpu_ticks()

Metrics and the SSD tier are off unless an override turns them on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator

from kvtier._admin import wait_serving
from kvtier._core import socket_paths


@dataclasses.dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    socket_dir: str
    shm_dir: str
    log_path: str
    #: Its whole log, read when it stopped (the directory is gone after the block).
    final_log: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def grpc_path(self) -> str:
        """The gRPC socket (``grpc.insecure_channel(f"unix://{d.grpc_path}")``)."""
        return socket_paths(self.socket_dir)[0]

    def cpu_ticks(self) -> int:
        """The daemon's user + system CPU so far, in clock ticks (``/proc/PID/stat``)."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""


@contextlib.contextmanager
def kvtierd(tag: str, *overrides: str, timeout: float = 60) -> Iterator[Daemon]:
    """Start kvtierd with ``overrides`` (``KEY=VALUE`` each) and wait until it serves;
    on leaving, SIGTERM (SIGKILL after 20 s) and remove its directories."""
    work = tempfile.mkdtemp(prefix=f"kvt-bench-{tag}-")
    shm = f"/dev/shm/kvt-bench-{tag}-{uuid.uuid4().hex[:12]}"
    sock = os.path.join(work, "sock")
    log_path = os.path.join(work, "kvtierd.log")
    args = [sys.executable, "-m", "kvtierd"]
    for item in (f"server.socket_dir={sock}", f"dram.shm_dir={shm}", "metrics.address=",
                 "spill.ssd_dir=", *overrides):
        args += ["--set", item]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = daemon = None
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, env=env,
                                    stdin=subprocess.DEVNULL)
        daemon = Daemon(proc, sock, shm, log_path)
        try:
            wait_serving(sock, proc, timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"kvtierd did not start ({exc}): {daemon.log_tail()}") from None
        yield daemon
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if daemon is not None:
            daemon.final_log = daemon.log_tail(1 << 30)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
