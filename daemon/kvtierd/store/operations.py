"""The client operations with a call: sessions, lookup, reserve/commit/abort, acquire/
release, delete; and the tiering layer's hooks (system pins, settle, demotion).

A component the store holds (``Store.calls``), given the store's state, budget and
allocator: the pins it grants and ends are the state's, the room it takes is the
allocator's (``Allocator.claim_refs``), the growth a reserve waits for is the budget's."""


from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvtier import _native, _slot_ref
from kvtier.errors import (
    CapacityExhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unauthenticated,
)
from kvtierd.block_table import Policy
from kvtierd.logs import event
from kvtierd.segments import (
    MAX_KEY_BYTES,
    Segment,
    SegmentLayout,
)
from kvtierd.store.allocator import Allocator, blocks_of, offsets
from kvtierd.store.base import _NeedExtent, _Raced, _refs
from kvtierd.store.budget import Budget
from kvtierd.store.state import StoreState
from kvtierd.store.types import (
    MAX_GROW_ROUNDS,
    AcquireResult,
    Block,
    BlockBatch,
    Commits,
    Lease,
    Lower,
    Namespace,
    Peer,
    Reservation,
    ReserveResult,
    ReserveStatus,
    Session,
    U64s,
)

log = logging.getLogger(__name__)

_NO_REFS = np.zeros(0, dtype=np.uint64)
# (plain ints: an IntEnum member costs a metaclass lookup and numpy a conversion)
_RESERVED, _EXISTS, _IN_FLIGHT = (int(ReserveStatus.RESERVED), int(ReserveStatus.EXISTS),
                                  int(ReserveStatus.IN_FLIGHT))


def _u64_or_none(values: Sequence[int | None] | U64s) -> npt.NDArray[np.uint64] | None:
    """``values`` as a uint64 column, or None when one is not an integer in 0..2**64-1."""
    if isinstance(values, np.ndarray) and values.dtype == np.uint64:
        return values if values.ndim == 1 else None  # (a column read from the wire)
    if not len(values):
        return _NO_REFS
    try:  # (ints from the wire or the store itself: no floats to truncate)
        column = np.array(values, dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):
        return None
    return column if column.ndim == 1 else None


