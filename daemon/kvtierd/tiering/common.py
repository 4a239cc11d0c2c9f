"""What the parts of the tiering layer share: the policy, the counters and the
observer, how a copy can end, the test that a batch's blocks are still live, the
reports of faults, and the worker pool every byte moves on."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import enum
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kvtierd.block_table import RECORD_DTYPE
from kvtierd.config import ClusterConfig, SpillConfig
from kvtierd.logs import Throttle, event, more
from kvtierd.spill.blockio import fault_kind
from kvtierd.spill.ssd import SpillFull
from kvtierd.spill.tier import LowerTier
from kvtierd.store import BlockBatch
from kvtierd.store.types import COMMITTED_STATE

#: One logger for the whole package: its name is what operators filter on.
log = logging.getLogger("kvtierd.tiering")

_T = TypeVar("_T")

#: How often the demoter, and a drain, re-check when nothing woke them.
TICK: Final = 0.25


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


class TieringObserver(Protocol):
    """Metrics hooks (``kvtierd.metrics.Metrics`` implements them)."""

    def spill_io(self, tier: str, op: str, seconds: float, nbytes: int) -> None: ...

    def spill_fault(self, tier: str, kind: str) -> None: ...

    def background_error(self, task: str) -> None: ...

    def slot_fault(self, namespace: str) -> None:
        """A DRAM slot of ``namespace`` found faulted (a client cut its data file)."""


class NoObserver:
    def spill_io(self, tier: str, op: str, seconds: float, nbytes: int) -> None:
        pass

    def spill_fault(self, tier: str, kind: str) -> None:
        pass

    def background_error(self, task: str) -> None:
        pass

    def slot_fault(self, namespace: str) -> None:
        pass


class Copy(enum.Enum):
    """A copy's outcome besides done/failed: the DRAM slot's memory faulted."""

    SLOT_FAULT = "slot_fault"


def outcomes(results: Sequence[bool | Copy]) -> tuple[npt.NDArray[np.bool_],
                                                       npt.NDArray[np.bool_]]:
    """A batch's copy outcomes as two masks: the slots that faulted, the copies made."""
    n = len(results)
    fault = np.fromiter((r is Copy.SLOT_FAULT for r in results), dtype=bool, count=n)
    made = np.fromiter((r is not Copy.SLOT_FAULT and bool(r) for r in results), dtype=bool,
                       count=n)
    return fault, made


def live_many(blocks: BlockBatch) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.void]]:
    """Whether each block of a batch is still the visible DRAM block of its key (its
    extent held, its slot COMMITTED at its generation, and the index naming that slot
    for its key), and its slot's record (``RECORD_DTYPE``: pins, lower state; zeros for
    a block whose extent left), in one table read and one index search: no handle made,
    no call per block."""
    n = len(blocks)
    if not n:
        return np.zeros(0, dtype=bool), np.zeros(0, dtype=RECORD_DTYPE)
    ns = blocks.ns
    held = blocks.held()
    if held is None:
        rows = ns.table.inspect(blocks.refs)
        ok = ((rows["state"] == COMMITTED_STATE) & (rows["generation"] == blocks.gens)
              & (ns.index.find(blocks.keys) == blocks.refs))
        return ok, rows
    ok = np.zeros(n, dtype=bool)
    rows = np.zeros(n, dtype=RECORD_DTYPE)
    here = blocks.take(held)
    if len(here):
        ok[held], rows[held] = live_many(here)
    return ok, rows


class Reporter:
    """The counters, the observer and the throttled log lines of what went wrong."""

    def __init__(self, counters: TieringCounters, observer: TieringObserver) -> None:
        self.counters = counters
        self.observer = observer
        #: Spill faults repeat per block while a disk is failing: one line per kind per 10 s.
        self.throttle = Throttle()

    def fault(self, tier: str, kind: str, n: int = 1) -> None:
        """A fault a tier below DRAM absorbed or raised (any thread)."""
        self.counters.faults[f"{tier}/{kind}"] += n
        for _ in range(n):
            self.observer.spill_fault(tier, kind)

    def write_failed(self, tier: LowerTier, op: str, namespace: str, key: bytes,
                     exc: OSError | SpillFull) -> None:
        """Count (and log, throttled) a failed copy of a block into ``tier``."""
        kind = fault_kind(exc) if isinstance(exc, OSError) else "full"
        self.fault(tier.name, kind)
        held = self.throttle(f"{tier.name}/write/{kind}")
        if held is not None:
            log.warning("%s tier: %s of %s in %r failed (%s); it stays in DRAM without "
                        "a copy there%s", tier.name, op, key.hex(), namespace, exc,
                        more(held),
                        extra=event("spill_fault", tier=tier.name, op="write", kind=kind,
                                    namespace=namespace, held_back=held))

    def sync_failed(self, tier: LowerTier, exc: OSError) -> None:
        """Count (and log, throttled) a failed ``fdatasync`` of a demotion batch."""
        kind = fault_kind(exc)
        self.fault(tier.name, kind)
        held = self.throttle(f"{tier.name}/sync/{kind}")
        if held is not None:
            log.warning("%s tier: fdatasync failed (%s); the batch is not durable%s",
                        tier.name, exc, more(held),
                        extra=event("spill_fault", tier=tier.name, op="sync",
                                    kind=kind, held_back=held))

    def slot_fault(self, namespace: str, key: bytes, op: str) -> None:
        """Count (and log, throttled) a DRAM slot found faulted by ``op`` (event loop)."""
        self.counters.slot_faults[namespace] += 1
        self.observer.slot_fault(namespace)
        held = self.throttle(f"slot/{op}")
        if held is not None:
            then = ("the promotion failed, the copy below DRAM stays" if op == "promotion"
                    else "the block is dropped from DRAM, copies below it stay")
            log.warning("namespace %r: the DRAM slot of block %s faulted during its %s (a "
                        "writer truncated or punched holes in the namespace's data file); "
                        "%s%s", namespace, key.hex(), op, then, more(held),
                        extra=event("slot_fault", namespace=namespace, op=op,
                                    held_back=held))

    def background_error(self, task: str) -> None:
        """An unexpected exception in background work: logged (throttled) and counted."""
        self.observer.background_error(task)
        held = self.throttle(f"background-{task}")
        if held is not None:
            log.exception("%s failed; it keeps running%s", task, more(held))


class Background:
    """The ``spill`` worker threads (every byte moves there, never on the loop) and
    the background tasks of the tiering layer."""

    def __init__(self, io_threads: int) -> None:
        #: How many worker threads (a batch split for them runs in this many parts).
        self.threads = max(1, io_threads)
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.threads, thread_name_prefix="kvtier-spill")
        self.tasks: set[asyncio.Task[Any]] = set()

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a task that ``stop`` cancels."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def stop(self) -> None:
        """Cancel the tasks, then wait for the worker threads' I/O to finish."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.to_thread(self.pool.shutdown, wait=True)
