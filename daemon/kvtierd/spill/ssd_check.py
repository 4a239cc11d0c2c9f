"""``SsdTier.check``: the SSD tier's state cross-checked, for tests and after a warm
attach: the key index against the slot columns, the free stacks, the slot tables
(every indexed entry's key hash and namespace recomputed from its table row) and the
byte budget.  O(slots), vectorised, under the tier's lock.
"""

from __future__ import annotations

import collections
import os
from typing import TYPE_CHECKING

import numpy as np

from kvtierd.spill import format as fmt
from kvtierd.spill import ssd_index
from kvtierd.spill.ssd_files import BUSY, FREE, INDEXED, REMOVED, SpillFile

if TYPE_CHECKING:
    from kvtierd.spill.ssd import SsdTier


def check(tier: SsdTier) -> list[str]:
    """Cross-check the key index, the slot columns, free stacks, slot tables (every
    indexed entry's key hash and namespace recomputed from its table row) and the
    byte budget.  O(slots), vectorised, under the lock."""
    problems: list[str] = []
    with tier._lock:
        budget = 0
        held: collections.Counter[str] = collections.Counter()
        ids: list[np.ndarray] = []
        ns_hash = np.array([ssd_index.ns_hash(b) for b in tier.names.encoded] or [0], np.uint64)
        in_files = {id(f) for fs in tier.files.values() for f in fs}
        if in_files != {id(f) for f in tier.key_index.files}:
            problems.append("SSD files by slot size and by slot id differ")
        for slot_bytes, fs in tier.files.items():
            for f in fs:
                budget += f.layout.file_bytes
                problems += _check_file(tier, f, slot_bytes, ns_hash, held)
                ids.append(np.flatnonzero(f.state == INDEXED).astype(np.uint64)
                           + np.uint64(f.base))
        if budget != tier.file_budget_used:
            problems.append(f"SSD file budget {tier.file_budget_used} != files {budget}")
        if budget > tier.capacity:
            problems.append(f"SSD files {budget} exceed spill.ssd_capacity {tier.capacity}")
        if +held != +tier._bytes_of:
            problems.append(f"SSD bytes per namespace {dict(+tier._bytes_of)} != "
                            f"{dict(+held)} counted from the slots")
        problems += tier.key_index.check(
            np.concatenate(ids) if ids else np.zeros(0, np.uint64))
    return problems


def _check_file(tier: SsdTier, f: SpillFile, slot_bytes: int, ns_hash: np.ndarray,
                held: collections.Counter[str]) -> list[str]:
    problems: list[str] = []
    where = os.path.basename(f.path)
    if f.slot_bytes != slot_bytes:
        problems.append(f"{where}: filed under slot size {slot_bytes}")
    counts = np.bincount(f.state, minlength=4)
    if len(counts) > 4:
        problems.append(f"{where}: slot states out of range")
    free = f.free[: f.nfree]
    if len(np.unique(free)) != f.nfree:
        problems.append(f"{where}: free list has duplicates")
    if (f.nfree != counts[FREE] or (f.nfree and (f.state[free] != FREE).any())):
        problems.append(f"{where}: free list {f.nfree} != FREE slots {counts[FREE]}")
    if f.nbusy != counts[BUSY]:
        problems.append(f"{where}: busy counter {f.nbusy} != BUSY slots {counts[BUSY]}")
    if f.committed != counts[INDEXED] + counts[REMOVED]:
        problems.append(f"{where}: committed counter {f.committed} != indexed "
                        f"{counts[INDEXED]} + being read {counts[REMOVED]}")
    if (f.readers[(f.state == FREE) | (f.state == BUSY)] != 0).any():
        problems.append(f"{where}: readers on a free or busy slot")
    rows = f.rows()
    on_table = rows["state"] == fmt.EntryState.COMMITTED
    live = f.state == INDEXED
    if (live & ~on_table).any():
        problems.append(f"{where}: indexed slots are FREE in the slot table")
    if (on_table & (f.state == FREE)).any():
        problems.append(f"{where}: slot table has COMMITTED slots nobody holds")
    sel = np.flatnonzero(live)
    if sel.size:
        nsid = f.nsid[sel]
        if (nsid >= len(tier.names.names)).any():
            problems.append(f"{where}: a namespace id out of range")
        elif (ssd_index.row_ns_hashes(f.table, f.n_slots)[sel] != ns_hash[nsid]).any():
            problems.append(f"{where}: a namespace differs from its slot table entry")
        else:
            for i, c in enumerate(np.bincount(nsid).tolist()):
                if c:
                    held[tier.names.names[i]] += c * f.slot_bytes
    del rows
    return problems

