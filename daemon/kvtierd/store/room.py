"""Room for a reserve: free slots, growth from the DRAM budget, eviction of the namespace's
blocks (CLOCK), reclaim of other namespaces' extents, and retirement."""


from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvtier import _slot_ref
from kvtier.errors import (
    CapacityExhausted,
)
from kvtierd.block_table import Policy, by_extent
from kvtierd.logs import event
from kvtierd.segments import (
    Segment,
    SegmentLayout,
    cut_data_file,
)
from kvtierd.store.base import (
    Pinned,
    StoreBase,
    _close_quietly,
    _NeedExtent,
    _Raced,
)
from kvtierd.store.grants import granted_in, take_back_untaken, untaken_in
from kvtierd.store.types import (
    MAX_KEPT_RETIRED,
    Block,
    Extent,
    Lower,
    Namespace,
    NeedDemotion,
    Victims,
)

log = logging.getLogger(__name__)

_NO_REFS = np.zeros(0, dtype=np.uint64)
#: ``victims`` calls one plan may make (each does bounded work; a short answer is
#: asked again, and what is still short after these is not there to evict).
VICTIM_ROUNDS = 4
#: Growth ahead of need (``dram.grow_ahead``): a claim that leaves its namespace fewer
#: free slots than the larger of what it took and this fraction of a full extent's
#: slots starts one background growth to that mark (docs/decisions.md).
GROW_AHEAD_FRACTION = 0.5
#: Seconds growth ahead pauses (store-wide) after one failed: reserves still grow,
#: and report the failure, themselves.
GROW_AHEAD_RETRY = 10.0
#: Longest a reserve that found no room waits for other namespaces' growths in flight
#: (an extent's creation and pre-fault) before it plans again.
GROWTH_WAIT_SECONDS = 5.0


