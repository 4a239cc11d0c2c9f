"""The store: per-namespace index, one host-wide LRU, reservations, leases.

Policy lives here; bytes never do.  The store decides which slot a key gets,
when a block becomes visible, which block is evicted, and who holds what;
the mechanism (``segments``) persists slot states; the service translates the
wire.  Every public call either applies fully or changes nothing (a failed
call may only have *evicted* unleased blocks, which is cache policy, never a
loss of anything acknowledged to a caller as leased or reserved).

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
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
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
from kvtierd.logs import event
from kvtierd.segments import Segment, SegmentLayout, SlotState

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
    index: dict[bytes, Block] = dataclasses.field(default_factory=dict)
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

    #: (slot, key, length, checksum or None) of each block to adopt
    blocks: list[tuple[int, bytes, int, int | None]]
    #: the persisted last access of each of ``blocks`` (LRU order)
    last_access: list[int]
    #: RESERVED slots: quarantined for the reservation TTL, then freed
    reserved: list[int]
    #: free slots
    free: list[int]
    #: every slot's generation (in range)
    generations: list[int]


class _NeedExtent(Exception):
    """Internal signal: the reserve fits only after growing ``slots`` more free slots."""

    def __init__(self, slots: int) -> None:
        super().__init__(slots)
        self.slots = slots


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
    ) -> None:
        self.capacity = capacity
        self.extent_size = extent_size
        self.lease_ttl = lease_ttl
        self.reservation_ttl = reservation_ttl
        self.boot_epoch = boot_epoch
        self._factory = extent_factory
        self._clock = clock
        self._on_evict = on_evict
        self.namespaces: dict[str, Namespace] = {}
        self.sessions: dict[int, Session] = {}
        self._system_sessions: dict[str, Session] = {}
        #: Set by the tiering layer when a spill tier exists: evict only non-DIRTY blocks.
        self.spill_enabled = False
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
        self._retiring: set[asyncio.Future[None]] = set()
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

    # ================================================================ sessions
    def open_session(self, name: str, block_bytes: int, model_uid: str, peer: Peer) -> Session:
        """Declare (or join) a namespace and start a session in it."""
        ns = self.namespaces.get(name)
        if ns is None:
            layout = SegmentLayout.fit(block_bytes, self.capacity)
            if layout is None:
                raise InvalidArgument(
                    f"block_bytes {block_bytes} does not fit in dram.capacity {self.capacity}"
                )
            ns = Namespace(name, block_bytes, model_uid, layout.slot_bytes)
            self.namespaces[name] = ns
            log.info("namespace %r declared: block_bytes=%d model_uid=%r", name, block_bytes,
                     model_uid, extra=event("namespace_declared", namespace=name,
                                            block_bytes=block_bytes, model_uid=model_uid))
        elif (ns.block_bytes, ns.model_uid) != (block_bytes, model_uid) and not ns.declared:
            # Only recovered data has this layout (e.g. the model was upgraded while the
            # daemon was down): reformat this namespace, never mix or refuse forever.
            self._reformat(ns, f"declared with block_bytes={block_bytes} "
                               f"model_uid={model_uid!r}; the {ns.committed} recovered blocks of "
                               f"block_bytes={ns.block_bytes} model_uid={ns.model_uid!r} are "
                               "dropped")
            return self.open_session(name, block_bytes, model_uid, peer)
        elif ns.block_bytes != block_bytes or ns.model_uid != model_uid:
            raise FailedPrecondition(
                f"namespace {name!r} is declared with block_bytes={ns.block_bytes} "
                f"model_uid={ns.model_uid!r}; refusing block_bytes={block_bytes} "
                f"model_uid={model_uid!r}"
            )
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
        session.closed = True
        n_res = sum(len(r.keys) for r in session.reservations.values())
        n_lease = len(session.leases)
        for res in list(session.reservations.values()):
            self._end_reservation(res, commit=None)
        for lease in list(session.leases.values()):
            self._end_lease(lease)
        del self.sessions[session.id]
        del self._by_token[session.token]
        session.ns.sessions -= 1
        self._forget_if_unused(session.ns)
        return (n_res, n_lease)

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
        del self.namespaces[ns.name]
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
        return self._reserve_now(session, keys, exists, may_grow=False)

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
        places = self._take_slots(ns, len(new_keys), may_grow=may_grow)
        # From here on nothing can fail: apply.
        rid = next(self._ids)
        now = self._clock()
        res = Reservation(rid, session, new_keys, [], now + self.reservation_ttl, started=now)
        grants: list[SlotGrant] = []
        for key, (ext, slot) in zip(new_keys, places, strict=False):
            gen = ext.generations[slot] + 1
            ext.generations[slot] = gen
            ext.reserved += 1
            ext.segment.mark_reserved(slot, gen)
            ns.in_flight[key] = rid
            res.places.append((ext, slot, gen))
            grants.append(SlotGrant(ext.segment.segment_id, ext.segment.slot_offset(slot),
                                    ns.block_bytes, None))
        ns.reserved += len(new_keys)
        session.reservations[rid] = res
        self._reservations[rid] = res
        return ReserveResult(rid, statuses, grants, ns.segments_version)

    def _take_slots(self, ns: Namespace, n: int, *, may_grow: bool) -> list[tuple[Extent, int]]:
        """Pop ``n`` free slots of ``ns``, evicting or reclaiming as needed.

        Order: free slots; growth while the budget allows; then, walking the
        host-wide LRU from the oldest block, either evict blocks of ``ns`` or
        reclaim whole extents of other namespaces (empty ones first) until
        the budget fits a new extent.  Victims are planned before anything
        changes: on failure every popped slot is back and nothing is evicted.
        (A key the same request saw as EXISTS may be among the victims when
        the request needs nearly the whole namespace; its status was true
        when the call began.)
        """
        taken: list[tuple[Extent, int]] = []

        def give_back() -> None:
            for ext, slot in reversed(taken):
                ext.free.append(slot)

        for ext in ns.extents:
            while ext.free and len(taken) < n:
                taken.append((ext, ext.free.pop()))
            if len(taken) == n:
                return taken
        short = n - len(taken)
        # A namespace at its DRAM quota neither grows nor reclaims others' extents: it
        # evicts its own blocks (access.namespaces[].dram_quota; checked off the fast path).
        quota = self.dram_quota_of(ns.name)
        held = ns.extent_bytes() if quota else 0
        at_quota = bool(quota) and SegmentLayout.fit(ns.block_bytes, quota - held) is None
        may_grow = may_grow and not at_quota
        # Room in the budget: grow rather than evict.
        if may_grow and SegmentLayout.fit(ns.block_bytes, self.budget_free) is not None:
            give_back()
            raise _NeedExtent(n)
        same_ns: list[Block] = []
        dirty_ns: list[Block] = []  # DIRTY blocks of ns: evictable once demoted
        dirty_ext: list[Extent] = []  # other namespaces' extents blocked only by DIRTY blocks
        spill = self.spill_enabled
        reclaim: list[Extent] = []
        reclaim_bytes = 0

        def funded() -> bool:
            return SegmentLayout.fit(ns.block_bytes, self.budget_free + reclaim_bytes) is not None

        if may_grow:
            # Empty extents of other namespaces cost nothing to reclaim (but never
            # take what a namespace that is growing right now just created).
            for other in self.namespaces.values():
                if other is ns or other.grow_lock.locked():
                    continue
                for ext in other.extents:
                    if not funded() and ext.committed == 0 and ext.reserved == 0:
                        reclaim.append(ext)
                        reclaim_bytes += ext.bytes
        considered: set[int] = {id(e) for e in reclaim}
        for scanned, block in enumerate(self.lru):
            if scanned >= EVICTION_SCAN_LIMIT or len(same_ns) >= short or (reclaim and funded()):
                break
            if block.ns is ns:
                if spill and block.lower == Lower.DIRTY:
                    if len(dirty_ns) < short:
                        dirty_ns.append(block)
                else:
                    same_ns.append(block)
            elif may_grow and id(block.extent) not in considered:
                considered.add(id(block.extent))
                ext = block.extent
                if ext.reserved == 0 and ext.pinned == 0 and not block.ns.grow_lock.locked():
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
            give_back()
            for ext in reclaim:
                self._retire_extent(ext)
            for name in {e.segment.namespace for e in reclaim}:
                self._forget_if_unused(self.namespaces[name])
            raise _NeedExtent(n)
        if len(same_ns) >= short:
            for block in same_ns[:short]:
                self._evict(block)
                taken.append((block.extent, block.extent.free.pop()))
            return taken
        give_back()
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
                f"slots needed, {len(taken) + len(same_ns)} obtainable by evicting its own "
                f"blocks ({ns.leased} leased and {ns.reserved} reserved blocks cannot be "
                "evicted)")
        raise CapacityExhausted(
            f"DRAM is full for namespace {ns.name!r}: {n} slots needed, "
            f"{len(taken) + len(same_ns)} obtainable ({ns.leased} leased and "
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
        ns = res.session.ns
        made: list[Block | None] = []
        for i, (key, (ext, slot, gen)) in enumerate(zip(res.keys, res.places, strict=False)):
            del ns.in_flight[key]
            ext.reserved -= 1
            if commit is None or commit[0][i] == 0:
                ext.segment.mark_free(slot)
                ext.free.append(slot)
                made.append(None)
                continue
            lengths, checksums = commit
            checksum = checksums[i] if checksums is not None else None
            ext.segment.mark_committed(
                slot, key=key, length=lengths[i], checksum=checksum,
                last_access=next(self._access_seq), generation=gen, epoch=self.boot_epoch,
            )
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
        ns.hits += len(blocks)
        ns.misses += len(keys) - len(blocks)
        if not blocks:
            return AcquireResult(0, [], ns.segments_version)
        lid = next(self._ids)
        now = self._clock()
        lease = Lease(lid, session, blocks, now + self.lease_ttl, started=now)
        for block in blocks:
            self._pin(block)
            block.extent.segment.touch(block.slot, next(self._access_seq))
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
        self._end_lease(lease)

    def _pin(self, block: Block) -> None:
        if block.pins == 0:
            self.lru.pop(block, None)
            block.extent.pinned += 1
            block.ns.leased += 1
        block.pins += 1

    def _end_lease(self, lease: Lease) -> None:
        for block in lease.blocks:
            block.pins -= 1
            if block.pins:
                continue
            block.extent.pinned -= 1
            block.ns.leased -= 1
            if block.doomed:
                self._free_block(block)
            else:
                self.lru[block] = None  # most recently used
        del lease.session.leases[lease.id]
        del self._leases[lease.id]

    # ================================================================ delete / evict
    def delete(self, session: Session, keys: Sequence[bytes]) -> int:
        """Remove present keys; a leased block is hidden now and freed at its last release."""
        ns = session.ns
        deleted = 0
        for key in dict.fromkeys(keys):
            block = ns.index.pop(key, None)
            if block is None:
                continue
            deleted += 1
            if block.pins:
                block.doomed = True
                block.extent.segment.mark_doomed(block.slot)  # persisted: a crash keeps it deleted
            else:
                self.lru.pop(block, None)
                self._free_block(block)
        return deleted

    def evict_block(self, block: Block) -> bool:
        """Evict one DRAM block on an admin's request (``kvtier evict``), through the
        same exit as LRU eviction.  False, changing nothing, when the block is
        leased or no longer visible."""
        if block.pins or block.doomed or block.ns.index.get(block.key) is not block:
            return False
        self._evict(block)
        return True

    def _evict(self, block: Block) -> None:
        """The one exit of DRAM blocks (the spill tiers turn this into demotion)."""
        assert block.pins == 0 and not block.doomed
        del block.ns.index[block.key]
        self.lru.pop(block, None)
        self._free_block(block)
        self.evictions += 1
        if self._on_evict is not None:
            self._on_evict(block)

    def _free_block(self, block: Block) -> None:
        ext = block.extent
        ext.segment.mark_free(block.slot)
        ext.committed -= 1
        if block.lower == Lower.DIRTY:
            ext.dirty -= 1
        block.ns.committed -= 1
        ext.free.append(block.slot)

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
        leases = []
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
            self._end_lease(lease)

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

        File creation and pre-faulting run off the loop; the budget is taken
        before and given back if creation fails.  False when nothing could be
        added (the caller then evicts).
        """
        async with ns.grow_lock:
            while ns.free_slots() < need:
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
                try:
                    segment = await loop.run_in_executor(None, self._factory, ns, index, layout,
                                                         seg_id)
                except BaseException as exc:
                    self.budget_free += layout.file_bytes
                    if isinstance(exc, OSError):
                        raise CapacityExhausted(f"could not create a DRAM extent: {exc}") from exc
                    raise
                self.add_extent(ns, segment)
            return ns.free_slots() > 0

    def add_extent(self, ns: Namespace, segment: Segment) -> None:
        """Account a created segment (its bytes are already taken from the budget)."""
        n = segment.layout.n_slots
        ext = Extent(segment, list(range(n - 1, -1, -1)), [0] * n)
        ns.extents.append(ext)
        ns.segments_version += 1
        self.prefault_seconds += segment.prefault_seconds
        if segment.mlock_error is not None:
            self.mlock_errors.append(segment.mlock_error)

    def _retire_extent(self, ext: Extent, why: str = "for another namespace") -> None:
        """Evict every block of an extent and give its bytes back to the budget."""
        ns = ext.segment.namespace
        owner = self.namespaces[ns]
        for block in [b for b in owner.index.values() if b.extent is ext]:
            self._evict(block)
        assert ext.committed == 0 and ext.reserved == 0
        owner.extents.remove(ext)
        owner.segments_version += 1
        self.budget_free += ext.bytes
        log.info("reclaimed extent %d of namespace %r (%d bytes) %s",
                 ext.segment.index, ns, ext.bytes, why)
        # Unlink now (a tmpfs metadata update): the budget is free again at once, so a
        # crash before the background unmap must not find the file still counted.
        ext.segment.unlink()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            ext.segment.close(unlink=False)
            return
        fut = loop.run_in_executor(None, lambda: ext.segment.close(unlink=False))
        self._retiring.add(fut)
        fut.add_done_callback(self._retiring.discard)

    def _reformat(self, ns: Namespace, why: str) -> None:
        """Drop a namespace nobody uses yet: every extent retired, its files removed."""
        assert ns.sessions == 0
        log.warning("namespace %r reformatted: %s", ns.name, why,
                    extra=event("namespace_reformatted", namespace=ns.name, reason=why))
        self.dropped_segments.append(f"namespace {ns.name!r} reformatted: {why}")
        for ext in list(ns.extents):
            ext.reserved -= len(ext.quarantine)  # a late writer of a previous run writes
            ns.reserved -= len(ext.quarantine)   # into the unlinked file: harmless
            ext.quarantine.clear()
            self._retire_extent(ext, "(namespace reformatted)")
        del self.namespaces[ns.name]

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
        ones.  Returns the blocks recovered.  Raises like ``check_adoptable``;
        the store is unchanged then.
        """
        self.check_adoptable(segment)
        lay = segment.layout
        ns = self.namespaces.get(segment.namespace)
        if ns is None:
            ns = Namespace(segment.namespace, lay.block_bytes, segment.model_uid, lay.slot_bytes)
            self.namespaces[ns.name] = ns
        ext = Extent(segment, [], list(slots.generations))
        gens = ext.generations
        deadline = self._clock() + self.reservation_ttl
        recovered = 0
        index, adopted, adopted_at = ns.index, self._adopted, self._adopted_at
        for slot in slots.reserved:
            ext.quarantine[slot] = deadline
        ext.reserved += len(ext.quarantine)
        ns.reserved += len(ext.quarantine)
        ext.free = sorted(slots.free, reverse=True)  # pop() hands out the lowest slot first
        for (slot, key, length, checksum), last in zip(slots.blocks, slots.last_access,
                                                        strict=True):
            old = index.get(key)
            if old is not None:  # the same key twice (never written so; be safe)
                log.warning("namespace %r: key %s committed twice; keeping the newer copy",
                            ns.name, key.hex())
                at_old = adopted.index(old)  # rare: a linear search is fine
                if adopted_at[at_old] >= last:
                    segment.mark_free(slot)
                    ext.free.append(slot)
                    continue
                del index[key]
                del adopted[at_old], adopted_at[at_old]
                if old.extent is ext:  # not counted yet: just free its slot
                    segment.mark_free(old.slot)
                    ext.free.append(old.slot)
                    recovered -= 1
                else:
                    self._free_block(old)
                    ns.recovered -= 1
            block = Block(ns, key, ext, slot, length, checksum, gens[slot])
            index[key] = block
            adopted.append(block)
            adopted_at.append(last)
            recovered += 1
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
        """Order the adopted blocks by their persisted last access (oldest first in the LRU)."""
        blocks = self._adopted
        lasts = np.array(self._adopted_at, dtype=np.uint64)
        lru = self.lru
        for i in np.argsort(lasts, kind="stable").tolist():
            lru[blocks[i]] = None
        top = int(lasts.max()) if len(blocks) else 0
        self._access_seq = itertools.count(top + 1)
        self._adopted, self._adopted_at = [], []

    def _release_quarantine(self, now: float) -> int:
        n = 0
        for ns in self.namespaces.values():
            for ext in ns.extents:
                if not ext.quarantine:
                    continue
                for slot in [s for s, t in ext.quarantine.items() if t <= now]:
                    del ext.quarantine[slot]
                    ext.segment.mark_free(slot)
                    ext.reserved -= 1
                    ns.reserved -= 1
                    ext.free.append(slot)
                    n += 1
        return n

    def segments(self, ns: Namespace) -> list[Segment]:
        return [e.segment for e in ns.extents]

    async def drain(self) -> None:
        """Wait for extents being retired in the background."""
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    def close_all(self) -> None:
        """Unmap every segment, keeping the files (the warm-restart path re-attaches them)."""
        for ns in self.namespaces.values():
            for ext in ns.extents:
                ext.segment.close(unlink=False)

    # ================================================================ expiry
    def expire(self) -> tuple[collections.Counter[str], int]:
        """Abort reservations and release leases past their deadline.

        Returns (reserved slots returned per namespace, leases released).
        """
        now = self._clock()
        stale_res = [r for r in self._reservations.values()
                     if r.expires <= now and not r.session.system]
        if stale_res:  # one line per sweep, however many expired (an expiry storm)
            log.warning("%d reservations expired (ids %s%s); their %d slots are quarantined "
                        "for %.0f s", len(stale_res), ", ".join(str(r.id) for r in stale_res[:5]),
                        ", ..." if len(stale_res) > 5 else "",
                        sum(len(r.keys) for r in stale_res), self.reservation_ttl,
                        extra=event("reservations_expired", count=len(stale_res)))
        for res in stale_res:
            self._expire_reservation(res, now + self.reservation_ttl)
        self._release_quarantine(now)
        stale_leases = [lease for lease in self._leases.values()
                        if lease.expires <= now and not lease.session.system]
        if stale_leases:
            log.warning("%d leases expired after %.0f s (ids %s%s)", len(stale_leases),
                        self.lease_ttl, ", ".join(str(x.id) for x in stale_leases[:5]),
                        ", ..." if len(stale_leases) > 5 else "",
                        extra=event("leases_expired", count=len(stale_leases)))
        for lease in stale_leases:
            self._end_lease(lease)
        aborted: collections.Counter[str] = collections.Counter()
        for res in stale_res:
            aborted[res.session.ns.name] += len(res.keys)
        return (aborted, len(stale_leases))

    # ================================================================ accounting
    @property
    def lease_count(self) -> int:
        """Leases held by clients (the tiering layer's own pins are not counted)."""
        return sum(1 for lease in self._leases.values() if not lease.session.system)

    @property
    def reservation_count(self) -> int:
        """Reservations open by clients (promotions in flight are not counted)."""
        return sum(1 for r in self._reservations.values() if not r.session.system)

    def dram_bytes(self) -> dict[str, int]:
        """Tier accounting: total = free + reserved + committed (bytes of slots)."""
        reserved = sum(ns.reserved * ns.slot_bytes for ns in self.namespaces.values())
        committed = sum(ns.committed * ns.slot_bytes for ns in self.namespaces.values())
        return {
            "total": self.capacity,
            "reserved": reserved,
            "committed": committed,
            "free": self.capacity - reserved - committed,
        }

    def check(self) -> list[str]:
        """Cross-check the index against the segments' slot tables; the problems found.

        An empty list means: every tier balances (free + reserved + committed ==
        total per extent and for the budget), every indexed block is committed
        on its segment under its key and generation, every committed or
        reserved slot is known to the index or a reservation, the LRU holds
        exactly the unleased visible blocks, and pin counts equal the leases.
        """
        problems: list[str] = []
        pins: collections.Counter[int] = collections.Counter()
        for lease in self._leases.values():
            for block in lease.blocks:
                pins[id(block)] += 1
        reserved_at: dict[tuple[int, int], Reservation] = {}
        for res in self._reservations.values():
            for ext, slot, _gen in res.places:
                reserved_at[(id(ext), slot)] = res
        extent_bytes = 0
        lru_expected: set[int] = set()
        for ns in self.namespaces.values():
            blocks_at: dict[tuple[int, int], Block] = {}
            for key, block in ns.index.items():
                if block.key != key or block.doomed:
                    problems.append(f"{ns.name}: index entry {key.hex()} points at a wrong block")
                blocks_at[(id(block.extent), block.slot)] = block
                if block.pins == 0:
                    lru_expected.add(id(block))
            for lease in self._leases.values():
                for block in lease.blocks:
                    if block.doomed and block.ns is ns:
                        blocks_at[(id(block.extent), block.slot)] = block
            totals = {"free": 0, "reserved": 0, "committed": 0}
            ns_pinned = 0
            for ext in ns.extents:
                extent_bytes += ext.bytes
                free_set = set(ext.free)
                if len(free_set) != len(ext.free):
                    problems.append(f"{ns.name}: extent {ext.segment.index} free list has duplicates")
                counts = {"free": 0, "reserved": 0, "committed": 0}
                pinned_slots = 0
                dirty = 0
                for slot in range(ext.n_slots):
                    rec = ext.segment.read_slot(slot)
                    where = f"{ns.name}: extent {ext.segment.index} slot {slot}"
                    owner = blocks_at.get((id(ext), slot))
                    holder = reserved_at.get((id(ext), slot))
                    if rec.state == SlotState.FREE:
                        counts["free"] += 1
                        if slot not in free_set:
                            problems.append(f"{where}: FREE on segment but not on the free list")
                        if owner is not None or holder is not None:
                            problems.append(f"{where}: FREE on segment but in use in the index")
                    elif rec.state == SlotState.RESERVED:
                        counts["reserved"] += 1
                        if holder is None and slot not in ext.quarantine:
                            problems.append(f"{where}: RESERVED on segment but no reservation")
                    elif rec.state == SlotState.DOOMED:
                        counts["committed"] += 1  # still pinned by a reader
                        if owner is None or not owner.doomed:
                            problems.append(f"{where}: DOOMED on segment but not a deleted "
                                            "leased block")
                    else:
                        counts["committed"] += 1
                        if owner is None or owner.doomed:
                            problems.append(f"{where}: COMMITTED on segment but not indexed")
                        elif (rec.key, rec.length, rec.generation, rec.checksum) != (
                            owner.key, owner.length, owner.generation, owner.checksum
                        ):
                            problems.append(f"{where}: slot table disagrees with the index")
                    if owner is not None:
                        dirty += owner.lower == Lower.DIRTY
                        if pins[id(owner)] != owner.pins:
                            problems.append(
                                f"{where}: pins {owner.pins} != leases {pins[id(owner)]}")
                        if owner.pins:
                            pinned_slots += 1
                if counts["free"] != len(ext.free):
                    problems.append(f"{ns.name}: extent {ext.segment.index} free list "
                                    f"{len(ext.free)} != FREE slots {counts['free']}")
                if (counts["reserved"], counts["committed"]) != (ext.reserved, ext.committed):
                    problems.append(f"{ns.name}: extent {ext.segment.index} counters "
                                    f"({ext.reserved}, {ext.committed}) != slot table "
                                    f"({counts['reserved']}, {counts['committed']})")
                if sum(counts.values()) != ext.n_slots:
                    problems.append(f"{ns.name}: extent {ext.segment.index} does not balance")
                if dirty != ext.dirty:
                    problems.append(f"{ns.name}: extent {ext.segment.index} dirty counter "
                                    f"{ext.dirty} != DIRTY blocks {dirty}")
                if pinned_slots != ext.pinned:
                    problems.append(f"{ns.name}: extent {ext.segment.index} pinned counter "
                                    f"{ext.pinned} != leased slots {pinned_slots}")
                ns_pinned += pinned_slots
                for k in totals:
                    totals[k] += counts[k]
            if ns_pinned != ns.leased:
                problems.append(f"{ns.name}: leased counter {ns.leased} != leased blocks {ns_pinned}")
            if (totals["reserved"], totals["committed"]) != (ns.reserved, ns.committed):
                problems.append(f"{ns.name}: namespace counters ({ns.reserved}, {ns.committed}) "
                                f"!= slot tables ({totals['reserved']}, {totals['committed']})")
            if set(ns.in_flight) != {k for r in self._reservations.values()
                                     if r.session.ns is ns for k in r.keys}:
                problems.append(f"{ns.name}: in-flight keys disagree with open reservations")
        if extent_bytes + self.budget_free != self.capacity:
            problems.append(f"DRAM budget does not balance: extents {extent_bytes} + free "
                            f"{self.budget_free} != capacity {self.capacity}")
        if {id(b) for b in self.lru} != lru_expected:
            problems.append("LRU does not hold exactly the unleased visible blocks")
        acct = self.dram_bytes()
        if acct["free"] + acct["reserved"] + acct["committed"] != acct["total"] or acct["free"] < 0:
            problems.append(f"DRAM accounting does not add up: {acct}")
        return problems
