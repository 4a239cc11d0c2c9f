"""Default filesystem locations shared by the client and the daemon.

Both sides must agree on where the sockets live without reading the daemon's
config, so the rule is here, in one place: ``KVTIER_SOCKET_DIR`` if set and
non-empty, else ``$XDG_RUNTIME_DIR/kvtier`` (if set and non-empty), else ``/tmp/kvtier-<uid>``.
"""

from __future__ import annotations

import os
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
