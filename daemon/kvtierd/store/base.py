"""The store's state and the primitives every layer uses: namespaces and their shared
indexes, pins and their accounting, the one exit of DRAM blocks, what clients hold
without a call (hazards; grants are ``kvtierd.store.grants``'), and ``_Undo`` (the
all-or-nothing persist phase)."""


from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType

import numpy as np
import numpy.typing as npt

from kvtier import _slot_ref
from kvtierd.segments import (
    Segment,
    SegmentLayout,
)
from kvtierd.shared_index import (
    HAZARD_BIT,
    HazardSet,
    collect_hazards,
    hazard_of,
)
from kvtierd.store.types import (
    MAX_READ_HINTS,
    Block,
    Commits,
    Extent,
    Lease,
    Namespace,
    Peer,
    Reservation,
    Session,
    Victims,
)

log = logging.getLogger(__name__)

_NO_REFS = np.zeros(0, dtype=np.uint64)
_HAZARD_BIT64 = np.uint64(HAZARD_BIT)



class _Raced(Exception):
    """Internal signal: a client leased a planned victim (a hazard) while the plan was
    made; plan again (the hazard is seen then)."""


def _refs(places: Iterable[tuple[Extent, int]]) -> npt.NDArray[np.uint64]:
    """The refs of (extent, slot) places."""
    return np.fromiter((_slot_ref.encode(e.segment.segment_id, slot) for e, slot in places),
                       dtype=np.uint64)


class _NeedExtent(Exception):
    """Internal signal: the reserve fits only after growing ``slots`` more free slots."""

    def __init__(self, slots: int) -> None:
        super().__init__(slots)
        self.slots = slots


class _Undo:
    """The slot-table writes of one store call so far, and how to take each back.

    ``with _Undo() as undo:`` around a call's persist phase; each write first
    adds its inverse (so a write that fails half-way is taken back too), and
    when anything in the block raises, the inverses run newest first and the
    error goes on.  An inverse that fails itself is logged (``check()`` will
    then report that slot) and the others still run.
    """

    __slots__ = ("_steps",)

    def __init__(self) -> None:
        self._steps: list[tuple[Callable[..., object], tuple[object, ...]]] = []

    def add(self, fn: Callable[..., object], *args: object) -> None:
        self._steps.append((fn, args))

    def __enter__(self) -> _Undo:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            return
        for fn, args in reversed(self._steps):
            try:
                fn(*args)
            except Exception:
                log.exception("could not take back a slot-table write (%s%r) after %r; "
                              "check() reports that slot until it is freed", fn, args, exc)


def _close_quietly(segment: Segment, unlink: bool, keep_fd: bool = False) -> int | None:
    """Close a segment the store no longer holds, and free its memory whoever still
    holds an fd (worker thread): nothing waits for the result, so a failure is logged
    here.  ``keep_fd``: a duplicate of its data fd, to cut the file to 0 later."""
    try:
        return segment.close(unlink=unlink, free=True, keep_fd=keep_fd)
    except OSError as exc:
        log.warning("closing segment %s failed: %s", segment.path, exc)
        return None


#: Creates a segment file for (namespace, extent index, layout, segment id); blocking I/O.
ExtentFactory = Callable[[Namespace, int, SegmentLayout, int], Segment]


