"""kvtierd.lease_watch: the leases made without a call, as the daemon verifies them.

A fast-path reader leases through hazards in its session page, with no call; the
daemon's own figures are what it can check there: a hazard naming a COMMITTED block
of the page's namespace is a pin it honours.  These tests lease through a real
``LocalIndex`` against a real store, forge pages, and read the figures the way an
operator does (/metrics through the registry, ``kvtier stats``' table).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvtier import _native, _page
from kvtier._index import LocalIndex
from kvtier.cli import render_fast_path, render_namespaces
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.lease_watch import LOOK_BUDGET, Held, LeaseWatch, held_now
from kvtierd.metrics import Metrics
from kvtierd.shared_index import HAZARDS_N, SessionPage, hazard_of
from kvtierd.store import Session

from .conftest import StoreEnv
from .test_store import CAPACITY, keys, payload, put, session

pytestmark = pytest.mark.skipif(not hasattr(_native, "index_acquire"), reason="no native build")

_HI = _page.HAZARD_HI // 8  # the page's u64 index of its bound word
_HZ = _page.HAZARDS // 8
_SER = _page.SERIALS // 8


def _attach(env: StoreEnv, s: Session, max_hazards: int = HAZARDS_N
            ) -> tuple[SessionPage, LocalIndex]:
    shared = s.ns.index.shared
    assert shared is not None and shared.fd is not None
    page = SessionPage(s.ns.name, max_hazards=max_hazards)
    assert page.fd is not None
    env.store.attach_page(s, page)
    return page, LocalIndex(shared.fd, page.fd, 4096)


def _nbytes(ks: list[bytes]) -> int:
    return sum(len(payload(k)) for k in ks)


@pytest.fixture
def env(store_factory: Callable[..., StoreEnv]) -> StoreEnv:
    return store_factory(capacity=CAPACITY, extent_size=1 << 20)


def test_a_lease_without_a_call_is_seen_once_and_held_until_released(env: StoreEnv) -> None:
    s = session(env)
    ks = keys(6)
    put(env, s, ks)
    page, local = _attach(env, s)
    watch = LeaseWatch(env.store)
    watch.look()
    assert watch.tally("A").leases == 0 and held_now(s.ns) == Held()
    got = local.acquire(ks[:3] + [b"missing"])
    assert got is not None
    _slots, at, _serial = got
    assert held_now(s.ns) == Held(1, 3, _nbytes(ks[:3]))
    watch.look()
    watch.look()  # the same hazards: counted once
    t = watch.tally("A")
    assert (t.leases, t.blocks, t.nbytes, t.unverified) == (1, 3, _nbytes(ks[:3]), 0)
    assert watch.looks == 3
    local.release(at, 3)
    assert held_now(s.ns) == Held()
    watch.look()
    assert watch.tally("A").leases == 1
    # The same blocks leased again are a new lease (a new serial), in the same entries.
    again = local.acquire(ks[:2])
    assert again is not None and again[1] == at
    other = local.acquire(ks[1:4])  # a second lease beside it: block 1 twice
    assert other is not None
    assert held_now(s.ns) == Held(2, 4, _nbytes(ks[:4]))  # distinct blocks
    watch.look()
    t = watch.tally("A")
    assert (t.leases, t.blocks, t.nbytes) == (3, 3 + 5, _nbytes(ks[:3]) + _nbytes(ks[:2])
                                                + _nbytes(ks[1:4]))
    local.release(again[1], 2)
    local.release(other[1], 3)
    local.close()
    env.store.close_session(s)
    page.close()
    watch.look()  # a page that is gone is forgotten; the namespace's tally stays
    assert watch.tally("A").leases == 3 and not watch._pages


def test_a_look_in_the_middle_of_an_acquire_counts_its_lease_once(env: StoreEnv) -> None:
    s = session(env)
    ks = keys(4)
    put(env, s, ks)
    page = SessionPage("A")
    env.store.attach_page(s, page)
    hz = [env.store.slot_of(s.ns.index[k]) for k in ks]
    view = np.frombuffer(page.mapping, dtype=np.uint64)
    watch = LeaseWatch(env.store)
    view[_HI] = 4
    view[_SER:_SER + 4] = 9
    view[_HZ:_HZ + 2] = hz[:2]  # the reader has published two of its four hazards
    watch.look()
    view[_HZ + 2:_HZ + 4] = hz[2:]
    watch.look()
    t = watch.tally("A")
    assert (t.leases, t.blocks, t.nbytes) == (1, 4, _nbytes(ks))
    del view
    env.store.close_session(s)
    page.close()


def test_forged_hazards_are_never_counted_as_leases(env: StoreEnv) -> None:
    """Garbage, slots past the extent, another namespace's committed block, a free slot
    of its own, words without the hazard bit: counted as unverified, never as leases,
    blocks or bytes; the page's forged counters reach only the client-reported figures."""
    a, b = session(env, "A"), session(env, "B")
    put(env, a, keys(4, "a"))
    put(env, b, keys(4, "b"))
    (ext,) = a.ns.extents
    sid = ext.segment.segment_id
    free_slot = next(i for i in range(ext.n_slots)
                     if hazard_of(sid, i) not in {env.store.slot_of(blk)
                                                  for blk in a.ns.index.values()})
    forged = [2**64 - 1, 12345, hazard_of(sid, ext.n_slots), hazard_of(sid, 2**20 - 1),
              hazard_of(999, 1), env.store.slot_of(b.ns.index[b"b0000"]),
              hazard_of(sid, free_slot), hazard_of(sid, 0) & ~_page.HAZARD_BIT]
    page = SessionPage("A")
    env.store.attach_page(a, page)
    view = np.frombuffer(page.mapping, dtype=np.uint64)
    view[:_page.COUNTERS_N] = 2**40 - 1  # the client's counters, as it likes them
    view[_HI] = 2**63  # past the page: cut to the session's share
    view[_HZ:_HZ + len(forged)] = forged
    view[_SER:_SER + len(forged)] = np.arange(1, len(forged) + 1)
    watch = LeaseWatch(env.store)
    watch.look()
    t = watch.tally("A")
    assert (t.leases, t.blocks, t.nbytes, t.unverified) == (0, 0, 0, len(forged))
    assert held_now(a.ns) == Held() and watch.tally("B").blocks == 0
    # Every entry rewritten at every look: still nothing verified.
    for round_ in range(3):
        view[_SER:_SER + len(forged)] += 100
        watch.look()
        assert watch.tally("A").unverified == len(forged) * (round_ + 2)
    assert watch.tally("A").leases == 0
    # The one hazard that names a committed block of A is a lease (a pin the daemon
    # honours: it keeps the block), whoever wrote it.
    view[_HZ + 1] = env.store.slot_of(a.ns.index[b"a0001"])
    watch.look()
    assert (watch.tally("A").leases, watch.tally("A").blocks) == (1, 1)
    assert held_now(a.ns) == Held(1, 1, len(payload(b"a0001")))
    del view
    env.store.close_session(a)
    page.close()


