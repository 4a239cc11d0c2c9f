"""Puts in batches whose copies overlap the commits before them, and ``put_many``.

Every test runs on both transports (the session page's commits and the Commit
call, over the session channel or gRPC): a put past ``put_batch_bytes`` * 2 is
cut into batches, batch i+1 copied while batch i's commit is in flight, each
batch all or nothing, stored in order; a failure in a middle batch leaves the
batches before it stored, that one and the later ones not, and says how many.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

import kvtier
from kvtier import _core, errors
from tests.conftest import DaemonProc, run_in_threads

BB = 64 << 10  # 64 KiB blocks: a put of 32 is 2 MiB, four batches of 8 below


def blocks_of(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BB, dtype=np.uint8) for _ in range(n)]


def client(d: DaemonProc, ns: str = "ov") -> kvtier.Client:
    c = kvtier.Client(d.socket_dir, namespace=ns, block_bytes=BB, model_uid="m")
    c.put_batch_bytes = 512 << 10  # 2 MiB puts: four batches of 8 blocks
    return c


def aclient(d: DaemonProc, ns: str) -> kvtier.AsyncClient:
    """:func:`client`'s asyncio twin (opened by ``async with``)."""
    c = kvtier.AsyncClient(d.socket_dir, namespace=ns, block_bytes=BB, model_uid="m")
    c.put_batch_bytes = 512 << 10
    return c


def open_reservations(d: DaemonProc) -> int:
    return int(d.stats().reservations)


def count_commits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of the commits this process's reservations send from now on."""
    sent = [0]
    real = _core.ReservationState._commit_prepare_steps

    def prepare(r: _core.ReservationState) -> _core.Steps[Any]:
        what = yield from real(r)
        sent[0] += what is not None
        return what
    monkeypatch.setattr(_core.ReservationState, "_commit_prepare_steps", prepare)
    return sent


def test_a_put_is_cut_into_batches_only_when_large() -> None:
    c = object.__new__(kvtier.Client)  # put_batches reads only the two class settings
    assert (c.put_batch_bytes, c.put_max_batches) == (16 << 20, 4)  # the defaults
    assert c.put_batches([BB] * 32) == [(0, 32)]  # 2 MiB: one batch
    assert c.put_batches([512 << 10] * 32) == [(0, 32)]  # 16 MiB: one batch
    assert c.put_batches([512 << 10] * 64) == [(0, 32), (32, 64)]  # 32 MiB: two of 16
    assert c.put_batches([16 << 20] * 10) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert c.put_batches([64 << 20] * 3) == [(0, 1), (1, 2), (2, 3)]  # never an empty one
    assert c.put_batches([]) == [(0, 0)]