class Pinned:
    """The one answer to "is it pinned?" in a namespace, as of when it was made.

    A block is pinned by a lease made with a call (its pin count, ``Block.pins``,
    and its extent's ``pinned`` count) or without one (a hazard naming its slot in
    a client's page, read after a full fence when this is made).  A free slot can
    be named by a hazard too (a client that leased its block just before it was
    freed): it is not reused while it is.  Nothing pinned is evicted, reclaimed or
    reused.
    """

    __slots__ = ("_ns", "hazards", "_segments")

    def __init__(self, ns: Namespace, hazards: HazardSet) -> None:
        self._ns = ns
        #: The hazards of ``ns``'s pages (``hazard_of`` values).
        self.hazards = hazards
        self._segments: set[int] | None = None

    def slot(self, ext: Extent, slot: int) -> bool:
        """A client leases ``slot`` of ``ext`` without a call."""
        return bool(self.hazards) and hazard_of(ext.segment.segment_id, slot) in self.hazards

    def any_slot(self, refs: npt.NDArray[np.uint64]) -> bool:
        """A client leases one of ``refs``' slots without a call."""
        return bool(self.hazards) and self.hazards.any_of(
            np.asarray(refs, dtype=np.uint64) | _HAZARD_BIT64)

    def block(self, block: Block) -> bool:
        return block.pins > 0 or self.slot(block.extent, block.slot)

    def skip(self) -> npt.NDArray[np.uint64] | None:
        """The hazards as refs the table skips (None: none), sorted."""
        if not self.hazards:
            return None
        return self.hazards.refs

    def extent(self, ext: Extent) -> bool:
        """Some block of ``ext`` is pinned.  A hazard counts only where it names a slot
        the extent has (a page's garbage, say random slot numbers in real segments,
        pins no extent)."""
        if ext.pinned:
            return True
        if not self.hazards:
            return False
        if self._segments is None:
            self._segments = self._named_segments()
        return ext.segment.segment_id in self._segments

    def _named_segments(self) -> set[int]:
        """The ids of ``ns``'s segments one of whose slots a hazard names (numpy
        throughout: a client's hazards may be thousands)."""
        extents = self._ns.extents
        if not extents:
            return set()
        ids = np.array([e.segment.segment_id for e in extents], dtype=np.uint64)
        n_slots = np.array([e.n_slots for e in extents], dtype=np.uint64)
        order = np.argsort(ids)
        ids, n_slots = ids[order], n_slots[order]
        segs, slots = _slot_ref.split(self.hazards.refs)
        segs &= np.uint64(_slot_ref.SEGMENT_MASK)
        at = np.minimum(np.searchsorted(ids, segs), len(ids) - 1)
        named = (ids[at] == segs) & (slots < n_slots[at])
        return set(np.unique(segs[named]).tolist())

    def blocks(self) -> int:
        """Blocks leased, by calls or without (a hazard is a block)."""
        return self._ns.leased + len(self.hazards)


def _no_quota(name: str) -> int:
    return 0


def _forget_nothing(name: str) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """What the daemon decides about a store beyond its sizes, given to its constructor
    (``Store(..., options=StoreOptions(...))``); a store made without one (tests,
    benchmarks) has these defaults.  What is only known once the store exists is told
    by a method instead: the tiers below it (``attach_tiering``), the cluster tier
    (``attach_cluster``), recovery's figures (``set_recovery_report``)."""

    #: Namespace name -> its DRAM quota in bytes (0: none); the daemon's come from the
    #: access rules.  Consulted only when a reserve finds no free slot.
    dram_quota_of: Callable[[str], int] = _no_quota
    #: Grow namespaces ahead of need (``dram.grow_ahead``); without it a namespace grows
    #: only when a reserve needs the room.
    grow_ahead: bool = False
    #: Called with the name of a namespace the store forgot (metrics drop its series).
    on_forget: Callable[[str], None] = _forget_nothing


