"""A private kvtierd: one a benchmark or a test starts for itself, on its own sockets
and shared-memory directory, and stops (removing that directory) when done.

    from kvtier.bench.private_daemon import private_daemon

    with private_daemon("cp", "dram.capacity=512MiB", "dram.extent_size=64MiB") as d:
        with kvtier.Client(d.socket_dir, ...) as c: ...
        ticks = d.cpu_ticks()

Where the daemon must outlive one block (a test fixture, a restart), the two halves:
:func:`start_private_daemon` and :func:`stop_private_daemon`.

What every caller had written for itself, once: the command line (``--set`` the
socket and shm directories, then the caller's settings, which win), the environment
without the caller's ``KVTIER_*`` (a run measures or tests the configuration it
names), metrics and the SSD tier off unless a setting turns them on (an SSD tier
would spill under ``~/.local/state``, shared by every run), the wait until the
daemon serves (its log's tail in the error if it does not), SIGTERM then SIGKILL at
the end.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvtier._admin import wait_serving
from kvtier._core import socket_paths

#: The tmpfs private daemons keep their DRAM tier on: /dev/shm, or ``KVTIER_BENCH_SHM_ROOT``
#: (a benchmark of a tmpfs mounted with huge pages, docs/deployment.md).
SHM_ROOT = os.environ.get("KVTIER_BENCH_SHM_ROOT") or "/dev/shm"
#: Where private daemons' shm directories go (``remove_stale_shm_dirs`` sweeps them).
SHM_PREFIX = os.path.join(SHM_ROOT, "kvtier-bench-")
#: Seconds a daemon has to serve after its start, and to exit after SIGTERM.
START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0


@dataclasses.dataclass
class PrivateDaemon:
    """A kvtierd child process and where it listens."""

    proc: subprocess.Popen[bytes]
    socket_dir: str
    shm_dir: str
    log_path: str
    args: list[str]
    #: Its whole log, read when it stopped (a ``private_daemon`` block removes it).
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

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log()[-n:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def daemon_args(socket_dir: str, shm_dir: str, settings: Sequence[str] = (), *,
                metrics: str = "", prefix: Sequence[str] = (),
                argv: Sequence[str] = ()) -> list[str]:
    """kvtierd's command line: ``prefix`` (a command that execs it, e.g. ``ip netns exec
    NAME``), the directories, metrics on ``metrics`` ("": off), no SSD tier, then
    ``settings`` (``KEY=VALUE`` each, as ``--set``: later ones win), then ``argv`` (more
    arguments as they are: ``--config FILE``, ``--set KEY=VALUE``)."""
    args = [*prefix, sys.executable, "-m", "kvtierd"]
    for item in (f"server.socket_dir={socket_dir}", f"dram.shm_dir={shm_dir}",
                 f"metrics.address={metrics}", "spill.ssd_dir=", *settings):
        args += ["--set", item]
    return args + list(argv)


#: ``KVTIER_*`` variables that choose how this host runs rather than what the daemon
#: is: they reach a private daemon (``KVTIER_XXH3``: the XXH3 path of ``kvtier._native``,
#: so a run under ``KVTIER_XXH3=sse2`` tests the daemon's hashing on that path too).
HOST_KNOBS = frozenset({"KVTIER_XXH3"})


def daemon_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without its ``KVTIER_*`` (but for ``HOST_KNOBS``),
    plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVTIER_") or k in HOST_KNOBS}
    env.update(extra or {})
    return env


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask the kernel to SIGTERM the child when its parent dies (even by SIGKILL).

    Only for a parent whose starting thread lives as long as the child should: the
    signal comes when *that thread* exits."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def stop_process(proc: subprocess.Popen[Any], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def start_private_daemon(socket_dir: str, *settings: str, shm_dir: str | None = None,
                         log_path: str | None = None, metrics: str = "",
                         argv: Sequence[str] = (),
                         env: Mapping[str, str] | None = None, prefix: Sequence[str] = (),
                         bound_to_parent: bool = False, timeout: float = START_TIMEOUT,
                         cls: type[PrivateDaemon] = PrivateDaemon) -> PrivateDaemon:
    """Start kvtierd on ``socket_dir`` (and ``shm_dir``: a fresh one under ``SHM_PREFIX``
    by default), its output to ``log_path`` (``kvtierd-<id>.log`` beside the socket
    directory by default), and wait until it serves; if it does not, it is stopped and
    RuntimeError carries its log's tail.  ``bound_to_parent``: SIGTERM it if this
    process dies (``die_with_parent``).  ``cls``: a subclass of PrivateDaemon to make."""
    shm_dir = shm_dir or f"{SHM_PREFIX}{uuid.uuid4().hex[:12]}"
    log_path = log_path or os.path.join(os.path.dirname(socket_dir.rstrip("/")),
                                        f"kvtierd-{uuid.uuid4().hex[:6]}.log")
    args = daemon_args(socket_dir, shm_dir, settings, metrics=metrics, prefix=prefix, argv=argv)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=daemon_env(env),
                                stdin=subprocess.DEVNULL,
                                preexec_fn=die_with_parent if bound_to_parent else None)
    d = cls(proc, socket_dir, shm_dir, log_path, args)
    try:
        wait_serving(socket_dir, proc, timeout)
    except BaseException as exc:
        stop_private_daemon(d)
        if isinstance(exc, (RuntimeError, TimeoutError)):
            raise RuntimeError(f"kvtierd did not start ({exc}): {d.log_tail()}") from None
        raise
    return d


def stop_private_daemon(d: PrivateDaemon, *, keep_shm: bool = False,
                        timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM (SIGKILL after ``timeout`` s); remove its shm directory unless ``keep_shm``
    (a warm restart reattaches to it)."""
    stop_process(d.proc, timeout)
    if not keep_shm:
        shutil.rmtree(d.shm_dir, ignore_errors=True)


@contextlib.contextmanager
def private_daemon(tag: str, *settings: str, workdir: str | None = None,
                   **kwargs: Any) -> Iterator[PrivateDaemon]:
    """``start_private_daemon`` in a directory of its own (``workdir``, or a fresh temp
    directory removed after), stopped when the block ends, however it ends."""
    work = workdir or tempfile.mkdtemp(prefix=f"kvt-bench-{tag}-")
    kwargs.setdefault("shm_dir", f"{SHM_PREFIX}{tag}-{uuid.uuid4().hex[:12]}")
    kwargs.setdefault("log_path", os.path.join(work, f"kvtierd-{tag}.log"))
    d = None
    try:
        d = start_private_daemon(os.path.join(work, f"sock-{tag}"), *settings, **kwargs)
        yield d
    finally:
        if d is not None:
            stop_private_daemon(d)
            with contextlib.suppress(OSError):
                d.final_log = d.log()
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def remove_stale_shm_dirs(min_age_s: float = 300.0) -> list[str]:
    """Remove ``SHM_PREFIX*`` directories left by private daemons whose runs were killed
    (SIGKILL).

    A directory is stale when no daemon holds its instance lock and it is older than
    ``min_age_s`` (so a run that is just starting is spared).
    """
    removed = []
    for path in glob.glob(SHM_PREFIX + "*"):
        try:
            if time.time() - os.stat(path).st_mtime < min_age_s:
                continue
            lock = os.path.join(path, "kvtierd.lock")
            if os.path.exists(lock):
                fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while a daemon lives
                finally:
                    os.close(fd)
            shutil.rmtree(path)
            removed.append(path)
        except OSError:
            continue
    return removed
