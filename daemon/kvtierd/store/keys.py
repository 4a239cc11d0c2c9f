"""A namespace's key index: the shared index its clients search *is* the index (one
table, not a Python dict beside it: memory per block stays at the native record).

No Python object per key: the table (``kvtierd.shared_index``, native) maps each
visible key to where its block is (segment id, slot, offset, length, checksum),
and a block's ref is ``segment_id << 32 | slot``.  The table holds 16-byte keys
exactly and other keys as a 128-bit hash; a hit on a hashed key is checked
against the key in the slot entry (``BlockTable.match_keys``), so a key that
collides with another (a hostile client could search for one) is simply absent:
it cannot be stored while the other is, and never reads the other's bytes.

Whether clients receive the table (``published``) is the store's choice; the
index exists either way.  A table that cannot be made or grown (out of memory or
fds) leaves the keys in the shared index's ``unpublished`` dict: slower, still
exact, and clients then ask the daemon.

Only the store changes it, on the event loop: ``add`` at commit and adoption,
``remove`` at delete and eviction, ``hide_refs``/``unhide_refs`` around an eviction
plan (``store.allocator``).
``watch`` hears every key that comes or goes (KV events).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvtier import _slot_ref
from kvtierd.block_table import by_extent
from kvtierd.segments import KEY_OFFSET, MAX_KEY_BYTES, SLOT_DTYPE, SLOT_ENTRY_BYTES, TABLE_OFFSET
from kvtierd.shared_index import Location, SharedIndex

if TYPE_CHECKING:
    from kvtierd.store.types import Block, Namespace


_SLOT_MASK = np.uint64(_slot_ref.SLOT_MASK)
#: Up to this many keys, ``Keys.find`` looks up and checks in one native call.
_SMALL = 8


def _hashed(keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
    """Keys the table holds as a hash (not 16 bytes long): hits need the slot's check."""
    sizes = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    return np.not_equal(sizes, 16)


