"""What a session page costs the daemon and what it can make the daemon believe.

The page is the client's to write at any time.  These tests write it as a hostile
client would, through the same mapping the client library uses, and check the
daemon's side: its hazard reads follow the page exactly however the words change
(``SessionPage.hazards``: parsed only when they moved), only the
entries of the session's share are read, the expiry sweep ends exactly the leases
held past the TTL, and the counters it reports are cut to what a client could have
done and never overflow the daemon's totals.
"""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvtier import _native, _page
from kvtier._index import LocalIndex, _hazard_limit
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.counters import (
    COUNTER_CAP,
    HOST_CALLS_PER_SECOND,
    HOST_KEYS_PER_SECOND,
    HOST_READ_BYTES_PER_SECOND,
    ClientReported,
    saturating_add,
)
from kvtierd.metrics import Metrics
from kvtierd.shared_index import (
    HAZARDS_N,
    SessionPage,
    SharedIndex,
    collect_hazards,
    hazard_of,
)

pytestmark = pytest.mark.skipif(not hasattr(_native, "index_acquire"), reason="no native build")

_HI = _page.HAZARD_HI
_HAZARDS = _page.HAZARDS
_SERIALS = _page.SERIALS


def _write(page: SessionPage, values: dict[int, tuple[int, int]]) -> None:
    """Set entries i -> (hazard, serial) as a client would, the bound word first."""
    hi = max(values, default=-1) + 1
    struct.pack_into("<Q", page.mapping, _HI, max(hi, struct.unpack_from("<Q", page.mapping,
                                                                           _HI)[0]))
    for i, (value, serial) in values.items():
        struct.pack_into("<Q", page.mapping, _SERIALS + 8 * i, serial)
        struct.pack_into("<Q", page.mapping, _HAZARDS + 8 * i, value)


def _truth(page: SessionPage, limit: int = HAZARDS_N) -> set[int]:
    """Every non-zero entry below the client's bound word and the share."""
    hi = min(struct.unpack_from("<Q", page.mapping, _HI)[0], limit)
    words = np.frombuffer(page.mapping, dtype="<u8", count=hi, offset=_HAZARDS)
    return {int(w) for w in words if w}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 5)),
                         max_size=30), min_size=1, max_size=12),
       st.integers(0, 2**32))
def test_the_union_follows_every_change_of_every_page(
        rounds: list[list[tuple[int, int, int]]], seed: int) -> None:
    """Pages come and go and rewrite entries between reads: after each read the union
    is exactly what the pages hold (the same values in several pages counted once, a
    value one page drops still held while another has it)."""
    rng = random.Random(seed)
    pages = {sid: SessionPage("ns", max_hazards=rng.choice([HAZARDS_N, 40, 8]))
             for sid in range(4)}
    try:
        live = dict(pages)
        for changes in rounds:
            for sid, entry, value in changes:
                page = pages[sid]
                _write(page, {entry: (hazard_of(1 + value, entry % 3) if value else 0, 9)})
            if rng.random() < 0.2 and live:  # a session ends
                live.pop(rng.choice(list(live)))
            got = collect_hazards(live.values())
            want = set().union(*(_truth(p, p.max_hazards) for p in live.values()))
            assert set(got) == want and len(got) == len(want) and bool(got) == bool(want)
            assert all(v in got for v in want) and hazard_of(99, 1) not in got
            assert collect_hazards(live.values()) == want
            again = collect_hazards(live.values(), got)
            assert again is got  # nothing moved: the same set, its union made once
            mask = (1 << 63) - 1
            assert got.refs.tolist() == sorted({v & mask for v in want})
            probe = np.array(sorted(want)[:2] + [hazard_of(99, 1)], dtype=np.uint64)
            assert got.any_of(probe) == bool(want) and not got.any_of(probe[-1:])
    finally:
        for page in pages.values():
            page.close()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=60), st.lists(st.integers(0, 2**64 - 1),
                                                                      max_size=60))
def test_any_words_a_client_writes_read_as_exactly_the_set_they_are(
        one: list[int], two: list[int]) -> None:
    """Words without the hazard flag, repeated, zero, at the ends of the range: the union,
    its refs (flag off, each once, sorted) and membership are exactly a set's."""
    pages = [SessionPage("ns"), SessionPage("ns")]
    try:
        for page, values in zip(pages, (one, two), strict=True):
            _write(page, {i: (v, 1) for i, v in enumerate(values)})
        got = collect_hazards(pages)
        want = {v for v in one + two if v}
        assert set(got) == want and len(got) == len(want)
        assert all(v in got for v in want) and 0 not in got and -1 not in got
        mask = (1 << 63) - 1
        assert got.refs.tolist() == sorted({v & mask for v in want})
        words = got.words.tolist()
        assert words == sorted(want)
        _write(pages[0], {0: (0 if one and one[0] else 5, 1)})  # a page moves: a new set
        assert collect_hazards(pages, got) is not got or not one
    finally:
        for page in pages:
            page.close()


