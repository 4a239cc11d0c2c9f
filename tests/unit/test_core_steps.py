"""kvtier._core: the operations both clients run, driven by a fake transport.

No daemon: a ``do`` that records each step and answers from a script shows
what an operation asks of its transport, in order, and that the blocking and
the asyncio drivers run the same operation the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from kvtier._core import (
    Call,
    ClientCore,
    LeaseState,
    LookHere,
    ReservationState,
    Step,
    SyncMaps,
    Tier,
    Work,
    arun_steps,
    run_steps,
)
from kvtier.errors import Corrupted, FailedPrecondition, InvalidArgument, Unavailable
from kvtier.v1 import kvtier_pb2 as pb


class FakeCore(ClientCore[ReservationState, LeaseState]):
    def __init__(self) -> None:
        super().__init__("/nonexistent", namespace="ns", block_bytes=4096, model_uid="m",
                         timeout=1.0, checksum=False, reconnect_max=1.0)

    def _new_reservation(self, keys: list[bytes], resp: pb.ReserveResponse) -> ReservationState:
        return ReservationState(self, keys, resp)

    def _new_lease(self, keys: list[bytes], resp: pb.AcquireResponse,
                   verify: bool) -> LeaseState:
        return LeaseState(self, keys, resp, verify)


def transport(answers: dict[str, Any], log: list[str],
              fail: Callable[[Step], BaseException | None] = lambda s: None
              ) -> Callable[[Step], Any]:
    def do(step: Step) -> Any:
        log.append(step.method if isinstance(step, Call) else type(step).__name__)
        exc = fail(step)
        if exc is not None:
            raise exc
        if isinstance(step, Call):
            return answers[step.method]
        if isinstance(step, Work):
            return step.fn()
        return None
    return do


def both(steps: Callable[[], Any], do: Callable[[Step], Any]) -> list[Any]:
    """The operation's result under the blocking and under the asyncio driver."""
    async def ado(step: Step) -> Any:
        return do(step)

    return [run_steps(steps(), do), asyncio.run(arun_steps(steps(), ado))]


def test_lookup_is_one_call_and_decodes_hits() -> None:
    core, log = FakeCore(), []
    do = transport({"Lookup": pb.LookupResponse(hits=2, tiers=[1, 2])}, log)
    assert both(lambda: core._lookup_steps([b"a", b"b", b"c"], False), do) == [2, 2]
    # First the shared index (the fake transport has none: it answers None), then the call.
    assert log == ["LookHere", "Lookup", "LookHere", "Lookup"]


def test_lookup_answered_by_the_shared_index_makes_no_call() -> None:
    core, log = FakeCore(), []
    here = {"answer": (b"\x01\x01", True)}

    def do(step: Step) -> Any:
        log.append(step.method if isinstance(step, Call) else type(step).__name__)
        if isinstance(step, LookHere):
            return here["answer"]
        assert isinstance(step, Call)
        return pb.LookupResponse(hits=1, tiers=[2])

    assert both(lambda: core._lookup_tiers_steps([b"a", b"b"], False), do) == [
        [Tier.DRAM, Tier.DRAM]] * 2
    assert log == ["LookHere"] * 2
    # A miss that is not final: the keys after the table's hits are asked of the daemon.
    log.clear()
    here["answer"] = (b"\x01", False)
    assert both(lambda: core._lookup_tiers_steps([b"a", b"b", b"c"], True), do) == [
        [Tier.DRAM, Tier.SSD]] * 2
    assert log == ["LookHere", "Lookup"] * 2


def test_reserve_aborts_when_its_segments_cannot_be_mapped() -> None:
    core, log = FakeCore(), []
    resp = pb.ReserveResponse(reservation_id=7, statuses=[pb.RESERVE_STATUS_RESERVED],
                              slots=[pb.SlotRef(segment_id=1)])

    def fail(step: Step) -> BaseException | None:
        return Unavailable("gone") if isinstance(step, SyncMaps) else None

    do = transport({"Reserve": resp, "Abort": pb.AbortResponse()}, log, fail)
    with pytest.raises(Unavailable, match="gone"):
        run_steps(core._reserve_steps([b"k"]), do)
    assert log == ["GrantHere", "Reserve", "SyncMaps", "Abort"]  # no grants here: the call


def test_get_releases_without_waiting_after_the_copies() -> None:
    core, log = FakeCore(), []
    resp = pb.AcquireResponse(lease_id=3, hits=0)
    do = transport({"Acquire": resp}, log)
    assert both(lambda: core._get_steps([b"k"], None), do) == [[], []]
    assert log == ["LookHere", "Acquire", "SyncMaps", "Work", "Work", "SendRelease"] * 2


