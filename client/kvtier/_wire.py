"""What both ends of the wire must agree on, defined once for the daemon and the client.

The daemon (``kvtierd.session_channel.framing``, ``kvtierd.service``) imports these
from here, as the client does: the daemon depends on ``kvtier``, never the
reverse.  Changing a value here changes the protocol on both sides at once.

Session channel frames are a 4-byte big-endian length and a serialized
``kvtier.v1.SessionRequest`` / ``SessionResponse``; a frame that carries
segment fds carries them as ``SCM_RIGHTS`` on the bytes of that frame, at
most :data:`MAX_FDS_PER_MSG` per ``sendmsg``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Final, TypeVar, cast

import numpy as np
import numpy.typing as npt
from google.protobuf.message import Message

from kvtier import _native
from kvtier.v1 import kvtier_pb2 as pb

#: The length prefix of every session-channel frame (body bytes, big-endian).
FRAME_LEN: Final = struct.Struct(">I")
#: Linux SCM_MAX_FD: most fds one sendmsg may carry, so the sender splits longer
#: lists and the receiver makes room for this many per recvmsg.
MAX_FDS_PER_MSG: Final = 253
#: gRPC metadata entry that carries the session token on every call.
SESSION_METADATA: Final = "kvtier-session"
#: Each tier's number in the wire enum ``kvtier.v1.Tier`` by its name: the enum's
#: value name without ``TIER_``, in lower case ("dram", "ssd", "shared", "cluster").
#: The CLI's tables and ``--tier``, the daemon's metrics labels, logs and tier
#: objects all use these names; a tier added to the proto gets its name here.
TIER_OF_NAME: Final[dict[str, pb.Tier]] = {
    name.removeprefix("TIER_").lower(): cast("pb.Tier", number)  # (typed int in the stub)
    for name, number in pb.Tier.items() if number != pb.TIER_UNSPECIFIED}
#: Each tier's name by its number (``TIER_OF_NAME`` turned around).
TIER_NAMES: Final[dict[int, str]] = {number: name for name, number in TIER_OF_NAME.items()}

#: Repeated integer fields of at least this many values go to and from the wire as
#: columns (``with_columns``, ``columns``); shorter ones through protobuf's Python API,
#: which is quicker for a few values than a serialization and a merge.
COLUMN_MIN: Final = 64

M = TypeVar("M", bound=Message)


def with_columns(msg: M, columns: Mapping[int, npt.NDArray[np.unsignedinteger] | bytes]) -> M:
    """``msg`` with each repeated varint field (by number) set to a column of unsigned
    integers (u8, u32 or u64; bytes: a u8 each), merged in C: no Python int per value
    (``csrc/wire.c``).  The fields must be empty in ``msg``."""
    msg.MergeFromString(b"".join(_native.varints_field(f, v) for f, v in columns.items()))
    return msg


def columns(msg: Message, *fields: int) -> list[npt.NDArray[np.uint64]]:
    """Repeated varint fields (by number) of ``msg`` as uint64 columns, read from one
    serialization of it in C (no Python int per value)."""
    raw = msg.SerializeToString()
    return [np.frombuffer(_native.varints_column(raw, f), dtype=np.uint64) for f in fields]


__all__ = ["COLUMN_MIN", "FRAME_LEN", "MAX_FDS_PER_MSG", "SESSION_METADATA", "TIER_NAMES",
           "TIER_OF_NAME", "columns", "with_columns"]
