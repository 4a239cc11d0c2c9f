"""Room for a reserve: free slots, growth from the DRAM budget, eviction of the namespace's
least recently used blocks, reclaim of other namespaces' extents, and retirement."""


from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence

from kvtier.errors import (
    CapacityExhausted,
)
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
    _grant_word,
    _locate,
    _NeedExtent,
    _Raced,
    _rewrite,
    _Undo,
)
from kvtierd.store.types import (
    EVICTION_SCAN_LIMIT,
    MAX_KEPT_RETIRED,
    Block,
    Extent,
    Lower,
    Namespace,
    NeedDemotion,
    Session,
)

log = logging.getLogger(__name__)



class Room(StoreBase):
    """Finding room: _claim takes slots all or nothing (free, grown, evicted, reclaimed)."""

    def _claim(self, ns: Namespace, n: int, *, may_grow: bool,
               partial: bool = False) -> list[tuple[Extent, int, int]]:
        """Take ``n`` slots of ``ns`` into the RESERVED state (evicting blocks as planned
        by ``_take_slots``), all or nothing: (extent, slot, new generation) each, already
        counted as reserved.  With ``partial``, fewer (the free ones) rather than raise
        when no more room can be made now."""
        taken, victims = self._take_slots(ns, n, may_grow=may_grow, partial=partial)
        places = taken + [(b.extent, b.slot) for b in victims]
        try:
            with _Undo() as undo:
                for ext, slot in taken:
                    seg = ext.segment
                    undo.add(seg.mark_free, slot)
                    seg.mark_reserved(slot, ext.generations[slot] + 1)
                for block in victims:  # evicted into this reservation: COMMITTED -> RESERVED
                    seg = block.extent.segment
                    undo.add(_rewrite, seg, block.slot, seg.read_slot(block.slot))
                    seg.mark_reserved(block.slot, block.extent.generations[block.slot] + 1)
        except BaseException:
            for ext, slot in reversed(taken):
                ext.free.append(slot)
            self._unhide(ns, victims)
            raise
        # Applied: nothing below can fail.
        for block in victims:
            self._drop_from_index(block)
        out: list[tuple[Extent, int, int]] = []
        for ext, slot in places:
            gen = ext.generations[slot] + 1
            ext.generations[slot] = gen
            ext.reserved += 1
            out.append((ext, slot, gen))
        ns.reserved += len(places)
        self._report_evicted(victims)
        return out

    def _take_slots(self, ns: Namespace, n: int, *, may_grow: bool, partial: bool = False
                    ) -> tuple[list[tuple[Extent, int]], list[Block]]:
        """Pop free slots of ``ns`` and pick the blocks to evict for the rest (``n`` in all).

        Order: free slots; growth while the budget allows; then, walking the
        host-wide LRU from the oldest block, either evict blocks of ``ns`` or
        reclaim whole extents of other namespaces (empty ones first) until
        the budget fits a new extent.  Victims are only planned here: the
        caller evicts them into its reservation once every slot-table write
        is done.  When this raises, every popped slot is back (with ``partial``,
        a shortage of room returns the free slots found instead).  (A key the
        same request saw as EXISTS may be among the victims when the request
        needs nearly the whole namespace; its status was true when the call
        began.)
        """
        taken: list[tuple[Extent, int]] = []
        # Slots that clients read without a call stay as they are (csrc/index.c): a
        # free slot's block left the shared index when it was freed, so what the pages
        # hold now is all that can still read it.
        pinned = self.pinned(ns)
        for ext in ns.extents:
            if pinned.hazards:
                kept = []
                while ext.free and len(taken) < n:
                    slot = ext.free.pop()
                    if pinned.slot(ext, slot):
                        kept.append(slot)
                    else:
                        taken.append((ext, slot))
                ext.free.extend(reversed(kept))
            else:
                while ext.free and len(taken) < n:
                    taken.append((ext, ext.free.pop()))
            if len(taken) == n:
                return taken, []
        try:
            try:
                victims = self._find_room(ns, n, len(taken), may_grow=may_grow, pinned=pinned)
            except CapacityExhausted:
                if partial:
                    return taken, []
                raise
            if ns.pages and victims and ns.index.shared is not None:
                # Victims leave the table before the pages are read again: a client
                # that leased one meanwhile is seen now, or sees it gone.
                for block in victims:
                    ns.index.shared.hide(block.key)
                now = self.pinned(ns)
                if any(now.slot(b.extent, b.slot) for b in victims):
                    self._unhide(ns, victims)
                    raise _Raced()
            return taken, victims
        except BaseException:
            for ext, slot in reversed(taken):
                ext.free.append(slot)
            raise

    def _revoke_idle_grants(self, exts: Sequence[Extent]) -> None:
        """Take back the untaken grants in extents about to be reclaimed, all or none:
        a writer that took one meanwhile (the page's compare-and-swap says so) puts
        back the ones already taken back, and ``_Raced``."""
        revoked: list[tuple[Session, int, int]] = []

        def put_back() -> None:
            for s2, g2, w2 in revoked:
                page2 = s2.ns.pages.get(s2.id)
                if page2 is not None:
                    page2.set_grant(g2, w2)

        for ext in exts:
            idle = self._idle_grants_in(ext)
            if len(idle) != ext.reserved - len(ext.quarantine):
                put_back()  # a writer took one since the plan was made
                raise _Raced()
            for session, g in idle:
                page = session.ns.pages.get(session.id)
                e, slot, _gen = session.grants[g]
                word = _grant_word(e, slot)
                if page is not None and not page.revoke_grant(g, word):
                    put_back()
                    raise _Raced()
                revoked.append((session, g, word))
        # Applied: the slots go back (the extents' reserved counts drop to their
        # quarantine, which retirement drops with them).
        by_session: dict[int, tuple[Session, list[int]]] = {}
        for session, g, _word in revoked:
            by_session.setdefault(session.id, (session, []))[1].append(g)
        for session, entries in by_session.values():
            self._end_grants(session, entries)

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
            blocks = [b for b in owner.index.values() if b.extent is ext]
            if owner.index.shared is not None:
                for block in blocks:
                    owner.index.shared.hide(block.key)
            hidden.append((owner, blocks))
        pins: dict[str, Pinned] = {}
        for ext in exts:
            owner = self.namespaces[ext.segment.namespace]
            if owner.pages:
                if owner.name not in pins:
                    pins[owner.name] = self.pinned(owner)
                if pins[owner.name].extent(ext):
                    for other, blocks in hidden:
                        self._unhide(other, blocks)
                    raise _Raced()
        return hidden

    def _unhide(self, ns: Namespace, blocks: Iterable[Block]) -> None:
        """Put back in the table the victims of a plan that did not go ahead."""
        shared = ns.index.shared
        if shared is not None:
            for block in blocks:
                if ns.index.get(block.key) is block:
                    shared.add(block.key, _locate(block))

    def _find_room(self, ns: Namespace, n: int, got: int, *, may_grow: bool,
                   pinned: Pinned) -> list[Block]:
        """The blocks of ``ns`` to evict for the ``n - got`` slots no free list had, or raise:
        ``_NeedExtent`` to grow first (after reclaiming other namespaces' extents, if
        that funds the growth), ``NeedDemotion`` or ``CapacityExhausted``."""
        short = n - got
        # A namespace at its DRAM quota neither grows nor reclaims others' extents: it
        # evicts its own blocks (access.namespaces[].dram_quota; checked off the fast path).
        quota = self.dram_quota_of(ns.name)
        held = ns.extent_bytes() if quota else 0
        at_quota = bool(quota) and SegmentLayout.fit(ns.block_bytes, quota - held) is None
        may_grow = may_grow and not at_quota
        # Room in the budget: grow rather than evict.
        if may_grow and SegmentLayout.fit(ns.block_bytes, self.budget_free) is not None:
            raise _NeedExtent(n)
        same_ns: list[Block] = []
        dirty_ns: list[Block] = []  # DIRTY blocks of ns: evictable once demoted
        dirty_ext: list[Extent] = []  # other namespaces' extents blocked only by DIRTY blocks
        spill = self.spill_enabled
        reclaim: list[Extent] = []
        reclaim_bytes = 0

        def funded() -> bool:
            return SegmentLayout.fit(ns.block_bytes, self.budget_free + reclaim_bytes) is not None

        # Extents of other namespaces holding a pinned block (by a call or without one)
        # are never reclaimed: a leased block is never evicted, whoever holds it.
        pins: dict[str, Pinned] = {}

        def leased_in(other: Namespace, ext: Extent) -> bool:
            if ext.pinned:
                return True
            if not other.pages:
                return False
            if other.name not in pins:
                pins[other.name] = self.pinned(other)
            return pins[other.name].extent(ext)

        def unreserved(ext: Extent) -> bool:
            # Reserved slots that are only grants no writer took can be taken back
            # (``_revoke_idle_grants``): they do not hold an extent against reclaim.
            return ext.reserved == 0 or ext.reserved == len(self._idle_grants_in(ext))

        if may_grow:
            # Empty extents of other namespaces cost nothing to reclaim (but never
            # take what a namespace that is growing right now just created).
            for other in self.namespaces.values():
                if other is ns or other.grow_lock.locked():
                    continue
                for ext in other.extents:
                    if (not funded() and ext.committed == 0 and unreserved(ext)
                            and not leased_in(other, ext)):
                        reclaim.append(ext)
                        reclaim_bytes += ext.bytes
        considered: set[int] = {id(e) for e in reclaim}
        self.note_reads(ns)  # blocks read without a call are not the least recently used
        for scanned, block in enumerate(self.lru):
            if scanned >= EVICTION_SCAN_LIMIT or len(same_ns) >= short or (reclaim and funded()):
                break
            if block.ns is ns:
                if pinned.block(block):  # the LRU holds no block pinned by a call
                    continue
                if spill and block.lower == Lower.DIRTY:
                    if len(dirty_ns) < short:
                        dirty_ns.append(block)
                else:
                    same_ns.append(block)
            elif may_grow and id(block.extent) not in considered:
                considered.add(id(block.extent))
                ext = block.extent
                if (not block.ns.grow_lock.locked() and unreserved(ext)
                        and not leased_in(block.ns, ext)):
                    if spill and ext.dirty:
                        # In LRU order this extent goes before anything younger: it is
                        # reclaimed once its DIRTY blocks are demoted.
                        dirty_ext.append(ext)
                        if not reclaim:
                            break
                    else:
                        reclaim.append(ext)
                        reclaim_bytes += ext.bytes
        if reclaim and funded():
            hidden = self._hide_for_reclaim(reclaim)  # or _Raced: a client leased meanwhile
            try:
                self._revoke_idle_grants(reclaim)  # or _Raced: a writer took one
            except _Raced:
                for owner, blocks in hidden:
                    self._unhide(owner, blocks)
                raise
            try:
                self._retire_extents(reclaim, "for another namespace")
            finally:
                for name in {e.segment.namespace for e in reclaim}:
                    if name in self.namespaces:
                        self._forget_if_unused(self.namespaces[name])
            raise _NeedExtent(n)
        if len(same_ns) >= short:
            return same_ns[:short]
        if spill:
            # Room comes once DIRTY blocks are demoted: ours, or those holding an extent of
            # another namespace back from reclaim, or the ones being demoted right now.
            wanted = dirty_ns[: short - len(same_ns)]
            if dirty_ext and (len(same_ns) + len(dirty_ns) < short or not reclaim):
                ext = dirty_ext[0]
                owner = self.namespaces[ext.segment.namespace]
                wanted += [b for b in owner.index.values()
                           if b.extent is ext and b.lower == Lower.DIRTY]
            in_flight = any(s.leases for s in self._system_sessions.values())
            if wanted or in_flight:
                raise NeedDemotion(ns, short - len(same_ns), wanted)
        if at_quota:
            raise CapacityExhausted(
                f"namespace {ns.name!r} is at its DRAM quota ({held} of {quota} bytes): {n} "
                f"slots needed, {got + len(same_ns)} obtainable by evicting its own "
                f"blocks ({ns.leased} leased and {ns.reserved} reserved blocks cannot be "
                "evicted)")
        raise CapacityExhausted(
            f"DRAM is full for namespace {ns.name!r}: {n} slots needed, "
            f"{got + len(same_ns)} obtainable ({ns.leased} leased and "
            f"{ns.reserved} reserved blocks in this namespace cannot be evicted)"
        )

    async def _grow(self, ns: Namespace, need: int) -> bool:
        """Add extents to ``ns`` from the global budget until ``need`` slots are free.

        File creation and pre-faulting run off the loop.  The budget and the
        extent number are taken before (growths of other namespaces run
        meanwhile) and given back when creation fails; a reserve cancelled
        meanwhile gives them back too, and the file, once made, is removed.
        Extents added before a failing one stay (capacity, not state).  False
        when nothing could be added (the caller then evicts).  Free slots that a
        client still reads without a call (hazards) are not free for this: a reserve
        skips them, so counting them would end its growth rounds in an eviction
        while the budget still had room.
        """
        async with ns.grow_lock:
            while self._usable_free(ns) < need:
                room = self.budget_free
                quota = self.dram_quota_of(ns.name)
                if quota:  # never grow past the namespace's DRAM quota
                    room = min(room, quota - ns.extent_bytes())
                layout = SegmentLayout.fit(ns.block_bytes, min(room, max(
                    self.extent_size, SegmentLayout.one_slot_file_bytes(ns.block_bytes))))
                if layout is None:
                    break
                self.budget_free -= layout.file_bytes
                index = ns.next_extent_index
                ns.next_extent_index += 1
                seg_id = next(self._segment_ids)
                loop = asyncio.get_running_loop()
                made = loop.run_in_executor(None, self._factory, ns, index, layout, seg_id)
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
                self.add_extent(ns, segment)
            return self._usable_free(ns) > 0

    def _usable_free(self, ns: Namespace) -> int:
        """Free slots of ``ns`` a reserve may take now (those under no hazard)."""
        pinned = self.pinned(ns)
        if not pinned.hazards:
            return ns.free_slots()
        return sum(1 for ext in ns.extents for slot in ext.free if not pinned.slot(ext, slot))

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
        n = segment.layout.n_slots
        ext = Extent(segment, list(range(n - 1, -1, -1)), [0] * n)
        ns.extents.append(ext)
        ns.segments_version += 1
        self.prefault_seconds += segment.prefault_seconds
        if segment.mlock_error is not None:
            self.mlock_errors.append(segment.mlock_error)

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
            assert ext.pinned == 0 and ext.reserved == len(ext.quarantine), (
                f"extent in use: {ext.pinned} pinned, {ext.reserved} reserved, "
                f"{len(ext.quarantine)} quarantined")
        for ext in exts:
            ext.segment.unlink()
        # Applied: nothing below can fail.
        evicted: list[Block] = []
        for ext in exts:
            owner = self.namespaces[ext.segment.namespace]
            for block in [b for b in owner.index.values() if b.extent is ext]:
                self._drop_from_index(block)
                evicted.append(block)
            # A late writer of a previous run writes into the unlinked file: harmless.
            ext.reserved -= len(ext.quarantine)
            owner.reserved -= len(ext.quarantine)
            ext.quarantine.clear()
            owner.extents.remove(ext)
            owner.segments_version += 1
            self.budget_free += ext.bytes
            log.info("reclaimed extent %d of namespace %r (%d bytes) %s",
                     ext.segment.index, owner.name, ext.bytes, why)
            self._close_later(ext.segment)
        self._report_evicted(evicted)

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
