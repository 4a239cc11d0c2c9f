"""The store's data types: namespaces, extents, blocks, sessions, reservations, leases,
and the results and limits of its operations (no behaviour but small properties)."""


from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Final, TypeAlias

import numpy as np
import numpy.typing as npt

from kvtier import _slot_ref
from kvtier.errors import (
    CapacityExhausted,
)
from kvtierd.access import Identity
from kvtierd.block_table import ENTRY_DTYPE, PREFETCHED, BlockTable, Counts
from kvtierd.counters import ClientReported
from kvtierd.segments import (
    Segment,
    SlotState,
)
from kvtierd.shared_index import (
    HazardSet,
    SessionPage,
)
from kvtierd.store.grants import GrantBook
from kvtierd.store.keys import Keys

log = logging.getLogger(__name__)



#: Grow/reclaim rounds one reserve may take before it settles for eviction;
#: each round adds or reclaims at least one extent, so this bounds its work.
MAX_GROW_ROUNDS: Final = 64


COMMITTED_STATE: Final = int(SlotState.COMMITTED)


class Lower(enum.IntEnum):
    """What the tiers below DRAM hold of a block (``Block.lower``)."""

    DIRTY = 0  # DRAM is the only copy
    CLEAN = 1  # a spill tier holds a durable copy: eviction loses nothing
    UNSPILLABLE = 2  # spilling failed: evicted like a block without spill tiers


class NeedDemotion(CapacityExhausted):
    """A reserve in ``ns`` fits only after ``blocks`` (DIRTY) are demoted, or after the
    demotions in flight finish (``blocks`` empty)."""

    def __init__(self, ns: Namespace, short: int, blocks: BlockBatch) -> None:
        super().__init__(f"DRAM is full for namespace {ns.name!r}: {short} slots wait for "
                         "blocks to be demoted to a spill tier")
        self.ns = ns
        self.short = short
        self.blocks = blocks


class ReserveStatus(enum.IntEnum):
    """Per-key outcome of a reserve (values match the wire enum)."""

    RESERVED = 1
    EXISTS = 2
    IN_FLIGHT = 3


@dataclasses.dataclass(frozen=True, slots=True)
class Peer:
    """Who is on the other end of a session channel (from SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


@dataclasses.dataclass(eq=False, slots=True)
class Extent:
    """One segment of a namespace; its slots' state is in the namespace's ``BlockTable``
    (named by the segment id), their durable fields in the segment's slot table."""

    segment: Segment
    table: BlockTable
    # Slots found RESERVED at recovery, or reserved by a writer who outlived its
    # reservation: a writer may still be copying into them, so they are reused
    # only after the reservation TTL (slot -> monotonic deadline).
    quarantine: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def id(self) -> int:
        """Its segment id: the high half of its blocks' refs."""
        return self.segment.segment_id

    @property
    def n_slots(self) -> int:
        return self.segment.layout.n_slots

    @property
    def bytes(self) -> int:
        return self.segment.layout.file_bytes

    def counts(self) -> Counts:
        """Its slots by category (the table's, O(1))."""
        return self.table.counts(self.segment.segment_id)

    @property
    def reserved(self) -> int:
        """RESERVED slots (quarantined ones included)."""
        return self.counts().reserved

    @property
    def committed(self) -> int:
        """Slots holding committed data (doomed blocks still pinned included)."""
        return self.counts().committed

    @property
    def pinned(self) -> int:
        """Slots with a pin by a call."""
        return self.counts().pinned

    @property
    def dirty(self) -> int:
        """Committed blocks whose only copy is DRAM (``Lower.DIRTY``)."""
        return self.counts().dirty

    @property
    def free(self) -> int:
        return self.counts().free


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """A committed block as the store names it: a handle made when asked for, never kept
    (its state is in the namespace's ``BlockTable``, its fields in the slot table).

    Two handles are equal when they name the same slot at the same generation: a
    handle of a block that left DRAM (and whose slot was reused) equals no current
    one.  ``pins``, ``doomed``, ``lower`` and ``prefetched`` are read from the table
    now (a call each: not for hot paths).
    """

    ns: Namespace = dataclasses.field(repr=False)
    key: bytes
    extent: Extent = dataclasses.field(repr=False)
    slot: int
    length: int
    checksum: int | None
    generation: int

    @property
    def ref(self) -> int:
        return _slot_ref.encode(self.extent.segment.segment_id, self.slot)

    def _record(self) -> tuple[int, int, int, int] | None:
        """(state, lower, flags, pins) while the slot holds this block, else None."""
        if self.extent not in self.ns.extents:
            return None
        row = self.ns.table.inspect([self.ref])[0]
        if int(row["generation"]) != self.generation:
            return None
        return int(row["state"]), int(row["lower"]), int(row["flags"]), int(row["pins"])

    @property
    def pins(self) -> int:
        rec = self._record()
        return 0 if rec is None else rec[3]

    @property
    def doomed(self) -> bool:
        """Deleted while pinned (freed at its last unpin), or gone from DRAM."""
        rec = self._record()
        return rec is None or rec[0] != COMMITTED_STATE

    @property
    def lower(self) -> Lower:
        rec = self._record()
        return Lower.DIRTY if rec is None else Lower(rec[1])

    @property
    def prefetched(self) -> bool:
        rec = self._record()
        return rec is not None and bool(rec[2] & PREFETCHED)