def test_entries_past_the_share_are_never_read_and_the_client_keeps_to_it() -> None:
    shared = SharedIndex("ns", lower_tiers=False)
    keys = [bytes([i]) * 16 for i in range(12)]
    for i, k in enumerate(keys):
        shared.add(k, (7, i, i * 4096, 10, None))
    page = SessionPage("ns", max_hazards=5)
    assert page.fd is not None and shared.fd is not None
    local = LocalIndex(shared.fd, page.fd, 4096)
    try:
        assert _hazard_limit(page.mapping) == 5
        got = local.acquire(keys[:4])
        assert got is not None and len(got[0]) == 4
        assert local.acquire(keys[4:6]) is None  # would pass the share: the Acquire call
        one = local.acquire(keys[4:5])
        assert one is not None and len(one[0]) == 1
        assert page.hazards() == {hazard_of(7, i) for i in range(5)}
        # A hostile client writes past its share: none of it is read.
        _write(page, {i: (hazard_of(9, i), 3) for i in range(5, HAZARDS_N)})
        assert page.hazards() == {hazard_of(7, i) for i in range(5)}
        assert all(v >> 32 & 0x7FFF_FFFF != 9 for v in collect_hazards([page]))
    finally:
        local.close()
        page.close()
        shared.close()


def test_a_share_of_zero_reads_nothing_and_an_older_daemon_means_all() -> None:
    page = SessionPage("ns", max_hazards=0)
    try:
        _write(page, {i: (hazard_of(3, i), 1) for i in range(10)})
        assert page.hazards() == frozenset() and page.leases() == 0
        assert _hazard_limit(page.mapping) == 0
        struct.pack_into("<Q", page.mapping, 104, 0)  # what an older daemon's page holds
        assert _hazard_limit(page.mapping) == HAZARDS_N
    finally:
        page.close()


