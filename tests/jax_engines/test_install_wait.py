"""The wait for a venv's background install (``scripts/install.sh``'s
``VLLM_TPU_BACKGROUND``): it returns when the install ended well or was never started
in the background, and fails with the install's log when it failed, died or ran past
the wait."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from tests.jax_engines.common import wait_for_install


def _status(venv: str, text: str, log: str = "") -> None:
    with open(os.path.join(venv, ".kvtier-install"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(venv, ".kvtier-install.log"), "w") as f:
        f.write(log)


def test_no_background_install_and_a_finished_one_are_not_waited_for(tmp_path: str) -> None:
    venv = str(tmp_path)
    t0 = time.monotonic()
    wait_for_install(venv, "X", timeout=30)
    _status(venv, "ok")
    wait_for_install(venv, "X", timeout=30)
    assert time.monotonic() - t0 < 5


def test_a_failed_install_fails_the_test_with_its_log(tmp_path: str) -> None:
    venv = str(tmp_path)
    _status(venv, "failed 1", "ERROR: No matching distribution found for tpu-inference")
    with pytest.raises(pytest.fail.Exception, match="(?s)failed \\(exit 1\\).*No matching"):
        wait_for_install(venv, "X", timeout=30)


def test_a_running_install_is_waited_for_until_it_ends(tmp_path: str) -> None:
    venv = str(tmp_path)
    job = subprocess.Popen(["sleep", "30"])
    try:
        _status(venv, f"running {job.pid}")
        threading.Timer(2.0, _status, (venv, "ok")).start()
        t0 = time.monotonic()
        wait_for_install(venv, "X", timeout=60)
        assert 1.5 < time.monotonic() - t0 < 30
    finally:
        job.kill()
        job.wait()


def test_an_install_gone_without_an_end_or_past_the_wait_fails(tmp_path: str) -> None:
    venv = str(tmp_path)
    job = subprocess.Popen(["true"])
    job.wait()
    _status(venv, f"running {job.pid}", "Collecting torch")
    with pytest.raises(pytest.fail.Exception, match="(?s)ended unrecorded.*Collecting torch"):
        wait_for_install(venv, "X", timeout=30)
    job = subprocess.Popen(["sleep", "30"])
    try:
        _status(venv, f"running {job.pid}")
        with pytest.raises(pytest.fail.Exception, match="still running"):
            wait_for_install(venv, "X", timeout=0.1)
    finally:
        job.kill()
        job.wait()