@dataclasses.dataclass(eq=False, slots=True)
class Namespace:
    """A namespace: its declared layout, extents, block table and key index."""

    name: str
    block_bytes: int
    model_uid: str
    slot_bytes: int
    extents: list[Extent] = dataclasses.field(default_factory=list)
    #: Every slot's state (``kvtierd.block_table``): made in ``__post_init__``.
    table: BlockTable = dataclasses.field(init=False)
    #: The key index: the shared index clients search, checked against slot entries.
    index: Keys = dataclasses.field(init=False)
    #: The keys of its open reservations (Reserve calls), each in exactly one: a
    #: Reserve or page commit of one of them is IN_FLIGHT.
    in_flight: InFlight = dataclasses.field(default_factory=lambda: InFlight())
    next_extent_index: int = 0
    segments_version: int = 1
    sessions: int = 0
    #: Keys of Acquire calls the daemon found and did not find (the daemon's own count;
    #: what clients report of their acquires without a call is in ``reported``).
    hits: int = 0
    misses: int = 0
    #: What its clients report doing without a call (their pages' counters), bounded,
    #: never verified, never in a host-wide figure (``kvtierd.counters``); made when its
    #: first session page is attached (its clock starts then: no client counted before).
    reported: ClientReported | None = None
    recovered: int = 0  # blocks re-adopted from a previous run's segments
    # False while the layout only comes from recovered segments: the first
    # declaration of this boot may then differ, and reformats the namespace.
    declared: bool = False
    grow_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    #: Session id -> the page where its client leases blocks without a call (hazards).
    pages: dict[int, SessionPage] = dataclasses.field(default_factory=dict)
    #: The hazards its pages held when last read (``collect_hazards``'s ``last``).
    hazards: HazardSet | None = None
    #: Segment id -> extent.
    by_id: dict[int, Extent] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.table = BlockTable(self.block_bytes, self.slot_bytes)
        self.index = Keys(self)

    @property
    def reserved(self) -> int:
        return self.table.counts().reserved

    @property
    def committed(self) -> int:
        """Slots holding committed data (doomed included)."""
        return self.table.counts().committed

    @property
    def leased(self) -> int:
        """Blocks pinned by calls."""
        return self.table.counts().pinned

    def extent_bytes(self) -> int:
        """DRAM this namespace holds: the bytes of its extents (what a quota caps)."""
        return sum(ext.bytes for ext in self.extents)

    def free_slots(self) -> int:
        return self.table.n_free

    def block_at(self, ref: int) -> Block | None:
        """The handle of the block at ``ref`` (COMMITTED or DOOMED), else None."""
        ext = self.by_id.get(_slot_ref.segment_of(ref))
        slot = _slot_ref.slot_of(ref)
        if ext is None or slot >= ext.n_slots:
            return None
        rec = ext.segment.read_slot(slot)
        if rec.state not in (SlotState.COMMITTED, SlotState.DOOMED):
            return None
        return Block(self, rec.key, ext, slot, rec.length, rec.checksum, rec.generation)

    def batch_at(self, refs: npt.NDArray[np.uint64]) -> BlockBatch:
        """``blocks_at`` as a ``BlockBatch`` (one table call, no handle made)."""
        return self.victims_at(refs).batch()

    def visible(self) -> BlockBatch:
        """Every visible (COMMITTED) block, extent by extent (one table call each and
        one for their entries: no handle made)."""
        parts = [self.table.committed(ext.id) for ext in self.extents]
        return self.batch_at(np.concatenate(parts) if parts else _NO_REFS)

    def blocks_at(self, refs: npt.NDArray[np.uint64]) -> list[Block]:
        """``block_at`` of each ref (those naming no COMMITTED or DOOMED block left out),
        reading the slot entries in one table call."""
        return self.victims_at(refs).blocks()

    def victims_at(self, refs: npt.NDArray[np.uint64]) -> Victims:
        """The COMMITTED or DOOMED blocks at ``refs`` as columns (one table call)."""
        refs = np.asarray(refs, dtype=np.uint64)
        keys, rows = self.table.entries(refs)  # (ValueError for a ref naming no slot)
        state = rows["state"]
        live = (state == COMMITTED_STATE) | (state == _DOOMED_STATE)
        if not live.all():
            at = np.flatnonzero(live)
            refs, rows = refs[at], rows[at]
            keys = [keys[i] for i in at.tolist()]
        return Victims(self, refs, keys, rows)


