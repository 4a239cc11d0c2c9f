"""The store's data types: namespaces, extents, blocks, sessions, reservations, leases,
and the results and limits of its operations (no behaviour but small properties)."""


from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from typing import Final, NamedTuple

from kvtier import _page
from kvtier.errors import (
    CapacityExhausted,
)
from kvtierd.access import Identity
from kvtierd.segments import (
    Segment,
)
from kvtierd.shared_index import (
    KeyIndex,
    SessionPage,
)

log = logging.getLogger(__name__)



#: How many LRU entries one reserve may inspect while looking for victims:
#: bounds the work of a single allocation (STYLE: bounded work per operation).
EVICTION_SCAN_LIMIT: Final = 4096
#: Grow/reclaim rounds one reserve may take before it settles for eviction;
#: each round adds or reclaims at least one extent, so this bounds its work.
MAX_GROW_ROUNDS: Final = 64


class Lower(enum.IntEnum):
    """What the tiers below DRAM hold of a block (``Block.lower``)."""

    DIRTY = 0  # DRAM is the only copy
    CLEAN = 1  # a spill tier holds a durable copy: eviction loses nothing
    UNSPILLABLE = 2  # spilling failed: evicted like a block without spill tiers


class NeedDemotion(CapacityExhausted):
    """A reserve in ``ns`` fits only after ``blocks`` (DIRTY) are demoted, or after the
    demotions in flight finish (``blocks`` empty)."""

    def __init__(self, ns: Namespace, short: int, blocks: list[Block]) -> None:
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
    """One segment of a namespace plus the store's bookkeeping of its slots."""

    segment: Segment
    free: list[int]
    generations: list[int]
    reserved: int = 0  # includes quarantined slots
    committed: int = 0  # includes doomed blocks still pinned
    pinned: int = 0  # slots with pins > 0
    dirty: int = 0  # committed blocks whose only copy is DRAM (Lower.DIRTY)
    # Slots found RESERVED at recovery: a writer of the previous daemon may
    # still be copying into them, so they are reused only after the
    # reservation TTL (slot -> monotonic deadline).
    quarantine: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def n_slots(self) -> int:
        return self.segment.layout.n_slots

    @property
    def bytes(self) -> int:
        return self.segment.layout.file_bytes


@dataclasses.dataclass(eq=False, slots=True)
class Block:
    """A committed block: where it lives and who pins it."""

    ns: Namespace
    key: bytes
    extent: Extent
    slot: int
    length: int
    checksum: int | None
    generation: int
    pins: int = 0
    doomed: bool = False
    lower: Lower = Lower.DIRTY
    prefetched: bool = False  # promoted by a Lookup prefetch, not yet acquired


@dataclasses.dataclass(eq=False, slots=True)
class Namespace:
    """A namespace: its declared layout, extents and key index."""

    name: str
    block_bytes: int
    model_uid: str
    slot_bytes: int
    extents: list[Extent] = dataclasses.field(default_factory=list)
    # Mirrored into the namespace's shared index when the store publishes one.
    index: KeyIndex[Block] = dataclasses.field(default_factory=KeyIndex)
    in_flight: dict[bytes, int] = dataclasses.field(default_factory=dict)  # key -> reservation id
    next_extent_index: int = 0
    segments_version: int = 1
    sessions: int = 0
    reserved: int = 0
    committed: int = 0  # slots holding committed data (doomed included)
    leased: int = 0  # blocks with pins > 0
    hits: int = 0
    misses: int = 0
    recovered: int = 0  # blocks re-adopted from a previous run's segments
    # False while the layout only comes from recovered segments: the first
    # declaration of this boot may then differ, and reformats the namespace.
    declared: bool = False
    grow_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    #: Session id -> the page where its client leases blocks without a call (hazards).
    pages: dict[int, SessionPage] = dataclasses.field(default_factory=dict)

    def extent_bytes(self) -> int:
        """DRAM this namespace holds: the bytes of its extents (what a quota caps)."""
        return sum(ext.bytes for ext in self.extents)

    def free_slots(self) -> int:
        return sum(len(e.free) for e in self.extents)


@dataclasses.dataclass(eq=False, slots=True)
class Reservation:
    id: int
    session: Session
    keys: list[bytes]
    places: list[tuple[Extent, int, int]]  # (extent, slot, generation) per key
    expires: float
    started: float = 0.0  # the store's clock at Reserve (the metrics' hold time)


@dataclasses.dataclass(eq=False, slots=True)
class Lease:
    id: int
    session: Session
    blocks: list[Block]
    expires: float
    started: float = 0.0  # the store's clock at Acquire (the metrics' hold time)


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
    #: Slots reserved ahead for this session's writer (csrc/writes.c): page entry ->
    #: (extent, slot, generation), and when a writer was first seen filling one.
    grants: dict[int, tuple[Extent, int, int]] = dataclasses.field(default_factory=dict)
    grant_seen: dict[int, float] = dataclasses.field(default_factory=dict)
    grants_used: float = 0.0  # the store's clock when a grant was last made or committed


class SlotCommit(NamedTuple):
    """One slot of the commit transition: a reserved (or granted) slot becoming a block."""

    ext: Extent
    slot: int
    gen: int  # the generation the reserve gave the slot
    key: bytes
    length: int
    checksum: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class SlotGrant:
    """Where a reserved or leased block's bytes are, for the wire."""

    segment_id: int
    offset: int
    length: int
    checksum: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class ReserveResult:
    reservation_id: int
    statuses: list[int]
    slots: list[SlotGrant]
    segments_version: int


@dataclasses.dataclass(frozen=True, slots=True)
class AcquireResult:
    lease_id: int
    slots: list[SlotGrant]
    segments_version: int


@dataclasses.dataclass(frozen=True, slots=True)
class AdoptedSlots:
    """A previous run's slot table as ``recovery.scan_slots`` validated it."""

    # One entry per block to adopt, in the same order in each list (columns: a
    # quarter of a million blocks adopt in a fraction of a second).
    slots: list[int]
    keys: list[bytes]
    lengths: list[int]
    checksums: list[int | None]
    #: the persisted last access (LRU order)
    last_access: list[int]
    #: RESERVED slots: quarantined for the reservation TTL, then freed
    reserved: list[int]
    #: free slots
    free: list[int]
    #: every slot's generation (in range)
    generations: list[int]


class CommitResult(enum.IntEnum):
    """A commit record's result byte in the page (``csrc/index.h``'s ``KVT_W_*``)."""

    COMMITTED = _page.COMMITTED
    EXISTS = _page.EXISTS  # the key was present (or being written): the grant stays
    INVALID = _page.INVALID  # the record's batch was malformed: nothing of it committed
    LOST = _page.LOST  # a grant of the batch is no longer this session's (expired)
    FAILED = _page.FAILED  # the daemon could not write the slot table: nothing committed


@dataclasses.dataclass(slots=True)
class PageCommits:
    """What one ring of a session's page did (``FastPath.commit_from_page``)."""

    records: int = 0  # commit records found (0: an empty ring, or an impossible head)
    blocks: list[Block] = dataclasses.field(default_factory=list)  # the blocks made
    nbytes: int = 0  # their bytes


#: Grants nobody committed into for this long go back (an idle writer holds no room).
GRANT_IDLE_SECONDS: Final = 5.0


#: Retired data files kept (an fd each) until their grace is over; past this many the
#: oldest is cut at once.
MAX_KEPT_RETIRED: Final = 256
#: Blocks read without a call that one ``note_reads`` moves in the LRU (the pages'
#: rings are hints the clients write: past this many the rest are dropped).
MAX_READ_HINTS: Final = 4096

