"""The daemon's totals, and what clients report about themselves without a call.

**Saturating totals.**  Every total stops at ``COUNTER_CAP``: each int64 and
uint64 field that carries it (``Stats``' protobufs, Prometheus' exposition) holds
that, so no sum can make ``Stats`` or a scrape fail.

**Client-reported figures.**  A session's page (``kvtierd.shared_index.SessionPage``)
carries counters its client writes: the lookups it answered from the shared index,
its acquires without a call, their hit and missed keys, the bytes it leased.  The
daemon did none of that and cannot check it, so it never reaches a host-wide
figure (``Stats.io``, ``kvtier_hit_blocks``, a namespace's ``hits``): it is kept
per namespace, apart, and labelled as the clients' (``ClientReported``: ``Stats``'
``NamespaceStats.client_reported``, the ``kvtier_client_reported_*`` series, ``kvtier
top``'s client-reported table).  It is bounded twice (``docs/security.md``):

* per session and take, by what one client could have done (``SessionPage.take``:
  hits and misses at most ``max_keys_per_call`` per call counted, bytes at most
  ``block_bytes`` per acquired block, calls and keys per second of one process);
* per namespace and fold, by what the whole host could physically do in the time
  since the namespace's last fold (``ClientReported.add``: the ``HOST_*``
  ceilings below; hits at most the namespace's slots per call, bytes at most
  ``block_bytes`` per hit), so the namespace's totals never exceed the ceilings
  times the seconds since it began counting, however many sessions report.
"""

from __future__ import annotations

import dataclasses
from typing import Final

#: Where a total stops growing (the largest int64).
COUNTER_CAP: Final = (1 << 63) - 1

#: Bytes the clients of one namespace can read per second, all of them together: the
#: host's memory bandwidth, rounded up well past today's largest two-socket hosts (24
#: channels of DDR5-6400 peak at 1.2 TB/s): 2 TiB/s.
HOST_READ_BYTES_PER_SECOND: Final = 2 << 40
#: Keys (hit or missed, by lookups and acquires each) a namespace's clients can search
#: per second: each is a hash probe of tens of nanoseconds; 2^30 is 4 M a second on
#: each of 256 cores.
HOST_KEYS_PER_SECOND: Final = 1 << 30
#: Lookups or acquires a namespace's clients can make per second (each costs a fence
#: and a probe at least): 2^20 a second on each of 256 cores.
HOST_CALLS_PER_SECOND: Final = 1 << 28


def saturating_add(total: int, step: int) -> int:
    """``total + step``, at most ``COUNTER_CAP`` (a step below 0 adds nothing)."""
    return min(total + max(step, 0), COUNTER_CAP)


@dataclasses.dataclass(slots=True)
class ClientReported:
    """What a namespace's clients reported doing without a call (their pages' counters),
    as the daemon believed it: bounded, never verified, never added to a host-wide
    figure.  ``since``: when the namespace began counting (the clock of ``add``)."""

    since: float
    lookups: int = 0
    lookup_hits: int = 0
    lookup_misses: int = 0
    acquires: int = 0
    acquire_hits: int = 0
    acquire_misses: int = 0
    read_bytes: int = 0
    #: Folds in which a reported step was cut to a bound (a client that lies, or a bug).
    cut: int = 0
    #: When the last fold was added (``add``'s budget is the time since).
    last: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.last = self.since

    def add(self, steps: tuple[int, ...], now: float, *, slots: int,
            block_bytes: int) -> tuple[int, ...]:
        """Add one fold's steps of the namespace's pages (lookups, lookup hits, lookup
        misses, acquires, acquire hits, acquire misses, bytes; each already cut per
        session by ``SessionPage.take``), each cut to what the host could have done
        since the last fold: calls to ``HOST_CALLS_PER_SECOND``, keys to
        ``HOST_KEYS_PER_SECOND`` and bytes to ``HOST_READ_BYTES_PER_SECOND`` times
        the seconds since; hits to ``slots`` (the namespace's blocks) per call, bytes
        to ``block_bytes`` per acquired block.  So every total stays within its
        ceiling times ``now - since``.  Returns what was added."""
        lookups, hits, misses, acquires, got, missed, nbytes = (max(s, 0) for s in steps)
        span = max(now - self.last, 0.0)
        self.last = max(now, self.last)
        calls = int(HOST_CALLS_PER_SECOND * span)
        keys = int(HOST_KEYS_PER_SECOND * span)
        c_lookups, c_acquires = min(lookups, calls), min(acquires, calls)
        c_hits = min(hits, keys, c_lookups * slots)
        c_misses = min(misses, keys - c_hits)
        c_got = min(got, keys, c_acquires * slots)
        c_missed = min(missed, keys - c_got)
        c_bytes = min(nbytes, int(HOST_READ_BYTES_PER_SECOND * span), c_got * block_bytes)
        added = (c_lookups, c_hits, c_misses, c_acquires, c_got, c_missed, c_bytes)
        if added != (lookups, hits, misses, acquires, got, missed, nbytes):
            self.cut = saturating_add(self.cut, 1)
        self.lookups = saturating_add(self.lookups, c_lookups)
        self.lookup_hits = saturating_add(self.lookup_hits, c_hits)
        self.lookup_misses = saturating_add(self.lookup_misses, c_misses)
        self.acquires = saturating_add(self.acquires, c_acquires)
        self.acquire_hits = saturating_add(self.acquire_hits, c_got)
        self.acquire_misses = saturating_add(self.acquire_misses, c_missed)
        self.read_bytes = saturating_add(self.read_bytes, c_bytes)
        return added
