"""``Promoter.locate`` (lookup, and acquire past DRAM's prefix) asks the local tiers once
per batch (``held_many``); its answers are those of the walk key by key it replaced,
kept here as the reference: DRAM hits, local copies, runs of keys only a remote tier
holds (batched or not), keys being deleted, for any mix of them."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.spill.tier import TIER_CLUSTER, TIER_DRAM, TIER_SSD, Geometry, HandOff
from kvtierd.tiering import Tiering

POOL = [b"k%d" % i for i in range(10)]


class FakeIndex:
    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def find(self, keys: Sequence[bytes]) -> np.ndarray:
        return np.array([7 if k in self.keys else 0 for k in keys], np.uint64)


class FakeTier:
    """A local tier (its ``held`` answers from a set) or a remote one (``present``)."""

    name = "fake"
    cross_host = False
    durable_writes = True

    def __init__(self, tier: int, local: bool, held: set[bytes], batched: bool = False) -> None:
        self.tier, self.local, self.batched, self.keys = tier, local, batched, held
        self.held_calls: list[int] = []
        self.held_many_calls: list[int] = []

    def connect(self, *, on_fault: Callable[[str], None], hand_off: HandOff | None,
                on_lost: Callable[[str, bytes], None] | None) -> None:
        pass

    def held(self, namespace: str, key: bytes, geometry: Geometry | None) -> int | None:
        self.held_calls.append(1)
        return 100 + len(key) if self.local and key in self.keys else None

    def held_many(self, namespace: str, keys: Sequence[bytes],
                  geometry: Geometry | None) -> list[int | None]:
        self.held_many_calls.append(len(keys))
        return [100 + len(k) if self.local and k in self.keys else None for k in keys]

    def present(self, namespace: str, keys: Sequence[bytes],
                geometry: Geometry | None) -> list[bool]:
        return [k in self.keys for k in keys]

    async def present_async(self, namespace: str, keys: Sequence[bytes],
                            geometry: Geometry | None) -> list[bool]:
        return self.present(namespace, keys, geometry)


async def walk_key_by_key(t: Tiering, ns: Any, keys: Sequence[bytes]) -> list[int]:
    """``_locate`` as it was before the batch lookup (f40ecb2): a key at a time."""
    tiers: list[int] = []
    geometry = t.below.geometry(ns)
    in_dram = ns.index.find(keys).tolist() if keys else []
    i = 0
    while i < len(keys):
        key = keys[i]
        if t.moves.hidden(ns.name, key):
            break
        if in_dram[i]:
            tiers.append(TIER_DRAM)
            i += 1
            continue
        local = t.below.local_copy(ns.name, key, geometry)
        if local is not None:
            tiers.append(local[0].tier)
            i += 1
            continue
        if not t.below.remote:
            break
        j = i + 1
        while (j < len(keys) and not in_dram[j]
               and t.below.local_copy(ns.name, keys[j], geometry) is None
               and not t.moves.hidden(ns.name, keys[j])):
            j += 1
        found = await t.below.locate_remote(ns.name, list(keys[i:j]), geometry)
        tiers.extend(found)
        if len(found) < j - i:
            break
        i = j
    return tiers


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.sampled_from(POOL), max_size=14),
       dram=st.sets(st.sampled_from(POOL)), ssd=st.sets(st.sampled_from(POOL)),
       remote=st.sets(st.sampled_from(POOL)), deleting=st.sets(st.sampled_from(POOL)),
       doomed=st.sets(st.sampled_from(POOL)),
       layout=st.sampled_from(["ssd", "ssd+remote", "ssd+batched", "remote", "none"]))
def test_locate_answers_what_the_walk_key_by_key_answered(
        keys: list[bytes], dram: set[bytes], ssd: set[bytes], remote: set[bytes],
        deleting: set[bytes], doomed: set[bytes], layout: str) -> None:
    tiers = []
    local = FakeTier(TIER_SSD, True, ssd)
    if "ssd" in layout:
        tiers.append(local)
    if "remote" in layout or "batched" in layout:
        tiers.append(FakeTier(TIER_CLUSTER, False, remote, batched="batched" in layout))
    store = types.SimpleNamespace(pin_blocks=lambda blocks: None, unpin=lambda lease: None,
                                  attach_tiering=lambda **told: None)
    t = Tiering(store, below=tiers, io_threads=1)  # type: ignore[arg-type]
    try:
        ns = types.SimpleNamespace(name="a", block_bytes=4096, model_uid="m",
                                   index=FakeIndex(dram))
        t.moves.hide([("a", k) for k in deleting])
        # A Delete during the key's demotion: its copies below are gone.
        demoting = [types.SimpleNamespace(
            ns=ns, keys=list(doomed),
            doomed=lambda at: np.ones(len(at), dtype=bool))] if doomed else []

        async def both() -> tuple[list[int], list[int]]:
            return await t.promoter.locate(ns, keys), await walk_key_by_key(t, ns, keys)

        local.held_many_calls.clear()
        with t.moves.demoting(demoting):  # type: ignore[arg-type]
            got, want = asyncio.run(both())
        assert got == want
        if not tiers or not tiers[-1].local:
            return
        # The batch: one held_many for every key DRAM lacks (none when there is none).
        n_below = sum(k not in dram for k in keys[: next(
            (i for i, k in enumerate(keys) if k in deleting), len(keys))])
        assert local.held_many_calls == ([n_below] if n_below else [])
    finally:
        t.work.pool.shutdown()
