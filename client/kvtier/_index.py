"""The namespace's shared index, mapped here: lookups without a call.

kvtierd publishes each namespace's DRAM keys in a table in shared memory
(``kvtierd.shared_index``; layout and concurrency in ``csrc/index.c``) and
sends it, read-only, with the session.  ``LocalIndex.lookup`` searches it in
native code: a 64-key lookup costs about a microsecond instead of a round
trip to the daemon.  It answers only what the table can: ``None`` when it
cannot (the table was replaced, a key is malformed, more keys than the daemon
takes in one call), and ``final=False`` when a miss may still be a hit below
DRAM; the client then calls ``Lookup`` as before.  What this session looked up
here is added to its lookup counters page, which the daemon reads into its
metrics.
"""

from __future__ import annotations

import mmap
import os
from typing import Final

import numpy as np

from kvtier import _accel

try:
    from kvtier import _native
except ImportError:  # not built: the client calls Lookup
    _native = None  # type: ignore[assignment]

#: Whether this build can search a shared index.
AVAILABLE: Final = _native is not None and _accel.NATIVE
#: The header's flags word (csrc/index.h).
SUPERSEDED: Final = 1
COUNTERS_BYTES: Final = 4096


class LocalIndex:
    """The shared index's table mapped read-only, and this session's counters page."""

    def __init__(self, index_fd: int, counters_fd: int, max_keys: int) -> None:
        """Maps both (the fds stay the caller's to close)."""
        self.max_keys = max_keys
        self._table = _map_table(index_fd)
        try:
            self._page = mmap.mmap(counters_fd, COUNTERS_BYTES, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._table.close()
            raise
        self._counters = np.frombuffer(self._page, dtype=np.uint64, count=3)

    def lookup(self, keys: list[bytes]) -> tuple[bytes, bool] | None:
        """The tiers of the leading keys present, and whether the first miss is final
        (no tier below DRAM may hold it); None when the table cannot answer."""
        if not 0 < len(keys) <= self.max_keys:
            return None
        try:
            return _native.index_lookup(self._table, keys, self._counters)
        except ValueError:  # closed by another thread (the session was replaced)
            return None

    @property
    def superseded(self) -> bool:
        """The daemon replaced this table: ``replace`` it with the new one's fd."""
        return bool(_native.index_info(self._table)[3] & SUPERSEDED)

    def replace(self, index_fd: int) -> None:
        new = _map_table(index_fd)
        old, self._table = self._table, new
        try:
            old.close()
        except BufferError:
            pass  # a lookup in another thread still holds it; it goes with it

    def close(self) -> None:
        self._counters = np.zeros(3, dtype=np.uint64)  # drop the view of the page
        for mm in (self._table, self._page):
            try:
                mm.close()
            except BufferError:
                pass  # a lookup in another thread still holds it; it goes with it


def _map_table(fd: int) -> mmap.mmap:
    size = os.fstat(fd).st_size
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
