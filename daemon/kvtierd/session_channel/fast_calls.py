"""FastCalls: ``kvtier.v1.KVTier`` calls carried on the session connection.

Once a session is open, a ``FastCall`` frame carries a ``KVTier`` call
(``Acquire``, ``Reserve``, ...) on the session connection instead of gRPC: the
daemon serves it with the very handler that serves the gRPC method
(``service.methods``), as this connection's own session, and answers with a
``FastReply`` or a ``SessionError`` that names the call (``call_id``) and
leaves the connection open.  Calls run concurrently (at most
:data:`MAX_CALLS_IN_FLIGHT` per connection; past that the daemon reads no
further frame until one ends) and may be answered out of order; ``no_reply``
calls (a Release) are never answered.  When the connection ends, its calls
still running are cancelled before the session is closed.

A call starts at once (``start_call``), in the socket's callback when the frame
arrived while the connection's reader waited for bytes (``Conn.fast_lane``), else
in the reader's turn of the loop: most calls (a delete of keys in DRAM, a lease, a
stats read) never wait for anything, and are served and answered there, without a
task, a second turn of the loop or a wake-up; only a call that waits goes on in a
task of its own from where it waited (its deadline's timer starts then).
"""

from __future__ import annotations

import asyncio
import collections.abc
import logging
from collections.abc import Coroutine, Generator, Mapping
from typing import Any, Final

from kvtier.errors import (
    CapacityExhausted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVTierError,
    status_of,
)
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.service import FastCallFailed, FastContext, Method
from kvtierd.session_channel.framing import MAX_REQUEST_FRAME, Conn, error_frame, send

log = logging.getLogger("kvtierd.session_channel")  # one name for the package's records

#: FastCalls one connection may have running at once; the next frame is read
#: when one ends (a client cannot make the daemon hold unbounded work).
MAX_CALLS_IN_FLIGHT: Final = 64
#: FastCalls that never wait one connection's reader serves in a row before it gives the
#: loop up (the other clients' turn; ~16 x 40 us of a 1-key delete each at most).
CALLS_PER_TURN: Final = 16
#: Room a FastCall frame needs beyond its request message (method name, ids, tags).
_CALL_OVERHEAD: Final = 4096


def max_call_bytes(max_message_bytes: int) -> int:
    """The longest FastCall request: ``max_message_bytes`` (as a gRPC one), within
    the frame limit."""
    return min(max_message_bytes, MAX_REQUEST_FRAME - _CALL_OVERHEAD)


class _Runner:
    """The task a call goes on in once it waits (None while it runs in the reader's
    turn: nothing can expire or cancel it then, no callback runs), and its deadline's
    timer, started then (a call that never waits needs none)."""

    __slots__ = ("task", "timer", "expired")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.expired = False

    def expire(self) -> None:
        """The call's deadline fell due: cancel its task (``serve_call`` answers it)."""
        if self.task is not None:
            self.expired = True
            self.task.cancel()


class _Rest(collections.abc.Coroutine):  # type: ignore[type-arg]
    """A call's coroutine from where it first waited (``waiting``: what it yielded to
    the loop), as a coroutine of its own for the task that goes on with it: its first
    step yields ``waiting`` again, every later one is the call's.  What the task throws
    in -- its cancellation, even before its first step (a deadline that fell due in the
    same turn, a connection closing) -- goes into the call, which answers it; a task
    around ``await`` of the call would drop a cancellation that comes before its first
    step, and the call with it, unanswered."""

    __slots__ = ("_coro", "_waiting", "_started")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting: Any) -> None:
        self._coro = coro
        self._waiting: Any = waiting
        self._started = False

    def send(self, value: Any) -> Any:
        if not self._started:
            self._started = True
            waiting, self._waiting = self._waiting, None
            return waiting
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._started, self._waiting = True, None
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)  # (the old three-argument form)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, Any, None]:
        raise TypeError("a FastCall's rest runs as a task's coroutine, not awaited")


def start_call(methods: Mapping[str, Method] | None, max_bytes: int, conn: Conn,
               token: str, call_id: int, call: pb.FastCall) -> asyncio.Task[None] | None:
    """``serve_call``, started at once: as far as it goes without waiting (for most
    calls, all of it: the answer is sent by the time this returns None), then in a
    task of its own, returned.  A bug that escapes the call is logged here, as a
    task's would be (the call answers every error a client can cause itself)."""
    runner = _Runner()
    coro = serve_call(methods, max_bytes, conn, token, call_id, call, runner)
    started = conn.loop.time() if call.timeout_ms else 0.0
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    except Exception:
        log.exception("session channel: call %d (%s) failed", call_id, call.method[:64])
        return None
    runner.task = conn.loop.create_task(_Rest(coro, waiting))
    if call.timeout_ms:  # (a timer, not wait_for's second task per call)
        runner.timer = conn.loop.call_at(started + call.timeout_ms / 1000, runner.expire)
    return runner.task


async def serve_call(methods: Mapping[str, Method] | None, max_bytes: int, conn: Conn,
                     token: str, call_id: int, call: pb.FastCall, runner: _Runner) -> None:
    """Serve one FastCall with the gRPC method's own handler (``methods``: the
    service's; None: the fast path is off) as the session ``token``; answer unless
    no_reply.  ``runner``: the task it goes on in once it waits (``start_call``)."""
    try:
        if methods is None:
            raise FailedPrecondition("the fast path is off on this daemon "
                                     "(server.fast_path: false): use gRPC")
        method = methods.get(call.method)
        if method is None:
            raise InvalidArgument(f"FastCall of an unknown method {call.method[:64]!r}")
        if len(call.request) > max_bytes:
            raise CapacityExhausted(
                f"{call.method} request of {len(call.request)} bytes exceeds the fast "
                f"path's {max_bytes} (server.max_message_bytes): send it over gRPC")
        work = method.handler(method.parse(call.request), FastContext(token))
        # The deadline cancels the call's task: its timer starts once the call waits,
        # from the call's start (``start_call``); it can only fire then, in the task.
        try:
            resp = await work
        except asyncio.CancelledError:
            if not runner.expired:
                raise  # the connection is closing
            assert runner.task is not None
            runner.task.uncancel()
            raise DeadlineExceeded(
                f"{call.method} did not finish within {call.timeout_ms} ms") from None
        finally:
            if runner.timer is not None:
                runner.timer.cancel()
        out = pb.SessionResponse(call_id=call_id,
                                 reply=pb.FastReply(response=method.serialize(resp)))
    except FastCallFailed as exc:
        out = error_frame(call_id, exc.code.value[0], exc.details)
    except KVTierError as exc:
        out = error_frame(call_id, status_of(exc).value[0], str(exc))
    if call.no_reply:
        return
    try:
        await send(conn, out, [])
    except OSError as exc:  # the peer is gone: the read loop ends the session
        log.debug("session channel: answer to call %d not sent: %s", call_id, exc)
