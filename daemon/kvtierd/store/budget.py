"""The DRAM budget and the extents drawn from it: growth of a namespace (for a reserve,
and ahead of need), accounting of extents added (created or adopted), and the files of
retired extents (unmapped off the loop, cut to 0 bytes after a grace).

A component the store holds (``Store.budget``), given the store's state; the allocator
(``kvtierd.store.allocator``) asks it whether to grow first and gives retired extents'
bytes back to it."""


from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import math
from collections.abc import Callable

from kvtier.errors import CapacityExhausted
from kvtierd.logs import event
from kvtierd.segments import Segment, SegmentLayout, cut_data_file
from kvtierd.store.base import ExtentFactory, StoreOptions, _close_quietly
from kvtierd.store.grants import granted_in
from kvtierd.store.state import StoreState
from kvtierd.store.types import MAX_KEPT_RETIRED, Extent, Namespace

log = logging.getLogger(__name__)

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


class Budget:
    """The global DRAM budget (``dram.capacity``) and the extents made from it.

    Every byte of ``capacity`` is in exactly one of: ``free_bytes``, an extent being
    made (``growing_bytes``), or an extent of some namespace.  Runs on the event loop
    thread; extent creation and unmapping go to an executor.
    """

    def __init__(self, state: StoreState, *, capacity: int, extent_size: int,
                 extent_factory: ExtentFactory, retired_grace: float,
                 options: StoreOptions) -> None:
        self._state = state
        self._options = options
        self._clock = state.clock
        self.capacity = capacity
        self.extent_size = extent_size
        self._factory = extent_factory
        #: Bytes of the budget in no extent.
        self.free_bytes = capacity
        #: Bytes of extents being made now (out of ``free_bytes``, in no extent yet).
        self.growing_bytes = 0
        #: How long a retired data file keeps its size (punched: it reads as zeros)
        #: before it is cut to 0 bytes: past a reservation's and a lease's TTL, no
        #: honest client still writes or reads it, so only then does a touch fault.
        self.retired_grace = retired_grace
        self._segment_ids = itertools.count(1)
        #: Told of every extent added (``Store.attach_cluster``).
        self.on_extent: Callable[[Segment], None] | None = None
        #: Growth ahead of need on now: ``options.grow_ahead``, until ``stop_growth``.
        self.grow_ahead = options.grow_ahead
        #: Extents made ahead of need so far.
        self.grown_ahead = 0
        self._ahead_paused_until = float("-inf")
        #: The growth ahead in flight, per namespace (at most one each).
        self._ahead: dict[Namespace, asyncio.Task[None]] = {}
        #: Extent creations in flight (``stop_growth`` waits for them).
        self._making: set[asyncio.Future[Segment]] = set()
        self._retiring: set[asyncio.Future[int | None]] = set()
        #: Retired data files to cut to 0 bytes, in order: (when, a duplicate of its fd).
        self._to_cut: collections.deque[tuple[float, int]] = collections.deque()
        self.mlock_errors: list[str] = []
        self.prefault_seconds = 0.0

    def new_segment_id(self) -> int:
        return next(self._segment_ids)

    # ------------------------------------------------ what a claim asks
    def at_quota(self, ns: Namespace) -> bool:
        """A namespace at its DRAM quota neither grows nor reclaims others' extents: it
        evicts its own blocks (access.namespaces[].dram_quota; checked off the fast path)."""
        quota = self._options.dram_quota_of(ns.name)
        return bool(quota) and SegmentLayout.fit(ns.block_bytes,
                                                 quota - ns.extent_bytes()) is None

    def grows_first(self, ns: Namespace) -> bool:
        """Room in the budget, or an extent of this namespace being made (ahead of need, or
        for another reserve; its bytes are out of the budget already): a claim short of
        free slots grows, or waits for that growth, rather than evict."""
        return (ns.grow_lock.locked()
                or SegmentLayout.fit(ns.block_bytes, self.free_bytes) is not None)

    def _usable_free(self, ns: Namespace) -> int:
        return self._state.pinned(ns).free_slots()

    # ------------------------------------------------ growth for a reserve
    async def grow(self, ns: Namespace, need: int) -> bool:
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
        room = self.free_bytes
        quota = self._options.dram_quota_of(ns.name)
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
        self.free_bytes -= layout.file_bytes
        self.growing_bytes += layout.file_bytes
        index = ns.next_extent_index
        ns.next_extent_index += 1
        seg_id = self.new_segment_id()
        loop = asyncio.get_running_loop()
        made = loop.run_in_executor(None, self._factory, ns, index, layout, seg_id)
        self._making.add(made)
        made.add_done_callback(self._making.discard)
        try:
            segment = await asyncio.shield(made)
        except BaseException as exc:
            self.free_bytes += layout.file_bytes
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
        if self._state.namespaces.get(ns.name) is not ns:
            self.free_bytes += layout.file_bytes
            self._discard_made(made)
            return False
        self.add_extent(ns, segment)
        return True

    def _discard_made(self, made: asyncio.Future[Segment]) -> None:
        """Remove a segment made for a reserve that was cancelled meanwhile."""
        if made.cancelled() or made.exception() is not None:
            return
        segment = made.result()
        fut = asyncio.get_running_loop().run_in_executor(None, _close_quietly, segment, True)
        self._retiring.add(fut)
        fut.add_done_callback(self._retiring.discard)

    async def growths_elsewhere(self, ns: Namespace) -> bool:
        """Wait (bounded) for the growths of namespaces other than ``ns`` in flight now
        -- ahead of need, or a reserve's own -- to end.  False when there were none."""
        others = [o for o in self._state.namespaces.values()
                  if o is not ns and o.grow_lock.locked()]
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

    # ------------------------------------------------ growth ahead of need
    # (on with ``StoreOptions.grow_ahead``)
    def start_ahead(self, ns: Namespace, took: int) -> None:
        """After a claim of ``took`` slots of ``ns``: when it left fewer free slots than
        the larger of ``took`` (the next claim is likely as large) and
        ``GROW_AHEAD_FRACTION`` of a full extent's, and the budget and the quota have
        room, start one background growth to that mark (none while one is in flight).
        It only ever takes unused budget: it never evicts nor reclaims, and a reserve
        that needs room meanwhile waits for it (``grow_lock``) rather than evict."""
        one_slot = SegmentLayout.one_slot_file_bytes(ns.block_bytes)
        if not self.grow_ahead or ns in self._ahead or self.free_bytes < one_slot:
            return  # (DRAM full, the steady state: this much per claim)
        full = SegmentLayout.fit(ns.block_bytes, max(self.extent_size, one_slot))
        want = max(took, math.ceil((full.n_slots if full else 1) * GROW_AHEAD_FRACTION))
        if (ns.free_slots() + granted_in(ns, self._state.sessions) >= want
                or self._clock() < self._ahead_paused_until
                or self._state.namespaces.get(ns.name) is not ns
                or self._next_layout(ns) is None):
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
                    if (not self.grow_ahead or self._state.namespaces.get(ns.name) is not ns
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

    # ------------------------------------------------ extents in and out
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
        if self.on_extent is not None:
            self.on_extent(segment)

    def take(self, nbytes: int) -> None:
        """An adopted extent's bytes leave the budget (``adoption.adopt_segment``, which
        checked they fit)."""
        self.free_bytes -= nbytes

    def give_back(self, ext: Extent) -> None:
        """A retired extent's bytes come back, and its segment is unmapped off the loop
        (``drain`` waits for it); its data file is cut to 0 bytes ``retired_grace``
        later (``cut_retired``)."""
        self.free_bytes += ext.bytes
        segment = ext.segment
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

    def cut_retired(self, *, everything: bool = False) -> None:
        """Cut the retired data files whose grace is over (all, with ``everything``)."""
        now = self._clock()
        while self._to_cut and (everything or self._to_cut[0][0] <= now):
            cut_data_file(self._to_cut.popleft()[1])

    async def drain(self) -> None:
        """Wait for extents being retired in the background."""
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)
