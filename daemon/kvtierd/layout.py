"""The records the daemon shares with native code, as ``csrc/layout.h`` defines them.

A DRAM segment's slot entry (``kvtierd.segments``, written natively by the block
table in ``csrc/blocks.c``) and an SSD spill file's slot entry
(``kvtierd.spill.format``, read natively by the SSD tier's key index in
``csrc/native.c``) are laid out once, in that header.  This module reads every
offset and size from the native module (``_native.LAYOUT``: each constant of the
header; ``_native.FIELDS``: each record's fields) and builds from them the numpy
dtypes and ``struct`` formats Python reads and writes the records with; no Python
file writes those numbers itself.  ``tests/unit/test_layout_header.py`` compiles a
C program against the header and fails when what Python reads here differs.

(The session page and its commit records are the client's too: ``kvtier._page``
reads them from the same export.)
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple

import numpy as np

from kvtier import _native  # the daemon runs on the native module (block table, recovery)

#: Every constant of ``csrc/layout.h``, by name without its ``KVT_`` prefix.
CONSTANTS: Final[Mapping[str, int]] = _native.LAYOUT


class Field(NamedTuple):
    """One field of a record: where it starts, how many bytes, and what it holds."""

    offset: int
    size: int
    kind: str  # "u": a little-endian unsigned integer; "s": a byte string


#: struct's codes of the little-endian unsigned integers, by size.
_INT_CODES: Final = {1: "B", 2: "H", 4: "I", 8: "Q"}


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """A fixed-size record of ``csrc/layout.h``: its size and its fields."""

    name: str
    size: int
    fields: Mapping[str, Field]

    def offset(self, name: str) -> int:
        """Where field ``name`` starts in the record."""
        return self.fields[name].offset

    def dtype(self, names: Sequence[str] | None = None) -> np.dtype:
        """A numpy record of the fields ``names`` (all of them when None), as long as
        the record: for viewing whole tables of it."""
        chosen = list(self.fields) if names is None else list(names)
        return np.dtype({
            "names": chosen,
            "formats": [_numpy_format(self.fields[n]) for n in chosen],
            "offsets": [self.fields[n].offset for n in chosen],
            "itemsize": self.size,
        })

    def struct(self, names: Sequence[str] | None = None) -> struct.Struct:
        """A little-endian ``struct`` of the fields ``names`` (all when None) in offset
        order, from the record's start to the last of them.  Each gap before a field
        is zero padding, packed and unpacked as naturally aligned unsigned integers
        (a gap at bytes 3..8 is a u8 and a u32), which the caller passes as 0."""
        chosen = sorted((self.fields[n] for n in (self.fields if names is None else names)),
                        key=lambda f: f.offset)
        codes, at = ["<"], 0
        for f in chosen:
            if f.offset < at:
                raise ValueError(f"{self.name}: fields overlap at byte {f.offset}")
            while at < f.offset:
                size = next(s for s in (8, 4, 2, 1) if at % s == 0 and at + s <= f.offset)
                codes.append(_INT_CODES[size])
                at += size
            codes.append(_INT_CODES[f.size] if f.kind == "u" else f"{f.size}s")
            at = f.offset + f.size
        return struct.Struct("".join(codes))


def _numpy_format(f: Field) -> str:
    return f"<u{f.size}" if f.kind == "u" else f"S{f.size}"


def _record(name: str, size: int) -> Record:
    return Record(name, size, {n: Field(*v) for n, v in _native.FIELDS[name].items()})


#: A DRAM segment's slot entry (``kvtierd.segments``).
SLOT_ENTRY: Final = _record("slot_entry", CONSTANTS["SLOT_BYTES"])
#: An SSD spill file's slot entry (``kvtierd.spill.format``).
SSD_ENTRY: Final = _record("ssd_entry", CONSTANTS["SSD_ENTRY"])
