"""The admin operations of ``Tiering``: list_keys, evict and drain.

Real segments and real spill files, through ``spill_harness.tiered`` (30 DRAM
slots of 64 KiB, an SSD tier in a directory on a disk filesystem); every
test ends with ``check()`` of the store and the SSD tier (the harness asserts
it).  ``clean_ahead=0`` keeps the demoter from copying blocks on its own, so
what is on the SSD tier is what the test put there.
"""

from __future__ import annotations

import asyncio
import errno
import io
import sys

import pytest

from kvtier.errors import FailedPrecondition, NotFound
from kvtierd.store import Lower
from kvtierd.tiering import TIER_DRAM, TIER_SHARED, TIER_SSD, SpillPolicy

from .spill_harness import Env, MiB, keys, payload, tiered
from .test_spill_faults import SPILL_FILE, FaultyIO, another_shm_dir, data_offset

QUIET = SpillPolicy.with_defaults(clean_ahead=0.0, backpressure_timeout=5.0)


async def list_all(env: Env, name: str, page_size: int) -> list[list[bytes]]:
    """Every page of ``name``, following the continuation keys."""
    pages: list[list[bytes]] = []
    after = None
    for _ in range(1000):
        page, after = await env.t.list_keys(name, page_size, after)
        pages.append([k.key for k in page])
        if after is None:
            return pages
    raise AssertionError("list_keys never reached its last page")


