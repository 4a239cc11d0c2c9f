"""Answers from shared memory, without a call to the daemon.

The shared index (``csrc/index.c``) answers lookups and acquires, the slots
the daemon granted ahead answer reserves, and the page's commit ring carries
commits (``csrc/writes.c``).  Each answer here is None when shared memory
cannot give it (no index mapped, the session not quiet, a limit reached); the
operation then makes the call instead.

Both transports run an operation's ``LookHere``, ``GrantHere`` and
``CommitHere`` steps through one :class:`SharedMemoryAnswers`; it reads the
client's current session (its mappings and link, replaced on reconnect) each
time, as ``ReservationState`` and ``LeaseState`` do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier import _index
from kvtier._core import (
    ClientCore,
    CommitHere,
    KeyStatus,
    LocalAcquire,
    LocalReserve,
    LookHere,
    session_lost,
)
from kvtier._index import MAX_KEY_BYTES
from kvtier._session import SessionLink
from kvtier.errors import DeadlineExceeded


class SharedMemoryAnswers:
    """A client's lookups, acquires, reserves and commits through shared memory."""

    def __init__(self, core: ClientCore[Any, Any]) -> None:
        self._core = core

    def look(self, keys: Sequence[bytes]) -> tuple[bytes, bool] | None:
        """A lookup in the shared index (None: it cannot answer, ask the daemon).

        Needs no lock: it reads the current session's mappings once, and a table
        another thread unmaps meanwhile answers None."""
        index = self._core._maps.index
        link = self._core._link
        if index is None or link is None or self._core._closed or not link.quiet():
            return None
        return index.lookup(keys if type(keys) is list else list(keys))

    def lease(self, keys: Sequence[bytes]) -> LocalAcquire | None:
        """An acquire answered from the shared index (None: ask the daemon)."""
        index = self._core._maps.index
        link = self._core._link
        if (index is None or link is None or self._core._closed or not self._core.local_leases
                or not link.quiet()):
            return None
        got = index.acquire(keys if type(keys) is list else list(keys))
        if got is None:
            return None
        slots, at, serial = got
        return LocalAcquire(index, at, slots, lease_id=serial if slots else 0,
                            segments_version=self._core._maps.version)

    def grant(self, keys: Sequence[bytes]) -> LocalReserve | None:
        """A reserve answered from the slots granted ahead (None: call Reserve).  Keys
        the shared index holds are EXISTS, as a Reserve would say; one that another
        writer is writing, or commits first, is EXISTS at commit instead."""
        index = self._core._maps.index
        link = self._core._link
        writes = None if index is None else index.writes
        if (writes is None or index is None or link is None or self._core._closed
                or not self._core.local_writes or self._core._maps.read_only or not link.quiet()):
            return None
        keys = keys if type(keys) is list else list(keys)
        n = len(keys)
        if self._core._open_reservations >= writes.max_reservations:
            return None  # the call refuses, with the limit's message
        if (not 0 < n <= index.max_keys or len(set(keys)) != n
                or min(map(len, keys)) < 1 or max(map(len, keys)) > MAX_KEY_BYTES):
            return None  # the call says what is wrong
        present = index.present_many(keys)  # one native call, under the table's seqlock
        want = present.count(0)
        statuses = ([KeyStatus.RESERVED] * n if want == n else
                    [KeyStatus.EXISTS if p else KeyStatus.RESERVED for p in present])
        grants = _index.NO_GRANTS
        if want:
            try:
                got = writes.take_columns(want, self._core._maps.slot_bytes)
            except ValueError:  # the page was unmapped (the session was replaced)
                return None
            if got is None:
                return None
            grants = got
        return LocalReserve(writes, statuses, grants, self._core._maps.version, self._core.block_bytes)

    def commit(self, step: CommitHere) -> bytes:
        """Publish a reservation's commit records in the page and wait for the results."""
        return self.commit_wait(self.commit_start(step))

    def commit_start(self, step: CommitHere) -> tuple[CommitHere, SessionLink, Any]:
        """``commit``'s publish and ring (the handle for ``commit_wait``,
        which must follow: the page's ring is held until then)."""
        link = self._core._link
        if step.session_gen != self._core._session_gen or link is None:
            raise session_lost("reservation")
        try:
            return step, link, step.writes.publish(step.records)
        except ValueError:  # the page was unmapped
            raise session_lost("reservation") from None

    def commit_wait(self, started: tuple[CommitHere, SessionLink, Any]) -> bytes:
        """``commit``'s wait for the daemon's results (blocking, GIL released)."""
        step, link, ticket = started
        try:
            return step.writes.wait(ticket, lambda: not link.hung_up(), self._core.timeout)
        except (ConnectionError, ValueError):  # the daemon went, or the page was unmapped
            raise session_lost("reservation") from None
        except TimeoutError as exc:
            raise DeadlineExceeded(str(exc)) from None

    def answer(self, step: LookHere) -> Any:
        """A ``LookHere`` step's answer: ``lease`` or ``look``."""
        return self.lease(step.keys) if step.lease else self.look(step.keys)

    def index_stale(self) -> bool:
        """Whether the daemon replaced the shared index this session maps."""
        index = self._core._maps.index
        return index is not None and index.superseded
