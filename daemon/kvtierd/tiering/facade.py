"""``Tiering``: the one object the service and the app call; the parts do the work.

It builds the parts around one movement table and forwards each call to the
part that owns it: lookups and acquires to the promoter, reserves to the
demoter (they wait on its back-pressure), commits to the publisher (and wake
the demoter), admin calls to the admin and the drainer.  Delete is its own:
it touches every part's moves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from typing import Final

from kvtierd.cluster.tier import ClusterTier
from kvtierd.shared_index import SessionPage
from kvtierd.spill.shared import SharedTier
from kvtierd.spill.ssd import SsdTier
from kvtierd.spill.tier import LowerTier
from kvtierd.store import (
    AcquireResult,
    BlockBatch,
    CheckSnapshot,
    PageCommits,
    ReserveResult,
    Session,
    Store,
    U64s,
)
from kvtierd.tiering.admin import Admin, EvictResult, KeyState
from kvtierd.tiering.below import Below
from kvtierd.tiering.common import (
    Background,
    NoObserver,
    Reporter,
    SpillPolicy,
    TieringCounters,
    TieringObserver,
)
from kvtierd.tiering.context import Context
from kvtierd.tiering.copies import Copier
from kvtierd.tiering.demoter import Demoter
from kvtierd.tiering.drain import Drainer, DrainProgress
from kvtierd.tiering.moves import MovementTable
from kvtierd.tiering.promoter import Promoter
from kvtierd.tiering.publisher import Publisher

#: Rounds a delete waits for the demotions/promotions of its keys in flight.
MAX_DELETE_WAITS: Final = 100


class Tiering:
    """DRAM (the store) plus the tiers below it (``lower``), and the movement between them."""

    def __init__(
        self,
        store: Store,
        *,
        ssd: SsdTier | None = None,
        shared: SharedTier | None = None,
        cluster: ClusterTier | None = None,
        below: Sequence[LowerTier] = (),
        policy: SpillPolicy | None = None,
        io_threads: int = 4,
        observer: TieringObserver | None = None,
    ) -> None:
        """``ssd``, ``shared``, ``cluster``: the mechanisms (kept as attributes for
        stats and metrics); ``below``: more tiers under them, slowest last (tests)."""
        self.store = store
        self.ssd = ssd
        self.shared = shared
        self.cluster = cluster
        self.policy = policy or SpillPolicy.with_defaults()
        self.observer: TieringObserver = observer or NoObserver()
        self.counters = TieringCounters()
        # The parts (attributes for tests and benchmarks; callers use the methods).
        self.report = Reporter(self.counters, self.observer)
        self.work = Background(io_threads)
        self.moves = MovementTable(store)
        self.below = Below(ssd=ssd, shared=shared, cluster=cluster, below=below,
                           policy=self.policy, moves=self.moves, report=self.report,
                           work=self.work)
        #: The tiers below DRAM, fastest first (``Below.lower``).
        self.lower = self.below.lower
        self.enabled = bool(self.lower)
        # Page commits make block handles only for the write-through publish.
        store.attach_tiering(spill=self.enabled, commit_handles=bool(self.below.write_through))
        self._wake = asyncio.Event()  # the demoter's: something to demote now
        self.copier = Copier(store, self.below, self.report)
        ctx = Context(store, self.below, self.moves, self.copier, self.report, self.work)
        self.drainer = Drainer(ctx, self._wake)
        self.demoter = Demoter(ctx, self.drainer, self._wake)
        self.promoter = Promoter(ctx, self.demoter)
        self.publisher = Publisher(ctx)
        self.admin = Admin(ctx, ssd)

    # ================================================================ lifecycle
    async def start(self) -> None:
        """Open the tiers below DRAM (re-adopting the SSD's files) and start the demoter."""
        loop = asyncio.get_running_loop()
        self.moves.attach(loop)
        self.demoter.attach(loop)
        for tier in self.lower:
            await loop.run_in_executor(self.work.pool, tier.open)
        self.demoter.start()

    async def stop(self) -> None:
        """Stop moving blocks; in-flight I/O finishes before any file is closed."""
        await self.demoter.stop()
        # Worker threads may still be reading DRAM slots or writing spill files: wait for
        # them before the spill files (and then the segments) are closed.
        await self.work.stop()
        for tier in self.lower:
            await asyncio.to_thread(tier.close)

    def background_error(self, task: str) -> None:
        """An unexpected exception in background work: logged (throttled) and counted."""
        self.report.background_error(task)

    def queue_depth(self) -> int:
        """Blocks being demoted or published now."""
        return self.moves.in_flight()

    # ================================================================ client calls
    async def lookup(self, session: Session, keys: Sequence[bytes], *,
                     prefetch: bool = False) -> list[int]:
        """The tier of each key of the longest prefix present in any tier."""
        return await self.promoter.lookup(session, keys, prefetch=prefetch)

    async def acquire(self, session: Session, keys: Sequence[bytes]) -> tuple[AcquireResult,
                                                                                 list[int]]:
        """Lease the longest prefix present in any tier, promoting what is below DRAM.

        Returns the lease and the tier each hit was found on.
        """
        return await self.promoter.acquire(session, keys)

    async def reserve(self, session: Session, keys: Sequence[bytes]) -> ReserveResult:
        """Reserve DRAM slots; keys a lower tier holds are EXISTS.  Waits for demotion
        when only DIRTY blocks could make room.

        Raises: CapacityExhausted when demotion did not make room in time
        (``spill.backpressure_timeout``); what ``Store.reserve`` raises.
        """
        return await self.demoter.reserve(session, keys,
                                          self.below.exists_below(session, keys))

    def commit(self, session: Session, reservation_id: int, lengths: U64s,
               checksums: U64s | None) -> int:
        """``Store.commit``, then wake the demoter and publish when write-through."""
        res = session.reservations.get(reservation_id)
        keys = list(res.keys) if res is not None else []
        n = self.store.commit(session, reservation_id, lengths, checksums)
        if self.enabled:
            ns = session.ns
            if self.publisher.enabled and keys:
                refs = ns.index.find(keys)
                self._committed(ns.batch_at(refs[refs != 0]))
            else:
                self._committed(None)
        return n

    def commit_from_page(self, session: Session, page: SessionPage) -> PageCommits:
        """``Store.commit_from_page`` (keys a lower tier holds are EXISTS, as for a
        reserve), then wake the demoter and publish when write-through."""
        out = self.store.commit_from_page(session, page, self.below.held_below(session))
        if self.enabled and out.committed:
            # (the commit path hands its blocks over as handles, made only for this;
            # only a write-through tier needs them, so no batch is made for demotion)
            self._committed(BlockBatch.of_blocks(session.ns, out.blocks)
                            if self.publisher.enabled and out.blocks else None)
        return out

    def _committed(self, blocks: BlockBatch | None) -> None:
        if blocks is not None:
            self.publisher.committed(blocks)
        self._wake.set()

    async def delete(self, session: Session, keys: Sequence[bytes]) -> int:
        """Delete from every tier; returns how many keys were present in any.

        The keys are hidden first (lookups miss them, no new promotion, publish or
        hand-off starts), then demotions, promotions, publishes and SSD->shared hand-offs
        of them in flight finish: one would otherwise write the block to a tier after
        its copy there was removed, or commit it to DRAM again.
        """
        ns = session.ns
        # (hidden until the shared tier's files are gone too)
        gone, busy, moving = self.moves.hide_checked(ns.name, keys)
        try:
            if moving:
                await self._wait_unmoving(ns.name, keys, busy)
            return await self._delete(session, keys)
        finally:
            self.moves.unhide(gone)

    async def _wait_unmoving(self, namespace: str, keys: Sequence[bytes],
                             busy: list[asyncio.Future[bool]]) -> None:
        """Until no move of ``keys`` is in flight (one was: ``busy``, the promotions of them
        found first), or ``MAX_DELETE_WAITS`` rounds."""
        for _ in range(MAX_DELETE_WAITS):
            if busy:
                await asyncio.gather(*busy, return_exceptions=True)
            else:
                await self.moves.wait(1.0)
            busy = self.moves.promotions_of(namespace, keys)
            if not busy and not self.moves.any_moving(namespace, keys):
                break

    async def _delete(self, session: Session, keys: Sequence[bytes]) -> int:
        ns = session.ns
        present = set(self.store.delete_present(session, keys))
        below = self.below
        geometry = below.geometry(ns)
        removed = 0
        for tier in below.local:
            present |= {k for k, length in zip(keys, below.copies_in(tier, ns.name, keys,
                                                                     geometry), strict=True)
                        if length is not None}
            removed += tier.remove(ns.name, keys)
        # (A delete of keys no local tier held has no removal to persist: no worker
        # thread's round trip; so is a delete with no remote tier answered on the spot.)
        found = await below.drop(ns.name, {t: keys for t in below.remote}, geometry,
                                 flush=removed > 0)
        for there in found.values():
            present |= there
        return len(present)

    # ================================================================ admin calls
    async def list_keys(self, namespace: str, page_size: int,
                        after: bytes | None) -> tuple[list[KeyState], bytes | None]:
        """``Admin.list_keys``: one page of a namespace's blocks in DRAM and the SSD."""
        return await self.admin.list_keys(namespace, page_size, after)

    async def evict(self, namespace: str, keys: Sequence[bytes] | None,
                    tiers: Collection[int]) -> EvictResult:
        """``Admin.evict``: drop the copies of ``keys`` on ``tiers``."""
        return await self.admin.evict(namespace, keys, tiers)

    async def drain(self, wait: float) -> DrainProgress:
        """``Drainer.drain``: give every DRAM block a durable copy below DRAM."""
        return await self.drainer.drain(wait)

    async def blocks_by_tier(self) -> dict[str, dict[str, list[bytes]]]:
        """``Admin.blocks_by_tier``: every key DRAM and the SSD tier hold."""
        return await self.admin.blocks_by_tier()

    def watch(self, changed: Callable[[str, str, list[bytes], bool], None] | None) -> None:
        """``Admin.watch``: tell ``changed`` every key entering or leaving DRAM or SSD."""
        self.admin.watch(changed)

    # ================================================================ invariants
    def check(self) -> list[str]:
        """Every cross-check, on the calling thread (tests, shutdown)."""
        return self._check_from(self.store.check_snapshot(), list(self.lower))

    async def check_off_loop(self) -> list[str]:
        """``check()`` for the Check RPC without stalling the event loop.

        The store is copied here (``check_snapshot``: lists and slot-table bytes, no
        per-slot work) and cross-checked in a worker thread; the tiers below DRAM
        take their own locks, so their checks run in the worker too.
        """
        return await asyncio.get_running_loop().run_in_executor(
            None, self._check_from, self.store.check_snapshot(), list(self.lower))

    def _check_from(self, snapshot: CheckSnapshot, lower: list[LowerTier]) -> list[str]:
        problems = self.store.check_from(snapshot)
        for tier in lower:
            problems += tier.check()
        return problems
