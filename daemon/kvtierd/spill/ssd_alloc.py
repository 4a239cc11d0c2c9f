"""The SSD tier's slot allocation: a free slot, a new file, or room made by eviction.

In order: a free slot of the size; a new file while the byte budget allows (one
creator per slot size at a time -- the others wait for its file rather than each
taking budget for one; a slot size's first file is small, each next twice the last);
the budget of an empty file of another size; the CLOCK victim of this size; a whole
file of another size, emptied.  A namespace at its SSD quota evicts its own CLOCK
victim instead of taking more room.

CLOCK: a referenced bit per slot, set when an entry is read (``SsdTier.read_into``),
and a hand per slot size that clears it and takes the first unreferenced slot.  An
evicted entry's verified bytes go to ``SsdTier.on_evict`` first (the next tier).
"""

from __future__ import annotations

import collections
import errno
import logging
import threading
from typing import TYPE_CHECKING, Final

import numpy as np

from kvtierd.logs import Throttle, event, more
from kvtierd.spill import format as fmt
from kvtierd.spill.blockio import aligned_buffer, fault_kind
from kvtierd.spill.ssd_files import (
    BUSY,
    FIRST_FILE_BYTES,
    FIRST_FILE_SLOTS,
    FREE,
    INDEXED,
    SpillFile,
    SpillFull,
    SsdEntry,
    create_file,
    retire_file,
)

if TYPE_CHECKING:
    from kvtierd.spill.ssd import SsdTier

log = logging.getLogger(__name__)
_throttle = Throttle()

#: Slots one allocation's CLOCK hand may pass for a victim (bounded work per write).
EVICTION_SCAN_LIMIT: Final = 4096


class _Retry(Exception):
    pass


