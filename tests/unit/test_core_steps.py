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
    ReservationState,
    Step,
    SyncMaps,
    Work,
    arun_steps,
    run_steps,
)
from kvtier.errors import FailedPrecondition, Unavailable
from kvtier.v1 import kvtier_pb2 as pb


class FakeCore(ClientCore[ReservationState, LeaseState]):
    def __init__(self) -> None:
        super().__init__("/nonexistent", namespace="ns", block_bytes=4096, model_uid="m",
                         timeout=1.0, checksum=False, reconnect_max=1.0)

    def _new_reservation(self, keys: list[bytes], resp: pb.ReserveResponse) -> ReservationState:
        return ReservationState(self, keys, resp)

    def _new_lease(self, keys: list[bytes], resp: pb.AcquireResponse) -> LeaseState:
        return LeaseState(self, keys, resp)


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
    do = transport({"Lookup": pb.LookupResponse(hits=2)}, log)
    assert both(lambda: core._lookup_steps([b"a", b"b", b"c"], False), do) == [2, 2]
    assert log == ["Lookup", "Lookup"]


def test_reserve_aborts_when_its_segments_cannot_be_mapped() -> None:
    core, log = FakeCore(), []
    resp = pb.ReserveResponse(reservation_id=7, statuses=[pb.RESERVE_STATUS_RESERVED],
                              slots=[pb.SlotRef(segment_id=1)])

    def fail(step: Step) -> BaseException | None:
        return Unavailable("gone") if isinstance(step, SyncMaps) else None

    do = transport({"Reserve": resp, "Abort": pb.AbortResponse()}, log, fail)
    with pytest.raises(Unavailable, match="gone"):
        run_steps(core._reserve_steps([b"k"]), do)
    assert log == ["Reserve", "SyncMaps", "Abort"]


def test_get_releases_without_waiting_after_the_copies() -> None:
    core, log = FakeCore(), []
    resp = pb.AcquireResponse(lease_id=3, hits=0)
    do = transport({"Acquire": resp}, log)
    assert both(lambda: core._get_steps([b"k"], None), do) == [[], []]
    assert log == ["Acquire", "SyncMaps", "Work", "Work", "SendRelease"] * 2


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
