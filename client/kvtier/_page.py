"""The session page's layout: every offset, size and flag, from ``csrc/layout.h``.

A session's page is shared by the client (``kvtier._index``) and the daemon
(``kvtierd.shared_index``), and read and written by native code on both sides
(``csrc/index.c``, ``csrc/writes.c``).  ``csrc/layout.h`` is its one definition:
the names here are read from it at import (``_native.LAYOUT``), never
written as numbers of their own.  Without the native module there is no page
(``AVAILABLE`` is False on both sides) and every value here is 0.
"""

from __future__ import annotations

from typing import Final

try:
    from kvtier import _native
except ImportError:  # not built: no page is ever made or mapped
    _native = None  # type: ignore[assignment]

_L: Final[dict[str, int]] = _native.LAYOUT if _native is not None else {}


def _get(name: str) -> int:
    """The header's constant ``name`` (a KeyError for a name the module does not export:
    a module built from another header); 0 without the module."""
    return _L[name] if _native is not None else 0


#: The shared index: its header's and entries' bytes, the longest probe, and the
#: header's flags word.
INDEX_HEADER_BYTES: Final = _get("IDX_HEADER_BYTES")
INDEX_ENTRY_BYTES: Final = _get("IDX_ENTRY_BYTES")
INDEX_MAX_PROBE: Final = _get("IDX_MAX_PROBE")
SUPERSEDED: Final = _get("IDX_SUPERSEDED")
MISS_NOT_FINAL: Final = _get("IDX_MISS_NOT_FINAL")

#: The page (u64 offsets): the client's counters, the hazards' bound, the read ring's
#: head, the limits the daemon writes, the client's reservations from grants.
PAGE_BYTES: Final = _get("PAGE_BYTES")
COUNTERS: Final = _get("PAGE_COUNTERS")
COUNTERS_N: Final = _get("PAGE_COUNTERS_N")
HAZARD_HI: Final = _get("PAGE_HAZARD_HI")
RING_HEAD: Final = _get("PAGE_RING_HEAD")
MAX_LEASES: Final = _get("PAGE_MAX_LEASES")
MAX_RESERVATIONS: Final = _get("PAGE_MAX_RESERVATIONS")
LOCAL_RESERVATIONS: Final = _get("PAGE_LOCAL_RESERVATIONS")
MAX_HAZARDS: Final = _get("PAGE_MAX_HAZARDS")
MAX_HAZARDS_SET: Final = _get("MAX_HAZARDS_SET")
#: The ring of blocks read (hazard values), the hazards and their serials.
RING: Final = _get("PAGE_RING")
RING_N: Final = _get("PAGE_RING_N")
HAZARDS: Final = _get("PAGE_HAZARDS")
SERIALS: Final = _get("PAGE_SERIALS")
HAZARDS_N: Final = _get("PAGE_HAZARDS_N")
HAZARD_BIT: Final = _get("HAZARD_BIT")

#: The write area (a page twice as long): the commit ring's head, DONE, waiters, the
#: wanted grants, the grants, the records.
WPAGE_BYTES: Final = _get("WPAGE_BYTES")
W_HEAD: Final = _get("W_HEAD")
W_DONE: Final = _get("W_DONE")
W_WAITERS: Final = _get("W_WAITERS")
W_WANT: Final = _get("W_WANT")
W_GRANTS: Final = _get("W_GRANTS")
GRANTS_N: Final = _get("W_GRANTS_N")
GRANT_VALID: Final = _get("GRANT_VALID")
GRANT_TAKEN: Final = _get("GRANT_TAKEN")
#: A grant word's segment id (bits 32..61: above them, VALID and TAKEN).
GRANT_SEGMENT_MASK: Final = _get("GRANT_SEGMENT_MASK")
W_RING: Final = _get("W_RING")
RECORD_BYTES: Final = _get("W_RECORD")
RING_RECORDS: Final = _get("W_RING_N")
KEY_MAX: Final = _get("W_KEY_MAX")
#: A commit record's fields (byte offsets), flags and result bytes.
R_GRANT: Final = _get("R_GRANT")
R_LENGTH: Final = _get("R_LENGTH")
R_CHECKSUM: Final = _get("R_CHECKSUM")
R_KEYLEN: Final = _get("R_KEYLEN")
R_FLAGS: Final = _get("R_FLAGS")
R_RESULT: Final = _get("R_RESULT")
R_KEY: Final = _get("R_KEY")
R_WORD: Final = _get("R_WORD")
HAS_SUM: Final = _get("W_HAS_SUM")
LAST: Final = _get("W_LAST")
COMMITTED: Final = _get("W_COMMITTED")
EXISTS: Final = _get("W_EXISTS")
INVALID: Final = _get("W_INVALID")
LOST: Final = _get("W_LOST")
FAILED: Final = _get("W_FAILED")