# ================================================================ list_keys
def test_list_keys_pages_through_dram_and_ssd_in_key_order(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s = env.session()
            ks = keys(60)[::-1]  # written in reverse: neither tier's order is key order
            await env.put_all(s, ks)
            await env.settle()
            in_dram = set(s.ns.index)
            assert 0 < len(in_dram) < 60  # both tiers hold some

            pages = await list_all(env, "A", 7)
            assert [len(p) for p in pages] == [7] * 8 + [4]
            flat = [k for p in pages for k in p]
            assert flat == sorted(ks)  # all of them, once each, in key-byte order

            page, after = await env.t.list_keys("A", 60, None)
            assert after is None
            by_key = {k.key: k for k in page}
            for k in ks:
                st = by_key[k]
                assert st.length == len(payload(k))
                if k in in_dram:
                    assert st.tier == TIER_DRAM
                    assert st.spilled == (s.ns.index[k].lower == Lower.CLEAN)
                else:
                    assert (st.tier, st.spilled) == (TIER_SSD, True)
                assert not st.leased

            # A leased block says so; the page size bounds the page exactly.
            leased = sorted(in_dram)[0]
            result, _ = await env.t.acquire(s, [leased])
            page, after = await env.t.list_keys("A", 1, None)
            assert len(page) == 1 and after == page[0].key == sorted(ks)[0]
            states = {k.key: k for k in (await env.t.list_keys("A", 60, None))[0]}
            assert states[leased].leased
            env.store.release(s, result.lease_id)

            # A page after the last key is empty and final.
            assert await env.t.list_keys("A", 5, max(ks)) == ([], None)

    asyncio.run(go())


def test_list_keys_of_an_unknown_namespace_is_not_found(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            env.session("A")
            with pytest.raises(NotFound) as exc:
                await env.t.list_keys("nope", 10, None)
            assert str(exc.value) == "namespace 'nope' is not known to this daemon"
            assert await env.t.list_keys("A", 10, None) == ([], None)  # declared, empty

    asyncio.run(go())


def test_list_keys_shows_a_namespace_only_the_ssd_holds_after_a_reboot(shm_dir: str,
                                                                        disk_dir: str) -> None:
    """After a reboot (DRAM gone) the SSD tier's blocks are listed before any client
    declares the namespace again."""

    async def go() -> None:
        ks = keys(12)
        async with tiered(shm_dir, ssd_dir=disk_dir, policy=QUIET) as env:
            s = env.session()
            await env.put_all(s, ks)
            assert (await env.t.drain(10.0)).done
        with another_shm_dir() as fresh:
            async with tiered(fresh, ssd_dir=disk_dir, policy=QUIET) as env:
                assert "A" not in env.store.namespaces
                page, after = await env.t.list_keys("A", 100, None)
                assert [k.key for k in page] == ks and after is None
                assert {(k.tier, k.spilled) for k in page} == {(TIER_SSD, True)}
                # and evict works there too
                res = await env.t.evict("A", ks[:3], [])
                assert (res.evicted, res.skipped, res.dropped) == (3, 0, {"ssd": 3})
                assert [k.key for k in (await env.t.list_keys("A", 100, None))[0]] == ks[3:]

    asyncio.run(go())


# ================================================================ evict
def test_evicting_the_dram_copy_leaves_the_ssd_copy_readable(shm_dir: str,
                                                              disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, policy=QUIET) as env:
            s = env.session()
            ks = keys(10)
            await env.put(s, ks)
            assert (await env.t.drain(10.0)).done
            evicted_before = env.store.evictions
            res = await env.t.evict("A", ks[:4], [TIER_DRAM])
            assert (res.evicted, res.skipped, res.dropped) == (4, 0, {"dram": 4})
            assert env.store.evictions == evicted_before + 4
            assert [k for k in ks if k in s.ns.index] == ks[4:]
            assert env.t.check() == []
            assert await env.t.lookup(s, ks) == [TIER_SSD] * 4 + [TIER_DRAM] * 6
            got, tiers = await env.get(s, ks)
            assert got == [payload(k) for k in ks]  # promoted back from the SSD
            assert tiers == [TIER_SSD] * 4 + [TIER_DRAM] * 6
            # evicting from a tier that does not hold the key is not an eviction
            res = await env.t.evict("A", [b"absent"], [TIER_DRAM])
            assert (res.evicted, res.skipped) == (0, 0)

    asyncio.run(go())


def test_evicting_the_only_copy_drops_the_block(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, policy=QUIET) as env:
            s = env.session()
            ks = keys(6)
            await env.put(s, ks)
            assert all(s.ns.index[k].lower == Lower.DIRTY for k in ks)
            res = await env.t.evict("A", ks[:2], [TIER_DRAM])
            assert (res.evicted, res.dropped) == (2, {"dram": 2})
            assert env.senv.evicted[-2:] and {b.key for b in env.senv.evicted[-2:]} == set(ks[:2])
            assert await env.t.lookup(s, ks) == []  # the prefix starts with a dropped key
            assert await env.t.lookup(s, ks[2:]) == [TIER_DRAM] * 4

    asyncio.run(go())


def test_evicting_every_tier_removes_the_block(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, policy=QUIET) as env:
            s = env.session()
            ks = keys(8)
            await env.put(s, ks)
            assert (await env.t.drain(10.0)).done
            res = await env.t.evict("A", ks[:3], [])  # every tier
            assert (res.evicted, res.skipped, res.dropped) == (3, 0, {"dram": 3, "ssd": 3})
            assert await env.t.lookup(s, ks[:3]) == []
            assert env.t.ssd is not None and env.t.ssd.stats()["blocks"] == 5

    asyncio.run(go())


def test_evicting_the_ssd_copy_of_a_dram_block_makes_it_dirty(shm_dir: str,
                                                              disk_dir: str) -> None:
    """The DRAM block stays; without its copy below it must be demoted before DRAM
    evicts it, so it is DIRTY again (and the dirty counters still balance)."""

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, policy=QUIET) as env:
            s = env.session()
            ks = keys(5)
            await env.put(s, ks)
            assert (await env.t.drain(10.0)).done
            assert all(s.ns.index[k].lower == Lower.CLEAN for k in ks)
            res = await env.t.evict("A", ks[:2], [TIER_SSD])
            assert (res.evicted, res.dropped) == (2, {"ssd": 2})
            assert [s.ns.index[k].lower for k in ks] == [Lower.DIRTY] * 2 + [Lower.CLEAN] * 3
            assert env.t.check() == []
            page, _ = await env.t.list_keys("A", 10, None)
            assert [(k.tier, k.spilled) for k in page] == (
                [(TIER_DRAM, False)] * 2 + [(TIER_DRAM, True)] * 3)

    asyncio.run(go())


def test_evict_skips_leased_blocks_and_blocks_being_promoted(shm_dir: str,
                                                              disk_dir: str) -> None:
    io = FaultyIO()

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, io=io, policy=QUIET) as env:
            s = env.session()
            ks = keys(6)
            await env.put(s, ks)
            assert (await env.t.drain(10.0)).done
            assert (await env.t.evict("A", ks[3:], [TIER_DRAM])).evicted == 3  # SSD only now
            lease, _ = await env.t.acquire(s, ks[:1])
            # A promotion of ks[3] in flight: its SSD read is held up.
            slow = io.slow("pread", 30.0, path=SPILL_FILE, when=lambda c: c.offset >= data_offset())
            reader = env.session()
            promoting = asyncio.ensure_future(env.t.acquire(reader, ks[3:4]))
            for _ in range(500):
                if slow.fired:
                    break
                await asyncio.sleep(0.01)
            assert slow.fired

            res = await env.t.evict("A", ks, [])
            assert (res.evicted, res.skipped) == (4, 2)  # ks[0] leased, ks[3] moving
            assert ks[0] in s.ns.index  # untouched, still leased
            env.store.release(s, lease.lease_id)
            io.clear()
            result, tiers = await promoting
            assert tiers == [TIER_SSD]
            env.store.release(reader, result.lease_id)
            assert await env.t.lookup(s, ks) == [TIER_DRAM]  # ks[1] was evicted everywhere
            assert await env.t.lookup(s, ks[3:4]) == [TIER_DRAM]  # the promotion finished

    asyncio.run(go())


