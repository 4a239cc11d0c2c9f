"""Default filesystem locations shared by the client and the daemon.

Both sides must agree on where the sockets live without reading the daemon's
config, so the rule is here, in one place: ``KVTIER_SOCKET_DIR`` if set and
non-empty, else ``$XDG_RUNTIME_DIR/kvtier`` (if set and non-empty), else ``/tmp/kvtier-<uid>``.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping
from typing import Final

#: File name of the gRPC control-plane socket inside the socket directory.
GRPC_SOCKET_NAME: Final = "kvtier.sock"
#: File name of the session (fd-passing) socket inside the socket directory.
SESSION_SOCKET_NAME: Final = "kvtier-session.sock"


def default_socket_dir(env: Mapping[str, str] | None = None) -> str:
    """Return the directory that holds the daemon's sockets.

    ``env`` defaults to ``os.environ``; pass a mapping to resolve the rule
    for another environment (tests, the config loader's injected env).
    """
    if env is None:
        env = os.environ
    explicit = env.get("KVTIER_SOCKET_DIR", "")
    if explicit:
        return explicit
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime:
        return os.path.join(runtime, "kvtier")
    return f"/tmp/kvtier-{os.getuid()}"


def default_shm_dir(instance: str) -> str:
    """Return the directory under ``/dev/shm`` for one daemon instance's segments."""
    return f"/dev/shm/kvtier-{os.getuid()}-{instance}"


def explain_unreachable(path: str, cause: BaseException | None = None) -> str:
    """Why nothing answers on the daemon socket ``path``, and where it was looked for."""
    where = (f"the socket directory {os.path.dirname(path)!r} comes from --socket or "
             "socket_dir, else $KVTIER_SOCKET_DIR, $XDG_RUNTIME_DIR/kvtier, /tmp/kvtier-$UID; "
             "a container needs it mounted")
    if not os.path.exists(path):
        return f"kvtierd is not running, or not here: {path} does not exist ({where})"
    if cause is None:  # e.g. gRPC said UNAVAILABLE: ask the socket itself why
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError as exc:
            cause = exc
        finally:
            probe.close()
    code = getattr(cause, "errno", None)
    if code == errno.ECONNREFUSED:
        return (f"kvtierd is not running: {path} exists but nothing listens on it (a daemon "
                "that stopped or was killed leaves its socket); start kvtierd")
    if code in (errno.EACCES, errno.EPERM):
        return (f"no permission to connect to kvtierd at {path} (the daemon's "
                "server.socket_mode decides who may; run as a user it lets in)")
    return f"cannot connect to kvtierd at {path}: {cause or 'no answer'} ({where})"