class Room(StoreBase):
    """Finding room: _claim takes slots all or nothing (free, grown, evicted, reclaimed)."""

    def _claim_refs(self, ns: Namespace, n: int, *, may_grow: bool, partial: bool = False,
                    ahead: bool = True
                    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """Take ``n`` slots of ``ns`` into the RESERVED state (free ones first, then the
        blocks ``_take_slots`` chose are evicted into them), all or nothing: their refs
        and new generations.  With ``partial``, fewer (the free ones) rather than raise
        when no more room can be made now.  Without ``ahead`` the caller decides about
        growth ahead (``_grow_ahead``) once it holds the slots."""
        try:
            free, victims, pinned = self._take_slots(ns, n, may_grow=may_grow, partial=partial)
        except _NeedExtent:
            if partial:  # grants ahead: the writer's next reserve finds the extent (being) made
                self._grow_ahead(ns, n)
            raise
        # Applied: the table's calls below were validated by the plan (on the loop,
        # nothing changed since) and change every slot or none.
        vrefs = victims.refs
        try:
            # One call: the free slots and the victims (evicted into this claim), or none.
            refs, short = ns.table.claim(free, pinned.skip(), evict=vrefs if victims else None)
        except BaseException:
            ns.index.unhide(victims.blocks())
            raise
        assert short == 0, f"{short} free slots vanished since the plan"
        if victims:
            self._drop_from_index(ns, victims.keys, hidden=victims.hidden)
            refs = np.concatenate([refs, vrefs])
            self._report_evicted(ns, victims)
        gens = ns.table.inspect(refs)["generation"]
        if self.grow_ahead and ahead:
            self._grow_ahead(ns, n)
        return refs, gens

    def _claim(self, ns: Namespace, n: int, *, may_grow: bool,
               partial: bool = False) -> list[tuple[Extent, int, int]]:
        """``_claim_refs`` as (extent, slot, generation) places."""
        refs, gens = self._claim_refs(ns, n, may_grow=may_grow, partial=partial)
        return [(ns.by_id[_slot_ref.segment_of(r)], _slot_ref.slot_of(r), g)
                for r, g in zip(refs.tolist(), gens.tolist(), strict=True)]

    @staticmethod
    def _offsets(ns: Namespace, refs: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        """Each ref's slot offset in its data file (what clients address)."""
        slots = _slot_ref.slots_of(refs)
        out = slots * np.uint64(ns.slot_bytes)
        for ext_id, mine in by_extent(refs):  # an extent of another layout (recovered)
            slot_bytes = ns.by_id[ext_id].segment.layout.slot_bytes
            if slot_bytes != ns.slot_bytes:
                at = slice(None) if mine is None else mine
                out[at] = slots[at] * np.uint64(slot_bytes)
        return out

    def _take_slots(self, ns: Namespace, n: int, *, may_grow: bool, partial: bool = False
                    ) -> tuple[int, Victims, Pinned]:
        """Plan room for ``n`` slots of ``ns``: how many free slots to claim and which
        blocks to evict for the rest (nothing changes yet).

        Order: free slots (but those clients still read without a call); growth while
        the budget allows; then eviction of the namespace's blocks (CLOCK) or reclaim of
        whole extents of other namespaces (``_find_room``).  Victims leave the shared
        table before the pages are read again (a client that leased one meanwhile is
        seen, ``_Raced``).  With ``partial``, a shortage of room returns the free slots
        found instead of raising.
        """
        pinned = self.pinned(ns)
        free = min(n, self._usable_free(ns, pinned))
        if free == n:
            return n, Victims.none(ns), pinned
        try:
            victims = self._find_room(ns, n, free, may_grow=may_grow, pinned=pinned)
        except CapacityExhausted:
            if partial:
                return free, Victims.none(ns), pinned
            raise
        if ns.pages and len(victims):
            ns.index.hide(victims.keys)
            victims.hidden = True
            now = self.pinned(ns)
            if now.any_slot(victims.refs):
                ns.index.unhide(victims.blocks())
                raise _Raced()
            pinned = now
        return free, victims, pinned

    def _revoke_idle_grants(self, exts: Sequence[Extent]) -> None:
        """Take back the untaken grants in extents about to be reclaimed, all or none
        (``grants.take_back_untaken``); ``_Raced`` when a writer took one meanwhile."""
        if not take_back_untaken(exts, self.namespaces, self.sessions):
            raise _Raced()

    def _hide_for_reclaim(self, exts: Sequence[Extent]) -> list[tuple[Namespace, list[Block]]]:
        """Take the blocks of other namespaces' extents about to be reclaimed out of
        their shared tables, then read those namespaces' pages again: a client that
        leased one of their slots meanwhile is seen now (the blocks go back, and
        ``_Raced``: plan again) or sees the blocks gone (the hazard handshake of
        ``_take_slots``, across namespaces).  Returns what it hid, for ``_unhide``."""
        hidden: list[tuple[Namespace, list[Block]]] = []
        for ext in exts:
            owner = self.namespaces[ext.segment.namespace]
            if not owner.pages:
                continue
            blocks = self._blocks_of(owner, ext)
            owner.index.hide([b.key for b in blocks])
            hidden.append((owner, blocks))
        pins: dict[str, Pinned] = {}
        for ext in exts:
            owner = self.namespaces[ext.segment.namespace]
            if owner.pages:
                if owner.name not in pins:
                    pins[owner.name] = self.pinned(owner)
                if pins[owner.name].extent(ext):
                    for other, blocks in hidden:
                        other.index.unhide(blocks)
                    raise _Raced()
        return hidden

    @staticmethod
    def _blocks_of(ns: Namespace, ext: Extent, *, dirty: bool = False) -> list[Block]:
        """Handles of ``ext``'s COMMITTED blocks (only the DIRTY ones, with ``dirty``)."""
        refs = ns.table.committed(ext.id)
        if dirty and len(refs):
            refs = refs[ns.table.inspect(refs)["lower"] == Lower.DIRTY]
        return ns.blocks_at(refs)

    def _at_quota(self, ns: Namespace) -> bool:
        """A namespace at its DRAM quota neither grows nor reclaims others' extents: it
        evicts its own blocks (access.namespaces[].dram_quota; checked off the fast path)."""
        quota = self.options.dram_quota_of(ns.name)
        return bool(quota) and SegmentLayout.fit(ns.block_bytes,
                                                 quota - ns.extent_bytes()) is None

    def _grows_first(self, ns: Namespace) -> bool:
        """Room in the budget, or an extent of this namespace being made (ahead of need, or
        for another reserve; its bytes are out of the budget already): a claim short of
        free slots grows, or waits for that growth, rather than evict."""
        return (ns.grow_lock.locked()
                or SegmentLayout.fit(ns.block_bytes, self.budget_free) is not None)

    def _find_room(self, ns: Namespace, n: int, got: int, *, may_grow: bool,
                   pinned: Pinned) -> Victims:
        """The blocks of ``ns`` to evict for the ``n - got`` slots no free list had, or raise:
        ``_NeedExtent`` to grow first (after reclaiming other namespaces' extents, if
        that funds the growth), ``NeedDemotion`` or ``CapacityExhausted``.

        Eviction within a namespace is CLOCK (``BlockTable.victims``; docs/decisions.md).
        Across namespaces the budget moves by whole extents: another namespace's
        extent is reclaimed when it is empty, when this namespace has too few blocks to
        evict, or when every block in it is older than every block CLOCK would evict
        here (its newest access is older than their oldest).
        """
        short = n - got
        at_quota = self._at_quota(ns)
        may_grow = may_grow and not at_quota
        if may_grow and self._grows_first(ns):
            raise _NeedExtent(n)
        spill = self.spill_enabled
        self.note_reads(ns)  # blocks read without a call get their CLOCK bit first
        same_ns = self._victims(ns, short, pinned, spill=spill)
        reclaim: list[Extent] = []
        dirty_ext: list[Extent] = []  # other namespaces' extents blocked only by DIRTY blocks
        if may_grow:
            reclaim, dirty_ext = self._plan_reclaim(ns, same_ns, short)
        if reclaim:
            hidden = self._hide_for_reclaim(reclaim)  # or _Raced: a client leased meanwhile
            try:
                self._revoke_idle_grants(reclaim)  # or _Raced: a writer took one
            except _Raced:
                for owner, blocks in hidden:
                    owner.index.unhide(blocks)
                raise
            try:
                self._retire_extents(reclaim, "for another namespace")
            finally:
                for name in {e.segment.namespace for e in reclaim}:
                    if name in self.namespaces:
                        self._forget_if_unused(self.namespaces[name])
            raise _NeedExtent(n)
        if dirty_ext and (len(same_ns) < short
                          or dirty_ext[0].counts().newest_access < same_ns.oldest()):
            # Another namespace's extent, older than what CLOCK would evict here, waits
            # only for its DIRTY blocks to be demoted: demote them, then reclaim it.
            ext = dirty_ext[0]
            raise NeedDemotion(ns, short, self._blocks_of(
                self.namespaces[ext.segment.namespace], ext, dirty=True))
        if len(same_ns) >= short:
            return same_ns[:short]
        if spill:
            # Room comes once DIRTY blocks are demoted: ours, or those holding an extent of
            # another namespace back from reclaim, or the ones being demoted right now.
            skip = pinned.skip()
            want = short - len(same_ns)
            refs = ns.table.dirty(want, Policy.CLOCK, skip=skip)
            wanted = ns.blocks_at(refs)
            in_flight = any(s.leases for s in self._system_sessions.values())
            if wanted or in_flight:
                raise NeedDemotion(ns, short - len(same_ns), wanted)
        if at_quota:
            raise CapacityExhausted(
                f"namespace {ns.name!r} is at its DRAM quota ({ns.extent_bytes()} of "
                f"{self.options.dram_quota_of(ns.name)} bytes): {n} "
                f"slots needed, {got + len(same_ns)} obtainable by evicting its own "
                f"blocks ({ns.leased} leased and {ns.reserved} reserved blocks cannot be "
                "evicted)")
        raise CapacityExhausted(
            f"DRAM is full for namespace {ns.name!r}: {n} slots needed, "
            f"{got + len(same_ns)} obtainable ({ns.leased} leased and "
            f"{ns.reserved} reserved blocks in this namespace cannot be evicted)"
        )

    @staticmethod
    def _victims(ns: Namespace, n: int, pinned: Pinned, *, spill: bool) -> Victims:
        """Up to ``n`` evictable blocks of ``ns`` by CLOCK (with ``spill``, non-DIRTY
        only), none pinned by a call or a hazard.  The table's work per call is bounded:
        a short answer is asked again a few times."""
        skip = pinned.skip()
        chosen = np.zeros(0, dtype=np.uint64)
        for _ in range(VICTIM_ROUNDS):
            more = ns.table.victims(n - len(chosen), Policy.CLOCK, spill=spill,
                                    skip=chosen if skip is None else np.concatenate([skip, chosen]))
            chosen = np.concatenate([chosen, more])
            if len(chosen) >= n or not len(more):
                break
        return ns.victims_at(chosen)

    def _plan_reclaim(self, ns: Namespace, same_ns: Victims, short: int
                      ) -> tuple[list[Extent], list[Extent]]:
        """Other namespaces' extents to reclaim for ``ns`` (enough to fund one extent of
        it, or none), and those that only DIRTY blocks keep from it (spill).  Never an
        extent with a pinned block (by a call or a hazard), reservations that are not
        idle grants, or one of a namespace growing right now."""
        reclaim: list[Extent] = []
        reclaim_bytes = 0

        def funded() -> bool:
            return SegmentLayout.fit(ns.block_bytes, self.budget_free + reclaim_bytes) is not None

        pins: dict[str, Pinned] = {}
        candidates: list[tuple[int, Extent]] = []
        dirty_ext: list[tuple[int, Extent]] = []
        for other in self.namespaces.values():
            if other is ns or other.grow_lock.locked():
                continue
            for ext in other.extents:
                c = ext.counts()
                if c.pinned or not (c.reserved == 0
                                    or c.reserved == len(untaken_in(ext, self.namespaces, self.sessions))):
                    continue
                if other.pages:
                    if other.name not in pins:
                        pins[other.name] = self.pinned(other)
                    if pins[other.name].extent(ext):
                        continue
                if self.spill_enabled and c.dirty:
                    dirty_ext.append((c.newest_access, ext))
                else:
                    candidates.append((0 if c.committed == 0 else c.newest_access, ext))
        candidates.sort(key=lambda t: t[0])
        dirty_ext.sort(key=lambda t: t[0])
        # The oldest block CLOCK would evict here: an extent older than it goes first.
        ours = same_ns.oldest()
        enough = len(same_ns) >= short
        for newest, ext in candidates:
            if funded():
                break
            if newest and enough and newest >= ours:
                break
            reclaim.append(ext)
            reclaim_bytes += ext.bytes
        if not funded():
            reclaim = []
        return reclaim, [e for _, e in dirty_ext]

    async def _grow(self, ns: Namespace, need: int) -> bool:
        """Add extents to ``ns`` from the global budget until ``need`` slots are free.

        One extent at a time (``_grow_one``), under the namespace's ``grow_lock``: a
        growth ahead of need in flight finishes first, and what it added counts.
        Extents added before a failing one stay (capacity, not state).  False when
        nothing could be added (the caller then evicts).  Free slots that a client
        still reads without a call (hazards) are not free for this: a reserve skips
        them, so counting them would end its growth rounds in an eviction while the
        budget still had room.
        """
        async with ns.grow_lock:
            while self._usable_free(ns) < need:
                if not await self._grow_one(ns):
                    break
            return self._usable_free(ns) > 0

    def _next_layout(self, ns: Namespace) -> SegmentLayout | None:
        """The next extent of ``ns``: ``extent_size`` (or one slot, if that is more), less
        where the budget or the namespace's DRAM quota has less room; None: no room."""
        room = self.budget_free
        quota = self.options.dram_quota_of(ns.name)
        if quota:  # never grow past the namespace's DRAM quota
            room = min(room, quota - ns.extent_bytes())
        return SegmentLayout.fit(ns.block_bytes, min(room, max(
            self.extent_size, SegmentLayout.one_slot_file_bytes(ns.block_bytes))))

    async def _grow_one(self, ns: Namespace) -> bool:
        """Add one extent to ``ns`` (the caller holds ``ns.grow_lock``); False when the
        budget or the quota has no room for one slot.

        File creation and pre-faulting run off the loop.  The budget and the extent
        number are taken before (growths of other namespaces run meanwhile) and given
        back when creation fails; a caller cancelled meanwhile gives them back too,
        and the file, once made, is removed.  A namespace dropped meanwhile (its last
        session closed before it held an extent) gets nothing: the file goes and the
        bytes come back.
        """
        layout = self._next_layout(ns)
        if layout is None:
            return False
        self.budget_free -= layout.file_bytes
        self.growing_bytes += layout.file_bytes
        index = ns.next_extent_index
        ns.next_extent_index += 1
        seg_id = next(self._segment_ids)
        loop = asyncio.get_running_loop()
        made = loop.run_in_executor(None, self._factory, ns, index, layout, seg_id)
        self._making.add(made)
        made.add_done_callback(self._making.discard)
        try:
            segment = await asyncio.shield(made)
        except BaseException as exc:
            self.budget_free += layout.file_bytes
            if made.done() and (made.cancelled() or made.exception() is not None):
                # Creation failed: nothing was made, its number is free again.
                if ns.next_extent_index == index + 1:
                    ns.next_extent_index = index
            else:
                # Cancelled while the file is being made, or right after (before
                # this resumed): it is removed once made, and its number stays
                # taken, so no new extent reuses its name.
                made.add_done_callback(self._discard_made)
            if isinstance(exc, OSError):
                raise CapacityExhausted(f"could not create a DRAM extent: {exc}") from exc
            raise
        finally:
            self.growing_bytes -= layout.file_bytes
        if self.namespaces.get(ns.name) is not ns:
            self.budget_free += layout.file_bytes
            self._discard_made(made)
            return False
        self.add_extent(ns, segment)
        return True

    # ------------------------------------------------ growth ahead of need
    # (its state: ``StoreBase.__init__``; on with ``StoreOptions.grow_ahead``)

    def _grow_ahead(self, ns: Namespace, took: int) -> None:
        """After a claim of ``took`` slots of ``ns``: when it left fewer free slots than
        the larger of ``took`` (the next claim is likely as large) and
        ``GROW_AHEAD_FRACTION`` of a full extent's, and the budget and the quota have
        room, start one background growth to that mark (none while one is in flight).
        It only ever takes unused budget: it never evicts nor reclaims, and a reserve
        that needs room meanwhile waits for it (``grow_lock``) rather than evict."""
        one_slot = SegmentLayout.one_slot_file_bytes(ns.block_bytes)
        if not self.grow_ahead or ns in self._ahead or self.budget_free < one_slot:
            return  # (DRAM full, the steady state: this much per claim)
        full = SegmentLayout.fit(ns.block_bytes, max(self.extent_size, one_slot))
        want = max(took, math.ceil((full.n_slots if full else 1) * GROW_AHEAD_FRACTION))
        if (ns.free_slots() + granted_in(ns, self.sessions) >= want
                or self._clock() < self._ahead_paused_until
                or self.namespaces.get(ns.name) is not ns or self._next_layout(ns) is None):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a claim outside the loop (tests): nothing to run it on
            return
        task = loop.create_task(self._grow_ahead_to(ns, want), name=f"grow-ahead {ns.name}")
        self._ahead[ns] = task
        task.add_done_callback(functools.partial(self._grown, ns))

    async def _grow_ahead_to(self, ns: Namespace, want: int) -> None:
        """Grow ``ns`` an extent at a time until ``want`` slots are free, the budget or
        the quota runs out, or growth ahead stops.  The lock is taken per extent: a
        reserve waiting for it goes between two.  A failure pauses growth ahead."""
        try:
            while True:
                async with ns.grow_lock:
                    if (not self.grow_ahead or self.namespaces.get(ns.name) is not ns
                            or self._usable_free(ns) >= want or not await self._grow_one(ns)):
                        return
                    self.grown_ahead += 1
        except Exception as exc:
            self._ahead_paused_until = self._clock() + GROW_AHEAD_RETRY
            log.warning("growing namespace %r ahead of need failed: %s; its reserves grow it "
                        "themselves, and growth ahead pauses for %.0f s", ns.name, exc,
                        GROW_AHEAD_RETRY, exc_info=not isinstance(exc, CapacityExhausted),
                        extra=event("grow_ahead_failed", namespace=ns.name, error=str(exc)))

    def _grown(self, ns: Namespace, task: asyncio.Task[None]) -> None:
        if self._ahead.get(ns) is task:
            del self._ahead[ns]

    async def _growths_elsewhere(self, ns: Namespace) -> bool:
        """Wait (bounded) for the growths of namespaces other than ``ns`` in flight now
        -- ahead of need, or a reserve's own -- to end.  False when there were none."""
        others = [o for o in self.namespaces.values() if o is not ns and o.grow_lock.locked()]
        tasks = [t for o, t in self._ahead.items() if o is not ns]
        if not others and not tasks:
            return False

        async def through(lock: asyncio.Lock) -> None:
            async with lock:
                pass

        waits = [asyncio.ensure_future(through(o.grow_lock)) for o in others]
        try:
            await asyncio.wait([*waits, *tasks], timeout=GROWTH_WAIT_SECONDS)
        finally:
            for w in waits:
                w.cancel()
        return True

    async def stop_growth(self) -> None:
        """At shutdown, before ``drain``: no growth ahead from now on; those in flight are
        cancelled, and every extent being made (ahead, or for a reserve cancelled
        meanwhile) is waited for, so that its removal is one ``drain`` waits for."""
        self.grow_ahead = False
        tasks = list(self._ahead.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._making:
            await asyncio.wait(list(self._making))
            await asyncio.sleep(0)  # their done callbacks (``_discard_made``) have run

    def _usable_free(self, ns: Namespace, pinned: Pinned | None = None) -> int:
        """Free slots of ``ns`` a reserve may take now (those under no hazard)."""
        pinned = self.pinned(ns) if pinned is None else pinned
        free = ns.free_slots()
        skip = pinned.skip()
        if skip is None or not free:
            return free
        # The hazards that name a free slot of ``ns`` (garbage names none): vectorised.
        exts = np.array(sorted(ns.by_id), dtype=np.uint64)
        sizes = np.array([ns.by_id[i].n_slots for i in sorted(ns.by_id)], dtype=np.uint64)
        ids, slots = _slot_ref.split(skip)
        at = np.searchsorted(exts, ids)
        ok = at < len(exts)
        ok[ok] &= exts[at[ok]] == ids[ok]
        ok[ok] &= slots[ok] < sizes[at[ok]]
        named = np.unique(skip[ok])
        if not len(named):
            return free
        return free - int(np.count_nonzero(ns.table.inspect(named)["state"] == 0))

    def _discard_made(self, made: asyncio.Future[Segment]) -> None:
        """Remove a segment made for a reserve that was cancelled meanwhile."""
        if made.cancelled() or made.exception() is not None:
            return
        segment = made.result()
        fut = asyncio.get_running_loop().run_in_executor(None, _close_quietly, segment, True)
        self._retiring.add(fut)
        fut.add_done_callback(self._retiring.discard)

    def add_extent(self, ns: Namespace, segment: Segment) -> None:
        """Account a created segment (its bytes are already taken from the budget)."""
        ns.table.add_segment(segment)
        ext = Extent(segment, ns.table)
        ns.extents.append(ext)
        ns.by_id[ext.id] = ext
        ns.segments_version += 1
        self.prefault_seconds += segment.prefault_seconds
        if segment.mlock_error is not None:
            self.mlock_errors.append(segment.mlock_error)
        if self._on_extent is not None:
            self._on_extent(segment)

    def _retire_extents(self, exts: Sequence[Extent], why: str) -> None:
        """Evict every block of these extents (holding no lease or reservation; slots
        quarantined since recovery are dropped) and give their bytes back to the budget.

        The files are removed first (a tmpfs metadata update: the budget is free
        again at once, so a crash before the background unmap must not find the
        files still counted), and that is the step that can fail; a failure there
        leaves the memory as it was, and the files removed before it (their
        extents serve on until the next restart, which loses their blocks as if
        evicted).  The slot tables of a removed file are not written any more.
        """
        for ext in exts:
            c = ext.counts()
            assert c.pinned == 0 and c.reserved == len(ext.quarantine), (
                f"extent in use: {c.pinned} pinned, {c.reserved} reserved, "
                f"{len(ext.quarantine)} quarantined")
        for ext in exts:
            ext.segment.unlink()
        # Applied: nothing below can fail.
        evicted: list[tuple[Namespace, Victims | list[Block]]] = []
        for ext in exts:
            owner = self.namespaces[ext.segment.namespace]
            blocks = owner.victims_at(owner.table.committed(ext.id))
            self._drop_from_index(owner, blocks.keys)
            # (handles, when a hook wants them, before the extent is gone)
            evicted.append((owner, blocks.blocks() if self._on_evict is not None else blocks))
            # A late writer of a previous run writes into the unlinked file: harmless.
            ext.quarantine.clear()
            owner.table.remove_extent(ext.id, force=True)  # before the segment closes
            owner.extents.remove(ext)
            del owner.by_id[ext.id]
            owner.segments_version += 1
            self.budget_free += ext.bytes
            log.info("reclaimed extent %d of namespace %r (%d bytes) %s",
                     ext.segment.index, owner.name, ext.bytes, why)
            self._close_later(ext.segment)
        for owner, gone in evicted:
            self._report_evicted(owner, gone)

    def _close_later(self, segment: Segment) -> None:
        """Unmap a retired segment and free its memory off the loop (``drain`` waits for
        it); its data file is cut to 0 bytes ``retired_grace`` later (``_cut_retired``)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            _close_quietly(segment, False)
            return
        fut = loop.run_in_executor(None, _close_quietly, segment, False, True)
        self._retiring.add(fut)
        fut.add_done_callback(self._retiring.discard)
        fut.add_done_callback(self._kept)

    def _kept(self, fut: asyncio.Future[int | None]) -> None:
        if fut.cancelled() or fut.exception() is not None or fut.result() is None:
            return
        fd = fut.result()
        assert fd is not None
        self._to_cut.append((self._clock() + self.retired_grace, fd))
        while len(self._to_cut) > MAX_KEPT_RETIRED:  # fds are finite: the oldest go now
            cut_data_file(self._to_cut.popleft()[1])

    @property
    def retired_grace(self) -> float:
        """How long a retired data file keeps its size (punched: it reads as zeros)
        before it is cut to 0 bytes: past a reservation's and a lease's TTL, no honest
        client still writes or reads it, so only then does a touch fault."""
        return max(self.reservation_ttl, self.lease_ttl)

    def _cut_retired(self, *, everything: bool = False) -> None:
        """Cut the retired data files whose grace is over (all, with ``everything``)."""
        now = self._clock()
        while self._to_cut and (everything or self._to_cut[0][0] <= now):
            cut_data_file(self._to_cut.popleft()[1])

    def _reformat(self, ns: Namespace, why: str) -> None:
        """Drop a namespace nobody uses yet: every extent retired, its files removed.

        A failure part-way (removing a file) keeps the namespace; the next
        declaration reformats it again."""
        assert ns.sessions == 0
        self._retire_extents(list(ns.extents), "(namespace reformatted)")
        self._drop_namespace(ns)
        log.warning("namespace %r reformatted: %s", ns.name, why,
                    extra=event("namespace_reformatted", namespace=ns.name, reason=why))
        self.dropped_segments.append(f"namespace {ns.name!r} reformatted: {why}")
