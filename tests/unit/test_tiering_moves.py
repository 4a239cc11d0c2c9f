"""``tiering.moves.MovementTable``: one table, one lock, for every key in motion."""

from __future__ import annotations

import asyncio
import threading
import types
from typing import Any

import numpy as np

from kvtierd.tiering import MovementTable


class FakeStore:
    """``pin_blocks``/``unpin`` that remember what is pinned (a lease per batch)."""

    def __init__(self) -> None:
        self.pinned: list[bytes] = []

    def pin_blocks(self, blocks: Any) -> Any:
        self.pinned.extend(blocks.keys)
        return ("lease", list(blocks.keys))

    def unpin(self, lease: Any) -> None:
        self.pinned = [k for k in self.pinned if k not in lease[1]]


class FakeBatch:
    """A ``BlockBatch`` of namespace "a" as the movement table reads it: its keys, and
    which of them were deleted (``doomed``)."""

    def __init__(self, *keys: bytes, doomed: tuple[bytes, ...] = ()) -> None:
        self.ns = types.SimpleNamespace(name="a")
        self.keys = list(keys)
        self._doomed = doomed

    def __len__(self) -> int:
        return len(self.keys)

    def doomed(self, at: Any) -> Any:
        return np.array([self.keys[i] in self._doomed for i in at.tolist()], dtype=bool)


def block(key: bytes, doomed: bool = False) -> Any:
    return FakeBatch(key, doomed=(key,) if doomed else ())


def test_each_kind_of_move_makes_its_key_moving_until_it_ends() -> None:
    store = FakeStore()
    moves = MovementTable(store)  # type: ignore[arg-type]

    async def go() -> None:
        loop = asyncio.get_running_loop()
        moves.attach(loop)
        mine, waits = moves.claim_promotions("a", [b"p"], loop)
        assert mine == [b"p"] and not waits and moves.moving("a", b"p")
        again, waits = moves.claim_promotions("a", [b"p"], loop)
        assert again == [] and len(waits) == 1  # one read for concurrent promotions
        moves.end_promotion("a", b"p", True)
        assert await waits[0] is True and not moves.moving("a", b"p")

        with moves.demoting([block(b"d")]):
            assert moves.moving("a", b"d") and store.pinned and moves.in_flight() == 1
        assert not moves.moving("a", b"d") and not store.pinned and moves.in_flight() == 0

        moves.will_publish(block(b"u"))
        assert moves.moving("a", b"u") and moves.publishing() == 0  # recorded, not started
        with moves.publishing_blocks(block(b"u")):
            assert moves.publishing() == 1 and store.pinned
        assert not moves.moving("a", b"u") and not store.pinned

        with moves.handing(("a", b"h")) as started:
            assert started and moves.moving("a", b"h")
        assert not moves.any_moving("a", [b"p", b"d", b"u", b"h"])

    asyncio.run(go())


def test_a_hidden_key_is_not_handed_on_and_hides_count_per_caller() -> None:
    moves = MovementTable(FakeStore())  # type: ignore[arg-type]
    moves.hide([("a", b"k"), ("a", b"k")])  # a Delete and an Evict at once
    assert moves.first_hidden("a", [b"x", b"k", b"y"], 0) == 1
    assert moves.first_hidden("a", [b"x", b"k", b"y"], 2) == 3
    out: list[bool] = []

    def hand_off() -> None:  # an I/O thread
        with moves.handing(("a", b"k")) as started:
            out.append(started)

    t = threading.Thread(target=hand_off)
    t.start()
    t.join()
    assert out == [False] and not moves.moving("a", b"k")
    moves.unhide([("a", b"k")])
    assert moves.hidden("a", b"k")  # the other caller still hides it
    moves.unhide([("a", b"k")])
    assert not moves.hidden("a", b"k")


def test_overlapping_hides_end_key_by_key_in_any_order() -> None:
    """Two deletes hiding overlapping keys (one of them twice): each unhide ends only its
    own hides, whichever ends first; the last one leaves nothing hidden."""
    moves = MovementTable(FakeStore())  # type: ignore[arg-type]
    one, _, _ = moves.hide_checked("a", [b"k", b"l", b"k"])
    two, _, moving = moves.hide_checked("a", [b"l", b"m"])
    assert not moving
    assert [moves.hidden("a", k) for k in (b"k", b"l", b"m")] == [True, True, True]
    moves.unhide(one)
    assert [moves.hidden("a", k) for k in (b"k", b"l", b"m")] == [False, True, True]
    three, _, _ = moves.hide_checked("b", [b"k"])
    moves.unhide(two)
    assert [moves.hidden("a", k) for k in (b"k", b"l", b"m")] == [False, False, False]
    assert moves.hidden("b", b"k")
    moves.unhide(three)
    assert not moves.hidden("b", b"k") and moves.first_hidden("b", [b"k"], 0) == 1


def test_a_block_deleted_during_its_demotion_is_reported() -> None:
    moves = MovementTable(FakeStore())  # type: ignore[arg-type]
    assert moves.deleted_while_demoting("a", [b"x"]) == []
    with moves.demoting([FakeBatch(b"x", b"y", doomed=(b"y",))]):
        assert moves.deleted_while_demoting("a", [b"y", b"x", b"z"]) == [0]
        assert moves.moving_many("a", [b"y", b"z", b"x"]).tolist() == [True, False, True]
    assert moves.deleted_while_demoting("a", [b"y"]) == []
