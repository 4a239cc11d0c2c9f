"""sd_notify: tell systemd READY=1 / STOPPING=1 / STATUS=... (no-op without NOTIFY_SOCKET)."""

from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to ``$NOTIFY_SOCKET``; False when not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):  # abstract namespace socket
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(addr)
        sock.sendall(state.encode())
    return True