_DOOMED_STATE: Final = int(SlotState.DOOMED)
_NO_REFS: Final = np.zeros(0, dtype=np.uint64)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class BlockBatch:
    """Committed blocks of ONE namespace as columns: what the tiering layer moves, pins
    and marks (``Store.demotion_candidates``, ``pin_blocks``, ``set_lower_many``), in
    place of a ``Block`` handle per block.

    Block ``i`` is the one at slot ref ``refs[i]`` (encoded and decoded by
    ``kvtier._slot_ref`` only) at generation ``gens[i]``: a batch naming a block that
    left DRAM (its slot reused since) names no current one.  ``keys``, ``lengths`` and
    ``checksums`` (``has_checksum[i]``: one was given at commit) are as the slot entry
    held them when the batch was read.
    """

    ns: Namespace = dataclasses.field(repr=False)
    refs: npt.NDArray[np.uint64]
    gens: npt.NDArray[np.uint64]
    keys: list[bytes]
    lengths: npt.NDArray[np.uint64]
    checksums: npt.NDArray[np.uint64]
    has_checksum: npt.NDArray[np.bool_]

    @classmethod
    def none(cls, ns: Namespace) -> BlockBatch:
        return cls(ns, _NO_REFS, _NO_REFS, [], _NO_REFS, _NO_REFS, np.zeros(0, dtype=bool))

    @classmethod
    def of_blocks(cls, ns: Namespace, blocks: Sequence[Block]) -> BlockBatch:
        """The batch of handles of ``ns`` (cold paths: one block at a time, the commit
        path's handles)."""
        n = len(blocks)
        return cls(ns,
                   np.fromiter((b.ref for b in blocks), dtype=np.uint64, count=n),
                   np.fromiter((b.generation for b in blocks), dtype=np.uint64, count=n),
                   [b.key for b in blocks],
                   np.fromiter((b.length for b in blocks), dtype=np.uint64, count=n),
                   np.fromiter((b.checksum or 0 for b in blocks), dtype=np.uint64, count=n),
                   np.fromiter((b.checksum is not None for b in blocks), dtype=bool, count=n))

    @classmethod
    def concat(cls, ns: Namespace, batches: Sequence[BlockBatch]) -> BlockBatch:
        """The blocks of ``batches`` (all of ``ns``), in order."""
        if len(batches) == 1:
            return batches[0]
        if not batches:
            return cls.none(ns)
        return cls(ns, np.concatenate([b.refs for b in batches]),
                   np.concatenate([b.gens for b in batches]),
                   [k for b in batches for k in b.keys],
                   np.concatenate([b.lengths for b in batches]),
                   np.concatenate([b.checksums for b in batches]),
                   np.concatenate([b.has_checksum for b in batches]))

    def __len__(self) -> int:
        return len(self.refs)

    def take(self, at: slice | npt.NDArray[np.intp] | npt.NDArray[np.bool_]) -> BlockBatch:
        """The blocks at ``at`` (a slice, indexes or a mask), in that order."""
        if isinstance(at, slice):
            keys = self.keys[at]
        else:
            idx = np.flatnonzero(at) if at.dtype == np.bool_ else at
            keys = [self.keys[i] for i in idx.tolist()]
        return BlockBatch(self.ns, self.refs[at], self.gens[at], keys, self.lengths[at],
                          self.checksums[at], self.has_checksum[at])

    def checksum(self, i: int) -> int | None:
        """Block ``i``'s checksum, None when none was given at commit."""
        return int(self.checksums[i]) if self.has_checksum[i] else None

    def checksum_list(self) -> list[int | None]:
        """``checksum`` of each block."""
        return [c if has else None for c, has in zip(self.checksums.tolist(),
                                                     self.has_checksum.tolist(), strict=True)]

    def place(self, i: int) -> tuple[Extent, int]:
        """Block ``i``'s extent and slot (the extent must still be the namespace's)."""
        ref = int(self.refs[i])
        return self.ns.by_id[_slot_ref.segment_of(ref)], _slot_ref.slot_of(ref)

    def held(self) -> npt.NDArray[np.bool_] | None:
        """Which blocks' extents are still the namespace's (None: all of them, the
        usual answer, found with one look per extent)."""
        segments = _slot_ref.segments_of(self.refs)
        ids = np.unique(segments)
        by_id = self.ns.by_id
        gone = [s for s in ids.tolist() if s not in by_id]
        return None if not gone else ~np.isin(segments, np.array(gone, dtype=np.uint64))

    def doomed(self, at: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        """Whether each block at ``at`` was deleted (doomed while pinned) or left DRAM:
        ``Block.doomed`` of each, in one table read."""
        part = self.take(at)
        held = part.held()
        out = np.ones(len(part), dtype=bool)
        if held is not None:
            part = part.take(held)
        if len(part):
            rows = self.ns.table.inspect(part.refs)
            still = (rows["generation"] == part.gens) & (rows["state"] == COMMITTED_STATE)
            if held is None:
                out = ~still
            else:
                out[held] = ~still
        return out

    def same(self, other: BlockBatch) -> npt.NDArray[np.bool_]:
        """Which of these blocks ``other`` names too (same ref at the same generation;
        ``other``'s refs distinct)."""
        if not len(other) or not len(self) or other.ns is not self.ns:
            return np.zeros(len(self), dtype=bool)
        order = np.argsort(other.refs, kind="stable")
        sorted_refs = other.refs[order]
        at = np.minimum(np.searchsorted(sorted_refs, self.refs), len(other) - 1)
        found: npt.NDArray[np.bool_] = ((sorted_refs[at] == self.refs)
                                        & (other.gens[order[at]] == self.gens))
        return found

    def first_of_each(self) -> BlockBatch:
        """Each block once (its first appearance), in order."""
        if len(self) < 2:
            return self
        _, first = np.unique(self.refs, return_index=True)
        if len(first) == len(self):
            return self
        return self.take(np.sort(first))

    def blocks(self) -> list[Block]:
        """Handles of its blocks whose extent is still the namespace's (cold paths)."""
        ns, by_id = self.ns, self.ns.by_id
        out = []
        for i, ref in enumerate(self.refs.tolist()):
            ext = by_id.get(_slot_ref.segment_of(ref))
            if ext is not None:
                out.append(Block(ns, self.keys[i], ext, _slot_ref.slot_of(ref),
                                 int(self.lengths[i]), self.checksum(i), int(self.gens[i])))
        return out


class Victims:
    """Blocks of one namespace as columns (an eviction plan's victims): refs, and their
    keys and slot entries (``ENTRY_DTYPE``) read in one table call, when first asked for
    (an eviction needs them only for the KV events, the handles hook or keys kept
    outside the shared table: ``Keys.hide_refs`` takes the victims out by slot);
    handles only when asked for (``blocks``)."""

    __slots__ = ("ns", "refs", "_keys", "_rows", "hidden")

    def __init__(self, ns: Namespace, refs: npt.NDArray[np.uint64],
                 keys: list[bytes] | None = None, rows: npt.NDArray[np.void] | None = None
                 ) -> None:
        """``keys`` and ``rows`` as ``BlockTable.entries`` reads them (None: read when
        asked; the refs name COMMITTED blocks, as the table's victims do)."""
        self.ns = ns
        self.refs = refs
        self._keys = keys
        self._rows = rows
        #: Their keys are out of the shared table already (``Keys.hide_refs``, before
        #: the hazard check): their removal is then no second pass over the table.
        self.hidden = False

    @classmethod
    def none(cls, ns: Namespace) -> Victims:
        return cls(ns, np.zeros(0, dtype=np.uint64), [], np.zeros(0, dtype=ENTRY_DTYPE))

    def read(self) -> Victims:
        """Read their keys and slot entries now (before their slots change)."""
        if self._keys is None or self._rows is None:
            self._keys, self._rows = self.ns.table.entries(self.refs)
        return self

    @property
    def is_read(self) -> bool:
        return self._keys is not None

    @property
    def keys(self) -> list[bytes]:
        keys = self.read()._keys
        assert keys is not None
        return keys

    @property
    def rows(self) -> npt.NDArray[np.void]:
        rows = self.read()._rows
        assert rows is not None
        return rows

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, at: slice) -> Victims:
        return Victims(self.ns, self.refs[at], None if self._keys is None else self._keys[at],
                       None if self._rows is None else self._rows[at])

    def oldest(self) -> int:
        """The oldest last access among them (2**64 when there are none)."""
        return int(self.rows["last_access"].min()) if len(self.refs) else 2**64

    def batch(self) -> BlockBatch:
        """The victims as a ``BlockBatch`` (their entries as read: no handle made)."""
        rows = self.rows
        return BlockBatch(self.ns, self.refs, rows["generation"].astype(np.uint64),
                          self.keys, rows["length"].astype(np.uint64),
                          rows["checksum"].astype(np.uint64),
                          rows["has_checksum"].astype(bool))

    def blocks(self) -> list[Block]:
        ns = self.ns
        by_id = ns.by_id
        rows = self.rows
        return [Block(ns, key, by_id[_slot_ref.segment_of(r)], _slot_ref.slot_of(r), length, c if has else None, gen)
                for r, key, length, c, has, gen in zip(
                    self.refs.tolist(), self.keys, rows["length"].tolist(),
                    rows["checksum"].tolist(), rows["has_checksum"].tolist(),
                    rows["generation"].tolist(), strict=True)]


