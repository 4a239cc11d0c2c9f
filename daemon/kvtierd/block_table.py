"""A namespace's DRAM blocks in native records: ``kvtier._native.BlockTable`` (csrc/blocks.c).

No Python object per block.  A block's durable fields stay where they are, in
its extent's persisted slot table (``segments``: state, key, length, checksum,
generation, epoch, last access; laid out in ``csrc/layout.h``); the table keeps
only what is volatile, 12 bytes a slot: a copy of the state, the pin count, the
lower-tier state (DIRTY / CLEAN / UNSPILLABLE), the prefetched and CLOCK bits
and the free-list link.  It writes the slot-table entries itself, in
segments.py's crash-safe order and byte for byte its format.

Blocks are named by slot refs (``kvtier._slot_ref``: the segment id and the
slot in one u64), passed in and out as numpy ``uint64`` arrays: one call per
batch, never an object per block.  Every call validates its whole batch first
and changes nothing when one item is invalid (``ValueError`` naming the index);
large batches apply with the GIL released.

Operations (each one native call):

* extents: ``add_segment`` / ``add_extent`` (fresh, all FREE),
  ``remove_extent``, ``adopt`` (a previous run's table, every slot validated
  first), ``committed`` (an extent's block refs);
* keys: ``match_keys`` (refs against keys, from the slot entries: the check
  of a shared-index hit whose entry holds the key's hash);
* write path: ``claim(n, skip)`` (FREE -> RESERVED, all or nothing; says how
  many slots are short), ``release_claims`` (RESERVED -> FREE), ``commit``
  (RESERVED -> COMMITTED with key, length, checksum);
* read path: ``pin`` / ``unpin`` (pin counts; unpin frees the DOOMED blocks
  whose last pin ended and returns them), ``touch`` (persisted last access
  and CLOCK bit), ``set_prefetched``;
* leaving DRAM: ``delete`` (free, or DOOMED while pinned), ``victims`` (the
  policy's choice of evictable blocks: sampled LRU or CLOCK, bounded work),
  ``evict`` (free them, or take them into RESERVED), ``dirty`` (demotion
  candidates), ``set_lower`` (what the spill tiers hold);
* reading: ``counts`` (per extent or table, O(1); with the extent's newest
  access, what reclaim across namespaces compares), ``inspect``, ``check``
  (records against slot tables), ``native_bytes``.

The store (``kvtierd.store``) keeps one table per namespace (``Namespace.table``),
with the shared index as its key index, whose ``ref`` field holds the block's ref:
claims, eviction and reclaim in ``store.allocator``, commits and pins in
``store.state``, deletes and demotion candidates in ``store.operations``, warm starts
in ``store.adoption``, ``check_rows`` and ``check`` in ``store.check``.

Eviction is not exact LRU, which needs an ordered structure per block: the
per-block state stays a fixed-size record.
``Policy.LRU`` is Redis' sampled approximation on the persisted last access
(``sample`` random evictable slots per victim, the oldest goes, with a pool of
16 candidates kept across calls); ``Policy.CLOCK`` sets a bit at every access
and sweeps a hand.  ``bench/eviction_policy.py`` measures both against exact
LRU; docs/decisions.md says which the store uses.
"""

from __future__ import annotations

import dataclasses
import enum
import mmap
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from kvtier import _slot_ref
from kvtierd.segments import SLOT_ENTRY_BYTES, TABLE_OFFSET, Segment

try:
    from kvtier import _native
except ImportError:  # not built: no table (and no daemon: the store runs on it)
    _native = None  # type: ignore[assignment]

#: Whether this build has the native block table.
AVAILABLE: Final = _native is not None
#: Records one ``victims`` call examines at the least (csrc/blocks.c ``KVT_SCAN_BASE``):
#: CLOCK walks at most two revolutions, so in a table of no more than half as many
#: slots a short answer is final (nothing else is eligible).
SCAN_BASE: Final[int] = _native.BLOCK_TABLE["scan_base"] if _native is not None else 0

Refs: TypeAlias = npt.NDArray[np.uint64]
_RefsIn: TypeAlias = "npt.ArrayLike"

