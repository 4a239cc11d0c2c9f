"""What the JAX engines' tests share: their venvs (Python 3.12, built by ``make install``
beside the main one) and a lab of a tiny model and a kvtierd started around engines."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest

import kvtier
from tests.conftest import DaemonProc, start_daemon, stop_daemon
from tests.vllm import driver

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def engine_python(variable: str, default: str, engine: str, make: str) -> str:
    """The python of ``engine``'s venv: ``$variable`` (as ``make test`` sets it; empty:
    make was told not to build it, so the test skips), else ``default`` under the
    checkout when it is there (pytest run by hand).  ``make`` says how to build it."""
    venv = os.environ.get(variable)
    if venv == "":
        pytest.skip(f"the {engine} tests need the {engine} venv, which make did not build "
                    f"(build it with: {make})")
    if venv is None:
        venv = os.path.join(ROOT, default)
        if not os.path.exists(os.path.join(venv, "bin", "python")):
            pytest.skip(f"no {engine} venv at {venv} ({make} builds it)")
    venv = venv if os.path.isabs(venv) else os.path.join(ROOT, venv)
    wait_for_install(venv, engine)
    python = os.path.join(venv, "bin", "python")
    assert os.path.exists(python), f"make built no {engine} venv at {venv}: run {make}"
    return python


#: How long a test waits for a venv's install still going on in the background
#: (``scripts/install.sh``'s ``VLLM_TPU_BACKGROUND``): ~6 min from PyPI, begun before
#: the suite, which it runs beside.
INSTALL_WAIT = float(os.environ.get("KVTIER_INSTALL_WAIT", "1800"))


def wait_for_install(venv: str, engine: str, timeout: float = INSTALL_WAIT) -> None:
    """Wait until the background install of ``venv`` (if one was started) has ended, and
    fail with its log if it failed, died, or is still running after ``timeout``."""
    status = os.path.join(venv, ".kvtier-install")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(status) as f:
                state, _, pid = f.read().strip().partition(" ")
        except FileNotFoundError:
            return  # installed in the foreground (or by hand): nothing to wait for
        if state == "ok":
            return
        if state == "running" and _alive(int(pid or 0)) and time.monotonic() < deadline:
            time.sleep(5)
            continue
        try:
            with open(status + ".log", errors="replace") as f:
                log = f.read()[-4000:]
        except OSError:
            log = "(no log)"
        why = {"running": "is still running" if _alive(int(pid or 0)) else "ended unrecorded",
               "failed": f"failed (exit {pid})"}.get(state, f"left a state of {state!r}")
        pytest.fail(f"the {engine} venv's background install {why} (waited up to "
                    f"{timeout:.0f} s; its log, {status}.log, ends):\n{log}")


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lab:
    """A random-weight Llama built in ``base`` by the engines' venv (``python``), the
    engines started for a test, and a kvtierd on ``base``'s sockets that keeps its shared
    memory over restarts (the same segments: blocks survive a SIGKILL)."""

    def __init__(self, python: str, base: str) -> None:
        self.python, self.base = python, base
        self.model = os.path.join(base, "model")
        subprocess.run([python, os.path.join(HERE, "tinyllama.py"), self.model], check=True,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        self.daemon: DaemonProc | None = None
        self.shm_dir = ""
        self.engines: list[driver.Engine] = []

    @property
    def socket_dir(self) -> str:
        return os.path.join(self.base, "sock")

    def start_daemon(self) -> DaemonProc:
        d = start_daemon(self.base, capacity="64MiB", extent="16MiB",
                         **({"shm_dir": self.shm_dir} if self.shm_dir else {}))
        self.daemon, self.shm_dir = d, d.shm_dir
        return d

    def namespace(self) -> Any:
        """The engines' namespace, the only one the daemon has (its Stats entry)."""
        assert self.daemon is not None
        spaces = self.daemon.stats().namespaces
        assert len(spaces) == 1, [n.name for n in spaces]
        return spaces[0]

    def client(self) -> kvtier.Client:
        """A client of the engines' namespace."""
        st = self.namespace()
        return kvtier.Client(self.socket_dir, namespace=st.name, block_bytes=st.block_bytes,
                             model_uid=st.model_uid)

    def close(self) -> None:
        for e in self.engines:
            e.close()
        if self.daemon is not None:
            stop_daemon(self.daemon)
