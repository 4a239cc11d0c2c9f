"""sd_notify: tell systemd READY=1 / STOPPING=1 / STATUS=... (no-op without NOTIFY_SOCKET)."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)
_warned = False


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to ``$NOTIFY_SOCKET``; False when not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):  # abstract namespace socket
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(state.encode())
    except OSError as exc:
        global _warned
        if not _warned:  # a broken NOTIFY_SOCKET must not take the daemon down
            log.warning("cannot notify systemd at %r: %s", os.environ.get("NOTIFY_SOCKET"), exc)
            _warned = True
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of ``$WATCHDOG_USEC``), or None when off.

    Honors ``$WATCHDOG_PID``: the pings are only for the process systemd named.
    """
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    try:
        return max(int(usec) / 2e6, 0.01)
    except ValueError:
        return None
