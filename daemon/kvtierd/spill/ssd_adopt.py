"""The SSD tier's re-adoption at start: every spill file's slot table read, validated
and indexed, with no Python loop per entry.

One sequential read per file, no data read (every read verifies the data's checksum
instead); each table validated with vectorised numpy and one native hashing call for
its entry checksums, one for its key hashes and one for its namespace hashes; the
same key in two slots (a crash between a rewrite and the old copy's FREE entry):
the newest write wins.  Functions of an :class:`~kvtierd.spill.ssd.SsdTier` that is
not yet serving (``SsdTier.open``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from kvtier import _accel
from kvtierd.spill import format as fmt
from kvtierd.spill import ssd_index
from kvtierd.spill.blockio import aligned_buffer
from kvtierd.spill.ssd_files import FILE_RE, FREE, INDEXED, SpillFile, unlink_quietly

if TYPE_CHECKING:
    from kvtierd.spill.ssd import SsdTier

log = logging.getLogger(__name__)


def adopt_files(tier: SsdTier) -> int:
    """Re-adopt every spill file under the tier's root (dropping the ones that fail
    their checks, and leftovers of a file creation cut short); returns the entries
    kept."""
    for name in sorted(tier.io.listdir(tier.root)):
        path = os.path.join(tier.root, name)
        if name.endswith(".tmp") or name.startswith(".kvtier-direct-probe"):
            unlink_quietly(tier.io, path)  # a file creation cut short by a crash
            continue
        match = FILE_RE.fullmatch(name)
        if match is None:
            continue
        try:
            _adopt_file(tier, path, int(match.group(1)), int(match.group(2)))
        except (fmt.FormatError, OSError) as exc:
            log.warning("SSD tier: dropping spill file %s: %s", path, exc)
            tier.counters.dropped_files.append(f"{name}: {exc}")
            tier._absorbed("bad_file")
            unlink_quietly(tier.io, path)
    with tier._lock:
        return _index_adopted(tier)


def _adopt_file(tier: SsdTier, path: str, slot_bytes: int, index: int) -> None:
    """Read a file's header and slot table and validate every entry (vectorised); its
    valid entries become INDEXED-to-be (``_index_adopted`` indexes them)."""
    fd = tier.io.open(path, tier._open_flags())
    try:
        size = tier.io.fstat_size(fd)
        page = aligned_buffer(fmt.PAGE)
        n = tier.io.pread(fd, page, 0)
        layout, head_index = fmt.unpack_spill_header(bytes(page[:n]), size)
        if (layout.slot_bytes, head_index) != (slot_bytes, index):
            raise fmt.FormatError(f"header says slot_bytes={layout.slot_bytes} index="
                                  f"{head_index}, the name says {slot_bytes}/{index}")
        if tier.file_budget_used + layout.file_bytes > tier.capacity:
            raise fmt.FormatError(f"does not fit in spill.ssd_capacity ({tier.capacity} "
                                  "bytes) next to the files adopted before it")
        table = aligned_buffer(layout.table_bytes)
        if tier.io.pread(fd, table, fmt.TABLE_OFFSET) != layout.table_bytes:
            raise fmt.FormatError("slot table is truncated")
    except BaseException:
        tier.io.close(fd)
        raise
    f = SpillFile(path, fd, index, layout, table)
    n = layout.n_slots
    rows, raw = f.rows(), f.raw()
    state = rows["state"]
    klen = rows["key_len"]
    nlen = rows["ns_len"]
    sums = np.frombuffer(_accel.hash_rows(table, fmt.ENTRY_BYTES, 0, fmt.ENTRY_SUM_AT,
                                          np.zeros(n, np.uint64)), dtype=np.uint64)
    ok = ((state == fmt.EntryState.COMMITTED) & (sums == rows["entry_sum"])
          & (klen >= 1) & (klen <= fmt.MAX_KEY_BYTES) & (nlen <= fmt.NAME_BYTES)
          & (rows["length"] >= 1) & (rows["length"] <= layout.slot_bytes))
    # The key and namespace fields are zero past their lengths (what ``key_hash``
    # assumes); an entry that says otherwise was not written by this code.  Checked
    # per distinct length over the table in place (a table has one or a few).
    for lens, at, width in ((klen, fmt.KEY_AT, fmt.MAX_KEY_BYTES),
                            (nlen, fmt.NS_AT, fmt.NAME_BYTES)):
        for size in np.unique(lens[ok]).tolist():
            if size >= width:
                continue
            sel = np.flatnonzero(ok & (lens == size))
            if 8 * len(sel) >= n:  # most of the table: scan it in place
                junk = raw[:, at + size : at + width].any(axis=1) & (lens == size)
                ok &= ~junk
            else:  # a few rows: copy just them
                ok[sel[raw[sel, at + size : at + width].any(axis=1)]] = False
    cand = np.flatnonzero(ok)
    if cand.size:
        ns_h = ssd_index.row_ns_hashes(table, n)[cand]
        if (ns_h == ns_h[0]).all():  # one namespace (the usual file): no sort
            uniq, first = ns_h[:1], np.zeros(1, np.int64)
            inverse = np.zeros(len(cand), np.int64)
        else:
            uniq, first, inverse = np.unique(ns_h, return_index=True,
                                             return_inverse=True)
            inverse = inverse.reshape(-1)
        ids = np.empty(len(uniq), np.uint32)
        for u, row in enumerate(cand[first].tolist()):
            field = bytes(raw[row, fmt.NS_AT : fmt.NS_AT + int(nlen[row])])
            try:
                ids[u] = tier.names.id_of(field.decode())
            except UnicodeDecodeError:  # not a name this code wrote
                ids[u] = 0
                ok[cand[inverse == u]] = False
        f.nsid[cand] = ids[inverse]
    torn = np.flatnonzero((state != fmt.EntryState.FREE) & ~ok)
    good = np.flatnonzero(ok)
    f.state[good] = INDEXED
    f.committed = int(good.size)
    raw[torn] = 0
    del rows, raw, state, klen, nlen
    if torn.size:
        tier.counters.dropped_entries += int(torn.size)
        tier._absorbed("torn_entry", int(torn.size))
        log.warning("SSD tier: %s: %d slot entries failed their check and were freed",
                    path, torn.size)
        f.freed_pages.update(np.unique(torn // fmt.ENTRIES_PER_PAGE).tolist())
        tier._pending_frees.add(f)
    free = np.flatnonzero(f.state == FREE)[::-1]
    f.nfree = len(free)
    f.free[: f.nfree] = free
    tier.key_index.add_file(f)
    tier.files.setdefault(slot_bytes, []).append(f)
    tier.file_budget_used += layout.file_bytes
    tier._next_index = max(tier._next_index, index + 1)


def _index_adopted(tier: SsdTier) -> int:
    """Index every adopted entry; the same key twice (a crash between a rewrite and
    the free of the old copy): the newest write wins, the other slot is freed.
    Returns the entries kept (lock held)."""
    ix = tier.key_index
    files = ix.files
    if not files:
        return 0
    slots = [np.flatnonzero(f.state == INDEXED) for f in files]
    sid = np.concatenate([s.astype(np.uint64) + np.uint64(f.base)
                          for s, f in zip(slots, files, strict=True)])
    h = np.concatenate([ssd_index.row_key_hashes(f.table, f.n_slots)[s]
                        for s, f in zip(slots, files, strict=True)])
    seq = np.concatenate([f.rows()["seq"][s]
                          for s, f in zip(slots, files, strict=True)])
    hs = np.sort(h)
    starts = np.zeros(0, np.int64)
    if len(hs) > 1 and (hs[1:] == hs[:-1]).any():  # rare: sort again, keeping order
        order = np.lexsort((~seq, h))  # by hash, the newest first among equal ones
        hs = h[order]
        dup = hs[1:] == hs[:-1]
        starts = np.flatnonzero(dup & ~np.concatenate([[False], dup[:-1]]))
    forgot = False
    for j in starts.tolist():  # runs of equal hashes (rare): compare the keys' bytes
        kept: list[bytes] = []
        k = j
        while k < len(hs) and hs[k] == hs[j]:
            f, slot = ix.locate(int(sid[order[k]]))
            off = slot * fmt.ENTRY_BYTES
            ident = bytes(f.table[off + 1 : off + 3]) + bytes(
                f.table[off + fmt.KEY_AT : off + fmt.ENTRY_SUM_AT])
            if ident in kept:
                _forget_adopted(tier, f, slot)  # an older copy of a kept key
                forgot = True
            else:
                kept.append(ident)
            k += 1
    if forgot:
        ix.rebuild()
    else:  # the hashes are at hand
        tags = h >> np.uint64(32)
        ix.place(tags, tags << np.uint64(32) | (sid + np.uint64(1)), ssd_index.MIN_BUCKETS)
    tier._bytes_of.clear()
    for f in files:
        live = f.state == INDEXED
        counts = np.bincount(f.nsid[live], minlength=len(tier.names.names))
        for i in np.flatnonzero(counts).tolist():
            tier._bytes_of[tier.names.names[i]] += int(counts[i]) * f.slot_bytes
    # The reference bits are not persisted: the newer half of the writes starts
    # referenced, so the hand takes the older half first rather than in slot order.
    if len(seq):
        tier._seq = int(seq.max())
        median = np.median(seq)
        at = 0
        for f, live in zip(files, slots, strict=True):
            f.ref[live] = seq[at : at + len(live)] >= median
            at += len(live)
        for f in files:  # (an older copy dropped above: not referenced)
            f.ref[f.state != INDEXED] = 0
    return ix.n


def _forget_adopted(tier: SsdTier, f: SpillFile, slot: int) -> None:
    """Drop an adopted entry that lost to a newer copy of its key."""
    f.clear_row(slot)
    f.state[slot] = FREE
    f.push_free(slot)
    f.committed -= 1
    tier._pending_frees.add(f)
    tier.counters.dropped_entries += 1
