"""Busy polling (``server.busy_poll``): after a commit from a page or a call on the session
socket, the event loop keeps running instead of sleeping in ``epoll_wait``, so the next
ring or call is seen at once.

A daemon asleep in ``epoll_wait`` is woken by the kernel when a client writes its
doorbell or socket; on a virtual machine whose idle vCPU halted, that wake-up alone costs
tens of microseconds, more than the daemon's whole work for a 1-key commit.  While the
loop has a callback ready it polls with a zero timeout, so keeping one callback ready
(``_spin``, rescheduled with ``call_soon``) keeps the loop awake; the loop still runs
everything else in between, and releases the GIL in each poll.  The cost is one core
busy for up to ``window`` seconds after the last activity, so the setting is off by
default: a deployment that wants the latency gives the daemon the core.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable


class BusyPoll:
    """Keeps the running loop awake for ``window`` seconds after each ``active()``."""

    def __init__(self, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``window``: seconds (0: off, ``active`` does nothing)."""
        self.window = window
        self._clock = clock
        self._until = 0.0
        self._spinning = False
        #: Loop iterations spent polling, for tests and the curious.
        self.spins = 0

    @property
    def spinning(self) -> bool:
        return self._spinning

    def active(self) -> None:
        """A commit or call was served: poll for ``window`` seconds more (on the loop)."""
        if not self.window:
            return
        self._until = self._clock() + self.window
        if not self._spinning:
            self._spinning = True
            asyncio.get_running_loop().call_soon(self._spin)

    def _spin(self) -> None:
        if self._clock() < self._until:
            self.spins += 1
            # A client that shares this CPU (the kernel places a woken daemon beside
            # the client that woke it) would otherwise wait for the end of the loop's
            # time slice -- milliseconds -- to publish its next ring.
            os.sched_yield()
            asyncio.get_running_loop().call_soon(self._spin)
        else:
            self._spinning = False
