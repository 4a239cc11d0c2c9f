"""What both ends of the wire must agree on, defined once for the daemon and the client.

The daemon (``kvtierd.session_channel``, ``kvtierd.service``) imports these
from here, as the client does: the daemon depends on ``kvtier``, never the
reverse.  Changing a value here changes the protocol on both sides at once.

Session channel frames are a 4-byte big-endian length and a serialized
``kvtier.v1.SessionRequest`` / ``SessionResponse``; a frame that carries
segment fds carries them as ``SCM_RIGHTS`` on the bytes of that frame, at
most :data:`MAX_FDS_PER_MSG` per ``sendmsg``.
"""

from __future__ import annotations

import struct
from typing import Final

#: The length prefix of every session-channel frame (body bytes, big-endian).
FRAME_LEN: Final = struct.Struct(">I")
#: Linux SCM_MAX_FD: most fds one sendmsg may carry, so the sender splits longer
#: lists and the receiver makes room for this many per recvmsg.
MAX_FDS_PER_MSG: Final = 253
#: gRPC metadata entry that carries the session token on every call.
SESSION_METADATA: Final = "kvtier-session"

__all__ = ["FRAME_LEN", "MAX_FDS_PER_MSG", "SESSION_METADATA"]
