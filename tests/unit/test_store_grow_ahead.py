"""Growth ahead of need (``dram.grow_ahead``): a claim that leaves a namespace
few free slots makes its next extent in the background, from the unused budget only.

Each scenario runs in one event loop (the growth is a task on it) with an extent
factory over real segments whose calls the test can hold (``Gate``): a held call is
an extent being made (and pre-faulted) in a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest

from kvtier.errors import CapacityExhausted
from kvtierd.segments import Segment, SegmentLayout, segment_file_name
from kvtierd.shared_index import SessionPage
from kvtierd.store import Namespace, Session, Store, StoreOptions
from kvtierd.store.budget import GROW_AHEAD_RETRY

from .conftest import BOOT_EPOCH, PEER, FakeClock, segment_factory

T = TypeVar("T")
KiB = 1 << 10
BLOCK = 64 * KiB
EXTENT = 1 << 20
_LAYOUT = SegmentLayout.fit(BLOCK, EXTENT)
assert _LAYOUT is not None
SLOTS = _LAYOUT.n_slots  # 15 a extent; growth ahead starts below max(claim, 8) free
EXTENT_FILE = _LAYOUT.file_bytes
ONE_SLOT = SegmentLayout.one_slot_file_bytes(BLOCK)


class Gate:
    """An extent factory over real segments: ``hold()`` makes the next calls wait (in
    their worker thread) until ``release()``; ``fail`` makes them raise instead."""

    def __init__(self, directory: str) -> None:
        self._real = segment_factory(directory)
        self._open = threading.Event()
        self._open.set()
        self.calls = 0
        self.waiting = 0
        self.fail: BaseException | None = None

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def __call__(self, ns: Namespace, index: int, layout: SegmentLayout, seg_id: int) -> Segment:
        self.calls += 1
        self.waiting += 1
        try:
            assert self._open.wait(20), "the test never released the gate"
        finally:
            self.waiting -= 1
        if self.fail is not None:
            raise self.fail
        return self._real(ns, index, layout, seg_id)


@pytest.fixture
def gate(shm_dir: str) -> Gate:
    return Gate(shm_dir)


def make(gate: Gate, capacity: int, *, grant_bytes: int = 0, grow_ahead: bool = True,
         dram_quota_of: Callable[[str], int] | None = None) -> tuple[Store, FakeClock]:
    clock = FakeClock()
    options = StoreOptions(grow_ahead=grow_ahead)
    if dram_quota_of is not None:
        options = dataclasses.replace(options, dram_quota_of=dram_quota_of)
    store = Store(capacity=capacity, extent_size=EXTENT, extent_factory=gate,
                  lease_ttl=30.0, reservation_ttl=10.0, boot_epoch=BOOT_EPOCH, clock=clock,
                  publish=True, grant_bytes=grant_bytes, options=options)
    return store, clock


@pytest.fixture
def stores() -> Iterator[list[Store]]:
    """Stores a test made: each one's check() must be clean at the end, then closed."""
    made: list[Store] = []
    yield made
    problems: list[str] = []
    for store in made:
        try:
            problems += store.check()
        finally:
            store.close_all()
    assert problems == []


def scenario(store: Store, body: Callable[[], Awaitable[T]]) -> T:
    """Run ``body`` in a fresh loop; then stop growth (cancelling what is in flight) and
    wait for retirements, so nothing is left pending when the loop closes."""

    async def go() -> T:
        try:
            return await body()
        finally:
            await store.stop_growth()
            await store.drain()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            assert others == [], f"tasks left pending: {others}"

    return asyncio.run(go())


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


async def settled(store: Store) -> None:
    """No growth ahead in flight."""
    await until(lambda: not store.budget._ahead and not store.budget._making, "the growth ahead to end")


def keys(n: int, start: int = 0) -> list[bytes]:
    return [f"k{i:05d}".encode() for i in range(start, start + n)]


async def put(store: Store, s: Session, ks: list[bytes]) -> None:
    """Reserve and commit ``ks`` (a byte each is enough for the store)."""
    res = await store.reserve(s, ks)
    store.commit(s, res.reservation_id, [1] * len(res.slots), None)


def files(directory: str) -> set[str]:
    return set(os.listdir(directory))


def balanced(store: Store) -> bool:
    held = sum(e.bytes for ns in store.namespaces.values() for e in ns.extents)
    return held + store.budget_free == store.capacity and store.budget_free >= 0


