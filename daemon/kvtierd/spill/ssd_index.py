"""The SSD tier's key index: (namespace, key) -> slot id, in one open-addressing table.

Linear probing, backward-shift deletion, load at most 3/4; 8 bytes a bucket: the
upper half of the xxh3-64 of (namespace, key) (which gives the home bucket) over
slot id + 1 (0: empty).  A slot id is a spill file's ``base`` + slot; the index
hands the ids out (:meth:`SsdKeyIndex.add_file`) and renumbers them from 0 when the
next file's would not fit 32 bits.  A hit is confirmed against the key and namespace
bytes in the file's slot-table mirror, so a hash collision is a probe more, never a
wrong block.

The hash is defined over a slot entry's zero-padded key and namespace fields, seeded
with their lengths: exactly what ``_accel.hash_rows`` computes over a whole slot table
at once, so re-adoption and ``check()`` hash every row in one native call.  One key
at a time (writes, removals, single finds) the probe runs here; a batch of keys goes
to one native call (``_accel.ssd_find_slots``: the same hash, the same buckets, the
same confirmation; its layout is csrc/layout.h's SSD entry).

Why not the DRAM tier's table (``csrc/index.c``): its entries are 64 bytes (a
fingerprint and a client-readable location per key, one table per namespace), this
one's buckets 8 (11-21 bytes an entry at its load); an SSD tier holds millions of
entries (docs/decisions.md, "The SSD tier's bookkeeping in columns").

Not thread-safe: the SSD tier's lock guards every call.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import xxhash

from kvtier import _accel
from kvtierd.spill import format as fmt
from kvtierd.spill.ssd_files import INDEXED, SpillFile

#: Keys per native batch lookup (``find_slots``): it copies each key's 193-byte field
#: first, so a huge batch goes in pieces of a few MiB.
FIND_BATCH: Final = 16384
#: The key index starts with this many buckets, grows (doubles) above MAX_LOAD, and is
#: rebuilt at most half full: probes stay short, 8 bytes a bucket is 11-21 bytes an entry.
MIN_BUCKETS: Final = 1024
MAX_LOAD: Final = 0.75
#: A bucket holds the upper half of its key's hash (the home bucket's bits, and a check
#: that spares most mismatches a look at the slot table) over slot id + 1.
MAX_SLOT_IDS: Final = (1 << 32) - 1
_LOW: Final = (1 << 32) - 1
_MISS: Final = (-1, -1, None)
ENTRY_BYTES: Final = fmt.ENTRY_BYTES
KEY_AT: Final = fmt.KEY_AT
ENTRY_SUM_AT: Final = fmt.ENTRY_SUM_AT


def key_hash(ns: bytes, key: bytes) -> int:
    """The key index's hash of (namespace, key): the xxh3-64 of the slot entry's zero-padded
    key and namespace fields, seeded with their lengths (what ``hash_rows`` computes over
    a whole slot table at re-adoption)."""
    field = key.ljust(fmt.MAX_KEY_BYTES, b"\0") + ns.ljust(fmt.NAME_BYTES, b"\0")
    return field_hash(field, len(key), len(ns))


def field_hash(field: bytes, key_len: int, ns_len: int) -> int:
    """``key_hash`` of an entry's padded key + namespace field and their lengths."""
    return xxhash.xxh3_64_intdigest(field, key_len | ns_len << 8)


def row_key_hashes(table: Any, n: int) -> np.ndarray:
    """``key_hash`` of every row of a raw slot table (one native call)."""
    raw = np.frombuffer(table, dtype=np.uint8, count=n * fmt.ENTRY_BYTES).reshape(
        n, fmt.ENTRY_BYTES)
    seeds = raw[:, 1].astype(np.uint64) | raw[:, 2].astype(np.uint64) << np.uint64(8)
    out = np.frombuffer(_accel.hash_rows(table, fmt.ENTRY_BYTES, fmt.KEY_AT, fmt.ENTRY_SUM_AT,
                                         np.ascontiguousarray(seeds)), dtype=np.uint64)
    return out


def row_ns_hashes(table: Any, n: int) -> np.ndarray:
    """An xxh3-64 of every row's padded namespace field, seeded with its length."""
    raw = np.frombuffer(table, dtype=np.uint8, count=n * fmt.ENTRY_BYTES).reshape(
        n, fmt.ENTRY_BYTES)
    seeds = np.ascontiguousarray(raw[:, 2].astype(np.uint64))
    return np.frombuffer(_accel.hash_rows(table, fmt.ENTRY_BYTES, fmt.NS_AT, fmt.ENTRY_SUM_AT,
                                          seeds), dtype=np.uint64)


def ns_hash(ns: bytes) -> int:
    """``row_ns_hashes`` of one namespace's encoded name."""
    return xxhash.xxh3_64_intdigest(ns.ljust(fmt.NAME_BYTES, b"\0"), len(ns))