class SlotAllocator:
    """Slots for the SSD tier's writers; its state (the hands, the files being made,
    the bytes each quota-limited namespace is writing) is guarded by the tier's lock."""

    def __init__(self, tier: SsdTier) -> None:
        self.tier = tier
        #: Signalled when a file is created (writers of that slot size wait for it).
        self.room = threading.Condition(tier._lock)
        self.creating: set[int] = set()
        #: The CLOCK hand of each slot size: (position in ``files[size]``, slot).
        self.hands: dict[int, tuple[int, int]] = {}
        #: Bytes of slots each quota-limited namespace is writing right now.
        self.writing: collections.Counter[str] = collections.Counter()

    def allocate(self, slot_bytes: int) -> tuple[SpillFile, int]:
        """A slot of ``slot_bytes`` owned by the caller (``BUSY``).

        In order: a free slot; a new file while the budget allows (one creator
        per slot size at a time -- the others wait for its file rather than
        each taking budget for one); the budget of an empty file of another
        size; the CLOCK victim of this size; a whole file of another size,
        emptied.
        """
        t = self.tier
        while True:
            with self.room:
                found = self._pop_free(slot_bytes)
                if found is not None:
                    return found
                if slot_bytes in self.creating:
                    self.room.wait(timeout=1.0)
                    continue
                layout = fmt.SpillLayout.fit(
                    slot_bytes, min(self._next_file_bytes(slot_bytes),
                                    t.capacity - t.file_budget_used))
                if layout is None and self._retire_empty_file(slot_bytes):
                    continue
                victim: SsdEntry | None = None
                if layout is None:
                    try:
                        victim = self._take_victim(slot_bytes)
                    except _Retry:
                        continue
                else:
                    self.creating.add(slot_bytes)
                    t.file_budget_used += layout.file_bytes
                    index = t._next_index
                    t._next_index += 1
            if victim is not None:
                return self._reuse(victim)
            assert layout is not None
            try:
                f = create_file(t.io, t.root, layout, index, t._open_flags())
            except OSError as exc:
                with self.room:
                    self.creating.discard(slot_bytes)
                    self.room.notify_all()
                    t.file_budget_used -= layout.file_bytes
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not t.files:
                        raise
                    # The filesystem holds less than spill.ssd_capacity: make do with the
                    # files there are (evict within them) instead of failing every write.
                    t.capacity = t.file_budget_used
                t._absorbed(fault_kind(exc))
                log.warning("SSD tier %s: filesystem full (%s); capacity lowered to the %d "
                            "bytes of spill files already allocated", t.root, exc,
                            t.capacity)
                continue
            except BaseException:
                with self.room:
                    self.creating.discard(slot_bytes)
                    self.room.notify_all()
                    t.file_budget_used -= layout.file_bytes
                raise
            with self.room:
                t.key_index.add_file(f)
                t.files.setdefault(slot_bytes, []).append(f)
                self.creating.discard(slot_bytes)
                self.room.notify_all()

    def allocate_within_quota(self, namespace: str, key: bytes,
                              slot_bytes: int) -> tuple[SpillFile, int]:
        """``allocate``, except that a namespace at its SSD quota reuses the slot of its
        own CLOCK victim of this size instead of taking more room."""
        t = self.tier
        quota = t.quota_of(namespace)
        if not quota:
            return self.allocate(slot_bytes)
        with self.room:
            # Slots being written count too: concurrent writers must not all see room.
            held = t._bytes_of[namespace] + self.writing[namespace]
            ns_id = t.names.ids.get(namespace)
            old = -1 if ns_id is None else t._probe(ns_id, key)[1]
            if old >= 0:  # a rewrite frees the old copy's bytes
                held -= t.key_index.locate(old)[0].slot_bytes
            if held + slot_bytes <= quota:
                victim = None
                self.writing[namespace] += slot_bytes
            else:
                found = (None if ns_id is None else
                         self._clock(slot_bytes, ns_id=ns_id, exclude=old, limit=None))
                if found is None:
                    raise SpillFull(f"namespace {namespace!r} is at its SSD quota ({held} of "
                                    f"{quota} bytes) and none of its {slot_bytes}-byte blocks "
                                    "can be evicted")
                victim = self._evict_for_reuse(*found)
                self.writing[namespace] += slot_bytes
        if victim is None:
            try:
                return self.allocate(slot_bytes)
            except BaseException:
                with t._lock:
                    self.writing[namespace] -= slot_bytes
                raise
        return self._reuse(victim)

    def written(self, namespace: str, slot_bytes: int) -> None:
        """A quota-counted slot is no longer being written (lock held)."""
        if self.writing.get(namespace):
            self.writing[namespace] -= slot_bytes

    def _pop_free(self, slot_bytes: int) -> tuple[SpillFile, int] | None:
        t = self.tier
        for f in t.files.get(slot_bytes, ()):
            if f.nfree:
                f.nfree -= 1
                slot = int(f.free[f.nfree])
                f.state[slot] = BUSY
                f.nbusy += 1
                return f, slot
        return None

    def _clock(self, slot_bytes: int, *, ns_id: int | None = None, exclude: int = -1,
               limit: int | None = EVICTION_SCAN_LIMIT) -> tuple[SpillFile, int] | None:
        """The CLOCK victim among the INDEXED, unread slots of this size (of namespace
        ``ns_id`` only, when given; never slot id ``exclude``), or None (lock held).

        The hand passes at most ``limit`` slots (None: twice round), clearing the
        referenced bit of each candidate it passes; when all it passed were
        referenced, the first of them is the victim.  Vectorised: a window of slots
        at a time."""
        t = self.tier
        fs = t.files.get(slot_bytes)
        if not fs:
            return None
        fi, pos = self.hands.get(slot_bytes, (0, 0))
        if fi >= len(fs):
            fi, pos = 0, 0
        total = sum(f.n_slots for f in fs)
        budget = 2 * total if limit is None else min(limit, 2 * total)
        scanned = 0
        fallback: tuple[SpillFile, int] | None = None
        while scanned < budget:
            f = fs[fi]
            stop = min(f.n_slots, pos + max(1, min(budget - scanned, 1 << 16)))
            ok = (f.state[pos:stop] == INDEXED) & (f.readers[pos:stop] == 0)
            if ns_id is not None:
                ok &= f.nsid[pos:stop] == ns_id
            if pos <= exclude - f.base < stop:
                ok[exclude - f.base - pos] = False
            cand = np.flatnonzero(ok) + pos
            if cand.size:
                cold = np.flatnonzero(f.ref[cand] == 0)
                if cold.size:
                    f.ref[cand[: cold[0]]] = 0
                    slot = int(cand[cold[0]])
                    self.hands[slot_bytes] = (fi, slot + 1)
                    return f, slot
                f.ref[cand] = 0  # a second chance each
                if fallback is None:
                    fallback = (f, int(cand[0]))
            scanned += stop - pos
            pos = stop
            if pos >= f.n_slots:
                fi, pos = (fi + 1) % len(fs), 0
        if fallback is not None:
            self.hands[slot_bytes] = (fs.index(fallback[0]), fallback[1] + 1)
        else:
            self.hands[slot_bytes] = (fi, pos)
        return fallback

    def _take_victim(self, slot_bytes: int) -> SsdEntry:
        """Evict the CLOCK victim of this size (lock held), or reclaim a file."""
        found = self._clock(slot_bytes)
        if found is None:
            if self._reclaim_other_size(slot_bytes):
                raise _Retry
            raise SpillFull(f"SSD tier is full: no evictable {slot_bytes}-byte slot "
                            "(all are being read or written)")
        return self._evict_for_reuse(*found)

    def _evict_for_reuse(self, f: SpillFile, slot: int) -> SsdEntry:
        """Take an entry out of the index; its slot becomes the caller's (busy) (lock held).
        Returns the entry as it was."""
        t = self.tier
        e = t._entry_at(f, slot)
        t._unindex(t.key_index.bucket_of(f, slot), f, slot)
        f.state[slot] = BUSY
        f.ref[slot] = 0
        f.nbusy += 1
        f.committed -= 1
        t.counters.evictions += 1
        if t.on_evicted is not None:
            t.on_evicted(e.namespace, e.key)
        return e

    def _reuse(self, victim: SsdEntry) -> tuple[SpillFile, int]:
        t = self.tier
        if t.on_evict is not None:
            buf = aligned_buffer(fmt.round_up(victim.length))
            try:
                t._read_verified(victim, memoryview(buf))
                t.on_evict(victim, memoryview(buf))
            except Exception as exc:  # the victim is dropped either way; never crash
                held = _throttle("ssd/evict_pass_on")
                if held is not None:
                    log.warning("SSD tier: evicted block %s of %r not passed on: %s%s",
                                victim.key.hex(), victim.namespace, exc, more(held),
                                extra=event("spill_fault", tier="shared", op="write",
                                            kind="pass_on", held_back=held))
            finally:
                buf.close()
        return victim.file, victim.slot

    def _retire_empty_file(self, slot_bytes: int) -> bool:
        """Give back the budget of an empty file of another slot size (lock held)."""
        t = self.tier
        for size, fs in t.files.items():
            if size == slot_bytes:
                continue
            for f in fs:
                if f.committed == 0 and not f.nbusy:
                    self._forget_file(f)
                    return True
        return False

    def _forget_file(self, f: SpillFile) -> None:
        """Take a file out of the tier and delete it in the background (lock held)."""
        t = self.tier
        t.files[f.slot_bytes].remove(f)
        if not t.files[f.slot_bytes]:
            del t.files[f.slot_bytes]
        self.hands.pop(f.slot_bytes, None)
        t.key_index.remove_file(f)
        f.dropped = True
        t.file_budget_used -= f.layout.file_bytes
        t._pending_frees.discard(f)
        threading.Thread(target=retire_file, args=(t.io, f), daemon=True).start()

    def _reclaim_other_size(self, slot_bytes: int) -> bool:
        """Budget is held by files of other slot sizes: empty the coldest one (the fewest
        referenced entries, then the oldest write), evicting its blocks, and delete it
        (lock held)."""
        t = self.tier
        best: tuple[float, int, SpillFile] | None = None
        for size, fs in t.files.items():
            if size == slot_bytes:
                continue
            for f in fs:
                if f.nbusy or not f.committed:
                    continue
                live = f.state == INDEXED
                n = int(live.sum())
                if n != f.committed or f.readers[live].any():
                    continue  # being read
                score = (float(f.ref[live].sum()) / n, int(f.rows()["seq"][live].min()), f)
                if best is None or score[:2] < best[:2]:
                    best = score
        if best is None:
            return self._retire_empty_file(slot_bytes)
        f = best[2]
        for slot in np.flatnonzero(f.state == INDEXED).tolist():
            name, key = t.names.names[int(f.nsid[slot])], f.row_key(slot)
            t._unindex(t.key_index.bucket_of(f, slot), f, slot)
            f.state[slot] = FREE
            t.counters.evictions += 1
            if t.on_evicted is not None:
                t.on_evicted(name, key)
        f.committed = 0
        self._forget_file(f)
        return True

    def _next_file_bytes(self, slot_bytes: int) -> int:
        """The size of the next file for ``slot_bytes`` (sizes double, from small)."""
        t = self.tier
        n = len(t.files.get(slot_bytes, ()))
        first = max(FIRST_FILE_BYTES, FIRST_FILE_SLOTS * slot_bytes)
        return min(t.file_bytes, first << min(n, 32))

