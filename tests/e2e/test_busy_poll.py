"""A kvtierd with ``server.busy_poll`` answers as without it, and goes idle again once
its clients stop (the polling ends with the window)."""

from __future__ import annotations

import os
import time

import kvtier
from tests.conftest import start_daemon, stop_daemon


def test_a_busy_polling_daemon_answers_and_sleeps_once_its_clients_stop(
        workdir: str, transport: str) -> None:
    d = start_daemon(workdir, "--set", "server.busy_poll=5ms")
    try:
        assert "busy polling: the event loop polls for 5000 us" in d.log()
        with kvtier.Client(d.socket_dir, namespace="bp", block_bytes=4096, model_uid="m") as c:
            assert c.fast_path == (transport == "fast")
            for i in range(300):  # commits through the page, and calls
                with c.reserve([b"k%04d" % i]) as r:
                    r.write(0, b"%04d" % i)
                    assert r.commit() == 1
            assert c.lookup([b"k%04d" % i for i in range(300)]) == 300
            assert c.delete([b"k0000"]) == 1
            with c.acquire([b"k0299"]) as lease:
                assert bytes(lease.views[0]) == b"0299"
            time.sleep(0.2)  # past the window
            t0, k0 = time.monotonic(), d.cpu_ticks()
            time.sleep(1.0)
            busy = (d.cpu_ticks() - k0) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0)
        # A daemon still polling would use ~100% of a core; an idle one a few %.
        assert busy < 0.3, f"the daemon used {busy:.0%} of a core while no client was active"
        assert d.check() == []
    finally:
        stop_daemon(d)
    assert d.proc.returncode == 0, d.log_tail()
