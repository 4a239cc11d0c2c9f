"""A namespace's client for an engine integration: opened on first use, and again later
while kvtierd cannot be reached.

An engine must never fail or wait on a request because kvtierd is away: it asks for the
client at each use and gets None until the client opens (then it recomputes).  Attempts
are spaced by a delay that starts at ``first_delay`` and doubles up to ``retry_max``, and
drops back after a success.  Once open, the client rides through daemon restarts itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvtier import errors
from kvtier.client import Client


class LazyClient:
    """``connect()`` called at first use and after each spaced-out failure."""

    def __init__(self, connect: Callable[[], Client], *,
                 on_failure: Callable[[BaseException], None],
                 on_open: Callable[[Client], None] | None = None,
                 retry_max: float = 30.0, first_delay: float = 0.5) -> None:
        self._connect, self._on_failure, self._on_open = connect, on_failure, on_open
        self._retry_max, self._first_delay = retry_max, first_delay
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._retry_at = 0.0
        self._delay = first_delay

    def get(self) -> Client | None:
        """The open client, or None while kvtierd cannot be reached."""
        with self._lock:
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._retry_at:
                return None
            try:
                client = self._connect()
            except (errors.KVTierError, OSError) as exc:
                self._retry_at = now + self._delay
                self._delay = min(2 * self._delay, self._retry_max)
                self._on_failure(exc)
                return None
            self._client, self._delay = client, self._first_delay
        if self._on_open is not None:
            self._on_open(client)
        return client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
