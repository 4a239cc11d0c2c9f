"""A fork server for the tests' engine processes: ``python engine_zygote.py MODULE...``.

An engine process spends most of its start importing its framework: of a tiny vLLM
engine's 13 s start here, 9 s are ``import vllm`` and what ``LLM`` pulls in.  The zygote
imports ``MODULE...`` once, then forks each engine from itself: the child starts with
those modules loaded and runs the engine's script as ``__main__`` would.

Protocol (``Zygote`` below is its parent's side): the zygote prints
``ZYGOTE <socket path>`` once its imports are done and serves a ``SOCK_SEQPACKET``
socket there.  A request is one JSON message ``{"argv": [...], "env": {...}, "cwd": ...}``
sent with three file descriptors (the child's stdin, stdout and stderr; ``argv`` a
script and its arguments, or ``-m``, a module and its arguments); the answer on
the same connection is ``pid N``, then ``exit N`` when the child ended (a signal: minus
its number, as ``subprocess`` has it).  The child gets a session of its own (as
``start_new_session``), exactly the environment asked for, and a fresh temporary
directory choice.  The zygote exits when its stdin ends (its parent closed it or died);
its children live on until their own stdin ends, as processes started directly do.

The zygote stays single-threaded at fork (the children of a threaded process inherit
only the forking thread): it imports, then only waits on its socket and stdin.  Only the
standard library at module level: each engine venv can run it.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from typing import IO, Any, NoReturn

#: ``KVTIER_TEST_ZYGOTE=1``: the drivers fork their engines from a zygote (the suite's
#: default, tests/conftest.py); ``0``: each is a process of its own, started afresh.
ZYGOTE_ENV = "KVTIER_TEST_ZYGOTE"


def _child(req: dict[str, Any], fds: list[int], inherited: list[socket.socket]) -> NoReturn:
    """In the forked child: become the engine process ``req`` describes (``inherited``:
    the zygote's sockets, closed here)."""
    code = 1
    try:
        for sock in inherited:
            sock.close()
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        # The dispositions a new Python process starts with (SIGPIPE ignored: a write to
        # a closed socket, a daemon's killed under its client, is an error, not death).
        for sig, how in ((signal.SIGINT, signal.default_int_handler),
                         (signal.SIGTERM, signal.SIG_DFL), (signal.SIGCHLD, signal.SIG_DFL),
                         (signal.SIGPIPE, signal.SIG_IGN)):
            signal.signal(sig, how)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        tempfile.tempdir = None  # chosen again from this child's TMPDIR
        if os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable(all_threads=True)
        import runpy

        argv = list(req["argv"])
        if argv[0] == "-m":  # as `python -m module args`
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 (printed to the engine's log, as Python would)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001,S110 (a closed pipe: nothing more to say)
                pass
    os._exit(code)


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def serve(modules: list[str]) -> None:
    for name in modules:
        importlib.import_module(name)
    path = os.path.join(tempfile.mkdtemp(prefix="kvt-zygote-"), "sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(64)
    print(f"ZYGOTE {path}", flush=True)
    children: dict[int, socket.socket] = {}
    try:
        while True:
            ready, _, _ = select.select([srv, sys.stdin], [], [], 0.2)
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
                return
            if srv in ready:
                conn, _ = srv.accept()
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                try:
                    req = json.loads(msg)
                    assert len(fds) == 3, "a request sends stdin, stdout and stderr"
                    pid = os.fork()
                    if pid == 0:
                        _child(req, fds, [srv, conn, *children.values()])
                    children[pid] = conn
                    conn.send(b"pid %d" % pid)
                except Exception as e:  # noqa: BLE001 (the request's fault: told, not fatal)
                    conn.send(b"error " + repr(e).encode())
                    conn.close()
                finally:
                    for fd in fds:
                        os.close(fd)
            while children:
                pid, raw = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = children.pop(pid)
                try:
                    conn.send(b"exit %d" % _status(raw))
                except OSError:
                    pass
                conn.close()
    finally:
        srv.close()
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


class Forked:
    """A child of the zygote with the part of ``subprocess.Popen``'s interface the tests'
    drivers use: ``pid``, ``stdin``/``stdout`` (text pipes, when asked for), ``poll``,
    ``wait`` and ``returncode``.  Its end is told by the zygote, whose child it is."""

    def __init__(self, conn: socket.socket, pid: int, stdin: IO[str] | None,
                 stdout: IO[str] | None) -> None:
        self._conn, self.pid, self.stdin, self.stdout = conn, pid, stdin, stdout
        self.returncode: int | None = None

    def _read_end(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        if not select.select([self._conn], [], [], timeout)[0]:
            return
        msg = self._conn.recv(256)
        # "exit N"; nothing (the zygote went away first): the child's end is unknown.
        self.returncode = int(msg.split()[1]) if msg.startswith(b"exit ") else -signal.SIGKILL
        self._conn.close()

    def poll(self) -> int | None:
        self._read_end(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_end(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout or 0)
        return self.returncode


class Zygote:
    """This script run by ``python`` with ``modules`` imported, in ``env``: started once
    per test process (``get``) and stopped at its exit (the engines it forked end as
    theirs would: at the end of their stdin, or signalled by their tests)."""

    _started: dict[tuple[str, tuple[str, ...]], Zygote] = {}
    _lock = threading.Lock()

    def __init__(self, python: str, modules: tuple[str, ...], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), *modules],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("ZYGOTE "):
            self.proc.kill()
            err = self.proc.communicate(timeout=30)[1].decode(errors="replace")
            raise AssertionError(f"the engine zygote did not start: {line!r}\n{err[-4000:]}")
        self.path = line.split(" ", 1)[1].strip()
        # What its imports log later goes to stderr: drained, so it never blocks.
        threading.Thread(target=self._drain, daemon=True).start()
        atexit.register(self.close)

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for _ in self.proc.stderr:
            pass

    @classmethod
    def get(cls, python: str, modules: tuple[str, ...], env: dict[str, str]) -> Zygote:
        """The zygote of ``python`` with ``modules``, started (in ``env``) if none runs."""
        with cls._lock:
            z = cls._started.get((python, modules))
            if z is None or z.proc.poll() is not None:
                z = cls._started[(python, modules)] = Zygote(python, modules, env)
            return z

    def fork(self, argv: list[str], env: dict[str, str], *, stdin: int | None,
             stdout: int | None, stderr: int, cwd: str | None = None) -> Forked:
        """A child running ``argv`` with exactly ``env``, in ``cwd`` (None: this
        process's); ``stdin``/``stdout`` None: a pipe to it (``Forked.stdin``/``.stdout``),
        else that file descriptor."""
        mine: list[int] = []  # this process's ends of the pipes
        theirs: list[int] = []  # the child's ends, closed here once sent
        fds = []
        for fd, child_reads in ((stdin, True), (stdout, False)):
            if fd is None:
                r, w = os.pipe()
                mine.append(w if child_reads else r)
                theirs.append(r if child_reads else w)
                fd = theirs[-1]
            fds.append(fd)
        fds.append(stderr)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            req = {"argv": argv, "env": env, "cwd": cwd or os.getcwd()}
            socket.send_fds(conn, [json.dumps(req).encode()], fds)
            answer = conn.recv(1 << 16)
        except BaseException:
            for fd in mine:
                os.close(fd)
            conn.close()
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        if not answer.startswith(b"pid "):
            for fd in mine:
                os.close(fd)
            conn.close()
            raise AssertionError(f"the engine zygote could not fork: {answer!r}")
        pipes = iter(mine)
        child_in = open(next(pipes), "w") if stdin is None else None  # noqa: SIM115
        child_out = open(next(pipes)) if stdout is None else None  # noqa: SIM115
        return Forked(conn, int(answer.split()[1]), child_in, child_out)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


if __name__ == "__main__":
    # This script's folder (tests/) is not where its modules come from: its ``vllm``
    # package would hide vLLM's.  Each child puts its own script's folder there.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path[0] = os.getcwd()
    serve(sys.argv[1:])
