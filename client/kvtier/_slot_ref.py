"""Slot refs: a block's place (segment id, slot) as one u64, encoded and decoded here only.

A ref is ``segment_id << SHIFT | slot`` (``KVT_REF`` in ``csrc/layout.h``, read from
the native module).  The daemon's block table names blocks by refs
(``kvtierd.block_table``), the shared index stores them, and a session page's words
carry one under flags in their top bits: a hazard is ``HAZARD_BIT | ref``, a grant
``GRANT_VALID [| GRANT_TAKEN] | ref`` (``kvtier._page``); ``segment_of`` /
``segments_of`` of such a word keep the flags, so mask them off
(``SEGMENT_MASK``, ``_page.GRANT_SEGMENT_MASK``).

Scalars: ``encode``, ``segment_of``, ``slot_of``.  Arrays of refs (numpy ``uint64``,
one call a batch, never a Python object a block): ``encode_many``, ``segments_of``,
``slots_of``, ``split``.  Without the native module there is no page and no daemon,
so no ref to decode, and every value here is 0.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

try:
    from kvtier import _native
except ImportError:  # not built: no page, no daemon, no ref
    _native = None  # type: ignore[assignment]

_L: Final[dict[str, int]] = _native.LAYOUT if _native is not None else {}

#: A ref's slot is its low SHIFT bits (SLOT_MASK); its segment id the bits above.
SHIFT: Final = _L["REF_SHIFT"] if _L else 0
SLOT_MASK: Final = _L["REF_SLOT_MASK"] if _L else 0
#: A segment id is below 2**31: a hazard word's segment is ``segment_of(word) & SEGMENT_MASK``.
SEGMENT_MASK: Final = _L["REF_SEGMENT_MASK"] if _L else 0

_SHIFT64: Final = np.uint64(SHIFT)
_SLOT_MASK64: Final = np.uint64(SLOT_MASK)


def encode(segment_id: int, slot: int) -> int:
    """The ref of ``slot`` of segment ``segment_id``."""
    return segment_id << SHIFT | slot


def segment_of(ref: int) -> int:
    """The segment id of a ref (with a page word's flags above it)."""
    return ref >> SHIFT


def slot_of(ref: int) -> int:
    """The slot of a ref (or of a page word)."""
    return ref & SLOT_MASK


def encode_many(segment_id: int, slots: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """The refs of ``slots`` of one segment."""
    return (np.uint64(segment_id) << _SHIFT64) | np.asarray(slots, dtype=np.uint64)


def segments_of(refs: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Each ref's segment id."""
    return refs >> _SHIFT64


def slots_of(refs: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Each ref's slot."""
    return refs & _SLOT_MASK64


def split(refs: npt.NDArray[np.uint64]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """(segment ids, slots) of refs."""
    return refs >> _SHIFT64, refs & _SLOT_MASK64
