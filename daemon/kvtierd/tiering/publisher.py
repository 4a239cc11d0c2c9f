"""Write-through: every committed block published to the cross-host tiers.

With ``shared_write: commit`` (or ``cluster.write: commit``) a commit also
publishes its blocks at once to every such tier, best effort: when
``queue_depth`` publishes are in flight, further ones are skipped and
counted.  (``shared_write: demotion`` publishes only what the tier above
evicts: the demoter's hand-offs.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from kvtierd.spill.tier import WritesMany
from kvtierd.store import BlockBatch, Lower
from kvtierd.tiering.common import Copy, outcomes
from kvtierd.tiering.context import Context


class Publisher:
    """Copies each commit's blocks into the write-through tiers."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._tiers = ctx.below.write_through
        #: Those that take a commit's blocks in one ``write_many`` (the cluster tier).
        self._many = {t.tier for t in self._tiers if isinstance(t, WritesMany)}

    @property
    def enabled(self) -> bool:
        """Whether any tier is written through."""
        return bool(self._tiers)

    def committed(self, blocks: BlockBatch) -> None:
        """Start publishing a commit's blocks (event loop)."""
        if not self._tiers or not len(blocks):
            return
        # Bounded by queue_depth blocks in flight; a commit that finds none in flight
        # is published whole (one batch: a commit cut at queue_depth would leave a
        # consumer on another host waiting for blocks that never come).
        publishing = self._ctx.moves.publishing()
        room = self._ctx.below.policy.queue_depth - publishing if publishing else len(blocks)
        if room < len(blocks):
            self._ctx.report.counters.skipped_publishes += len(blocks) - max(room, 0)
            blocks = blocks.take(slice(0, max(room, 0)))
        if len(blocks):
            self._ctx.moves.will_publish(blocks)
            self._ctx.work.spawn(self._publish(blocks))

    async def _publish(self, blocks: BlockBatch) -> None:
        """Copy a commit's blocks into every write-through tier: one ``write_many`` (one
        worker job) for a tier that takes batches, one ``write`` per block otherwise."""
        copier, run = self._ctx.copier, self._ctx.work.run
        n = len(blocks)
        with self._ctx.moves.publishing_blocks(blocks):
            jobs: list[Any] = []
            for t in self._tiers:
                if t.tier in self._many:
                    jobs.append(run(copier.copy_down_many, blocks, t, "publish"))
                else:
                    jobs.extend(run(copier.copy_down, blocks, i, t, "publish") for i in range(n))
            done = await asyncio.gather(*jobs)
            results: list[list[bool | Copy]] = []  # per tier, per block
            at = 0
            for t in self._tiers:
                if t.tier in self._many:
                    results.append(done[at])
                    at += 1
                else:
                    results.append(done[at : at + n])
                    at += n
            first = self._ctx.below.lower[0]  # where demotion would have put it
            faults = np.zeros(n, dtype=bool)
            clean = np.zeros(n, dtype=bool)
            for tier, res_t in zip(self._tiers, results, strict=True):
                fault, made = outcomes(res_t)
                faults |= fault
                if tier is first:
                    clean = made
            if faults.any():
                copier.lose(blocks.take(faults), "publish")  # (gone from DRAM now)
                clean &= ~faults
            if clean.any():
                self._ctx.store.set_lower_many(blocks.take(clean), Lower.CLEAN)