def test_a_failed_release_does_not_hide_the_error_that_ended_the_with_block() -> None:
    core, log = FakeCore(), []
    lease = LeaseState(core, [], pb.AcquireResponse(lease_id=3))

    def fail(step: Step) -> BaseException | None:
        return Unavailable("release failed") if isinstance(step, Call) else None

    do = transport({}, log, fail)
    run_steps(lease._exit_steps(ValueError), do)  # swallowed: a ValueError is on its way
    assert log == ["Release"]
    lease = LeaseState(core, [], pb.AcquireResponse(lease_id=4))
    with pytest.raises(Unavailable, match="release failed"):
        run_steps(lease._exit_steps(None), do)


def test_commit_of_an_earlier_session_is_reported_lost_without_a_call() -> None:
    core, log = FakeCore(), []
    r = ReservationState(core, [b"k"], pb.ReserveResponse(reservation_id=5))
    core._session_gen += 1  # a reconnect happened meanwhile
    with pytest.raises(FailedPrecondition, match="reservation was lost"):
        run_steps(r._commit_steps(), transport({}, log))
    assert log == ["Work"] and r.done


def test_release_without_waiting_of_an_earlier_session_is_reported_lost() -> None:
    core, log = FakeCore(), []
    lease = LeaseState(core, [], pb.AcquireResponse(lease_id=9))
    core._session_gen += 1
    with pytest.raises(FailedPrecondition, match="lease was lost"):
        run_steps(lease._release_steps(wait=False), transport({}, log))
    assert log == []


def leased(core: FakeCore, keys: list[bytes], lease_id: int) -> LeaseState:
    """A lease of ``keys`` without slots (no views): what drop_corrupted needs."""
    resp = pb.AcquireResponse(lease_id=lease_id, hits=len(keys))
    return LeaseState(core, keys, resp, verify=False)


@pytest.mark.parametrize("driver", ["blocking", "asyncio"])
def test_drop_corrupted_releases_then_deletes_as_corrupted_and_raises_for_the_first(
        driver: str) -> None:
    core, log = FakeCore(), []
    sent: list[Any] = []

    def record(step: Step) -> BaseException | None:
        if isinstance(step, Call):
            sent.append(step.request)
        return None

    do = transport({"Release": pb.ReleaseResponse(), "Delete": pb.DeleteResponse(deleted=2)},
                   log, record)

    async def ado(step: Step) -> Any:
        return do(step)

    lease = leased(core, [b"\x01", b"\x02", b"\x03"], lease_id=11)
    steps = lease._drop_corrupted_steps([2, 1, 2])
    with pytest.raises(Corrupted, match=r"^block 02 failed its checksum$") as exc:
        if driver == "blocking":
            run_steps(steps, do)
        else:
            asyncio.run(arun_steps(steps, ado))
    assert exc.value.key == b"\x02"  # the first bad one
    assert exc.value.__cause__ is None
    assert log == ["Release", "Delete"]  # the lease ends first, as acquire's own check does
    assert sent == [pb.ReleaseRequest(lease_id=11),
                    pb.DeleteRequest(keys=[b"\x02", b"\x03"], corrupted=True)]
    assert lease.done and lease.views == []


def test_drop_corrupted_still_deletes_and_raises_corrupted_when_the_release_fails() -> None:
    core, log = FakeCore(), []

    def fail(step: Step) -> BaseException | None:
        return Unavailable("release failed") if isinstance(step, Call) and \
            step.method == "Release" else None

    do = transport({"Delete": pb.DeleteResponse(deleted=1)}, log, fail)
    with pytest.raises(Corrupted, match=r"^block 0a failed its checksum$") as exc:
        run_steps(leased(core, [b"\x0a"], 5)._drop_corrupted_steps([0]), do)
    assert isinstance(exc.value.__cause__, Unavailable)
    assert log == ["Release", "Delete"]


def test_drop_corrupted_refuses_indices_outside_the_lease() -> None:
    core, log = FakeCore(), []
    lease = leased(core, [b"a", b"b"], 6)
    for bad, message in [([], "no block to drop: bad is empty"),
                         ([0, 2], "block 2 is not in this lease of 2 blocks"),
                         ([-1], "block -1 is not in this lease of 2 blocks")]:
        with pytest.raises(InvalidArgument, match=f"^{message}$"):
            run_steps(lease._drop_corrupted_steps(bad), transport({}, log))
    assert log == [] and not lease.done
