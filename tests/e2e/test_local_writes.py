"""Writes without a call, end to end: puts through slots granted ahead and commits
through the session page (csrc/writes.c), against a real daemon."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvtier
from kvtier import _page, errors
from tests.conftest import DaemonProc, start_daemon, stop_daemon

pytestmark = pytest.mark.one_transport  # each test picks its clients' transports

BB = 65536
#: Grants are off by default (server.write_grant_bytes: 0); these daemons grant up to
#: 2 MiB per session (a 16th of the 32 MiB test pool).
GRANTING = ("--set", "server.write_grant_bytes=64MiB")


@pytest.fixture
def daemon(workdir: str) -> Iterator[DaemonProc]:
    d = start_daemon(workdir, *GRANTING)
    yield d
    stop_daemon(d)
    assert d.proc.returncode == 0, d.log()


def _client(d: DaemonProc, ns: str = "w", **kw: object) -> kvtier.Client:
    kw.setdefault("timeout", 10)
    return kvtier.Client(d.socket_dir, namespace=ns, block_bytes=BB, model_uid="m",
                         **kw)  # type: ignore[arg-type]


def _granted(d: DaemonProc, at_least: int) -> int:
    """Wait for the daemon to grant ``at_least`` slots (it does after a doorbell)."""
    deadline = time.monotonic() + 10
    while (n := d.stats().granted_blocks) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def _settled(d: DaemonProc) -> kvtier.v1.kvtier_pb2.StatsResponse:  # type: ignore[name-defined]
    deadline = time.monotonic() + 10
    while True:
        s = d.stats()
        if (s.sessions, s.granted_blocks, s.reservations) == (0, 0, 0) or \
                time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def test_puts_make_no_reserve_or_commit_call_and_read_back_byte_exact(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    with _client(daemon) as c:
        assert c._maps.index is not None and c._maps.index.writes is not None
        first = [b"first-%d" % i for i in range(8)]
        data = [np.full(BB - i, i, np.uint8) for i in range(8)]
        # No grants yet: Reserve, and the daemon grants two puts' worth of what the put
        # took (a batch of more is held only within 1/16 of the namespace's slots: 3 of
        # its 63 here).
        assert c.put(first, data) == 8
        assert _granted(daemon, 16) == 16
        real = c._call

        def call(method: str, request: object, **kw: object) -> object:
            assert method not in ("Reserve", "Commit", "Abort"), f"{method} went to the daemon"
            return real(method, request, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(c, "_call", call)
        for round_ in range(5):
            ks = [b"r%d-%d" % (round_, i) for i in range(8)]
            assert c.put(ks, data) == 8
            got = c.get(ks)
            assert all(np.array_equal(g, x) for g, x in zip(got, data, strict=True))
        # Present keys are EXISTS before anything is written, as a Reserve says.
        with c.reserve([b"r0-1", b"fresh"]) as r:
            assert r.statuses == [kvtier.KeyStatus.EXISTS, kvtier.KeyStatus.RESERVED]
            r.write(1, b"abc")
            assert r.commit() == 1
        assert c.get([b"fresh"])[0].tobytes() == b"abc"
        with c.reserve([b"aborted"]) as r:
            r.write(0, b"x")
            r.abort()
        assert c.lookup([b"aborted"]) == 0
        with pytest.raises(RuntimeError):
            with c.reserve([b"raised"]):
                raise RuntimeError("the writer failed")  # leaving the block aborts
        assert c.lookup([b"raised"]) == 0
        s = daemon.stats()
        held = s.granted_blocks
        # Refilled to two puts' worth once it held one or less: never fewer than its next
        # put takes (the 1-key reservations since took 2 of the 16).
        assert held == 16 - 2 and s.reservations == 0
        ns = next(n for n in s.namespaces if n.name == "w")
        # Granted and not taken: room held, not reserved.
        assert (ns.committed_blocks, ns.reserved_blocks, ns.granted_blocks) == (8 * 6 + 1, 0, held)
        (dram,) = s.tiers
        assert (dram.granted_blocks, dram.reserved_blocks) == (held, 0)
        assert dram.granted_bytes == held * ns.slot_bytes
    s = _settled(daemon)
    assert (s.sessions, s.granted_blocks, s.reservations) == (0, 0, 0)
    t = s.tiers[0]
    assert t.reserved_bytes == 0 and t.free_bytes + t.committed_bytes == t.total_bytes
    assert daemon.check() == []


def test_a_key_committed_by_another_writer_first_is_not_overwritten(
        daemon: DaemonProc) -> None:
    with _client(daemon) as a, _client(daemon) as b:
        a.put([b"prime"], [b"p"])
        assert _granted(daemon, 1) >= 1
        with a.reserve([b"race"]) as ra:  # from a grant: the daemon knows nothing yet
            ra.write(0, b"from a")
            assert b.put([b"race"], [b"from b"]) == 1  # b commits first
            assert ra.commit() == 0  # a's is EXISTS at commit: nothing stored
        assert a.get([b"race"])[0].tobytes() == b"from b"
        assert a.put([b"after"], [b"ok"]) == 1  # the grant went back to a
    assert daemon.check() == []


_KILLED_WRITER = textwrap.dedent("""
    import sys, numpy as np, kvtier
    from kvtier import _native
    c = kvtier.Client(sys.argv[1], namespace="w", block_bytes=65536, model_uid="m")
    c.put([b"prime-0", b"prime-1", b"prime-2"], [b"p"] * 3)  # a call: 3 granted after it
    index = c._maps.index
    w = index.writes
    import time
    deadline = time.monotonic() + 10
    while (g := w.take(3)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert g is not None
    # Two slots filled and committed in the page (not rung), one only taken.
    for grant, key in zip(g[:2], (b"published-0", b"published-1")):
        view = c._maps.view(kvtier._index.LocalSlot(grant.segment_id, grant.slot * c._maps.slot_bytes,
                            65536, 0, False), 65536, writable=True)
        view[:5] = np.frombuffer(key[:5], np.uint8)
    _native.commits_put(index._page, 0, [(g[0].entry, g[0].word, b"published-0", 5, None),
                                          (g[1].entry, g[1].word, b"published-1", 5, None)])
    print("READY", flush=True)
    time.sleep(60)
""")


def test_a_writer_killed_mid_write_leaves_nothing_held(daemon: DaemonProc) -> None:
    """SIGKILL with grants taken and commit records published but the daemon not rung:
    the published commit is applied when the session ends (its bytes were complete),
    every other granted slot is freed, and the tier balances."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    p = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, daemon.socket_dir],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.strip() == "READY", p.stderr.read() if p.stderr else line
        assert daemon.stats().tiers[0].reserved_blocks == 3  # the three grants it took
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    s = _settled(daemon)
    assert (s.sessions, s.granted_blocks, s.reservations) == (0, 0, 0)
    assert s.tiers[0].reserved_bytes == 0
    with _client(daemon) as c:
        got = c.get([b"published-0", b"published-1"])
        assert [g.tobytes() for g in got] == [b"publi", b"publi"]
    assert daemon.check() == []


def test_async_client_puts_through_grants(daemon: DaemonProc) -> None:
    async def go() -> None:
        async with kvtier.AsyncClient(daemon.socket_dir, namespace="aw", block_bytes=BB,
                                      model_uid="m") as c:
            await c.put([b"prime"], [b"p"])
            assert _granted(daemon, 1) >= 1
            for i in range(4):
                ks = [b"a%d-%d" % (i, j) for j in range(4)]
                assert await c.put(ks, [bytes([j]) * 100 for j in range(4)]) == 4
                got = await c.get(ks)
                assert [g.tobytes() for g in got] == [bytes([j]) * 100 for j in range(4)]

    asyncio.run(go())
    assert daemon.check() == []


def test_off_at_either_end(workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    d = start_daemon(workdir, "--set", "server.write_grant_bytes=0")  # off in the daemon
    try:
        with _client(d) as c:
            assert c._maps.index is not None and c._maps.index.writes is None
            assert c.put([b"k"], [b"v"]) == 1
            assert d.stats().granted_blocks == 0
    finally:
        stop_daemon(d)
    d = start_daemon(workdir, *GRANTING)
    try:
        monkeypatch.setenv("KVTIER_LOCAL_WRITES", "0")
        with _client(d) as c:
            assert c._maps.index is not None and c._maps.index.writes is None
            assert c.put([b"k"], [b"v"]) == 1
        monkeypatch.delenv("KVTIER_LOCAL_WRITES")
        with _client(d, fast_path=False) as g:
            assert g._maps.index is None and g.put([b"k2"], [b"v"]) == 1
        assert d.stats().granted_blocks == 0
        with _client(d) as c, pytest.raises(errors.InvalidArgument):
            c.put([b"dup", b"dup"], [b"v", b"v"])  # a bad request still gets the call's error
        assert d.check() == []
    finally:
        stop_daemon(d)


def test_a_writer_scribbling_its_write_area_costs_only_itself(daemon: DaemonProc) -> None:
    """Random bytes over the whole write area (head, DONE, grants, records), the doorbell
    rung again and again: the daemon keeps serving, commits nothing that is not a valid
    batch of that session's own grants, and balances when the writer goes."""
    rng = np.random.default_rng(7)
    with _client(daemon, "victim") as other:
        other.put([b"safe"], [b"kept"])
        with _client(daemon, "scribbler") as c:
            c.put([b"p0", b"p1", b"p2", b"p3"], [b"p"] * 4)
            assert _granted(daemon, 4) >= 4
            index = c._maps.index
            assert index is not None and index.writes is not None
            page = np.frombuffer(index._page, dtype=np.uint8)
            for _ in range(50):
                page[_page.PAGE_BYTES:] = rng.integers(0, 256, _page.WPAGE_BYTES - _page.PAGE_BYTES,
                                                        dtype=np.uint8)
                index.writes.ring()
            time.sleep(0.2)
            assert other.get([b"safe"])[0].tobytes() == b"kept"
            # At most its limit (2 MiB of a 32 MiB pool: 32 slots), whatever it asks; one
            # more for the victim's writer.
            assert daemon.stats().granted_blocks <= 32 + 1
            del page
    s = _settled(daemon)
    assert (s.sessions, s.granted_blocks, s.reservations) == (0, 0, 0)
    assert s.tiers[0].reserved_bytes == 0
    assert daemon.check() == []
    assert "Traceback" not in daemon.log()


def test_a_reservation_from_grants_makes_its_views_on_first_use(daemon: DaemonProc) -> None:
    """A put copies through (segment, offset) columns: no view per slot is made unless
    ``buffers`` is read, and then it is the same writable view a Reserve gives."""
    with _client(daemon) as c:
        c.put([b"prime-%d" % i for i in range(4)], [b"p"] * 4)
        assert _granted(daemon, 4) >= 4
        with c.reserve([b"v0", b"prime-0", b"v1"]) as r:
            assert r.local and r.statuses[1] == kvtier.KeyStatus.EXISTS
            assert r._buffers is None  # none made yet
            bufs = r.buffers
            assert r.buffers is bufs and bufs[1] is None
            for b in (bufs[0], bufs[2]):
                assert b is not None and b.flags.writeable and b.size == BB
            assert bufs[2] is not None
            bufs[2][:3] = np.frombuffer(b"abc", np.uint8)
            r.lengths[2] = 3
            r.write(0, b"hello")
            assert r.commit() == 2
            assert r.buffers == [None, None, None]  # views end with the reservation
            with pytest.raises(errors.InvalidArgument, match="not reserved"):
                r.write(0, b"late")
            with pytest.raises(errors.InvalidArgument, match=r"keys\[0\] is not reserved"):
                r.write_blocks([b"late", b"", b"late"])
        assert [g.tobytes() for g in c.get([b"v0", b"prime-0", b"v1"])] == [b"hello", b"p", b"abc"]
        # Without reading buffers: the copy is straight into the slots.
        with c.reserve([b"w0", b"w1"]) as r:
            r.write_blocks([b"x" * 10, b"y" * BB])
            assert r._buffers is None
            assert r.commit() == 2
        assert [g.tobytes() for g in c.get([b"w0", b"w1"])] == [b"x" * 10, b"y" * BB]
    assert daemon.check() == []


def test_a_granted_slot_past_its_segment_is_refused_as_a_view_is_and_the_put_calls(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grant's slot is the daemon's word: one that lies past its segment's mapping is
    refused when the reservation is made (FailedPrecondition, with the message a view of
    it gives), its grants go back, and the put asks the daemon instead."""
    from kvtier._index import LocalSlot

    with _client(daemon) as c:
        c.put([b"prime-%d" % i for i in range(2)], [b"p"] * 2)
        assert _granted(daemon, 2) >= 2
        seg = next(iter(c._maps.mappings()))
        for slots in ([(seg, 0), (seg, 2**40)], [(seg, 0), (10**6, 0)], [(10**6, 0)]):
            bad = slots[-1]
            with pytest.raises(errors.FailedPrecondition) as by_view:
                c._maps.view(LocalSlot(bad[0], bad[1], BB, 0, False), BB, writable=True)
            with pytest.raises(errors.FailedPrecondition) as by_columns:
                c._maps.slot_arrays([s for s, _ in slots], [o for _, o in slots], BB,
                                    writable=True)
            assert str(by_columns.value) == str(by_view.value)
        assert set(c._maps.slot_arrays([seg, seg], [0, BB], BB, writable=True)) == {seg}
        index = c._maps.index
        assert index is not None and index.writes is not None
        writes = index.writes
        real_take = writes.take_columns
        taken: list[list[int]] = []

        def far(n: int, slot_bytes: int) -> kvtier._index.TakenGrants | None:
            got = real_take(n, slot_bytes)
            if got is not None:
                taken.append(list(got.entries))
                got.offsets = [2**64 - 1] * len(got)
            return got

        monkeypatch.setattr(writes, "take_columns", far)
        calls: list[str] = []
        real_call = c._call

        def call(method: str, request: object, **kw: object) -> object:
            calls.append(method)
            return real_call(method, request, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(c, "_call", call)
        assert c.put([b"far-0", b"far-1"], [b"a", b"b"]) == 2
        assert taken and "Reserve" in calls
        # The grants taken went back (none is held taken by this writer).
        assert all(_native_grant_free(index, e) for e in taken[0])
        monkeypatch.undo()
        assert [g.tobytes() for g in c.get([b"far-0", b"far-1"])] == [b"a", b"b"]
    assert daemon.check() == []


def _native_grant_free(index: kvtier._index.LocalIndex, entry: int) -> bool:
    """Whether grant ``entry`` of the session page is not taken by a writer."""
    word = int(np.frombuffer(index._page, np.uint64, 1, _page.W_GRANTS + 8 * entry)[0])
    return word & _page.GRANT_TAKEN == 0