@dataclasses.dataclass(eq=False, slots=True)
class Reservation:
    """Reserved slots of one session, as columns: key i is written into ``refs[i]``,
    reserved at generation ``gens[i]``."""

    id: int
    session: Session
    keys: list[bytes]
    refs: npt.NDArray[np.uint64]
    gens: npt.NDArray[np.uint64]
    expires: float
    started: float = 0.0  # the store's clock at Reserve (the metrics' hold time)

    @property
    def places(self) -> list[tuple[Extent, int, int]]:
        """(extent, slot, generation) per key (handles for the paths off the hot one)."""
        by_id = self.session.ns.by_id
        return [(by_id[_slot_ref.segment_of(r)], _slot_ref.slot_of(r), g)
                for r, g in zip(self.refs.tolist(), self.gens.tolist(), strict=True)]


class InFlight:
    """The keys of a namespace's open reservations (``Namespace.in_flight``), each in
    exactly one.  A reservation's keys come in as its list (``open``) and are folded
    into one set only when a question needs it (a Reserve or a page commit of the
    namespace while others are open): a writer that reserves and commits one batch at
    a time never hashes a key here.  Iteration, ``in`` and ``intersection`` see every
    open reservation's keys."""

    __slots__ = ("_set", "_lists")

    def __init__(self) -> None:
        self._set: set[bytes] = set()
        #: Reservation id -> its keys, not folded into ``_set`` yet.
        self._lists: dict[int, list[bytes]] = {}

    def open(self, rid: int, keys: list[bytes]) -> None:
        """Reservation ``rid`` of ``keys`` (none of them in flight) opened."""
        self._lists[rid] = keys

    def close(self, rid: int, keys: list[bytes]) -> None:
        """Reservation ``rid`` of ``keys`` ended (committed, aborted, expired, closed)."""
        if self._lists.pop(rid, None) is not None:
            return
        if len(keys) == len(self._set):  # (the only one folded: every key is its own)
            self._set.clear()
        else:
            self._set.difference_update(keys)

    def _folded(self) -> set[bytes]:
        if self._lists:
            for keys in self._lists.values():
                self._set.update(keys)
            self._lists.clear()
        return self._set

    def intersection(self, keys: Iterable[bytes]) -> set[bytes]:
        return self._folded().intersection(keys)

    def __contains__(self, key: object) -> bool:
        return key in self._folded()

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._folded()))

    def __len__(self) -> int:
        return len(self._set) + sum(map(len, self._lists.values()))

    def __bool__(self) -> bool:
        return bool(self._set) or bool(self._lists)

    def clear(self) -> None:
        """Forget every key (tests: a corrupted store)."""
        self._set.clear()
        self._lists.clear()


