"""Clients ride through daemon restarts: Unavailable during the outage, then a new session."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import kvtier
from kvtier import errors
from tests.conftest import start_daemon, stop_daemon


def _retry_until_ok(fn, deadline_s: float = 15.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return fn()
        except errors.Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_client_rides_through_daemon_sigkill_and_restart(workdir: str) -> None:
    d = start_daemon(workdir)
    d2 = None
    try:
        c = kvtier.Client(d.socket_dir, namespace="ride", block_bytes=4096, model_uid="m",
                          timeout=3, reconnect_max=0.5)
        keys = [b"a", b"b", b"c"]
        blocks = [np.full(4096, i, np.uint8) for i in range(3)]
        assert c.put(keys, blocks) == 3
        lease = c.acquire(keys[:1])
        res = c.reserve([b"never-committed"])
        res.write(0, b"partial")
        d.kill()
        t0 = time.monotonic()
        with pytest.raises(errors.Unavailable):
            c.lookup(keys)
        assert time.monotonic() - t0 < 3.5  # never hangs past the deadline
        with pytest.raises(errors.Unavailable):  # backing off: fails fast, no hang
            c.lookup(keys)
        d2 = start_daemon(workdir, shm_dir=d.shm_dir)
        assert _retry_until_ok(lambda: c.lookup(keys)) == 3  # warm, through a new session
        got = c.get(keys)
        assert all(np.array_equal(a, b) for a, b in zip(got, blocks, strict=True))
        with pytest.raises(errors.SessionLost, match="lease was lost"):
            lease.release()
        with pytest.raises(errors.SessionLost, match="reservation was lost"):
            res.commit()
        assert c.lookup([b"never-committed"]) == 0
        assert c.put([b"never-committed"], [b"now"]) == 1
        c.close()
        assert d2.check() == []
    finally:
        if d2 is not None:
            stop_daemon(d2)
        stop_daemon(d)


def test_client_reconnects_after_graceful_restart(workdir: str) -> None:
    d = start_daemon(workdir)
    stop_daemon(d, keep_shm=True)
    d = start_daemon(workdir, shm_dir=d.shm_dir)
    try:
        with kvtier.Client(d.socket_dir, namespace="g", block_bytes=4096, model_uid="m",
                           reconnect_max=0.5) as c:
            c.put([b"k"], [b"v"])
            stop_daemon(d, keep_shm=True)
            d = start_daemon(workdir, shm_dir=d.shm_dir)
            # The first call after the restart notices the old token and reopens the session.
            assert _retry_until_ok(lambda: c.lookup([b"k"])) == 1
            assert bytes(c.get([b"k"])[0]) == b"v"
    finally:
        stop_daemon(d)


def test_async_client_rides_through_restart(workdir: str) -> None:
    d = start_daemon(workdir)

    async def go() -> None:
        nonlocal d
        async with kvtier.AsyncClient(d.socket_dir, namespace="aio-r", block_bytes=4096,
                                      model_uid="m", timeout=3, reconnect_max=0.5) as c:
            await c.put([b"k"], [b"v"])
            lease = await c.acquire([b"k"])
            d.kill()
            with pytest.raises(errors.Unavailable):
                await c.lookup([b"k"])
            d = start_daemon(workdir, shm_dir=d.shm_dir)
            deadline = time.monotonic() + 15
            while True:
                try:
                    assert await c.lookup([b"k"]) == 1
                    break
                except errors.Unavailable:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
            with pytest.raises(errors.SessionLost):
                await lease.release()

    try:
        asyncio.run(go())
        assert d.check() == []
    finally:
        stop_daemon(d)


def test_client_constructed_while_daemon_down_raises_unavailable(workdir: str) -> None:
    with pytest.raises(errors.Unavailable, match="kvtierd is not running, or not here"):
        kvtier.Client(workdir, namespace="x", block_bytes=4096, model_uid="m")


def test_restart_with_bigger_capacity_keeps_everything(workdir: str) -> None:
    d = start_daemon(workdir, capacity="16MiB")
    keys = [f"cap{i}".encode() for i in range(100)]
    blocks = [np.full(65536, i, np.uint8) for i in range(100)]
    try:
        with kvtier.Client(d.socket_dir, namespace="cap", block_bytes=65536, model_uid="m") as c:
            assert c.put(keys, blocks) == 100
        stop_daemon(d, keep_shm=True)
        d = start_daemon(workdir, capacity="64MiB", shm_dir=d.shm_dir)
        s = d.stats()
        assert s.warm_start and s.recovered_blocks == 100 and list(s.dropped_segments) == []
        assert s.tiers[0].total_bytes == 64 << 20
        with kvtier.Client(d.socket_dir, namespace="cap", block_bytes=65536, model_uid="m") as c:
            got = c.get(keys)
            assert all(np.array_equal(a, b) for a, b in zip(got, blocks, strict=True))
            assert c.put([b"more"], [b"x"]) == 1  # and the extra budget is usable
        assert d.check() == []
    finally:
        stop_daemon(d)