class StoreBase:
    """The store's state and primitives (``kvtierd.store``'s docstring tells the whole).

    All methods run on the event loop thread; the only awaits are extent
    creation/retirement (blocking I/O sent to an executor).
    """

    def __init__(
        self,
        *,
        capacity: int,
        extent_size: int,
        extent_factory: ExtentFactory,
        lease_ttl: float,
        reservation_ttl: float,
        boot_epoch: int,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[Block], None] | None = None,
        on_evicted: Callable[[str, int], None] | None = None,
        publish: bool = False,
        grant_bytes: int = 0,
        options: StoreOptions = StoreOptions(),
    ) -> None:
        self.options = options
        self.capacity = capacity
        #: Bytes of slots each session with a write page may hold reserved ahead.
        self.grant_bytes = grant_bytes
        self.extent_size = extent_size
        self.lease_ttl = lease_ttl
        self.reservation_ttl = reservation_ttl
        self.boot_epoch = boot_epoch
        self._factory = extent_factory
        self._clock = clock
        #: Hears each evicted block's handle (tests and models; a handle per block costs)
        #: and each eviction's count per namespace (the daemon's metrics).
        self._on_evict = on_evict
        self._on_evicted = on_evicted
        #: Prefetched blocks first read without a call (tiering counts those read by calls).
        self.prefetched_reads = 0
        #: Publish each namespace's keys in a shared index its clients search.
        self.publish = publish
        self.namespaces: dict[str, Namespace] = {}
        self.sessions: dict[int, Session] = {}
        self._system_sessions: dict[str, Session] = {}
        self._spill_enabled = False
        self._by_token: dict[str, Session] = {}
        self.budget_free = capacity
        self._ids = itertools.count(1)
        self._segment_ids = itertools.count(1)
        #: The next access sequence number (persisted as a slot's last access).
        self._next_access = 1
        #: The newest last access adopted so far (``finish_recovery`` goes on from it).
        self._last_adopted = 0
        #: Page commits return handles of the blocks they made (the tiering layer turns
        #: this off unless it publishes every commit: a handle per block costs).
        self.commit_handles = True
        self._reservations: dict[int, Reservation] = {}
        self._leases: dict[int, Lease] = {}
        self._retiring: set[asyncio.Future[int | None]] = set()
        #: Retired data files to cut to 0 bytes, in order: (when, a duplicate of its fd).
        self._to_cut: collections.deque[tuple[float, int]] = collections.deque()
        # event counters (read by metrics at scrape time)
        self.evictions = 0
        #: Slots granted ahead per namespace, since metrics last took them (``take_granted``).
        self.granted: collections.Counter[str] = collections.Counter()
        self.mlock_errors: list[str] = []
        self.prefault_seconds = 0.0
        #: Recovery's figures (``set_recovery_report``); ``dropped_segments`` also
        #: hears of namespaces reformatted later.
        self.recovery_seconds = 0.0
        self.dropped_segments: list[str] = []
        #: Hears every key that comes into or goes out of DRAM (``watch``).
        self._watch: Callable[[str, str, list[bytes], bool], None] | None = None
        # ------------------------------------------------ growth (``room``)
        #: Told of every extent added (``attach_cluster``).
        self._on_extent: Callable[[Segment], None] | None = None
        #: Growth ahead of need on now: ``options.grow_ahead``, until ``stop_growth``.
        self.grow_ahead = options.grow_ahead
        #: Extents made ahead of need so far.
        self.grown_ahead = 0
        #: Bytes of extents being made now (out of ``budget_free``, in no extent yet).
        self.growing_bytes = 0
        self._ahead_paused_until = float("-inf")
        #: The growth ahead in flight, per namespace (at most one each).
        self._ahead: dict[Namespace, asyncio.Task[None]] = {}
        #: Extent creations in flight (``stop_growth`` waits for them).
        self._making: set[asyncio.Future[Segment]] = set()

    def attach_tiering(self, *, spill: bool, commit_handles: bool) -> None:
        """Told by the tiering layer, which is built over the store (so not a constructor
        option): ``spill``, a spill tier exists (evict only non-DIRTY blocks, and a miss
        in a shared index is not final: the key may be below DRAM); ``commit_handles``,
        page commits return handles of the blocks they made (only for a write-through
        publish: a handle per block costs)."""
        self._spill_enabled = spill
        for ns in self.namespaces.values():
            ns.index.table.set_lower_tiers(spill)
        self.commit_handles = commit_handles

    def attach_cluster(self, on_extent: Callable[[Segment], None]) -> None:
        """Tell ``on_extent`` of every extent added from now on (the cluster tier maps it
        into its agent; called on the event loop, so it must not block).  A method, not
        a constructor option: the cluster tier is made after the store, whose live
        segments it maps."""
        self._on_extent = on_extent

    def set_recovery_report(self, seconds: float, dropped: Sequence[str]) -> None:
        """Recovery's figures (Stats, metrics): the time it took and the segments it
        dropped.  A method, not a constructor option: recovery adopts into the store, so
        its figures exist only once the store does."""
        self.recovery_seconds = seconds
        self.dropped_segments = list(dropped)

    @property
    def spill_enabled(self) -> bool:
        """A spill tier exists (``attach_tiering``): evict only non-DIRTY blocks (and a
        miss in a shared index is not final: the key may be below DRAM)."""
        return self._spill_enabled

    def _new_namespace(self, name: str, block_bytes: int, model_uid: str,
                       slot_bytes: int, *, publish: bool = True) -> Namespace:
        ns = Namespace(name, block_bytes, model_uid, slot_bytes)
        if publish:
            self._publish(ns)
        self._watch_namespace(ns)
        self.namespaces[name] = ns
        return ns

    def watch(self, changed: Callable[[str, str, list[bytes], bool], None] | None) -> None:
        """Tell ``changed(namespace, "dram", keys, stored)`` every key that comes into
        (stored) or goes out of DRAM from now on: the KV events (``kvtierd.events``)."""
        self._watch = changed
        for ns in self.namespaces.values():
            self._watch_namespace(ns)

    def _watch_namespace(self, ns: Namespace) -> None:
        changed = self._watch
        ns.index.watch = None if changed is None else functools.partial(changed, ns.name, "dram")

    def _publish(self, ns: Namespace) -> None:
        """Let ``ns``'s clients search its key index (when the store publishes)."""
        ns.index.table.set_lower_tiers(self._spill_enabled)
        ns.index.published = self.publish and ns.index.table.fd is not None

    @staticmethod
    def _unpublish(ns: Namespace) -> None:
        ns.index.published = False

    def _drop_namespace(self, ns: Namespace) -> None:
        del self.namespaces[ns.name]
        ns.index.table.close()  # its clients see SUPERSEDED and ask the daemon

    def _access(self, n: int) -> int:
        """Take ``n`` access sequence numbers; the first."""
        first = self._next_access
        self._next_access += n
        return first

    def _forget_if_unused(self, ns: Namespace) -> None:
        """Drop a namespace that holds nothing and that nobody uses (no sessions, extents,
        blocks or reservations): thousands of declared-and-abandoned namespaces must not
        grow the index, Stats or /metrics without bound.  Declaring it again starts fresh."""
        if (ns.sessions or ns.extents or ns.committed or ns.reserved or ns.in_flight
                or self.namespaces.get(ns.name) is not ns):
            return
        system = self._system_sessions.get(ns.name)
        if system is not None and (system.leases or system.reservations):
            return
        self._system_sessions.pop(ns.name, None)
        self._drop_namespace(ns)
        self.options.on_forget(ns.name)

    def _hazards(self, ns: Namespace) -> HazardSet:
        """The slots of ``ns`` its clients lease without a call (see csrc/index.c), read
        from the pages now, after a full fence."""
        hazards = collect_hazards(ns.pages.values(), ns.hazards)
        ns.hazards = hazards
        return hazards

    def pinned(self, ns: Namespace) -> Pinned:
        """What is pinned in ``ns`` now, by calls and without (``Pinned``)."""
        return Pinned(ns, self._hazards(ns))

    def held_seconds(self, started: float) -> float:
        """Seconds since ``started`` (a lease's or reservation's), on the store's clock."""
        return self._clock() - started

    def note_reads(self, ns: Namespace) -> None:
        """Mark the blocks ``ns``'s clients read without a call as read (their CLOCK bit
        and persisted last access), from the pages' rings: hints, checked natively."""
        if not ns.pages:
            return
        seen = {v for page in ns.pages.values() for v in page.accessed()}
        if not seen:
            return
        if len(seen) > MAX_READ_HINTS:  # hints: a page full of them costs a bounded sweep
            seen = set(itertools.islice(seen, MAX_READ_HINTS))
        hints = np.fromiter(seen, dtype=np.uint64, count=len(seen))
        _touched, prefetched = ns.table.touch(hints, self._access(len(hints)), hints=True)
        self.prefetched_reads += prefetched

    def _commit(self, ns: Namespace, commits: Commits,
                release: npt.NDArray[np.uint64] = _NO_REFS, *,
                handles: bool | None = None) -> list[Block]:
        """The one commit transition (RESERVED -> COMMITTED), for a Commit call and a
        page's commit records alike: the slot entries (``BlockTable.commit``, with the
        ``release`` slots freed in the same call: all or nothing, ValueError changes
        nothing), then the key index -- the moment a reader can find them.  Returns
        the blocks made (handles; with ``handles`` False or, when None,
        ``commit_handles`` off, none)."""
        if not len(commits):
            if len(release):
                ns.table.release_claims(release)
            return []
        # The keys go in the shared index in the same native call, from the slot entries
        # it just wrote, when the table has room for them (else they go in after, and
        # the table grows for them).
        index = ns.index.table.room_for(len(commits))
        published = ns.table.commit(commits.refs, commits.keys, commits.lengths,
                                    commits.checksums, first_access=self._access(len(commits)),
                                    epoch=self.boot_epoch,
                                    release=release if len(release) else None, index=index)
        if published is None:
            ns.index.add_committed(commits.refs, commits.keys)
        else:
            ns.index.committed_published(commits.refs, commits.keys, *published)
        if not (self.commit_handles if handles is None else handles):
            return []
        sums = commits.checksums
        sums = [None] * len(commits) if sums is None else (
            sums.tolist() if isinstance(sums, np.ndarray) else list(sums))
        by_id = ns.by_id
        return [Block(ns, key, by_id[_slot_ref.segment_of(r)], _slot_ref.slot_of(r), length, c, gen)
                for r, gen, key, length, c in zip(
                    commits.refs.tolist(), commits.gens.tolist(), commits.keys,
                    commits.lengths.tolist(), sums, strict=True)]

    def _pin(self, ns: Namespace, refs: npt.NDArray[np.uint64]) -> None:
        ns.table.pin(refs)

    def _end_leases(self, leases: Sequence[Lease]) -> None:
        """Unpin every block of ``leases`` (a doomed block whose last pin this was is
        freed by the table) and forget them."""
        for lease in leases:
            lease.ns.table.unpin(lease.refs)
            del lease.session.leases[lease.id]
            del self._leases[lease.id]

    def _drop_from_index(self, ns: Namespace, keys: list[bytes], *,
                         hidden: bool = False) -> None:
        """The index's part of an eviction (the one exit of DRAM blocks; the spill tiers
        turn it into demotion): the keys leave (``hidden``: the shared table let go of
        them already).  The table's part is the caller's."""
        ns.index.remove(keys, hidden=hidden)
        self.evictions += len(keys)

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

    def system_session(self, ns: Namespace) -> Session:
        """The tiering layer's session in ``ns`` (created on first use; never expires)."""
        session = self._system_sessions.get(ns.name)
        if session is None or session.ns is not ns:
            session = Session(next(self._ids), "", ns, Peer(0, 0, 0), self._clock(), system=True)
            self._system_sessions[ns.name] = session
        return session

    def live_segments(self) -> list[Segment]:
        """Every DRAM segment in use now (any thread: a snapshot taken under the GIL;
        the cluster tier's agent maps these and lets go of the others)."""
        return [e.segment for ns in list(self.namespaces.values()) for e in list(ns.extents)]

    def new_segment_id(self) -> int:
        return next(self._segment_ids)

    def segments(self, ns: Namespace) -> list[Segment]:
        return [e.segment for e in ns.extents]

    @staticmethod
    def slot_of(block: Block) -> int:
        """``block``'s slot as a client's page names it."""
        return hazard_of(block.extent.segment.segment_id, block.slot)
