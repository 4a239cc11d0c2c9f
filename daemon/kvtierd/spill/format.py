"""On-disk formats of the spill tiers (all integers little-endian).

**SSD spill file**, version 1 -- a preallocated file of fixed-size slots, one
file per slot size, shared by every namespace whose blocks round up to it::

    offset 0            header page: magic, version, slot_bytes, n_slots,
                        file index, table/data offsets, xxh64 of the header
    offset TABLE_OFFSET slot table: n_slots entries of ENTRY_BYTES
    offset data_offset  data (page aligned): slot i at data_offset + i * slot_bytes

Entry: state, namespace, key, committed length, xxh3-64 of the data, the
namespace's block_bytes and an xxh3-64 of its model_uid (a block is never
served to a namespace declared differently), a write sequence (newest wins,
LRU order after a restart), and an xxh3-64 of the entry itself so a torn
table write is detected rather than believed.

Commit order: the data is written (O_DIRECT); the changed table pages of a
batch are written after all of its data, then one ``fdatasync`` covers both.  A crash between leaves either the old
entry (whose checksum no longer matches the new data: dropped at its first
read, never served) or the new one; nothing is served without its checksum.

**Shared-tier block file**, version 1 -- one file per block::

    offset 0     header page: magic, version, length, xxh3-64 of the data,
                 block_bytes, model hash, namespace, key, xxh64 of the header
    offset 4096  data (length bytes)

published whole by write-to-temp + fsync + rename, so a reader sees either
no file or a complete one.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Any, Final

import numpy as np
import xxhash

from kvtierd.layout import CONSTANTS, SSD_ENTRY

PAGE: Final = 4096
#: The slot entry's key and namespace fields (csrc/layout.h); a block file's header
#: holds them at the same widths.
MAX_KEY_BYTES: Final = CONSTANTS["SSD_MAX_KEY"]
NAME_BYTES: Final = CONSTANTS["SSD_NAME"]

# ------------------------------------------------------------------ SSD spill file
SPILL_MAGIC: Final = b"KVTSPL\x00\x01"
SPILL_VERSION: Final = 1
HEADER_BYTES: Final = PAGE
TABLE_OFFSET: Final = HEADER_BYTES
#: The slot entry (csrc/layout.h): a 64-byte key and a 128-byte namespace plus the
#: fixed fields.
ENTRY_BYTES: Final = SSD_ENTRY.size
ENTRIES_PER_PAGE: Final = PAGE // ENTRY_BYTES

# magic, version, n_slots, file_index, slot_bytes, table_offset, data_offset, created_ns
_SPILL_HEADER = struct.Struct("<8sIIIQQQQ")
_SUM = struct.Struct("<Q")

# state, key_len, ns_len, pad, pad32, length, checksum, block_bytes, model_hash, seq,
# key, namespace: every field before the entry's checksum.
ENTRY_SUM_AT: Final = SSD_ENTRY.offset("entry_sum")
_ENTRY = SSD_ENTRY.struct([n for n in SSD_ENTRY.fields if n != "entry_sum"])
assert _ENTRY.size <= ENTRY_SUM_AT
#: The entry's fields, for reading one entry in place (``unpack_from``).
ENTRY_STRUCT: Final = _ENTRY

#: The entry as a numpy record, for re-adopting whole tables at start (the key and the
#: namespace are read from the raw rows).
ENTRY_DTYPE: Final = SSD_ENTRY.dtype([n for n in SSD_ENTRY.fields if n not in ("key", "namespace")])
KEY_AT: Final = SSD_ENTRY.offset("key")
NS_AT: Final = SSD_ENTRY.offset("namespace")
SEQ_AT: Final = SSD_ENTRY.offset("seq")


class EntryState(enum.IntEnum):
    FREE = 0
    COMMITTED = 1


class FormatError(ValueError):
    """A spill file or block file that must not be used; the message says why."""


def _sealed(head: bytes) -> bytes:
    """A header page: ``head``, then its xxh64, then zeros to the page's end."""
    page = bytearray(PAGE)
    page[: len(head)] = head
    _SUM.pack_into(page, len(head), xxhash.xxh64_intdigest(head))
    return bytes(page)


def _opened(page: bytes | memoryview, header: struct.Struct, magic: bytes, version: int,
            short: str) -> tuple[Any, ...]:
    """The fields of a header page ``_sealed`` made with ``header`` (its first two: the
    magic and the version), once the magic, the checksum and the version are right;
    raises FormatError naming what is wrong (``short``: the page is too short)."""
    if len(page) < header.size + _SUM.size:
        raise FormatError(short)
    head = bytes(page[: header.size])
    fields = header.unpack(head)
    if fields[0] != magic:
        raise FormatError(f"bad magic {fields[0]!r}")
    (stored,) = _SUM.unpack_from(page, header.size)
    if xxhash.xxh64_intdigest(head) != stored:
        raise FormatError("header checksum mismatch")
    if fields[1] != version:
        raise FormatError(f"format version {fields[1]}, expected {version}")
    return fields


def round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def model_hash(model_uid: str) -> int:
    return xxhash.xxh3_64_intdigest(model_uid.encode())


