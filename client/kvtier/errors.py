"""The one kvtier exception hierarchy and its one table of gRPC status codes.

The daemon raises these; its service decorator turns them into a status with
``STATUS_OF`` and the client turns a status back into the same class with
``from_status``.  Callers never see a bare ``grpc.RpcError``.
"""

from __future__ import annotations

import grpc


class KVTierError(Exception):
    """Base class of every error kvtier raises."""


class InvalidArgument(KVTierError):
    """The request is malformed: empty/oversized key lists, bad lengths, ..."""


class NotFound(KVTierError):
    """An unknown reservation or lease (never issued, finished or expired)."""


class CapacityExhausted(KVTierError):
    """No room: the tier is full of leased/reserved blocks, or a limit is hit."""


class FailedPrecondition(KVTierError):
    """The system is not in the state the call needs (e.g. a layout conflict)."""


class SessionLost(FailedPrecondition):
    """A lease or reservation belonged to a session that ended (the daemon restarted).

    A lost lease's views may no longer hold its blocks; a lost reservation
    committed nothing.  The client has already opened a new session.
    """


class Corrupted(KVTierError):
    """Bytes failed their checksum; they are never served.

    ``key`` names the failing block when the client detected it.
    """

    def __init__(self, message: str, key: bytes = b"") -> None:
        super().__init__(message)
        self.key = key


class Unavailable(KVTierError):
    """The daemon cannot be reached (not running, restarting, overloaded)."""


class DeadlineExceeded(Unavailable):
    """The call did not finish within its deadline."""


class PermissionDenied(KVTierError):
    """The caller may not use this namespace or call."""


class Unauthenticated(KVTierError):
    """The session token is missing, unknown or belongs to a closed session."""


class Internal(KVTierError):
    """A bug in kvtier; the message says where.  Please report it."""


#: The one table: each error class and the status code it travels as.
STATUS_OF: dict[type[KVTierError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    CapacityExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Corrupted: grpc.StatusCode.DATA_LOSS,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Internal: grpc.StatusCode.INTERNAL,
}

#: Raised by the client itself, never sent by the daemon: they travel (if ever)
#: as their base class's code, and a code never decodes back to them.
CLIENT_ONLY: tuple[type[KVTierError], ...] = (SessionLost,)

_ERROR_OF: dict[grpc.StatusCode, type[KVTierError]] = {v: k for k, v in STATUS_OF.items()}
# Codes only gRPC itself produces (never the daemon) map onto the nearest class.
_ERROR_OF[grpc.StatusCode.CANCELLED] = Unavailable
_ERROR_OF[grpc.StatusCode.UNKNOWN] = Internal
_ERROR_OF[grpc.StatusCode.UNIMPLEMENTED] = FailedPrecondition

_CODE_BY_VALUE: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def status_of(exc: KVTierError) -> grpc.StatusCode:
    """The status code ``exc`` travels as (its nearest listed base class)."""
    for cls in type(exc).__mro__:
        code = STATUS_OF.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def from_status(code: grpc.StatusCode | int, message: str) -> KVTierError:
    """The exception for a status ``code`` (an enum or its integer value)."""
    if isinstance(code, int):
        code = _CODE_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    return _ERROR_OF.get(code, Internal)(message)


def from_rpc_error(err: grpc.RpcError) -> KVTierError:
    """Translate a ``grpc.RpcError`` (sync or aio) into the hierarchy."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return from_status(code, details or str(code))
