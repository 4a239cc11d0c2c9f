"""Doorbells: the pipes a writing session's client rings after it publishes commit
records in its page, and what a ring does.

A ring hands the session and its page to ``commit_from_page`` (the service's:
``KVTierService.commit_from_page`` -> ``Tiering`` -> ``store/fast_path.py``,
where the records are read, checked and committed and the client's futex is
woken).  This module only watches the pipes: it reads them without blocking,
pauses a doorbell rung again and again for nothing, stops watching at end of
file, and rings once more when the session ends.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Final

from kvtierd.shared_index import SessionPage
from kvtierd.store import Session

log = logging.getLogger("kvtierd.session_channel")  # one name for the package's records

#: Rings in a row that find no commit record before a doorbell is paused, and the
#: longest pause (``Doorbells._rung``).
EMPTY_RINGS_BEFORE_PAUSE: Final = 4
EMPTY_RING_PAUSE_MAX: Final = 0.05


def open_pipe() -> tuple[int, int]:
    """A new doorbell: (read end, kept by the daemon; write end, sent to the client).

    Both ends are non-blocking, and each is its own open file description, so
    nothing the client does to its end changes the daemon's (``Doorbells._rung``)."""
    return os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)


class Doorbells:
    """The read ends of the open sessions' doorbells, watched on the loop."""

    def __init__(self, commit_from_page: Callable[[Session, SessionPage], int] | None,
                 served: Callable[[], None] = lambda: None) -> None:
        """``commit_from_page``: run on each ring; None: no session gets a doorbell.
        ``served``: called after each ring that found records (``BusyPoll.active``)."""
        self.commit_from_page = commit_from_page
        self._served = served
        #: Session id -> the read end of the pipe its client rings after publishing
        #: commit records (the write end went to the client; see ``_rung``).
        self._bells: dict[int, int] = {}
        #: Session id -> rings in a row that found no record (see ``_rung``).
        self._empty_rings: dict[int, int] = {}

    def watch(self, session: Session, page: SessionPage, bell: int) -> None:
        """Watch ``bell`` (a read end from ``open_pipe``; this now owns it) for ``session``."""
        self._bells[session.id] = bell
        asyncio.get_running_loop().add_reader(bell, self._rung, session, page, bell)

    def close(self, session: Session, page: SessionPage | None) -> None:
        """The session is ending: stop watching and close its doorbell, then commit
        what its page still holds (records the client published before it went)."""
        bell = self._bells.pop(session.id, None)
        self._empty_rings.pop(session.id, None)
        if bell is not None:
            asyncio.get_running_loop().remove_reader(bell)
            os.close(bell)
            if page is not None:
                self.ring(session, page)

    def _rung(self, session: Session, page: SessionPage, bell: int) -> None:
        """A writer rang: commit what its page holds (on the loop, from the reader).

        The doorbell is a pipe whose read end only the daemon holds, non-blocking:
        the client got the write end, a different open file description, so
        nothing it does to its fd (``F_SETFL`` clearing ``O_NONBLOCK``, draining,
        closing) can make this read block.  (It was an eventfd shared by ``dup``:
        a client that cleared ``O_NONBLOCK`` on it and drained it hung the loop.)
        A ring is any bytes; one read drains up to 64 KiB of them, however many
        rings that was.  End of file (the client closed its write end) stops the
        watching: commits the page holds then wait for the session's end."""
        try:
            data = os.read(bell, 1 << 16)
        except BlockingIOError:
            return  # rung and answered already
        except OSError as exc:
            log.warning("doorbell of session %d failed: %s", session.id, exc)
            data = b""
        if not data:
            self._silence(session.id)
            return
        if self.ring(session, page):
            self._empty_rings.pop(session.id, None)
            self._served()
            return
        # A client rings after publishing records, so a ring that finds none is rare
        # for an honest one (its records went with the ring before).  Rings in a row
        # that find none are a client ringing for nothing: its doorbell is left
        # unwatched for a while (1 ms, doubling to EMPTY_RING_PAUSE_MAX), so ringing
        # in a loop costs the daemon a bounded number of wakeups per second.
        empty = self._empty_rings.get(session.id, 0) + 1
        self._empty_rings[session.id] = empty
        if empty >= EMPTY_RINGS_BEFORE_PAUSE:
            loop = asyncio.get_running_loop()
            loop.remove_reader(bell)
            pause = min(0.001 * 2 ** (empty - EMPTY_RINGS_BEFORE_PAUSE), EMPTY_RING_PAUSE_MAX)
            loop.call_later(pause, self._rewatch, session, page, bell)

    def _rewatch(self, session: Session, page: SessionPage, bell: int) -> None:
        if self._bells.get(session.id) == bell and not session.closed:
            asyncio.get_running_loop().add_reader(bell, self._rung, session, page, bell)

    def _silence(self, session_id: int) -> None:
        """Stop watching a doorbell whose write end is gone (EOF would be ready forever)."""
        bell = self._bells.get(session_id)
        if bell is not None:
            asyncio.get_running_loop().remove_reader(bell)

    def ring(self, session: Session, page: SessionPage) -> int:
        """Commit what the page holds; the number of records found."""
        if session.closed or self.commit_from_page is None:
            return 0
        try:
            return self.commit_from_page(session, page)
        except Exception:  # never the loop's end: the page is the client's input
            log.exception("commits from session %d's page failed", session.id)
            return 1  # not an empty ring: its doorbell is not paused for it
