"""The store: per-namespace index, one host-wide LRU, reservations, leases.

Policy lives here; bytes never do.  The store decides which slot a key gets,
when a block becomes visible, which block is evicted, and who holds what;
the mechanism (``segments``) persists slot states; the service translates the
wire.

Every public call either applies fully or changes nothing.  Each runs in three
phases: validate; persist (the slot-table writes: the steps that can fail);
apply (counters, index, LRU, free lists: in memory, nothing there can fail).
A write that fails takes back the writes before it (``_Undo``), so a failed
call leaves tables and memory as they were.  The exceptions, each consistent
on its own: a failed ``acquire`` may have rewritten the last access of the
blocks before the failing one (only an LRU hint for the next restart); a
failed reserve may already have reclaimed extents of other namespaces or
grown its own (cache policy: the reclaimed blocks were evictable and left
through the one exit); a failed reclaim or reformat may have removed the
files of extents it still holds (they serve on, and at the next restart their
blocks are gone like evicted ones).

Pins (the three workflows; each pin is granted by exactly one call and
released by exactly one call):

1. **write**: ``reserve`` grants a reservation (slot state RESERVED, key
   IN_FLIGHT); exactly one of ``commit`` / ``abort`` / reservation expiry /
   session close ends it.
2. **read**: ``acquire`` grants a lease (each block's pin count +1, the block
   leaves the LRU); exactly one of ``release`` / lease expiry / session close
   ends it.
3. **delete of a leased block**: ``delete`` hides the block at once (it is
   *doomed*); its slot is freed by whichever workflow-2 ending drops the last
   pin.

Capacity: one global DRAM budget (``dram.capacity``) from which namespaces
grow in extents.  A reserve that finds no free slot evicts the host-wide
least recently used unleased block of the same namespace, or reclaims a
whole extent of another namespace whose blocks are all evictable (so the
budget can move between namespaces), or grows a new extent when the budget
allows.  Eviction is the one place where DRAM blocks leave.

Spill (``spill_enabled``, driven by ``kvtierd.tiering``): every block is
DIRTY (DRAM is its only copy), CLEAN (a spill tier holds a durable copy) or
UNSPILLABLE (spilling it failed).  Only non-DIRTY blocks are evicted, and only
extents without DIRTY blocks are reclaimed; a reserve that could be served by
evicting DIRTY blocks raises ``NeedDemotion`` instead, and the tiering layer
waits for the demoter (back-pressure) and retries.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import logging
import operator
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from types import TracebackType
from typing import Final

import numpy as np

from kvtier.errors import (
    CapacityExhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unauthenticated,
)
from kvtierd.access import Identity
from kvtierd.counters import saturating_add
from kvtierd.logs import event
from kvtierd.segments import (
    FLAG_HAS_CHECKSUM,
    KEY_OFFSET,
    MAX_ACCESS_SEQ,
    MAX_KEY_BYTES,
    SLOT_DTYPE,
    SLOT_ENTRY_BYTES,
    Segment,
    SegmentLayout,
    SlotRecord,
    SlotState,
    cut_data_file,
)
from kvtierd.shared_index import (
    GRANT_TAKEN,
    GRANT_VALID,
    GRANTS_N,
    HAS_SUM,
    LAST,
    KeyIndex,
    Location,
    SessionPage,
    SharedIndex,
    collect_hazards,
    fingerprint,
    hazard_of,
)

log = logging.getLogger(__name__)

#: How many LRU entries one reserve may inspect while looking for victims:
#: bounds the work of a single allocation (STYLE: bounded work per operation).
EVICTION_SCAN_LIMIT: Final = 4096
#: Grow/reclaim rounds one reserve may take before it settles for eviction;
#: each round adds or reclaims at least one extent, so this bounds its work.
MAX_GROW_ROUNDS: Final = 64


class Lower:
    """What the tiers below DRAM hold of a block (``Block.lower``)."""

    DIRTY: Final = 0  # DRAM is the only copy
    CLEAN: Final = 1  # a spill tier holds a durable copy: eviction loses nothing
    UNSPILLABLE: Final = 2  # spilling failed: evicted like a block without spill tiers


class NeedDemotion(CapacityExhausted):
    """A reserve in ``ns`` fits only after ``blocks`` (DIRTY) are demoted, or after the
    demotions in flight finish (``blocks`` empty)."""

    def __init__(self, ns: Namespace, short: int, blocks: list[Block]) -> None:
        super().__init__(f"DRAM is full for namespace {ns.name!r}: {short} slots wait for "
                         "blocks to be demoted to a spill tier")
        self.ns = ns
        self.short = short
        self.blocks = blocks


class ReserveStatus:
    """Per-key outcome of a reserve (values match the wire enum)."""

    RESERVED: Final = 1
    EXISTS: Final = 2
    IN_FLIGHT: Final = 3


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
    lower: int = Lower.DIRTY
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


class CommitResult:
    """A commit record's result byte in the page (``csrc/writes.c``)."""

    COMMITTED: Final = 1
    EXISTS: Final = 2  # the key was present (or being written): the grant stays
    INVALID: Final = 3  # the record's batch was malformed: nothing of it committed
    LOST: Final = 4  # a grant of the batch is no longer this session's (expired)
    FAILED: Final = 5  # the daemon could not write the slot table: nothing committed


#: Grants nobody committed into for this long go back (an idle writer holds no room).
GRANT_IDLE_SECONDS: Final = 5.0


#: Retired data files kept (an fd each) until their grace is over; past this many the
#: oldest is cut at once.
MAX_KEPT_RETIRED: Final = 256
#: Blocks read without a call that one ``note_reads`` moves in the LRU (the pages'
#: rings are hints the clients write: past this many the rest are dropped).
MAX_READ_HINTS: Final = 4096


class _Raced(Exception):
    """Internal signal: a client leased a planned victim (a hazard) while the plan was
    made; plan again (the hazard is seen then)."""


def _grant_word(ext: Extent, slot: int) -> int:
    """How a client's page names a granted slot (``csrc/writes.c``)."""
    return GRANT_VALID | ext.segment.segment_id << 32 | slot


def _locate(block: Block) -> Location:
    """Where the shared index says ``block`` is (what a client leases without a call)."""
    seg = block.extent.segment
    return (seg.segment_id, block.slot, seg.slot_offset(block.slot), block.length,
            block.checksum)


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


def _recommit(segment: Segment, slot: int) -> None:
    """Write a freed or doomed COMMITTED entry back (its fields are still in the table)."""
    _rewrite(segment, slot, segment.read_slot(slot))


def _rewrite(segment: Segment, slot: int, rec: SlotRecord) -> None:
    """Put a COMMITTED entry back as ``rec`` read it (the entry checksum comes out equal)."""
    segment.mark_committed(slot, key=rec.key, length=rec.length, checksum=rec.checksum,
                           last_access=rec.last_access, generation=rec.generation,
                           epoch=rec.epoch)


def _close_quietly(segment: Segment, unlink: bool, keep_fd: bool = False) -> int | None:
    """Close a segment the store no longer holds, and free its memory whoever still
    holds an fd (worker thread): nothing waits for the result, so a failure is logged
    here.  ``keep_fd``: a duplicate of its data fd, to cut the file to 0 later."""
    try:
        return segment.close(unlink=unlink, free=True, keep_fd=keep_fd)
    except OSError as exc:
        log.warning("closing segment %s failed: %s", segment.path, exc)
        return None


#: The mutable fields of a block (``check_snapshot`` copies them on the loop).
_BLOCK_STATE: Final = operator.attrgetter("pins", "doomed", "lower")


#: Creates a segment file for (namespace, extent index, layout, segment id); blocking I/O.
ExtentFactory = Callable[[Namespace, int, SegmentLayout, int], Segment]