def test_a_look_reads_no_entry_past_the_sessions_share(env: StoreEnv) -> None:
    s = session(env)
    ks = keys(4)
    put(env, s, ks)
    page = SessionPage("A", max_hazards=2)
    env.store.attach_page(s, page)
    view = np.frombuffer(page.mapping, dtype=np.uint64)
    view[_HI] = HAZARDS_N
    view[_HZ:_HZ + 4] = [env.store.slot_of(s.ns.index[k]) for k in ks]
    view[_SER:_SER + 4] = [1, 1, 2, 2]
    watch = LeaseWatch(env.store)
    watch.look()
    t = watch.tally("A")
    assert (t.leases, t.blocks) == (1, 2)
    assert held_now(s.ns) == Held(1, 2, _nbytes(ks[:2]))
    del view
    env.store.close_session(s)
    page.close()


def test_a_look_verifies_a_bounded_number_of_entries_and_none_waits_forever(
        env: StoreEnv) -> None:
    """Pages that all move at once (one uid churning its whole share) are verified
    ``LOOK_BUDGET`` entries a look, the next look starting after the last page counted."""
    s = session(env)
    ks = keys(4)
    put(env, s, ks)
    words = [env.store.slot_of(s.ns.index[k]) for k in ks]
    per_page = LOOK_BUDGET * 3 // 5  # two pages do not fit one look
    pages, views, readers = [], [], []
    for i in range(3):
        page = SessionPage("A")
        readers.append(session(env))
        env.store.attach_page(readers[-1], page)
        view = np.frombuffer(page.mapping, dtype=np.uint64)
        view[_HI] = per_page
        view[_HZ:_HZ + per_page] = np.resize(np.array(words, dtype=np.uint64), per_page)
        view[_SER:_SER + per_page] = i + 1
        pages.append(page)
        views.append(view)
    watch = LeaseWatch(env.store)
    seen = []
    for _ in range(4):
        watch.look()
        seen.append(watch.tally("A").blocks)
    assert seen == [per_page, 2 * per_page, 3 * per_page, 3 * per_page]
    assert watch.tally("A").leases == 3
    # Every page moves at every look: each is still counted, in turn.
    for _ in range(6):
        for v in views:
            v[_SER:_SER + per_page] += 10
        watch.look()
    assert watch.tally("A").blocks == 3 * per_page + 6 * per_page
    del view, views, v
    for reader, page in zip(readers, pages, strict=True):
        env.store.close_session(reader)
        page.close()