# ================================================================ tests
def test_a_claim_that_leaves_few_free_slots_grows_the_next_extent_ahead(
        gate: Gate, stores: list[Store]) -> None:
    store, _clock = make(gate, 4 * EXTENT_FILE)
    stores.append(store)
    s = store.open_session("A", BLOCK, "m", PEER)

    async def body() -> None:
        await put(store, s, keys(4))  # the reserve grows the first extent itself
        assert gate.calls == 1 and s.ns.free_slots() == SLOTS - 4  # 11 >= max(4, 8): enough
        assert not store.budget._ahead
        await put(store, s, keys(6, 4))  # 5 free left, under max(6, 8): one growth ahead
        assert s.ns in store.budget._ahead
        await settled(store)
        assert len(s.ns.extents) == 2 and store.grown_ahead == 1 and gate.calls == 2
        assert s.ns.free_slots() == 2 * SLOTS - 10
        assert store.evictions == 0 and balanced(store) and store.check() == []
        # A claim larger than half an extent keeps its own size free ahead.
        await put(store, s, keys(14, 10))  # 6 free left, under 14: one extent (21 >= 14)
        await settled(store)
        assert len(s.ns.extents) == 3 and s.ns.free_slots() == 3 * SLOTS - 24
        assert store.grown_ahead == 2

    scenario(store, body)


def test_the_next_reserve_takes_free_slots_without_waiting_for_the_growth(
        gate: Gate, stores: list[Store]) -> None:
    store, _clock = make(gate, 4 * EXTENT_FILE)
    stores.append(store)
    s = store.open_session("A", BLOCK, "m", PEER)

    async def body() -> None:
        await put(store, s, keys(4))
        gate.hold()  # the next extent takes "forever" to pre-fault
        await put(store, s, keys(6, 4))
        await until(lambda: gate.waiting == 1, "the growth ahead to start making its extent")
        assert store.growing_bytes == EXTENT_FILE
        assert store.check() == []  # an extent being made balances the budget
        # The next reserve fits in the free slots: it does not wait for the extent.
        await asyncio.wait_for(put(store, s, keys(5, 10)), 5)
        assert gate.waiting == 1 and len(s.ns.extents) == 1 and s.ns.free_slots() == 0
        gate.release()
        await settled(store)
        assert len(s.ns.extents) == 2 and store.growing_bytes == 0
        assert store.evictions == 0 and balanced(store)

    scenario(store, body)


def test_a_reserve_that_needs_more_waits_for_the_growth_ahead_rather_than_evict(
        gate: Gate, stores: list[Store]) -> None:
    """The growth ahead took the last of the budget: a reserve that needs more than the
    free slots waits for it (the grow lock) and takes its slots; nothing is evicted."""
    store, _clock = make(gate, 2 * EXTENT_FILE)
    stores.append(store)
    s = store.open_session("A", BLOCK, "m", PEER)

    async def body() -> None:
        await put(store, s, keys(10))
        gate.hold()
        await until(lambda: gate.waiting == 1, "the growth ahead")
        assert store.budget_free == 0
        reserve = asyncio.ensure_future(put(store, s, keys(10, 10)))
        await asyncio.sleep(0.05)
        assert not reserve.done()  # waiting for the extent, not evicting
        gate.release()
        await asyncio.wait_for(reserve, 10)
        await settled(store)
        assert store.evictions == 0 and len(s.ns.extents) == 2 and gate.calls == 2
        assert s.ns.committed == 20

    scenario(store, body)


def test_growth_ahead_never_passes_the_capacity_nor_evicts(
        gate: Gate, stores: list[Store]) -> None:
    """Two and a half extents of budget: growth ahead makes the third one smaller, then
    stops; the reserves evict only once the budget cannot hold a slot."""
    capacity = 2 * EXTENT_FILE + EXTENT_FILE // 2
    store, _clock = make(gate, capacity)
    stores.append(store)
    s = store.open_session("A", BLOCK, "m", PEER)

    async def body() -> None:
        for i in range(8):
            evicted_before, room_before = store.evictions, store.budget_free >= ONE_SLOT
            await put(store, s, keys(6, 6 * i))
            await settled(store)
            assert balanced(store)
            if room_before:
                assert store.evictions == evicted_before  # never evicts while it may grow
        assert len(s.ns.extents) == 3 and store.budget_free < ONE_SLOT
        assert s.ns.extent_bytes() <= capacity
        assert store.evictions > 0  # 48 blocks put in fewer slots
        calls = gate.calls
        await put(store, s, keys(6, 100))  # DRAM is full: nothing more is grown
        await settled(store)
        assert gate.calls == calls and not store.budget._ahead

    scenario(store, body)