@dataclasses.dataclass(eq=False, slots=True)
class Lease:
    """Pins on blocks of one namespace (``refs``: one pin each, a block may repeat)."""

    id: int
    session: Session
    refs: npt.NDArray[np.uint64]
    expires: float
    started: float = 0.0  # the store's clock at Acquire (the metrics' hold time)

    @property
    def ns(self) -> Namespace:
        return self.session.ns

    def blocks(self) -> list[Block]:
        """Handles of its blocks (made now: not for hot paths)."""
        return [b for r in self.refs.tolist() if (b := self.ns.block_at(r)) is not None]


@dataclasses.dataclass(eq=False, slots=True)
class Session:
    id: int
    token: str
    ns: Namespace
    peer: Peer
    opened: float
    leases: dict[int, Lease] = dataclasses.field(default_factory=dict)
    reservations: dict[int, Reservation] = dataclasses.field(default_factory=dict)
    closed: bool = False
    # The tiering layer's own session (promotions, demotion pins): no client,
    # no token, no TTL on what it holds.
    system: bool = False
    # What the peer may do here (kvtierd.access.Right bits) and who it is (uid and
    # groups as the kernel told the session channel), set before the client gets
    # the token; admin calls made with this session's token are judged by ``ident``.
    rights: int = 7
    ident: Identity | None = None
    #: Slots reserved ahead for this session's writer (csrc/writes.c) and all that
    #: ends them (``kvtierd.store.grants``): made in ``__post_init__``.
    grants: GrantBook = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.grants = GrantBook(self)


