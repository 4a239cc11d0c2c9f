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
from typing import Final, cast

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

__all__ = ["FRAME_LEN", "MAX_FDS_PER_MSG", "SESSION_METADATA", "TIER_NAMES", "TIER_OF_NAME"]