def test_metrics_show_verified_leases_and_keep_client_reported_apart(env: StoreEnv) -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.watch(env.store)
    watch = LeaseWatch(env.store)
    metrics.watch_leases(watch)
    s = session(env)
    ks = keys(5)
    put(env, s, ks)
    page, local = _attach(env, s)
    got = local.acquire(ks)
    assert got is not None
    watch.look()
    ns = {"namespace": "A"}

    def value(name: str, labels: dict[str, str] | None = None) -> float | None:
        return registry.get_sample_value(name, labels or {})

    assert value("kvtier_fast_path_leases_seen_total", ns) == 1
    assert value("kvtier_fast_path_leased_blocks_seen_total", ns) == 5
    assert value("kvtier_fast_path_leased_bytes_seen_total", ns) == _nbytes(ks)
    assert value("kvtier_fast_path_unverified_hazards_total", ns) == 0
    assert value("kvtier_fast_path_lease_looks_total") == 1
    assert value("kvtier_fast_path_leases", ns) == 1
    assert value("kvtier_fast_path_leased_blocks", ns) == 5
    assert value("kvtier_fast_path_leased_bytes", ns) == _nbytes(ks)
    assert value("kvtier_active_leases") == 1
    assert value("kvtier_namespace_blocks", {**ns, "tier": "dram", "state": "leased"}) == 5
    # The daemon's call figures saw no call.
    assert value("kvtier_hit_blocks_total", {**ns, "op": "acquire"}) is None
    local.release(got[1], len(ks))
    # Garbage hazards: no lease held, none active; the seen totals do not move.
    view = np.frombuffer(page.mapping, dtype=np.uint64)
    view[_HI] = 8
    view[_HZ:_HZ + 8] = np.arange(1, 9, dtype=np.uint64) | np.uint64(_page.HAZARD_BIT)
    view[_SER:_SER + 8] = np.arange(1, 9)
    watch.look()
    assert value("kvtier_fast_path_leases", ns) == 0
    assert value("kvtier_active_leases") == 0
    assert value("kvtier_namespace_blocks", {**ns, "tier": "dram", "state": "leased"}) == 0
    assert value("kvtier_fast_path_leases_seen_total", ns) == 1
    assert value("kvtier_fast_path_unverified_hazards_total", ns) == 8
    del view
    local.close()
    env.store.close_session(s)
    page.close()


def test_kvtier_stats_shows_verified_leases_apart_from_client_reported() -> None:
    s = pb.StatsResponse(lease_looks=250, lease_look_interval_seconds=0.01, namespaces=[
        pb.NamespaceStats(name="llama", client_reported=pb.ClientReported(acquire_hits=9),
                          fast_path_leases=pb.FastPathLeases(
                              leases=1, blocks=3, bytes=3 << 16, leases_seen=7,
                              blocks_seen=21, bytes_seen=21 << 16, unverified=2))])
    text = render_fast_path(s)
    head, columns, row = text.splitlines()
    assert head.startswith("leases without a call, verified by kvtierd")
    assert "every 10 ms, 250 so far" in head
    assert columns.split()[:3] == ["namespace", "leases", "now"]
    assert row.split() == ["llama", "1", "3", "192.0", "KiB", "7", "21", "1.3", "MiB", "2"]
    assert "client-reported" in render_namespaces(s)  # the clients' word: its own column
    # A daemon that does not look (older, or no fast path): no table.
    assert render_fast_path(pb.StatsResponse(namespaces=s.namespaces)) == ""
