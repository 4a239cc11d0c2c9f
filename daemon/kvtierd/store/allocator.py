"""The allocator: room for a reserve or a refill -- free slots, growth (asked of the
budget), eviction of the namespace's blocks (CLOCK), reclaim of other namespaces'
extents -- taken all or nothing; retirement of extents; and the one exit of DRAM
blocks (eviction).

A component the store holds (``Store.room``), given the store's state and budget;
the calls (``kvtierd.store.operations``) and the fast path (``kvtierd.store.fast_path``)
call ``claim_refs``; the others are for reclaim and the admin's evict."""


from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvtier import _slot_ref
from kvtier.errors import CapacityExhausted
from kvtierd.block_table import Policy, extent_ids
from kvtierd.logs import event
from kvtierd.segments import SegmentLayout
from kvtierd.store.base import Pinned, StoreOptions, _NeedExtent, _Raced, _refs
from kvtierd.store.budget import Budget
from kvtierd.store.grants import take_back_untaken, untaken_in
from kvtierd.store.state import StoreState
from kvtierd.store.types import (
    Block,
    BlockBatch,
    Extent,
    Lower,
    Namespace,
    NeedDemotion,
    Victims,
)

log = logging.getLogger(__name__)

#: ``victims`` calls one plan may make (each does bounded work; a short answer is
#: asked again, and what is still short after these is not there to evict).
VICTIM_ROUNDS = 4