def test_a_put_in_batches_stores_every_block_byte_exact(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    with client(daemon) as c:
        keys = [f"b{i:03d}".encode() for i in range(32)]
        blocks = blocks_of(1, 32)
        assert len(c.put_batches([BB] * 32)) == 4
        sent = count_commits(monkeypatch)
        assert c.put(keys, blocks) == 32
        assert sent == [4]  # one commit per batch
        got = c.get(keys)
        assert len(got) == 32 and all(np.array_equal(a, b) for a, b in zip(got, blocks,
                                                                           strict=True))
        # Present keys are skipped batch by batch, as one put skips them.
        more = [f"c{i:03d}".encode() for i in range(16)]
        assert c.put(keys[8:24] + more, blocks[8:24] + blocks_of(2, 16)) == 16
        assert c.lookup(more) == 16
    assert open_reservations(daemon) == 0
    assert daemon.check() == []


def test_put_many_streams_batches_in_order(daemon: DaemonProc,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with client(daemon) as c:
        items = [([f"s{j}-{i}".encode() for i in range(12)], blocks_of(10 + j, 12))
                 for j in range(5)]
        read: list[int] = []

        def gen() -> Iterator[tuple[list[bytes], list[np.ndarray]]]:
            for j, item in enumerate(items):
                read.append(j)
                yield item

        assert c.put_many(gen()) == 60
        assert read == [0, 1, 2, 3, 4]
        for keys, blocks in items:
            got = c.get(keys)
            assert all(np.array_equal(a, b) for a, b in zip(got, blocks, strict=True))
        assert c.put_many([]) == 0
        assert c.put_many(items[:2]) == 0  # all present
        # An item is one batch, all or nothing, whatever its size.
        sent = count_commits(monkeypatch)
        assert c.put_many([([f"x{i}".encode() for i in range(32)], blocks_of(9, 32))]) == 32
        assert sent == [1]
    assert open_reservations(daemon) == 0
    assert daemon.check() == []


class Inject:
    """Makes the ``at``-th copy (``what="copy"``) or commit (``"commit"``) of this
    process's reservations raise Unavailable, as a daemon that went away would."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, what: str, at: int) -> None:
        self.count = 0
        if what == "copy":
            real_copy = _core.ReservationState._write_reserved

            def copy_in(r: _core.ReservationState, blocks: Any, hashed: bool) -> None:
                self.count += 1
                if self.count == at:
                    raise errors.Unavailable("injected: the copy of a middle batch failed")
                real_copy(r, blocks, hashed)
            monkeypatch.setattr(_core.ReservationState, "_write_reserved", copy_in)
        else:
            real_prepare = _core.ReservationState._commit_prepare_steps

            def prepare(r: _core.ReservationState) -> _core.Steps[Any]:
                self.count += 1
                if self.count == at:
                    raise errors.Unavailable("injected: the commit of a middle batch failed")
                return (yield from real_prepare(r))
            monkeypatch.setattr(_core.ReservationState, "_commit_prepare_steps", prepare)


@pytest.mark.parametrize("what", ["copy", "commit"])
def test_a_failed_middle_batch_keeps_the_batches_before_and_nothing_after(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    with client(daemon) as c:
        keys = [f"f{i:03d}".encode() for i in range(32)]
        blocks = blocks_of(3, 32)
        Inject(monkeypatch, what, at=3)  # batch 3 of 4 (keys 16..23)
        with pytest.raises(errors.Unavailable, match="injected") as info:
            c.put(keys, blocks)
        # The batches before the failing one were stored (batch 2's commit was in
        # flight while batch 3 was copied: it answered before the error left); the
        # failing batch and the one after it were not.
        assert info.value.stored == 16  # type: ignore[attr-defined]
        assert c.lookup(keys) == 16
        assert c.lookup(keys[16:]) == 0
        assert open_reservations(daemon) == 0  # the failed batch's reservation was aborted
        monkeypatch.undo()
        assert c.put(keys, blocks) == 16  # the same put again stores the rest
        got = c.get(keys)
        assert all(np.array_equal(a, b) for a, b in zip(got, blocks, strict=True))
    assert daemon.check() == []


def test_put_many_stops_reading_at_the_first_error(daemon: DaemonProc) -> None:
    with client(daemon) as c:
        read: list[int] = []

        def gen() -> Iterator[tuple[list[bytes], list[np.ndarray]]]:
            for j in range(4):
                read.append(j)
                n = BB + 1 if j == 2 else BB  # item 2 holds a block too large
                yield [f"e{j}-{i}".encode() for i in range(4)], [np.zeros(n, np.uint8)] * 4

        with pytest.raises(errors.InvalidArgument, match="a block holds") as info:
            c.put_many(gen())
        assert info.value.stored == 8  # type: ignore[attr-defined]
        assert read == [0, 1, 2]
        assert c.lookup([f"e1-{i}".encode() for i in range(4)]) == 4
        assert c.lookup([b"e2-0"]) == 0
        with pytest.raises(errors.InvalidArgument, match="a .keys, blocks. pair, not bytes"):
            c.put_many([b"not a pair"])  # type: ignore[list-item]
    assert open_reservations(daemon) == 0


def test_async_put_and_put_many_overlap_the_same_way(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        async with aclient(daemon, "aov") as c:
            keys = [f"a{i:03d}".encode() for i in range(32)]
            blocks = blocks_of(4, 32)
            sent = count_commits(monkeypatch)
            assert await c.put(keys, blocks) == 32
            assert sent == [4]
            got = await c.get(keys)
            assert all(np.array_equal(a, b) for a, b in zip(got, blocks, strict=True))

            async def agen() -> AsyncIterator[tuple[list[bytes], list[np.ndarray]]]:
                for j in range(3):
                    await asyncio.sleep(0)
                    yield [f"g{j}-{i}".encode() for i in range(20)], blocks_of(20 + j, 20)

            assert await c.put_many(agen()) == 60
            assert await c.put_many([([b"g0-0"], [blocks[0]])]) == 0  # a plain iterable too
            assert await c.lookup([f"g2-{i}".encode() for i in range(20)]) == 20

    asyncio.run(main())
    assert open_reservations(daemon) == 0
    assert daemon.check() == []


def test_async_failed_middle_batch_keeps_the_batches_before(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        async with aclient(daemon, "af") as c:
            keys = [f"h{i:03d}".encode() for i in range(32)]
            Inject(monkeypatch, "commit", at=2)
            with pytest.raises(errors.Unavailable, match="injected") as info:
                await c.put(keys, blocks_of(5, 32))
            assert info.value.stored == 8  # type: ignore[attr-defined]
            assert await c.lookup(keys) == 8

    asyncio.run(main())
    assert open_reservations(daemon) == 0
    assert daemon.check() == []


def test_threads_sharing_a_client_put_in_batches_at_once(daemon: DaemonProc) -> None:
    with client(daemon) as c:

        def writer(t: int) -> None:
            for r in range(3):
                keys = [f"t{t}-{r}-{i}".encode() for i in range(24)]
                assert c.put(keys, blocks_of(100 * t + r, 24)) == 24

        run_in_threads(writer, 3, 60)
        assert c.lookup([f"t2-2-{i}".encode() for i in range(24)]) == 24
    assert open_reservations(daemon) == 0
    assert daemon.check() == []


def test_batches_committed_by_calls_overlap_and_fail_the_same_way(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    """Without writes through the page every batch is a Reserve and a Commit call (a
    FastCall on the fast transport, gRPC on the other), the Commit sent before the
    next batch's copy and waited for after it."""
    monkeypatch.setenv(_core.LOCAL_WRITES_ENV, "0")
    with client(daemon, "calls") as c:
        assert not c.local_writes
        keys = [f"r{i:03d}".encode() for i in range(32)]
        blocks = blocks_of(6, 32)
        sent = count_commits(monkeypatch)
        assert c.put(keys[:16], blocks[:16]) == 16  # 1 MiB: two batches of 8
        assert sent == [2]
        Inject(monkeypatch, "commit", at=2)  # of the next put: its second batch
        with pytest.raises(errors.Unavailable, match="injected") as info:
            c.put(keys[16:], blocks[16:])
        assert info.value.stored == 8  # type: ignore[attr-defined]
        assert c.lookup(keys) == 24
        got = c.get(keys[:24])
        assert all(np.array_equal(a, b) for a, b in zip(got, blocks[:24], strict=True))
    assert open_reservations(daemon) == 0
    assert daemon.check() == []
