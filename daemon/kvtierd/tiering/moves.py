"""The movement table: every key of the tiering layer in motion, under one lock.

A key is *moving* while a promotion brings it into DRAM, a demotion copies its
DRAM block below, a write-through publish copies it to a cross-host tier, or a
tier's eviction hands its copy to the next tier (an I/O thread).  It is
*hidden* while a Delete or an Evict removes it below DRAM: lookups and
promotions miss it, and no publish or hand-off of it starts.  A Delete waits
until none of its keys is moving; an Evict and a drain leave moving keys
alone.

Demotions and publishes also pin their DRAM blocks for the move: the pin is
granted when the move is recorded here and released when it ends, by the
same pair of calls (``demoting``/``publishing``), so a move never holds a
block the table does not list, nor the reverse.

One ``threading.Lock`` guards every container: hand-offs run on I/O threads,
everything else on the event loop.  The lock is never held across an await
or a call into a tier or the store (a tier may call ``handing`` with its own
lock held).  Each end of a move signals ``progress`` (``wait``), which the
waiters above -- Delete, a reserve waiting for demotion, a drain -- poll.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from kvtierd.store import BlockBatch, Lease, Store

#: A key as the table knows it: (namespace, key).
Key = tuple[str, bytes]


class MovementTable:
    """What is promoting, demoting, publishing, being handed on or hidden, and the
    pins the demotions and publishes hold."""

    def __init__(self, store: Store) -> None:
        """``store``: whose ``pin_blocks``/``unpin`` pin the blocks of a move."""
        self._store = store
        self._lock = threading.Lock()
        self._promoting: dict[Key, asyncio.Future[bool]] = {}
        #: Each key being demoted -> its batch and its place there.
        self._demoting: dict[Key, tuple[BlockBatch, int]] = {}
        self._publishing: collections.Counter[Key] = collections.Counter()
        self._publishing_blocks = 0  # blocks whose publish has started (pinned)
        self._handing: collections.Counter[Key] = collections.Counter()
        # A count per key: a Delete and an Evict may hide one key at once.
        self._hidden: collections.Counter[Key] = collections.Counter()
        self._hidden_n = 0  # the sum of its counts: an unhide of all of them clears it
        self._progress = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that I/O threads signal progress to."""
        self._loop = loop

    # ---------------------------------------------------------------- questions
    def moving(self, namespace: str, key: bytes) -> bool:
        """A promotion, demotion, publish or hand-off of this key is in flight."""
        with self._lock:
            return self._moving((namespace, key))

    def any_moving(self, namespace: str, keys: Iterable[bytes]) -> bool:
        with self._lock:
            return self._any_moving((namespace, key) for key in keys)

    def moving_many(self, namespace: str, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        """``moving`` of each key, under one take of the lock."""
        with self._lock:
            return np.fromiter((self._moving((namespace, key)) for key in keys), dtype=bool,
                               count=len(keys))

    def _moving(self, k: Key) -> bool:
        return (k in self._promoting or k in self._demoting or k in self._publishing
                or k in self._handing)

    def _any_moving(self, keys: Iterable[Key]) -> bool:
        """Whether any of ``keys`` is moving (under the lock): no step per key while
        nothing moves at all."""
        if not (self._promoting or self._demoting or self._publishing or self._handing):
            return False
        return any(map(self._moving, keys))

    def hidden(self, namespace: str, key: bytes) -> bool:
        """A Delete or an Evict is removing this key below DRAM."""
        with self._lock:
            return (namespace, key) in self._hidden

    def first_hidden(self, namespace: str, keys: Sequence[bytes], start: int) -> int:
        """The index of the first hidden key of ``keys[start:]``, ``len(keys)`` for none."""
        with self._lock:
            if self._hidden:
                hidden = self._hidden
                return next((i for i in range(start, len(keys))
                             if (namespace, keys[i]) in hidden), len(keys))
        return len(keys)

    def deleted_while_demoting(self, namespace: str, keys: Sequence[bytes]) -> list[int]:
        """The indexes of ``keys`` whose demotion is in flight although the block was
        deleted meanwhile: the copy it is writing below will not be served."""
        with self._lock:
            if not self._demoting:
                return []
            found = [(i, at) for i, key in enumerate(keys)
                     if (at := self._demoting.get((namespace, key))) is not None]
        if not found:
            return []
        # (reads the block table: outside the lock; one read per batch found)
        by_batch: dict[int, tuple[BlockBatch, list[int], list[int]]] = {}
        for i, (batch, j) in found:
            entry = by_batch.setdefault(id(batch), (batch, [], []))
            entry[1].append(i)
            entry[2].append(j)
        out: list[int] = []
        for batch, mine, places in by_batch.values():
            doomed = batch.doomed(np.array(places, dtype=np.intp))
            out += [i for i, d in zip(mine, doomed.tolist(), strict=True) if d]
        return sorted(out)

    def demoting_keys(self) -> list[Key]:
        with self._lock:
            return list(self._demoting)

    def in_flight(self) -> int:
        """Blocks being demoted or published now (the spill queue's depth)."""
        with self._lock:
            return len(self._demoting) + self._publishing_blocks

    def publishing(self) -> int:
        """Blocks whose publish has started and not ended."""
        with self._lock:
            return self._publishing_blocks

    # ---------------------------------------------------------------- progress
    async def wait(self, timeout: float) -> None:
        """Until a move ends, or ``timeout`` seconds."""
        progress = self._progress
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(progress.wait(), timeout=timeout)

    def signal(self) -> None:
        """A move ended (event loop)."""
        self._progress.set()
        self._progress = asyncio.Event()

    def _signal_threadsafe(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                self._loop.call_soon_threadsafe(self.signal)

    # ---------------------------------------------------------------- hiding
    def hide(self, keys: Sequence[Key]) -> None:
        """Hide ``keys`` (each once more) until ``unhide`` of the same keys."""
        with self._lock:
            self._hidden.update(keys)
            self._hidden_n += len(keys)

    def hide_checked(self, namespace: str, keys: Sequence[bytes]
                     ) -> tuple[list[Key], list[asyncio.Future[bool]], bool]:
        """``hide`` the keys of ``namespace`` (for ``unhide``, returned) and, under the
        same take of the lock, the promotions of them in flight and whether any other
        move of them is (a delete's first step: most find neither, and go on at once)."""
        keys_of = [(namespace, key) for key in keys]
        with self._lock:
            self._hidden.update(keys_of)
            self._hidden_n += len(keys_of)
            busy = self._promotions(keys_of)
            moving = bool(busy) or self._any_moving(keys_of)
        return keys_of, busy, moving

    def unhide(self, keys: Sequence[Key]) -> None:
        """End a ``hide`` of ``keys``."""
        with self._lock:
            if len(keys) >= self._hidden_n:  # (all of them: nobody else hides a key now)
                self._hidden.clear()
                self._hidden_n = 0
            else:
                _count_down(self._hidden, keys)
                self._hidden_n -= len(keys)

    # ---------------------------------------------------------------- promotions
    def claim_promotions(self, namespace: str, keys: Iterable[bytes],
                         loop: asyncio.AbstractEventLoop
                         ) -> tuple[list[bytes], list[asyncio.Future[bool]]]:
        """Record a promotion of each of ``keys`` nobody is promoting yet.  Returns those
        keys (the caller's to promote and ``end_promotion``) and the futures of the
        promotions of the others already in flight (each set to whether its key is in
        DRAM when it ends)."""
        mine: list[bytes] = []
        waits: list[asyncio.Future[bool]] = []
        with self._lock:
            for key in keys:
                fut = self._promoting.get((namespace, key))
                if fut is not None:
                    waits.append(fut)
                else:
                    self._promoting[(namespace, key)] = loop.create_future()
                    mine.append(key)
        return mine, waits

    def end_promotion(self, namespace: str, key: bytes, present: bool) -> None:
        with self._lock:
            fut = self._promoting.pop((namespace, key))
        if not fut.done():
            fut.set_result(present)

    def promotions_of(self, namespace: str, keys: Iterable[bytes]) -> list[asyncio.Future[bool]]:
        """The promotions of ``keys`` in flight."""
        with self._lock:
            return self._promotions((namespace, k) for k in keys)

    def _promotions(self, keys: Iterable[Key]) -> list[asyncio.Future[bool]]:
        """The promotions of ``keys`` in flight (under the lock)."""
        promoting = self._promoting
        return [f for k in keys if (f := promoting.get(k)) is not None] if promoting else []

    # ---------------------------------------------------------------- demotions
    @contextlib.contextmanager
    def demoting(self, batches: Sequence[BlockBatch]) -> Iterator[None]:
        """Pin the blocks of ``batches`` (one per namespace) and record their demotion for
        the ``with`` body (event loop); all pinned or none."""
        leases: list[Lease] = []
        try:
            for batch in batches:
                leases.append(self._store.pin_blocks(batch))
        except BaseException:
            for lease in leases:
                self._store.unpin(lease)
            raise
        with self._lock:
            for batch in batches:
                name = batch.ns.name
                for j, key in enumerate(batch.keys):
                    self._demoting[(name, key)] = (batch, j)
        try:
            yield
        finally:
            with self._lock:
                for batch in batches:
                    name = batch.ns.name
                    for key in batch.keys:
                        self._demoting.pop((name, key), None)
            for lease in leases:
                self._store.unpin(lease)
            self.signal()

    # ---------------------------------------------------------------- publishes
    def will_publish(self, blocks: BlockBatch) -> None:
        """Record the keys of a publish about to be started (``publishing`` ends it)."""
        name = blocks.ns.name
        with self._lock:
            self._publishing.update((name, k) for k in blocks.keys)

    @contextlib.contextmanager
    def publishing_blocks(self, blocks: BlockBatch) -> Iterator[None]:
        """Pin the blocks of a publish ``will_publish`` recorded, for the ``with`` body;
        at its end the publish is over (event loop)."""
        lease = self._store.pin_blocks(blocks)
        with self._lock:
            self._publishing_blocks += len(blocks)
        try:
            yield
        finally:
            name = blocks.ns.name
            with self._lock:
                self._publishing_blocks -= len(blocks)
                _count_down(self._publishing, [(name, k) for k in blocks.keys])
            self._store.unpin(lease)
            self.signal()

    # ---------------------------------------------------------------- hand-offs
    @contextlib.contextmanager
    def handing(self, key: Key) -> Iterator[bool]:
        """A tier's eviction hands ``key`` to the next tier (an I/O thread).  Yields
        False, recording nothing, when the key is hidden: it is not to be handed on.
        Otherwise a Delete that starts meanwhile waits for it (and then removes what
        it wrote): under the lock, a hand-off either sees a Delete's hide or is seen
        by that Delete."""
        with self._lock:
            if key in self._hidden:
                started = False
            else:
                self._handing[key] += 1
                started = True
        if not started:
            yield False
            return
        try:
            yield True
        finally:
            with self._lock:
                _count_down(self._handing, [key])
            self._signal_threadsafe()


def _count_down(counter: collections.Counter[Key], keys: Iterable[Key]) -> None:
    """Take one of each of ``keys`` from ``counter``, dropping the ones that reach 0
    (``pop``: ``Counter``'s own ``del`` is a Python method)."""
    for k in keys:
        n = counter[k] - 1
        if n > 0:
            counter[k] = n
        else:
            counter.pop(k, None)