def test_growth_ahead_never_passes_a_quota(gate: Gate, stores: list[Store]) -> None:
    quota = EXTENT_FILE + EXTENT_FILE // 2
    store, _clock = make(gate, 8 * EXTENT_FILE,
                         dram_quota_of=lambda name: quota if name == "A" else 0)
    stores.append(store)
    a = store.open_session("A", BLOCK, "m", PEER)
    b = store.open_session("B", BLOCK, "m", PEER)

    async def body() -> None:
        for i in range(6):
            await put(store, a, keys(6, 6 * i))
            await settled(store)
            assert a.ns.extent_bytes() <= quota and balanced(store)
        assert len(a.ns.extents) == 2  # the second one what the quota left room for
        assert store.evictions > 0
        # Another namespace without a quota grows ahead as usual.
        await put(store, b, keys(10))
        await settled(store)
        assert len(b.ns.extents) == 2

    scenario(store, body)


def test_a_quota_of_one_extent_grows_nothing_ahead(gate: Gate, stores: list[Store]) -> None:
    store, _clock = make(gate, 8 * EXTENT_FILE, dram_quota_of=lambda name: EXTENT_FILE)
    stores.append(store)
    s = store.open_session("A", BLOCK, "m", PEER)

    async def body() -> None:
        await put(store, s, keys(14))
        assert not store.budget._ahead and gate.calls == 1

    scenario(store, body)


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("a bug in the factory")],
                         ids=["oserror", "bug"])
def test_a_failed_growth_ahead_gives_everything_back_and_pauses(
        gate: Gate, stores: list[Store], shm_dir: str, error: BaseException,
        caplog: pytest.LogCaptureFixture) -> None:
    store, clock = make(gate, 4 * EXTENT_FILE)
    stores.append(store)
    s = store.open_session("A", BLOCK, "m", PEER)

    async def body() -> None:
        await put(store, s, keys(4))
        before = files(shm_dir)
        gate.fail = error
        with caplog.at_level(logging.WARNING, logger="kvtierd.store.budget"):
            await put(store, s, keys(6, 4))
            await settled(store)
        assert "growing namespace 'A' ahead of need failed" in caplog.text
        assert gate.calls == 2 and len(s.ns.extents) == 1 and s.ns.next_extent_index == 1
        assert store.budget_free == store.capacity - EXTENT_FILE and store.growing_bytes == 0
        assert files(shm_dir) == before and store.check() == []
        # Paused: claims start nothing for a while; a reserve that needs room grows (and
        # reports) it itself.
        await put(store, s, keys(2, 10))
        assert not store.budget._ahead and gate.calls == 2
        if isinstance(error, OSError):
            with pytest.raises(CapacityExhausted, match="could not create a DRAM extent"):
                await put(store, s, keys(10, 12))
        gate.fail = None
        clock.advance(GROW_AHEAD_RETRY)
        await put(store, s, keys(1, 30))  # 2 free left: growth ahead again
        await settled(store)
        assert len(s.ns.extents) == 2 and balanced(store)

    scenario(store, body)


def test_stop_cancels_the_growth_and_removes_its_extent(
        gate: Gate, stores: list[Store], shm_dir: str) -> None:
    store, _clock = make(gate, 4 * EXTENT_FILE)
    stores.append(store)
    s = store.open_session("A", BLOCK, "m", PEER)

    async def body() -> None:
        await put(store, s, keys(4))
        before = files(shm_dir)
        gate.hold()
        await put(store, s, keys(6, 4))
        await until(lambda: gate.waiting == 1, "the growth ahead")
        stopping = asyncio.ensure_future(store.stop_growth())
        await until(lambda: not store.budget._ahead, "the growth ahead to be cancelled")
        # Its bytes and number are back at once; the file being made is not there yet.
        assert store.budget_free == store.capacity - EXTENT_FILE and store.growing_bytes == 0
        assert not stopping.done()  # it waits for the file being made
        gate.release()
        await asyncio.wait_for(stopping, 10)
        await store.drain()
        assert files(shm_dir) == before  # the made file was removed
        assert len(s.ns.extents) == 1 and store.check() == []
        await put(store, s, keys(5, 10))  # stopped: claims start nothing any more
        assert not store.budget._ahead and gate.calls == 2

    scenario(store, body)