def offsets(ns: Namespace, refs: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Each ref's slot offset in its data file (what clients address)."""
    slots = _slot_ref.slots_of(refs)
    out = slots * np.uint64(ns.slot_bytes)
    segments = None  # each ref's extent id, once an extent of another layout needs it
    for ext_id in extent_ids(refs):  # an extent of another layout (recovered): its own
        slot_bytes = ns.by_id[ext_id].segment.layout.slot_bytes
        if slot_bytes != ns.slot_bytes:
            if segments is None:
                segments = _slot_ref.segments_of(refs)
            at = segments == ext_id
            out[at] = slots[at] * np.uint64(slot_bytes)
    return out


def blocks_of(ns: Namespace, ext: Extent) -> list[Block]:
    """Handles of ``ext``'s COMMITTED blocks."""
    return ns.blocks_at(ns.table.committed(ext.id))


def dirty_of(ns: Namespace, ext: Extent) -> BlockBatch:
    """``ext``'s COMMITTED DIRTY blocks."""
    refs = ns.table.committed(ext.id)
    if len(refs):
        refs = refs[ns.table.inspect(refs)["lower"] == Lower.DIRTY]
    return ns.batch_at(refs)


def _victims(ns: Namespace, n: int, pinned: Pinned, *, spill: bool) -> Victims:
    """Up to ``n`` evictable blocks of ``ns`` by CLOCK (with ``spill``, non-DIRTY
    only), none pinned by a call or a hazard.  The table's work per call is bounded:
    a short answer is asked again a few times."""
    skip = pinned.skip()
    chosen = np.zeros(0, dtype=np.uint64)
    final = ns.table.clock_scans_all()  # (then one call's short answer is all there is)
    for _ in range(VICTIM_ROUNDS):
        more = ns.table.victims(n - len(chosen), Policy.CLOCK, spill=spill,
                                skip=chosen if skip is None else np.concatenate([skip, chosen]))
        chosen = np.concatenate([chosen, more])
        if len(chosen) >= n or not len(more) or final:
            break
    return Victims(ns, chosen)  # (COMMITTED and unpinned: their keys read when asked)


class Allocator:
    """Finding room: ``claim_refs`` takes slots all or nothing (free, grown, evicted,
    reclaimed).  Runs on the event loop thread; nothing here awaits (growth does:
    ``Budget.grow``, which the caller awaits when a claim raises ``_NeedExtent``)."""

    def __init__(self, state: StoreState, budget: Budget, *, options: StoreOptions,
                 on_evict: Callable[[Block], None] | None = None,
                 on_evicted: Callable[[str, int], None] | None = None) -> None:
        self._state = state
        self._budget = budget
        self._options = options
        #: Hears each evicted block's handle (tests and models; a handle per block costs)
        #: and each eviction's count per namespace (the daemon's metrics).
        self._on_evict = on_evict
        self._on_evicted = on_evicted
        #: Blocks evicted so far (read by metrics at scrape time).
        self.evictions = 0

    # ------------------------------------------------ claims
    def claim_refs(self, ns: Namespace, n: int, *, may_grow: bool, partial: bool = False,
                   ahead: bool = True
                   ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """Take ``n`` slots of ``ns`` into the RESERVED state (free ones first, then the
        blocks ``_take_slots`` chose are evicted into them), all or nothing: their refs
        and new generations.  With ``partial``, fewer (the free ones) rather than raise
        when no more room can be made now.  Without ``ahead`` the caller decides about
        growth ahead (``Budget.start_ahead``) once it holds the slots.

        Raises ``_NeedExtent`` (grow first: ``Budget.grow``, then claim again),
        ``_Raced`` (a client leased a planned victim: claim again), ``NeedDemotion``
        or ``CapacityExhausted``; nothing changed then (but extents reclaimed)."""
        try:
            free, victims, pinned = self._take_slots(ns, n, may_grow=may_grow, partial=partial)
        except _NeedExtent:
            if partial:  # grants ahead: the writer's next reserve finds the extent (being) made
                self._budget.start_ahead(ns, n)
            raise
        # Applied: the table's calls below were validated by the plan (on the loop,
        # nothing changed since) and change every slot or none.
        vrefs = victims.refs
        if victims and (self._on_evict is not None or ns.index.wants_keys):
            victims.read()  # (before their slots change)
        try:
            # One call: the free slots and the victims (evicted into this claim), or none.
            refs, short = ns.table.claim(free, pinned.skip(), evict=vrefs if victims else None)
        except BaseException:
            if victims.hidden:
                ns.index.unhide_refs(vrefs)
            raise
        assert short == 0, f"{short} free slots vanished since the plan"
        if victims:
            self._drop_from_index(ns, victims.keys if victims.is_read else None,
                                  len(victims), hidden=victims.hidden)
            refs = np.concatenate([refs, vrefs])
            self._report_evicted(ns, victims)
        gens = ns.table.inspect(refs)["generation"]
        if self._budget.grow_ahead and ahead:
            self._budget.start_ahead(ns, n)
        return refs, gens

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
        pinned = self._state.pinned(ns)
        free = min(n, pinned.free_slots())
        if free == n:
            return n, Victims.none(ns), pinned
        try:
            victims = self._find_room(ns, n, free, may_grow=may_grow, pinned=pinned)
        except CapacityExhausted:
            if partial:
                return free, Victims.none(ns), pinned
            raise
        if len(victims):
            ns.index.hide_refs(victims.refs)
            victims.hidden = True
            if ns.pages:
                now = self._state.pinned(ns)
                if now.any_slot(victims.refs):
                    ns.index.unhide_refs(victims.refs)
                    raise _Raced()
                pinned = now
        return free, victims, pinned

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
        state = self._state
        short = n - got
        at_quota = self._budget.at_quota(ns)
        may_grow = may_grow and not at_quota
        if may_grow and self._budget.grows_first(ns):
            raise _NeedExtent(n)
        spill = state.spill_enabled
        state.note_reads(ns)  # blocks read without a call get their CLOCK bit first
        same_ns = _victims(ns, short, pinned, spill=spill)
        reclaim: list[Extent] = []
        dirty_ext: list[Extent] = []  # other namespaces' extents blocked only by DIRTY blocks
        if may_grow:
            reclaim, dirty_ext = self._plan_reclaim(ns, same_ns, short)
        if reclaim:
            hidden = self._hide_for_reclaim(reclaim)  # or _Raced: a client leased meanwhile
            try:
                self._revoke_idle_grants(reclaim)  # or _Raced: a writer took one
            except _Raced:
                for owner, refs in hidden:
                    owner.index.unhide_refs(refs)
                raise
            try:
                self.retire_extents(reclaim, "for another namespace")
            finally:
                for name in {e.segment.namespace for e in reclaim}:
                    if name in state.namespaces:
                        state.forget_if_unused(state.namespaces[name])
            raise _NeedExtent(n)
        if dirty_ext and (len(same_ns) < short
                          or dirty_ext[0].counts().newest_access < same_ns.oldest()):
            # Another namespace's extent, older than what CLOCK would evict here, waits
            # only for its DIRTY blocks to be demoted: demote them, then reclaim it.
            ext = dirty_ext[0]
            raise NeedDemotion(ns, short, dirty_of(state.namespaces[ext.segment.namespace],
                                                   ext))
        if len(same_ns) >= short:
            return same_ns[:short]
        if spill:
            # Room comes once DIRTY blocks are demoted: ours, or those holding an extent of
            # another namespace back from reclaim, or the ones being demoted right now.
            skip = pinned.skip()
            want = short - len(same_ns)
            refs = ns.table.dirty(want, Policy.CLOCK, skip=skip)
            wanted = ns.batch_at(refs)
            in_flight = any(s.leases for s in state.system_sessions.values())
            if wanted or in_flight:
                raise NeedDemotion(ns, short - len(same_ns), wanted)
        if at_quota:
            raise CapacityExhausted(
                f"namespace {ns.name!r} is at its DRAM quota ({ns.extent_bytes()} of "
                f"{self._options.dram_quota_of(ns.name)} bytes): {n} "
                f"slots needed, {got + len(same_ns)} obtainable by evicting its own "
                f"blocks ({ns.leased} leased and {ns.reserved} reserved blocks cannot be "
                "evicted)")
        raise CapacityExhausted(
            f"DRAM is full for namespace {ns.name!r}: {n} slots needed, "
            f"{got + len(same_ns)} obtainable ({ns.leased} leased and "
            f"{ns.reserved} reserved blocks in this namespace cannot be evicted)"
        )

    # ------------------------------------------------ reclaim of other namespaces' extents
    def _plan_reclaim(self, ns: Namespace, same_ns: Victims, short: int
                      ) -> tuple[list[Extent], list[Extent]]:
        """Other namespaces' extents to reclaim for ``ns`` (enough to fund one extent of
        it, or none), and those that only DIRTY blocks keep from it (spill).  Never an
        extent with a pinned block (by a call or a hazard), reservations that are not
        idle grants, or one of a namespace growing right now."""
        state = self._state
        reclaim: list[Extent] = []
        reclaim_bytes = 0

        def funded() -> bool:
            return SegmentLayout.fit(ns.block_bytes,
                                     self._budget.free_bytes + reclaim_bytes) is not None

        pins: dict[str, Pinned] = {}
        candidates: list[tuple[int, Extent]] = []
        dirty_ext: list[tuple[int, Extent]] = []
        for other in state.namespaces.values():
            if other is ns or other.grow_lock.locked():
                continue
            for ext in other.extents:
                c = ext.counts()
                if c.pinned or not (c.reserved == 0
                                    or c.reserved == len(untaken_in(ext, state.namespaces,
                                                                    state.sessions))):
                    continue
                if other.pages:
                    if other.name not in pins:
                        pins[other.name] = state.pinned(other)
                    if pins[other.name].extent(ext):
                        continue
                if state.spill_enabled and c.dirty:
                    dirty_ext.append((c.newest_access, ext))
                else:
                    candidates.append((0 if c.committed == 0 else c.newest_access, ext))
        if not candidates:  # (the usual case: nothing to weigh, no layout to fit)
            dirty_ext.sort(key=lambda t: t[0])
            return [], [e for _, e in dirty_ext]
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

    def _revoke_idle_grants(self, exts: Sequence[Extent]) -> None:
        """Take back the untaken grants in extents about to be reclaimed, all or none
        (``grants.take_back_untaken``); ``_Raced`` when a writer took one meanwhile."""
        if not take_back_untaken(exts, self._state.namespaces, self._state.sessions):
            raise _Raced()

    def _hide_for_reclaim(self, exts: Sequence[Extent]
                          ) -> list[tuple[Namespace, npt.NDArray[np.uint64]]]:
        """Take the blocks of other namespaces' extents about to be reclaimed out of
        their shared tables, then read those namespaces' pages again: a client that
        leased one of their slots meanwhile is seen now (the blocks go back, and
        ``_Raced``: plan again) or sees the blocks gone (the hazard handshake of
        ``_take_slots``, across namespaces).  Returns the refs it hid, by namespace, for
        ``Keys.unhide_refs``."""
        namespaces = self._state.namespaces
        hidden: list[tuple[Namespace, npt.NDArray[np.uint64]]] = []
        for ext in exts:
            owner = namespaces[ext.segment.namespace]
            if not owner.pages:
                continue
            refs = owner.table.committed(ext.id)
            owner.index.hide_refs(refs)
            hidden.append((owner, refs))
        pins: dict[str, Pinned] = {}
        for ext in exts:
            owner = namespaces[ext.segment.namespace]
            if owner.pages:
                if owner.name not in pins:
                    pins[owner.name] = self._state.pinned(owner)
                if pins[owner.name].extent(ext):
                    for other, refs in hidden:
                        other.index.unhide_refs(refs)
                    raise _Raced()
        return hidden

    # ------------------------------------------------ retirement
    def retire_extents(self, exts: Sequence[Extent], why: str) -> None:
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
            owner = self._state.namespaces[ext.segment.namespace]
            blocks = owner.victims_at(owner.table.committed(ext.id))
            self._drop_from_index(owner, blocks.keys, len(blocks))
            # (handles, when a hook wants them, before the extent is gone)
            evicted.append((owner, blocks.blocks() if self._on_evict is not None else blocks))
            # A late writer of a previous run writes into the unlinked file: harmless.
            ext.quarantine.clear()
            owner.table.remove_extent(ext.id, force=True)  # before the segment closes
            owner.extents.remove(ext)
            del owner.by_id[ext.id]
            owner.segments_version += 1
            log.info("reclaimed extent %d of namespace %r (%d bytes) %s",
                     ext.segment.index, owner.name, ext.bytes, why)
            self._budget.give_back(ext)
        for owner, gone in evicted:
            self._report_evicted(owner, gone)

    def reformat(self, ns: Namespace, why: str) -> None:
        """Drop a namespace nobody uses yet: every extent retired, its files removed.

        A failure part-way (removing a file) keeps the namespace; the next
        declaration reformats it again."""
        assert ns.sessions == 0
        self.retire_extents(list(ns.extents), "(namespace reformatted)")
        self._state.drop_namespace(ns)
        log.warning("namespace %r reformatted: %s", ns.name, why,
                    extra=event("namespace_reformatted", namespace=ns.name, reason=why))
        self._state.dropped_segments.append(f"namespace {ns.name!r} reformatted: {why}")

    # ------------------------------------------------ the one exit of DRAM blocks
    def evict_block(self, block: Block) -> bool:
        """Evict one DRAM block on an admin's request (``kvtier evict``), through the
        same exit as eviction for room.  False, changing nothing, when the block is
        leased or no longer visible."""
        ns = block.ns
        if block.pins or block.doomed or ns.index.get(block.key) != block:
            return False
        ns.table.evict(_refs([(block.extent, block.slot)]))  # or nothing changes
        self._drop_from_index(ns, [block.key], 1)
        self._report_evicted(ns, [block])
        return True

    def _drop_from_index(self, ns: Namespace, keys: list[bytes] | None, n: int, *,
                         hidden: bool = False) -> None:
        """The index's part of an eviction of ``n`` blocks (the one exit of DRAM blocks;
        the spill tiers turn it into demotion): their keys leave (``hidden``: the shared
        table let go of them already; then None when nothing else wants the keys,
        ``Keys.wants_keys``).  The table's part is the caller's."""
        if keys is not None:
            ns.index.remove(keys, hidden=hidden)
        self.evictions += n

    def _report_evicted(self, ns: Namespace, blocks: Victims | Sequence[Block]) -> None:
        """Tell ``on_evicted`` (a count) and ``on_evict`` (each block's handle: made only
        for that hook) of applied evictions; a hook that raises is a bug logged here, it
        never fails (or half-undoes) the call that evicted."""
        if self._on_evicted is not None and len(blocks):
            try:
                self._on_evicted(ns.name, len(blocks))
            except Exception:
                log.exception("on_evicted hook failed for %r", ns.name)
        if self._on_evict is None:
            return
        for block in blocks.blocks() if isinstance(blocks, Victims) else blocks:
            try:
                self._on_evict(block)
            except Exception:
                log.exception("on_evict hook failed for a block of %r", block.ns.name)
