"""Lookup across the tiers, and promotion into DRAM.

``acquire`` of a key that only a lower tier holds reserves a DRAM slot for it
(system session), reads the block into the slot, verifies its checksum and
commits it CLEAN, then leases it like any DRAM block.  ``lookup`` reports each
hit's tier and, with ``prefetch``, starts those promotions in the
background.  Concurrent promotions of one key share one read (the movement
table).  A promotion into a slot whose memory faults fails: the slot is
returned, the key is a miss, the copy below stays.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Final

import numpy as np

from kvtier.errors import CapacityExhausted
from kvtierd.block_table import PREFETCHED
from kvtierd.spill.tier import TIER_DRAM
from kvtierd.store import AcquireResult, BlockBatch, Lower, Namespace, ReserveStatus, Session
from kvtierd.tiering.common import Copy
from kvtierd.tiering.context import Context
from kvtierd.tiering.copies import ReadOutcome
from kvtierd.tiering.demoter import Demoter

#: Prefetches running at once (each is one promotion of a run of keys).
MAX_PREFETCHES: Final = 16
#: Prefetches waiting for one of those at most; a Lookup beyond it does not prefetch.
MAX_QUEUED_PREFETCHES: Final = 256


class Promoter:
    """Where each key is (``locate``), and bringing keys below DRAM into it."""

    def __init__(self, ctx: Context, demoter: Demoter) -> None:
        """``demoter``: whose back-pressure a promotion's reserve waits on."""
        self._ctx = ctx
        self._demoter = demoter
        self._prefetch_slots = asyncio.Semaphore(MAX_PREFETCHES)
        self.queued_prefetches = 0

    async def lookup(self, session: Session, keys: Sequence[bytes], *,
                     prefetch: bool = False) -> list[int]:
        """The tier of each key of the longest prefix present in any tier."""
        ns = session.ns
        tiers = await self.locate(ns, keys)
        lower = [k for k, t in zip(keys, tiers, strict=False) if t != TIER_DRAM]
        if prefetch and lower:
            counters = self._ctx.report.counters
            if self.queued_prefetches >= MAX_QUEUED_PREFETCHES:
                counters.skipped_prefetches += 1  # the Acquire will promote them
            else:
                counters.prefetches += len(lower)
                self.queued_prefetches += 1
                self._ctx.work.spawn(self._prefetch(ns, list(keys[: len(tiers)]), tiers))
        return tiers

    async def locate(self, ns: Namespace, keys: Sequence[bytes]) -> list[int]:
        """The tier of each key of the longest prefix some tier holds (fastest tier wins)."""
        below = self._ctx.below
        tiers: list[int] = []
        geometry = below.geometry(ns)
        in_dram = (ns.index.find(keys) != 0 if keys  # one batch lookup
                   else np.zeros(0, bool))
        name, n = ns.name, len(keys)
        i = 0
        while i < n:
            # The walk from key i, in batches: it ends at a key being deleted (hidden);
            # the local tiers are asked once about every key DRAM lacks up to there
            # (``local_tiers``: one ``held_many`` a tier).  Asked again after an await
            # on a remote tier: the answers may have changed meanwhile.
            end = self._ctx.moves.first_hidden(name, keys, i)
            walk = np.where(in_dram[i:end], TIER_DRAM, 0)  # 0: no tier known to hold it
            missing = np.flatnonzero(walk == 0)
            if len(missing):
                first, last = i + int(missing[0]), i + int(missing[-1])
                asked = (keys[first : last + 1] if last - first + 1 == len(missing)
                         else [keys[i + k] for k in missing.tolist()])  # (a run: a slice)
                walk[missing] = below.local_tiers(name, asked, geometry)
            zeros = np.flatnonzero(walk == 0)
            held = int(zeros[0]) if len(zeros) else len(walk)
            tiers.extend(walk[:held].tolist())
            if held == len(walk) or not below.remote:
                break  # the end, a key being deleted, or one no tier holds
            # The run of keys only a remote tier can hold: asked off the loop, in one go.
            after = np.flatnonzero(walk[held:] != 0)
            start, stop = i + held, i + (held + int(after[0]) if len(after) else len(walk))
            found = await below.locate_remote(name, list(keys[start:stop]), geometry)
            tiers.extend(found)
            if len(found) < stop - start:
                break
            i = stop
        return tiers

    async def _prefetch(self, ns: Namespace, keys: list[bytes], tiers: list[int]) -> None:
        try:
            async with self._prefetch_slots:
                with contextlib.suppress(CapacityExhausted):
                    await self.promote(ns, keys, tiers, prefetch=True)
        except Exception:  # noqa: BLE001 (a bug: count it, the Acquire promotes anyway)
            self._ctx.report.background_error("prefetch")
        finally:
            self.queued_prefetches -= 1

    async def acquire(self, session: Session, keys: Sequence[bytes]) -> tuple[AcquireResult,
                                                                                 list[int]]:
        """Lease the longest prefix present in any tier, promoting what is below DRAM.

        Returns the lease and the tier each hit was found on.
        """
        ns = session.ns
        tiers: list[int] = [TIER_DRAM] * ns.index.prefix(keys)
        if self._ctx.below.lower and len(tiers) < len(keys):
            tiers = await self.locate(ns, keys)
            if any(t != TIER_DRAM for t in tiers):
                # Pin this prefix's DRAM hits meanwhile: the promotions' reserve would
                # otherwise evict them (CLOCK may take them) and cut the prefix short.
                hits = ns.index.find(keys[: len(tiers)])
                hits = hits[hits != 0]
                lease = self._ctx.store.pin_blocks(ns.batch_at(hits)) if len(hits) else None
                try:
                    with contextlib.suppress(CapacityExhausted):
                        await self.promote(ns, list(keys[: len(tiers)]), tiers, prefetch=False)
                finally:
                    if lease is not None:
                        self._ctx.store.unpin(lease)
        # Prefetched blocks read now count as prefetch hits (the acquire's touch clears
        # the mark).
        refs = ns.index.find(keys[: len(tiers)]) if tiers else None
        if refs is not None:
            missing = np.flatnonzero(refs == 0)
            refs = refs[: int(missing[0]) if len(missing) else len(refs)]
            if len(refs):
                flags = ns.table.inspect(refs)["flags"]
                self._ctx.report.counters.prefetch_hits += int(np.count_nonzero(flags & PREFETCHED))
        result = self._ctx.store.acquire(session, keys[: len(tiers)])
        ns.misses += len(keys) - len(tiers)  # store.acquire counted the rest
        return result, tiers[: result.hits]

    async def promote(self, ns: Namespace, keys: list[bytes], tiers: list[int], *,
                      prefetch: bool) -> None:
        """Bring every non-DRAM key of ``keys`` into DRAM, in order, stopping at a failure."""
        tier_of = dict(zip(keys, tiers, strict=True))
        wanted = [k for k, t in zip(keys, tiers, strict=True)
                  if t != TIER_DRAM and k not in ns.index]
        mine, waits = self._ctx.moves.claim_promotions(ns.name, wanted,
                                                   asyncio.get_running_loop())
        try:
            if mine:
                await self._promote_keys(ns, [(k, tier_of[k]) for k in mine], prefetch)
        finally:
            for key in mine:
                self._ctx.moves.end_promotion(ns.name, key, key in ns.index)
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)

    async def _promote_keys(self, ns: Namespace, items: list[tuple[bytes, int]],
                            prefetch: bool) -> None:
        system = self._ctx.store.system_session(ns)
        keys = [k for k, _ in items]
        res = await self._demoter.reserve(system, keys, None)
        wanted = [(k, t) for (k, t), st in zip(items, res.statuses, strict=True)
                  if st == ReserveStatus.RESERVED]
        if not wanted:
            return
        views = self._ctx.store.reservation_slots(system, res.reservation_id)
        geometry = self._ctx.below.geometry(ns)
        by_id = self._ctx.below.by_id
        try:
            # One job per block, or per batched tier (its blocks in one read_many).
            groups: list[list[int]] = []
            by_tier: dict[int, list[int]] = {}
            for i, (_key, tier) in enumerate(wanted):
                if not by_id[tier].batched:
                    groups.append([i])
                elif tier in by_tier:
                    by_tier[tier].append(i)
                else:
                    groups.append(by_tier.setdefault(tier, [i]))
            done = await asyncio.gather(*(
                self._ctx.work.run(self._ctx.copier.read_blocks, ns.name, by_id[wanted[g[0]][1]],
                               [(wanted[i][0], views[i]) for i in g], geometry)
                for g in groups))
            outcomes: list[ReadOutcome] = [None] * len(wanted)
            for g, got in zip(groups, done, strict=True):
                for i, out in zip(g, got, strict=True):
                    outcomes[i] = out
        finally:
            for v in views:
                v.release()
        # Keep the prefix: after the first failure, nothing is committed.
        settled: list[tuple[int, int] | None] = []
        failed = False
        for (key, _tier), out in zip(wanted, outcomes, strict=True):
            if out is Copy.SLOT_FAULT:
                self._ctx.report.slot_fault(ns.name, key, "promotion")
                out = None
            failed = failed or out is None
            settled.append(None if failed else out)
        blocks = self._ctx.store.settle(system, res.reservation_id, settled)
        made = [b for b in blocks if b is not None]
        if not made:
            return
        batch = BlockBatch.of_blocks(ns, made)  # (settle's handles: one per promotion)
        self._ctx.store.set_lower_many(batch, Lower.CLEAN)
        if prefetch:
            ns.table.set_prefetched(batch.refs)
        for (_key, tier), block in zip(wanted, blocks, strict=True):
            if block is not None:
                self._ctx.report.counters.promotions[by_id[tier].name] += 1
