"""One small Protocol for every tier below DRAM, and the SSD and shared tiers behind it.

``kvtierd.tiering`` holds the tiers below DRAM as an ordered list (fastest
first: SSD, then shared) and moves blocks along it: demotion writes into the
first, an evicting tier hands its evictions to the next, promotion reads from
the fastest tier that holds a key.  It never asks *which* tier it has, only
what a tier is like (``local``, ``cross_host``, ``durable_writes``).  A new
tier -- the cluster tier on Mooncake Store (``kvtierd.cluster``) -- is a third
implementation of :class:`LowerTier` appended to that list; the policy's loops do
not change.

The mechanisms (``spill.ssd.SsdTier``, ``spill.shared.SharedTier``) keep their
own richer APIs for their tests, metrics and ``kvtier doctor``;
:class:`SsdAdapter` and :class:`SharedAdapter` are the thin layers that give
them this one shape.

Memory faults.  Every call that takes a DRAM slot (``read_into``'s ``dst``,
``write``'s ``src``) may get memory a client has cut away (it truncated or
punched holes in its namespace's data file).  The copies and checksums then
raise ``OSError(errno.EFAULT)`` (``blockio.memory_fault``): a tier leaves its
own state as if the call had not happened -- no copy dropped, nothing counted
as its fault -- and raises it unchanged.  Whose loss that is, is the policy's
to say.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple, Protocol, runtime_checkable

from kvtier._wire import TIER_NAMES
from kvtier.errors import Corrupted
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.spill.shared import SharedTier
from kvtierd.spill.ssd import SsdTier

log = logging.getLogger(__name__)

#: Tier numbers: the wire enum ``kvtier.v1.Tier`` (their names: ``kvtier._wire.TIER_NAMES``).
TIER_DRAM: Final[int] = pb.TIER_DRAM
TIER_SSD: Final[int] = pb.TIER_SSD
TIER_SHARED: Final[int] = pb.TIER_SHARED
TIER_CLUSTER: Final[int] = pb.TIER_CLUSTER


class Geometry(NamedTuple):
    """What a block was written for: its namespace's block size and model (hash).

    A copy written for another geometry (the namespace was re-declared with a
    new layout or model) is not that namespace's block: tiers never serve it.
    """

    block_bytes: int
    model_hash: int


class BlockCopy(Protocol):
    """The copy a tier evicts and hands on (``spill.ssd.SsdEntry`` is one)."""

    @property
    def namespace(self) -> str: ...

    @property
    def key(self) -> bytes: ...

    @property
    def length(self) -> int: ...

    @property
    def checksum(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    @property
    def model_hash(self) -> int: ...


#: Called on a worker thread with a copy the tier evicts and its verified bytes
#: (page-aligned memory of at least round_up(length) bytes, the data first), before
#: the tier reuses its room: the next tier's chance to keep the block.
HandOff = Callable[[BlockCopy, memoryview], None]


class LowerTier(Protocol):
    """A tier below DRAM, as the tiering policy sees it.

    Blocking methods run on the tiering's worker threads; the ones marked
    loop-safe are O(keys) in-memory work.  ``write`` and ``read_into`` raise
    ``OSError`` on I/O errors (EFAULT: the DRAM slot's memory, not the tier's,
    see the module docstring) and leave the tier consistent.

    The SSD tier and the shared tier implement it (through the adapters
    below), and so does the cluster tier (``kvtierd.cluster.tier``: Mooncake
    Store, a master plus a transfer engine, so hosts read each other's
    blocks): ``local`` False (its index is the master's), ``cross_host`` True,
    ``batched`` (``present`` is one master query for many keys, ``read_many``
    one transfer batch), appended after the shared tier.
    """

    @property
    def tier(self) -> int:
        """The wire enum value (``kvtier.v1.Tier``) this tier reports hits as."""
        ...

    @property
    def name(self) -> str:
        """Its name in metrics labels, logs and ``EvictResult.dropped`` ("ssd", "shared")."""
        ...

    @property
    def local(self) -> bool:
        """Its index lives in this process: ``held`` answers on the event loop,
        ``keys_of`` enumerates it, ``remove`` takes keys out at once, and it evicts
        its own least recently used copies to stay within its capacity (handing
        them to ``hand_off``, reporting them to ``on_lost``).  Not local: every
        question is I/O (``present``), it is never enumerated, nothing here
        bounds it."""
        ...

    @property
    def cross_host(self) -> bool:
        """Other hosts' daemons read it: ``shared_write: commit`` publishes here."""
        ...

    @property
    def durable_writes(self) -> bool:
        """Each ``write`` is durable when it returns (``sync`` has nothing to do)."""
        ...

    @property
    def batched(self) -> bool:
        """Questions cost a round trip each, whatever their size: the policy asks
        ``present`` about a whole run of keys at once and reads a promotion's
        blocks with one ``read_many``; otherwise it asks key by key (stopping at
        the first miss) and reads blocks in parallel, one ``read_into`` each."""
        ...

    def open(self) -> None:
        """Blocking: create or re-adopt what the tier keeps on disk."""
        ...

    def close(self) -> None:
        """Blocking: persist what can be (errors logged, not raised) and let go of files."""
        ...

    def connect(self, *, on_fault: Callable[[str], None], hand_off: HandOff | None,
                on_lost: Callable[[str, bytes], None] | None) -> None:
        """Set the tier's callbacks (called from any thread; keep them short).

        ``on_fault(kind)``: a fault the tier absorbed itself (a damaged file at
        re-adoption, a filesystem smaller than its capacity).  ``hand_off``:
        see :data:`HandOff`.  ``on_lost(namespace, key)``: a copy it evicted.
        Tiers that never evict ignore the last two.
        """
        ...

    def held(self, namespace: str, key: bytes, geometry: Geometry | None) -> int | None:
        """Loop-safe: the length of the copy of ``key`` that a read would use, if this
        process's index knows one (written for ``geometry``; None: any); else None.
        A tier that is not ``local`` always answers None (it cannot tell without I/O)."""
        ...

    def held_many(self, namespace: str, keys: Sequence[bytes],
                  geometry: Geometry | None) -> list[int | None]:
        """Loop-safe: ``held`` of each key, asked at once (a ``local`` tier answers a
        batch with one look at its index; one that is not answers Nones)."""
        ...

    def present(self, namespace: str, keys: Sequence[bytes],
                geometry: Geometry | None) -> list[bool]:
        """Blocking: whether the tier holds a copy of each key (a stat per key for a file
        tier, one query for a ``batched`` one).  ``OSError``: the tier could not tell."""
        ...

    async def present_async(self, namespace: str, keys: Sequence[bytes],
                            geometry: Geometry | None) -> list[bool]:
        """``present`` awaited on the event loop: a ``batched`` tier answers it there
        without a worker thread (one hop less per lookup); the others run ``present``
        on a thread."""
        ...

    def read_into(self, namespace: str, key: bytes, dst: memoryview,
                  geometry: Geometry) -> tuple[int, int]:
        """Blocking: read the block into ``dst`` (page aligned, a whole slot) and verify
        it; returns (length, checksum).

        ``KeyError``: no copy (evicted or deleted meanwhile, or of another
        geometry).  ``kvtier.errors.Corrupted``: the copy failed its checks and
        the tier dropped it.  ``OSError``: the read failed (the tier dropped
        its copy), or EFAULT: ``dst`` faulted (the copy stays).
        """
        ...

    def read_many(self, namespace: str, items: Sequence[tuple[bytes, memoryview]],
                  geometry: Geometry) -> list[tuple[int, int] | BaseException]:
        """Blocking: ``read_into`` for each (key, dst), as one batch where the tier can;
        each result is (length, checksum) or the exception ``read_into`` would have
        raised for that block.  Raises ``OSError`` when none could be tried."""
        ...

    def write(self, namespace: str, key: bytes, src: memoryview, length: int,
              checksum: int | None, geometry: Geometry) -> bool:
        """Blocking: store ``src[:length]`` (``src``: page aligned, covering
        round_up(length) bytes) under ``key``; ``checksum``: its xxh3-64 if known.

        Visible at once, durable when ``sync`` returns (or at once with
        ``durable_writes``).  False when the tier already held a copy and kept
        it.  Raises ``OSError`` (EFAULT: ``src`` faulted) or
        ``spill.ssd.SpillFull``; the tier is unchanged then.
        """
        ...

    def sync(self) -> None:
        """Blocking: make every write so far durable (OSError: none of them is known to be)."""
        ...

    def remove(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Loop-safe: take ``keys`` out of this process's index (reads miss them at
        once; ``flush`` persists it).  A tier that is not ``local`` does nothing (0)."""
        ...

    def flush(self) -> None:
        """Blocking: persist what ``remove`` took out (OSError: the next flush retries)."""
        ...

    def delete(self, namespace: str, keys: Sequence[bytes],
               geometry: Geometry | None) -> set[bytes]:
        """Blocking: remove the copies of ``keys`` that only I/O reaches; returns the
        keys that had one (``geometry``: the namespace's, None when nobody declared
        it since the start).  A ``local`` tier's copies go through ``remove``
        instead, so it does nothing here (a copy written since then stays: it is
        newer)."""
        ...

    def keys_of(self, namespace: str, geometry: Geometry | None) -> list[bytes]:
        """Blocking, O(copies): the keys held for ``namespace`` (written for
        ``geometry``; None: any).  A tier that is not ``local`` answers [] (never
        enumerated: it is a directory tree many hosts write)."""
        ...

    def check(self) -> list[str]:
        """Cross-check the tier's own bookkeeping; the problems found (none: [])."""
        ...


@runtime_checkable
class WritesMany(Protocol):
    """A tier that takes many writes at once (the cluster tier: one Mooncake batch).

    A ``cross_host`` tier that has it receives a commit's write-through publish in
    one ``write_many``; other tiers get one ``write`` per block, in parallel."""

    def write_many(self, namespace: str, keys: Sequence[bytes], srcs: Sequence[memoryview],
                   lengths: Sequence[int], checksums: Sequence[int | None],
                   geometry: Geometry) -> list[bool | BaseException]:
        """Blocking: ``write`` of each block, given as columns (block ``i``: ``keys[i]``,
        ``srcs[i]``, ``lengths[i]``, ``checksums[i]``); each result is what ``write``
        returned for it or the exception it would have raised (a batch that failed as a
        whole: that error for each block).  Raises ``OSError`` when none could be tried."""
        ...


class SsdAdapter:
    """:class:`LowerTier` over a :class:`~kvtierd.spill.ssd.SsdTier`."""

    tier = TIER_SSD
    name = TIER_NAMES[TIER_SSD]
    local = True
    cross_host = False
    durable_writes = False
    batched = False

    def __init__(self, ssd: SsdTier) -> None:
        self.ssd = ssd

    def open(self) -> None:
        self.ssd.open()

    def close(self) -> None:
        try:
            self.ssd.flush_frees()
        except OSError as exc:
            log.warning("SSD tier: could not persist freed slots at stop: %s", exc)
        self.ssd.close()

    def connect(self, *, on_fault: Callable[[str], None], hand_off: HandOff | None,
                on_lost: Callable[[str, bytes], None] | None) -> None:
        self.ssd.on_fault = on_fault
        self.ssd.on_evict = hand_off
        self.ssd.on_evicted = on_lost

    def held(self, namespace: str, key: bytes, geometry: Geometry | None) -> int | None:
        return self.ssd.length_of(namespace, key, None if geometry is None else
                                  (geometry.block_bytes, geometry.model_hash))

    def held_many(self, namespace: str, keys: Sequence[bytes],
                  geometry: Geometry | None) -> list[int | None]:
        return self.ssd.length_of_many(namespace, keys, None if geometry is None else
                                       (geometry.block_bytes, geometry.model_hash))

    def present(self, namespace: str, keys: Sequence[bytes],
                geometry: Geometry | None) -> list[bool]:
        return [n is not None for n in self.held_many(namespace, keys, geometry)]

    async def present_async(self, namespace: str, keys: Sequence[bytes],
                            geometry: Geometry | None) -> list[bool]:
        return self.present(namespace, keys, geometry)  # its index: in memory

    def read_into(self, namespace: str, key: bytes, dst: memoryview,
                  geometry: Geometry) -> tuple[int, int]:
        entry = self.ssd.find(namespace, key, geometry.block_bytes, geometry.model_hash)
        if entry is None:
            raise KeyError(key)
        self.ssd.read_into(entry, dst)
        return entry.length, entry.checksum

    def read_many(self, namespace: str, items: Sequence[tuple[bytes, memoryview]],
                  geometry: Geometry) -> list[tuple[int, int] | BaseException]:
        return _one_by_one(self, namespace, items, geometry)

    def write(self, namespace: str, key: bytes, src: memoryview, length: int,
              checksum: int | None, geometry: Geometry) -> bool:
        self.ssd.write(namespace, key, src, length, checksum, geometry.block_bytes,
                       geometry.model_hash)
        return True

    def sync(self) -> None:
        self.ssd.sync()

    def remove(self, namespace: str, keys: Sequence[bytes]) -> int:
        return self.ssd.remove(namespace, keys)

    def flush(self) -> None:
        self.ssd.flush_frees()

    def delete(self, namespace: str, keys: Sequence[bytes],
               geometry: Geometry | None) -> set[bytes]:
        return set()

    def keys_of(self, namespace: str, geometry: Geometry | None) -> list[bytes]:
        return self.ssd.keys_of(namespace, geometry)

    def check(self) -> list[str]:
        return self.ssd.check()


class RemoteTier:
    """What a tier that is not ``local`` answers to the calls of :class:`LowerTier` only a
    local tier serves: it holds nothing in this process's index, has no removals to
    persist and is never enumerated (``SharedAdapter``, the cluster tier)."""

    def held(self, namespace: str, key: bytes, geometry: Geometry | None) -> int | None:
        return None

    def held_many(self, namespace: str, keys: Sequence[bytes],
                  geometry: Geometry | None) -> list[int | None]:
        return [None] * len(keys)

    def remove(self, namespace: str, keys: Sequence[bytes]) -> int:
        return 0

    def flush(self) -> None:
        pass

    def keys_of(self, namespace: str, geometry: Geometry | None) -> list[bytes]:
        return []


class SharedAdapter(RemoteTier):
    """:class:`LowerTier` over a :class:`~kvtierd.spill.shared.SharedTier`."""

    tier = TIER_SHARED
    name = TIER_NAMES[TIER_SHARED]
    local = False
    cross_host = True
    durable_writes = True  # published by fsync + rename
    batched = False

    def __init__(self, shared: SharedTier) -> None:
        self.shared = shared

    def open(self) -> None:
        self.shared.open()

    def close(self) -> None:
        pass  # no file stays open between calls

    def connect(self, *, on_fault: Callable[[str], None], hand_off: HandOff | None,
                on_lost: Callable[[str, bytes], None] | None) -> None:
        pass  # it absorbs no faults and never evicts

    def present(self, namespace: str, keys: Sequence[bytes],
                geometry: Geometry | None) -> list[bool]:
        return [self.shared.exists(namespace, k) for k in keys]

    async def present_async(self, namespace: str, keys: Sequence[bytes],
                            geometry: Geometry | None) -> list[bool]:
        return await asyncio.to_thread(self.present, namespace, keys, geometry)  # stats

    def read_into(self, namespace: str, key: bytes, dst: memoryview,
                  geometry: Geometry) -> tuple[int, int]:
        return self.shared.read_into(namespace, key, dst, geometry.block_bytes,
                                     geometry.model_hash)

    def read_many(self, namespace: str, items: Sequence[tuple[bytes, memoryview]],
                  geometry: Geometry) -> list[tuple[int, int] | BaseException]:
        return _one_by_one(self, namespace, items, geometry)

    def write(self, namespace: str, key: bytes, src: memoryview, length: int,
              checksum: int | None, geometry: Geometry) -> bool:
        with src[:length] as data:
            return self.shared.publish(namespace, key, data, checksum, geometry.block_bytes,
                                       geometry.model_hash)

    def sync(self) -> None:
        pass

    def delete(self, namespace: str, keys: Sequence[bytes],
               geometry: Geometry | None) -> set[bytes]:
        present = {k for k in keys if self.shared.exists(namespace, k)}
        self.shared.delete(namespace, list(keys))
        return present

    def check(self) -> list[str]:
        return []


def _one_by_one(tier: LowerTier, namespace: str, items: Sequence[tuple[bytes, memoryview]],
                geometry: Geometry) -> list[tuple[int, int] | BaseException]:
    """``read_many`` for a tier without batches: ``read_into`` each, in order."""
    out: list[tuple[int, int] | BaseException] = []
    for key, dst in items:
        try:
            out.append(tier.read_into(namespace, key, dst, geometry))
        except (KeyError, Corrupted, OSError) as exc:
            out.append(exc)
    return out
