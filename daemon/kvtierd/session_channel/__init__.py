"""The session channel: a Unix stream socket that opens sessions and passes fds.

A client connects once, declares its namespace (``OpenSession``), and gets a
session token plus the namespace's segment file descriptors (``SCM_RIGHTS``);
later ``MapSegments`` requests fetch fds of extents added since.  The peer's
pid/uid/gid come from ``SO_PEERCRED``, and access is decided before any fd
moves.  The open connection *is* the session's liveness: when it closes (the
client exited, crashed or was SIGKILLed) the session's leases are released
and its reservations aborted at once.  Once a session is open, the same
connection carries ``KVTier`` calls as ``FastCall`` frames (the fast path),
and with it on the session gets the namespace's shared index, a page of its
own and, for a writer, a doorbell it rings after publishing commit records in
that page.

The parts (calls go down the table, never up):

================  ==========================================================
``channel``       ``SessionChannel``: the listening socket, one task per
                  connection reading its requests (once a session is open,
                  FastCalls that arrive while it waits start in the socket's
                  callback: ``Conn.fast_lane``), the session's end
``handshake``     OpenSession / OpenAdmin / MapSegments: the declaration,
                  access and session limits, what ``SessionOpened`` carries
``fast_calls``    a FastCall served with the gRPC method's handler, its
                  deadline, and its answer
``pages``         the sessions' pages the daemon keeps: hazard shares, the
                  lookup counters folded into client-reported figures
``doorbell``      the writers' doorbell pipes: watching, a ring handed to
                  ``commit_from_page``, pausing rings that find nothing
``framing``       one connection's bytes: frames in (size limits,
                  back-pressure, the fast lane's hook), frames and fds out
================  ==========================================================

Where the rest of a write without a call happens: the page layout and its
commit ring are ``kvtierd.shared_index.SessionPage`` (over ``csrc/writes.c``,
which copies each record out and checks it against the session's grants);
``store/fast_path.py: FastPath.commit_from_page`` commits the records through
the store's one commit transition and answers them in the page, waking the
writer.  ``docs/architecture.md`` section 2.3 walks it step by step.
"""

from kvtierd.session_channel.channel import SessionChannel
from kvtierd.session_channel.doorbell import EMPTY_RING_PAUSE_MAX, EMPTY_RINGS_BEFORE_PAUSE
from kvtierd.session_channel.fast_calls import MAX_CALLS_IN_FLIGHT
from kvtierd.session_channel.framing import MAX_FRAME, MAX_OPEN_FRAME, MAX_REQUEST_FRAME
from kvtierd.session_channel.handshake import HANDSHAKE_TIMEOUT, validate_decl

__all__ = [
    "EMPTY_RINGS_BEFORE_PAUSE",
    "EMPTY_RING_PAUSE_MAX",
    "HANDSHAKE_TIMEOUT",
    "MAX_CALLS_IN_FLIGHT",
    "MAX_FRAME",
    "MAX_OPEN_FRAME",
    "MAX_REQUEST_FRAME",
    "SessionChannel",
    "validate_decl",
]
