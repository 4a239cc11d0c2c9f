"""Tiering: the policy that moves blocks between DRAM and the spill tiers.

Call graph: service -> ``Tiering`` -> ``Store`` (DRAM index, pins, capacity)
and the tiers below DRAM: ``self.lower``, an ordered list of ``spill.tier.Tier``
(SSD, then shared; a cluster tier would come last), which the policy walks
without asking which tiers it has.  Every byte moves on the ``spill`` thread
pool, never on the event loop.

**Demotion** (write-back).  When DRAM's free space falls under
``clean_ahead`` of its capacity, the demoter copies the DIRTY blocks among the
``clean_ahead`` bytes CLOCK would evict first to the first tier below DRAM (the SSD
tier, or without one the shared tier): straight from the shared-memory slot
with O_DIRECT, a batch at a time, then one ``fdatasync``; only then is each
block marked CLEAN, and only CLEAN blocks are evicted.  A tier that evicts
(``Tier.local``) hands what it evicts to the next tier.  The queue is bounded
(``queue_depth`` blocks in flight); a reserve that finds only DIRTY victims
waits for the demoter (back-pressure, up to ``backpressure_timeout``) instead
of dropping data or buffering without bound.  A block whose spill fails (disk full, EIO) becomes
UNSPILLABLE and is evicted as without spill tiers: DRAM keeps serving.

**Promotion.**  ``acquire`` of a key that only a lower tier holds reserves a
DRAM slot for it (system session), reads the block into the slot, verifies
its checksum and commits it CLEAN, then leases it like any DRAM block.
``lookup`` reports each hit's tier and, with ``prefetch``, starts those
promotions in the background.  Concurrent promotions of one key share one read.

**Shared tier writes**: ``shared_write: demotion`` publishes blocks the SSD
tier evicts (or, without an SSD tier, DRAM demotions); ``commit`` also
publishes every committed block at once (write-through to every ``cross_host``
tier, best effort: when ``queue_depth`` publishes are in flight, further ones
are skipped and counted).

**A DRAM slot whose memory faults** (a writer truncated its namespace's data
file or punched holes in it: copies and checksums of the slot raise
``OSError(EFAULT)``, ``spill.blockio.memory_fault``) is the writer's loss,
never a fault of a spill tier: a demotion or publish of it drops the block
from DRAM (as a delete does; its copies below stay), a promotion into it
fails (the slot is returned, the key is a miss, the copy below stays); each
is counted in ``counters.slot_faults`` and the observer's ``slot_fault``.

**Admin calls** (``list_keys``, ``evict``, ``drain``; the service's ListKeys,
Evict, Drain).  Listing and evicting cover DRAM and the local tiers (SSD),
whose indexes this daemon holds; remote tiers (shared) are never enumerated
(a directory tree many hosts write), so ``list_keys`` does not show them and
an evict of ``all`` removes their copies only of the keys DRAM or a local
tier know.  An evict skips (and counts) keys that are leased or moving -- the
``_promoting``/``_demoting`` bookkeeping a delete waits on -- and drops the
rest tier by tier in one loop step per chunk, so each block's bookkeeping
changes all at once.  A drain gives every DRAM block without a durable copy
below DRAM one: it marks them, and the demoter copies them in its ordinary
batches (the same write-back path, off the loop, bounded by ``queue_depth``
and ``BATCH_BYTES``); blocks committed after the drain began are not part of
it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import enum
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol, TypeVar

import numpy as np

from kvtier.errors import CapacityExhausted, Corrupted, FailedPrecondition, NotFound
from kvtierd.block_table import PREFETCHED
from kvtierd.cluster.tier import ClusterTier
from kvtierd.config import ClusterConfig, SpillConfig
from kvtierd.logs import Throttle, event, more
from kvtierd.shared_index import SessionPage
from kvtierd.spill.blockio import fault_kind, memory_fault
from kvtierd.spill.format import model_hash
from kvtierd.spill.shared import SharedTier
from kvtierd.spill.ssd import SpillFull, SsdTier
from kvtierd.spill.tier import TIER_CLUSTER as TIER_CLUSTER
from kvtierd.spill.tier import TIER_DRAM as TIER_DRAM
from kvtierd.spill.tier import TIER_SHARED as TIER_SHARED
from kvtierd.spill.tier import TIER_SSD as TIER_SSD
from kvtierd.spill.tier import (
    BlockCopy,
    Geometry,
    HandOff,
    SharedAdapter,
    SsdAdapter,
    Tier,
    WritesMany,
)
from kvtierd.store import (
    AcquireResult,
    Block,
    CheckSnapshot,
    Lease,
    Lower,
    Namespace,
    NeedDemotion,
    PageCommits,
    Pinned,
    ReserveResult,
    ReserveStatus,
    Session,
    Store,
)

log = logging.getLogger(__name__)
#: Spill faults repeat per block while a disk is failing: one line per kind per 10 s.
_throttle = Throttle()

_T = TypeVar("_T")

#: Tier numbers are the wire enum ``kvtier.v1.Tier`` (``spill.tier``).
TIER_NAMES: Final = {TIER_DRAM: "dram", TIER_SSD: "ssd", TIER_SHARED: "shared",
                     TIER_CLUSTER: "cluster"}
#: How often the demoter re-checks DRAM pressure when nothing woke it.
DEMOTER_TICK: Final = 0.25
#: Bytes one demotion batch may carry before its fdatasync.
BATCH_BYTES: Final = 64 << 20
#: Rounds a delete waits for the demotions/promotions of its keys in flight.
MAX_DELETE_WAITS: Final = 100
#: Prefetches running at once (each is one promotion of a run of keys).
MAX_PREFETCHES: Final = 16
#: Prefetches waiting for one of those at most; a Lookup beyond it does not prefetch.
MAX_QUEUED_PREFETCHES: Final = 256
#: Keys an Evict handles per event-loop step (bounded work between yields: an
#: evict of a whole 250k-block namespace must not stall every other call).
EVICT_CHUNK: Final = 1024
#: DRAM blocks a drain inspects per event-loop step while it collects its blocks.
DRAIN_COLLECT_CHUNK: Final = 4096
#: DRAM blocks per batch lookup below when marking them CLEAN after a restart.
MARK_CLEAN_BATCH: Final = 4096
#: Entries of a drain's pending list one demoter plan may inspect (bounded work
#: per plan; settled entries leave the list, so the scan rarely gets this far).
DRAIN_SCAN_LIMIT: Final = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class SpillPolicy:
    """How blocks move down: the ``spill`` keys the movement follows and ``cluster.write``.

    No defaults of its own: build it from the config (:meth:`from_config`), or from
    the config's defaults (:meth:`with_defaults`, for tests and benchmarks).
    """

    clean_ahead: float
    queue_depth: int
    backpressure_timeout: float
    shared_write: str  # "demotion" or "commit"
    cluster_write: str  # "demotion" or "commit"

    @classmethod
    def from_config(cls, spill: SpillConfig, cluster: ClusterConfig) -> SpillPolicy:
        return cls(clean_ahead=spill.clean_ahead, queue_depth=spill.queue_depth,
                   backpressure_timeout=spill.backpressure_timeout,
                   shared_write=spill.shared_write, cluster_write=cluster.write)

    @classmethod
    def with_defaults(cls, **changes: Any) -> SpillPolicy:
        """The config's defaults, with ``changes`` (field name -> value)."""
        return dataclasses.replace(cls.from_config(SpillConfig(), ClusterConfig()), **changes)


@dataclasses.dataclass
class TieringCounters:
    demotions: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    promotions: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    prefetches: int = 0
    prefetch_hits: int = 0
    skipped_prefetches: int = 0
    skipped_publishes: int = 0
    backpressure_waits: int = 0
    spill_failures: collections.Counter[str] = dataclasses.field(
        default_factory=collections.Counter)
    faults: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # DRAM slots found faulted (EFAULT) while a demotion, publish or promotion copied
    # them, per namespace: a writer cut its data file; the daemon's devices are fine.
    slot_faults: collections.Counter[str] = dataclasses.field(
        default_factory=collections.Counter)


class _Copy(enum.Enum):
    """A copy's outcome besides done/failed: the DRAM slot's memory faulted."""

    SLOT_FAULT = "slot_fault"


@dataclasses.dataclass(frozen=True, slots=True)
class KeyState:
    """One block of a namespace as ``list_keys`` reports it (the wire ``KeyInfo``)."""

    key: bytes
    tier: int  # the fastest tier holding it
    length: int
    leased: bool  # pinned by a lease, or a move of it is in flight
    spilled: bool  # a durable copy exists below DRAM (always true below DRAM)