def test_an_unchanged_page_is_not_parsed_again() -> None:
    page = SessionPage("ns")
    try:
        _write(page, {i: (hazard_of(2, i), 1 + i // 4) for i in range(HAZARDS_N)})
        first = page.hazards()
        assert len(first) == HAZARDS_N and page.leases() == HAZARDS_N // 4
        assert page.hazards() is first  # the same object: nothing was parsed
        _write(page, {3: (0, 0)})
        assert page.hazards() == first - {hazard_of(2, 3)}
    finally:
        page.close()


def test_the_sweep_ends_exactly_the_leases_held_past_the_ttl() -> None:
    """A lease is (entry, hazard, serial): rewritten with a new serial it starts again;
    left alone it ends at the TTL; the client's bound word is honoured."""
    page = SessionPage("ns")
    try:
        _write(page, {0: (hazard_of(1, 0), 1), 1: (hazard_of(1, 1), 1), 2: (hazard_of(1, 2), 2)})
        assert page.expire(10.0, 5.0) == 0
        _write(page, {2: (hazard_of(1, 2), 3)})  # released and leased again at 12
        assert page.expire(12.0, 5.0) == 0
        assert page.expire(14.9, 5.0) == 0
        assert page.expire(15.0, 5.0) == 1  # serial 1: entries 0 and 1
        assert page.hazards() == {hazard_of(1, 2)}
        assert page.expire(16.9, 5.0) == 0
        assert page.expire(17.0, 5.0) == 1
        assert page.hazards() == frozenset()
        assert page.expire(100.0, 5.0) == 0
    finally:
        page.close()


def test_counters_are_cut_to_what_a_client_could_have_done() -> None:
    page = SessionPage("ns")
    now = [100.0]
    try:
        take = lambda: page.take(max_keys=64, block_bytes=4096, clock=lambda: now[0])  # noqa: E731
        assert take() == (0,) * 7
        # Honest counts pass as they are.
        struct.pack_into("<7Q", page.mapping, 0, 3, 10, 2, 1, 5, 1, 5 * 4096)
        now[0] += 1
        assert take() == (3, 10, 2, 1, 5, 1, 5 * 4096)
        # Hostile: huge steps (under MAX_STEP), hits beyond keys per call, bytes beyond
        # the blocks' size.
        big = (1 << 40) - 1
        struct.pack_into("<7Q", page.mapping, 0, 3 + 1, 10 + big, 2, 1 + 1, 5 + big, 1, 5 * 4096 + big)
        now[0] += 1
        lookups, hits, misses, acquires, got, missed, nbytes = take()
        assert (lookups, hits, misses) == (1, 64, 0)
        assert (acquires, got, missed, nbytes) == (1, 64, 0, 64 * 4096)
        # Many calls at once: cut to the rate bound over the time since the last take.
        base = struct.unpack_from("<7Q", page.mapping, 0)
        struct.pack_into("<7Q", page.mapping, 0, *(b + big for b in base))
        now[0] += 0.5
        steps = take()
        assert steps[0] == steps[3] == int(SessionPage.MAX_CALLS_PER_SECOND * 1.5)
        assert steps[4] == int(SessionPage.MAX_BLOCKS_PER_SECOND * 1.5)
        assert steps[6] == steps[4] * 4096
        # Backwards is nothing, whatever the jump.
        struct.pack_into("<7Q", page.mapping, 0, *(0 for _ in range(7)))
        now[0] += 1
        assert take() == (0,) * 7
    finally:
        page.close()


_Steps = tuple[int, int, int, int, int, int, int]


@settings(max_examples=200, deadline=None)
@given(folds=st.lists(st.tuples(st.floats(0.0, 5.0), st.tuples(*[st.integers(-5, 2**62)] * 7)),
                      max_size=30),
       slots=st.integers(0, 1 << 20), block_bytes=st.integers(1, 1 << 26))
def test_a_namespaces_reported_figures_stay_within_the_hosts_ceilings(
        folds: list[tuple[float, _Steps]], slots: int, block_bytes: int) -> None:
    """Whatever its pages' steps and however often they are folded, a namespace's
    client-reported totals are at most each ceiling times the seconds since it began
    counting (docs/security.md), hits at most its slots per call, bytes at most
    ``block_bytes`` per acquired block; honest steps within the ceilings pass whole."""
    r = ClientReported(100.0)
    now = 100.0
    for dt, steps in folds:
        now += dt
        added = r.add(steps, now, slots=slots, block_bytes=block_bytes)
        assert all(0 <= a <= max(s, 0) for a, s in zip(added, steps, strict=True))
        assert r.cut >= (added != tuple(max(s, 0) for s in steps))
    t = now - r.since
    assert r.lookups <= HOST_CALLS_PER_SECOND * t and r.acquires <= HOST_CALLS_PER_SECOND * t
    assert r.lookup_hits + r.lookup_misses <= HOST_KEYS_PER_SECOND * t
    assert r.acquire_hits + r.acquire_misses <= HOST_KEYS_PER_SECOND * t
    assert r.read_bytes <= HOST_READ_BYTES_PER_SECOND * t
    assert r.lookup_hits <= r.lookups * slots and r.acquire_hits <= r.acquires * slots
    assert r.read_bytes <= r.acquire_hits * block_bytes


def test_honest_reports_pass_whole_and_a_forged_one_is_cut_and_counted() -> None:
    r = ClientReported(10.0)
    honest = (100, 900, 100, 10, 80, 5, 80 * 4096)
    assert r.add(honest, 11.0, slots=1000, block_bytes=4096) == honest and r.cut == 0
    # No time passed: nothing can have happened, whatever is said.
    assert r.add(honest, 11.0, slots=1000, block_bytes=4096) == (0,) * 7 and r.cut == 1
    # A second later: bytes cut to the memory bandwidth and to block_bytes per block.
    forged = (1, 10**6, 0, 1, 10**6, 0, 1 << 60)
    added = r.add(forged, 12.0, slots=1000, block_bytes=4096)
    assert added == (1, 1000, 0, 1, 1000, 0, 1000 * 4096) and r.cut == 2
    assert (r.lookups, r.acquire_hits, r.read_bytes) == (101, 1080, 1080 * 4096)


def test_totals_saturate_instead_of_overflowing_the_wire() -> None:
    assert saturating_add(COUNTER_CAP - 5, 10) == COUNTER_CAP
    assert saturating_add(7, -3) == 7
    metrics = Metrics(CollectorRegistry())
    for _ in range(4):
        metrics.tier_io("dram", "read", 1 << 62, 1 << 62)
    io = metrics.io["dram"]
    assert io.read_bytes == io.reads == COUNTER_CAP
    # What Stats puts on the wire (uint64) and the exposition accept it.
    pb.TierIO(read_bytes=io.read_bytes, reads=io.reads).SerializeToString()
