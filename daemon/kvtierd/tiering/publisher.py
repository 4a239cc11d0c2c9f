"""Write-through: every committed block published to the cross-host tiers.

With ``shared_write: commit`` (or ``cluster.write: commit``) a commit also
publishes its blocks at once to every such tier, best effort: when
``queue_depth`` publishes are in flight, further ones are skipped and
counted.  (``shared_write: demotion`` publishes only what the tier above
evicts: the demoter's hand-offs.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvtierd.spill.tier import WritesMany
from kvtierd.store import Block, Lower
from kvtierd.tiering.common import Copy
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

    def committed(self, blocks: Sequence[Block]) -> None:
        """Start publishing a commit's blocks (event loop)."""
        if not self._tiers or not blocks:
            return
        # Bounded by queue_depth blocks in flight; a commit that finds none in flight
        # is published whole (one batch: a commit cut at queue_depth would leave a
        # consumer on another host waiting for blocks that never come).
        publishing = self._ctx.moves.publishing()
        room = self._ctx.below.policy.queue_depth - publishing if publishing else len(blocks)
        if room < len(blocks):
            self._ctx.report.counters.skipped_publishes += len(blocks) - max(room, 0)
            blocks = blocks[: max(room, 0)]
        if blocks:
            self._ctx.moves.will_publish(blocks)
            self._ctx.work.spawn(self._publish(list(blocks)))

    async def _publish(self, blocks: list[Block]) -> None:
        """Copy a commit's blocks into every write-through tier: one ``write_many`` (one
        worker job) for a tier that takes batches, one ``write`` per block otherwise."""
        copier, run = self._ctx.copier, self._ctx.work.run
        with self._ctx.moves.publishing_blocks(blocks):
            jobs: list[Any] = []
            for t in self._tiers:
                if t.tier in self._many:
                    jobs.append(run(copier.copy_down_many, blocks, t, "publish"))
                else:
                    jobs.extend(run(copier.copy_down, b, t, "publish") for b in blocks)
            done = await asyncio.gather(*jobs)
            results: list[list[bool | Copy]] = []  # per tier, per block
            at = 0
            for t in self._tiers:
                if t.tier in self._many:
                    results.append(done[at])
                    at += 1
                else:
                    results.append(done[at : at + len(blocks)])
                    at += len(blocks)
            first = self._ctx.below.lower[0]  # where demotion would have put it
            for i, block in enumerate(blocks):
                for tier, res_t in zip(self._tiers, results, strict=True):
                    res = res_t[i]
                    if res is Copy.SLOT_FAULT:
                        copier.lose(block, "publish")
                    elif res and tier is first:
                        self._ctx.store.set_lower(block, Lower.CLEAN)
