"""The client's session connection without a daemon: framing, fds, answers by call id.

A socketpair stands in for the daemon: frames are written to it exactly as
``kvtierd.session_channel`` writes them (fds on bytes of the frame they belong
to, pieces of one frame, frames back to back), and the link must hand every
frame its own fds and every waiting caller its own answer.
"""

from __future__ import annotations

import array
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvtier import errors
from kvtier._session import FrameSplitter, LinkBroken, SessionLink
from kvtier._wire import FRAME_LEN
from kvtier.v1 import kvtier_pb2 as pb


def _frame(msg: pb.SessionResponse) -> bytes:
    body = msg.SerializeToString()
    return FRAME_LEN.pack(len(body)) + body


def _send(sock: socket.socket, data: bytes, fds: list[int] = ()) -> None:  # type: ignore[assignment]
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    assert sock.sendmsg([data], anc) == len(data)


def _inode(fd: int) -> int:
    return os.fstat(fd).st_ino


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_fds_go_to_the_frame_whose_bytes_carried_them(pair: tuple[socket.socket, socket.socket]
                                                      ) -> None:
    ours, daemon = pair
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    try:
        a = _frame(pb.SessionResponse(call_id=1, reply=pb.FastReply(response=b"a")))
        b = _frame(pb.SessionResponse(call_id=2, mapped=pb.SegmentsMapped(segments_version=7)))
        c = _frame(pb.SessionResponse(call_id=3, mapped=pb.SegmentsMapped(
            fd_segment_ids=[1, 2], segments_version=8)))
        # A without fds, then B whose first bytes carry r1 (one read may take A's tail
        # and B's head together), then C in two pieces, each with one fd (the daemon
        # splits a frame of more than 253 fds that way), then a frame with none.
        _send(daemon, a[:3])
        _send(daemon, a[3:])
        _send(daemon, b[:5], [r1])
        _send(daemon, b[5:])
        half = len(c) // 2
        _send(daemon, c[:half], [r2])
        _send(daemon, c[half:], [w2])
        _send(daemon, a)
        frames = FrameSplitter()
        got: list[tuple[int, list[int]]] = []
        while len(got) < 4:
            item = frames.take()
            if item is None:
                frames.recv(ours)
                continue
            body, fds = item
            got.append((pb.SessionResponse.FromString(body).call_id, fds))
        assert [cid for cid, _ in got] == [1, 2, 3, 1]
        assert got[0][1] == [] and got[3][1] == []
        assert [_inode(fd) for fd in got[1][1]] == [_inode(r1)]
        assert [_inode(fd) for fd in got[2][1]] == [_inode(r2), _inode(w2)]
        for _, fds in got:
            for fd in fds:
                os.close(fd)
    finally:
        for fd in (r1, w1, r2, w2):
            os.close(fd)


def test_a_zero_length_frame_is_a_frame_not_a_stall(pair: tuple[socket.socket, socket.socket]
                                                    ) -> None:
    ours, daemon = pair
    _send(daemon, FRAME_LEN.pack(0) + FRAME_LEN.pack(0))
    frames = FrameSplitter()
    frames.recv(ours)
    assert frames.take() == (b"", [])
    assert frames.take() == (b"", [])
    assert frames.take() is None


class _FakeDaemon:
    """Answers FastCalls on a socket, out of order: a batch of Lookups is answered
    last-first, each with hits = the number its key spells."""

    def __init__(self, sock: socket.socket, batch: int) -> None:
        self.sock = sock
        self.batch = batch
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        frames = FrameSplitter()
        pending: list[pb.SessionRequest] = []
        try:
            while True:
                item = frames.take()
                if item is None:
                    frames.recv(self.sock)
                    continue
                req = pb.SessionRequest.FromString(item[0])
                pending.append(req)
                if len(pending) == self.batch:
                    for r in reversed(pending):
                        n = int(pb.LookupRequest.FromString(r.call.request).keys[0])
                        resp = pb.LookupResponse(hits=n)
                        _send(self.sock, _frame(pb.SessionResponse(
                            call_id=r.call_id,
                            reply=pb.FastReply(response=resp.SerializeToString()))))
                    pending.clear()
        except OSError:
            return


@pytest.fixture
def served(tmp_path: os.PathLike[str], request: pytest.FixtureRequest
           ) -> Iterator[tuple[SessionLink, socket.socket]]:
    """A SessionLink to a listening socket, and the daemon's end of its connection
    (the link's timeout: the test's ``link_timeout`` mark, else 5 s)."""
    mark = request.node.get_closest_marker("link_timeout")
    path = os.path.join(str(tmp_path), "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    link = SessionLink(path, timeout=mark.args[0] if mark else 5.0)
    conn, _ = srv.accept()
    yield link, conn
    link.close()
    conn.close()
    srv.close()


def test_threads_sharing_a_link_each_get_their_own_answer(
        served: tuple[SessionLink, socket.socket]) -> None:
    link, conn = served
    _FakeDaemon(conn, batch=8)
    results: dict[int, int] = {}
    errs: list[BaseException] = []

    def caller(n: int) -> None:
        try:
            # The key spells n; the fake daemon answers hits=n (out of order).
            resp = link.call("Lookup", pb.LookupRequest(keys=[b"%d" % n]), 5.0)
            results[n] = resp.hits
        except BaseException as exc:  # noqa: BLE001
            errs.append(exc)

    for rnd in range(5):
        threads = [threading.Thread(target=caller, args=(rnd * 8 + i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert not errs, errs[0]
    assert results == {n: n for n in range(40)}


@pytest.mark.link_timeout(0.2)
def test_a_silent_daemon_breaks_the_link_after_the_deadline(
        served: tuple[SessionLink, socket.socket]) -> None:
    link, _ = served
    t0 = time.monotonic()
    with pytest.raises(LinkBroken):
        link.call("Lookup", pb.LookupRequest(keys=[b"k"]), 0.2)
    assert time.monotonic() - t0 < 10
    with pytest.raises(errors.Unavailable):  # and stays broken
        link.call("Lookup", pb.LookupRequest(keys=[b"k"]), 0.2)


def test_an_error_frame_is_the_callers_error_and_the_link_goes_on(
        served: tuple[SessionLink, socket.socket]) -> None:
    link, conn = served

    def answer(resp: pb.SessionResponse) -> None:
        frames = FrameSplitter()
        while (item := frames.take()) is None:
            frames.recv(conn)
        resp.call_id = pb.SessionRequest.FromString(item[0]).call_id
        _send(conn, _frame(resp))

    t = threading.Thread(target=answer, args=(pb.SessionResponse(error=pb.SessionError(
        code=5, message="no such lease")),))
    t.start()
    with pytest.raises(errors.NotFound, match="no such lease"):
        link.call("Release", pb.ReleaseRequest(lease_id=9), 5.0)
    t.join()
    t = threading.Thread(target=answer, args=(pb.SessionResponse(reply=pb.FastReply(
        response=pb.LookupResponse(hits=3).SerializeToString())),))
    t.start()
    assert link.call("Lookup", pb.LookupRequest(keys=[b"k"]), 5.0).hits == 3
    t.join()