class SsdKeyIndex:
    """The buckets, and the spill files by slot id (``files`` ascending by ``base``)."""

    def __init__(self) -> None:
        self.buckets = np.zeros(MIN_BUCKETS, np.uint64)
        self.n = 0  # indexed entries
        # Files by slot id: ``bases`` ascending, ``files`` the file at each.
        self.bases: list[int] = []
        self.files: list[SpillFile] = []
        self._next_base = 0

    # ---------------------------------------------------------------- slot ids
    def locate(self, sid: int) -> tuple[SpillFile, int]:
        """(file, slot) of a slot id."""
        f = self.files[bisect.bisect_right(self.bases, sid) - 1]
        return f, sid - f.base

    def add_file(self, f: SpillFile) -> None:
        """Give ``f`` its slot ids.

        Slot ids fit 32 bits (the low half of a bucket); when the next file's would
        not, every file is numbered afresh from 0 and the index rebuilt."""
        if self._next_base + f.layout.n_slots >= MAX_SLOT_IDS:
            self._next_base = 0
            for g in self.files:
                g.base = self._next_base
                self._next_base += g.layout.n_slots
            self.bases = [g.base for g in self.files]
            renumbered = True
        else:
            renumbered = False
        f.base = self._next_base
        self._next_base += f.layout.n_slots
        self.bases.append(f.base)
        self.files.append(f)
        if renumbered:
            self.rebuild()

    def remove_file(self, f: SpillFile) -> None:
        """Take a file none of whose slots is indexed out of the numbering."""
        at = self.files.index(f)
        del self.files[at], self.bases[at]

    # ---------------------------------------------------------------- lookups
    def probe(self, key: bytes, ns: bytes, ns_pad: bytes
              ) -> tuple[int, int, SpillFile | None]:
        """(bucket, slot id, file) of (namespace ``ns``, key) in the index, or
        (-1, -1, None); ``ns_pad`` is ``ns`` as the entry's zero-padded field.

        A candidate is confirmed by the upper half of its key hash (in its bucket),
        then by the key and namespace fields of its slot-table entry (lengths, then
        the padded fields in one comparison)."""
        klen, nlen = len(key), len(ns)
        if not 1 <= klen <= fmt.MAX_KEY_BYTES:
            return _MISS
        field = key.ljust(fmt.MAX_KEY_BYTES, b"\0") + ns_pad
        tag = field_hash(field, klen, nlen) >> 32
        buckets = self.buckets
        mask = len(buckets) - 1
        i = tag & mask
        bases, files = self.bases, self.files
        one = files[0] if len(files) == 1 else None
        while True:
            v = buckets.item(i)
            if v == 0:
                return _MISS
            if v >> 32 == tag:
                sid = (v & _LOW) - 1
                f = one if one is not None else files[bisect.bisect_right(bases, sid) - 1]
                off = (sid - f.base) * ENTRY_BYTES
                t = f.table
                if (t[off + 1] == klen and t[off + 2] == nlen
                        and t[off + KEY_AT : off + ENTRY_SUM_AT] == field):
                    return i, sid, f
            i = (i + 1) & mask

    def find_slots(self, ns: bytes, keys: Sequence[bytes]) -> np.ndarray:
        """The slot id of each key of namespace ``ns`` in the index, or -1: what
        ``probe`` finds, for every key in one native call (``_accel.ssd_find_slots``:
        the same hash, the same confirmation against the slot-table mirror)."""
        tables = [f.table for f in self.files]
        if len(keys) <= FIND_BATCH:
            return np.frombuffer(_accel.ssd_find_slots(self.buckets, tables, self.bases,
                                                       keys, ns), dtype=np.int64)
        return np.concatenate([  # (the call copies its keys: ~200 B a key at a time)
            np.frombuffer(_accel.ssd_find_slots(self.buckets, tables, self.bases,
                                                keys[at : at + FIND_BATCH], ns), np.int64)
            for at in range(0, len(keys), FIND_BATCH)])

    def bucket_of(self, f: SpillFile, slot: int) -> int:
        """The bucket holding an INDEXED slot: its key hash again, from the slot-table
        entry."""
        t, off = f.table, slot * ENTRY_BYTES
        h = field_hash(bytes(t[off + KEY_AT : off + ENTRY_SUM_AT]), t[off + 1], t[off + 2])
        buckets = self.buckets
        mask = len(buckets) - 1
        want = (h >> 32) << 32 | (f.base + slot + 1)
        i = (h >> 32) & mask
        while buckets.item(i) != want:
            if not buckets.item(i):
                raise AssertionError(f"slot {slot} of {f.path} is INDEXED but not indexed")
            i = (i + 1) & mask
        return i

    # ---------------------------------------------------------------- changes
    def insert(self, sid: int, h: int) -> None:
        """Put a slot id known to be absent, its key hash ``h``, into the index."""
        if (self.n + 1) > MAX_LOAD * len(self.buckets):
            self._grow()
        buckets = self.buckets
        mask = len(buckets) - 1
        tag = h >> 32
        i = tag & mask
        while buckets.item(i):
            i = (i + 1) & mask
        buckets[i] = tag << 32 | (sid + 1)
        self.n += 1

    def delete(self, i: int) -> None:
        """Empty bucket ``i``, shifting later members of its run back."""
        buckets = self.buckets
        mask = len(buckets) - 1
        buckets[i] = 0
        j = i
        while True:
            j = (j + 1) & mask
            v = buckets.item(j)
            if v == 0:
                break
            home = (v >> 32) & mask
            if (j - home) & mask >= (j - i) & mask:  # its home is not in (i, j]
                buckets[i] = v
                buckets[j] = 0
                i = j
        self.n -= 1

    def _grow(self) -> None:
        """Twice the buckets, the members re-placed by their tags."""
        v = self.buckets[self.buckets != 0]
        self.place(v >> np.uint64(32), v, 2 * len(self.buckets))

    def rebuild(self) -> None:
        """The index afresh from the files' INDEXED slots and their slot-table entries
        (re-adoption, renumbering; vectorised, one native hashing call a file)."""
        tags: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        for f in self.files:
            slots = np.flatnonzero(f.state == INDEXED)
            tag = row_key_hashes(f.table, f.n_slots)[slots] >> np.uint64(32)
            tags.append(tag)
            vals.append(tag << np.uint64(32) | (slots.astype(np.uint64)
                                                 + np.uint64(f.base + 1)))
        empty = np.zeros(0, np.uint64)
        self.place(np.concatenate(tags) if tags else empty,
                   np.concatenate(vals) if vals else empty, MIN_BUCKETS)

    def place(self, tags: np.ndarray, vals: np.ndarray, n_buckets: int) -> None:
        """Fill a fresh bucket array of at least ``n_buckets`` (at most half full) with
        ``vals``, each from the home its tag gives."""
        while n_buckets < MIN_BUCKETS or len(vals) > n_buckets // 2:
            n_buckets *= 2
        # Linear probing in one pass: in order of home bucket, each item takes the first
        # bucket at or after its home past the one before it (a cumulative maximum);
        # the few that run off the end wrap round one by one.
        home = (tags & np.uint64(n_buckets - 1)).astype(np.int64)
        order = np.argsort(home, kind="stable")
        k = np.arange(len(order), dtype=np.int64)
        pos = np.maximum.accumulate(home[order] - k) + k if len(order) else k
        inside = pos < n_buckets
        buckets = np.zeros(n_buckets, np.uint64)
        buckets[pos[inside]] = vals[order[inside]]
        self.buckets = buckets
        self.n = int(inside.sum())
        mask = n_buckets - 1
        for j in np.flatnonzero(~inside).tolist():
            v = int(vals[order[j]])
            i = (v >> 32) & mask
            while buckets.item(i):
                i = (i + 1) & mask
            buckets[i] = v
            self.n += 1

    # ---------------------------------------------------------------- invariants
    def check(self, ids: np.ndarray) -> list[str]:
        """Every indexed slot (``ids``, the files' INDEXED slot ids) once in the index,
        found from its hash's home bucket."""
        b = self.buckets
        occ = np.flatnonzero(b)
        vals = (b[occ] & np.uint64(_LOW)) - np.uint64(1)
        got = np.sort(vals)
        if len(got) != self.n or not np.array_equal(got, np.sort(ids)):
            return [f"SSD key index holds {len(got)} slots (count {self.n}), the "
                    f"files {len(ids)} indexed ones (or other ones)"]
        if not len(occ):
            return []
        n = len(b)
        if len(occ) == n:
            return ["SSD key index is full"]
        tags = b[occ] >> np.uint64(32)
        which = np.searchsorted(np.array(self.bases, np.uint64), vals, side="right") - 1
        for k, f in enumerate(self.files):
            m = which == k
            slots = (vals[m] - np.uint64(f.base)).astype(np.int64)
            row_tags = row_key_hashes(f.table, f.n_slots)[slots] >> np.uint64(32)
            if (row_tags != tags[m]).any():
                return [f"{os.path.basename(f.path)}: a key hash in the index differs from "
                        "its slot table entry"]
        # A member must sit no further from its home than the run of members before it.
        idx = np.arange(n)
        last_empty = np.maximum.accumulate(np.where(b == 0, idx, -1))
        if last_empty[-1] >= 0:  # runs that wrap around: the last empty before the end
            last_empty = np.where(last_empty < 0, last_empty[-1] - n, last_empty)
        run = idx - last_empty - 1
        dist = (occ.astype(np.uint64) - (tags & np.uint64(n - 1))) & np.uint64(n - 1)
        if (dist > run[occ]).any():
            return ["SSD key index has a member its probe cannot reach"]
        return []