#: ``inspect``'s rows: the native record and the persisted generation of a slot.
RECORD_DTYPE: Final = np.dtype([("state", "u1"), ("lower", "u1"), ("flags", "u1"),
                                ("pad", "u1"), ("pins", "<u4"), ("generation", "<u8")])
#: ``entries``' rows: a slot entry's persisted fields (its key comes apart).
ENTRY_DTYPE: Final = np.dtype([("length", "<u8"), ("checksum", "<u8"), ("generation", "<u8"),
                               ("last_access", "<u8"), ("state", "u1"), ("has_checksum", "u1"),
                               ("pad", "V6")])
#: ``RECORD_DTYPE``'s flags.
PREFETCHED: Final = 1
REFERENCED: Final = 2  # CLOCK's bit


class Policy(enum.IntEnum):
    """How ``victims`` chooses (csrc/blocks.h ``KVT_POLICY_*``)."""

    LRU = 0  # sampled LRU on the persisted last access
    CLOCK = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Counts:
    """Slots by category (``counts``): committed includes DOOMED; evictable is
    COMMITTED and unpinned; clean is evictable and not DIRTY."""

    slots: int
    free: int
    reserved: int
    committed: int
    pinned: int
    dirty: int
    doomed: int
    evictable: int
    clean: int
    #: The largest last access the blocks were given (commit, touch, adopt); never
    #: decreases while the extent is in the table.  Reclaim across namespaces takes
    #: the extent whose newest access is oldest (its every block is at least as old).
    newest_access: int


@dataclasses.dataclass(frozen=True, slots=True)
class Adoption:
    """What ``adopt`` found in a previous run's slot table."""

    adopted: int
    reserved: int
    free: int
    max_last_access: int
    #: Dropped COMMITTED slots (and invalid state bytes), by ``recovery``'s reasons.
    dropped: dict[str, int]


class RingCommit(NamedTuple):
    """What ``BlockTable.commit_ring`` committed: ``n`` records, their slots' ``refs``
    and grant ``entries`` (in ring order), their ``nbytes``; of the publishing, the
    refs before ``done`` went in the index but those at ``left``; the ``keys`` when
    asked for; whether it ``answered`` the writer already."""

    n: int
    refs: Refs
    entries: bytes  # u64 each
    nbytes: int
    done: int
    left: list[int]
    keys: list[bytes] | None
    #: the answers and DONE were written, the writer woken (``answer_min``)
    answered: bool = False


#: Below this many refs, the distinct extent ids come from a set of Python ints:
#: ``np.unique``'s fixed cost (~20 us) is more than the ints cost then.
_UNIQUE_MIN = 512


def _extents(refs: Refs) -> tuple[list[int], npt.NDArray[np.uint64] | None]:
    """The extent ids among ``refs`` in increasing order, and each ref's extent id (None
    when they are all of one extent, or none)."""
    if not len(refs):
        return [], None
    first = _slot_ref.segment_of(int(refs[0]))
    if len(refs) == 1:
        return [first], None
    ids = _slot_ref.segments_of(refs)
    if bool((ids == first).all()):
        return [first], None
    if len(ids) < _UNIQUE_MIN:
        return sorted(set(ids.tolist())), ids
    return np.unique(ids).tolist(), ids


def extent_ids(refs: Refs) -> list[int]:
    """The extent ids among ``refs``, in increasing order."""
    return _extents(refs)[0]


def by_extent(refs: Refs) -> list[tuple[int, npt.NDArray[np.bool_] | None]]:
    """Each extent id among ``refs`` with the mask of its refs -- None when every ref
    is of that one extent (the usual batch: no pass over the refs per extent)."""
    found, ids = _extents(refs)
    if ids is None:
        return [(ext_id, None) for ext_id in found]
    return [(ext_id, ids == ext_id) for ext_id in found]


