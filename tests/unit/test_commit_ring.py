"""A writer's plain commit ring in one native call (``BlockTable.commit_ring``, through
``StoreState.commit_ring``): what it commits, answers and ends is exactly what the ring
taken record by record (``SessionPage.take_commits`` + ``GrantBook.commit``) gives, and
it changes nothing for any ring that is not plain."""

from __future__ import annotations

import contextlib
import shutil
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import _native, _page
from kvtierd.shared_index import GRANT_TAKEN, SessionPage
from kvtierd.store import CommitResult, Session
from kvtierd.store.fast_path import FastPath
from kvtierd.store.state import StoreState

from .conftest import StoreEnv, close_store, make_shm_dir, make_store
from .test_store import BLOCK, CAPACITY, put, session

pytestmark = pytest.mark.skipif(not hasattr(_native, "grants_take"), reason="no native build")

GRANTS = 12
_COMMITTED = bytes([CommitResult.COMMITTED])


@contextlib.contextmanager
def _ring_store() -> Iterator[StoreEnv]:
    """A store of its own /dev/shm directory as kvtierd runs one without a write-through
    tier: page commits make no block handles (the native ring's case).  ``check()`` is
    clean at the end; the store is closed and its directory removed."""
    directory = make_shm_dir()
    env = make_store(directory, capacity=CAPACITY, extent_size=1 << 20,
                     grant_bytes=GRANTS * BLOCK)
    try:
        env.store.attach_tiering(spill=False, commit_handles=False)
        yield env
        assert env.store.check() == []
    finally:
        close_store(env.store)
        shutil.rmtree(directory, ignore_errors=True)


def _writer_page(env: StoreEnv, s: Session) -> SessionPage:
    page = SessionPage(s.ns.name, writes=True)
    env.store.attach_page(s, page)
    assert env.store.refill_grants(s, GRANTS) == GRANTS
    return page


def _head(page: SessionPage) -> int:
    return int(struct.unpack_from("<Q", page.mapping, _page.W_HEAD)[0])


def _publish(page: SessionPage, batches: Sequence[Sequence[tuple[int, int, bytes, int,
                                                                 int | None]]]) -> int:
    head = first = _head(page)
    for batch in batches:
        head = _native.commits_put(page.mapping, head, list(batch))
    return first


def _words(s: Session) -> dict[int, int]:
    return {g: int(s.grants.words[g]) for g in s.grants}


def test_a_plain_ring_commits_in_one_native_call(monkeypatch: pytest.MonkeyPatch) -> None:
    with _ring_store() as env:
        s = session(env)
        put(env, s, [b"first"])
        page = _writer_page(env, s)
        events: list[tuple[list[bytes], bool]] = []
        s.ns.index.watch = lambda keys, added: events.append((keys, added))
        taken: list[int] = []
        real_take = SessionPage.take_commits
        monkeypatch.setattr(SessionPage, "take_commits",
                            lambda self, *a: taken.append(1) or real_take(self, *a))
        held = sorted(s.grants)
        words = _words(s)
        ks = [b"a", b"b" * 64, b"0123456789abcdef", b"d"]
        first = _publish(page, [
            [(held[0], words[held[0]], ks[0], 5, 77), (held[1], words[held[1]], ks[1], 9, None)],
            [(held[2], words[held[2]], ks[2], BLOCK, 0)],
            [(held[3], words[held[3]], ks[3], 1, None)]])
        out = env.store.commit_from_page(s, page)
        assert taken == []  # the native call took the ring
        assert (out.records, out.committed, out.nbytes, list(out.blocks)) == (4, 4, 5 + 9 + BLOCK + 1, [])
        assert _native.commit_results(page.mapping, first, 4) == _COMMITTED * 4
        assert _native.done_wait(page.mapping, first + 4, 0.0)
        assert env.store.lookup(s, ks) == 4
        got = {k: s.ns.index[k] for k in ks}
        assert [(got[k].length, got[k].checksum) for k in ks] == [
            (5, 77), (9, None), (BLOCK, 0), (1, None)]
        for g in held[:4]:  # the grants ended, in the book and in the page
            assert g not in s.grants and page.grant_word(g) == 0
        assert events == [(ks, True)]
        # The next ring with a present key goes record by record, with the same answers.
        g = sorted(s.grants)[0]
        first = _publish(page, [[(g, int(s.grants.words[g]), b"a", 5, None)]])
        env.store.commit_from_page(s, page)
        assert taken == [1]
        assert _native.commit_results(page.mapping, first, 1) == bytes([CommitResult.EXISTS])
        assert g in s.grants and env.store.check() == []
        env.store.close_session(s)
        page.close()
        assert env.store.check() == []