@dataclasses.dataclass(frozen=True, slots=True)
class Commits:
    """The commit transition's input as columns (a Commit call's or a page's records):
    the reserved (or granted) slots ``refs`` at generations ``gens`` become blocks
    ``keys[i]`` of ``lengths[i]`` bytes; ``checksums``: None (none given), or one per
    block (None where that one has none)."""

    refs: npt.NDArray[np.uint64]
    gens: npt.NDArray[np.uint64]
    keys: list[bytes]
    lengths: npt.NDArray[np.uint64]
    checksums: Sequence[int | None] | npt.NDArray[np.uint64] | None

    def __len__(self) -> int:
        return len(self.keys)


@dataclasses.dataclass(frozen=True, slots=True)
class SlotGrant:
    """Where a reserved or leased block's bytes are, for the wire."""

    segment_id: int
    offset: int
    length: int
    checksum: int | None


#: A commit's lengths or checksums: a list of ints, or a uint64 column (a large commit's,
#: read from the wire in C: ``kvtier._wire.columns``).
U64s: TypeAlias = Sequence[int] | npt.NDArray[np.uint64]


@dataclasses.dataclass(frozen=True, slots=True)
class ReserveResult:
    """Per key a status; per RESERVED key (in key order) a slot of ``capacity`` bytes at
    ``offsets[i]`` of segment ``segment_ids[i]``."""

    reservation_id: int
    statuses: list[int]
    segment_ids: npt.NDArray[np.uint64]
    offsets: npt.NDArray[np.uint64]
    capacity: int
    segments_version: int

    @property
    def slots(self) -> list[SlotGrant]:
        """The slots as ``SlotGrant``s (one object each: not for the hot path)."""
        return [SlotGrant(s, o, self.capacity, None)
                for s, o in zip(self.segment_ids.tolist(), self.offsets.tolist(), strict=True)]