def _u64(values: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    out = np.ascontiguousarray(values, dtype=np.uint64)
    return out.reshape(-1)


def _refs(raw: bytes) -> Refs:
    return np.frombuffer(raw, dtype=np.uint64)


class BlockTable:
    """One namespace's blocks (see the module docstring for the operations).

    Raises ``RuntimeError`` when the native module is not built.
    """

    __slots__ = ("_t",)

    def __init__(self, block_bytes: int, slot_bytes: int, *, seed: int = 0) -> None:
        if _native is None:
            raise RuntimeError("kvtier._native is not built: no native block table")
        self._t = _native.BlockTable(block_bytes, slot_bytes, seed)

    @property
    def n_slots(self) -> int:
        """Slots of all its extents (``counts().slots``, without building the counts)."""
        return int(self._t.n_slots)

    @property
    def n_free(self) -> int:
        """FREE slots of all its extents (``counts().free``, without building the counts)."""
        return int(self._t.n_free)

    @property
    def native_bytes(self) -> int:
        """Native memory the table holds (records, extents, the object)."""
        return self._t.native_bytes

    # ------------------------------------------------------------ extents
    def add_segment(self, seg: Segment) -> None:
        """``add_extent`` of a segment, named by its ``segment_id``, over its slot table."""
        n = seg.layout.n_slots
        # The table holds an export of this view (and so of the mapping) until
        # remove_extent: the segment cannot unmap it while the table may write.
        view = memoryview(seg.meta)[TABLE_OFFSET : TABLE_OFFSET + n * SLOT_ENTRY_BYTES]
        self._t.add_extent(seg.segment_id, n, view, seg.created_unix_ns)

    def add_extent(self, extent_id: int, n_slots: int, meta: object, created_unix_ns: int) -> None:
        """Add a fresh extent: every slot FREE.  ``meta``: a writable buffer of its slot
        table (``n_slots`` entries of ``SLOT_ENTRY_BYTES``).  ValueError for an id taken."""
        self._t.add_extent(extent_id, n_slots, meta, created_unix_ns)

    def remove_extent(self, extent_id: int, *, force: bool = False) -> tuple[int, int]:
        """Drop an extent, (committed, reserved) slots it held; ValueError while one of
        its slots is pinned (unless ``force``).  Call before closing its segment."""
        return self._t.remove_extent(extent_id, force)

    def adopt(self, seg: Segment, boot_epoch: int, *, referenced_from: int = 2**64 - 1
              ) -> Adoption:
        """Validate a previous run's slot table of an extent just added (``add_segment``)
        (tests/unit/slot_oracle.py states the rules): valid COMMITTED entries become unpinned DIRTY blocks,
        RESERVED ones stay reserved (quarantine: ``release_claims`` them later), the rest
        are freed in the table too.  Blocks last accessed at ``referenced_from`` or later
        get their CLOCK bit (pass the median last access of every extent, from
        ``recovery``'s first pass: the hand then evicts the older half first)."""
        got = self._t.adopt(seg.segment_id, boot_epoch, seg.intact_bytes, referenced_from)
        return Adoption(adopted=got["adopted"], reserved=got["reserved"], free=got["free"],
                        max_last_access=got["max_last_access"], dropped=dict(got["dropped"]))

    def rescale_access(self, shift: int) -> int:
        """Shift every block's persisted last access right by ``shift`` bits (order kept,
        ties may appear): recovery's way back from a sequence in the upper half of its
        2**48 range.  Returns how many blocks were rescaled."""
        return self._t.rescale_access(shift)

    def committed(self, extent_id: int) -> Refs:
        """The refs of an extent's COMMITTED slots, ascending."""
        return _refs(self._t.committed(extent_id))

    def find_keys(self, index: mmap.mmap, keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
        """Each key's ref in the shared index ``index`` (a ``SharedIndex.buffer``) whose slot
        entry holds it (a hit on a key held as its hash checked as ``match_keys`` does),
        else 0: a lookup and its check in one native call (writable)."""
        return np.frombuffer(self._t.find_keys(index, keys), dtype=np.uint64)

    def match_keys(self, refs: npt.ArrayLike, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        """Whether each ref holds a COMMITTED block whose persisted key is ``keys[i]``: the
        check of a shared-index hit whose entry holds the key's hash, not the key."""
        return np.frombuffer(self._t.match_keys(_u64(refs), keys), dtype=np.bool_)

    def extents(self) -> list[int]:
        return self._t.extents()

    # ------------------------------------------------------------ write path
    def claim(self, n: int, skip: npt.ArrayLike | None = None, *,
              evict: npt.ArrayLike | None = None) -> tuple[Refs, int]:
        """Take ``n`` free slots into RESERVED (generation + 1), all or nothing:
        (refs, 0), or (empty, how many more slots are needed) with nothing changed.
        ``skip``: refs or hazard words of free slots clients still read.  ``evict``:
        COMMITTED unpinned blocks evicted into RESERVED in the same call (not in the
        refs returned)."""
        raw, short = self._t.claim(n, None if skip is None else _u64(skip),
                                   None if evict is None else _u64(evict))
        return _refs(raw), short

    def release_claims(self, refs: npt.ArrayLike, *, unpin: npt.ArrayLike | None = None
                       ) -> Refs:
        """Free RESERVED slots (abort, length 0, quarantine over, grant taken back) and,
        with ``unpin``, end those pins in the same call (all or nothing); returns the
        DOOMED blocks the unpins freed."""
        return _refs(self._t.release_claims(_u64(refs),
                                            None if unpin is None else _u64(unpin)))

    def commit(self, refs: npt.ArrayLike, keys: Sequence[bytes], lengths: npt.ArrayLike,
               checksums: Sequence[int | None] | npt.ArrayLike | None, *, first_access: int,
               epoch: int, release: npt.ArrayLike | None = None,
               index: mmap.mmap | None = None) -> tuple[int, list[int]] | None:
        """Make RESERVED slots COMMITTED with their keys, lengths and checksums (None: no
        checksum; per block or for all), last access ``first_access + i``; with
        ``release``, those RESERVED slots are freed in the same call.  ValueError
        (nothing written) for a slot not RESERVED, a key or length out of range, columns
        of different lengths, a slot named twice, an ``index`` that holds no index.
        With ``index`` (a shared index's buffer, ``SharedIndex.room_for``), the keys
        are published there in the same call: returns (done, left), the refs before
        ``done`` published but those at ``left`` (held already or past the probe
        limit), the rest left to the caller (the index filled); else None."""
        sums: npt.NDArray[np.uint64] | None = None
        has: npt.NDArray[np.uint8] | None = None
        if checksums is not None:
            items = list(checksums) if isinstance(checksums, Sequence) else None
            if items is not None and any(c is None for c in items):
                has = np.array([c is not None for c in items], dtype=np.uint8)
                sums = np.array([0 if c is None else c for c in items], dtype=np.uint64)
            else:
                sums = _u64(items if items is not None else checksums)  # type: ignore[arg-type]
        return self._t.commit(_u64(refs), keys, _u64(lengths), sums, has, first_access,
                              epoch, None if release is None else _u64(release), index)

    def commit_ring(self, page: mmap.mmap, tail: int, max_length: int,
                    held: npt.NDArray[np.uint64], index: mmap.mmap, *, first_access: int,
                    epoch: int, exists: Callable[[list[bytes]], Sequence[bool]] | None,
                    want_keys: bool, answer_min: int = -1) -> RingCommit | None:
        """A session's commit ring from ``tail`` in one call, when it is the plain case
        (every record names a grant ``held`` holds, no grant or key twice, every key
        new to ``index`` and, asked, to ``exists``): the slots committed as
        ``commit`` makes them, their keys published in ``index`` and their grants ended
        in ``held`` and the page.  None, changing nothing, for any other ring (the
        caller takes it record by record: ``SessionPage.take_commits``).  With
        ``answer_min`` >= 0 it also answers the writer (COMMITTED each, DONE, a wake)
        when ``held`` keeps that many grants after the ring's ended."""
        got = self._t.commit_ring(page, tail, max_length, held, index, first_access, epoch,
                                  exists, want_keys, answer_min)
        if got is None:
            return None
        n, refs, entries, nbytes, done, n_left, left, keys, answered = got
        return RingCommit(n, np.frombuffer(refs, dtype=np.uint64), entries, nbytes, done,
                          np.frombuffer(left, dtype=np.uint64, count=n_left).tolist()
                          if n_left else [], keys, answered)

    def unpublish(self, refs: npt.ArrayLike, index: mmap.mmap) -> bytes:
        """Take the blocks at ``refs`` out of the shared index whose buffer is ``index``,
        by the keys their slot entries hold (an entry is removed only where it names
        that block): 1 per ref removed."""
        return self._t.unpublish(_u64(refs), index)

    # ------------------------------------------------------------ read path
    def pin(self, refs: npt.ArrayLike) -> None:
        """Pin COMMITTED blocks (+1 per ref)."""
        self._t.pin(_u64(refs))

    def unpin(self, refs: npt.ArrayLike) -> Refs:
        """End pins; returns the DOOMED blocks this freed (their last pin ended)."""
        return _refs(self._t.unpin(_u64(refs)))

    def touch(self, refs: npt.ArrayLike, first_access: int, *, hints: bool = False
              ) -> tuple[int, int]:
        """Record reads: (touched, were prefetched).  ``hints``: refs from clients' pages,
        those naming no slot are skipped instead of raising."""
        return self._t.touch(_u64(refs), first_access, hints)

    def set_prefetched(self, refs: npt.ArrayLike) -> int:
        return self._t.set_prefetched(_u64(refs))

    # ------------------------------------------------------------ leaving DRAM
    def delete(self, refs: npt.ArrayLike) -> int:
        """Free unpinned blocks, doom pinned ones (freed by their last ``unpin``); returns
        how many were doomed."""
        return self._t.delete(_u64(refs))

    def clock_scans_all(self) -> bool:
        """Whether one CLOCK ``victims`` call sees every slot (two revolutions fit its
        least budget): its short answer is then final, not worth asking again."""
        return 2 * self.n_slots <= SCAN_BASE

    def victims(self, n: int, policy: Policy = Policy.LRU, *, sample: int = 5,
                pool: bool = True, spill: bool = False,
                skip: npt.ArrayLike | None = None) -> Refs:
        """Up to ``n`` distinct evictable blocks chosen by ``policy`` (bounded work: fewer
        when fewer are eligible, or call again).  Changes nothing but the policy's state."""
        return _refs(self._t.victims(n, int(policy), sample, pool, spill,
                                     None if skip is None else _u64(skip)))

    def evict(self, refs: npt.ArrayLike, *, reserve: bool = False) -> None:
        """Evict unpinned COMMITTED blocks: freed, or with ``reserve`` RESERVED for the
        claim that needed the room."""
        self._t.evict(_u64(refs), reserve)

    def dirty(self, n: int, policy: Policy = Policy.LRU, *, sample: int = 5,
              skip: npt.ArrayLike | None = None) -> Refs:
        """Demotion candidates: up to ``n`` unpinned DIRTY blocks the policy takes first."""
        return _refs(self._t.dirty(n, int(policy), sample, False, False,
                                   None if skip is None else _u64(skip)))

    def set_lower(self, refs: npt.ArrayLike, lower: int,
                  generations: npt.ArrayLike | None = None) -> int:
        """Set the lower-tier state of COMMITTED blocks (with ``generations``, only where
        the slot still holds that generation); returns how many changed."""
        return self._t.set_lower(_u64(refs), lower,
                                 None if generations is None else _u64(generations))

    # ------------------------------------------------------------ reading
    def counts(self, extent_id: int | None = None) -> Counts:
        return Counts(**self._t.counts(extent_id))

    def inspect(self, refs: npt.ArrayLike) -> npt.NDArray[np.void]:
        """Each ref's record (``RECORD_DTYPE``)."""
        return np.frombuffer(self._t.inspect(_u64(refs)), dtype=RECORD_DTYPE)

    def entries(self, refs: npt.ArrayLike) -> tuple[list[bytes], npt.NDArray[np.void]]:
        """Each ref's persisted key and entry fields (``ENTRY_DTYPE``), in one call."""
        keys, rows = self._t.entries(_u64(refs))
        assert keys is not None
        return keys, np.frombuffer(rows, dtype=ENTRY_DTYPE)

    def fields(self, refs: npt.ArrayLike) -> npt.NDArray[np.void]:
        """``entries`` without the keys (no bytes object per block)."""
        return np.frombuffer(self._t.entries(_u64(refs), keys=False)[1], dtype=ENTRY_DTYPE)

    def check(self) -> list[str]:
        """Records against slot tables, free lists and counters: the problems found."""
        return self._t.check()

    def check_rows(self, extent_id: int) -> bytes:
        """What ``Store.check`` reads of an extent, 24 bytes a slot
        (``store.check.CHECK_ROW_DTYPE``): each committed key's shared-index fingerprint
        (else the persisted generation), the persisted state byte and key length, and
        the record's pins; one consistent copy, made natively."""
        return self._t.check_rows(extent_id)