def test_the_native_call_answers_a_writer_that_keeps_what_its_next_put_takes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that still holds the grants it asks for (the page's WANT) once the
    ring's have ended is answered inside the native call (no ``finish_commits``), and
    refilled after; one that holds fewer is refilled first and answered after, so its
    next put finds its grants; a WANT past any page's grants is never answered there."""
    with _ring_store() as env:
        s = session(env)
        put(env, s, [b"first"])
        page = _writer_page(env, s)
        steps: list[str] = []  # the Python answers and the refills, in order
        real_finish = SessionPage.finish_commits
        real_refill = FastPath.refill_grants

        def finish(self: SessionPage, results: bytes) -> None:
            steps.append("answer")
            real_finish(self, results)

        def refill(self: FastPath, *args: Any) -> int:
            steps.append("refill")
            return real_refill(self, *args)

        monkeypatch.setattr(SessionPage, "finish_commits", finish)
        monkeypatch.setattr(FastPath, "refill_grants", refill)

        def ring(n: int, want: int, tag: bytes) -> None:
            struct.pack_into("<Q", page.mapping, _page.W_WANT, want)
            held = sorted(s.grants)[:n]
            first = _publish(page, [[(g, int(s.grants.words[g]), tag + b"%d" % i, 7, None)
                                     for i, g in enumerate(held)]])
            out = env.store.commit_from_page(s, page)
            assert (out.records, out.committed) == (n, n)
            assert _native.commit_results(page.mapping, first, n) == _COMMITTED * n
            assert _native.done_wait(page.mapping, first + n, 0.0)
            assert page.commits_tail == first + n

        ring(4, 4, b"kept")  # 12 granted, 8 left >= 4: answered natively
        assert "answer" not in steps
        steps.clear()
        ring(2, GRANTS, b"short")  # fewer than it wants left: a refill, then the answer
        assert steps[:2] == ["refill", "answer"]
        steps.clear()
        ring(1, 2**64 - 1, b"huge")  # the client's word, bounded: answered by Python
        assert "answer" in steps
        assert env.store.lookup(s, [b"kept0", b"short1", b"huge0"]) == 3
        env.store.close_session(s)
        page.close()


def test_a_ring_changes_nothing_when_the_store_needs_more_than_the_native_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Handles wanted, keys of reservations in flight, a key below DRAM: the native
    call leaves the ring to the general way, which answers it (EXISTS, COMMITTED)."""
    with _ring_store() as env:
        s = session(env)
        put(env, s, [b"first"])
        page = _writer_page(env, s)
        calls: list[object] = []
        real = StoreState.commit_ring

        def spy(self: StoreState, *args: object) -> object:
            got = real(self, *args)  # type: ignore[arg-type]
            calls.append(got)
            return got

        monkeypatch.setattr(StoreState, "commit_ring", spy)
        res = env.reserve(s, [b"flying"])  # a Reserve call's key, in flight
        assert res.reservation_id
        g = sorted(s.grants)
        _publish(page, [[(g[0], int(s.grants.words[g[0]]), b"flying", 5, None)]])
        env.store.commit_from_page(s, page)
        assert calls == [None] and g[0] in s.grants  # EXISTS: in flight
        env.store.abort(s, res.reservation_id)

        def below(keys: Sequence[bytes]) -> list[bool]:
            return [k == b"below" for k in keys]

        first = _publish(page, [[(g[0], int(s.grants.words[g[0]]), b"below", 5, None),
                                 (g[1], int(s.grants.words[g[1]]), b"new", 5, None)]])
        env.store.commit_from_page(s, page, below)
        assert calls[-1] is None
        assert _native.commit_results(page.mapping, first, 2) == bytes(
            [CommitResult.EXISTS, CommitResult.COMMITTED])
        env.store.attach_tiering(spill=False, commit_handles=True)
        first = _publish(page, [[(g[2], int(s.grants.words[g[2]]), b"handle", 5, None)]])
        out = env.store.commit_from_page(s, page, below)
        assert calls[-1] is None and [b.key for b in out.blocks] == [b"handle"]
        assert env.store.check() == []
        env.store.close_session(s)
        page.close()


# A record of a generated ring: which grant (an index into the session's grants held;
# past them: an entry no grant is in), how its word is forged, its key (an index into
# KEYS; "present" ones are in the store already), its length.  Mostly what an honest
# writer sends, so that most rings are plain and some are not.
_FORGE = ("held",) * 12 + ("taken", "zero", "other")
KEYS = [b"present-0", b"present-1"] + [b"k%02d" % i for i in range(30)] + [b"x" * 16]
_record = st.tuples(st.integers(0, GRANTS + 1), st.sampled_from(_FORGE),
                    st.integers(0, len(KEYS) - 1),
                    st.sampled_from([1, 7, BLOCK] * 6 + [0, BLOCK + 1]),
                    st.one_of(st.none(), st.integers(0, 2**64 - 1)))
_rings = st.lists(st.lists(st.lists(_record, min_size=1, max_size=3), min_size=1, max_size=2),
                  min_size=1, max_size=4)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(rings=_rings, below=st.sets(st.integers(0, len(KEYS) - 1), max_size=12))
def test_rings_commit_the_same_natively_and_record_by_record(
        rings: list[list[list[tuple[int, str, int, int, int | None]]]], below: set[int]) -> None:
    """The model: the same rings against two stores, one that takes every ring record
    by record; the answers, the keys found, the grants held and ``check()`` agree."""
    held_below = {KEYS[i] for i in below}

    def exists(keys: Sequence[bytes]) -> list[bool]:
        return [k in held_below for k in keys]

    outcomes = []
    for native in (True, False):
        with _ring_store() as env:
            if not native:
                env.store.state.commit_ring = lambda *a: None  # type: ignore[method-assign]
            s = session(env)
            put(env, s, KEYS[:2])
            page = _writer_page(env, s)
            answers = []
            for ring in rings:
                held = sorted(s.grants)
                batches = []
                for batch in ring:
                    records = []
                    for g, forge, k, length, checksum in batch:
                        entry = held[g] if g < len(held) else 255 - g
                        word = int(s.grants.words[entry]) if entry < _page.GRANTS_N else 0
                        word = {"held": word, "taken": word | GRANT_TAKEN, "zero": 0,
                                "other": word ^ 1}[forge]
                        records.append((entry, word, KEYS[k], length, checksum))
                    batches.append(records)
                first = _publish(page, batches)
                n = sum(map(len, batches))
                out = env.store.commit_from_page(s, page, exists)
                results = _native.commit_results(page.mapping, first, n)
                assert out.records == n and out.committed == results.count(_COMMITTED)
                answers.append(results)
                env.store.refill_grants(s, GRANTS)
            found = env.store.lookup(s, KEYS)
            present = [k for k in KEYS if k in s.ns.index]
            assert env.store.check() == []
            outcomes.append((answers, found, present, len(s.grants),
                             [(b.key, b.length, b.checksum) for b in sorted(
                                 s.ns.index.values(), key=lambda b: b.key)]))
            env.store.close_session(s)
            page.close()
            assert env.store.check() == []
    assert outcomes[0] == outcomes[1]


def test_commit_ring_refuses_what_is_not_a_page_or_grant_words() -> None:
    with _ring_store() as env:
        s = session(env)
        put(env, s, [b"first"])
        page = _writer_page(env, s)
        room = s.ns.index.table.room_for(1)
        assert room is not None
        call = s.ns.table._t.commit_ring
        with pytest.raises(ValueError, match="page"):
            call(bytearray(64), 0, BLOCK, s.grants.words, room, 0, 1, None, False)
        with pytest.raises(ValueError, match="held"):
            call(page.mapping, 0, BLOCK, np.zeros(3, dtype=np.uint64), room, 0, 1, None, False)
        with pytest.raises(ValueError):
            call(page.mapping, 0, BLOCK, s.grants.words, bytearray(4096), 0, 1, None, False)
        # An empty ring, a head behind the tail or past the ring: nothing to do natively.
        assert call(page.mapping, 0, BLOCK, s.grants.words, room, 0, 1, None, False) is None
        struct.pack_into("<Q", page.mapping, _page.W_HEAD, 10**6)
        assert call(page.mapping, 0, BLOCK, s.grants.words, room, 0, 1, None, False) is None
        assert env.store.commit_from_page(s, page).records == 0  # impossible: skipped
        assert env.store.check() == []
        env.store.close_session(s)
        page.close()


def test_victims_leave_the_index_by_their_slots_and_come_back_the_same_way() -> None:
    """An eviction's victims are hidden by slot ref (``BlockTable.unpublish``: the keys
    their slot entries hold, removed only where the index names that block) and put
    back the same way when a reader raced the plan (``Keys.unhide_refs``)."""
    with _ring_store() as env:
        s = session(env)
        ks = [b"v%d" % i for i in range(6)] + [b"0123456789abcdef"]
        put(env, s, ks)
        index, table = s.ns.index, s.ns.table
        refs = index.find(ks)
        assert refs.all()
        buf = index.table.buffer
        assert buf is not None
        assert table.unpublish(refs[:3], buf) == b"\x01" * 3
        assert index.find(ks).tolist() == [0, 0, 0] + refs[3:].tolist()
        assert table.unpublish(refs[:3], buf) == b"\x00" * 3  # gone already
        # A free slot's ref, and one naming no extent.
        free = np.array([int(refs[0]) >> 32 << 32 | 14], dtype=np.uint64)  # the extent's last
        assert table.inspect(free)["state"].tolist() == [0]  # FREE
        assert table.unpublish(free, buf) == b"\x00"
        with pytest.raises(ValueError):
            table.unpublish(np.array([999 << 32], dtype=np.uint64), buf)
        index.unhide_refs(refs[:3])
        assert (index.find(ks) == refs).all() and env.store.lookup(s, ks) == len(ks)
        # Evictions as a full namespace's claims make them, with a writer's page attached
        # (the hazard check between the hide and the claim).
        page = SessionPage(s.ns.name, writes=True)
        env.store.attach_page(s, page)
        for i in range(4):
            put(env, s, [b"w%d-%d" % (i, j) for j in range(8)])
        present = index.find(ks)
        gone = [k for k, r in zip(ks, present.tolist(), strict=True) if not r]
        assert gone and env.store.evictions >= len(gone)
        assert env.store.lookup(s, gone[:1]) == 0
        assert env.store.check() == []
        env.store.close_session(s)
        page.close()
        assert env.store.check() == []
