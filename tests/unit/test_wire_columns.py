"""Repeated varint fields to and from the wire as columns (``csrc/wire.c``,
``kvtier._wire.with_columns`` / ``columns``): the same bytes and values as protobuf's
own API, and a malformed message refused, never read past."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import _native
from kvtier._wire import columns, with_columns
from kvtier.v1 import kvtier_pb2 as pb

U64 = st.integers(0, (1 << 64) - 1)
U32 = st.integers(0, (1 << 32) - 1)


@settings(max_examples=200, deadline=None)
@given(statuses=st.lists(st.integers(0, 127), max_size=300),
       segments=st.lists(U32, max_size=300), offsets=st.lists(U64, max_size=300),
       rid=U64)
def test_a_message_built_from_columns_is_the_message_built_from_lists(
        statuses: list[int], segments: list[int], offsets: list[int], rid: int) -> None:
    ref = pb.ReserveResponse(reservation_id=rid, statuses=statuses, slot_segment_ids=segments,
                             slot_offsets=offsets, slot_capacity=4096)
    got = with_columns(pb.ReserveResponse(reservation_id=rid, slot_capacity=4096), {
        pb.ReserveResponse.STATUSES_FIELD_NUMBER: bytes(statuses),
        pb.ReserveResponse.SLOT_SEGMENT_IDS_FIELD_NUMBER: np.array(segments, dtype=np.uint32),
        pb.ReserveResponse.SLOT_OFFSETS_FIELD_NUMBER: np.array(offsets, dtype=np.uint64)})
    assert got == ref
    assert got.SerializeToString() == ref.SerializeToString()


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(U64, max_size=300), sums=st.lists(U64, max_size=300), rid=U64)
def test_columns_read_from_a_message_are_its_fields(lengths: list[int], sums: list[int],
                                                    rid: int) -> None:
    msg = pb.CommitRequest(reservation_id=rid, lengths=lengths, checksums=sums)
    got_lengths, got_sums = columns(msg, pb.CommitRequest.LENGTHS_FIELD_NUMBER,
                                    pb.CommitRequest.CHECKSUMS_FIELD_NUMBER)
    assert got_lengths.dtype == np.uint64 and got_lengths.tolist() == lengths
    assert got_sums.tolist() == sums


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def test_unpacked_and_split_fields_are_read_as_a_parser_reads_them() -> None:
    """A field sent unpacked (a tag per value) or packed in several pieces, among
    other fields of every wire type, is all of its values in order."""
    raw = (_varint(1 << 3) + _varint(7)                       # field 1, varint
           + _varint(2 << 3) + _varint(5)                     # field 2 unpacked: 5
           + _varint(9 << 3 | 1) + b"\x00" * 8                # field 9, fixed64
           + _varint(2 << 3 | 2) + _varint(3) + _varint(300) + _varint(1)  # packed: 300, 1
           + _varint(10 << 3 | 5) + b"\x00" * 4               # field 10, fixed32
           + _varint(11 << 3 | 2) + _varint(2) + b"ab"        # field 11, bytes
           + _varint(2 << 3) + _varint((1 << 64) - 1))        # unpacked again
    assert np.frombuffer(_native.varints_column(raw, 2), np.uint64).tolist() == [
        5, 300, 1, (1 << 64) - 1]
    assert pb.CommitRequest.FromString(raw).lengths == [5, 300, 1, (1 << 64) - 1]
    assert _native.varints_column(raw, 3) == b""


@pytest.mark.parametrize("raw", [
    _varint(2 << 3 | 2) + _varint(5) + b"\x01",            # a length past the end
    _varint(2 << 3 | 2) + _varint(1) + b"\x80",            # a varint cut by its field's end
    _varint(2 << 3) + b"\xff" * 10 + b"\x01",              # a varint of 11 bytes
    _varint(2 << 3) + b"\xff" * 9 + b"\x02",               # bits past the 64th
    _varint(2 << 3 | 1) + b"\x00" * 8,                     # the field, but not a varint
    _varint(3 << 3 | 3),                                   # a group (not in our messages)
    _varint(0 << 3) + _varint(1),                          # field number 0
    _varint(9 << 3 | 1) + b"\x00" * 7,                     # another field cut short
    b"\x80",                                               # a tag cut short
], ids=["length", "cut", "long", "overflow", "type", "group", "zero", "short", "tag"])
def test_a_malformed_message_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError, match="well-formed"):
        _native.varints_column(raw, 2)


def test_only_unsigned_columns_of_known_widths_are_encoded() -> None:
    assert _native.varints_field(2, np.zeros(0, np.uint64)) == b""  # proto3: omitted
    for bad in (np.zeros(3, np.int64), np.zeros(3, np.float64), np.zeros(3, np.uint16)):
        with pytest.raises(ValueError, match="unsigned"):
            _native.varints_field(2, bad)
    with pytest.raises(ValueError, match="field"):
        _native.varints_field(0, b"\x01")
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        _native.varints_field(2, np.zeros((4, 4), np.uint64)[:, 1])  # not contiguous
