"""Tests for kvtier.errors: the one table between exceptions and gRPC status codes."""

from __future__ import annotations

import inspect

import grpc
import pytest

from kvtier import errors
from kvtier.errors import (
    STATUS_OF,
    Corrupted,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    KVTierError,
    NotFound,
    Unavailable,
    from_rpc_error,
    from_status,
    status_of,
)

TABLE = sorted(STATUS_OF.items(), key=lambda kv: kv[0].__name__)
IDS = [cls.__name__ for cls, _ in TABLE]


@pytest.mark.parametrize(("cls", "code"), TABLE, ids=IDS)
def test_each_error_travels_as_its_status_code(cls: type[KVTierError], code: grpc.StatusCode) -> None:
    assert status_of(cls("boom")) is code


@pytest.mark.parametrize(("cls", "code"), TABLE, ids=IDS)
def test_each_status_code_comes_back_as_the_same_class_with_the_message(
    cls: type[KVTierError], code: grpc.StatusCode
) -> None:
    for wire in (code, code.value[0]):
        exc = from_status(wire, "exactly this message")
        assert type(exc) is cls
        assert str(exc) == "exactly this message"
        assert status_of(exc) is code  # and round-trips again


def test_the_table_is_one_to_one() -> None:
    assert len(set(STATUS_OF.values())) == len(STATUS_OF)


def test_every_error_class_of_the_module_is_in_the_table() -> None:
    classes = {obj for _, obj in inspect.getmembers(errors, inspect.isclass)
               if issubclass(obj, KVTierError) and obj is not KVTierError}
    assert classes == set(STATUS_OF) | set(errors.CLIENT_ONLY)


def test_every_error_derives_from_kvtier_error() -> None:
    assert all(issubclass(cls, KVTierError) for cls in STATUS_OF)
    assert issubclass(KVTierError, Exception)


@pytest.mark.parametrize("code", [999, -1, 17, 2**31])
def test_unknown_integer_codes_map_to_internal(code: int) -> None:
    exc = from_status(code, "what")
    assert type(exc) is Internal and str(exc) == "what"


@pytest.mark.parametrize("code", [grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED,
                                  grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNKNOWN.value[0]])
def test_codes_outside_the_table_map_to_internal(code: grpc.StatusCode | int) -> None:
    assert type(from_status(code, "m")) is Internal


def test_grpc_only_codes_map_to_the_nearest_class() -> None:
    assert type(from_status(grpc.StatusCode.CANCELLED, "m")) is Unavailable
    assert type(from_status(grpc.StatusCode.UNIMPLEMENTED, "m")) is FailedPrecondition
    assert type(from_status(grpc.StatusCode.UNIMPLEMENTED.value[0], "m")) is FailedPrecondition


def test_ok_is_not_an_error_class_of_its_own() -> None:
    # a status of OK never reaches from_status in practice; if it does, it is a bug
    assert type(from_status(grpc.StatusCode.OK, "m")) is Internal


def test_deadline_exceeded_is_an_unavailable() -> None:
    assert issubclass(DeadlineExceeded, Unavailable)
    exc = from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "late")
    assert isinstance(exc, Unavailable) and type(exc) is DeadlineExceeded
    assert status_of(DeadlineExceeded("late")) is grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_subclass_travels_as_its_nearest_listed_base() -> None:
    class LeaseGone(NotFound):
        pass

    class Custom(KVTierError):
        pass

    assert status_of(LeaseGone("x")) is grpc.StatusCode.NOT_FOUND
    assert status_of(Custom("x")) is grpc.StatusCode.INTERNAL
    assert status_of(KVTierError("x")) is grpc.StatusCode.INTERNAL


def test_corrupted_keeps_the_failing_key() -> None:
    exc = Corrupted("checksum mismatch", key=b"\x01\x02")
    assert exc.key == b"\x01\x02" and str(exc) == "checksum mismatch"
    assert Corrupted("m").key == b""
    assert status_of(exc) is grpc.StatusCode.DATA_LOSS


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details


def test_from_rpc_error_uses_code_and_details() -> None:
    exc = from_rpc_error(_FakeRpcError(grpc.StatusCode.NOT_FOUND, "lease 3 is not held"))
    assert type(exc) is NotFound and str(exc) == "lease 3 is not held"


def test_from_rpc_error_without_details_still_says_something() -> None:
    exc = from_rpc_error(_FakeRpcError(grpc.StatusCode.UNAVAILABLE, ""))
    assert type(exc) is Unavailable and str(exc) == str(grpc.StatusCode.UNAVAILABLE)


def test_from_rpc_error_of_a_bare_rpc_error_is_internal() -> None:
    exc = from_rpc_error(grpc.RpcError("connection reset"))
    assert type(exc) is Internal and "connection reset" in str(exc)


def test_client_only_errors_travel_as_their_base_and_never_decode_back() -> None:
    for cls in errors.CLIENT_ONLY:
        code = status_of(cls("x"))
        assert type(from_status(code, "x")) is not cls
        assert isinstance(from_status(code, "x"), cls.__mro__[1])
