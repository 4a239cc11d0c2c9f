"""Saturating totals: the daemon's counts never outgrow the fields that carry them.

Some counts add what clients report (the session pages' lookups, hits and bytes
leased without a call).  Those steps are bounded where they are read
(``SessionPage.take``), and every total they feed stops at ``COUNTER_CAP``: each
int64 and uint64 field that carries it (``Stats``' protobufs, Prometheus'
exposition) holds that, so no sum can make ``Stats`` or a scrape fail.
"""

from __future__ import annotations

from typing import Final

#: Where a total stops growing (the largest int64).
COUNTER_CAP: Final = (1 << 63) - 1


def saturating_add(total: int, step: int) -> int:
    """``total + step``, at most ``COUNTER_CAP`` (a step below 0 adds nothing)."""
    return min(total + max(step, 0), COUNTER_CAP)
