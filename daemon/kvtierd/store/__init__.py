"""The store: per-namespace index, one host-wide LRU, reservations, leases.

The package, layer on layer (each a class over the one before; calls go down):

* ``types``: the data (namespaces, extents, blocks, sessions, reservations, leases).
* ``base``: the state, and the primitives every layer uses: pins and their
  accounting, the one exit of DRAM blocks, what clients hold without a call
  (hazards and grants in their pages), ``_Undo``.
* ``room``: finding room for a reserve (free slots, growth, eviction, reclaim of
  other namespaces' extents) and retiring extents.
* ``operations``: the calls: sessions, lookup, reserve/commit/abort,
  acquire/release, delete, evict, and the tiering layer's hooks.
* ``fast_path``: writes without a call (grants, page commits) and page counters.
* ``adoption``: taking over a previous run's segments.
* ``store``: ``Store`` itself, with expiry, accounting and ``check`` (``check``:
  the cross-check, on a snapshot).
Policy lives here; bytes never do.  The store decides which slot a key gets,
when a block becomes visible, which block is evicted, and who holds what;
the mechanism (``segments``) persists slot states; the service translates the
wire.

Every public call either applies fully or changes nothing.  Each runs in three
phases: validate; persist (the slot-table writes: the steps that can fail);
apply (counters, index, LRU, free lists: in memory, nothing there can fail).
A write that fails takes back the writes before it (``_Undo``), so a failed
call leaves tables and memory as they were.  The exceptions, each consistent
on its own: a failed ``acquire`` may have rewritten the last access of the
blocks before the failing one (only an LRU hint for the next restart); a
failed reserve may already have reclaimed extents of other namespaces or
grown its own (cache policy: the reclaimed blocks were evictable and left
through the one exit); a failed reclaim or reformat may have removed the
files of extents it still holds (they serve on, and at the next restart their
blocks are gone like evicted ones).

Pins (each pin is granted by exactly one call and released by exactly one call;
``Pinned`` is the one answer to "is this pinned?", whichever way it was granted):

1. **write with a call**: ``reserve`` grants a reservation (slot state RESERVED,
   key IN_FLIGHT); exactly one of ``commit`` / ``abort`` / reservation expiry
   (the slots are quarantined for the TTL) / session close ends it.
2. **write without a call** (``csrc/writes.c``): ``refill_grants`` reserves a slot
   ahead and names it in the session's page (a grant); exactly one of a page commit
   (``commit_from_page``), its take-back while no writer took it (idle, or its
   extent reclaimed: ``_revoke_idle_grants``, by the page's compare-and-swap),
   quarantine once a writer held it taken for the reservation TTL, or session
   close ends it.  A commit from a page and a Commit call are one transition
   (``_persist_commits`` / ``_apply_commits``).
3. **read with a call**: ``acquire`` grants a lease (each block's pin count +1, the
   block leaves the LRU); exactly one of ``release`` / lease expiry / session close
   ends it.
4. **read without a call** (``csrc/index.c``): the client writes a hazard naming
   the slot in its page, then checks the shared index still holds the block; the
   daemon reads the pages after a full fence before it reuses a slot.  Exactly one
   of the client clearing it, the page's TTL sweep (``SessionPage.expire``) or
   session close ends it.
5. **the tiering layer's pins**: ``pin_blocks`` (demotion, publication) grants a
   lease of the system session without a TTL; ``unpin`` ends it.

And a **delete of a leased block** (by 3 or 5) hides it at once (it is *doomed*);
its slot is freed by whichever ending drops the last pin.

Capacity: one global DRAM budget (``dram.capacity``) from which namespaces
grow in extents.  A reserve that finds no free slot evicts the host-wide
least recently used unleased block of the same namespace, or reclaims a
whole extent of another namespace whose blocks are all evictable (so the
budget can move between namespaces), or grows a new extent when the budget
allows.  Eviction is the one place where DRAM blocks leave.

Spill (``spill_enabled``, driven by ``kvtierd.tiering``): every block is
DIRTY (DRAM is its only copy), CLEAN (a spill tier holds a durable copy) or
UNSPILLABLE (spilling it failed).  Only non-DIRTY blocks are evicted, and only
extents without DIRTY blocks are reclaimed; a reserve that could be served by
evicting DIRTY blocks raises ``NeedDemotion`` instead, and the tiering layer
waits for the demoter (back-pressure) and retries.
"""

from __future__ import annotations

from kvtierd.store.base import ExtentFactory, Pinned
from kvtierd.store.check import CheckSnapshot
from kvtierd.store.store import Store
from kvtierd.store.types import (
    EVICTION_SCAN_LIMIT,
    GRANT_IDLE_SECONDS,
    MAX_GROW_ROUNDS,
    MAX_KEPT_RETIRED,
    MAX_READ_HINTS,
    AcquireResult,
    AdoptedSlots,
    Block,
    CommitResult,
    Extent,
    Lease,
    Lower,
    Namespace,
    NeedDemotion,
    PageCommits,
    Peer,
    Reservation,
    ReserveResult,
    ReserveStatus,
    Session,
    SlotGrant,
)

__all__ = [
    "EVICTION_SCAN_LIMIT", "GRANT_IDLE_SECONDS", "MAX_GROW_ROUNDS", "MAX_KEPT_RETIRED",
    "MAX_READ_HINTS", "AcquireResult", "AdoptedSlots", "Block", "CheckSnapshot",
    "CommitResult", "Extent", "ExtentFactory", "Lease", "Lower", "Namespace", "NeedDemotion", "PageCommits",
    "Peer", "Pinned", "Reservation", "ReserveResult", "ReserveStatus", "Session", "SlotGrant", "Store",
]
