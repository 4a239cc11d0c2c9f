"""The admin calls over every tier: ``list_keys``, ``evict`` (the service's ListKeys,
Evict) and the KV events' snapshots (``blocks_by_tier``, ``watch``).

Listing and evicting cover DRAM and the local tiers (SSD), whose indexes this
daemon holds; remote tiers (shared) are never enumerated (a directory tree
many hosts write), so ``list_keys`` does not show them and an evict of
``all`` removes their copies only of the keys DRAM or a local tier know.  An
evict skips (and counts) keys that are leased or moving (the movement table)
and drops the rest tier by tier in one loop step per chunk, so each block's
bookkeeping changes all at once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import heapq
import itertools
from collections.abc import Callable, Collection, Sequence
from typing import Final

from kvtier._wire import TIER_NAMES
from kvtier.errors import FailedPrecondition, NotFound
from kvtierd.spill.ssd import SsdTier
from kvtierd.spill.tier import TIER_CLUSTER, TIER_DRAM, TIER_SHARED, TIER_SSD, LowerTier
from kvtierd.store import Lower, Namespace, Pinned
from kvtierd.tiering.context import Context

#: Keys an Evict handles per event-loop step (bounded work between yields: an
#: evict of a whole 250k-block namespace must not stall every other call).
EVICT_CHUNK: Final = 1024
#: The setting that turns a tier on (for "this daemon has no ... tier" messages).
_TIER_SETTING: Final = {TIER_DRAM: "dram.capacity", TIER_SSD: "spill.ssd_dir",
                        TIER_SHARED: "spill.shared_dir", TIER_CLUSTER: "cluster.master"}


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


class Admin:
    """Listing and evicting the blocks of a namespace across the tiers."""

    def __init__(self, ctx: Context, ssd: SsdTier | None) -> None:
        """``ssd``: the SSD tier's mechanism (its keys for the KV events)."""
        self._ctx = ctx
        self._ssd = ssd

    # ---------------------------------------------------------------- KV events
    async def blocks_by_tier(self) -> dict[str, dict[str, list[bytes]]]:
        """Namespace -> tier ("dram", "ssd") -> every key it holds (the KV events'
        snapshots): DRAM's as of this call, the SSD tier's copied off the loop."""
        out: dict[str, dict[str, list[bytes]]] = {
            name: {"dram": list(ns.index)} for name, ns in self._ctx.store.namespaces.items()}
        if self._ssd is not None:
            for name, key in await asyncio.to_thread(self._ssd.all_keys):
                out.setdefault(name, {}).setdefault("ssd", []).append(key)
        return out

    def watch(self, changed: Callable[[str, str, list[bytes], bool], None] | None) -> None:
        """Tell ``changed(namespace, tier, keys, stored)`` every key that comes into or
        goes out of DRAM or the SSD tier from now on (the KV events)."""
        self._ctx.store.watch(changed)
        if self._ssd is not None:
            self._ssd.watch(None if changed is None
                            else lambda ns, key, stored: changed(ns, "ssd", [key], stored))

    # ---------------------------------------------------------------- list
    async def list_keys(self, namespace: str, page_size: int,
                        after: bytes | None) -> tuple[list[KeyState], bytes | None]:
        """One page of a namespace's blocks in DRAM and the local tiers (SSD), in
        key-byte order.

        ``after``: the last key of the previous page (None: the first page).
        Returns the page and the key to continue after, or None on the last
        page.  Remote tiers (shared) are not enumerated.  The page is chosen off the
        loop (O(blocks of the namespace)); keys that vanish meanwhile are left out.

        Raises: NotFound unless a session declared the namespace since the start, DRAM
        recovered it, or a local tier holds blocks of it.
        """
        ns = self._ctx.store.namespaces.get(namespace)
        dram = list(ns.index) if ns is not None else []
        below = await self._ctx.below.keys_below(namespace, ns)
        if ns is None and not below:
            raise NotFound(f"namespace {namespace!r} is not known to this daemon")
        page = await asyncio.to_thread(_smallest_after, dram, below, after, page_size + 1)
        has_more = len(page) > page_size  # (not ``more``: that is the log helper)
        page = page[:page_size]
        pinned = self._ctx.store.pinned(ns) if ns is not None else None
        out = [st for key in page
               if (st := self._key_state(namespace, ns, key, pinned)) is not None]
        return out, (page[-1] if has_more and page else None)

    def _key_state(self, namespace: str, ns: Namespace | None, key: bytes,
                   pinned: Pinned | None) -> KeyState | None:
        if self._ctx.moves.hidden(namespace, key):
            return None
        moving = self._ctx.moves.moving(namespace, key)
        block = ns.index.get(key) if ns is not None else None
        if block is not None:
            leased = pinned is not None and pinned.block(block)
            return KeyState(key, TIER_DRAM, block.length, leased or moving,
                            block.lower == Lower.CLEAN)
        local = self._ctx.below.local_copy(namespace, key, self._ctx.below.geometry_of(ns))
        if local is not None:
            return KeyState(key, local[0].tier, local[1], moving, True)
        return None

    # ---------------------------------------------------------------- evict
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

        Raises: FailedPrecondition for a tier this daemon does not have; NotFound for
        a namespace it does not know (as ``list_keys``).
        """
        have = self._ctx.below.known_tiers()
        for tier in tiers:
            if tier not in have:
                raise FailedPrecondition(f"this daemon has no {TIER_NAMES[tier]} tier "
                                         f"({_TIER_SETTING[tier]} is not set)")
        want = set(tiers) or have
        ns = self._ctx.store.namespaces.get(namespace)
        below: list[bytes] = []
        if keys is None or ns is None:
            below = await self._ctx.below.keys_below(namespace, ns)
            ns = self._ctx.store.namespaces.get(namespace)  # (it may have been declared meanwhile)
        if ns is None and not below:
            raise NotFound(f"namespace {namespace!r} is not known to this daemon")
        todo = list(dict.fromkeys(
            keys if keys is not None
            else itertools.chain(ns.index if ns is not None else (), below)))
        evicted = 0
        skipped = 0
        dropped: collections.Counter[str] = collections.Counter()
        for i in range(0, len(todo), EVICT_CHUNK):
            ns = self._ctx.store.namespaces.get(namespace)
            e, s = await self._evict_chunk(namespace, ns, todo[i : i + EVICT_CHUNK], want,
                                           dropped)
            evicted += e
            skipped += s
            await asyncio.sleep(0)
        return EvictResult(evicted, skipped, dict(dropped))

    async def _evict_chunk(self, namespace: str, ns: Namespace | None, keys: Sequence[bytes],
                           tiers: set[int], dropped: collections.Counter[str]) -> tuple[int, int]:
        below = self._ctx.below
        lost: set[bytes] = set()
        skipped = 0
        remote: dict[LowerTier, list[bytes]] = {t: [] for t in below.remote if t.tier in tiers}
        local = [t for t in below.local if t.tier in tiers]
        any_below = bool(tiers & {t.tier for t in below.lower})
        hidden: list[tuple[str, bytes]] = []
        freed = False  # local copies removed: their removal is to be persisted
        geometry = below.geometry_of(ns)
        # Blocks clients lease without a call count as leased (their slots would be kept
        # from reuse anyway; the admin is told they were skipped, as for pinned ones).
        pinned = self._ctx.store.pinned(ns) if ns is not None else None
        # -- in one loop step: each key's DRAM and local copies, all or nothing per key
        for key in keys:
            block = ns.index.get(key) if ns is not None else None
            if ((block is not None and pinned is not None and pinned.block(block))
                    or self._ctx.moves.moving(namespace, key)
                    or self._ctx.moves.hidden(namespace, key)):
                skipped += 1
                continue
            if TIER_DRAM in tiers and block is not None:
                if self._ctx.store.evict_block(block):
                    dropped["dram"] += 1
                    lost.add(key)
                    block = None
            for tier in local:
                if below.copy_in(tier, namespace, key, geometry) is not None:
                    tier.remove(namespace, [key])
                    dropped[tier.name] += 1
                    lost.add(key)
                    freed = True
            if (block is not None and block.lower == Lower.CLEAN and any_below
                    and below.local_copy(namespace, key, geometry) is None):
                self._ctx.store.set_lower(block, Lower.DIRTY)  # its copy below may be gone now
            if remote:
                for todo in remote.values():
                    todo.append(key)
                if block is None and below.local_copy(namespace, key, geometry) is None:
                    hidden.append((namespace, key))  # no promotion from there meanwhile
        # -- then the I/O: persist the local removals, remove the remote copies
        if not any(remote.values()) and not freed:
            return len(lost), skipped
        self._ctx.moves.hide(hidden)
        try:
            found = await below.drop(namespace, remote, geometry)
        finally:
            self._ctx.moves.unhide(hidden)
        for name, there in found.items():
            if there:
                dropped[name] += len(there)
                lost |= there
        return len(lost), skipped


def _smallest_after(dram: list[bytes], below: list[bytes], after: bytes | None,
                    n: int) -> list[bytes]:
    """The ``n`` smallest distinct keys of both lists greater than ``after`` (worker thread)."""
    pool = set(dram)
    pool.update(below)
    if after is None:
        return heapq.nsmallest(n, pool)
    return heapq.nsmallest(n, (k for k in pool if k > after))
