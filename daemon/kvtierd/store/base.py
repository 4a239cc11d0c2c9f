"""What the store's parts share: its options (``StoreOptions``), the one answer to "is
it pinned?" (``Pinned``), ``_Undo`` (the all-or-nothing persist phase), and the
internal signals between a claim and the call that made it."""


from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
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
    hazard_of,
)
from kvtierd.store.types import (
    Block,
    Extent,
    Namespace,
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

    def free_slots(self) -> int:
        """Free slots of the namespace a reserve may take now (those under no hazard)."""
        ns = self._ns
        free = ns.free_slots()
        skip = self.skip()
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