def _attach(store: Store, s: Session) -> SessionPage:
    page = SessionPage(s.ns.name, writes=True)
    store.attach_page(s, page)
    return page


def test_a_refill_that_needs_an_extent_grows_it_ahead(gate: Gate, stores: list[Store]) -> None:
    """Grants are never made by growing (-1: the writer's Reserve grows), but the growth
    starts then, in the background, so that Reserve finds the extent made."""
    store, _clock = make(gate, 4 * EXTENT_FILE, grant_bytes=4 * BLOCK)
    stores.append(store)
    s = store.open_session("A", BLOCK, "m", PEER)

    async def body() -> None:
        store.budget.grow_ahead = False
        await put(store, s, keys(SLOTS))  # the first extent full
        store.budget.grow_ahead = True
        page = _attach(store, s)
        try:
            assert store.refill_grants(s, 2) == -1
            assert s.ns in store.budget._ahead
            await settled(store)
            assert len(s.ns.extents) == 2 and gate.calls == 2
            assert store.refill_grants(s, 2) == 2
        finally:
            store.close_session(s)
            page.close()

    scenario(store, body)


def test_a_namespace_dropped_while_its_first_extent_is_made_gets_nothing(
        gate: Gate, stores: list[Store], shm_dir: str) -> None:
    """A writer's refill starts growing a fresh namespace, then its only session closes
    (the namespace is forgotten): the made file is removed and its bytes come back."""
    store, _clock = make(gate, 4 * EXTENT_FILE, grant_bytes=4 * BLOCK)
    stores.append(store)
    s = store.open_session("A", BLOCK, "m", PEER)
    ns = s.ns

    async def body() -> None:
        page = _attach(store, s)
        gate.hold()
        assert store.refill_grants(s, 2) == -1
        await until(lambda: gate.waiting == 1, "the growth ahead")
        store.close_session(s)
        page.close()
        assert "A" not in store.namespaces
        gate.release()
        await settled(store)
        await store.drain()
        assert ns.extents == [] and store.budget_free == store.capacity
        digest = segment_file_name("A", 0).split(".")[0]
        assert [f for f in files(shm_dir) if f.startswith(digest)] == []

    scenario(store, body)


def test_growth_ahead_is_off_unless_the_daemon_turns_it_on(
        gate: Gate, stores: list[Store]) -> None:
    store, _clock = make(gate, 4 * EXTENT_FILE, grow_ahead=False)
    stores.append(store)
    s = store.open_session("A", BLOCK, "m", PEER)

    async def body() -> None:
        await put(store, s, keys(SLOTS))
        await asyncio.sleep(0.01)
        assert gate.calls == 1 and not store.budget._ahead

    scenario(store, body)


def test_the_config_knob(tmp_path: Any) -> None:
    from kvtierd.config import config_to_dict, load_config

    on = load_config(env={}, overrides=[f"dram.shm_dir={tmp_path}"])
    off = load_config(env={}, overrides=[f"dram.shm_dir={tmp_path}", "dram.grow_ahead=false"])
    assert on.dram.grow_ahead is True and off.dram.grow_ahead is False
    assert config_to_dict(off)["dram"]["grow_ahead"] is False