def test_evict_all_covers_dram_ssd_and_their_shared_copies(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        ssd, shared = f"{disk_dir}/ssd", f"{disk_dir}/shared"
        async with tiered(shm_dir, ssd_dir=ssd, shared_dir=shared,
                          policy=SpillPolicy.with_defaults(clean_ahead=0.0,
                                                           backpressure_timeout=5.0,
                                                           shared_write="commit")) as env:
            s = env.session()
            other = env.session("B")
            ks = keys(50)
            await env.put_all(s, ks)
            await env.put(other, keys(3))
            await env.settle()
            assert env.t.shared is not None
            for _ in range(200):  # write-through publishes run in the background
                if all(env.t.shared.exists("A", k) for k in ks):
                    break
                await asyncio.sleep(0.02)
            res = await env.t.evict("A", None, [])
            assert (res.evicted, res.skipped) == (50, 0)
            assert res.dropped["shared"] == 50
            assert res.dropped.get("dram", 0) + res.dropped.get("ssd", 0) >= 50
            assert await env.t.list_keys("A", 100, None) == ([], None)
            assert not any(env.t.shared.exists("A", k) for k in ks)
            assert await env.t.lookup(s, ks) == []
            assert len((await env.t.list_keys("B", 10, None))[0]) == 3  # another namespace

            # only the shared copies
            await env.put(s, ks[:4])
            for _ in range(200):
                if all(env.t.shared.exists("A", k) for k in ks[:4]):
                    break
                await asyncio.sleep(0.02)
            res = await env.t.evict("A", ks[:4], [TIER_SHARED])
            assert (res.evicted, res.dropped) == (4, {"shared": 4})
            assert await env.t.lookup(s, ks[:4]) == [TIER_DRAM] * 4

    asyncio.run(go())


def test_evict_from_a_tier_the_daemon_lacks_is_failed_precondition(shm_dir: str,
                                                                   disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            env.session()
            with pytest.raises(FailedPrecondition) as exc:
                await env.t.evict("A", [b"k"], [TIER_SHARED])
            assert str(exc.value) == "this daemon has no shared tier (spill.shared_dir is not set)"
            with pytest.raises(NotFound) as nf:
                await env.t.evict("nope", None, [])
            assert str(nf.value) == "namespace 'nope' is not known to this daemon"

    asyncio.run(go())


# ================================================================ drain
def test_drain_copies_every_dram_block_below_and_keeps_it_in_dram(shm_dir: str,
                                                                  disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, policy=QUIET) as env:
            s = env.session()
            ks = keys(20)
            await env.put_all(s, ks)
            assert env.t.ssd is not None and env.t.ssd.stats()["blocks"] == 0
            p = await env.t.drain(10.0)
            size = sum(len(payload(k)) for k in ks)
            assert p.done and (p.total_blocks, p.done_blocks, p.failed_blocks) == (20, 20, 0)
            assert (p.total_bytes, p.done_bytes) == (size, size)
            assert all(s.ns.index[k].lower == Lower.CLEAN for k in ks)  # still in DRAM
            assert env.t.ssd.stats()["blocks"] == 20
            assert env.t.counters.demotions["dram->ssd"] == 20
            # Nothing is left to copy: the next drain is empty and done at once.
            p = await env.t.drain(10.0)
            assert p.done and (p.total_blocks, p.done_blocks) == (0, 0)

        # Durable: a "reboot" (fresh DRAM) reads every block back from the SSD tier.
        with another_shm_dir() as fresh:
            async with tiered(fresh, ssd_dir=disk_dir, policy=QUIET) as env:
                s = env.session()
                got, tiers = await env.get(s, ks)
                assert got == [payload(k) for k in ks] and tiers == [TIER_SSD] * 20

    asyncio.run(go())


def test_a_second_drain_call_joins_the_running_one(shm_dir: str, disk_dir: str) -> None:
    io = FaultyIO()

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, io=io, policy=QUIET) as env:
            s = env.session()
            await env.put_all(s, keys(12))
            io.slow("fdatasync", 0.3, path=SPILL_FILE)
            first = await env.t.drain(0.0)
            assert not first.done
            second = await env.t.drain(0.05)
            assert not second.done and second.total_blocks == 12  # the same drain
            last = await env.t.drain(20.0)
            assert last.done and (last.total_blocks, last.done_blocks) == (12, 12)
            io.clear()

    asyncio.run(go())


def test_drain_counts_blocks_it_cannot_copy_and_still_finishes(shm_dir: str,
                                                               disk_dir: str) -> None:
    io = FaultyIO()
    rule = io.fail("pwrite", errno.EIO, path=SPILL_FILE, when=lambda c: c.offset >= data_offset(),
                   times=4)

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, io=io, policy=QUIET) as env:
            s = env.session()
            ks = keys(10)
            await env.put(s, ks)
            p = await env.t.drain(10.0)
            assert rule.fired == 4
            assert p.done and (p.total_blocks, p.done_blocks, p.failed_blocks) == (10, 6, 4)
            failed = [k for k in ks if s.ns.index[k].lower == Lower.UNSPILLABLE]
            assert len(failed) == 4
            assert env.t.counters.faults["ssd/eio"] == 4
            # The disk is fine again: a new drain retries exactly the failed blocks.
            p = await env.t.drain(10.0)
            assert p.done and (p.total_blocks, p.done_blocks, p.failed_blocks) == (4, 4, 0)
            assert all(s.ns.index[k].lower == Lower.CLEAN for k in ks)

    asyncio.run(go())