class Keys:
    """The key index of one namespace (see the module docstring)."""

    __slots__ = ("_ns", "table", "published", "watch")

    def __init__(self, ns: Namespace) -> None:
        self._ns = ns
        #: The table; None only when it could not be made (then every key is in
        #: ``unpublished`` of a stand-in).
        self.table = SharedIndex(ns.name, lower_tiers=False)
        #: Clients get the table's fd (the store publishes it).
        self.published = False
        #: Hears the keys that come in (True) and go (False): the KV events.
        self.watch: Callable[[list[bytes], bool], None] | None = None

    # ------------------------------------------------------------ reading
    @property
    def shared(self) -> SharedIndex | None:
        """The table clients search, when published."""
        return self.table if self.published and self.table.fd is not None else None

    def find(self, keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
        """Each key's block ref, 0 when absent (hashed hits checked against the slot)."""
        if len(keys) <= _SMALL and not self.table.unpublished \
                and (buf := self.table.buffer) is not None:
            # (a 1-key delete or commit: the lookup and its check in one native call)
            return self._ns.table.find_keys(buf, keys)
        refs = self.table.find_many(keys)
        if not refs.any():  # (a commit's new keys: nothing to check; cheaper than nonzero)
            return refs
        hits = np.flatnonzero(refs)
        at = hits[_hashed([keys[i] for i in hits.tolist()])]
        if len(at):
            ok = self._ns.table.match_keys(refs[at], [keys[i] for i in at.tolist()])
            refs[at[~ok]] = 0
        return refs

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are present."""
        refs = self.find(keys)
        missing = np.flatnonzero(refs == 0)
        return int(missing[0]) if len(missing) else len(refs)

    def get(self, key: bytes) -> Block | None:
        """The handle of ``key``'s block, or None."""
        ref = int(self.find([key])[0])
        return self._ns.block_at(ref) if ref else None

    def __getitem__(self, key: bytes) -> Block:
        block = self.get(key)
        if block is None:
            raise KeyError(key)
        return block

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and bool(self.find([key])[0])

    def __len__(self) -> int:
        counts = self._ns.table.counts()
        return counts.committed - counts.doomed

    def __iter__(self) -> Iterator[bytes]:
        for key, _ref in self._pairs():
            yield key

    def keys(self) -> list[bytes]:
        return [k for k, _ in self._pairs()]

    def values(self) -> list[Block]:
        """Every visible block's handle (O(blocks): admin, check and tests only)."""
        return [b for _, ref in self._pairs() if (b := self._ns.block_at(ref)) is not None]

    def items(self) -> list[tuple[bytes, Block]]:
        return [(b.key, b) for b in self.values()]

    def _pairs(self) -> Iterator[tuple[bytes, int]]:
        """(key, ref) of every COMMITTED slot, read from the slot tables."""
        for ext in list(self._ns.extents):
            refs = self._ns.table.committed(ext.id)
            if not len(refs):
                continue
            slots = _slot_ref.slots_of(refs).astype(np.int64)
            rows = np.frombuffer(ext.segment.meta, dtype=SLOT_DTYPE, count=ext.n_slots,
                                 offset=TABLE_OFFSET)[slots]
            for ref, row in zip(refs.tolist(), rows, strict=True):
                klen = min(int(row["key_len"]), MAX_KEY_BYTES)
                yield bytes(row.tobytes()[KEY_OFFSET:KEY_OFFSET + klen]), ref

    @property
    def wants_keys(self) -> bool:
        """Removing keys needs them as Python objects: the KV events hear them, or the
        table left some out (``unpublished``)."""
        return self.watch is not None or bool(self.table.unpublished)

    # ------------------------------------------------------------ changing
    def add(self, keys: Sequence[bytes], locs: Sequence[Location]) -> None:
        """Make ``keys`` visible at ``locs`` (new keys: the store checked)."""
        if not keys:
            return
        if len(keys) == 1:
            self.table.add(keys[0], locs[0])
        else:
            self.table.add_many(zip(keys, locs, strict=True))
        if self.watch is not None:
            self.watch(list(keys), True)

    def add_committed(self, refs: npt.NDArray[np.uint64], keys: Sequence[bytes]) -> None:
        """Make the blocks just committed at ``refs`` visible (new keys: the store
        checked), their locations read from their slot entries natively (one call per
        extent, no Python object per block); ``keys`` are theirs, for the events."""
        ns = self._ns
        for ext_id, mine in by_extent(refs):
            ext = ns.by_id[ext_id]
            slots = (refs if mine is None else refs[mine]) & _SLOT_MASK
            seg = ext.segment
            view = memoryview(seg.meta)[TABLE_OFFSET : TABLE_OFFSET
                                        + ext.n_slots * SLOT_ENTRY_BYTES]
            try:
                left = self.table.add_slots(view, slots, ext_id, seg.layout.slot_bytes)
            finally:
                view.release()
            for i in left:  # past the probe limit: kept apart (present ones: a bug)
                self._add_apart(int(refs[i] if mine is None else refs[mine][i]))
        if keys and self.watch is not None:
            self.watch(list(keys), True)

    def committed_published(self, refs: npt.NDArray[np.uint64], keys: Sequence[bytes],
                            done: int, left: list[int]) -> None:
        """``add_committed`` after ``BlockTable.commit`` published ``refs[:done]`` in the
        table itself but for those at ``left``: those, and the rest (the table filled
        up: ``add_committed`` grows it), go in here."""
        for i in left:
            self._add_apart(int(refs[i]))
        if done < len(refs):
            self.add_committed(refs[done:], ())
        if keys and self.watch is not None:
            self.watch(list(keys), True)

    def _add_apart(self, ref: int) -> None:
        """The block just committed at ``ref``, by its slot entry, through ``add`` (a key
        past the probe limit is kept apart)."""
        ext_id, slot = _slot_ref.segment_of(ref), _slot_ref.slot_of(ref)
        seg = self._ns.by_id[ext_id].segment
        rec = seg.read_slot(slot)
        self.table.add(rec.key, (ext_id, slot, seg.slot_offset(slot), rec.length,
                                 rec.checksum))

    def remove(self, keys: Sequence[bytes], *, hidden: bool = False) -> None:
        """Take ``keys`` out (they were present; ``hidden``: ``hide`` took them out of
        the table already, so only the keys kept apart are looked at)."""
        if keys:
            self.table.discard_many(keys, hidden=hidden)
        if keys and self.watch is not None:
            self.watch(list(keys), False)

    def hide_refs(self, refs: npt.NDArray[np.uint64]) -> None:
        """Take the blocks at ``refs`` out of the table for now, by the keys their slot
        entries hold (no Python object per key), not an event: ``unhide_refs`` or
        ``remove`` follows (an eviction's victims, a reclaimed extent's blocks)."""
        buf = self.table.buffer
        if buf is not None and len(refs):
            self._ns.table.unpublish(refs, buf)

    def unhide_refs(self, refs: npt.NDArray[np.uint64]) -> None:
        """Put back the blocks at ``refs`` that ``hide_refs`` took out (still COMMITTED:
        nothing changed them since), read from their slot entries."""
        self.add_committed(refs, ())


def locate(block: Block) -> Location:
    """Where the index says ``block`` is (what a client leases without a call)."""
    seg = block.extent.segment
    return (seg.segment_id, block.slot, seg.slot_offset(block.slot), block.length,
            block.checksum)