def test_a_daemon_stopped_while_it_grows_ahead_leaves_no_task_nor_file(
        tmp_path: Any, shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon turns growth ahead on (``dram.grow_ahead``, default true); its stop
    cancels a growth in flight and waits for the file being made, then removes it."""
    import kvtier
    from kvtierd import app
    from kvtierd.config import load_config

    sock = tempfile.mkdtemp(prefix="kvt-ga-")  # Unix socket paths are short
    shm = os.path.join(shm_dir, "d")
    cfg = load_config(env={}, overrides=[
        f"server.socket_dir={sock}", f"dram.shm_dir={shm}", f"dram.capacity={4 * EXTENT}",
        f"dram.extent_size={EXTENT}", "metrics.address=", "spill.ssd_dir=", "dram.mlock=false"])
    assert cfg.dram.grow_ahead
    held = threading.Event()  # set: the extents after the first one may be made
    making: list[int] = []

    def create(*args: Any) -> Segment:
        making.append(1)
        assert len(making) == 1 or held.wait(20)
        return real(*args)

    real = app._create_extent
    monkeypatch.setattr(app, "_create_extent", create)

    def client_puts() -> None:
        with kvtier.Client(sock, namespace="A", block_bytes=BLOCK, model_uid="m",
                           fast_path=False) as c:
            block = np.zeros(16, np.uint8)
            c.put(keys(10), [block] * 10)  # grows the first extent, then one ahead

    async def go() -> None:
        daemon = await app.create_daemon(cfg)
        try:
            await asyncio.to_thread(client_puts)
            await until(lambda: bool(daemon.store.budget._ahead) and len(making) == 2,
                        "the growth ahead")
        finally:
            stopping = asyncio.ensure_future(daemon.stop(grace=0))
            await asyncio.sleep(0.05)
            held.set()
            await asyncio.wait_for(stopping, 20)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert others == []

    try:
        asyncio.run(go())
    finally:
        held.set()
        shutil.rmtree(sock, ignore_errors=True)
    digest = segment_file_name("A", 0).split(".")[0]
    left = sorted(f for f in os.listdir(shm) if f.startswith(digest))
    assert [f.split(".")[1] for f in left] == ["000000", "000000"]  # the first extent only


def test_a_reserve_that_finds_no_room_while_another_namespace_grows_waits_for_it(
        gate: Gate, stores: list[Store]) -> None:
    """Reclaim skips a namespace while it grows (its growth holds budget its extents
    cannot give back yet): a reserve of another namespace that finds no room then waits
    for that growth and plans again, instead of refusing for a moment's state (found by
    the hostile fast-path test: B refused with nothing of its own pinned while C grew)."""
    store, _clock = make(gate, 2 * EXTENT_FILE)
    stores.append(store)
    a = store.open_session("A", BLOCK, "m", PEER)
    b = store.open_session("B", BLOCK, "m", PEER)

    async def body() -> None:
        await put(store, a, keys(4))  # A's first extent, made by the reserve
        gate.hold()
        await put(store, a, keys(6, 4))  # few free left: A grows ahead, held in the factory
        await until(lambda: gate.waiting == 1, "A's growth ahead to start")
        assert store.budget_free < EXTENT_FILE  # the whole budget is A's now
        asyncio.get_running_loop().call_later(0.2, gate.release)
        await asyncio.wait_for(put(store, b, keys(1)), 10)  # waits, then reclaims from A
        assert store.namespaces["B"].committed == 1
        await settled(store)
        assert balanced(store) and store.check() == []

    scenario(store, body)


def test_a_reserve_with_no_room_and_no_growth_anywhere_still_refuses_at_once(
        gate: Gate, stores: list[Store]) -> None:
    store, _clock = make(gate, EXTENT_FILE, grow_ahead=False)
    stores.append(store)
    a = store.open_session("A", BLOCK, "m", PEER)

    async def body() -> None:
        await put(store, a, keys(SLOTS))
        lease = store.acquire(a, keys(SLOTS))  # every slot pinned, nothing growing
        assert lease.hits == SLOTS
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(CapacityExhausted):
            await store.reserve(a, keys(1, 200))
        assert asyncio.get_running_loop().time() - t0 < 1.0
        store.release(a, lease.lease_id)

    scenario(store, body)


def test_every_extent_made_is_told_to_on_extent_as_it_is_added(
        gate: Gate, stores: list[Store]) -> None:
    """``Store.attach_cluster`` (the cluster tier maps each new extent into its agent then,
    not at the extent's first publish): called once per extent, ahead or on demand."""
    store, _clock = make(gate, 4 * EXTENT_FILE)
    stores.append(store)
    told: list[int] = []
    store.attach_cluster(lambda seg: told.append(seg.segment_id))
    s = store.open_session("A", BLOCK, "m", PEER)

    async def body() -> None:
        await put(store, s, keys(10))  # the first extent, then one grown ahead
        await settled(store)

    scenario(store, body)
    assert told == [e.segment.segment_id for e in s.ns.extents] and len(told) == 2