@dataclasses.dataclass(frozen=True, slots=True)
class EvictResult:
    evicted: int  # keys that lost at least one copy
    skipped: int  # keys left in place: leased, or a move of them in flight
    dropped: dict[str, int]  # copies dropped per tier name ("dram", "ssd", "shared")


@dataclasses.dataclass(frozen=True, slots=True)
class DrainProgress:
    total_blocks: int
    done_blocks: int
    total_bytes: int
    done_bytes: int
    failed_blocks: int
    done: bool


@dataclasses.dataclass(eq=False)
class _Drain:
    """One drain: the DRAM blocks it still has to see copied (``pending``) and its tallies.

    A pending block settles exactly once (``settle``): done when it is CLEAN or
    gone from DRAM, failed when its copy failed (UNSPILLABLE).  ``copied``
    remembers the blocks the drain saw become CLEAN, for the final check that
    their copies are still there.
    """

    pending: collections.OrderedDict[Block, None] = dataclasses.field(
        default_factory=collections.OrderedDict)
    copied: list[Block] = dataclasses.field(default_factory=list)
    total_blocks: int = 0
    total_bytes: int = 0
    done_blocks: int = 0
    done_bytes: int = 0
    failed_blocks: int = 0
    collecting: bool = True  # still choosing its blocks (totals may grow)
    finished: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def add(self, block: Block) -> None:
        self.pending[block] = None
        self.total_blocks += 1
        self.total_bytes += block.length

    def settle(self, block: Block) -> None:
        if block not in self.pending:
            return
        del self.pending[block]
        if block.doomed or block.ns.index.get(block.key) != block:
            self.done_blocks += 1  # gone from DRAM: nothing left to lose
            self.done_bytes += block.length
        elif block.lower == Lower.CLEAN:
            self.done_blocks += 1
            self.done_bytes += block.length
            self.copied.append(block)
        else:
            self.failed_blocks += 1

    def progress(self) -> DrainProgress:
        return DrainProgress(self.total_blocks, self.done_blocks, self.total_bytes,
                             self.done_bytes, self.failed_blocks, self.finished.is_set())


class TieringObserver(Protocol):
    """Metrics hooks (``kvtierd.metrics.Metrics`` implements them)."""

    def spill_io(self, tier: str, op: str, seconds: float, nbytes: int) -> None: ...

    def spill_fault(self, tier: str, kind: str) -> None: ...

    def background_error(self, task: str) -> None: ...

    def slot_fault(self, namespace: str) -> None:
        """A DRAM slot of ``namespace`` found faulted (a client cut its data file)."""


class _NoObserver:
    def spill_io(self, tier: str, op: str, seconds: float, nbytes: int) -> None:
        pass

    def spill_fault(self, tier: str, kind: str) -> None:
        pass

    def background_error(self, task: str) -> None:
        pass

    def slot_fault(self, namespace: str) -> None:
        pass


def _count_down(counter: collections.Counter[tuple[str, bytes]],
                keys: Iterable[tuple[str, bytes]]) -> None:
    """Take one of each of ``keys`` from ``counter``, dropping the ones that reach 0."""
    for k in keys:
        counter[k] -= 1
        if counter[k] <= 0:
            del counter[k]


