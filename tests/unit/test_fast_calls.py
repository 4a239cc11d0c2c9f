"""FastCalls start at once (``start_call``): a call that never waits is served and
answered in the reader's turn, without a task; one that waits goes on in a task of
its own, where its deadline cancels it and nothing else."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import uvloop

from kvtier._wire import FRAME_LEN
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.service import FastCallFailed, Method
from kvtierd.session_channel.fast_calls import start_call
from kvtierd.session_channel.framing import Conn


def _parse(body: bytes) -> pb.DeleteRequest:
    return pb.DeleteRequest.FromString(body)


def _serialize(resp: Any) -> bytes:
    out: bytes = resp.SerializeToString()
    return out


def _method(handler: Any) -> dict[str, Method]:
    return {"Delete": Method("Delete", handler, _parse, _serialize)}


def _call(timeout_ms: int = 0, no_reply: bool = False) -> pb.FastCall:
    return pb.FastCall(method="Delete", request=pb.DeleteRequest(keys=[b"k"]).SerializeToString(),
                       timeout_ms=timeout_ms, no_reply=no_reply)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def _answer(peer: socket.socket) -> pb.SessionResponse:
    head = peer.recv(FRAME_LEN.size, socket.MSG_WAITALL)
    (n,) = FRAME_LEN.unpack(head)
    return pb.SessionResponse.FromString(peer.recv(n, socket.MSG_WAITALL))


def test_a_call_that_never_waits_is_answered_before_start_call_returns(pair: Any) -> None:
    daemon, peer = pair
    served: list[asyncio.Task[Any] | None] = []

    async def handler(req: pb.DeleteRequest, ctx: Any) -> pb.DeleteResponse:
        served.append(asyncio.current_task())
        return pb.DeleteResponse(deleted=len(req.keys))

    async def main() -> asyncio.Task[None] | None:
        reader = asyncio.current_task()
        task = start_call(_method(handler), 1 << 20, Conn(daemon, 1 << 20), "tok", 7, _call())
        assert served == [reader]  # it ran in the caller's turn, as the caller's task
        peer.setblocking(False)
        got = _answer(peer)  # already sent: no turn of the loop since
        peer.settimeout(5)
        assert got.call_id == 7 and pb.DeleteResponse.FromString(got.reply.response).deleted == 1
        return task

    assert asyncio.run(main()) is None


def test_a_call_that_waits_goes_on_in_its_own_task(pair: Any) -> None:
    daemon, peer = pair
    go = asyncio.Event()

    async def handler(req: pb.DeleteRequest, ctx: Any) -> pb.DeleteResponse:
        first = asyncio.current_task()
        await go.wait()
        assert asyncio.current_task() is not first  # the rest runs in the call's task
        await asyncio.sleep(0)
        return pb.DeleteResponse(deleted=3)

    async def main() -> None:
        task = start_call(_method(handler), 1 << 20, Conn(daemon, 1 << 20), "tok", 9, _call())
        assert task is not None and not task.done()
        go.set()
        await task
        got = _answer(peer)
        assert got.call_id == 9 and pb.DeleteResponse.FromString(got.reply.response).deleted == 3

    asyncio.run(main())


def test_a_waiting_call_past_its_deadline_answers_deadline_exceeded_and_cancels_only_itself(
        pair: Any) -> None:
    daemon, peer = pair

    async def handler(req: pb.DeleteRequest, ctx: Any) -> pb.DeleteResponse:
        await asyncio.sleep(30)
        raise AssertionError("not reached")

    async def main() -> None:
        reader = asyncio.current_task()
        assert reader is not None
        task = start_call(_method(handler), 1 << 20, Conn(daemon, 1 << 20), "tok", 11,
                          _call(timeout_ms=20))
        assert task is not None
        await task  # answered, not cancelled: the deadline is an answer
        assert not task.cancelled() and not reader.cancelling()
        got = _answer(peer)
        assert got.call_id == 11 and got.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert "did not finish within 20 ms" in got.error.message

    asyncio.run(main())


def test_a_call_that_fails_at_once_is_answered_with_its_status_and_no_reply_is_silent(
        pair: Any) -> None:
    daemon, peer = pair

    async def handler(req: pb.DeleteRequest, ctx: Any) -> pb.DeleteResponse:
        raise FastCallFailed(grpc.StatusCode.NOT_FOUND, "no such lease")

    async def main() -> None:
        conn = Conn(daemon, 1 << 20)
        assert start_call(_method(handler), 1 << 20, conn, "tok", 1, _call(no_reply=True)) is None
        assert start_call(_method(handler), 1 << 20, conn, "tok", 2, _call()) is None
        assert start_call(None, 1 << 20, conn, "tok", 3, _call()) is None  # the fast path off
        got = [_answer(peer) for _ in range(2)]  # call 1 asked for no answer
        assert [g.call_id for g in got] == [2, 3]
        assert got[0].error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert got[1].error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]

    asyncio.run(main())


def test_a_bug_that_escapes_a_call_is_logged_and_the_reader_goes_on(
        pair: Any, caplog: pytest.LogCaptureFixture) -> None:
    daemon, _peer = pair

    def parse(body: bytes) -> Any:
        raise RuntimeError("a parser bug")

    async def handler(req: Any, ctx: Any) -> Any:
        raise AssertionError("not reached")

    async def main() -> asyncio.Task[None] | None:
        methods = {"Delete": Method("Delete", handler, parse, _serialize)}
        return start_call(methods, 1 << 20, Conn(daemon, 1 << 20), "tok", 5, _call())

    assert asyncio.run(main()) is None
    assert "call 5 (Delete) failed" in caplog.text and "a parser bug" in caplog.text


def test_a_deadline_due_before_the_calls_task_first_runs_still_answers(pair: Any) -> None:
    """On uvloop, timers due run before the callbacks made ready in the same turn: a call
    that spent its whole 1 ms deadline before it first waited is cancelled before its
    task's first step.  The cancellation goes into the call, which answers
    DEADLINE_EXCEEDED (a task around ``await`` of the call dropped it, unanswered)."""
    daemon, peer = pair
    seen: list[str] = []

    async def handler(req: pb.DeleteRequest, ctx: Any) -> pb.DeleteResponse:
        time.sleep(0.005)  # past the deadline before it first waits
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        raise AssertionError("not reached")

    async def main() -> None:
        task = start_call(_method(handler), 1 << 20, Conn(daemon, 1 << 20), "tok", 13,
                          _call(timeout_ms=1))
        assert task is not None
        await task
        got = _answer(peer)
        assert got.call_id == 13 and got.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]

    uvloop.run(main())
    assert seen == ["cancelled"]


def test_a_call_cancelled_before_its_task_first_runs_is_cancelled_inside(pair: Any) -> None:
    """A connection that closes cancels its calls' tasks, maybe before their first step:
    each call sees the cancellation where it waits (and lets go of what it holds)."""
    daemon, _peer = pair
    seen: list[str] = []

    async def handler(req: pb.DeleteRequest, ctx: Any) -> pb.DeleteResponse:
        try:
            await asyncio.sleep(30)
        finally:
            seen.append("left")
        raise AssertionError("not reached")

    async def main() -> None:
        task = start_call(_method(handler), 1 << 20, Conn(daemon, 1 << 20), "tok", 15, _call())
        assert task is not None
        task.cancel()  # before its first step
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["left"]

    uvloop.run(main())


def _whole_answer(peer: socket.socket) -> pb.SessionResponse:
    """``_answer`` of a frame larger than one ``recv`` gives (a socket with a timeout
    returns what it has)."""
    def exactly(n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = peer.recv(n - len(out))
            assert chunk, "the daemon's end closed"
            out += chunk
        return bytes(out)

    (n,) = FRAME_LEN.unpack(exactly(FRAME_LEN.size))
    return pb.SessionResponse.FromString(exactly(n))


def test_frames_a_full_socket_takes_in_part_arrive_whole_and_in_order(pair: Any) -> None:
    """``send``: an answer goes out in one ``send`` when the socket takes it; one that it
    takes only in part is finished under the connection's lock, and a frame sent
    meanwhile (another call's answer) waits for it: every frame arrives whole."""
    from kvtierd.session_channel.framing import send

    daemon, peer = pair
    daemon.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = pb.SessionResponse(call_id=1, reply=pb.FastReply(response=b"x" * (1 << 20)))
    small = pb.SessionResponse(call_id=2, reply=pb.FastReply(response=b"y"))
    got: list[pb.SessionResponse] = []

    async def main() -> None:
        conn = Conn(daemon, 1 << 20)
        first = asyncio.ensure_future(send(conn, big, []))
        await asyncio.sleep(0)  # it sent what fits and waits for room, holding the lock
        assert conn.send_lock.locked() and not first.done()
        second = asyncio.ensure_future(send(conn, small, []))
        reading = asyncio.ensure_future(asyncio.to_thread(
            lambda: [got.append(_whole_answer(peer)) for _ in range(2)]))
        await asyncio.wait_for(asyncio.gather(first, second, reading), 10)
        await send(conn, small, [])  # the socket free again: in one send
        got.append(_whole_answer(peer))

    asyncio.run(main())
    assert [r.call_id for r in got] == [1, 2, 2]
    assert got[0].reply.response == b"x" * (1 << 20) and got[1].reply.response == b"y"


def test_a_fast_lane_serves_the_frames_it_takes_and_leaves_the_rest_to_the_reader(
        pair: Any) -> None:
    """``Conn.fast_lane``: while the reader waits for bytes, the frames the bytes just read
    complete are offered to the lane in the socket's callback; what it takes never wakes
    the reader, a frame it leaves (False) reaches the reader whole and in order, and a
    part of a frame waits for the rest."""
    from kvtierd.session_channel.framing import frame_bytes, read_frame, take_frame

    daemon, peer = pair
    served: list[bytes] = []

    def frame(body: bytes) -> bytes:
        return FRAME_LEN.pack(len(body)) + body

    async def main() -> list[bytes]:
        conn = Conn(daemon, 1 << 20)

        def lane() -> bool:
            while (need := frame_bytes(conn.buf)) and len(conn.buf) >= need:
                if not bytes(conn.buf[FRAME_LEN.size:need]).startswith(b"call"):
                    return False
                served.append(take_frame(conn.buf, need))
            return True

        conn.fast_lane = lane
        got: list[bytes] = []

        async def reader() -> None:
            while True:
                got.append(await read_frame(conn, 1 << 20))

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0.01)
        peer.sendall(frame(b"call 1") + frame(b"call 2"))
        await asyncio.sleep(0.05)
        assert served == [b"call 1", b"call 2"] and got == []  # the reader slept on
        whole = frame(b"call 3") + frame(b"open") + frame(b"call 4")
        peer.sendall(whole[:5])  # a part: it waits
        await asyncio.sleep(0.05)
        assert served == [b"call 1", b"call 2"] and got == []
        peer.sendall(whole[5:])
        await asyncio.sleep(0.05)
        task.cancel()
        return got

    got = asyncio.run(main())
    # "open" left to the reader; "call 4" after it, in order (the lane no longer saw it:
    # the reader was not waiting for bytes then).
    assert served == [b"call 1", b"call 2", b"call 3"] and got == [b"open", b"call 4"]