@dataclasses.dataclass(frozen=True, slots=True)
class AcquireResult:
    """Per leased block (the prefix, in key order) its segment, offset, length and
    checksum (``has_checksum[i]``: one was given at commit)."""

    lease_id: int
    segment_ids: npt.NDArray[np.uint64]
    offsets: npt.NDArray[np.uint64]
    lengths: npt.NDArray[np.uint64]
    checksums: npt.NDArray[np.uint64]
    has_checksum: npt.NDArray[np.uint8]
    segments_version: int

    @property
    def slots(self) -> list[SlotGrant]:
        """The slots as ``SlotGrant``s (one object each: not for the hot path)."""
        return [SlotGrant(s, o, n, c if h else None) for s, o, n, c, h in zip(
            self.segment_ids.tolist(), self.offsets.tolist(), self.lengths.tolist(),
            self.checksums.tolist(), self.has_checksum.tolist(), strict=True)]

    @property
    def hits(self) -> int:
        return len(self.offsets)


@dataclasses.dataclass(frozen=True, slots=True)
class AdoptedSlots:
    """A previous run's slot table as ``tests/unit/slot_oracle.scan_slots`` validated it."""

    # One entry per block to adopt, in the same order in each list (columns: a
    # quarter of a million blocks adopt in a fraction of a second).
    slots: list[int]
    keys: list[bytes]
    lengths: list[int]
    checksums: list[int | None]
    #: the persisted last access (which blocks were read most recently)
    last_access: list[int]
    #: RESERVED slots: quarantined for the reservation TTL, then freed
    reserved: list[int]
    #: free slots
    free: list[int]
    #: every slot's generation (in range)
    generations: list[int]


@dataclasses.dataclass(slots=True)
class PageCommits:
    """What one ring of a session's page did (``FastPath.commit_from_page``; each
    record's answer is a ``grants.CommitResult``)."""

    records: int = 0  # commit records found (0: an empty ring, or an impossible head)
    committed: int = 0  # blocks made
    #: Their handles (only while ``Store.commit_handles``; a tuple when none: no list
    #: made at every ring).
    blocks: Sequence[Block] = ()
    nbytes: int = 0  # their bytes


#: Retired data files kept (an fd each) until their grace is over; past this many the
#: oldest is cut at once.
MAX_KEPT_RETIRED: Final = 256
#: Blocks read without a call that one ``note_reads`` marks as read (the pages'
#: rings are hints the clients write: past this many the rest are dropped).
MAX_READ_HINTS: Final = 4096

