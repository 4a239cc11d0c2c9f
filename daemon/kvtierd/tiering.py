"""Tiering: the policy that moves blocks between DRAM and the spill tiers.

Call graph: service -> ``Tiering`` -> ``Store`` (DRAM index, pins, capacity)
and the spill mechanisms (``spill.ssd``, ``spill.shared``).  Every byte
moves on the ``spill`` thread pool, never on the event loop.

**Demotion** (write-back).  When DRAM's free space falls under
``clean_ahead`` of its capacity, the demoter copies the DIRTY blocks among the
oldest ``clean_ahead`` bytes of the LRU to the SSD tier (or, without one, the
shared tier): straight from the shared-memory slot with O_DIRECT, a batch at
a time, then one ``fdatasync``; only then is each block marked CLEAN, and
only CLEAN blocks are evicted.  The queue is bounded (``queue_depth`` blocks
in flight); a reserve that finds only DIRTY victims waits for the demoter
(back-pressure, up to ``backpressure_timeout``) instead of dropping data or
buffering without bound.  A block whose spill fails (disk full, EIO) becomes
UNSPILLABLE and is evicted as without spill tiers: DRAM keeps serving.

**Promotion.**  ``acquire`` of a key that only a lower tier holds reserves a
DRAM slot for it (system session), reads the block into the slot, verifies
its checksum and commits it CLEAN, then leases it like any DRAM block.
``lookup`` reports each hit's tier and, with ``prefetch``, starts those
promotions in the background.  Concurrent promotions of one key share one read.

**Shared tier writes**: ``shared_write: demotion`` publishes blocks the SSD
tier evicts (or, without an SSD tier, DRAM demotions); ``commit`` also
publishes every committed block at once (write-through, best effort: when
``queue_depth`` publishes are in flight, further ones are skipped and counted).

**Admin calls** (``list_keys``, ``evict``, ``drain``; the service's ListKeys,
Evict, Drain).  Listing and evicting cover DRAM and the SSD tier, whose
indexes this daemon holds; the shared tier is never enumerated (it is a
directory tree many hosts write), so ``list_keys`` does not show it and an
evict of ``all`` removes shared copies only of the keys DRAM or the SSD tier
know.  An evict skips (and counts) keys that are leased or moving -- the
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
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Final, Protocol, TypeVar

from kvtier.errors import CapacityExhausted, Corrupted, FailedPrecondition, NotFound
from kvtierd.logs import Throttle, event, more
from kvtierd.spill.blockio import fault_kind
from kvtierd.spill.format import model_hash
from kvtierd.spill.shared import SharedTier
from kvtierd.spill.ssd import SpillFull, SsdEntry, SsdTier
from kvtierd.store import (
    AcquireResult,
    Block,
    Lease,
    Lower,
    Namespace,
    NeedDemotion,
    ReserveResult,
    ReserveStatus,
    Session,
    Store,
)

log = logging.getLogger(__name__)
#: Spill faults repeat per block while a disk is failing: one line per kind per 10 s.
_throttle = Throttle()

_T = TypeVar("_T")

#: Tier numbers (the wire enum ``kvtier.v1.Tier``).
TIER_DRAM: Final = 1
TIER_SSD: Final = 2
TIER_SHARED: Final = 3
TIER_NAMES: Final = {TIER_DRAM: "dram", TIER_SSD: "ssd", TIER_SHARED: "shared"}
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
#: Entries of a drain's pending list one demoter plan may inspect (bounded work
#: per plan; settled entries leave the list, so the scan rarely gets this far).
DRAIN_SCAN_LIMIT: Final = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class SpillPolicy:
    clean_ahead: float = 0.1
    queue_depth: int = 64
    backpressure_timeout: float = 10.0
    shared_write: str = "demotion"  # or "commit"


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
        if block.doomed or block.ns.index.get(block.key) is not block:
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


class _NoObserver:
    def spill_io(self, tier: str, op: str, seconds: float, nbytes: int) -> None:
        pass

    def spill_fault(self, tier: str, kind: str) -> None:
        pass

    def background_error(self, task: str) -> None:
        pass


def _count_down(counter: collections.Counter[tuple[str, bytes]],
                keys: Iterable[tuple[str, bytes]]) -> None:
    """Take one of each of ``keys`` from ``counter``, dropping the ones that reach 0."""
    for k in keys:
        counter[k] -= 1
        if counter[k] <= 0:
            del counter[k]


class Tiering:
    """DRAM (the store) plus optional SSD and shared tiers, and the movement between them."""

    def __init__(
        self,
        store: Store,
        *,
        ssd: SsdTier | None = None,
        shared: SharedTier | None = None,
        policy: SpillPolicy | None = None,
        io_threads: int = 4,
        observer: TieringObserver | None = None,
    ) -> None:
        self.store = store
        self.ssd = ssd
        self.shared = shared
        self.policy = policy or SpillPolicy()
        self.observer: TieringObserver = observer or _NoObserver()
        self.counters = TieringCounters()
        self.enabled = ssd is not None or shared is not None
        store.spill_enabled = self.enabled
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, io_threads), thread_name_prefix="kvtier-spill")
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._urgent: list[Block] = []  # DIRTY blocks a waiting reserve needs demoted
        self._promoting: dict[tuple[str, bytes], asyncio.Future[bool]] = {}
        self._demoting: dict[tuple[str, bytes], Block] = {}
        self._publishing = 0
        self._forgotten = False  # SSD entries removed by the demoter, not flushed yet
        # Keys a Delete or Evict is removing from the lower tiers (a count per key:
        # both may be at it at once): lookups and promotions do not see them meanwhile.
        self._deleting: collections.Counter[tuple[str, bytes]] = collections.Counter()
        # Keys being written to the shared tier: by a write-through publish (event loop) or
        # an SSD eviction's hand-off (an I/O thread; under the lock, with _deleting's
        # updates, so a hand-off either sees a Delete's hide or is seen by that Delete).
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
        if ssd is not None:
            ssd.on_fault = lambda kind: self._fault("ssd", kind)
        if ssd is not None and shared is not None and self.policy.shared_write in (
                "demotion", "commit"):
            ssd.on_evict = self._publish_evicted

    # ================================================================ lifecycle
    async def start(self) -> None:
        """Open the spill tiers (re-adopting the SSD's files) and start the demoter."""
        loop = self._loop = asyncio.get_running_loop()
        if self.ssd is not None:
            await loop.run_in_executor(self._pool, self.ssd.open)
            self._mark_clean_from_ssd()
            if self.shared is None:  # with a shared tier, evictions publish there instead

                def evicted(namespace: str, key: bytes) -> None:  # on an I/O thread
                    loop.call_soon_threadsafe(self._ssd_evicted, namespace, key)

                self.ssd.on_evicted = evicted
        if self.shared is not None:
            await loop.run_in_executor(self._pool, self.shared.open)
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
        if self.ssd is not None:
            await asyncio.to_thread(self._close_ssd, self.ssd)

    @staticmethod
    def _close_ssd(ssd: SsdTier) -> None:
        try:
            ssd.flush_frees()
        except OSError as exc:
            log.warning("SSD tier: could not persist freed slots at stop: %s", exc)
        ssd.close()

    def _ssd_evicted(self, namespace: str, key: bytes) -> None:
        """The SSD tier evicted its copy of (namespace, key) to make room (its LRU, or the
        namespace's SSD quota).  A DRAM block that counted on it (CLEAN) now has no copy
        below: it becomes UNSPILLABLE, evictable like a block without spill tiers, and is
        not demoted again -- re-spilling it would evict another copy in turn, for ever,
        whenever the SSD (or the quota) is smaller than what DRAM wants to keep clean."""
        ns = self.store.namespaces.get(namespace)
        block = ns.index.get(key) if ns is not None else None
        if block is not None and block.lower == Lower.CLEAN:
            self.store.set_lower(block, Lower.UNSPILLABLE)

    def _mark_clean_from_ssd(self) -> None:
        """After a restart, DRAM blocks that also have an SSD copy are CLEAN."""
        assert self.ssd is not None
        for ns in self.store.namespaces.values():
            mh = self._model_hash(ns)
            for block in ns.index.values():
                e = self.ssd.find(ns.name, block.key, ns.block_bytes, mh)
                if e is not None and e.length == block.length:
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
        mh = self._model_hash(ns)
        i = 0
        while i < len(keys):
            key = keys[i]
            if (ns.name, key) in self._deleting:
                break
            if key in ns.index:
                tiers.append(TIER_DRAM)
            elif self._on_ssd(ns, key, mh):
                tiers.append(TIER_SSD)
            elif self.shared is not None:
                # The run of keys only the shared tier can hold: one stat each, off the loop.
                j = i + 1
                while j < len(keys) and keys[j] not in ns.index and not self._on_ssd(
                        ns, keys[j], mh) and (ns.name, keys[j]) not in self._deleting:
                    j += 1
                run = await self._run(self.shared.count_prefix, ns.name, list(keys[i:j]))
                tiers.extend([TIER_SHARED] * run)
                if run < j - i:
                    break
                i = j
                continue
            else:
                break
            i += 1
        return tiers

    def _on_ssd(self, ns: Namespace, key: bytes, mh: int) -> bool:
        if self.ssd is None:
            return False
        demoting = self._demoting.get((ns.name, key))
        if demoting is not None and demoting.doomed:
            return False  # deleted while its demotion was in flight
        return self.ssd.find(ns.name, key, ns.block_bytes, mh) is not None

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
        tiers: list[int] = [TIER_DRAM] * sum(1 for _ in _prefix(ns, keys))
        if self.enabled and len(tiers) < len(keys):
            tiers = await self._locate(ns, keys)
            if any(t != TIER_DRAM for t in tiers):
                # Pin this prefix's DRAM hits meanwhile: the promotions' reserve would
                # otherwise evict them (the oldest in the LRU) and cut the prefix short.
                hits = [b for k in keys[: len(tiers)] if (b := ns.index.get(k)) is not None]
                leases = self.store.pin_blocks(hits)
                try:
                    with contextlib.suppress(CapacityExhausted):
                        await self._promote(ns, list(keys[: len(tiers)]), tiers, prefetch=False)
                finally:
                    for lease in leases:
                        self.store.unpin(lease)
        for block in _prefix(ns, keys[: len(tiers)]):
            if block.prefetched:
                block.prefetched = False
                self.counters.prefetch_hits += 1
        result = self.store.acquire(session, keys[: len(tiers)])
        ns.misses += len(keys) - len(tiers)  # store.acquire counted the rest
        return result, tiers[: len(result.slots)]

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
        mh = self._model_hash(ns)
        try:
            outcomes = await asyncio.gather(*(
                self._run(self._read_block, ns.name, key, tier, view, ns.block_bytes, mh)
                for (key, tier), view in zip(wanted, views, strict=True)))
        finally:
            for v in views:
                v.release()
        # Keep the prefix: after the first failure, nothing is committed.
        settled: list[tuple[int, int] | None] = []
        failed = False
        for out in outcomes:
            failed = failed or out is None
            settled.append(None if failed else out)
        blocks = self.store.settle(system, res.reservation_id, settled)
        for (_key, tier), block in zip(wanted, blocks, strict=True):
            if block is None:
                continue
            self.store.set_lower(block, Lower.CLEAN)
            block.prefetched = prefetch
            self.counters.promotions[TIER_NAMES[tier]] += 1

    def _read_block(self, namespace: str, key: bytes, tier: int, dst: memoryview,
                    block_bytes: int, mh: int) -> tuple[int, int] | None:
        """Worker thread: read one block into a DRAM slot; (length, checksum) or None."""
        t0 = time.perf_counter()
        name = TIER_NAMES[tier]
        try:
            if tier == TIER_SSD:
                assert self.ssd is not None
                entry = self.ssd.find(namespace, key, block_bytes, mh)
                if entry is None:
                    raise KeyError(key)
                self.ssd.read_into(entry, dst)
                length, checksum = entry.length, entry.checksum
            else:
                assert self.shared is not None
                length, checksum = self.shared.read_into(namespace, key, dst, block_bytes, mh)
        except KeyError:
            return None  # evicted or deleted meanwhile: a miss
        except (Corrupted, OSError) as exc:
            self._fault(name, fault_kind(exc))
            return None
        self.observer.spill_io(name, "read", time.perf_counter() - t0, length)
        return length, checksum

    # ================================================================ reserve / commit
    async def reserve(self, session: Session, keys: Sequence[bytes]) -> ReserveResult:
        """Reserve DRAM slots; keys a lower tier holds are EXISTS.  Waits for demotion
        when only DIRTY blocks could make room."""
        exists = None
        if self.ssd is not None:
            ns, mh = session.ns, self._model_hash(session.ns)

            def exists(key: bytes) -> bool:
                return self._on_ssd(ns, key, mh)

        return await self._reserve_with_backpressure(session, keys, exists)

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
            self._committed([index[k] for k in keys if k in index])
        return n

    def _committed(self, blocks: Sequence[Block]) -> None:
        if self.shared is not None and self.policy.shared_write == "commit" and blocks:
            room = self.policy.queue_depth - self._publishing
            if room < len(blocks):
                self.counters.skipped_publishes += len(blocks) - max(room, 0)
                blocks = blocks[: max(room, 0)]
            if blocks:
                self._publishing_keys.update((b.ns.name, b.key) for b in blocks)
                self._spawn(self._publish(list(blocks)))
        self._wake.set()

    async def _publish(self, blocks: list[Block]) -> None:
        assert self.shared is not None
        leases = self.store.pin_blocks(blocks)
        self._publishing += len(blocks)
        try:
            results = await asyncio.gather(*(self._run(self._publish_one, b) for b in blocks))
            for block, ok in zip(blocks, results, strict=True):
                if ok and self.ssd is None:
                    self.store.set_lower(block, Lower.CLEAN)
        finally:
            self._publishing -= len(blocks)
            _count_down(self._publishing_keys, [(b.ns.name, b.key) for b in blocks])
            for lease in leases:
                self.store.unpin(lease)
            self._signal_progress()

    def _publish_one(self, block: Block) -> bool:
        assert self.shared is not None
        ns = block.ns
        view = block.extent.segment.data_view(block.slot, block.length)
        t0 = time.perf_counter()
        try:
            self.shared.publish(ns.name, block.key, view, block.checksum, ns.block_bytes,
                                self._mhash.get(ns.model_uid) or model_hash(ns.model_uid))
        except OSError as exc:
            self._fault("shared", fault_kind(exc))
            return False
        finally:
            view.release()
        self.observer.spill_io("shared", "write", time.perf_counter() - t0, block.length)
        return True

    def _publish_evicted(self, entry: Any, data: memoryview) -> None:
        """SSD eviction hook (worker thread): pass the block on to the shared tier.

        A key a Delete is removing is not handed on; a Delete that starts meanwhile waits
        for the hand-off (``_moving``) and then removes what it wrote.
        """
        assert self.shared is not None
        k = (entry.namespace, entry.key)
        with self._handoff_lock:
            if k in self._deleting:
                return
            self._handing[k] += 1
        t0 = time.perf_counter()
        try:
            published = self.shared.publish(entry.namespace, entry.key, data, entry.checksum,
                                            entry.block_bytes, entry.model_hash)
        except OSError as exc:
            self._fault("shared", fault_kind(exc))
            raise
        finally:
            with self._handoff_lock:
                _count_down(self._handing, [k])
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    self._loop.call_soon_threadsafe(self._signal_progress)
        if published:
            self.counters.demotions["ssd->shared"] += 1
            self.observer.spill_io("shared", "write", time.perf_counter() - t0, entry.length)

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
        present = set(k for k in keys if k in ns.index)
        self.store.delete(session, keys)
        if self.ssd is not None:
            present |= {k for k in keys if self._ssd_entry(ns.name, ns, k) is not None}
            self.ssd.remove(ns.name, keys)
        present |= await self._drop_lower(ns.name, keys, shared=True)
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

    async def _drop_lower(self, namespace: str, keys: Sequence[bytes], *, shared: bool) -> set[bytes]:
        """The I/O half of removing keys below DRAM (Delete and Evict): persist the SSD
        entries ``ssd.remove`` freed, then remove the shared tier's files of ``keys``
        when ``shared``.  Returns the keys that had a shared file."""
        if self.ssd is not None:
            with contextlib.suppress(OSError):  # not persisted: the next flush retries
                await self._run(self.ssd.flush_frees)
        present: set[bytes] = set()
        if shared and self.shared is not None and keys:
            tier = self.shared
            try:
                present = set(await self._run(_present_shared, tier, namespace, list(keys)))
                await self._run(tier.delete, namespace, list(keys))
            except OSError as exc:
                self._fault("shared", fault_kind(exc))
        return present

    def _ssd_entry(self, namespace: str, ns: Namespace | None, key: bytes) -> SsdEntry | None:
        """The SSD copy of a key that reads would use (``ns`` None: a namespace nobody
        declared since the start, whose SSD entries are taken as they are)."""
        if self.ssd is None:
            return None
        demoting = self._demoting.get((namespace, key))
        if demoting is not None and demoting.doomed:
            return None  # deleted while its demotion was in flight
        if ns is None:
            return self.ssd.index.get((namespace, key))
        return self.ssd.find(namespace, key, ns.block_bytes, self._model_hash(ns))

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
        seen: set[int] = set()

        def add(blocks: list[Block]) -> None:
            size = sum(b.ns.slot_bytes for b in batch)
            for b in blocks:
                if len(batch) >= depth or size >= BATCH_BYTES:
                    return
                if id(b) not in seen:
                    seen.add(id(b))
                    batch.append(b)
                    size += b.ns.slot_bytes

        urgent, self._urgent = self._urgent, []
        add([b for b in urgent if b.pins == 0 and b.lower == Lower.DIRTY and not b.doomed
             and b.ns.index.get(b.key) is b])
        acct = self.store.dram_bytes()
        target = int(self.policy.clean_ahead * acct["total"])
        free = acct["free"]
        if free < target:
            add(self.store.demotion_candidates(target - free, depth))
        add(self._drain_candidates(depth - len(batch)))
        return batch

    async def _demote(self, batch: list[Block]) -> None:
        leases: list[Lease] = self.store.pin_blocks(batch)
        for b in batch:
            self._demoting[(b.ns.name, b.key)] = b
        try:
            results = await asyncio.gather(*(self._run(self._write_block, b) for b in batch))
            synced = await self._sync()
            for block, ok in zip(batch, results, strict=True):
                target = "ssd" if self.ssd is not None else "shared"
                if ok and synced:
                    if block.doomed or block.ns.index.get(block.key) is not block:
                        self._forget(block)  # deleted meanwhile: never resurrect it
                        continue
                    self.store.set_lower(block, Lower.CLEAN)
                    self.counters.demotions[f"dram->{target}"] += 1
                else:
                    if ok:
                        self._forget(block)
                    self.store.set_lower(block, Lower.UNSPILLABLE)
                    self.counters.spill_failures[target] += 1
            if self._forgotten and self.ssd is not None:
                self._forgotten = False
                try:
                    await self._run(self.ssd.flush_frees)
                except OSError as exc:
                    self._fault("ssd", fault_kind(exc))
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
        """Undo a block's SSD copy (its FREE entry reaches the disk at the next flush)."""
        if self.ssd is not None:
            self.ssd.remove(block.ns.name, [block.key])
            self._forgotten = True

    async def _sync(self) -> bool:
        if self.ssd is None:
            return True
        t0 = time.perf_counter()
        try:
            await self._run(self.ssd.sync)
        except OSError as exc:
            kind = fault_kind(exc)
            self._fault("ssd", kind)
            held = _throttle(f"ssd/sync/{kind}")
            if held is not None:
                log.warning("SSD tier: fdatasync failed (%s); the batch is not durable%s", exc,
                            more(held), extra=event("spill_fault", tier="ssd", op="sync",
                                                    kind=kind, held_back=held))
            return False
        self.observer.spill_io("ssd", "sync", time.perf_counter() - t0, 0)
        return True

    def _write_block(self, block: Block) -> bool:
        """Worker thread: copy one pinned DRAM block to the SSD (or shared) tier."""
        ns = block.ns
        mh = self._mhash.get(ns.model_uid) or model_hash(ns.model_uid)
        t0 = time.perf_counter()
        if self.ssd is None:
            return self._publish_one(block)
        view = block.extent.segment.data_view(block.slot, ns.slot_bytes)
        try:
            self.ssd.write(ns.name, block.key, view, block.length, block.checksum,
                           ns.block_bytes, mh)
        except (OSError, SpillFull) as exc:
            kind = fault_kind(exc) if isinstance(exc, OSError) else "full"
            self._fault("ssd", kind)
            held = _throttle(f"ssd/write/{kind}")
            if held is not None:
                log.warning("SSD tier: demotion of %s in %r failed (%s); it stays in DRAM "
                            "without a spill copy%s", block.key.hex(), ns.name, exc, more(held),
                            extra=event("spill_fault", tier="ssd", op="write", kind=kind,
                                        namespace=ns.name, held_back=held))
            return False
        finally:
            view.release()
        self.observer.spill_io("ssd", "write", time.perf_counter() - t0, block.length)
        return True

    # ================================================================ admin: list
    def _known_tiers(self) -> set[int]:
        tiers = {TIER_DRAM}
        if self.ssd is not None:
            tiers.add(TIER_SSD)
        if self.shared is not None:
            tiers.add(TIER_SHARED)
        return tiers

    async def _keys_below(self, namespace: str, ns: Namespace | None) -> list[bytes]:
        """The keys the SSD tier holds for a namespace (off the loop: O(SSD entries))."""
        if self.ssd is None:
            return []
        geometry = (ns.block_bytes, self._model_hash(ns)) if ns is not None else None
        return await asyncio.to_thread(self.ssd.keys_of, namespace, geometry)

    async def list_keys(self, namespace: str, page_size: int,
                        after: bytes | None) -> tuple[list[KeyState], bytes | None]:
        """One page of a namespace's blocks in DRAM and on the SSD tier, in key-byte order.

        ``after``: the last key of the previous page (None: the first page).
        Returns the page and the key to continue after, or None on the last
        page.  The shared tier is not enumerated.  A namespace is known when a
        session declared it since the start, DRAM recovered it, or the SSD tier
        holds blocks of it; otherwise ``NotFound``.  The page is chosen off the
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
        out = [st for key in page if (st := self._key_state(namespace, ns, key)) is not None]
        return out, (page[-1] if has_more and page else None)

    def _key_state(self, namespace: str, ns: Namespace | None, key: bytes) -> KeyState | None:
        if (namespace, key) in self._deleting:
            return None
        moving = self._moving(namespace, key)
        block = ns.index.get(key) if ns is not None else None
        if block is not None:
            return KeyState(key, TIER_DRAM, block.length, block.pins > 0 or moving,
                            block.lower == Lower.CLEAN)
        entry = self._ssd_entry(namespace, ns, key)
        if entry is not None:
            return KeyState(key, TIER_SSD, entry.length, moving, True)
        return None

    # ================================================================ admin: evict
    async def evict(self, namespace: str, keys: Sequence[bytes] | None,
                    tiers: Collection[int]) -> EvictResult:
        """Drop the copies of ``keys`` (None: every block of the namespace that DRAM or
        the SSD tier holds) on ``tiers`` (empty: every tier this daemon has).

        A key that is leased (by a client, or pinned by a demotion or a publish)
        or whose promotion/demotion is in flight is skipped and counted.  For
        the others, each tier's copy goes in one loop step per chunk of keys:
        the DRAM block through the store's eviction (the one exit of DRAM
        blocks), the SSD entry from the SSD index (its FREE entry persisted
        right after); then the shared tier's files.  A DRAM block that stays
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
        to_shared: list[bytes] = []
        hidden: list[tuple[str, bytes]] = []
        freed = False  # SSD entries removed: their FREE entries are to be persisted
        # -- in one loop step: each key's DRAM and SSD copies, all or nothing per key
        for key in keys:
            block = ns.index.get(key) if ns is not None else None
            if ((block is not None and block.pins) or self._moving(namespace, key)
                    or (namespace, key) in self._deleting):
                skipped += 1
                continue
            if TIER_DRAM in tiers and block is not None:
                if self.store.evict_block(block):
                    dropped["dram"] += 1
                    lost.add(key)
                    block = None
            if TIER_SSD in tiers and self._ssd_entry(namespace, ns, key) is not None:
                assert self.ssd is not None
                self.ssd.remove(namespace, [key])
                dropped["ssd"] += 1
                lost.add(key)
                freed = True
            if (block is not None and block.lower == Lower.CLEAN
                    and tiers & {TIER_SSD, TIER_SHARED}
                    and self._ssd_entry(namespace, ns, key) is None):
                self.store.set_lower(block, Lower.DIRTY)  # its copy below may be gone now
            if TIER_SHARED in tiers and self.shared is not None:
                to_shared.append(key)
                if block is None and self._ssd_entry(namespace, ns, key) is None:
                    hidden.append((namespace, key))  # no promotion from there meanwhile
        # -- then the I/O: persist the SSD frees, remove the shared files
        if not to_shared and not freed:
            return len(lost), skipped
        self._hide(hidden)
        try:
            on_shared = await self._drop_lower(namespace, to_shared, shared=True)
        finally:
            self._unhide(hidden)
        if on_shared:
            dropped["shared"] += len(on_shared)
            lost |= on_shared
        return len(lost), skipped

    # ================================================================ admin: drain
    async def drain(self, wait: float) -> DrainProgress:
        """Start a drain, or join the one running; answer after ``wait`` seconds or when
        it is done, with its progress.

        A drain gives every DRAM block without a durable copy below DRAM
        (DIRTY or UNSPILLABLE, and CLEAN ones whose SSD copy the SSD tier has
        since evicted when no shared tier could have taken it) a copy on the
        SSD tier (or, without one, the shared tier).  The demoter makes the
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
            mh: dict[str, int] = {}
            for i in range(0, len(blocks), DRAIN_COLLECT_CHUNK):
                for b in blocks[i : i + DRAIN_COLLECT_CHUNK]:
                    if b.doomed or b.ns.index.get(b.key) is not b:
                        continue
                    if b.lower == Lower.CLEAN:
                        if self.ssd is None or self.shared is not None:
                            continue
                        h = mh.get(b.ns.name)
                        if h is None:
                            h = mh[b.ns.name] = self._model_hash(b.ns)
                        if self._on_ssd(b.ns, b.key, h):
                            continue
                        self.store.set_lower(b, Lower.DIRTY)  # its SSD copy was evicted
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
        """Count as failed the copied blocks whose SSD copy the SSD tier has evicted
        again meanwhile (and has not passed on to the shared tier)."""
        if self.ssd is None:
            return
        missing = [b for b in d.copied if not b.doomed and b.ns.index.get(b.key) is b
                   and self._ssd_entry(b.ns.name, b.ns, b.key) is None]
        if missing and self.shared is not None:
            shared = self.shared
            there = await self._run(lambda: [shared.exists(b.ns.name, b.key) for b in missing])
            missing = [b for b, ok in zip(missing, there, strict=True) if not ok]
        for b in missing:
            if b.doomed or b.ns.index.get(b.key) is not b:
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
            if b.doomed or b.ns.index.get(b.key) is not b or b.lower == Lower.CLEAN:
                settled.append(b)
            elif not self._moving(b.ns.name, b.key):
                out.append(b)
        for b in settled:
            d.settle(b)
        return out

    # ================================================================ invariants
    def check(self) -> list[str]:
        problems = self.store.check()
        if self.ssd is not None:
            problems += self.ssd.check()
        return problems


def _prefix(ns: Namespace, keys: Sequence[bytes]) -> list[Block]:
    out = []
    for key in keys:
        block = ns.index.get(key)
        if block is None:
            break
        out.append(block)
    return out


def _present_shared(shared: SharedTier, namespace: str, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if shared.exists(namespace, k)]


#: The setting that turns a tier on (for "this daemon has no ... tier" messages).
_TIER_SETTING: Final = {TIER_DRAM: "dram.capacity", TIER_SSD: "spill.ssd_dir",
                        TIER_SHARED: "spill.shared_dir"}


def _smallest_after(dram: list[bytes], below: list[bytes], after: bytes | None,
                    n: int) -> list[bytes]:
    """The ``n`` smallest distinct keys of both lists greater than ``after`` (worker thread)."""
    pool = set(dram)
    pool.update(below)
    if after is None:
        return heapq.nsmallest(n, pool)
    return heapq.nsmallest(n, (k for k in pool if k > after))