class Operations:
    """The operations clients and the tiering layer call with a call (``Store`` hands
    each on).  Runs on the event loop thread; only a reserve awaits (growth)."""

    def __init__(self, state: StoreState, budget: Budget, room: Allocator, *,
                 capacity: int) -> None:
        self._state = state
        self._budget = budget
        self._room = room
        self._capacity = capacity

    def open_session(self, name: str, block_bytes: int, model_uid: str, peer: Peer) -> Session:
        """Declare (or join) a namespace and start a session in it."""
        ns = self._state.namespaces.get(name)
        layout = SegmentLayout.fit(block_bytes, self._capacity)
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
                self._room.reformat(ns, f"declared with block_bytes={block_bytes} "
                                        f"model_uid={model_uid!r}; the {ns.committed} recovered "
                                        f"blocks of block_bytes={ns.block_bytes} "
                                        f"model_uid={ns.model_uid!r} are dropped")
                ns = None
        if layout is None:
            raise InvalidArgument(
                f"block_bytes {block_bytes} does not fit in dram.capacity {self._capacity}"
            )
        # Applied: nothing below can fail.
        if ns is None:
            ns = self._state.new_namespace(name, block_bytes, model_uid, layout.slot_bytes)
            log.info("namespace %r declared: block_bytes=%d model_uid=%r", name, block_bytes,
                     model_uid, extra=event("namespace_declared", namespace=name,
                                            block_bytes=block_bytes, model_uid=model_uid))
        ns.declared = True
        sid = self._state.next_id()
        session = Session(sid, secrets.token_hex(16), ns, peer, self._state.clock())
        self._state.sessions[sid] = session
        self._state.by_token[session.token] = session
        ns.sessions += 1
        return session

    def session_for(self, token: str) -> Session:
        session = self._state.by_token.get(token)
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
        ns = session.ns
        # One table call: every reserved and granted slot freed, every pin ended (or none).
        places = [res.refs for res in reservations]
        places.append(session.grants.refs())
        claims = np.concatenate(places)
        unpin = np.concatenate([lease.refs for lease in leases]) if leases else None
        if len(claims) or unpin is not None:
            ns.table.release_claims(claims, unpin=unpin)
        # Applied: nothing below can fail.
        session.closed = True
        for res in reservations:
            ns.in_flight.close(res.id, res.keys)
            del session.reservations[res.id]
            del self._state.reservations[res.id]
        for lease in leases:
            del session.leases[lease.id]
            del self._state.leases[lease.id]
        session.grants.end(list(session.grants), freed=True)
        del self._state.sessions[session.id]
        del self._state.by_token[session.token]
        session.ns.pages.pop(session.id, None)  # its hazards end with it
        session.ns.sessions -= 1
        self._state.forget_if_unused(session.ns)
        return (sum(len(r.keys) for r in reservations), len(leases))

    def lookup(self, session: Session, keys: Sequence[bytes]) -> int:
        """Number of leading keys present (committed, not deleted); no side effects."""
        return session.ns.index.prefix(keys)

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
        for _wait in range(MAX_GROW_ROUNDS):
            try:
                return await self._reserve_rounds(session, keys, exists)
            except CapacityExhausted:
                # Another namespace growing right now holds budget its extents cannot
                # give back yet (reclaim skips a namespace while it grows): wait for
                # that growth, then plan again, rather than refuse for a moment's state.
                if not await self._budget.growths_elsewhere(ns):
                    raise
        return await self._reserve_rounds(session, keys, exists)

    async def _reserve_rounds(
        self,
        session: Session,
        keys: Sequence[bytes],
        exists: Callable[[bytes], bool] | None,
    ) -> ReserveResult:
        ns = session.ns
        for _round in range(MAX_GROW_ROUNDS):
            try:
                return self._reserve_now(session, keys, exists, may_grow=True)
            except _NeedExtent as need:
                if not await self._budget.grow(ns, need.slots):
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
        n = len(keys)
        bad, repeated = _native.keys_check(keys, MAX_KEY_BYTES)  # (one pass, no set)
        if repeated >= 0:
            raise InvalidArgument(f"duplicate key at index {repeated}")
        if bad >= 0:
            key = keys[bad]
            raise InvalidArgument(  # the slot table holds no more
                f"keys[{bad}] is {len(key)} bytes (1..{MAX_KEY_BYTES} allowed)"
                if isinstance(key, bytes) else f"keys[{bad}] is not bytes")
        found = ns.index.find(keys) if n else _NO_REFS
        flying = ns.in_flight.intersection(keys) if ns.in_flight else None
        if not flying and exists is None and not found.any():
            # Every key new (a writer's usual batch): no Python step per key to say so.
            statuses = [_RESERVED] * n
            new_keys = list(keys)
        else:
            present = found.tolist()
            statuses = [_EXISTS if p else _RESERVED for p in present]
            if flying:
                for i, key in enumerate(keys):
                    if key in flying and not present[i]:
                        statuses[i] = _IN_FLIGHT
            if exists is not None:
                for i, st in enumerate(statuses):
                    if st == _RESERVED and exists(keys[i]):
                        statuses[i] = _EXISTS
            todo = [i for i, st in enumerate(statuses) if st == _RESERVED]
            if not todo:
                return ReserveResult(0, statuses, _NO_REFS, _NO_REFS, ns.block_bytes,
                                     ns.segments_version)
            new_keys = list(keys) if len(todo) == n else [keys[i] for i in todo]
        refs, gens = self._room.claim_refs(ns, len(new_keys), may_grow=may_grow)
        rid = self._state.next_id()
        now = self._state.clock()
        res = Reservation(rid, session, new_keys, refs, gens, now + self._state.reservation_ttl,
                          started=now)
        ns.in_flight.open(rid, new_keys)
        session.reservations[rid] = res
        self._state.reservations[rid] = res
        return ReserveResult(rid, statuses, _slot_ref.segments_of(refs),
                             offsets(ns, refs), ns.block_bytes, ns.segments_version)

    def commit(
        self,
        session: Session,
        reservation_id: int,
        lengths: U64s,
        checksums: U64s | None,
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
        column = _u64_or_none(lengths)
        if column is None or not ((column > 0) & (column <= limit)).all():
            i, length = next((i, x) for i, x in enumerate(lengths) if not 0 < x <= limit)
            raise InvalidArgument(f"lengths[{i}] = {length} is outside 1..{limit} (block_bytes)")
        sums = None
        if checksums is not None:
            sums = _u64_or_none(checksums)  # the slot table's field is 64 bits
            if sums is None:
                i, checksum = next((i, x) for i, x in enumerate(checksums)
                                   if not 0 <= x < 1 << 64)
                raise InvalidArgument(f"checksums[{i}] = {checksum} is outside 0..2**64-1")
        self._end_reservation(res, commit=(column, sums), handles=False)
        return n

    def abort(self, session: Session, reservation_id: int) -> int:
        res = self._own_reservation(session, reservation_id)
        self._end_reservation(res, commit=None)
        return len(res.keys)

    def expire_reservation(self, res: Reservation, until: float) -> None:
        """End a reservation whose writer may still be copying: its slots stay
        RESERVED (quarantined) until ``until``, so they cannot be handed to
        another writer while the late one scribbles on them."""
        ns = res.session.ns
        ns.in_flight.close(res.id, res.keys)
        for ext, slot, _gen in res.places:
            ext.quarantine[slot] = until  # still RESERVED
        del res.session.reservations[res.id]
        del self._state.reservations[res.id]

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
        commit: tuple[npt.NDArray[np.uint64],
                      Sequence[int | None] | npt.NDArray[np.uint64] | None] | None,
        *,
        handles: bool = True,
    ) -> list[Block | None]:
        """Commit (or with None free) every slot; a length of 0 frees that one slot.
        All or nothing: the commit (the one call that can refuse its input) goes first."""
        ns = res.session.ns
        freed, commits = self._split_end(res, commit)
        made = iter(self._state.commit_slots(ns, commits, freed, handles=handles))
        # Applied: nothing below can fail.
        ns.in_flight.close(res.id, res.keys)
        del res.session.reservations[res.id]
        del self._state.reservations[res.id]
        if commit is None or not handles:
            return [None] * len(res.keys)
        return [next(made) if length else None for length in commit[0].tolist()]

    @staticmethod
    def _split_end(
        res: Reservation,
        commit: tuple[npt.NDArray[np.uint64],
                      Sequence[int | None] | npt.NDArray[np.uint64] | None] | None,
    ) -> tuple[npt.NDArray[np.uint64], Commits]:
        """Ending ``res``: the refs freed (all, or those of length 0) and the commits."""
        if commit is None:
            return res.refs, Commits(_NO_REFS, _NO_REFS, [], _NO_REFS, None)
        lengths, checksums = commit
        zero = lengths == 0
        if not zero.any():
            return _NO_REFS, Commits(res.refs, res.gens, res.keys, lengths, checksums)
        keep = np.flatnonzero(~zero)
        at = keep.tolist()
        sums = None if checksums is None else (
            checksums[keep] if isinstance(checksums, np.ndarray) else [checksums[i] for i in at])
        return res.refs[zero], Commits(res.refs[keep], res.gens[keep],
                                       [res.keys[i] for i in at], lengths[keep], sums)

    def acquire(self, session: Session, keys: Sequence[bytes]) -> AcquireResult:
        """Lease the longest present prefix of ``keys``."""
        if session.closed:
            raise Unauthenticated("session is closed")
        ns = session.ns
        refs = ns.index.find(keys) if keys else np.zeros(0, dtype=np.uint64)
        missing = np.flatnonzero(refs == 0)
        refs = refs[: int(missing[0]) if len(missing) else len(refs)]
        if len(np.unique(refs)) != len(refs):
            raise InvalidArgument("duplicate keys in one acquire")
        ns.hits += len(refs)
        ns.misses += len(keys) - len(refs)
        if not len(refs):
            return AcquireResult(0, _NO_REFS, _NO_REFS, _NO_REFS, _NO_REFS,
                                 np.zeros(0, dtype=np.uint8), ns.segments_version)
        # The pins, then the reads (CLOCK bits, persisted last access): a touch that
        # fails takes the pins back.  (The tiering layer counts the prefetched blocks a
        # call reads; the touch clears their mark.)
        self._state.pin(ns, refs)
        try:
            ns.table.touch(refs, self._state.access(len(refs)))
        except BaseException:
            ns.table.unpin(refs)
            raise
        # Applied: nothing below can fail.
        lid = self._state.next_id()
        now = self._state.clock()
        lease = Lease(lid, session, refs, now + self._state.lease_ttl, started=now)
        session.leases[lid] = lease
        self._state.leases[lid] = lease
        rows = ns.table.fields(refs)  # (pinned: they stay as read)
        return AcquireResult(lid, _slot_ref.segments_of(refs), offsets(ns, refs),
                             rows["length"], rows["checksum"], rows["has_checksum"],
                             ns.segments_version)

    def release(self, session: Session, lease_id: int) -> None:
        if lease_id == 0:
            raise InvalidArgument("lease_id is required (0 is not a lease)")
        lease = session.leases.get(lease_id)
        if lease is None:
            raise NotFound(
                f"lease {lease_id} is not held by this session (already released, or expired)"
            )
        self._state.end_leases([lease])

    def delete(self, session: Session, keys: Sequence[bytes]) -> list[bytes]:
        """Remove present keys; a leased block is hidden now and freed at its last release.
        Returns the keys that were present (each once)."""
        ns = session.ns
        keys = list(dict.fromkeys(keys))
        refs = ns.index.find(keys) if keys else _NO_REFS
        hit = [i for i, ref in enumerate(refs.tolist()) if ref]  # (often 1 key: lists)
        if not hit:
            return []
        if len(hit) == len(keys):
            present = keys
        else:
            refs, present = refs[hit], [keys[i] for i in hit]
        ns.table.delete(refs)  # all or nothing
        ns.index.remove(present)
        return present

    def drop_lost(self, segment: Segment, intact_bytes: int) -> list[Block]:
        """Forget the DRAM blocks of ``segment`` whose slots end past ``intact_bytes``.

        A client cut the data file short: those slots' bytes are gone (they read
        as zeros once the daemon restored the size).  Each block leaves the index
        as by a delete (a leased one is hidden now and freed at its last release);
        copies in lower tiers stay, they hold the real bytes.  Returns the blocks.
        """
        ns = self._state.namespaces.get(segment.namespace)
        ext = None if ns is None else next(
            (e for e in ns.extents if e.segment is segment), None)
        if ns is None or ext is None:
            return []
        slot_bytes = segment.layout.slot_bytes
        lost = [b for b in blocks_of(ns, ext)
                if (b.slot + 1) * slot_bytes > intact_bytes]
        self._delete_blocks(lost)
        return lost

    def _delete_blocks(self, blocks: Sequence[Block]) -> None:
        """Take visible blocks out of the index: a leased one is doomed (its slot is freed
        at its last release), an unleased one is freed now."""
        by_ns: dict[int, tuple[Namespace, list[Block]]] = {}
        for b in blocks:
            by_ns.setdefault(id(b.ns), (b.ns, []))[1].append(b)
        for ns, group in by_ns.values():
            ns.table.delete(_refs((b.extent, b.slot) for b in group))  # all or nothing
            ns.index.remove([b.key for b in group])

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
        lengths = np.array([o[0] if o is not None else 0 for o in outcomes], dtype=np.uint64)
        sums: list[int | None] = [o[1] if o is not None else None for o in outcomes]
        return self._end_reservation(res, commit=(lengths, sums))

    def pin_blocks(self, blocks: BlockBatch) -> Lease:
        """Lease a batch to the tiering layer (one lease, no TTL; all or none pinned)."""
        ns = blocks.ns
        self._state.pin(ns, blocks.refs)
        session = self._state.system_session(ns)
        lease = Lease(self._state.next_id(), session, blocks.refs, float("inf"))
        session.leases[lease.id] = lease
        self._state.leases[lease.id] = lease
        return lease

    def unpin(self, lease: Lease) -> None:
        """End a lease of ``pin_blocks`` (a doomed block is freed here)."""
        if lease.id in self._state.leases:
            self._state.end_leases([lease])

    def set_lower(self, block: Block, lower: Lower) -> None:
        """Record what the spill tiers hold of a live block (none that left DRAM, or
        whose slot holds another block now): one block at a time (cold paths)."""
        self.set_lower_many(BlockBatch.of_blocks(block.ns, [block]), lower)

    def set_lower_many(self, blocks: BlockBatch, lower: Lower) -> int:
        """``set_lower`` of each block of a batch, in one table call: the blocks whose
        extent left, or whose slot holds another generation now, are left alone.
        Returns how many changed."""
        if not len(blocks):
            return 0
        refs, gens = blocks.refs, blocks.gens
        held = blocks.held()
        if held is not None:
            refs, gens = refs[held], gens[held]
            if not len(refs):
                return 0
        return blocks.ns.table.set_lower(refs, lower, gens)

    def demotion_candidates(self, target_bytes: int, limit: int) -> list[BlockBatch]:
        """Up to ``limit`` DIRTY unleased blocks that eviction would take first (CLOCK's
        order), from each namespace in proportion to its DRAM, ``target_bytes`` in all:
        a batch per namespace that has some."""
        spaces = [(ns, ns.committed * ns.slot_bytes) for ns in self._state.namespaces.values()]
        total = sum(b for _, b in spaces)
        out: list[BlockBatch] = []
        if not total:
            return out
        taken = 0
        for ns, held in sorted(spaces, key=lambda t: -t[1]):
            left = limit - taken
            if left <= 0:
                break
            share = -(-min(target_bytes, total) * held // total)  # ceil
            n = min(left, -(-share // ns.slot_bytes))
            if n > 0:
                batch = ns.batch_at(ns.table.dirty(n, Policy.CLOCK))  # (one table read)
                if len(batch):
                    out.append(batch)
                    taken += len(batch)
        return out
