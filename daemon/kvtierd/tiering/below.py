"""The tiers below DRAM as the policy sees them, and the questions it asks them.

``lower`` is an ordered list of ``spill.tier.LowerTier`` (SSD, then shared, then a
cluster tier), fastest first, which the policy walks without asking which
tiers it has: demotion writes into the first, each evicting tier hands its
evictions to the next, promotion reads from the fastest tier holding a key.
A *local* tier's index lives in this process (the SSD tier): asking it is
loop-safe.  A *remote* tier's every question is I/O, asked off the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Mapping, Sequence

from kvtierd.cluster.tier import ClusterTier
from kvtierd.spill.blockio import fault_kind
from kvtierd.spill.format import model_hash
from kvtierd.spill.shared import SharedTier
from kvtierd.spill.ssd import SsdTier
from kvtierd.spill.tier import (
    TIER_CLUSTER,
    TIER_DRAM,
    Geometry,
    LowerTier,
    SharedAdapter,
    SsdAdapter,
)
from kvtierd.store import Namespace, Session
from kvtierd.tiering.common import Background, Reporter, SpillPolicy
from kvtierd.tiering.moves import MovementTable


class Below:
    """The tiers below DRAM, fastest first, and where a key's copies are."""

    def __init__(self, *, ssd: SsdTier | None, shared: SharedTier | None,
                 cluster: ClusterTier | None, below: Sequence[LowerTier], policy: SpillPolicy,
                 moves: MovementTable, report: Reporter, work: Background) -> None:
        self.policy = policy
        self._moves = moves
        self._report = report
        self._work = work
        #: Demotion writes into the first, each evicting tier hands its evictions to
        #: the next, promotion reads from the fastest tier holding a key.
        self.lower: list[LowerTier] = [
            *([SsdAdapter(ssd)] if ssd is not None else []),
            *([SharedAdapter(shared)] if shared is not None else []),
            *([cluster] if cluster is not None else []),
            *below,
        ]
        self.by_id = {t.tier: t for t in self.lower}
        self.local = [t for t in self.lower if t.local]  # their indexes: loop-safe lookups
        self.remote = [t for t in self.lower if not t.local]  # every lookup is I/O
        #: Where every committed block is published (``shared_write: commit``,
        #: ``cluster.write: commit``).
        self.write_through = [t for t in self.lower
                              if t.cross_host and self.write_policy(t) == "commit"]
        #: The last tier evicts without handing on (a local tier's LRU, or a cluster
        #: that may drop any object): a CLEAN block's copy may vanish.
        self.lossy = bool(self.lower) and (self.lower[-1].local
                                           or not self.lower[-1].durable_writes)
        self._mhash: dict[str, int] = {}

    def write_policy(self, tier: LowerTier) -> str:
        """When ``tier`` gets blocks: "demotion" (what the tier above it evicts, or
        DRAM's demotions when it is first) or "commit" (also every commit)."""
        return self.policy.cluster_write if tier.tier == TIER_CLUSTER else self.policy.shared_write

    def known_tiers(self) -> set[int]:
        return {TIER_DRAM, *(t.tier for t in self.lower)}

    # ---------------------------------------------------------------- geometry
    def geometry(self, ns: Namespace) -> Geometry:
        """What ``ns``'s blocks are written for (event loop: caches the model hash)."""
        h = self._mhash.get(ns.model_uid)
        if h is None:
            h = self._mhash[ns.model_uid] = model_hash(ns.model_uid)
        return Geometry(ns.block_bytes, h)

    def geometry_of(self, ns: Namespace | None) -> Geometry | None:
        """None for a namespace nobody declared since the start: copies taken as they are."""
        return None if ns is None else self.geometry(ns)

    def geometry_off_loop(self, ns: Namespace) -> Geometry:
        """``geometry`` for a worker thread (reads the cache, never writes it)."""
        return Geometry(ns.block_bytes,
                        self._mhash.get(ns.model_uid) or model_hash(ns.model_uid))

    # ---------------------------------------------------------------- local copies
    def copy_in(self, tier: LowerTier, namespace: str, key: bytes,
                geometry: Geometry | None) -> int | None:
        """The length of ``tier``'s copy of a key that reads would use, if its index in
        this process knows one (loop-safe; None for a tier that is not local)."""
        if self._moves.deleted_while_demoting(namespace, [key]):
            return None  # deleted while its demotion was in flight
        return tier.held(namespace, key, geometry)

    def local_copy(self, namespace: str, key: bytes,
                   geometry: Geometry | None) -> tuple[LowerTier, int] | None:
        """The fastest local tier's copy of a key: (tier, length), or None (loop-safe)."""
        for tier in self.local:
            length = self.copy_in(tier, namespace, key, geometry)
            if length is not None:
                return tier, length
        return None

    def copies_in(self, tier: LowerTier, namespace: str, keys: Sequence[bytes],
                  geometry: Geometry | None) -> list[int | None]:
        """``copy_in`` of each key: the tier asked once about them all (``held_many``:
        the SSD tier's index looks the batch up in one native call; loop-safe)."""
        held = list(tier.held_many(namespace, keys, geometry))
        for i in self._moves.deleted_while_demoting(namespace, keys):
            held[i] = None
        return held

    def local_tiers(self, namespace: str, keys: Sequence[bytes],
                    geometry: Geometry | None) -> list[int]:
        """The fastest local tier holding each key (its ``tier`` number), 0 for none:
        ``local_copies`` without the lengths (one ``held_many`` a tier; loop-safe)."""
        if len(self.local) == 1:
            only = self.local[0].tier
            return [0 if length is None else only
                    for length in self.copies_in(self.local[0], namespace, keys, geometry)]
        return [0 if copy is None else copy[0].tier
                for copy in self.local_copies(namespace, keys, geometry)]

    def local_copies(self, namespace: str, keys: Sequence[bytes],
                     geometry: Geometry | None) -> list[tuple[LowerTier, int] | None]:
        """``local_copy`` of each key: each local tier asked once, about the keys the
        tiers before it lack (loop-safe)."""
        out: list[tuple[LowerTier, int] | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for tier in self.local:
            if not todo:
                break
            lengths = self.copies_in(tier, namespace, [keys[i] for i in todo], geometry)
            rest: list[int] = []
            for i, length in zip(todo, lengths, strict=True):
                if length is None:
                    rest.append(i)
                else:
                    out[i] = (tier, length)
            todo = rest
        return out

    def exists_below(self, session: Session, keys: Sequence[bytes] = ()
                     ) -> Callable[[bytes], bool] | None:
        """Whether a tier below DRAM holds a key of ``session``'s namespace (None: no such
        tier): such a key is EXISTS to a writer, as a DRAM block is.

        ``keys``: the keys it will be asked about (a Reserve's).  Its first question in
        a turn of the event loop then asks the local tiers about all of them at once
        (``local_copies``: one batch lookup, not one per key), and the answers serve
        the rest of that turn -- the store asks key by key in one synchronous pass --
        and are dropped at its end: a later pass (after the store grew the namespace,
        or after waiting for demotion) asks afresh.  A key not among them, or a
        question off the event loop's thread, is asked alone."""
        if not self.local:
            return None
        ns, geometry = session.ns, self.geometry(session.ns)
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
                    copies = self.local_copies(ns.name, keys, geometry)
                    turn.update(zip(keys, (c is not None for c in copies), strict=True))
                    loop.call_soon(turn.clear)
                    hit = turn.get(key)
                    if hit is not None:
                        return hit
            return self.local_copy(ns.name, key, geometry) is not None

        return exists

    def held_below(self, session: Session) -> Callable[[Sequence[bytes]], list[bool]] | None:
        """``exists_below`` as one question about a batch of keys: whether a local tier
        below DRAM holds each (None: no such tier).  A page commit asks it once per
        batch of new keys (each tier one ``held_many``), not once per key."""
        if not self.local:
            return None
        name, geometry = session.ns.name, self.geometry(session.ns)

        def held(keys: Sequence[bytes]) -> list[bool]:
            return [t != 0 for t in self.local_tiers(name, keys, geometry)]

        return held

    async def keys_below(self, namespace: str, ns: Namespace | None) -> list[bytes]:
        """The keys the local tiers hold for a namespace (off the loop: O(their entries))."""
        if not self.local:
            return []
        geometry = self.geometry_of(ns)
        tiers = self.local

        def collect() -> list[bytes]:
            return list(itertools.chain.from_iterable(
                t.keys_of(namespace, geometry) for t in tiers))

        return await asyncio.to_thread(collect)

    # ---------------------------------------------------------------- remote copies
    async def locate_remote(self, namespace: str, keys: list[bytes],
                            geometry: Geometry) -> list[int]:
        """The tier of each key of the longest prefix the remote tiers hold (the first
        of them holding it).  A batched tier is asked about all the keys in one go, from
        the loop (``present_async``); the others key by key on a worker thread, as far
        as needed.  A tier that cannot answer counts a fault and is a miss."""
        batched: dict[int, list[bool]] = {}
        for tier in self.remote:
            if tier.batched:
                try:
                    batched[tier.tier] = await tier.present_async(namespace, keys, geometry)
                except OSError as exc:
                    self._report.fault(tier.name, fault_kind(exc))
                    batched[tier.tier] = [False] * len(keys)
        if all(t.batched for t in self.remote):
            return self._walk_remote(namespace, keys, geometry, batched)  # no I/O left
        return await self._work.run(self._walk_remote, namespace, keys, geometry, batched)

    def _walk_remote(self, namespace: str, keys: list[bytes], geometry: Geometry,
                     batched: dict[int, list[bool]]) -> list[int]:
        """Worker thread (or the loop when every remote tier is batched): walk the keys
        with the batched tiers' answers, asking the others key by key."""
        out: list[int] = []
        for i, key in enumerate(keys):
            found = None
            for tier in self.remote:
                if tier.batched:
                    hit = batched[tier.tier][i]
                else:
                    try:
                        hit = tier.present(namespace, [key], geometry)[0]
                    except OSError as exc:
                        self._report.fault(tier.name, fault_kind(exc))
                        hit = False
                if hit:
                    found = tier.tier
                    break
            if found is None:
                break
            out.append(found)
        return out

    async def drop(self, namespace: str, drops: Mapping[LowerTier, Sequence[bytes]],
                   geometry: Geometry | None, *, flush: bool = True
                   ) -> dict[str, set[bytes]]:
        """The I/O half of removing keys below DRAM (Delete and Evict): persist what the
        local tiers' ``remove`` took out (unless ``flush`` is False: it took out
        nothing), then remove each remote tier's copies of its keys in ``drops``.
        Returns, per tier name, the keys that had a copy there."""
        for tier in self.local if flush else ():
            with contextlib.suppress(OSError):  # not persisted: the next flush retries
                await self._work.run(tier.flush)
        found: dict[str, set[bytes]] = {}
        for tier, keys in drops.items():
            if not keys:
                continue
            try:
                found[tier.name] = await self._work.run(tier.delete, namespace, list(keys),
                                                        geometry)
            except OSError as exc:
                self._report.fault(tier.name, fault_kind(exc))
        return found
