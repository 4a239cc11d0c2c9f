"""Tiering: the policy that moves blocks between DRAM and the tiers below it.

Call graph: service -> ``Tiering`` (``facade``) -> ``Store`` (DRAM index, pins,
capacity) and the tiers below DRAM (``below``: an ordered list of
``spill.tier.LowerTier``, SSD, then shared, then a cluster tier, which the policy
walks without asking which tiers it has).  Every byte moves on the ``spill``
thread pool, never on the event loop.

The parts, each with its own constructor, share one ``MovementTable``
(``moves``: what is promoting, demoting, publishing, being handed on or
hidden by a Delete/Evict, under one lock):

=============  ==========================================================
``facade``     ``Tiering``: builds the parts, forwards each call; Delete
``promoter``   Lookup (``locate``), prefetch, Acquire's promotions
``demoter``    write-back to the first tier, back-pressure on reserves,
               the hand-offs between the tiers below
``publisher``  write-through of each commit to the cross-host tiers
``admin``      ListKeys, Evict, the KV events' snapshots
``drain``      Drain (marks blocks; the demoter copies them)
``below``      the tiers below DRAM and where a key's copies are
``copies``     the worker-thread copies between DRAM slots and tiers
``moves``      the movement table
``context``    what the parts share (store, tiers, table, copier, pool)
``common``     policy, counters, observer, fault reports, the worker pool
=============  ==========================================================

**A DRAM slot whose memory faults** (a writer truncated its namespace's data
file or punched holes in it: copies and checksums of the slot raise
``OSError(EFAULT)``, ``spill.blockio.memory_fault``) is the writer's loss,
never a fault of a spill tier: a demotion or publish of it drops the block
from DRAM (as a delete does; its copies below stay), a promotion into it
fails (the slot is returned, the key is a miss, the copy below stays); each
is counted in ``counters.slot_faults`` and the observer's ``slot_fault``.
"""

from kvtierd.spill.tier import TIER_CLUSTER, TIER_DRAM, TIER_SHARED, TIER_SSD
from kvtierd.tiering.admin import EvictResult, KeyState
from kvtierd.tiering.common import SpillPolicy, TieringCounters, TieringObserver
from kvtierd.tiering.drain import DrainProgress
from kvtierd.tiering.facade import Tiering
from kvtierd.tiering.moves import MovementTable
from kvtierd.tiering.promoter import MAX_QUEUED_PREFETCHES

__all__ = [
    "MAX_QUEUED_PREFETCHES",
    "TIER_CLUSTER",
    "TIER_DRAM",
    "TIER_SHARED",
    "TIER_SSD",
    "DrainProgress",
    "EvictResult",
    "KeyState",
    "MovementTable",
    "SpillPolicy",
    "Tiering",
    "TieringCounters",
    "TieringObserver",
]
