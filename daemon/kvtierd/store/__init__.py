"""The store: per-namespace block tables and key indexes, CLOCK eviction, reservations,
leases.

The package: ``Store`` holds its parts, each made by its own constructor and given the
parts it uses (no class derives from another; calls go one way, down this list's
order of holders: ``Store`` -> ``Operations``/``FastPath`` -> ``Allocator`` ->
``Budget`` -> ``StoreState``):

* ``types``: the data (namespaces, extents, block handles, sessions, reservations,
  leases).  No Python object per block: a namespace's slots live in its
  ``BlockTable`` (``kvtierd.block_table``, native) over the persisted slot tables,
  and its keys in its shared index (``keys``: the table clients search *is* the
  index).  ``Block`` is a handle made on demand, never kept; the tiering layer names
  blocks in ``BlockBatch``es instead (one namespace's refs, generations, keys,
  lengths and checksums as columns: ``demotion_candidates``, ``pin_blocks``,
  ``set_lower_many``).
* ``keys``: the key index.
* ``base``: what the parts share: ``StoreOptions``, ``Pinned`` (the one answer to
  "is it pinned?"), ``_Undo`` and the internal signals of a claim.
* ``state``: ``StoreState`` (``Store.state``): namespaces, sessions, reservations and
  leases, and the primitives every part uses: pins, hazards, the access clock, the
  one commit transition (``StoreState.commit_slots``).
* ``budget``: ``Budget`` (``Store.budget``): the DRAM budget and the extents drawn
  from it -- growth for a reserve and ahead of need, extents added, retired files.
* ``allocator``: ``Allocator`` (``Store.room``): finding room for a reserve or a
  refill (``claim_refs``: free slots, eviction by CLOCK, reclaim of other
  namespaces' extents, or "grow first"), retiring extents, and the one exit of DRAM
  blocks.
* ``operations``: ``Operations`` (``Store.calls``): the calls: sessions, lookup,
  reserve/commit/abort, acquire/release, delete, and the tiering layer's hooks.
* ``fast_path``: ``FastPath`` (``Store.fast_path``): writes without a call (when to
  refill grants, the commit ring's answer) and page counters.
* ``grants``: a ``GrantBook`` per session (``Session.grants``) that the parts hold
  and call: the grants' columns and every way one ends (grant, take, commit through
  the store's one commit transition, revoke, sweep, quarantine, close), and the
  refill policy (``grant_limit``, ``grant_target``).
* ``store``: ``Store`` itself: the composition root and the public API (each call
  handed to the part that owns it), with expiry, accounting and ``check``
  (``check``: the cross-check, on a snapshot).
* ``adoption``: taking over a previous run's segments, at start-up -- functions that
  take the store (``kvtierd.recovery`` calls them).

Every option a store has is given to its constructor (``StoreOptions``); what is
known only once the store exists is told by a method (``attach_tiering``,
``attach_cluster``, ``set_recovery_report``), never set as an attribute.
Policy lives here; bytes never do.  The store decides which slot a key gets,
when a block becomes visible, which block is evicted, and who holds what;
the mechanism (``segments``) persists slot states; the service translates the
wire.

Every public call either applies fully or changes nothing.  Each makes one
call to the block table that changes slots (``claim`` with its evictions,
``commit`` with the slots it frees, ``release_claims`` with the pins it ends,
``pin``, ``unpin``, ``delete``, ``evict``): the table validates the whole batch
and then changes all of it or, refusing, nothing; the key index and the
Python bookkeeping follow (nothing there can fail).  Where a call needs two
(``acquire``: pin, then touch), the second's refusal takes the first back.
The exceptions, each consistent on its own: a failed reserve may already have
reclaimed extents of other namespaces or grown its own (cache policy: the
reclaimed blocks were evictable and left through the one exit); a failed
reclaim or reformat may have removed the files of extents it still holds (they
serve on, and at the next restart their blocks are gone like evicted ones);
``expire`` is all or nothing per namespace (one that fails expires at the next
sweep).

Pins (each pin is granted by exactly one call and released by exactly one call;
``Pinned`` is the one answer to "is this pinned?", whichever way it was granted):

1. **write with a call**: ``reserve`` grants a reservation (slot state RESERVED,
   key IN_FLIGHT); exactly one of ``commit`` / ``abort`` / reservation expiry
   (the slots are quarantined for the TTL) / session close ends it.
2. **write without a call** (``csrc/writes.c``; all of it in ``grants``):
   ``refill_grants`` reserves a slot ahead and ``GrantBook.grant`` names it in the
   session's page (a grant); exactly one of a page commit (``commit_from_page`` ->
   ``GrantBook.commit``), its take-back while no writer took it (idle:
   ``GrantBook.sweep``; or its extent reclaimed: ``grants.take_back_untaken``, by the
   page's compare-and-swap), quarantine once a writer held it taken for the
   reservation TTL (``GrantBook.sweep`` finds it, ``expire`` ends it), or session
   close ends it.  A commit from a page and a Commit call are one transition
   (``StoreState.commit_slots``, which the fast path hands the book).
3. **read with a call**: ``acquire`` grants a lease (each block's pin count +1 in
   the table: not evictable); exactly one of ``release`` / lease expiry / session
   close ends it.
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
grow in extents.  A reserve that finds no free slot grows a new extent when
the budget allows; else it evicts unleased blocks of its namespace chosen by
CLOCK (a bit set by every read, a hand that clears it and takes the blocks
without one: docs/decisions.md), or reclaims a whole extent of another
namespace whose blocks are all evictable -- an empty one, one whose newest
access is older than every block CLOCK would evict here, or any when this
namespace has too few to evict (so the budget moves between namespaces).
Eviction is the one place where DRAM blocks leave.

Spill (``spill_enabled``, told by ``kvtierd.tiering``: ``attach_tiering``): every block is
DIRTY (DRAM is its only copy), CLEAN (a spill tier holds a durable copy) or
UNSPILLABLE (spilling it failed).  Only non-DIRTY blocks are evicted, and only
extents without DIRTY blocks are reclaimed; a reserve that could be served by
evicting DIRTY blocks raises ``NeedDemotion`` instead, and the tiering layer
waits for the demoter (back-pressure) and retries.
"""

from __future__ import annotations

from kvtierd.store.base import ExtentFactory, Pinned, StoreOptions
from kvtierd.store.check import CheckSnapshot
from kvtierd.store.grants import GRANT_IDLE_SECONDS, CommitResult, GrantBook
from kvtierd.store.store import Store
from kvtierd.store.types import (
    MAX_GROW_ROUNDS,
    MAX_KEPT_RETIRED,
    MAX_READ_HINTS,
    AcquireResult,
    AdoptedSlots,
    Block,
    BlockBatch,
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
    U64s,
)

__all__ = [
    "GRANT_IDLE_SECONDS", "MAX_GROW_ROUNDS", "MAX_KEPT_RETIRED",
    "MAX_READ_HINTS", "AcquireResult", "AdoptedSlots", "Block", "BlockBatch", "CheckSnapshot",
    "CommitResult", "Extent", "ExtentFactory", "GrantBook", "Lease", "Lower", "Namespace", "NeedDemotion", "PageCommits",
    "Peer", "Pinned", "Reservation", "ReserveResult", "ReserveStatus", "Session", "SlotGrant", "Store",
    "StoreOptions", "U64s",
]
