"""The rules of a warm start's slot validation, stated in numpy: the oracle the native
``BlockTable.adopt`` is tested against (tests/unit/test_block_table.py).

The daemon adopts a previous run's segments natively (``store.adoption.adopt_segment``:
``BlockTable.adopt``, csrc/blocks.c); this is the same validation written plainly,
over the same slot table, so a test can compare every verdict.
"""

from __future__ import annotations

import collections

import numpy as np

from kvtier import _accel
from kvtierd.layout import CONSTANTS
from kvtierd.segments import (
    ENTRY_SUM_AT,
    FLAG_HAS_CHECKSUM,
    KEY_OFFSET,
    MAX_ACCESS_SEQ,
    MAX_GENERATION,
    MAX_KEY_BYTES,
    SLOT_DTYPE,
    SLOT_ENTRY_BYTES,
    Segment,
    SlotState,
)
from kvtierd.store import AdoptedSlots


def scan_slots(seg: Segment, *, boot_epoch: int) -> tuple[AdoptedSlots, collections.Counter[str]]:
    """Validate every slot of an attached segment; what the store may adopt, and what not.

    COMMITTED slots whose every field is in bounds and whose entry checksum
    verifies become blocks; RESERVED slots are quarantined (a writer of the
    previous daemon may still be copying); everything else is freed, in the
    table too.  Generations out of range are reset.  Reasons for dropped
    COMMITTED slots (and for state bytes that are no state) are counted.
    """
    lay = seg.layout
    n = lay.n_slots
    raw = seg.raw_table()  # one copy of the table: the numpy view and the row hashes read it
    table = np.frombuffer(raw, dtype=SLOT_DTYPE, count=n)
    state, klen, flags = table["state"], table["key_len"], table["flags"]
    length, csum, gen = table["length"], table["checksum"], table["generation"]
    last, epoch = table["last_access"], table["epoch"]
    slot_end = (np.arange(n, dtype=np.uint64) + 1) * np.uint64(lay.slot_bytes)
    dropped: collections.Counter[str] = collections.Counter()
    ok = state == SlotState.COMMITTED
    checks = (
        ("key length out of range", (klen < 1) | (klen > MAX_KEY_BYTES)),
        ("length out of range", (length < 1) | (length > lay.block_bytes)),
        ("unknown flags", (flags & ~np.uint8(FLAG_HAS_CHECKSUM)) != 0),
        ("checksum without its flag", ((flags & FLAG_HAS_CHECKSUM) == 0) & (csum != 0)),
        ("generation out of range", gen >= MAX_GENERATION),
        ("access sequence out of range", last >= MAX_ACCESS_SEQ),
        ("commit epoch from the future", epoch > boot_epoch),
        ("data cut off by a client", slot_end > np.uint64(seg.intact_bytes)),
    )
    for reason, bad in checks:
        hit = ok & bad
        if hit.any():
            dropped[reason] += int(hit.sum())
            ok &= ~bad
    # Entry checksums of every row in one native call (entry_seed() vectorised: uint64
    # arithmetic wraps like its mask), then the keys of the rows that pass.
    seeds = (np.uint64(seg.created_unix_ns & (2**64 - 1))
             ^ (np.arange(n, dtype=np.uint64) * np.uint64(CONSTANTS["SLOT_SEED_MUL"])))
    sums = np.frombuffer(_accel.hash_rows(raw, SLOT_ENTRY_BYTES, CONSTANTS["SLOT_SUM_FROM"],
                                          ENTRY_SUM_AT, seeds), dtype=np.uint64)
    mismatch = ok & (sums != table["entry_sum"])
    if mismatch.any():
        dropped["entry checksum mismatch"] += int(mismatch.sum())
        ok &= ~mismatch
    keys = _keys(raw, np.flatnonzero(ok), klen[ok])
    bad_state = state > SlotState.DOOMED
    if bad_state.any():
        dropped["invalid state byte"] += int(bad_state.sum())
    reserved = state == SlotState.RESERVED
    to_free = ~ok & ~reserved
    for slot in np.flatnonzero(to_free & (state != SlotState.FREE)).tolist():
        seg.mark_free(slot)
    # A slot that is not adopted starts its generations again when they ran (or were
    # forged) into the upper half: reserves count up from there, and a block committed
    # at 2**48 would be dropped at the next start.  Adopted blocks keep theirs (at least
    # 2**47 reserves of headroom).
    restart_gen = ~ok & (gen >= MAX_GENERATION // 2)
    gens = np.where(restart_gen, 0, gen)
    for slot in np.flatnonzero(restart_gen & reserved).tolist():
        seg.mark_reserved(slot, 0)  # still quarantined: its writer may still be copying
    has_sum = (flags[ok] & FLAG_HAS_CHECKSUM).astype(bool)
    sums = csum[ok].tolist()
    adopted = AdoptedSlots(
        slots=np.flatnonzero(ok).tolist(),
        keys=keys,
        lengths=length[ok].tolist(),
        checksums=sums if has_sum.all() else [
            c if h else None for c, h in zip(sums, has_sum.tolist(), strict=True)],
        last_access=last[ok].tolist(),
        reserved=np.flatnonzero(reserved).tolist(),
        free=np.flatnonzero(to_free).tolist(),
        generations=gens.tolist(),
    )
    return adopted, dropped


def _keys(raw: bytes, slots: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    """The keys of ``slots`` (in that order) from a slot table's bytes.

    Keys of one length come out of numpy at once (a ``V`` record's ``tolist()``
    is its bytes, trailing NULs kept); tables hold one key length or a few.
    """
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, SLOT_ENTRY_BYTES)
    out = np.empty(len(slots), dtype=object)
    for k in np.unique(lengths).tolist():
        pick = lengths == k
        cols = np.ascontiguousarray(rows[slots[pick], KEY_OFFSET : KEY_OFFSET + k])
        out[pick] = cols.view(f"V{k}").ravel().tolist()
    keys: list[bytes] = out.tolist()
    return keys