def test_drain_into_an_ssd_smaller_than_dram_reports_the_overflow_as_failed(
        shm_dir: str, disk_dir: str) -> None:
    """21 SSD slots for 30 DRAM blocks: the SSD tier makes room by evicting copies the
    drain made earlier; those blocks are failed (and DIRTY again), not done."""

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, ssd_capacity=MiB, file_bytes=MiB,
                          policy=QUIET) as env:
            s = env.session()
            ks = keys(30)
            await env.put_all(s, ks)
            p = await env.t.drain(20.0)
            assert p.done and p.total_blocks == 30
            assert (p.done_blocks, p.failed_blocks) == (21, 9)
            assert env.t.ssd is not None
            on_ssd = [k for k in ks if env.t.ssd.index.get(("A", k)) is not None]
            assert len(on_ssd) == 21
            for k in ks:
                assert s.ns.index[k].lower == (Lower.CLEAN if k in on_ssd else Lower.DIRTY)

    asyncio.run(go())


def test_drain_without_a_spill_tier_is_failed_precondition(shm_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir) as env:
            env.session()
            with pytest.raises(FailedPrecondition) as exc:
                await env.t.drain(0.0)
            assert str(exc.value) == ("this daemon has no spill tier to drain DRAM to: set "
                                      "spill.ssd_dir (or spill.shared_dir)")

    asyncio.run(go())


def test_drain_publishes_to_the_shared_tier_without_an_ssd(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, shared_dir=disk_dir, policy=QUIET) as env:
            s = env.session()
            ks = keys(8)
            await env.put(s, ks)
            p = await env.t.drain(10.0)
            assert p.done and (p.total_blocks, p.done_blocks, p.failed_blocks) == (8, 8, 0)
            assert env.t.shared is not None
            assert all(env.t.shared.exists("A", k) for k in ks)
            assert all(s.ns.index[k].lower == Lower.CLEAN for k in ks)

    asyncio.run(go())


# ================================================================ kvtier drain's progress display
def test_drain_progress_is_plain_lines_without_a_tty_or_without_rich(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier import cli
    from kvtier.v1 import kvtier_pb2 as pb

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(cli._progress_display(), cli._PlainProgress)  # captured: not a TTY
    monkeypatch.setattr(sys, "stdout", Tty())
    monkeypatch.setitem(sys.modules, "rich.progress", None)  # rich not installed
    assert isinstance(cli._progress_display(), cli._PlainProgress)
    monkeypatch.undo()

    tty = Tty()
    monkeypatch.setattr(sys, "stdout", tty)
    bar = cli._progress_display()
    assert isinstance(bar, cli._RichProgress)
    bar.update(pb.DrainResponse(total_blocks=4, done_blocks=1, total_bytes=4 << 20,
                                done_bytes=1 << 20))
    bar.update(pb.DrainResponse(total_blocks=4, done_blocks=4, total_bytes=4 << 20,
                                done_bytes=4 << 20, done=True))
    bar.close()
    assert "4/4 blocks, 0 failed" in tty.getvalue()
    monkeypatch.undo()

    # The plain display: at most a line a second, and always the last one.
    capsys.readouterr()
    plain = cli._PlainProgress()
    plain.update(pb.DrainResponse(total_blocks=3, done_blocks=1, total_bytes=3 << 20,
                                  done_bytes=1 << 20))
    plain.update(pb.DrainResponse(total_blocks=3, done_blocks=2, total_bytes=3 << 20,
                                  done_bytes=2 << 20))  # within the second: not shown
    plain.update(pb.DrainResponse(total_blocks=3, done_blocks=3, total_bytes=3 << 20,
                                  done_bytes=3 << 20, failed_blocks=0, done=True))
    err = capsys.readouterr().err
    assert err == ("drain: 1/3 blocks, 1.0 MiB/3.0 MiB, 0 failed\n"
                   "drain: 3/3 blocks, 3.0 MiB/3.0 MiB, 0 failed, done\n")
