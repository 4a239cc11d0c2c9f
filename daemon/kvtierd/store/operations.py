"""The client operations with a call: sessions, lookup, reserve/commit/abort, acquire/
release, delete, evict; and the tiering layer's hooks (system pins, settle, demotion)."""


from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence

from kvtier.errors import (
    CapacityExhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unauthenticated,
)
from kvtierd.logs import event
from kvtierd.segments import (
    MAX_KEY_BYTES,
    Segment,
    SegmentLayout,
)
from kvtierd.store.base import _NeedExtent, _Raced, _recommit, _Undo
from kvtierd.store.room import Room
from kvtierd.store.types import (
    EVICTION_SCAN_LIMIT,
    MAX_GROW_ROUNDS,
    AcquireResult,
    Block,
    Extent,
    Lease,
    Lower,
    Peer,
    Reservation,
    ReserveResult,
    ReserveStatus,
    Session,
    SlotCommit,
    SlotGrant,
)

log = logging.getLogger(__name__)


class Operations(Room):
    """The operations clients and the tiering layer call."""

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

    def lookup(self, session: Session, keys: Sequence[bytes]) -> int:
        """Number of leading keys present (committed, not deleted); no side effects."""
        index = session.ns.index
        hits = 0
        for key in keys:
            if key not in index:
                break
            hits += 1
        return hits

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
        freed, commits = self._split_end(res, commit)
        for ext, slot, gen in freed:
            seg = ext.segment
            undo.add(seg.mark_reserved, slot, gen)
            seg.mark_free(slot)
        self._persist_commits(commits, undo)

    def _apply_end_reservation(
        self,
        res: Reservation,
        commit: tuple[Sequence[int], Sequence[int | None] | None] | None,
    ) -> list[Block | None]:
        """The in-memory part of ending ``res`` (its slot-table writes are done): the
        block made for each key, None for a slot freed."""
        ns = res.session.ns
        freed, commits = self._split_end(res, commit)
        for key in res.keys:
            del ns.in_flight[key]
        for ext, slot, _gen in freed:
            ext.reserved -= 1
            ext.free.append(slot)
        ns.reserved -= len(freed)
        made = iter(self._apply_commits(ns, commits))
        del res.session.reservations[res.id]
        del self._reservations[res.id]
        if commit is None:
            return [None] * len(res.keys)
        return [next(made) if length else None for length in commit[0]]

    @staticmethod
    def _split_end(
        res: Reservation,
        commit: tuple[Sequence[int], Sequence[int | None] | None] | None,
    ) -> tuple[list[tuple[Extent, int, int]], list[SlotCommit]]:
        """Ending ``res``: the places freed (all, or those of length 0) and the commits."""
        if commit is None:
            return list(res.places), []
        lengths, checksums = commit
        freed: list[tuple[Extent, int, int]] = []
        commits: list[SlotCommit] = []
        for i, (key, place) in enumerate(zip(res.keys, res.places, strict=True)):
            if lengths[i] == 0:
                freed.append(place)
            else:
                commits.append(SlotCommit(*place, key, lengths[i],
                                          checksums[i] if checksums is not None else None))
        return freed, commits

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

    def set_lower(self, block: Block, lower: Lower) -> None:
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