@dataclasses.dataclass(frozen=True, slots=True)
class SpillLayout:
    """Geometry of one SSD spill file."""

    slot_bytes: int
    n_slots: int

    @property
    def table_bytes(self) -> int:
        return round_up(self.n_slots * ENTRY_BYTES)

    @property
    def data_offset(self) -> int:
        return TABLE_OFFSET + self.table_bytes

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.n_slots * self.slot_bytes

    @classmethod
    def fit(cls, slot_bytes: int, budget: int) -> SpillLayout | None:
        """The largest layout of ``slot_bytes`` slots within ``budget`` bytes (None: not one)."""
        n = max(0, (budget - HEADER_BYTES) // (slot_bytes + ENTRY_BYTES))
        while n > 0 and cls(slot_bytes, n).file_bytes > budget:
            n -= 1
        return cls(slot_bytes, n) if n > 0 else None


def pack_spill_header(layout: SpillLayout, file_index: int, created_ns: int) -> bytes:
    """The header page of a spill file."""
    return _sealed(_SPILL_HEADER.pack(SPILL_MAGIC, SPILL_VERSION, layout.n_slots, file_index,
                                      layout.slot_bytes, TABLE_OFFSET, layout.data_offset,
                                      created_ns))


def unpack_spill_header(page: bytes, file_size: int) -> tuple[SpillLayout, int]:
    """(layout, file index) of a header page; raises FormatError naming what is wrong."""
    _, _, n_slots, index, slot_bytes, table_off, data_off, _ = _opened(
        page, _SPILL_HEADER, SPILL_MAGIC, SPILL_VERSION,
        f"file is {file_size} bytes, shorter than a header")
    if n_slots < 1 or slot_bytes < PAGE or slot_bytes % PAGE:
        raise FormatError(f"header has n_slots={n_slots} slot_bytes={slot_bytes}")
    layout = SpillLayout(slot_bytes, n_slots)
    if table_off != TABLE_OFFSET or data_off != layout.data_offset:
        raise FormatError(f"header offsets ({table_off}, {data_off}) do not follow from "
                          f"{n_slots} slots")
    if file_size != layout.file_bytes:
        raise FormatError(f"file is {file_size} bytes but its header describes "
                          f"{layout.file_bytes} (truncated or extended)")
    return layout, index


@dataclasses.dataclass(frozen=True, slots=True)
class EntryRecord:
    """One decoded, verified COMMITTED slot entry."""

    namespace: str
    key: bytes
    length: int
    checksum: int
    block_bytes: int
    model_hash: int
    seq: int


def pack_entry(rec: EntryRecord | None) -> bytes:
    """The ENTRY_BYTES of a slot entry: COMMITTED ``rec``, or FREE for None."""
    out = bytearray(ENTRY_BYTES)
    if rec is not None:
        ns = rec.namespace.encode()
        _ENTRY.pack_into(out, 0, EntryState.COMMITTED, len(rec.key), len(ns), 0, 0, rec.length,
                         rec.checksum, rec.block_bytes, rec.model_hash, rec.seq, rec.key, ns)
    _SUM.pack_into(out, ENTRY_SUM_AT, xxhash.xxh3_64_intdigest(bytes(out[:ENTRY_SUM_AT])))
    return bytes(out)


def entry_sums(table: bytes | memoryview, n_slots: int) -> np.ndarray:
    """The expected entry_sum of every entry of a raw table (vectorised over rows)."""
    rows = np.frombuffer(table, dtype=np.uint8, count=n_slots * ENTRY_BYTES).reshape(
        n_slots, ENTRY_BYTES)
    return np.fromiter((xxhash.xxh3_64_intdigest(r) for r in rows[:, :ENTRY_SUM_AT]),
                       dtype=np.uint64, count=n_slots)


# ------------------------------------------------------------------ shared-tier block file
BLOCK_MAGIC: Final = b"KVTBLK\x00\x01"
BLOCK_VERSION: Final = 1
BLOCK_DATA_OFFSET: Final = PAGE
# magic, version, key_len, ns_len, pad, length, checksum, block_bytes, model_hash,
# created_ns, key, namespace
_BLOCK_HEADER = struct.Struct(f"<8sIBBHQQQQQ{MAX_KEY_BYTES}s{NAME_BYTES}s")


@dataclasses.dataclass(frozen=True, slots=True)
class BlockHeader:
    namespace: str
    key: bytes
    length: int
    checksum: int
    block_bytes: int
    model_hash: int
    created_ns: int = 0


def pack_block_header(h: BlockHeader) -> bytes:
    ns = h.namespace.encode()
    return _sealed(_BLOCK_HEADER.pack(BLOCK_MAGIC, BLOCK_VERSION, len(h.key), len(ns), 0,
                                      h.length, h.checksum, h.block_bytes, h.model_hash,
                                      h.created_ns, h.key, ns))


def unpack_block_header(page: bytes | memoryview) -> BlockHeader:
    """Decode and verify a block file's header page; raises FormatError."""
    (_, _, klen, nlen, _, length, checksum, block_bytes, mhash, created, key, ns) = _opened(
        page, _BLOCK_HEADER, BLOCK_MAGIC, BLOCK_VERSION,
        f"file is shorter than a header ({len(page)} bytes)")
    if not 1 <= klen <= MAX_KEY_BYTES or nlen > NAME_BYTES or length < 1:
        raise FormatError(f"header has key_len={klen} ns_len={nlen} length={length}")
    return BlockHeader(ns[:nlen].decode(errors="replace"), key[:klen], length, checksum,
                       block_bytes, mhash, created)