class Store:
    """Index, LRU, reservations and leases over the DRAM extents.

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
        publish: bool = False,
        grant_bytes: int = 0,
    ) -> None:
        self.capacity = capacity
        #: Bytes of slots each session with a write page may hold reserved ahead.
        self.grant_bytes = grant_bytes
        self.extent_size = extent_size
        self.lease_ttl = lease_ttl
        self.reservation_ttl = reservation_ttl
        self.boot_epoch = boot_epoch
        self._factory = extent_factory
        self._clock = clock
        self._on_evict = on_evict
        #: Prefetched blocks first read without a call (tiering counts those read by calls).
        self.prefetched_reads = 0
        #: Publish each namespace's keys in a shared index its clients search.
        self.publish = publish
        self.namespaces: dict[str, Namespace] = {}
        self.sessions: dict[int, Session] = {}
        self._system_sessions: dict[str, Session] = {}
        self._spill_enabled = False
        self._by_token: dict[str, Session] = {}
        self.lru: collections.OrderedDict[Block, None] = collections.OrderedDict()
        self.budget_free = capacity
        self._ids = itertools.count(1)
        self._segment_ids = itertools.count(1)
        self._access_seq = itertools.count(1)
        # Adopted blocks and their persisted last access, until finish_recovery.
        self._adopted: list[Block] = []
        self._adopted_at: list[int] = []
        self._reservations: dict[int, Reservation] = {}
        self._leases: dict[int, Lease] = {}
        self._retiring: set[asyncio.Future[int | None]] = set()
        #: Retired data files to cut to 0 bytes, in order: (when, a duplicate of its fd).
        self._to_cut: collections.deque[tuple[float, int]] = collections.deque()
        # event counters (read by metrics at scrape time)
        self.evictions = 0
        #: Namespace name -> its DRAM quota in bytes (0: none); the daemon sets it from
        #: the access rules.  Consulted only when a reserve finds no free slot.
        self.dram_quota_of: Callable[[str], int] = lambda name: 0
        #: Called with the name of a namespace the store forgot (metrics drop its series).
        self.on_forget: Callable[[str], None] = lambda name: None
        self.mlock_errors: list[str] = []
        self.prefault_seconds = 0.0
        self.recovery_seconds = 0.0
        self.dropped_segments: list[str] = []
        #: Hears every key that comes into or goes out of DRAM (``watch``).
        self._watch: Callable[[str, str, list[bytes], bool], None] | None = None

    @property
    def spill_enabled(self) -> bool:
        """Set by the tiering layer when a spill tier exists: evict only non-DIRTY blocks
        (and a miss in a shared index is not final: the key may be below DRAM)."""
        return self._spill_enabled

    @spill_enabled.setter
    def spill_enabled(self, on: bool) -> None:
        self._spill_enabled = on
        for ns in self.namespaces.values():
            if ns.index.shared is not None:
                ns.index.shared.set_lower_tiers(on)

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
        """Give ``ns`` a shared index holding its keys (on failure it has none)."""
        if self.publish:
            try:
                ns.index.publish(SharedIndex(ns.name, lower_tiers=self._spill_enabled), _locate)
            except OSError as exc:  # out of memory or fds: lookups go to the daemon
                log.warning("namespace %r: no shared index (%s); its clients' lookups go "
                            "to the daemon", ns.name, exc)

    @staticmethod
    def _unpublish(ns: Namespace) -> None:
        if ns.index.shared is not None:
            ns.index.shared.close()  # its clients see SUPERSEDED and ask the daemon
            ns.index.shared = None

    def _drop_namespace(self, ns: Namespace) -> None:
        del self.namespaces[ns.name]
        self._unpublish(ns)

    # ================================================================ sessions
    def open_session(self, name: str, block_bytes: int, model_uid: str, peer: Peer) -> Session:
        """Declare (or join) a namespace and start a session in it."""
        ns = self.namespaces.get(name)
        layout = SegmentLayout.fit(block_bytes, self.capacity)
        if ns is not None and (ns.block_bytes, ns.model_uid) != (block_bytes, model_uid):
            if ns.declared:
                raise FailedPrecondition(
                    f"namespace {name!r} is declared with block_bytes={ns.block_bytes} "
                    f"model_uid={ns.model_uid!r}; refusing block_bytes={block_bytes} "
                    f"model_uid={model_uid!r}"
                )
            if layout is not None:
                # Only recovered data has this layout (e.g. the model was upgraded while
                # the daemon was down): reformat this namespace, never mix or refuse forever.
                self._reformat(ns, f"declared with block_bytes={block_bytes} "
                                   f"model_uid={model_uid!r}; the {ns.committed} recovered "
                                   f"blocks of block_bytes={ns.block_bytes} "
                                   f"model_uid={ns.model_uid!r} are dropped")
                ns = None
        if layout is None:
            raise InvalidArgument(
                f"block_bytes {block_bytes} does not fit in dram.capacity {self.capacity}"
            )
        # Applied: nothing below can fail.
        if ns is None:
            ns = self._new_namespace(name, block_bytes, model_uid, layout.slot_bytes)
            log.info("namespace %r declared: block_bytes=%d model_uid=%r", name, block_bytes,
                     model_uid, extra=event("namespace_declared", namespace=name,
                                            block_bytes=block_bytes, model_uid=model_uid))
        ns.declared = True
        sid = next(self._ids)
        session = Session(sid, secrets.token_hex(16), ns, peer, self._clock())
        self.sessions[sid] = session
        self._by_token[session.token] = session
        ns.sessions += 1
        return session

    def session_for(self, token: str) -> Session:
        session = self._by_token.get(token)
        if session is None:
            raise Unauthenticated(
                "unknown session token (the session was closed or never opened; "
                "open one on the session channel)"
            )
        return session

    def close_session(self, session: Session) -> tuple[int, int]:
        """End a session: abort its reservations and release its leases.

        Returns (reserved slots returned, leases released).  Idempotent.
        """
        if session.closed:
            return (0, 0)
        reservations = list(session.reservations.values())
        leases = list(session.leases.values())
        with _Undo() as undo:
            for res in reservations:
                self._persist_end_reservation(res, None, undo)
            self._persist_unpins(leases, undo)
        # Applied: nothing below can fail.
        session.closed = True
        for res in reservations:
            self._apply_end_reservation(res, None)
        for lease in leases:
            self._apply_end_lease(lease)
        self._end_grants(session, list(session.grants))
        del self.sessions[session.id]
        del self._by_token[session.token]
        session.ns.pages.pop(session.id, None)  # its hazards end with it
        session.ns.sessions -= 1
        self._forget_if_unused(session.ns)
        return (sum(len(r.keys) for r in reservations), len(leases))

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
        self.on_forget(ns.name)

    # ================================================================ lookup
    def lookup(self, session: Session, keys: Sequence[bytes]) -> int:
        """Number of leading keys present (committed, not deleted); no side effects."""
        index = session.ns.index
        hits = 0
        for key in keys:
            if key not in index:
                break
            hits += 1
        return hits

    # ================================================================ write path
    async def reserve(
        self,
        session: Session,
        keys: Sequence[bytes],
        exists: Callable[[bytes], bool] | None = None,
    ) -> ReserveResult:
        """Allocate writable slots for the keys not yet present (all or nothing).

        ``exists``: keys a lower tier holds, reported EXISTS like DRAM blocks.
        """
        ns = session.ns
        for _round in range(MAX_GROW_ROUNDS):
            try:
                return self._reserve_now(session, keys, exists, may_grow=True)
            except _NeedExtent as need:
                if not await self._grow(ns, need.slots):
                    break
            except _Raced:
                continue
        for _round in range(MAX_GROW_ROUNDS):
            try:
                return self._reserve_now(session, keys, exists, may_grow=False)
            except _Raced:
                continue
        raise CapacityExhausted(f"namespace {ns.name!r}: clients kept leasing the blocks "
                                "this reserve would evict")

    def _reserve_now(
        self,
        session: Session,
        keys: Sequence[bytes],
        exists: Callable[[bytes], bool] | None,
        *,
        may_grow: bool,
    ) -> ReserveResult:
        ns = session.ns
        if session.closed:
            raise Unauthenticated("session is closed")
        statuses: list[int] = []
        new_keys: list[bytes] = []
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            if key in seen:
                raise InvalidArgument(f"duplicate key at index {i}")
            if not 0 < len(key) <= MAX_KEY_BYTES:  # the slot table holds no more
                raise InvalidArgument(f"keys[{i}] is {len(key)} bytes (1..{MAX_KEY_BYTES} "
                                      "allowed)")
            seen.add(key)
            if key in ns.index:
                statuses.append(ReserveStatus.EXISTS)
            elif key in ns.in_flight:
                statuses.append(ReserveStatus.IN_FLIGHT)
            elif exists is not None and exists(key):
                statuses.append(ReserveStatus.EXISTS)
            else:
                statuses.append(ReserveStatus.RESERVED)
                new_keys.append(key)
        if not new_keys:
            return ReserveResult(0, statuses, [], ns.segments_version)
        places = self._claim(ns, len(new_keys), may_grow=may_grow)
        rid = next(self._ids)
        now = self._clock()
        res = Reservation(rid, session, new_keys, places, now + self.reservation_ttl, started=now)
        for key in new_keys:
            ns.in_flight[key] = rid
        session.reservations[rid] = res
        self._reservations[rid] = res
        grants = [SlotGrant(ext.segment.segment_id, ext.segment.slot_offset(slot),
                            ns.block_bytes, None) for ext, slot, _gen in places]
        return ReserveResult(rid, statuses, grants, ns.segments_version)

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
        hazards = self._hazards(ns)
        for ext in ns.extents:
            if hazards:
                sid = ext.segment.segment_id
                kept = []
                while ext.free and len(taken) < n:
                    slot = ext.free.pop()
                    if hazard_of(sid, slot) in hazards:
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
                victims = self._find_room(ns, n, len(taken), may_grow=may_grow, hazards=hazards)
            except CapacityExhausted:
                if partial:
                    return taken, []
                raise
            if ns.pages and victims and ns.index.shared is not None:
                # Victims leave the table before the pages are read again: a client
                # that leased one meanwhile is seen now, or sees it gone.
                for block in victims:
                    ns.index.shared.hide(block.key)
                now = self._hazards(ns)
                if any(self.slot_of(b) in now for b in victims):
                    self._unhide(ns, victims)
                    raise _Raced()
            return taken, victims
        except BaseException:
            for ext, slot in reversed(taken):
                ext.free.append(slot)
            raise

    def _hazards(self, ns: Namespace) -> AbstractSet[int]:
        """The slots of ``ns`` its clients lease without a call (see csrc/index.c), read
        from the pages now, after a full fence."""
        return collect_hazards(ns.pages.values())

    def _idle_grants_in(self, ext: Extent) -> list[tuple[Session, int]]:
        """The grants of ``ext``'s namespace's sessions in ``ext`` that no writer took
        (session, grant entry)."""
        owner = self.namespaces.get(ext.segment.namespace)
        if owner is None or not ext.reserved:
            return []
        out: list[tuple[Session, int]] = []
        for session in self.sessions.values():
            if session.ns is not owner or not session.grants:
                continue
            page = owner.pages.get(session.id)
            for g, (e, slot, _gen) in session.grants.items():
                if e is ext and (page is None or page.grant_word(g) == _grant_word(e, slot)):
                    out.append((session, g))
        return out

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

    def _held_segments(self, ns: Namespace) -> set[int]:
        """The segments of ``ns`` in which its clients lease a slot without a call: a
        hazard counts only where it names a slot the extent has (a page's garbage,
        say random slot numbers in real segments, pins no extent against reclaim)."""
        held = self._hazards(ns)
        if not held:
            return set()
        slots = {e.segment.segment_id: e.n_slots for e in ns.extents}
        return {sid for v in held
                if (sid := v >> 32 & 0x7FFF_FFFF) in slots and v & 0xFFFF_FFFF < slots[sid]}

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
        held: dict[str, set[int]] = {}
        for ext in exts:
            owner = self.namespaces[ext.segment.namespace]
            if owner.pages:
                if owner.name not in held:
                    held[owner.name] = self._held_segments(owner)
                if ext.segment.segment_id in held[owner.name]:
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
                   hazards: AbstractSet[int] | None = None) -> list[Block]:
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

        # Extents of other namespaces whose slots their clients lease without a call
        # (hazards) are never reclaimed: a leased block is never evicted, whoever holds it.
        held_segments: dict[str, set[int]] = {}

        def leased_in(other: Namespace, ext: Extent) -> bool:
            if not other.pages:
                return False
            if other.name not in held_segments:
                held_segments[other.name] = self._held_segments(other)
            return ext.segment.segment_id in held_segments[other.name]

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
                if hazards and self.slot_of(block) in hazards:
                    continue
                if spill and block.lower == Lower.DIRTY:
                    if len(dirty_ns) < short:
                        dirty_ns.append(block)
                else:
                    same_ns.append(block)
            elif may_grow and id(block.extent) not in considered:
                considered.add(id(block.extent))
                ext = block.extent
                if (ext.pinned == 0 and not block.ns.grow_lock.locked() and unreserved(ext)
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

    def held_seconds(self, started: float) -> float:
        """Seconds since ``started`` (a lease's or reservation's), on the store's clock."""
        return self._clock() - started

    def commit(
        self,
        session: Session,
        reservation_id: int,
        lengths: Sequence[int],
        checksums: Sequence[int] | None,
    ) -> int:
        """Make a reservation's slots visible, all or nothing."""
        res = self._own_reservation(session, reservation_id)
        n = len(res.keys)
        if len(lengths) != n:
            raise InvalidArgument(
                f"reservation {reservation_id} has {n} slots but {len(lengths)} lengths were given"
            )
        if checksums is not None and len(checksums) != n:
            raise InvalidArgument(
                f"lengths and checksums differ in length ({n} != {len(checksums)})"
            )
        limit = session.ns.block_bytes
        for i, length in enumerate(lengths):
            if not 0 < length <= limit:
                raise InvalidArgument(f"lengths[{i}] = {length} is outside 1..{limit} (block_bytes)")
        for i, checksum in enumerate(checksums or ()):
            if not 0 <= checksum < 1 << 64:  # the slot table's field is 64 bits
                raise InvalidArgument(f"checksums[{i}] = {checksum} is outside 0..2**64-1")
        self._end_reservation(res, commit=(lengths, checksums))
        return n

    def abort(self, session: Session, reservation_id: int) -> int:
        res = self._own_reservation(session, reservation_id)
        self._end_reservation(res, commit=None)
        return len(res.keys)

    def _expire_reservation(self, res: Reservation, until: float) -> None:
        """End a reservation whose writer may still be copying: its slots stay
        RESERVED (quarantined) until ``until``, so they cannot be handed to
        another writer while the late one scribbles on them."""
        ns = res.session.ns
        for key, (ext, slot, _gen) in zip(res.keys, res.places, strict=True):
            del ns.in_flight[key]
            ext.quarantine[slot] = until  # still counted in ext.reserved / ns.reserved
        del res.session.reservations[res.id]
        del self._reservations[res.id]

    def _own_reservation(self, session: Session, reservation_id: int) -> Reservation:
        if reservation_id == 0:
            raise InvalidArgument("reservation_id is required (0 is not a reservation)")
        res = session.reservations.get(reservation_id)
        if res is None:
            raise NotFound(
                f"reservation {reservation_id} is not open in this session "
                "(never issued, already committed or aborted, or expired)"
            )
        return res

    def _end_reservation(
        self,
        res: Reservation,
        commit: tuple[Sequence[int], Sequence[int | None] | None] | None,
    ) -> list[Block | None]:
        """Commit (or with None free) every slot; a length of 0 frees that one slot."""
        with _Undo() as undo:
            self._persist_end_reservation(res, commit, undo)
        return self._apply_end_reservation(res, commit)

    def _persist_end_reservation(
        self,
        res: Reservation,
        commit: tuple[Sequence[int], Sequence[int | None] | None] | None,
        undo: _Undo,
    ) -> None:
        """The slot-table writes of ending ``res``; each is taken back to RESERVED."""
        seq = self._access_seq
        for i, (key, (ext, slot, gen)) in enumerate(zip(res.keys, res.places, strict=True)):
            seg = ext.segment
            undo.add(seg.mark_reserved, slot, gen)
            if commit is None or commit[0][i] == 0:
                seg.mark_free(slot)
                continue
            lengths, checksums = commit
            seg.mark_committed(
                slot, key=key, length=lengths[i],
                checksum=checksums[i] if checksums is not None else None,
                last_access=next(seq), generation=gen, epoch=self.boot_epoch,
            )

    def _apply_end_reservation(
        self,
        res: Reservation,
        commit: tuple[Sequence[int], Sequence[int | None] | None] | None,
    ) -> list[Block | None]:
        """The in-memory part of ending ``res`` (its slot-table writes are done)."""
        ns = res.session.ns
        made: list[Block | None] = []
        for i, (key, (ext, slot, gen)) in enumerate(zip(res.keys, res.places, strict=True)):
            del ns.in_flight[key]
            ext.reserved -= 1
            if commit is None or commit[0][i] == 0:
                ext.free.append(slot)
                made.append(None)
                continue
            lengths, checksums = commit
            checksum = checksums[i] if checksums is not None else None
            block = Block(ns, key, ext, slot, lengths[i], checksum, gen)
            ext.committed += 1
            ext.dirty += 1
            ns.committed += 1
            ns.index[key] = block
            self.lru[block] = None
            made.append(block)
        ns.reserved -= len(res.keys)
        del res.session.reservations[res.id]
        del self._reservations[res.id]
        return made

    # ================================================================ read path
    def acquire(self, session: Session, keys: Sequence[bytes]) -> AcquireResult:
        """Lease the longest present prefix of ``keys``."""
        if session.closed:
            raise Unauthenticated("session is closed")
        ns = session.ns
        blocks: list[Block] = []
        for key in keys:
            block = ns.index.get(key)
            if block is None:
                break
            blocks.append(block)
        if len({id(b) for b in blocks}) != len(blocks):
            raise InvalidArgument("duplicate keys in one acquire")
        # The only writes: last-access hints for the next restart's LRU order, which a
        # failure part-way does not take back (they change nothing but that order).
        seq = self._access_seq
        for block in blocks:
            block.extent.segment.touch(block.slot, next(seq))
        # Applied: nothing below can fail.
        ns.hits += len(blocks)
        ns.misses += len(keys) - len(blocks)
        if not blocks:
            return AcquireResult(0, [], ns.segments_version)
        lid = next(self._ids)
        now = self._clock()
        lease = Lease(lid, session, blocks, now + self.lease_ttl, started=now)
        for block in blocks:
            self._pin(block)
        session.leases[lid] = lease
        self._leases[lid] = lease
        grants = [
            SlotGrant(b.extent.segment.segment_id, b.extent.segment.slot_offset(b.slot), b.length,
                      b.checksum)
            for b in blocks
        ]
        return AcquireResult(lid, grants, ns.segments_version)

    def release(self, session: Session, lease_id: int) -> None:
        if lease_id == 0:
            raise InvalidArgument("lease_id is required (0 is not a lease)")
        lease = session.leases.get(lease_id)
        if lease is None:
            raise NotFound(
                f"lease {lease_id} is not held by this session (already released, or expired)"
            )
        self._end_leases([lease])

    # ------------------------------------------------ leases without a call (csrc/index.c)
    def attach_page(self, session: Session, page: SessionPage) -> None:
        """``session``'s client leases blocks without a call, with hazards in ``page``:
        no slot it names is reused until the page lets go of it or the session ends."""
        if session.closed:
            raise Unauthenticated("session is closed")
        session.ns.pages[session.id] = page

    # ------------------------------------------------ writes without a call (csrc/writes.c)
    def grant_limit(self, ns: Namespace) -> int:
        """Most slots a session of ``ns`` may hold granted ahead (``grant_bytes`` of them)."""
        return min(GRANTS_N, self.grant_bytes // ns.slot_bytes)

    def refill_grants(self, session: Session, want: int) -> int:
        """Reserve slots ahead for ``session``'s writer until it holds ``want`` (at most
        ``grant_limit``), named in its page: it fills and commits them without a call.
        Takes room as a reserve does (free slots; then, if the namespace may grow, -1:
        the writer's next Reserve call grows it; else evicts), but never grows nor
        waits: short when no more room can be made now.  Returns how many were granted
        (-1: none, the namespace should grow first)."""
        page = session.ns.pages.get(session.id)
        if page is None or not page.writes or session.closed or session.system:
            return 0
        ns = session.ns
        n = min(want, self.grant_limit(ns)) - len(session.grants)
        if n <= 0:
            return 0
        places: list[tuple[Extent, int, int]] = []
        for _round in range(3):
            try:
                places = self._claim(ns, n, may_grow=True, partial=True)
                break
            except _Raced:
                continue
            except _NeedExtent:
                return -1
            except CapacityExhausted:
                break
        held = session.grants
        entries = list(itertools.islice((i for i in range(GRANTS_N) if i not in held),
                                        len(places)))
        for i, place in zip(entries, places, strict=True):
            ext, slot, _gen = place
            session.grants[i] = place
            page.set_grant(i, _grant_word(ext, slot))
        if places:
            session.grants_used = self._clock()
        return len(places)

    def commit_granted(
        self,
        session: Session,
        records: Sequence[tuple[int, int, bytes, int, int, int]],
        exists: Callable[[bytes], bool] | None = None,
    ) -> tuple[bytes, list[Block]]:
        """Commit the blocks ``session``'s writer put in granted slots: ``records`` as
        ``SessionPage.take_commits`` copied them out of its page (grant entry, grant
        word, key, length, checksum, flags), in batches that end with a ``LAST``
        record, each all or nothing.  A record whose word is not the grant the entry
        holds now (the writer filled a slot the daemon took back, and the entry was
        granted again since) is ``LOST``, never committed into the entry's new slot.
        Returns each record's ``CommitResult`` and the blocks made."""
        results = bytearray()
        made: list[Block] = []
        start = 0
        for end, rec in enumerate(records):
            if rec[5] & LAST or end == len(records) - 1:
                batch = records[start:end + 1]
                start = end + 1
                try:
                    codes, blocks = self._commit_batch(session, batch, exists)
                except (OSError, ValueError) as exc:  # a slot table that cannot be written
                    log.warning("commit of %d granted slots failed: %s", len(batch), exc)
                    codes, blocks = bytes([CommitResult.FAILED]) * len(batch), []
                results += codes
                made += blocks
        return bytes(results), made

    def _commit_batch(
        self,
        session: Session,
        batch: Sequence[tuple[int, int, bytes, int, int, int]],
        exists: Callable[[bytes], bool] | None,
    ) -> tuple[bytes, list[Block]]:
        ns = session.ns
        grants = session.grants
        n = len(batch)
        entries = {r[0] for r in batch}
        limit = ns.block_bytes
        if (len({r[2] for r in batch}) != n or len(entries) != n
                or not all(0 < len(r[2]) <= MAX_KEY_BYTES and 0 < r[3] <= limit for r in batch)):
            return bytes([CommitResult.INVALID]) * n, []
        if session.closed or not all(
                (place := grants.get(r[0])) is not None
                and _grant_word(place[0], place[1]) == r[1] for r in batch):
            return bytes([CommitResult.LOST]) * n, []
        index, in_flight = ns.index, ns.in_flight
        codes = bytearray(n)
        todo: list[tuple[int, bytes, int, int | None]] = []
        for i, (g, _word, key, length, raw_sum, flags) in enumerate(batch):
            if key in index or key in in_flight or (exists is not None and exists(key)):
                codes[i] = CommitResult.EXISTS  # first writer wins; the grant stays
            else:
                codes[i] = CommitResult.COMMITTED
                todo.append((g, key, length, raw_sum if flags & HAS_SUM else None))
        seq = self._access_seq
        epoch = self.boot_epoch
        with _Undo() as undo:
            for g, key, length, checksum in todo:
                ext, slot, gen = grants[g]
                seg = ext.segment
                undo.add(seg.mark_reserved, slot, gen)
                seg.mark_committed(slot, key=key, length=length, checksum=checksum,
                                   last_access=next(seq), generation=gen, epoch=epoch)
        # Applied: nothing below can fail.
        page = ns.pages.get(session.id)
        made: list[Block] = []
        lru = self.lru
        for g, key, length, checksum in todo:
            ext, slot, gen = grants.pop(g)
            if page is not None:
                page.set_grant(g, 0)  # before DONE: the writer never sees it as its own again
            ext.reserved -= 1
            ext.committed += 1
            ext.dirty += 1
            block = Block(ns, key, ext, slot, length, checksum, gen)
            lru[block] = None
            made.append(block)
        if session.grant_seen:
            for g, _key, _length, _sum in todo:
                session.grant_seen.pop(g, None)
        ns.reserved -= len(made)
        ns.committed += len(made)
        index.update([(b.key, b) for b in made])
        session.grants_used = self._clock()
        return bytes(codes), made

    def _end_grants(self, session: Session, entries: Iterable[int], *,
                    quarantine: float | None = None) -> None:
        """Take back grants: their slots are freed (or, with ``quarantine``, stay
        RESERVED until then: a writer may still be copying into them)."""
        page = session.ns.pages.get(session.id)
        ns = session.ns
        for g in list(entries):
            ext, slot, gen = session.grants[g]
            if quarantine is None:
                try:
                    ext.segment.mark_free(slot)
                except (OSError, ValueError) as exc:
                    log.warning("could not free granted slot %d: %s", slot, exc)
                    continue
            del session.grants[g]
            session.grant_seen.pop(g, None)
            if page is not None:
                page.set_grant(g, 0)
            if quarantine is None:
                ext.reserved -= 1
                ns.reserved -= 1
                ext.free.append(slot)
            else:
                ext.quarantine[slot] = quarantine  # still counted as reserved

    def _expire_grants(self, session: Session, now: float) -> None:
        """Grants idle for ``GRANT_IDLE_SECONDS`` go back; one a writer has held taken
        for the reservation TTL is quarantined like an expired reservation's slot."""
        page = session.ns.pages.get(session.id)
        idle = now - session.grants_used >= GRANT_IDLE_SECONDS
        back: list[int] = []
        stale: list[int] = []
        for g, (ext, slot, _gen) in session.grants.items():
            word = _grant_word(ext, slot)
            current = page.grant_word(g) if page is not None else 0
            if current == word | GRANT_TAKEN:
                first = session.grant_seen.setdefault(g, now)
                if now - first >= self.reservation_ttl:
                    stale.append(g)
                continue
            session.grant_seen.pop(g, None)
            if idle and (page is None or page.revoke_grant(g, current)):
                back.append(g)
        if stale:
            log.warning("%d granted slots were held for %.0f s without a commit; they are "
                        "quarantined", len(stale), self.reservation_ttl,
                        extra=event("reservations_expired", count=len(stale)))
            self._end_grants(session, stale, quarantine=now + self.reservation_ttl)
        self._end_grants(session, back)

    def idle_grants(self) -> dict[str, int]:
        """Per namespace, the slots granted ahead that no writer has taken yet: room held
        for the next writes, not being written.  Stats and metrics show them apart from
        the reserved slots (a taken grant is a reservation; the page's TAKEN bit says
        which, and a client that lies about it only changes these figures)."""
        out: dict[str, int] = {}
        for s in self.sessions.values():
            idle = len(s.grants) - self._taken_grants(s)
            if idle:
                out[s.ns.name] = out.get(s.ns.name, 0) + idle
        return out

    @staticmethod
    def _taken_grants(session: Session) -> int:
        """How many of ``session``'s grants its writer has taken (its page says)."""
        if not session.grants:
            return 0
        page = session.ns.pages.get(session.id)
        if page is None:
            return 0
        return sum(1 for g, (ext, slot, _gen) in session.grants.items()
                   if page.grant_word(g) == _grant_word(ext, slot) | GRANT_TAKEN)

    def note_reads(self, ns: Namespace) -> None:
        """Move the blocks ``ns``'s clients read without a call to the LRU's young end
        (and persist their last access), from the pages' rings: hints, checked here."""
        if not ns.pages:
            return
        seen = {v for page in ns.pages.values() for v in page.accessed()}
        if not seen:
            return
        if len(seen) > MAX_READ_HINTS:  # hints: a page full of them costs a bounded sweep
            seen = set(itertools.islice(seen, MAX_READ_HINTS))
        exts = {e.segment.segment_id: e for e in ns.extents}
        seq = self._access_seq
        for v in seen:
            ext = exts.get(v >> 32 & 0x7FFF_FFFF)
            slot = v & 0xFFFF_FFFF
            if ext is None or slot >= ext.n_slots:
                continue
            block = ns.index.get(ext.segment.read_slot(slot).key)
            if block is None or block.extent is not ext or block.slot != slot:
                continue
            ext.segment.touch(slot, next(seq))
            if block in self.lru:
                self.lru.move_to_end(block)
            if block.prefetched:  # as tiering's acquire counts it
                block.prefetched = False
                self.prefetched_reads += 1

    def count_reads(self, ns: Namespace, hits: int, misses: int) -> None:
        """Add what ``ns``'s clients counted of their acquires without a call (bounded
        by the caller; the totals saturate)."""
        ns.hits = saturating_add(ns.hits, hits)
        ns.misses = saturating_add(ns.misses, misses)

    def _pin(self, block: Block) -> None:
        if block.pins == 0:
            self.lru.pop(block, None)
            block.extent.pinned += 1
            block.ns.leased += 1
        block.pins += 1

    def _end_leases(self, leases: Sequence[Lease]) -> None:
        with _Undo() as undo:
            self._persist_unpins(leases, undo)
        for lease in leases:
            self._apply_end_lease(lease)

    def _persist_unpins(self, leases: Iterable[Lease], undo: _Undo) -> None:
        """Free the slots of the doomed blocks whose last pins ``leases`` hold."""
        doomed = [b for lease in leases for b in lease.blocks if b.doomed]
        if not doomed:
            return
        for block, n in collections.Counter(doomed).items():
            if block.pins == n:
                seg = block.extent.segment
                undo.add(seg.mark_doomed, block.slot)
                seg.mark_free(block.slot)

    def _apply_end_lease(self, lease: Lease) -> None:
        """The in-memory part of ending a lease (``_persist_unpins`` freed doomed slots)."""
        for block in lease.blocks:
            block.pins -= 1
            if block.pins:
                continue
            block.extent.pinned -= 1
            block.ns.leased -= 1
            if block.doomed:
                self._unaccount(block)
                block.extent.free.append(block.slot)
            else:
                self.lru[block] = None  # most recently used
        del lease.session.leases[lease.id]
        del self._leases[lease.id]

    # ================================================================ delete / evict
    def delete(self, session: Session, keys: Sequence[bytes]) -> int:
        """Remove present keys; a leased block is hidden now and freed at its last release."""
        index = session.ns.index
        blocks = [b for b in map(index.get, dict.fromkeys(keys)) if b is not None]
        self._delete_blocks(blocks)
        return len(blocks)

    def drop_lost(self, segment: Segment, intact_bytes: int) -> list[Block]:
        """Forget the DRAM blocks of ``segment`` whose slots end past ``intact_bytes``.

        A client cut the data file short: those slots' bytes are gone (they read
        as zeros once the daemon restored the size).  Each block leaves the index
        as by a delete (a leased one is hidden now and freed at its last release);
        copies in lower tiers stay, they hold the real bytes.  Returns the blocks.
        """
        ns = self.namespaces.get(segment.namespace)
        ext = None if ns is None else next(
            (e for e in ns.extents if e.segment is segment), None)
        if ns is None or ext is None:
            return []
        slot_bytes = segment.layout.slot_bytes
        lost = [b for b in ns.index.values()
                if b.extent is ext and (b.slot + 1) * slot_bytes > intact_bytes]
        self._delete_blocks(lost)
        return lost

    def _delete_blocks(self, blocks: Sequence[Block]) -> None:
        """Take visible blocks out of the index: a leased one is doomed (its slot is freed
        at its last release), an unleased one is freed now."""
        with _Undo() as undo:
            for block in blocks:
                seg = block.extent.segment
                undo.add(_recommit, seg, block.slot)
                if block.pins:
                    seg.mark_doomed(block.slot)  # persisted: a crash keeps it deleted
                else:
                    seg.mark_free(block.slot)
        # Applied: nothing below can fail.
        for block in blocks:
            del block.ns.index[block.key]
            if block.pins:
                block.doomed = True
            else:
                self.lru.pop(block, None)
                self._unaccount(block)
                block.extent.free.append(block.slot)

    def evict_block(self, block: Block) -> bool:
        """Evict one DRAM block on an admin's request (``kvtier evict``), through the
        same exit as LRU eviction.  False, changing nothing, when the block is
        leased or no longer visible."""
        if block.pins or block.doomed or block.ns.index.get(block.key) is not block:
            return False
        seg = block.extent.segment
        with _Undo() as undo:
            undo.add(_recommit, seg, block.slot)
            seg.mark_free(block.slot)
        self._drop_from_index(block)
        block.extent.free.append(block.slot)
        self._report_evicted([block])
        return True

    def _drop_from_index(self, block: Block) -> None:
        """The in-memory part of an eviction (the one exit of DRAM blocks; the spill tiers
        turn it into demotion), but for the free list: the caller puts the slot where
        it goes.  Its slot-table write is done."""
        assert block.pins == 0 and not block.doomed
        del block.ns.index[block.key]
        self.lru.pop(block, None)
        self._unaccount(block)
        self.evictions += 1

    def _report_evicted(self, blocks: Iterable[Block]) -> None:
        """Tell ``on_evict`` of applied evictions; a hook that raises is a bug logged here,
        it never fails (or half-undoes) the call that evicted."""
        if self._on_evict is None:
            return
        for block in blocks:
            try:
                self._on_evict(block)
            except Exception:
                log.exception("on_evict hook failed for a block of %r", block.ns.name)

    def _unaccount(self, block: Block) -> None:
        """Take a block's slot out of the committed (and dirty) counters."""
        ext = block.extent
        ext.committed -= 1
        if block.lower == Lower.DIRTY:
            ext.dirty -= 1
        block.ns.committed -= 1

    # ================================================================ tiering hooks
    def system_session(self, ns: Namespace) -> Session:
        """The tiering layer's session in ``ns`` (created on first use; never expires)."""
        session = self._system_sessions.get(ns.name)
        if session is None or session.ns is not ns:
            session = Session(next(self._ids), "", ns, Peer(0, 0, 0), self._clock(), system=True)
            self._system_sessions[ns.name] = session
        return session

    def reservation_slots(self, session: Session, reservation_id: int) -> list[memoryview]:
        """Writable views of a reservation's slots (slot_bytes each), in key order."""
        res = self._own_reservation(session, reservation_id)
        return [ext.segment.data_view(slot, ext.segment.layout.slot_bytes)
                for ext, slot, _gen in res.places]

    def settle(
        self,
        session: Session,
        reservation_id: int,
        outcomes: Sequence[tuple[int, int] | None],
    ) -> list[Block | None]:
        """Commit each slot with its (length, checksum), or free it for None."""
        res = self._own_reservation(session, reservation_id)
        lengths = [o[0] if o is not None else 0 for o in outcomes]
        sums: list[int | None] = [o[1] if o is not None else None for o in outcomes]
        return self._end_reservation(res, commit=(lengths, sums))

    def pin_blocks(self, blocks: Sequence[Block]) -> list[Lease]:
        """Lease blocks to the tiering layer (one lease per namespace, no TTL)."""
        by_ns: dict[str, list[Block]] = {}
        for b in blocks:
            by_ns.setdefault(b.ns.name, []).append(b)
        leases = []  # in memory only: nothing here can fail
        for group in by_ns.values():
            session = self.system_session(group[0].ns)
            lease = Lease(next(self._ids), session, group, float("inf"))
            for block in group:
                self._pin(block)
            session.leases[lease.id] = lease
            self._leases[lease.id] = lease
            leases.append(lease)
        return leases

    def unpin(self, lease: Lease) -> None:
        """End a lease of ``pin_blocks`` (a doomed block is freed here)."""
        if lease.id in self._leases:
            self._end_leases([lease])

    def set_lower(self, block: Block, lower: int) -> None:
        """Record what the spill tiers hold of a live block."""
        if block.doomed or block.ns.index.get(block.key) is not block or block.lower == lower:
            return
        if block.lower == Lower.DIRTY:
            block.extent.dirty -= 1
        elif lower == Lower.DIRTY:
            block.extent.dirty += 1
        block.lower = lower

    def demotion_candidates(self, target_bytes: int, limit: int) -> list[Block]:
        """Up to ``limit`` DIRTY unleased blocks among the oldest ``target_bytes`` of the LRU."""
        out: list[Block] = []
        seen = 0
        for scanned, block in enumerate(self.lru):
            if scanned >= EVICTION_SCAN_LIMIT or len(out) >= limit or seen >= target_bytes:
                break
            seen += block.ns.slot_bytes
            if block.lower == Lower.DIRTY:
                out.append(block)
        return out

    # ================================================================ extents
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
        hazards = self._hazards(ns)
        if not hazards:
            return ns.free_slots()
        return sum(1 for ext in ns.extents for slot in ext.free
                   if hazard_of(ext.segment.segment_id, slot) not in hazards)

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

    def live_segments(self) -> list[Segment]:
        """Every DRAM segment in use now (any thread: a snapshot taken under the GIL;
        the cluster tier's agent maps these and lets go of the others)."""
        return [e.segment for ns in list(self.namespaces.values()) for e in list(ns.extents)]

    # ================================================================ recovery
    def new_segment_id(self) -> int:
        return next(self._segment_ids)

    def check_adoptable(self, segment: Segment) -> None:
        """Raise unless a previous run's segment can be adopted now (the store is unchanged).

        ``CapacityExhausted`` when the budget cannot hold the extent,
        ``FailedPrecondition`` when its layout conflicts with the namespace's
        other extents or its extent number is taken.
        """
        lay = segment.layout
        if lay.file_bytes > self.budget_free:
            raise CapacityExhausted(
                f"extent needs {lay.file_bytes} bytes, {self.budget_free} left in dram.capacity"
            )
        ns = self.namespaces.get(segment.namespace)
        if ns is not None and (ns.block_bytes, ns.model_uid) != (lay.block_bytes, segment.model_uid):
            raise FailedPrecondition(
                f"extent {segment.index} of namespace {segment.namespace!r} has block_bytes="
                f"{lay.block_bytes} model_uid={segment.model_uid!r}, other extents have "
                f"block_bytes={ns.block_bytes} model_uid={ns.model_uid!r}"
            )
        if ns is not None and any(e.segment.index == segment.index for e in ns.extents):
            raise FailedPrecondition(f"extent {segment.index} of {segment.namespace!r} twice")

    def adopt_extent(self, segment: Segment, slots: AdoptedSlots) -> int:
        """Take over a segment of a previous run, as ``recovery`` validated it.

        ``slots`` holds what may become visible blocks (every field checked),
        the RESERVED slots (quarantined for the reservation TTL: a writer of
        the previous daemon may still be copying, then freed) and the free
        ones.  Returns the blocks recovered.  Raises like ``check_adoptable``
        (or when a slot-table write fails); the store is unchanged then.
        """
        self.check_adoptable(segment)
        lay = segment.layout
        ns = self.namespaces.get(segment.namespace)
        index: dict[bytes, Block] = ns.index if ns is not None else {}
        adopted, adopted_at = self._adopted, self._adopted_at
        # Plan: the newest copy of each key wins (the same key twice is never written
        # so; be safe).  Losers in this segment are freed, and so are adopted blocks of
        # other extents that a newer copy here beats.
        mine: dict[bytes, tuple[int, int, int | None, int]] = {}  # key -> slot, length, sum, last
        lose_here: list[int] = []
        beaten: list[Block] = []
        rows = zip(slots.keys, zip(slots.slots, slots.lengths, slots.checksums,
                                   slots.last_access, strict=True), strict=True)
        unique = (len(set(slots.keys)) == len(slots.keys)
                  and index.keys().isdisjoint(slots.keys))  # no key twice: the common case
        if not unique:
            for key, (slot, length, checksum, last) in rows:
                prev = mine.get(key)
                old = index.get(key) if prev is None else None
                if prev is not None or old is not None:
                    log.warning("namespace %r: key %s committed twice; keeping the newer copy",
                                segment.namespace, key.hex())
                if prev is not None:
                    if prev[3] >= last:
                        lose_here.append(slot)
                        continue
                    lose_here.append(prev[0])
                elif old is not None:
                    try:
                        old_last: float = adopted_at[adopted.index(old)]  # rare: linear is fine
                    except ValueError:
                        old_last = float("inf")  # not from a previous run: newer than any
                    if old_last >= last:
                        lose_here.append(slot)
                        continue
                    beaten.append(old)
                mine[key] = (slot, length, checksum, last)
        with _Undo() as undo:
            for slot in lose_here:
                undo.add(_recommit, segment, slot)
                segment.mark_free(slot)
            for old in beaten:
                undo.add(_recommit, old.extent.segment, old.slot)
                old.extent.segment.mark_free(old.slot)
        # Applied: nothing below can fail.
        if ns is None:
            # Published in bulk by finish_recovery, not key by key here.
            ns = self._new_namespace(segment.namespace, lay.block_bytes, segment.model_uid,
                                     lay.slot_bytes, publish=False)
        # pop() hands out the lowest slot first
        ext = Extent(segment, sorted([*slots.free, *lose_here], reverse=True),
                     list(slots.generations))
        deadline = self._clock() + self.reservation_ttl
        for slot in slots.reserved:
            ext.quarantine[slot] = deadline
        ext.reserved += len(ext.quarantine)
        ns.reserved += len(ext.quarantine)
        for old in beaten:
            del ns.index[old.key]
            at = adopted.index(old)
            del adopted[at], adopted_at[at]
            self._unaccount(old)
            old.extent.free.append(old.slot)
            ns.recovered -= 1
        if unique:
            keys, at_slots = slots.keys, slots.slots
            lengths, sums, lasts = slots.lengths, slots.checksums, slots.last_access
        else:
            keys = list(mine)
            at_slots, lengths, sums, lasts = (list(col) for col in zip(*mine.values(),
                                                                       strict=True)) \
                if mine else ([], [], [], [])
        gens = ext.generations
        # Built by map() from C: a quarter of a million blocks in a few hundred ms.
        new = list(map(Block, itertools.repeat(ns), keys, itertools.repeat(ext), at_slots,
                       lengths, sums, map(gens.__getitem__, at_slots)))
        ns.index.update(zip(keys, new, strict=True))
        adopted.extend(new)
        adopted_at.extend(lasts)
        recovered = len(new)
        ext.committed += recovered
        ext.dirty += recovered
        ns.committed += recovered
        self.budget_free -= lay.file_bytes
        ns.extents.append(ext)
        ns.extents.sort(key=lambda e: e.segment.index)
        ns.next_extent_index = max(ns.next_extent_index, segment.index + 1)
        ns.recovered += recovered
        return recovered

    def finish_recovery(self) -> None:
        """Order the adopted blocks by their persisted last access (oldest first in the LRU).

        The access sequence goes on from the newest one; when that is in the upper
        half of its range (a long-lived cache, or a damaged table) the adopted
        blocks are renumbered 1..n in the same order first, so it never runs into
        the bound recovery enforces (``MAX_ACCESS_SEQ``).
        """
        blocks = self._adopted
        lasts = np.array(self._adopted_at, dtype=np.uint64)
        order = np.argsort(lasts, kind="stable").tolist()
        top = int(lasts.max()) if len(blocks) else 0
        if top >= MAX_ACCESS_SEQ // 2:  # the writes first: a failure leaves memory as it was
            for rank, i in enumerate(order, 1):
                blocks[i].extent.segment.touch(blocks[i].slot, rank)
            top = len(order)
        self.lru.update(zip(map(blocks.__getitem__, order), itertools.repeat(None)))
        self._access_seq = itertools.count(top + 1)
        self._adopted, self._adopted_at = [], []
        for ns in self.namespaces.values():
            if ns.index.shared is None:
                self._publish(ns)

    def segments(self, ns: Namespace) -> list[Segment]:
        return [e.segment for e in ns.extents]

    async def drain(self) -> None:
        """Wait for extents being retired in the background."""
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    def close_all(self) -> None:
        """Unmap every segment, keeping the files (the warm-restart path re-attaches them);
        retired files still in their grace are cut now."""
        self._cut_retired(everything=True)
        for ns in self.namespaces.values():
            self._unpublish(ns)
            for ext in ns.extents:
                ext.segment.close(unlink=False)

    # ================================================================ expiry
    def expire(self) -> tuple[collections.Counter[str], int]:
        """Abort reservations and release leases past their deadline, and free the
        quarantined slots whose time is up; all of it or (raising) nothing.

        Returns (reserved slots returned per namespace, leases released).
        """
        now = self._clock()
        self._cut_retired()
        for ns in self.namespaces.values():
            self.note_reads(ns)  # the LRU hears of the reads made without a call
        stale_res = [r for r in self._reservations.values()
                     if r.expires <= now and not r.session.system]
        due = [(ns, ext, slot) for ns in self.namespaces.values() for ext in ns.extents
               if ext.quarantine for slot, until in ext.quarantine.items() if until <= now]
        stale_leases = [lease for lease in self._leases.values()
                        if lease.expires <= now and not lease.session.system]
        with _Undo() as undo:
            for _ns, ext, slot in due:
                seg = ext.segment
                undo.add(seg.mark_reserved, slot, ext.generations[slot])
                seg.mark_free(slot)
            self._persist_unpins(stale_leases, undo)
        # Applied: nothing below can fail.
        if stale_res:  # one line per sweep, however many expired (an expiry storm)
            log.warning("%d reservations expired (ids %s%s); their %d slots are quarantined "
                        "for %.0f s", len(stale_res), ", ".join(str(r.id) for r in stale_res[:5]),
                        ", ..." if len(stale_res) > 5 else "",
                        sum(len(r.keys) for r in stale_res), self.reservation_ttl,
                        extra=event("reservations_expired", count=len(stale_res)))
        for res in stale_res:
            self._expire_reservation(res, now + self.reservation_ttl)
        for ns, ext, slot in due:
            del ext.quarantine[slot]
            ext.reserved -= 1
            ns.reserved -= 1
            ext.free.append(slot)
        if stale_leases:
            log.warning("%d leases expired after %.0f s (ids %s%s)", len(stale_leases),
                        self.lease_ttl, ", ".join(str(x.id) for x in stale_leases[:5]),
                        ", ..." if len(stale_leases) > 5 else "",
                        extra=event("leases_expired", count=len(stale_leases)))
        for lease in stale_leases:
            self._apply_end_lease(lease)
        for session in self.sessions.values():
            if session.grants:
                self._expire_grants(session, now)
        # Leases made without a call: their hazards are zeroed (the slots are free to reuse).
        local = sum(page.expire(now, self.lease_ttl) for ns in self.namespaces.values()
                    for page in ns.pages.values())
        if local:
            log.warning("%d leases made without a call expired after %.0f s", local,
                        self.lease_ttl, extra=event("leases_expired", count=local))
        aborted: collections.Counter[str] = collections.Counter()
        for res in stale_res:
            aborted[res.session.ns.name] += len(res.keys)
        return (aborted, len(stale_leases) + local)

    # ================================================================ accounting
    @property
    def lease_count(self) -> int:
        """Leases held by clients, with or without a call (the tiering layer's own pins
        are not counted)."""
        local = sum(page.leases() for ns in self.namespaces.values()
                    for page in ns.pages.values())
        return local + sum(1 for lease in self._leases.values() if not lease.session.system)

    def hazard_count(self) -> int:
        """Blocks clients lease without a call, as their pages say now."""
        return sum(len(self._hazards(ns)) for ns in self.namespaces.values())

    def held_slots(self, ns: Namespace) -> AbstractSet[int]:
        """The slots of ``ns`` clients lease without a call (``slot_of`` values)."""
        return self._hazards(ns)

    @staticmethod
    def slot_of(block: Block) -> int:
        """``block``'s slot as a client's page names it."""
        return hazard_of(block.extent.segment.segment_id, block.slot)

    def leased_blocks(self, ns: Namespace) -> int:
        """Blocks of ``ns`` leased, by calls or without (hazards)."""
        return ns.leased + len(self._hazards(ns))

    def local_reservations(self, session: Session) -> int:
        """Reservations ``session``'s client holds from grants (its page says; at most
        as many as it has grants taken)."""
        page = session.ns.pages.get(session.id)
        if page is None or not session.grants:
            return 0
        return min(page.local_reservations(), self._taken_grants(session))

    def local_leases(self, session: Session) -> int:
        """Leases ``session``'s client holds without a call."""
        page = session.ns.pages.get(session.id)
        return 0 if page is None else page.leases()

    @property
    def reservation_count(self) -> int:
        """Reservations open by clients, by call and from grants (promotions in flight
        are not counted)."""
        calls = sum(1 for r in self._reservations.values() if not r.session.system)
        return calls + sum(self.local_reservations(s) for s in self.sessions.values()
                           if s.grants)

    def dram_bytes(self, idle: dict[str, int] | None = None) -> dict[str, int]:
        """Tier accounting: total = free + reserved + granted + committed (bytes of
        slots); ``granted`` is the slots granted ahead and not taken (``idle_grants``,
        or ``idle`` when the caller has it), ``reserved`` the other reserved slots."""
        if idle is None:
            idle = self.idle_grants()
        spaces = self.namespaces
        granted = sum(n * spaces[name].slot_bytes for name, n in idle.items() if name in spaces)
        reserved = sum(ns.reserved * ns.slot_bytes for ns in spaces.values()) - granted
        committed = sum(ns.committed * ns.slot_bytes for ns in spaces.values())
        return {
            "total": self.capacity,
            "reserved": reserved,
            "granted": granted,
            "committed": committed,
            "free": self.capacity - reserved - granted - committed,
        }

    def check(self) -> list[str]:
        """Cross-check the index against the segments' slot tables; the problems found.

        An empty list means: every tier balances (free + reserved + committed ==
        total per extent and for the budget), every indexed block is committed
        on its segment under its key and generation, every committed or
        reserved slot is known to the index or a reservation, the LRU holds
        exactly the unleased visible blocks, and pin counts equal the leases.
        (``check_from(check_snapshot())``: the same, with the work off the loop.)
        """
        return _cross_check(self.check_snapshot())

    @staticmethod
    def check_from(snapshot: CheckSnapshot) -> list[str]:
        """``check()`` of a ``check_snapshot()``: reads nothing the store changes, so it
        runs in a worker thread (``loop.run_in_executor(None, store.check_from, snap)``)
        while the loop keeps serving; what it reports held when the snapshot was taken."""
        return _cross_check(snapshot)

    def check_snapshot(self) -> CheckSnapshot:
        """Copy what ``check_from`` cross-checks (on the loop: copies of lists, dicts and
        slot tables, no per-slot work), so the check itself can run in a worker thread
        while the store keeps changing."""
        leases = [(lease.blocks, list(map(_BLOCK_STATE, lease.blocks)))
                  for lease in self._leases.values()]
        reservations = [(r.session.ns, r.keys, r.places) for r in self._reservations.values()]
        reservations += [(s.ns, [], list(s.grants.values())) for s in self.sessions.values()
                         if s.grants]
        namespaces = []
        for ns in self.namespaces.values():
            items = list(ns.index.items())
            shared = ns.index.shared
            published = None if shared is None or shared.fd is None else (
                shared.fingerprints(), set(shared.unpublished))
            namespaces.append(_NamespaceView(
                ns=ns, name=ns.name, slot_bytes=ns.slot_bytes, reserved=ns.reserved,
                committed=ns.committed, leased=ns.leased, index=items,
                states=[_BLOCK_STATE(b) for _, b in items], in_flight=list(ns.in_flight),
                extents=[_ExtentView(
                    ext=ext, index=ext.segment.index, n_slots=ext.n_slots, file_bytes=ext.bytes,
                    free=list(ext.free), quarantine=set(ext.quarantine),
                    reserved=ext.reserved, committed=ext.committed, pinned=ext.pinned,
                    dirty=ext.dirty, table=ext.segment.raw_table(),
                ) for ext in ns.extents],
                published=published,
            ))
        return CheckSnapshot(namespaces=namespaces, leases=leases, reservations=reservations,
                             lru=list(self.lru), budget_free=self.budget_free,
                             capacity=self.capacity)


@dataclasses.dataclass(frozen=True, slots=True)
class _ExtentView:
    ext: Extent  # identity only: never read by check_from
    index: int
    n_slots: int
    file_bytes: int
    free: list[int]
    quarantine: set[int]
    reserved: int
    committed: int
    pinned: int
    dirty: int
    table: bytes  # the slot table as the segment held it


@dataclasses.dataclass(frozen=True, slots=True)
class _NamespaceView:
    ns: Namespace  # identity only
    name: str
    slot_bytes: int
    reserved: int
    committed: int
    leased: int
    index: list[tuple[bytes, Block]]
    states: list[tuple[int, bool, int]]  # (pins, doomed, lower) of each index entry's block
    in_flight: list[bytes]
    extents: list[_ExtentView]
    # The shared index's fingerprints and unpublished keys (None: not published).
    published: tuple[list[bytes], set[bytes]] | None


@dataclasses.dataclass(frozen=True, slots=True)
class CheckSnapshot:
    """What ``Store.check_from`` needs, copied by ``Store.check_snapshot`` on the loop.

    Blocks, extents and namespaces are held for their identity and for the
    fields that never change after they are made (key, extent, slot, length,
    checksum, generation); what changes (pins, doomed, lower, counters, free
    lists, slot tables) is copied.
    """

    namespaces: list[_NamespaceView]
    leases: list[tuple[list[Block], list[tuple[int, bool, int]]]]
    reservations: list[tuple[Namespace, list[bytes], list[tuple[Extent, int, int]]]]
    lru: list[Block]
    budget_free: int
    capacity: int


def _check_published(name: str, keys: list[bytes], fingerprints: list[bytes],
                     unpublished: set[bytes]) -> list[str]:
    """The shared index holds exactly the index's keys but the unpublished ones."""
    problems = []
    if len(set(fingerprints)) != len(fingerprints):
        problems.append(f"{name}: the shared index holds a key twice")
    want = {fingerprint(k): k for k in keys if k not in unpublished}
    have = set(fingerprints)
    for fp in sorted(want.keys() - have)[:5]:
        problems.append(f"{name}: key {want[fp].hex()} is in the index, not in the shared index")
    stray = len(have - want.keys())
    if stray:
        problems.append(f"{name}: the shared index holds {stray} keys the index does not")
    if unpublished - set(keys):
        problems.append(f"{name}: keys left the index but are still listed unpublished")
    return problems


def _cross_check(snap: CheckSnapshot) -> list[str]:
    """``Store.check_from``: every cross-check, on the snapshot alone."""
    problems: list[str] = []
    pins: collections.Counter[int] = collections.Counter()
    state: dict[int, tuple[int, bool, int]] = {}
    doomed_leased: dict[int, list[Block]] = {}  # id(namespace) -> its doomed leased blocks
    for blocks, states in snap.leases:
        for block, st in zip(blocks, states, strict=True):
            pins[id(block)] += 1
            state[id(block)] = st
            if st[1]:
                doomed_leased.setdefault(id(block.ns), []).append(block)
    reserved_at: set[tuple[int, int]] = set()
    for _ns, _keys, places in snap.reservations:
        for ext, slot, _gen in places:
            reserved_at.add((id(ext), slot))
    extent_bytes = 0
    lru_expected: set[int] = set()
    reserved_bytes = committed_bytes = 0
    for nsv in snap.namespaces:
        name = nsv.name
        reserved_bytes += nsv.reserved * nsv.slot_bytes
        committed_bytes += nsv.committed * nsv.slot_bytes
        blocks_at: dict[tuple[int, int], Block] = {}
        for (key, block), st in zip(nsv.index, nsv.states, strict=True):
            state[id(block)] = st
            if block.key != key or st[1]:
                problems.append(f"{name}: index entry {key.hex()} points at a wrong block")
            blocks_at[(id(block.extent), block.slot)] = block
            if st[0] == 0:
                lru_expected.add(id(block))
        if nsv.published is not None:
            problems.extend(_check_published(name, [k for k, _ in nsv.index], *nsv.published))
        for block in doomed_leased.get(id(nsv.ns), ()):
            blocks_at[(id(block.extent), block.slot)] = block
        totals = {"free": 0, "reserved": 0, "committed": 0}
        ns_pinned = 0
        for ev in nsv.extents:
            extent_bytes += ev.file_bytes
            ns_pinned += _check_extent(ev, name, blocks_at, reserved_at, state, pins, totals,
                                       problems)
        if ns_pinned != nsv.leased:
            problems.append(f"{name}: leased counter {nsv.leased} != leased blocks {ns_pinned}")
        if (totals["reserved"], totals["committed"]) != (nsv.reserved, nsv.committed):
            problems.append(f"{name}: namespace counters ({nsv.reserved}, {nsv.committed}) "
                            f"!= slot tables ({totals['reserved']}, {totals['committed']})")
        if set(nsv.in_flight) != {k for ns, keys, _ in snap.reservations if ns is nsv.ns
                                  for k in keys}:
            problems.append(f"{name}: in-flight keys disagree with open reservations")
    if extent_bytes + snap.budget_free != snap.capacity:
        problems.append(f"DRAM budget does not balance: extents {extent_bytes} + free "
                        f"{snap.budget_free} != capacity {snap.capacity}")
    if {id(b) for b in snap.lru} != lru_expected:
        problems.append("LRU does not hold exactly the unleased visible blocks")
    acct = {"total": snap.capacity, "reserved": reserved_bytes, "committed": committed_bytes,
            "free": snap.capacity - reserved_bytes - committed_bytes}
    if acct["free"] + acct["reserved"] + acct["committed"] != acct["total"] or acct["free"] < 0:
        problems.append(f"DRAM accounting does not add up: {acct}")
    return problems


def _check_extent(
    ev: _ExtentView,
    name: str,
    blocks_at: dict[tuple[int, int], Block],
    reserved_at: set[tuple[int, int]],
    state: dict[int, tuple[int, bool, int]],
    pins: collections.Counter[int],
    totals: dict[str, int],
    problems: list[str],
) -> int:
    """One extent's slot table against the index, reservations and counters: adds to
    ``totals`` and ``problems``; returns its leased slots."""
    free_set = set(ev.free)
    if len(free_set) != len(ev.free):
        problems.append(f"{name}: extent {ev.index} free list has duplicates")
    rows = np.frombuffer(ev.table, dtype=SLOT_DTYPE, count=ev.n_slots)
    states = rows["state"].tolist()
    klens = rows["key_len"].tolist()
    lengths = rows["length"].tolist()
    gens = rows["generation"].tolist()
    flags = rows["flags"].tolist()
    sums = rows["checksum"].tolist()
    table = ev.table
    me = id(ev.ext)
    counts = {"free": 0, "reserved": 0, "committed": 0}
    pinned_slots = 0
    dirty = 0
    for slot, st in enumerate(states):
        where = f"{name}: extent {ev.index} slot {slot}"
        owner = blocks_at.get((me, slot))
        held = (me, slot) in reserved_at
        if st == SlotState.FREE:
            counts["free"] += 1
            if slot not in free_set:
                problems.append(f"{where}: FREE on segment but not on the free list")
            if owner is not None or held:
                problems.append(f"{where}: FREE on segment but in use in the index")
        elif st == SlotState.RESERVED:
            counts["reserved"] += 1
            if not held and slot not in ev.quarantine:
                problems.append(f"{where}: RESERVED on segment but no reservation")
        elif st == SlotState.DOOMED:
            counts["committed"] += 1  # still pinned by a reader
            if owner is None or not state[id(owner)][1]:
                problems.append(f"{where}: DOOMED on segment but not a deleted leased block")
        elif st == SlotState.COMMITTED:
            counts["committed"] += 1
            if owner is None or state[id(owner)][1]:
                problems.append(f"{where}: COMMITTED on segment but not indexed")
            else:
                at = slot * SLOT_ENTRY_BYTES + KEY_OFFSET
                key = table[at : at + min(klens[slot], MAX_KEY_BYTES)]
                checksum = sums[slot] if flags[slot] & FLAG_HAS_CHECKSUM else None
                if (key, lengths[slot], gens[slot], checksum) != (
                    owner.key, owner.length, owner.generation, owner.checksum
                ):
                    problems.append(f"{where}: slot table disagrees with the index")
        else:
            problems.append(f"{where}: state byte {st} is no slot state")
        if owner is not None:
            owner_pins, _doomed, lower = state[id(owner)]
            dirty += lower == Lower.DIRTY
            if pins[id(owner)] != owner_pins:
                problems.append(f"{where}: pins {owner_pins} != leases {pins[id(owner)]}")
            if owner_pins:
                pinned_slots += 1
    if counts["free"] != len(ev.free):
        problems.append(f"{name}: extent {ev.index} free list "
                        f"{len(ev.free)} != FREE slots {counts['free']}")
    if (counts["reserved"], counts["committed"]) != (ev.reserved, ev.committed):
        problems.append(f"{name}: extent {ev.index} counters "
                        f"({ev.reserved}, {ev.committed}) != slot table "
                        f"({counts['reserved']}, {counts['committed']})")
    if sum(counts.values()) != ev.n_slots:
        problems.append(f"{name}: extent {ev.index} does not balance")
    if dirty != ev.dirty:
        problems.append(f"{name}: extent {ev.index} dirty counter "
                        f"{ev.dirty} != DIRTY blocks {dirty}")
    if pinned_slots != ev.pinned:
        problems.append(f"{name}: extent {ev.index} pinned counter "
                        f"{ev.pinned} != leased slots {pinned_slots}")
    for k in totals:
        totals[k] += counts[k]
    return pinned_slots
