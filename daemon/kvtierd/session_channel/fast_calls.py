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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Final

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
#: Room a FastCall frame needs beyond its request message (method name, ids, tags).
_CALL_OVERHEAD: Final = 4096


def max_call_bytes(max_message_bytes: int) -> int:
    """The longest FastCall request: ``max_message_bytes`` (as a gRPC one), within
    the frame limit."""
    return min(max_message_bytes, MAX_REQUEST_FRAME - _CALL_OVERHEAD)


async def serve_call(methods: Mapping[str, Method] | None, max_bytes: int, conn: Conn,
                     token: str, call_id: int, call: pb.FastCall) -> None:
    """Serve one FastCall with the gRPC method's own handler (``methods``: the
    service's; None: the fast path is off) as the session ``token``; answer unless
    no_reply."""
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
        # The deadline cancels this task (a timer, not wait_for's second task per call).
        expired = False
        timer = None
        task = asyncio.current_task()
        assert task is not None
        if call.timeout_ms:

            def expire() -> None:
                nonlocal expired
                expired = True
                task.cancel()

            timer = asyncio.get_running_loop().call_later(call.timeout_ms / 1000, expire)
        try:
            resp = await work
        except asyncio.CancelledError:
            if not expired:
                raise  # the connection is closing
            task.uncancel()
            raise DeadlineExceeded(
                f"{call.method} did not finish within {call.timeout_ms} ms") from None
        finally:
            if timer is not None:
                timer.cancel()
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
