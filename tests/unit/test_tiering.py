"""Tiering over real segments and real spill files: demotion, promotion, faults.

Each test builds a small DRAM store (30 slots of 64 KiB) plus an SSD tier in a
temp directory on the root filesystem (ext4 here: O_DIRECT works) and/or a
shared tier, drives them on one event loop, and ends with ``check()`` of
both the store and the SSD tier.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading

from kvtierd.recovery import recover
from kvtierd.spill.blockio import aligned_buffer
from kvtierd.spill.shared import namespace_dir
from kvtierd.spill.ssd import SsdTier
from kvtierd.store import Lower, ReserveStatus
from kvtierd.tiering import TIER_DRAM, TIER_SHARED, TIER_SSD, SpillPolicy, Tiering

from .conftest import make_store
from .spill_harness import BLOCK, DRAM, MiB, keys, payload, tiered


# ================================================================ demotion and promotion
def test_working_set_four_times_dram_stays_reachable(shm_dir: str, disk_dir: str) -> None:
    """120 blocks through 30 DRAM slots: every one is read back byte-exact from some tier."""

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s = env.session()
            ks = keys(120)
            for i in range(0, 120, 6):
                assert await env.put(s, ks[i : i + 6]) == [ReserveStatus.RESERVED] * 6
            await env.settle()
            assert env.t.ssd is not None and env.t.ssd.stats()["blocks"] >= 90
            tiers = await env.t.lookup(s, ks)
            assert len(tiers) == 120 and TIER_SSD in tiers and TIER_DRAM in tiers
            for i in range(0, 120, 5):
                got, got_tiers = await env.get(s, ks[i : i + 5])
                assert got == [payload(k) for k in ks[i : i + 5]]
                assert len(got_tiers) == 5
            assert sum(env.t.counters.promotions.values()) >= 90
            assert sum(env.t.counters.demotions.values()) >= 90

    asyncio.run(go())


def test_reserve_of_a_spilled_key_is_exists(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s, ks = await env.spilled(60)
            on_ssd = [k for k in ks if k not in s.ns.index]
            assert on_ssd
            assert await env.put(s, on_ssd[:3]) == [ReserveStatus.EXISTS] * 3

    asyncio.run(go())


def test_lookups_reserves_and_deletes_ask_the_ssd_tier_once_per_batch(
        shm_dir: str, disk_dir: str) -> None:
    """Keys below DRAM are looked up in the SSD tier's index once per request
    (``length_of_many``: one native call), not key by key, with the answers a walk key
    by key gives: the prefix, its tiers, EXISTS for a writer (a Reserve, a page commit)."""

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s, ks = await env.spilled(60)
            ssd = env.t.ssd
            assert ssd is not None
            on_ssd = [k for k in ks if k not in s.ns.index]
            assert len(on_ssd) >= 20
            geometry = env.t.below.geometry(s.ns)
            # What the walk key by key answers (asked before the counting starts).
            asked = ks + keys(3, "gone") + ks[:4]
            want: list[int] = []
            for k in asked:
                local = env.t.below.local_copy(s.ns.name, k, geometry)
                if k not in s.ns.index and local is None:
                    break
                want.append(TIER_DRAM if k in s.ns.index else TIER_SSD)
            assert len(want) == 60
            one: list[bytes] = []
            many: list[int] = []
            real_one, real_many = ssd.length_of, ssd.length_of_many
            ssd.length_of = lambda ns, key, g=None: (  # type: ignore[method-assign]
                one.append(key), real_one(ns, key, g))[1]
            ssd.length_of_many = lambda ns, batch, g=None: (  # type: ignore[method-assign]
                many.append(len(batch)), real_many(ns, batch, g))[1]
            try:
                assert await env.t.lookup(s, asked) == want
                assert (one, len(many)) == ([], 1)
                fresh = keys(3, "new")
                assert await env.put(s, on_ssd[:10] + fresh) == (
                    [ReserveStatus.EXISTS] * 10 + [ReserveStatus.RESERVED] * 3)
                assert (one, len(many)) == ([], 2) and many[1] == 13
                # A page commit's question (``held_below``): one lookup for the batch.
                held = env.t.below.held_below(s)
                assert held is not None
                assert held(on_ssd[:4] + fresh) == [True] * 4 + [False] * 3
                assert (one, len(many)) == ([], 3) and many[2] == 7
                assert await env.t.delete(s, on_ssd[:5] + keys(2, "gone")) == 5
                assert (one, len(many)) == ([], 4)
                assert await env.t.lookup(s, on_ssd[:5]) == []
            finally:
                del ssd.length_of, ssd.length_of_many

    asyncio.run(go())


def test_without_spill_tiers_eviction_drops(shm_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir) as env:
            s = env.session()
            ks = keys(60)
            await env.put_all(s, ks)
            assert len(await env.t.lookup(s, ks)) == 0  # the oldest are gone
            assert not env.store.spill_enabled

    asyncio.run(go())


def test_prefetch_promotes_in_the_background(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s, ks = await env.spilled(60)
            first = ks[:5]
            assert all(k not in s.ns.index for k in first)
            tiers = await env.t.lookup(s, first, prefetch=True)
            assert tiers == [TIER_SSD] * 5
            for _ in range(100):
                await asyncio.sleep(0.01)
                if all(k in s.ns.index for k in first):
                    break
            assert all(s.ns.index[k].prefetched for k in first)
            got, got_tiers = await env.get(s, first)
            assert got == [payload(k) for k in first] and got_tiers == [TIER_DRAM] * 5
            assert env.t.counters.prefetch_hits == 5

    asyncio.run(go())


def test_delete_removes_every_tier_and_survives_restart(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s, ks = await env.spilled(60)
            victim = [k for k in ks if k not in s.ns.index][:4]
            assert await env.t.delete(s, victim) == 4
            assert await env.t.lookup(s, victim) == []
        async with tiered(shm_dir + "-2", ssd_dir=disk_dir) as env2:  # fresh DRAM, same SSD
            s2 = env2.session()
            assert await env2.t.lookup(s2, victim) == []
            rest = [k for k in ks[:30] if k not in victim][:3]
            got, tiers = await env2.get(s2, rest)
            assert got == [payload(k) for k in rest] and tiers == [TIER_SSD] * 3

    os.mkdir(shm_dir + "-2")
    try:
        asyncio.run(go())
    finally:
        shutil.rmtree(shm_dir + "-2", ignore_errors=True)


def test_a_delete_persists_removals_below_dram_only_when_it_made_one(
        shm_dir: str, disk_dir: str) -> None:
    """The SSD tier's removals reach the disk (``flush``, a worker thread's round trip)
    before a Delete answers; a Delete of keys the SSD tier did not hold has nothing to
    persist and answers without that round trip."""

    async def go() -> None:
        # (Nothing cleaned ahead: a block newly put stays in DRAM alone.)
        policy = SpillPolicy.with_defaults(backpressure_timeout=5.0, clean_ahead=0.0)
        async with tiered(shm_dir, ssd_dir=disk_dir, policy=policy) as env:
            s, ks = await env.spilled(60)
            ks += keys(2, "new")
            await env.put_all(s, ks[-2:])
            ssd = env.t.ssd
            assert ssd is not None
            geometry = env.t.below.geometry(s.ns)
            flushes: list[int] = []
            real_flush = ssd.flush_frees
            ssd.flush_frees = lambda: (  # type: ignore[method-assign]
                flushes.append(1), real_flush())[1]
            in_dram_only = [k for k in ks if k in s.ns.index
                            and env.t.below.local_copy(s.ns.name, k, geometry) is None][:2]
            assert in_dram_only
            assert await env.t.delete(s, in_dram_only) == len(in_dram_only)
            assert await env.t.delete(s, keys(2, "never")) == 0
            assert flushes == []
            on_ssd = [k for k in ks if k not in s.ns.index][:2]
            assert len(on_ssd) == 2
            assert await env.t.delete(s, on_ssd) == 2
            assert flushes == [1]
            assert await env.t.lookup(s, in_dram_only + on_ssd) == []
            assert env.t.check() == []

    asyncio.run(go())


# ================================================================ shared tier
def _two_hosts(shm_dir: str) -> tuple[str, str]:
    a, b = shm_dir + "-A", shm_dir + "-B"
    os.mkdir(a)
    os.mkdir(b)
    return a, b


def test_host_b_hits_what_host_a_wrote_through(shm_dir: str, disk_dir: str) -> None:
    """shared_write=commit: a block committed on A is read on B (separate DRAM and SSD)."""
    a_dir, b_dir = _two_hosts(shm_dir)
    shared = os.path.join(disk_dir, "shared")

    async def go() -> None:
        policy = SpillPolicy.with_defaults(shared_write="commit")
        async with tiered(a_dir, ssd_dir=os.path.join(disk_dir, "ssdA"), shared_dir=shared,
                          policy=policy) as a, \
                tiered(b_dir, ssd_dir=os.path.join(disk_dir, "ssdB"), shared_dir=shared,
                       policy=policy) as b:
            sa, sb = a.session(), b.session()
            ks = keys(8)
            await a.put(sa, ks)
            await a.settle()
            assert await b.t.lookup(sb, ks) == [TIER_SHARED] * 8
            got, tiers = await b.get(sb, ks)
            assert got == [payload(k) for k in ks] and tiers == [TIER_SHARED] * 8
            assert await b.t.lookup(sb, ks) == [TIER_DRAM] * 8  # promoted on B
            assert b.t.counters.promotions["shared"] == 8
            # A different model in the same namespace never sees these blocks.
            other = b.session("A2", model_uid="m2")
            assert await b.t.lookup(other, ks) == []

    try:
        asyncio.run(go())
    finally:
        shutil.rmtree(a_dir, ignore_errors=True)
        shutil.rmtree(b_dir, ignore_errors=True)


def test_host_b_hits_what_host_a_demoted(shm_dir: str, disk_dir: str) -> None:
    """shared_write=demotion without an SSD on A: DRAM demotions go to the shared tier."""
    a_dir, b_dir = _two_hosts(shm_dir)
    shared = os.path.join(disk_dir, "shared")

    async def go() -> None:
        async with tiered(a_dir, shared_dir=shared) as a, tiered(b_dir, shared_dir=shared) as b:
            sa, sb = a.session(), b.session()
            ks = keys(60)
            await a.put_all(sa, ks)
            await a.settle()
            assert a.t.counters.demotions["dram->shared"] >= 30
            spilled = [k for k in ks if k not in sa.ns.index]
            got, tiers = await b.get(sb, spilled[:10])
            assert got == [payload(k) for k in spilled[:10]]
            assert tiers == [TIER_SHARED] * 10
            # and A itself reads its demoted blocks back from the shared tier
            got_a, _ = await a.get(sa, spilled[:5])
            assert got_a == [payload(k) for k in spilled[:5]]

    try:
        asyncio.run(go())
    finally:
        shutil.rmtree(a_dir, ignore_errors=True)
        shutil.rmtree(b_dir, ignore_errors=True)


def test_ssd_evictions_pass_blocks_to_the_shared_tier(shm_dir: str, disk_dir: str) -> None:
    """DRAM 30 slots, SSD 2 files of 2 MiB: older blocks fall through to the shared tier."""

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=os.path.join(disk_dir, "ssd"),
                          shared_dir=os.path.join(disk_dir, "shared"),
                          ssd_capacity=4 * MiB + 2 * 4096 * 4) as env:
            s, ks = await env.spilled(150)
            assert env.t.counters.demotions["ssd->shared"] > 0
            tiers = await env.t.lookup(s, ks)
            assert len(tiers) == 150 and TIER_SHARED in tiers and TIER_SSD in tiers
            for i in range(0, 150, 10):
                got, _ = await env.get(s, ks[i : i + 10])
                assert got == [payload(k) for k in ks[i : i + 10]]

    asyncio.run(go())


def test_namespace_dir_is_one_safe_component() -> None:
    assert namespace_dir("a/b") == "a%2Fb"
    assert namespace_dir("..") == "%2E."
    assert namespace_dir(".hidden") == "%2Ehidden"
    assert namespace_dir("llama-3.1_8b") == "llama-3.1_8b"


# ================================================================ re-adoption
def test_ssd_readoption_keeps_lru_order_and_bytes(shm_dir: str, disk_dir: str) -> None:
    """A fresh SsdTier over the same directory finds every block, oldest first in its LRU."""
    written: list[bytes] = []

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s, ks = await env.spilled(90)
            assert env.t.ssd is not None
            # Persisted order is write order (seq); concurrent writes of one batch may
            # have entered the in-memory LRU in another order.
            written.extend(e.key for e in sorted(env.t.ssd.lru, key=lambda e: e.seq))

    asyncio.run(go())
    ssd = SsdTier(disk_dir, capacity=8 * MiB, file_bytes=2 * MiB)
    ssd.open()
    try:
        assert [e.key for e in ssd.lru] == written
        assert ssd.counters.adopted == len(written) and ssd.check() == []
        buf = aligned_buffer(BLOCK)
        for key in written[:10]:
            entry = ssd.index[("A", key)]
            ssd.read_into(entry, memoryview(buf))
            assert bytes(buf[: entry.length]) == payload(key)
    finally:
        ssd.close()


def test_dram_blocks_with_an_ssd_copy_are_clean_after_restart(shm_dir: str,
                                                              disk_dir: str) -> None:
    """Warm restart: DRAM is re-adopted and blocks that have SSD copies need no rewrite."""

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s, ks = await env.spilled(40)
            clean_before = {b.key for b in s.ns.index.values() if b.lower == Lower.CLEAN}
            assert clean_before
        senv = make_store(shm_dir, capacity=DRAM, extent_size=MiB + 4 * 4096)
        recover(senv.store, shm_dir)
        t = Tiering(senv.store, ssd=SsdTier(disk_dir, capacity=8 * MiB, file_bytes=2 * MiB))
        await t.start()
        try:
            ns = senv.store.namespaces["A"]
            clean_after = {b.key for b in ns.index.values() if b.lower == Lower.CLEAN}
            assert clean_before <= clean_after
            assert t.check() == []
        finally:
            await t.stop()
            senv.store.close_all()

    asyncio.run(go())


def test_another_namespace_older_extent_is_demoted_not_our_newer_blocks(
        shm_dir: str, disk_dir: str) -> None:
    """LRU order across namespaces: A's old, half-empty extent is demoted and reclaimed
    for B, rather than B churning through its own newer blocks while A holds DRAM."""

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            a, b = env.session("A"), env.session("B")
            old = keys(5, "a")
            await env.put(a, old)  # one extent of A, mostly free slots
            newer = keys(60, "b")
            await env.put_all(b, newer, 6)
            await env.settle()
            assert await env.t.lookup(a, old) == [TIER_SSD] * 5
            assert not a.ns.extents  # reclaimed for B
            assert len(b.ns.extents) == 2
            got, tiers = await env.get(a, old)
            assert got == [payload(k) for k in old] and tiers == [TIER_SSD] * 5

    asyncio.run(go())


# ================================================================ delete races
def test_delete_during_its_demotion_stays_deleted_across_a_crash(shm_dir: str,
                                                                  disk_dir: str) -> None:
    """A Delete that meets its block half-way to the SSD waits for that write, then removes
    it from every tier; the slot table on disk says FREE, so a restart does not revive it."""

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir,
                          policy=SpillPolicy.with_defaults(queue_depth=1,
                                                           backpressure_timeout=5.0)) as env:
            s, ssd = env.session(), env.t.ssd
            assert ssd is not None
            write_in, write_go = threading.Event(), threading.Event()
            write = ssd.write

            def slow_write(*a: object, **kw: object) -> object:
                write_in.set()
                write_go.wait(10)
                return write(*a, **kw)  # type: ignore[arg-type]

            ssd.write = slow_write  # type: ignore[method-assign]
            for i in range(0, 30, 5):
                await env.put(s, keys(30)[i : i + 5])  # DRAM full: the demoter takes the tail
            while not write_in.is_set():
                await asyncio.sleep(0.01)
            ((_, k),) = env.t.moves.demoting_keys()
            delete = asyncio.ensure_future(env.t.delete(s, [k]))
            await asyncio.sleep(0.05)
            assert not delete.done()  # waits for the write in flight
            write_go.set()
            ssd.write = write  # type: ignore[method-assign]
            assert await delete == 1
            assert await env.t.lookup(s, [k]) == []
            assert await env.put(s, [k], tag=b"again") == [ReserveStatus.RESERVED]
            await env.t.delete(s, [k])
            fresh = SsdTier(disk_dir, capacity=8 * MiB, file_bytes=2 * MiB)  # as after SIGKILL
            fresh.open()
            try:
                assert ("A", k) not in fresh.index
            finally:
                fresh.close()

    asyncio.run(go())


def test_delete_racing_a_promotion_is_not_undone(shm_dir: str, disk_dir: str) -> None:
    """Another session's acquire is reading the block from the SSD when the delete comes:
    the delete waits for that promotion and then removes the promoted DRAM copy too."""

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            writer, reader = env.session(), env.session()
            ks = keys(60)
            await env.put_all(writer, ks)
            await env.settle()
            k = next(x for x in ks if x not in writer.ns.index)
            ssd = env.t.ssd
            assert ssd is not None
            read_in, read_go = threading.Event(), threading.Event()
            read = ssd._read_verified

            def slow_read(entry: object, dst: memoryview) -> None:
                read_in.set()
                read_go.wait(10)
                read(entry, dst)  # type: ignore[arg-type]

            ssd._read_verified = slow_read  # type: ignore[method-assign]
            acquire = asyncio.ensure_future(env.get(reader, [k]))
            while not read_in.is_set():
                await asyncio.sleep(0.01)
            delete = asyncio.ensure_future(env.t.delete(writer, [k]))
            await asyncio.sleep(0.05)
            read_go.set()
            ssd._read_verified = read  # type: ignore[method-assign]
            got, _ = await acquire
            assert got == [payload(k)]  # the reader asked first: it gets the block
            assert await delete == 1
            assert await env.t.lookup(writer, [k]) == [] and k not in writer.ns.index

    asyncio.run(go())