class Tiering:
    """DRAM (the store) plus the tiers below it (``lower``), and the movement between them."""

    def __init__(
        self,
        store: Store,
        *,
        ssd: SsdTier | None = None,
        shared: SharedTier | None = None,
        cluster: ClusterTier | None = None,
        below: Sequence[Tier] = (),
        policy: SpillPolicy | None = None,
        io_threads: int = 4,
        observer: TieringObserver | None = None,
    ) -> None:
        """``ssd``, ``shared``, ``cluster``: the mechanisms (kept as attributes for
        stats and metrics); ``below``: more tiers under them, slowest last (tests)."""
        self.store = store
        self.ssd = ssd
        self.shared = shared
        self.cluster = cluster
        #: The tiers below DRAM, fastest first: demotion writes into the first, each
        #: evicting tier hands its evictions to the next, promotion reads from the
        #: fastest tier holding a key.
        self.lower: list[Tier] = [
            *([SsdAdapter(ssd)] if ssd is not None else []),
            *([SharedAdapter(shared)] if shared is not None else []),
            *([cluster] if cluster is not None else []),
            *below,
        ]
        self._by_id = {t.tier: t for t in self.lower}
        self._local = [t for t in self.lower if t.local]  # their indexes: loop-safe lookups
        self._remote = [t for t in self.lower if not t.local]  # every lookup is I/O
        self.policy = policy or SpillPolicy.with_defaults()
        #: Where every committed block is published (``shared_write: commit``,
        #: ``cluster.write: commit``).
        self._write_through = [t for t in self.lower
                               if t.cross_host and self._write_policy(t) == "commit"]
        #: Those that take a commit's blocks in one ``write_many`` (the cluster tier).
        self._publish_many = {t.tier for t in self._write_through if isinstance(t, WritesMany)}
        # Page commits make block handles only for the write-through publish.
        store.commit_handles = bool(self._write_through)
        #: The last tier evicts without handing on (a local tier's LRU, or a cluster
        #: that may drop any object): a CLEAN block's copy may vanish.
        self._lossy = bool(self.lower) and (self.lower[-1].local
                                            or not self.lower[-1].durable_writes)
        self.observer: TieringObserver = observer or _NoObserver()
        self.counters = TieringCounters()
        self.enabled = bool(self.lower)
        store.spill_enabled = self.enabled
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, io_threads), thread_name_prefix="kvtier-spill")
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._urgent: list[Block] = []  # DIRTY blocks a waiting reserve needs demoted
        self._promoting: dict[tuple[str, bytes], asyncio.Future[bool]] = {}
        self._demoting: dict[tuple[str, bytes], Block] = {}
        self._publishing = 0
        self._forgotten = False  # copies the demoter removed below, not flushed yet
        # Keys a Delete or Evict is removing from the lower tiers (a count per key:
        # both may be at it at once): lookups and promotions do not see them meanwhile.
        self._deleting: collections.Counter[tuple[str, bytes]] = collections.Counter()
        # Keys being written to a lower tier outside demotion: by a write-through publish
        # (event loop) or a tier's eviction hand-off to the next (an I/O thread; under the
        # lock, with _deleting's updates, so a hand-off either sees a Delete's hide or is
        # seen by that Delete).
        self._publishing_keys: collections.Counter[tuple[str, bytes]] = collections.Counter()
        self._handing: collections.Counter[tuple[str, bytes]] = collections.Counter()
        self._handoff_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: _Drain | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._demoter: asyncio.Task[None] | None = None
        self._prefetch_slots = asyncio.Semaphore(MAX_PREFETCHES)
        self._queued_prefetches = 0
        self._mhash: dict[str, int] = {}
        for i, tier in enumerate(self.lower):
            self._connect(tier, self.lower[i + 1] if i + 1 < len(self.lower) else None)

    def _connect(self, tier: Tier, nxt: Tier | None) -> None:
        """A tier's callbacks: its absorbed faults are counted; what it evicts goes to
        the next tier, or, from the last one, leaves the DRAM blocks that counted on it
        without a copy below."""
        hand_off: HandOff | None = None
        if nxt is not None and self._write_policy(nxt) in ("demotion", "commit"):
            target = nxt

            def pass_on(entry: BlockCopy, data: memoryview) -> None:  # an I/O thread
                self._hand_off(tier, target, entry, data)

            hand_off = pass_on
        tier.connect(on_fault=lambda kind: self._fault(tier.name, kind), hand_off=hand_off,
                     on_lost=self._lost_below if nxt is None else None)

    def _write_policy(self, tier: Tier) -> str:
        """When ``tier`` gets blocks: "demotion" (what the tier above it evicts, or
        DRAM's demotions when it is first) or "commit" (also every commit)."""
        return self.policy.cluster_write if tier.tier == TIER_CLUSTER else self.policy.shared_write

    # ================================================================ lifecycle
    async def start(self) -> None:
        """Open the tiers below DRAM (re-adopting the SSD's files) and start the demoter."""
        loop = self._loop = asyncio.get_running_loop()
        for tier in self.lower:
            await loop.run_in_executor(self._pool, tier.open)
        self._mark_clean_below()
        if self.enabled:
            self._demoter = loop.create_task(self._demote_forever(), name="kvtier-demoter")

    async def stop(self) -> None:
        """Stop moving blocks; in-flight I/O finishes before any file is closed."""
        if self._demoter is not None:
            self._demoter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._demoter
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Worker threads may still be reading DRAM slots or writing spill files: wait for
        # them before the spill files (and then the segments) are closed.
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        for tier in self.lower:
            await asyncio.to_thread(tier.close)

    def _lost_below(self, namespace: str, key: bytes) -> None:
        """The last tier evicted a copy (any thread, its lock held: just schedule)."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody to tell
                self._loop.call_soon_threadsafe(self._evicted_below, namespace, key)

    def _evicted_below(self, namespace: str, key: bytes) -> None:
        """The last tier below DRAM evicted its copy of (namespace, key) to make room (its
        LRU, or the namespace's SSD quota).  A DRAM block that counted on it (CLEAN) now
        has no copy below: it becomes UNSPILLABLE, evictable like a block without spill
        tiers, and is not demoted again -- re-spilling it would evict another copy in
        turn, for ever, whenever the tier (or the quota) is smaller than what DRAM wants
        to keep clean."""
        ns = self.store.namespaces.get(namespace)
        block = ns.index.get(key) if ns is not None else None
        if block is not None and block.lower == Lower.CLEAN:
            self.store.set_lower(block, Lower.UNSPILLABLE)

    def _mark_clean_below(self) -> None:
        """After a restart, DRAM blocks that also have a copy a local tier knows are CLEAN."""
        if not self._local:
            return
        for ns in self.store.namespaces.values():
            geometry = self._geometry(ns)
            blocks = list(ns.index.values())
            for at in range(0, len(blocks), MARK_CLEAN_BATCH):  # (a batch lookup each)
                chunk = blocks[at : at + MARK_CLEAN_BATCH]
                copies = self._local_copies(ns.name, [b.key for b in chunk], geometry)
                for block, copy in zip(chunk, copies, strict=True):
                    if copy is not None and copy[1] == block.length:
                        self.store.set_lower(block, Lower.CLEAN)

    def _fault(self, tier: str, kind: str, n: int = 1) -> None:
        self.counters.faults[f"{tier}/{kind}"] += n
        for _ in range(n):
            self.observer.spill_fault(tier, kind)

    def _model_hash(self, ns: Namespace) -> int:
        h = self._mhash.get(ns.model_uid)
        if h is None:
            h = self._mhash[ns.model_uid] = model_hash(ns.model_uid)
        return h

    def _geometry(self, ns: Namespace) -> Geometry:
        return Geometry(ns.block_bytes, self._model_hash(ns))

    def _geometry_of(self, ns: Namespace | None) -> Geometry | None:
        """None for a namespace nobody declared since the start: copies taken as they are."""
        return None if ns is None else self._geometry(ns)

    def _copy_in(self, tier: Tier, namespace: str, key: bytes,
                 geometry: Geometry | None) -> int | None:
        """The length of ``tier``'s copy of a key that reads would use, if its index in
        this process knows one (loop-safe; None for a tier that is not local)."""
        demoting = self._demoting.get((namespace, key))
        if demoting is not None and demoting.doomed:
            return None  # deleted while its demotion was in flight
        return tier.held(namespace, key, geometry)

    def _local_copy(self, namespace: str, key: bytes,
                    geometry: Geometry | None) -> tuple[Tier, int] | None:
        """The fastest local tier's copy of a key: (tier, length), or None (loop-safe)."""
        for tier in self._local:
            length = self._copy_in(tier, namespace, key, geometry)
            if length is not None:
                return tier, length
        return None

    def _copies_in(self, tier: Tier, namespace: str, keys: Sequence[bytes],
                   geometry: Geometry | None) -> list[int | None]:
        """``_copy_in`` of each key: the tier asked once about them all (``held_many``:
        the SSD tier's index looks the batch up in one native call; loop-safe)."""
        held = list(tier.held_many(namespace, keys, geometry))
        if self._demoting:
            for i, key in enumerate(keys):
                demoting = self._demoting.get((namespace, key))
                if demoting is not None and demoting.doomed:
                    held[i] = None
        return held

    def _local_tiers(self, namespace: str, keys: Sequence[bytes],
                     geometry: Geometry | None) -> list[int]:
        """The fastest local tier holding each key (its ``tier`` number), 0 for none:
        ``_local_copies`` without the lengths (one ``held_many`` a tier; loop-safe)."""
        if len(self._local) == 1:
            only = self._local[0].tier
            return [0 if length is None else only
                    for length in self._copies_in(self._local[0], namespace, keys, geometry)]
        return [0 if copy is None else copy[0].tier
                for copy in self._local_copies(namespace, keys, geometry)]

    def _local_copies(self, namespace: str, keys: Sequence[bytes],
                      geometry: Geometry | None) -> list[tuple[Tier, int] | None]:
        """``_local_copy`` of each key: each local tier asked once, about the keys the
        tiers before it lack (loop-safe)."""
        out: list[tuple[Tier, int] | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for tier in self._local:
            if not todo:
                break
            lengths = self._copies_in(tier, namespace, [keys[i] for i in todo], geometry)
            rest: list[int] = []
            for i, length in zip(todo, lengths, strict=True):
                if length is None:
                    rest.append(i)
                else:
                    out[i] = (tier, length)
            todo = rest
        return out

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _signal_progress(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    # ================================================================ lookup
    async def lookup(self, session: Session, keys: Sequence[bytes], *,
                     prefetch: bool = False) -> list[int]:
        """The tier of each key of the longest prefix present in any tier."""
        ns = session.ns
        tiers = await self._locate(ns, keys)
        lower = [k for k, t in zip(keys, tiers, strict=False) if t != TIER_DRAM]
        if prefetch and lower:
            if self._queued_prefetches >= MAX_QUEUED_PREFETCHES:
                self.counters.skipped_prefetches += 1  # the Acquire will promote them
            else:
                self.counters.prefetches += len(lower)
                self._queued_prefetches += 1
                self._spawn(self._prefetch(ns, list(keys[: len(tiers)]), tiers))
        return tiers

    async def _locate(self, ns: Namespace, keys: Sequence[bytes]) -> list[int]:
        """The tier of each key of the longest prefix some tier holds (fastest tier wins)."""
        tiers: list[int] = []
        geometry = self._geometry(ns)
        in_dram = (ns.index.find(keys) != 0 if keys  # one batch lookup
                   else np.zeros(0, bool))
        name, n = ns.name, len(keys)
        i = 0
        while i < n:
            # The walk from key i, in batches: it ends at a key being deleted (hidden);
            # the local tiers are asked once about every key DRAM lacks up to there
            # (``_local_tiers``: one ``held_many`` a tier).  Asked again after an await
            # on a remote tier: the answers may have changed meanwhile.
            end = n
            if self._deleting:
                deleting = self._deleting
                end = next((k for k in range(i, n) if (name, keys[k]) in deleting), n)
            walk = np.where(in_dram[i:end], TIER_DRAM, 0)  # 0: no tier known to hold it
            below = np.flatnonzero(walk == 0)
            if len(below):
                first, last = i + int(below[0]), i + int(below[-1])
                asked = (keys[first : last + 1] if last - first + 1 == len(below)
                         else [keys[i + k] for k in below.tolist()])  # (a run: a slice)
                walk[below] = self._local_tiers(name, asked, geometry)
            zeros = np.flatnonzero(walk == 0)
            held = int(zeros[0]) if len(zeros) else len(walk)
            tiers.extend(walk[:held].tolist())
            if held == len(walk) or not self._remote:
                break  # the end, a key being deleted, or one no tier holds
            # The run of keys only a remote tier can hold: asked off the loop, in one go.
            after = np.flatnonzero(walk[held:] != 0)
            start, stop = i + held, i + (held + int(after[0]) if len(after) else len(walk))
            found = await self._locate_remote_async(name, list(keys[start:stop]), geometry)
            tiers.extend(found)
            if len(found) < stop - start:
                break
            i = stop
        return tiers

    async def _prefetch(self, ns: Namespace, keys: list[bytes], tiers: list[int]) -> None:
        try:
            async with self._prefetch_slots:
                with contextlib.suppress(CapacityExhausted):
                    await self._promote(ns, keys, tiers, prefetch=True)
        except Exception:  # noqa: BLE001 (a bug: count it, the Acquire promotes anyway)
            self.background_error("prefetch")
        finally:
            self._queued_prefetches -= 1

    def background_error(self, task: str) -> None:
        """An unexpected exception in background work: logged (throttled) and counted."""
        self.observer.background_error(task)
        held = _throttle(f"background-{task}")
        if held is not None:
            log.exception("%s failed; it keeps running%s", task, more(held))

    # ================================================================ acquire
    async def acquire(self, session: Session, keys: Sequence[bytes]) -> tuple[AcquireResult,
                                                                                 list[int]]:
        """Lease the longest prefix present in any tier, promoting what is below DRAM.

        Returns the lease and the tier each hit was found on.
        """
        ns = session.ns
        tiers: list[int] = [TIER_DRAM] * ns.index.prefix(keys)
        if self.enabled and len(tiers) < len(keys):
            tiers = await self._locate(ns, keys)
            if any(t != TIER_DRAM for t in tiers):
                # Pin this prefix's DRAM hits meanwhile: the promotions' reserve would
                # otherwise evict them (CLOCK may take them) and cut the prefix short.
                hits = [b for k in keys[: len(tiers)] if (b := ns.index.get(k)) is not None]
                leases = self.store.pin_blocks(hits)
                try:
                    with contextlib.suppress(CapacityExhausted):
                        await self._promote(ns, list(keys[: len(tiers)]), tiers, prefetch=False)
                finally:
                    for lease in leases:
                        self.store.unpin(lease)
        # Prefetched blocks read now count as prefetch hits (the acquire's touch clears
        # the mark).
        refs = ns.index.find(keys[: len(tiers)]) if tiers else None
        if refs is not None:
            missing = np.flatnonzero(refs == 0)
            refs = refs[: int(missing[0]) if len(missing) else len(refs)]
            if len(refs):
                flags = ns.table.inspect(refs)["flags"]
                self.counters.prefetch_hits += int(np.count_nonzero(flags & PREFETCHED))
        result = self.store.acquire(session, keys[: len(tiers)])
        ns.misses += len(keys) - len(tiers)  # store.acquire counted the rest
        return result, tiers[: result.hits]

    async def _promote(self, ns: Namespace, keys: list[bytes], tiers: list[int], *,
                       prefetch: bool) -> None:
        """Bring every non-DRAM key of ``keys`` into DRAM, in order, stopping at a failure."""
        mine: list[tuple[bytes, int]] = []
        waits: list[asyncio.Future[bool]] = []
        loop = asyncio.get_running_loop()
        for key, tier in zip(keys, tiers, strict=True):
            if tier == TIER_DRAM or key in ns.index:
                continue
            fut = self._promoting.get((ns.name, key))
            if fut is not None:
                waits.append(fut)
                continue
            fut = loop.create_future()
            self._promoting[(ns.name, key)] = fut
            mine.append((key, tier))
        try:
            if mine:
                await self._promote_keys(ns, mine, prefetch)
        finally:
            for key, _tier in mine:
                fut = self._promoting.pop((ns.name, key))
                if not fut.done():
                    fut.set_result(key in ns.index)
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)

    async def _promote_keys(self, ns: Namespace, items: list[tuple[bytes, int]],
                            prefetch: bool) -> None:
        system = self.store.system_session(ns)
        keys = [k for k, _ in items]
        res = await self._reserve_with_backpressure(system, keys, None)
        wanted = [(k, t) for (k, t), st in zip(items, res.statuses, strict=True)
                  if st == ReserveStatus.RESERVED]
        if not wanted:
            return
        views = self.store.reservation_slots(system, res.reservation_id)
        geometry = self._geometry(ns)
        try:
            # One job per block, or per batched tier (its blocks in one read_many).
            groups: list[list[int]] = []
            by_tier: dict[int, list[int]] = {}
            for i, (_key, tier) in enumerate(wanted):
                if not self._by_id[tier].batched:
                    groups.append([i])
                elif tier in by_tier:
                    by_tier[tier].append(i)
                else:
                    groups.append(by_tier.setdefault(tier, [i]))
            done = await asyncio.gather(*(
                self._run(self._read_blocks, ns.name, self._by_id[wanted[g[0]][1]],
                          [(wanted[i][0], views[i]) for i in g], geometry)
                for g in groups))
            outcomes: list[tuple[int, int] | None | _Copy] = [None] * len(wanted)
            for g, got in zip(groups, done, strict=True):
                for i, out in zip(g, got, strict=True):
                    outcomes[i] = out
        finally:
            for v in views:
                v.release()
        # Keep the prefix: after the first failure, nothing is committed.
        settled: list[tuple[int, int] | None] = []
        failed = False
        for (key, _tier), out in zip(wanted, outcomes, strict=True):
            if out is _Copy.SLOT_FAULT:
                self._slot_fault(ns.name, key, "promotion")
                out = None
            failed = failed or out is None
            settled.append(None if failed else out)
        blocks = self.store.settle(system, res.reservation_id, settled)
        for (_key, tier), block in zip(wanted, blocks, strict=True):
            if block is None:
                continue
            self.store.set_lower(block, Lower.CLEAN)
            if prefetch:
                ns.table.set_prefetched([block.ref])
            self.counters.promotions[self._by_id[tier].name] += 1

    def _read_block(self, namespace: str, key: bytes, tier: Tier, dst: memoryview,
                    geometry: Geometry) -> tuple[int, int] | None | _Copy:
        """Worker thread: read one block into a DRAM slot; (length, checksum), None
        (a miss), or SLOT_FAULT (the slot's memory faulted: the copy below stays)."""
        t0 = time.perf_counter()
        try:
            length, checksum = tier.read_into(namespace, key, dst, geometry)
        except KeyError:
            return None  # evicted or deleted meanwhile: a miss
        except (Corrupted, OSError) as exc:
            if memory_fault(exc):
                return _Copy.SLOT_FAULT  # the writer's loss, not the tier's fault
            self._fault(tier.name, fault_kind(exc))
            return None
        self.observer.spill_io(tier.name, "read", time.perf_counter() - t0, length)
        return length, checksum

    def _read_blocks(self, namespace: str, tier: Tier, items: list[tuple[bytes, memoryview]],
                     geometry: Geometry) -> list[tuple[int, int] | None | _Copy]:
        """Worker thread: ``_read_block`` for each of ``items``: a batched tier's in one
        ``read_many``, another tier's (always one block here) through ``_read_block``."""
        if not tier.batched:
            return [self._read_block(namespace, key, tier, dst, geometry) for key, dst in items]
        t0 = time.perf_counter()
        try:
            results = tier.read_many(namespace, items, geometry)
        except OSError as exc:
            self._fault(tier.name, fault_kind(exc))
            return [None] * len(items)
        out: list[tuple[int, int] | None | _Copy] = []
        nbytes = 0
        for res in results:
            if isinstance(res, tuple):
                out.append(res)
                nbytes += res[0]
            elif isinstance(res, (Corrupted, OSError)):
                if memory_fault(res):
                    out.append(_Copy.SLOT_FAULT)
                else:
                    self._fault(tier.name, fault_kind(res))
                    out.append(None)
            else:
                out.append(None)  # KeyError: a miss
        if nbytes:
            self.observer.spill_io(tier.name, "read", time.perf_counter() - t0, nbytes)
        return out

    async def _locate_remote_async(self, namespace: str, keys: list[bytes],
                                   geometry: Geometry) -> list[int]:
        """The tier of each key of the longest prefix the remote tiers hold (the first
        of them holding it).  A batched tier is asked about all the keys in one go, from
        the loop (``present_async``); the others key by key on a worker thread, as far
        as needed.  A tier that cannot answer counts a fault and is a miss."""
        batched: dict[int, list[bool]] = {}
        for tier in self._remote:
            if tier.batched:
                try:
                    batched[tier.tier] = await tier.present_async(namespace, keys, geometry)
                except OSError as exc:
                    self._fault(tier.name, fault_kind(exc))
                    batched[tier.tier] = [False] * len(keys)
        if all(t.batched for t in self._remote):
            return self._locate_remote(namespace, keys, geometry, batched)  # no I/O left
        return await self._run(self._locate_remote, namespace, keys, geometry, batched)

    def _locate_remote(self, namespace: str, keys: list[bytes], geometry: Geometry,
                       batched: dict[int, list[bool]]) -> list[int]:
        """Worker thread (or the loop when every remote tier is batched): walk the keys
        with the batched tiers' answers, asking the others key by key."""
        out: list[int] = []
        for i, key in enumerate(keys):
            found = None
            for tier in self._remote:
                if tier.batched:
                    hit = batched[tier.tier][i]
                else:
                    try:
                        hit = tier.present(namespace, [key], geometry)[0]
                    except OSError as exc:
                        self._fault(tier.name, fault_kind(exc))
                        hit = False
                if hit:
                    found = tier.tier
                    break
            if found is None:
                break
            out.append(found)
        return out

    # ================================================================ reserve / commit
    async def reserve(self, session: Session, keys: Sequence[bytes]) -> ReserveResult:
        """Reserve DRAM slots; keys a lower tier holds are EXISTS.  Waits for demotion
        when only DIRTY blocks could make room."""
        return await self._reserve_with_backpressure(session, keys,
                                                     self._exists_below(session, keys))

    def _exists_below(self, session: Session, keys: Sequence[bytes] = ()
                      ) -> Callable[[bytes], bool] | None:
        """Whether a tier below DRAM holds a key of ``session``'s namespace (None: no such
        tier): such a key is EXISTS to a writer, as a DRAM block is.

        ``keys``: the keys it will be asked about (a Reserve's).  Its first question in
        a turn of the event loop then asks the local tiers about all of them at once
        (``_local_copies``: one batch lookup, not one per key), and the answers serve
        the rest of that turn -- the store asks key by key in one synchronous pass --
        and are dropped at its end: a later pass (after the store grew the namespace,
        or after waiting for demotion) asks afresh.  A key not among them, or a
        question off the event loop's thread, is asked alone."""
        if not self._local:
            return None
        ns, geometry = session.ns, self._geometry(session.ns)
        turn: dict[bytes, bool] = {}  # this turn's answers about ``keys``

        def exists(key: bytes) -> bool:
            hit = turn.get(key)
            if hit is not None:
                return hit
            if not turn and len(keys) > 1:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # (not on the loop's thread: no turn to cache for)
                    loop = None
                if loop is not None:
                    copies = self._local_copies(ns.name, keys, geometry)
                    turn.update(zip(keys, (c is not None for c in copies), strict=True))
                    loop.call_soon(turn.clear)
                    hit = turn.get(key)
                    if hit is not None:
                        return hit
            return self._local_copy(ns.name, key, geometry) is not None

        return exists

    async def _reserve_with_backpressure(
        self, session: Session, keys: Sequence[bytes], exists: Callable[[bytes], bool] | None
    ) -> ReserveResult:
        deadline = time.monotonic() + self.policy.backpressure_timeout
        while True:
            try:
                return await self.store.reserve(session, keys, exists)
            except NeedDemotion as need:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CapacityExhausted(
                        f"DRAM is full for namespace {need.ns.name!r} and demotion to the "
                        f"spill tiers did not free {need.short} blocks within "
                        f"{self.policy.backpressure_timeout:g} s (spill.backpressure_timeout)"
                    ) from None
                self.counters.backpressure_waits += 1
                self._urgent.extend(need.blocks)
                self._wake.set()
                progress = self._progress
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(progress.wait(), timeout=min(left, 1.0))

    def commit(self, session: Session, reservation_id: int, lengths: Sequence[int],
               checksums: Sequence[int] | None) -> int:
        """``Store.commit``, then wake the demoter and publish when write-through."""
        res = session.reservations.get(reservation_id)
        keys = list(res.keys) if res is not None else []
        n = self.store.commit(session, reservation_id, lengths, checksums)
        if self.enabled:
            index = session.ns.index
            self._committed([b for k in keys if (b := index.get(k)) is not None]
                            if self._write_through else [])
        return n

    def commit_from_page(self, session: Session, page: SessionPage) -> PageCommits:
        """``Store.commit_from_page`` (keys a lower tier holds are EXISTS, as for a
        reserve), then wake the demoter and publish when write-through."""
        out = self.store.commit_from_page(session, page, self._exists_below(session))
        if self.enabled and out.committed:
            self._committed(out.blocks)
        return out

    def _committed(self, blocks: Sequence[Block]) -> None:
        if self._write_through and blocks:
            # Bounded by queue_depth blocks in flight; a commit that finds none in flight
            # is published whole (one batch: a commit cut at queue_depth would leave a
            # consumer on another host waiting for blocks that never come).
            room = (self.policy.queue_depth - self._publishing if self._publishing
                    else len(blocks))
            if room < len(blocks):
                self.counters.skipped_publishes += len(blocks) - max(room, 0)
                blocks = blocks[: max(room, 0)]
            if blocks:
                self._publishing_keys.update((b.ns.name, b.key) for b in blocks)
                self._spawn(self._publish(list(blocks)))
        self._wake.set()

    async def _publish(self, blocks: list[Block]) -> None:
        """Copy a commit's blocks into every write-through tier: one ``write_many`` (one
        worker job) for a tier that takes batches, one ``write`` per block otherwise."""
        leases = self.store.pin_blocks(blocks)
        self._publishing += len(blocks)
        try:
            jobs: list[Any] = []
            for t in self._write_through:
                if t.tier in self._publish_many:
                    jobs.append(self._run(self._copy_down_many, blocks, t, "publish"))
                else:
                    jobs.extend(self._run(self._copy_down, b, t, "publish") for b in blocks)
            done = await asyncio.gather(*jobs)
            results: list[list[bool | _Copy]] = []  # per tier, per block
            at = 0
            for t in self._write_through:
                if t.tier in self._publish_many:
                    results.append(done[at])
                    at += 1
                else:
                    results.append(done[at : at + len(blocks)])
                    at += len(blocks)
            for i, block in enumerate(blocks):
                for tier, res_t in zip(self._write_through, results, strict=True):
                    res = res_t[i]
                    if res is _Copy.SLOT_FAULT:
                        self._lose(block, "publish")
                    elif res and tier is self.lower[0]:  # where demotion would have put it
                        self.store.set_lower(block, Lower.CLEAN)
        finally:
            self._publishing -= len(blocks)
            _count_down(self._publishing_keys, [(b.ns.name, b.key) for b in blocks])
            for lease in leases:
                self.store.unpin(lease)
            self._signal_progress()

    def _hand_off(self, tier: Tier, nxt: Tier, entry: BlockCopy, data: memoryview) -> None:
        """Eviction hook of ``tier`` (worker thread): pass the block on to ``nxt``.

        A key a Delete is removing is not handed on; a Delete that starts meanwhile waits
        for the hand-off (``_moving``) and then removes what it wrote.
        """
        k = (entry.namespace, entry.key)
        with self._handoff_lock:
            if k in self._deleting:
                return
            self._handing[k] += 1
        t0 = time.perf_counter()
        try:
            stored = nxt.write(entry.namespace, entry.key, data, entry.length, entry.checksum,
                               Geometry(entry.block_bytes, entry.model_hash))
        except (OSError, SpillFull) as exc:
            self._fault(nxt.name, fault_kind(exc) if isinstance(exc, OSError) else "full")
            raise
        finally:
            with self._handoff_lock:
                _count_down(self._handing, [k])
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    self._loop.call_soon_threadsafe(self._signal_progress)
        if stored:
            self.counters.demotions[f"{tier.name}->{nxt.name}"] += 1
            self.observer.spill_io(nxt.name, "write", time.perf_counter() - t0, entry.length)

    # ================================================================ delete
    async def delete(self, session: Session, keys: Sequence[bytes]) -> int:
        """Delete from every tier; returns how many keys were present in any.

        The keys are hidden first (lookups miss them, no new promotion, publish or
        hand-off starts), then demotions, promotions, publishes and SSD->shared hand-offs
        of them in flight finish: one would otherwise write the block to a tier after
        its copy there was removed, or commit it to DRAM again.
        """
        ns = session.ns
        gone = [(ns.name, k) for k in keys]
        self._hide(gone)  # until the shared tier's files are gone too
        try:
            await self._wait_unmoving(ns.name, keys)
            return await self._delete(session, keys)
        finally:
            self._unhide(gone)

    async def _wait_unmoving(self, namespace: str, keys: Sequence[bytes]) -> None:
        for _ in range(MAX_DELETE_WAITS):
            busy = [f for k in keys if (f := self._promoting.get((namespace, k))) is not None]
            moving = any(self._moving(namespace, k) for k in keys)
            if not busy and not moving:
                break
            progress = self._progress
            if busy:
                await asyncio.gather(*busy, return_exceptions=True)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(progress.wait(), timeout=1.0)

    async def _delete(self, session: Session, keys: Sequence[bytes]) -> int:
        ns = session.ns
        present = ({keys[i] for i in np.flatnonzero(ns.index.find(keys)).tolist()}
                   if keys else set())
        self.store.delete(session, keys)
        geometry = self._geometry(ns)
        for tier in self._local:
            present |= {k for k, length in zip(keys, self._copies_in(tier, ns.name, keys,
                                                                     geometry), strict=True)
                        if length is not None}
            tier.remove(ns.name, keys)
        found = await self._drop_lower(ns.name, {t: keys for t in self._remote}, geometry)
        for there in found.values():
            present |= there
        return len(present)

    def _moving(self, namespace: str, key: bytes) -> bool:
        """A promotion, demotion, publish or SSD->shared hand-off of this key is in flight
        (Delete waits for it to finish; Evict leaves the key alone)."""
        k = (namespace, key)
        return (k in self._promoting or k in self._demoting or k in self._publishing_keys
                or k in self._handing)

    def _hide(self, keys: Iterable[tuple[str, bytes]]) -> None:
        with self._handoff_lock:
            self._deleting.update(keys)

    def _unhide(self, keys: Iterable[tuple[str, bytes]]) -> None:
        with self._handoff_lock:
            _count_down(self._deleting, keys)

    async def _drop_lower(self, namespace: str, drops: Mapping[Tier, Sequence[bytes]],
                          geometry: Geometry | None) -> dict[str, set[bytes]]:
        """The I/O half of removing keys below DRAM (Delete and Evict): persist what the
        local tiers' ``remove`` took out, then remove each remote tier's copies of its
        keys in ``drops``.  Returns, per tier name, the keys that had a copy there."""
        for tier in self._local:
            with contextlib.suppress(OSError):  # not persisted: the next flush retries
                await self._run(tier.flush)
        found: dict[str, set[bytes]] = {}
        for tier, keys in drops.items():
            if not keys:
                continue
            try:
                found[tier.name] = await self._run(tier.delete, namespace, list(keys), geometry)
            except OSError as exc:
                self._fault(tier.name, fault_kind(exc))
        return found

    # ================================================================ demotion
    def queue_depth(self) -> int:
        return len(self._demoting) + self._publishing

    async def _demote_forever(self) -> None:
        while True:
            try:
                batch = self._plan()
                if batch:
                    await self._demote(batch)
                    continue
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=DEMOTER_TICK)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: log and count it, keep the daemon serving
                self.background_error("demotion")
                await asyncio.sleep(DEMOTER_TICK)

    def _plan(self) -> list[Block]:
        """Blocks to demote now: urgent reserves first, then the clean-ahead target, then
        a running drain's blocks."""
        depth = self.policy.queue_depth
        batch: list[Block] = []
        seen: set[Block] = set()

        def add(blocks: list[Block]) -> None:
            size = sum(b.ns.slot_bytes for b in batch)
            for b in blocks:
                if len(batch) >= depth or size >= BATCH_BYTES:
                    return
                if b not in seen:
                    seen.add(b)
                    batch.append(b)
                    size += b.ns.slot_bytes

        urgent, self._urgent = self._urgent, []
        add([b for b in urgent if b.pins == 0 and b.lower == Lower.DIRTY and not b.doomed
             and b.ns.index.get(b.key) == b])
        acct = self.store.dram_bytes()
        target = int(self.policy.clean_ahead * acct["total"])
        free = acct["free"]
        if free < target:
            add(self.store.demotion_candidates(target - free, depth))
        add(self._drain_candidates(depth - len(batch)))
        return batch

    async def _demote(self, batch: list[Block]) -> None:
        target = self.lower[0]
        leases: list[Lease] = self.store.pin_blocks(batch)
        for b in batch:
            self._demoting[(b.ns.name, b.key)] = b
        try:
            results = await asyncio.gather(*(
                self._run(self._copy_down, b, target, "demotion") for b in batch))
            synced = await self._sync(target)
            for block, res in zip(batch, results, strict=True):
                if res is _Copy.SLOT_FAULT:
                    self._lose(block, "demotion")
                    continue
                if res and synced:
                    if block.doomed or block.ns.index.get(block.key) != block:
                        self._forget(block)  # deleted meanwhile: never resurrect it
                        continue
                    self.store.set_lower(block, Lower.CLEAN)
                    self.counters.demotions[f"dram->{target.name}"] += 1
                else:
                    if res:
                        self._forget(block)
                    self.store.set_lower(block, Lower.UNSPILLABLE)
                    self.counters.spill_failures[target.name] += 1
            if self._forgotten:
                self._forgotten = False
                try:
                    await self._run(target.flush)
                except OSError as exc:
                    self._fault(target.name, fault_kind(exc))
        finally:
            for b in batch:
                self._demoting.pop((b.ns.name, b.key), None)
            for lease in leases:
                self.store.unpin(lease)
            if self._drain is not None:
                for b in batch:
                    self._drain.settle(b)
            self._signal_progress()

    def _forget(self, block: Block) -> None:
        """Undo a block's copy in the demotion target (a local tier's removal reaches
        the disk at the next flush; a remote copy stays for the Delete that waits on
        this demotion to remove)."""
        if self.lower[0].remove(block.ns.name, [block.key]):
            self._forgotten = True

    async def _sync(self, target: Tier) -> bool:
        if target.durable_writes:
            return True
        t0 = time.perf_counter()
        try:
            await self._run(target.sync)
        except OSError as exc:
            kind = fault_kind(exc)
            self._fault(target.name, kind)
            held = _throttle(f"{target.name}/sync/{kind}")
            if held is not None:
                log.warning("%s tier: fdatasync failed (%s); the batch is not durable%s",
                            target.name, exc, more(held),
                            extra=event("spill_fault", tier=target.name, op="sync",
                                        kind=kind, held_back=held))
            return False
        self.observer.spill_io(target.name, "sync", time.perf_counter() - t0, 0)
        return True

    def _copy_down(self, block: Block, tier: Tier, op: str) -> bool | _Copy:
        """Worker thread: copy one pinned DRAM block into ``tier`` (``op``: "demotion" or
        "publish"); True when the tier holds it now, False when the copy failed (counted
        as the tier's fault), SLOT_FAULT when the slot's memory faulted."""
        ns = block.ns
        geometry = Geometry(ns.block_bytes,
                            self._mhash.get(ns.model_uid) or model_hash(ns.model_uid))
        t0 = time.perf_counter()
        view = block.extent.segment.data_view(block.slot, ns.slot_bytes)
        try:
            tier.write(ns.name, block.key, view, block.length, block.checksum, geometry)
        except (OSError, SpillFull) as exc:
            if memory_fault(exc):
                return _Copy.SLOT_FAULT  # the writer's loss, not the tier's fault
            self._write_failed(tier, op, block, exc)
            return False
        finally:
            view.release()
        self.observer.spill_io(tier.name, "write", time.perf_counter() - t0, block.length)
        return True

    def _copy_down_many(self, blocks: Sequence[Block], tier: Tier,
                        op: str) -> list[bool | _Copy]:
        """Worker thread: ``_copy_down`` of each pinned block, as one ``write_many`` per
        namespace; each block's outcome and fault counted as ``_copy_down`` would (a
        batch that fails as a whole is a fault of each of its blocks)."""
        assert isinstance(tier, WritesMany)
        out: list[bool | _Copy] = [False] * len(blocks)
        by_ns: dict[str, list[int]] = {}
        for i, b in enumerate(blocks):
            by_ns.setdefault(b.ns.name, []).append(i)
        for idx in by_ns.values():
            ns = blocks[idx[0]].ns
            geometry = Geometry(ns.block_bytes,
                                self._mhash.get(ns.model_uid) or model_hash(ns.model_uid))
            views = [blocks[i].extent.segment.data_view(blocks[i].slot, ns.slot_bytes)
                     for i in idx]
            t0 = time.perf_counter()
            try:
                try:
                    got: list[bool | BaseException] = tier.write_many(
                        ns.name, [(blocks[i].key, v, blocks[i].length, blocks[i].checksum)
                                  for i, v in zip(idx, views, strict=True)], geometry)
                except OSError as exc:
                    got = [exc] * len(idx)
            finally:
                for v in views:
                    v.release()
            nbytes = 0
            for i, res in zip(idx, got, strict=True):
                if not isinstance(res, BaseException):
                    out[i] = res
                    nbytes += blocks[i].length
                elif memory_fault(res):
                    out[i] = _Copy.SLOT_FAULT  # the writer's loss, not the tier's fault
                elif isinstance(res, (OSError, SpillFull)):
                    self._write_failed(tier, op, blocks[i], res)
                else:
                    raise res
            if nbytes:
                self.observer.spill_io(tier.name, "write", time.perf_counter() - t0, nbytes)
        return out

    def _write_failed(self, tier: Tier, op: str, block: Block,
                      exc: OSError | SpillFull) -> None:
        """Count (and log, throttled) a failed copy of ``block`` into ``tier``."""
        kind = fault_kind(exc) if isinstance(exc, OSError) else "full"
        self._fault(tier.name, kind)
        held = _throttle(f"{tier.name}/write/{kind}")
        if held is not None:
            log.warning("%s tier: %s of %s in %r failed (%s); it stays in DRAM without "
                        "a copy there%s", tier.name, op, block.key.hex(), block.ns.name, exc,
                        more(held),
                        extra=event("spill_fault", tier=tier.name, op="write", kind=kind,
                                    namespace=block.ns.name, held_back=held))

    def _lose(self, block: Block, op: str) -> None:
        """A DRAM block whose slot faulted while ``op`` copied it: its bytes are gone (a
        writer truncated its namespace's data file or punched holes in it).  It leaves
        DRAM as by a delete -- a pinned or leased block is hidden now and freed at its
        last release, and the segment marks it doomed so a restart does not revive it
        -- while copies below DRAM stay (they hold the real bytes).  Counted once per
        block; a block gone meanwhile is left alone.

        (A store method would say it better: ``Store.drop_block(block)``, the
        per-block core of a delete that needs no session.)"""
        ns = block.ns
        if block.doomed or ns.index.get(block.key) != block:
            return
        self.store.delete(self.store.system_session(ns), [block.key])
        self._slot_fault(ns.name, block.key, op)

    def _slot_fault(self, namespace: str, key: bytes, op: str) -> None:
        """Count (and log, throttled) a DRAM slot found faulted by ``op`` (event loop)."""
        self.counters.slot_faults[namespace] += 1
        self.observer.slot_fault(namespace)
        held = _throttle(f"slot/{op}")
        if held is not None:
            then = ("the promotion failed, the copy below DRAM stays" if op == "promotion"
                    else "the block is dropped from DRAM, copies below it stay")
            log.warning("namespace %r: the DRAM slot of block %s faulted during its %s (a "
                        "writer truncated or punched holes in the namespace's data file); "
                        "%s%s", namespace, key.hex(), op, then, more(held),
                        extra=event("slot_fault", namespace=namespace, op=op,
                                    held_back=held))

    # ================================================================ admin: list
    def _known_tiers(self) -> set[int]:
        return {TIER_DRAM, *(t.tier for t in self.lower)}

    async def _keys_below(self, namespace: str, ns: Namespace | None) -> list[bytes]:
        """The keys the local tiers hold for a namespace (off the loop: O(their entries))."""
        if not self._local:
            return []
        geometry = self._geometry_of(ns)
        tiers = self._local

        def collect() -> list[bytes]:
            return list(itertools.chain.from_iterable(
                t.keys_of(namespace, geometry) for t in tiers))

        return await asyncio.to_thread(collect)

    async def blocks_by_tier(self) -> dict[str, dict[str, list[bytes]]]:
        """Namespace -> tier ("dram", "ssd") -> every key it holds (the KV events'
        snapshots): DRAM's as of this call, the SSD tier's copied off the loop."""
        out: dict[str, dict[str, list[bytes]]] = {
            name: {"dram": list(ns.index)} for name, ns in self.store.namespaces.items()}
        if self.ssd is not None:
            for name, key in await asyncio.to_thread(self.ssd.all_keys):
                out.setdefault(name, {}).setdefault("ssd", []).append(key)
        return out

    def watch(self, changed: Callable[[str, str, list[bytes], bool], None] | None) -> None:
        """Tell ``changed(namespace, tier, keys, stored)`` every key that comes into or
        goes out of DRAM or the SSD tier from now on (the KV events)."""
        self.store.watch(changed)
        if self.ssd is not None:
            self.ssd.watch(None if changed is None
                           else lambda ns, key, stored: changed(ns, "ssd", [key], stored))

    async def list_keys(self, namespace: str, page_size: int,
                        after: bytes | None) -> tuple[list[KeyState], bytes | None]:
        """One page of a namespace's blocks in DRAM and the local tiers (SSD), in
        key-byte order.

        ``after``: the last key of the previous page (None: the first page).
        Returns the page and the key to continue after, or None on the last
        page.  Remote tiers (shared) are not enumerated.  A namespace is known
        when a session declared it since the start, DRAM recovered it, or a
        local tier holds blocks of it; otherwise ``NotFound``.  The page is chosen off the
        loop (O(blocks of the namespace)); keys that vanish meanwhile are left out.
        """
        ns = self.store.namespaces.get(namespace)
        dram = list(ns.index) if ns is not None else []
        below = await self._keys_below(namespace, ns)
        if ns is None and not below:
            raise NotFound(f"namespace {namespace!r} is not known to this daemon")
        page = await asyncio.to_thread(_smallest_after, dram, below, after, page_size + 1)
        has_more = len(page) > page_size  # (not ``more``: that is the log helper)
        page = page[:page_size]
        pinned = self.store.pinned(ns) if ns is not None else None
        out = [st for key in page
               if (st := self._key_state(namespace, ns, key, pinned)) is not None]
        return out, (page[-1] if has_more and page else None)

    def _key_state(self, namespace: str, ns: Namespace | None, key: bytes,
                   pinned: Pinned | None) -> KeyState | None:
        if (namespace, key) in self._deleting:
            return None
        moving = self._moving(namespace, key)
        block = ns.index.get(key) if ns is not None else None
        if block is not None:
            leased = pinned is not None and pinned.block(block)
            return KeyState(key, TIER_DRAM, block.length, leased or moving,
                            block.lower == Lower.CLEAN)
        local = self._local_copy(namespace, key, self._geometry_of(ns))
        if local is not None:
            return KeyState(key, local[0].tier, local[1], moving, True)
        return None

    # ================================================================ admin: evict
    async def evict(self, namespace: str, keys: Sequence[bytes] | None,
                    tiers: Collection[int]) -> EvictResult:
        """Drop the copies of ``keys`` (None: every block of the namespace that DRAM or
        a local tier holds) on ``tiers`` (empty: every tier this daemon has).

        A key that is leased (by a client, or pinned by a demotion or a publish)
        or whose promotion/demotion is in flight is skipped and counted.  For
        the others, each tier's copy goes in one loop step per chunk of keys:
        the DRAM block through the store's eviction (the one exit of DRAM
        blocks), a local tier's (SSD) entry from its index (persisted right
        after); then the remote tiers' (shared) copies.  A DRAM block that stays
        but lost its durable copy below becomes DIRTY again, so it is demoted
        before DRAM evicts it.  Evicting the only copy of a block drops it.
        """
        have = self._known_tiers()
        for tier in tiers:
            if tier not in have:
                raise FailedPrecondition(f"this daemon has no {TIER_NAMES[tier]} tier "
                                         f"({_TIER_SETTING[tier]} is not set)")
        want = set(tiers) or have
        ns = self.store.namespaces.get(namespace)
        below: list[bytes] = []
        if keys is None or ns is None:
            below = await self._keys_below(namespace, ns)
            ns = self.store.namespaces.get(namespace)  # (it may have been declared meanwhile)
        if ns is None and not below:
            raise NotFound(f"namespace {namespace!r} is not known to this daemon")
        todo = list(dict.fromkeys(
            keys if keys is not None
            else itertools.chain(ns.index if ns is not None else (), below)))
        evicted = 0
        skipped = 0
        dropped: collections.Counter[str] = collections.Counter()
        for i in range(0, len(todo), EVICT_CHUNK):
            ns = self.store.namespaces.get(namespace)
            e, s = await self._evict_chunk(namespace, ns, todo[i : i + EVICT_CHUNK], want,
                                           dropped)
            evicted += e
            skipped += s
            await asyncio.sleep(0)
        return EvictResult(evicted, skipped, dict(dropped))

    async def _evict_chunk(self, namespace: str, ns: Namespace | None, keys: Sequence[bytes],
                           tiers: set[int], dropped: collections.Counter[str]) -> tuple[int, int]:
        lost: set[bytes] = set()
        skipped = 0
        remote: dict[Tier, list[bytes]] = {t: [] for t in self._remote if t.tier in tiers}
        local = [t for t in self._local if t.tier in tiers]
        below = bool(tiers & {t.tier for t in self.lower})
        hidden: list[tuple[str, bytes]] = []
        freed = False  # local copies removed: their removal is to be persisted
        geometry = self._geometry_of(ns)
        # Blocks clients lease without a call count as leased (their slots would be kept
        # from reuse anyway; the admin is told they were skipped, as for pinned ones).
        pinned = self.store.pinned(ns) if ns is not None else None
        # -- in one loop step: each key's DRAM and local copies, all or nothing per key
        for key in keys:
            block = ns.index.get(key) if ns is not None else None
            if ((block is not None and pinned is not None and pinned.block(block))
                    or self._moving(namespace, key)
                    or (namespace, key) in self._deleting):
                skipped += 1
                continue
            if TIER_DRAM in tiers and block is not None:
                if self.store.evict_block(block):
                    dropped["dram"] += 1
                    lost.add(key)
                    block = None
            for tier in local:
                if self._copy_in(tier, namespace, key, geometry) is not None:
                    tier.remove(namespace, [key])
                    dropped[tier.name] += 1
                    lost.add(key)
                    freed = True
            if (block is not None and block.lower == Lower.CLEAN and below
                    and self._local_copy(namespace, key, geometry) is None):
                self.store.set_lower(block, Lower.DIRTY)  # its copy below may be gone now
            if remote:
                for todo in remote.values():
                    todo.append(key)
                if block is None and self._local_copy(namespace, key, geometry) is None:
                    hidden.append((namespace, key))  # no promotion from there meanwhile
        # -- then the I/O: persist the local removals, remove the remote copies
        if not any(remote.values()) and not freed:
            return len(lost), skipped
        self._hide(hidden)
        try:
            found = await self._drop_lower(namespace, remote, geometry)
        finally:
            self._unhide(hidden)
        for name, there in found.items():
            if there:
                dropped[name] += len(there)
                lost |= there
        return len(lost), skipped

    # ================================================================ admin: drain
    async def drain(self, wait: float) -> DrainProgress:
        """Start a drain, or join the one running; answer after ``wait`` seconds or when
        it is done, with its progress.

        A drain gives every DRAM block without a durable copy below DRAM
        (DIRTY or UNSPILLABLE, and CLEAN ones whose SSD copy the SSD tier has
        since evicted when no shared tier could have taken it) a copy in the
        first tier below DRAM (the SSD tier, or without one the shared tier).  The demoter makes the
        copies, in its ordinary batches; blocks stay in DRAM, CLEAN.  A block
        whose copy fails counts as failed and the drain still finishes; so
        does a copied block the SSD tier evicted again before the drain ended
        (the tier is too small for DRAM).  Blocks committed after the drain
        began are not part of it.
        """
        if not self.enabled:
            raise FailedPrecondition("this daemon has no spill tier to drain DRAM to: set "
                                     "spill.ssd_dir (or spill.shared_dir)")
        d = self._drain
        if d is None or d.finished.is_set():
            d = self._drain = _Drain()
            self._spawn(self._run_drain(d))
        if wait > 0 and not d.finished.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(d.finished.wait(), timeout=wait)
        return d.progress()

    async def _run_drain(self, d: _Drain) -> None:
        try:
            blocks = list(itertools.chain.from_iterable(
                list(ns.index.values()) for ns in list(self.store.namespaces.values())))
            for i in range(0, len(blocks), DRAIN_COLLECT_CHUNK):
                for b in blocks[i : i + DRAIN_COLLECT_CHUNK]:
                    if b.doomed or b.ns.index.get(b.key) != b:
                        continue
                    if b.lower == Lower.CLEAN:
                        if not self._lossy:
                            continue  # copies below are never evicted without a hand-off
                        if self._local_copy(b.ns.name, b.key, self._geometry(b.ns)) is not None:
                            continue
                        self.store.set_lower(b, Lower.DIRTY)  # its copy was evicted
                    d.add(b)
                self._wake.set()
                await asyncio.sleep(0)
            d.collecting = False
            log.info("drain: %d DRAM blocks (%d bytes) need a copy below DRAM",
                     d.total_blocks, d.total_bytes)
            while d.pending:
                progress = self._progress
                self._wake.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(progress.wait(), timeout=DEMOTER_TICK)
            await self._recheck_drain(d)
            log.info("drain done: %d of %d blocks durable below DRAM, %d failed",
                     d.done_blocks, d.total_blocks, d.failed_blocks)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: log it; the blocks not settled count as failed below
            log.exception("drain failed")
        finally:
            # Whatever ended the drain, it ends done with every block settled one way:
            # done_blocks + failed_blocks == total_blocks.
            d.failed_blocks += len(d.pending)
            d.pending.clear()
            d.copied = []
            d.collecting = False
            d.finished.set()

    async def _recheck_drain(self, d: _Drain) -> None:
        """Count as failed the copied blocks whose copy the demotion target (a local tier,
        which evicts) has evicted again meanwhile (and has not passed on below)."""
        if not self.lower or not self.lower[0].local:
            return
        missing = [b for b in d.copied if not b.doomed and b.ns.index.get(b.key) == b
                   and self._local_copy(b.ns.name, b.key, self._geometry(b.ns)) is None]
        if missing and self._remote:
            remote = self._remote

            def anywhere(b: Block) -> bool:
                for t in remote:
                    with contextlib.suppress(OSError):  # cannot tell: not a copy to count on
                        if t.present(b.ns.name, [b.key], self._geometry(b.ns))[0]:
                            return True
                return False

            there = await self._run(lambda: [anywhere(b) for b in missing])
            missing = [b for b, ok in zip(missing, there, strict=True) if not ok]
        for b in missing:
            if b.doomed or b.ns.index.get(b.key) != b:
                continue
            d.done_blocks -= 1
            d.done_bytes -= b.length
            d.failed_blocks += 1
            self.store.set_lower(b, Lower.DIRTY)
        if missing:
            log.warning("drain: the SSD tier evicted %d of the copies it made before the drain "
                        "ended (spill.ssd_capacity is smaller than what DRAM holds)",
                        len(missing))

    def _drain_candidates(self, limit: int) -> list[Block]:
        """Up to ``limit`` blocks of the running drain to copy now; settles the ones that
        need nothing any more (CLEAN, or gone from DRAM)."""
        d = self._drain
        if d is None or d.finished.is_set() or limit <= 0:
            return []
        out: list[Block] = []
        settled: list[Block] = []
        for scanned, b in enumerate(d.pending):
            if scanned >= DRAIN_SCAN_LIMIT or len(out) >= limit:
                break
            if b.doomed or b.ns.index.get(b.key) != b or b.lower == Lower.CLEAN:
                settled.append(b)
            elif not self._moving(b.ns.name, b.key):
                out.append(b)
        for b in settled:
            d.settle(b)
        return out

    # ================================================================ invariants
    def check(self) -> list[str]:
        """Every cross-check, on the calling thread (tests, shutdown)."""
        return self._check_from(self.store.check_snapshot(), list(self.lower))

    async def check_off_loop(self) -> list[str]:
        """``check()`` for the Check RPC without stalling the event loop.

        The store is copied here (``check_snapshot``: lists and slot-table bytes, no
        per-slot work) and cross-checked in a worker thread; the tiers below DRAM
        take their own locks, so their checks run in the worker too.
        """
        return await asyncio.get_running_loop().run_in_executor(
            None, self._check_from, self.store.check_snapshot(), list(self.lower))

    def _check_from(self, snapshot: CheckSnapshot, lower: list[Tier]) -> list[str]:
        problems = self.store.check_from(snapshot)
        for tier in lower:
            problems += tier.check()
        return problems


#: The setting that turns a tier on (for "this daemon has no ... tier" messages).
_TIER_SETTING: Final = {TIER_DRAM: "dram.capacity", TIER_SSD: "spill.ssd_dir",
                        TIER_SHARED: "spill.shared_dir", TIER_CLUSTER: "cluster.master"}


def _smallest_after(dram: list[bytes], below: list[bytes], after: bytes | None,
                    n: int) -> list[bytes]:
    """The ``n`` smallest distinct keys of both lists greater than ``after`` (worker thread)."""
    pool = set(dram)
    pool.update(below)
    if after is None:
        return heapq.nsmallest(n, pool)
    return heapq.nsmallest(n, (k for k in pool if k > after))
