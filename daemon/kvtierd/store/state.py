"""The store's state: namespaces, sessions and what they hold (reservations, leases), and
the primitives on them that every part of the store uses -- the namespaces' lifecycle,
pins and ``Pinned``, the access clock, and the one commit transition
(``StoreState.commit_slots``; for a writer's plain commit ring, the same transition in
one native call: ``StoreState.commit_ring``).

A component the store holds (``Store.state``), not a base class: the allocator
(``kvtierd.store.allocator``), the budget (``kvtierd.store.budget``), the calls
(``kvtierd.store.operations``) and the fast path (``kvtierd.store.fast_path``) are each
given it by their constructor.  It calls none of them."""


from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvtier import _page, _slot_ref
from kvtierd.block_table import RingCommit
from kvtierd.segments import Segment
from kvtierd.shared_index import HazardSet, SessionPage, collect_hazards, hazard_of
from kvtierd.store.base import _NO_REFS, Pinned, StoreOptions
from kvtierd.store.types import (
    MAX_READ_HINTS,
    Block,
    Commits,
    Lease,
    Namespace,
    Peer,
    Reservation,
    Session,
)

log = logging.getLogger(__name__)


class StoreState:
    """Namespaces, sessions, reservations and leases, and the primitives on them (see the
    module docstring).  Runs on the event loop thread; nothing here awaits."""

    def __init__(
        self,
        *,
        lease_ttl: float,
        reservation_ttl: float,
        boot_epoch: int,
        clock: Callable[[], float],
        publish: bool,
        options: StoreOptions,
    ) -> None:
        self.options = options
        self.lease_ttl = lease_ttl
        self.reservation_ttl = reservation_ttl
        self.boot_epoch = boot_epoch
        self.clock = clock
        #: Publish each namespace's keys in a shared index its clients search.
        self.publish = publish
        #: A spill tier exists (``set_lower_tiers``).
        self.spill_enabled = False
        #: Page commits return handles of the blocks they made (the tiering layer turns
        #: this off unless it publishes every commit: a handle per block costs).
        self.commit_handles = True
        self.namespaces: dict[str, Namespace] = {}
        self.sessions: dict[int, Session] = {}
        self.by_token: dict[str, Session] = {}
        self.system_sessions: dict[str, Session] = {}
        #: The open reservations and leases made by calls (and the tiering layer's pins).
        self.reservations: dict[int, Reservation] = {}
        self.leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)
        #: The next access sequence number (persisted as a slot's last access).
        self.next_access = 1
        #: The newest last access adopted so far (``finish_recovery`` goes on from it).
        self.last_adopted = 0
        #: Prefetched blocks first read without a call (tiering counts those read by calls).
        self.prefetched_reads = 0
        #: Recovery's figures (``Store.set_recovery_report``); ``dropped_segments`` also
        #: hears of namespaces reformatted later (``Allocator.reformat``).
        self.recovery_seconds = 0.0
        self.dropped_segments: list[str] = []
        #: Hears every key that comes into or goes out of DRAM (``watch``).
        self._watch: Callable[[str, str, list[bytes], bool], None] | None = None

    def next_id(self) -> int:
        """A new session, reservation or lease id."""
        return next(self._ids)

    def set_lower_tiers(self, spill: bool, commit_handles: bool) -> None:
        """``Store.attach_tiering``'s part: a spill tier exists (a miss in a shared index
        is not final), and whether page commits return handles."""
        self.spill_enabled = spill
        for ns in self.namespaces.values():
            ns.index.table.set_lower_tiers(spill)
        self.commit_handles = commit_handles

    # ------------------------------------------------ namespaces
    def new_namespace(self, name: str, block_bytes: int, model_uid: str,
                      slot_bytes: int, *, publish: bool = True) -> Namespace:
        ns = Namespace(name, block_bytes, model_uid, slot_bytes)
        if publish:
            self.publish_index(ns)
        self._watch_namespace(ns)
        self.namespaces[name] = ns
        return ns

    def watch(self, changed: Callable[[str, str, list[bytes], bool], None] | None) -> None:
        """Tell ``changed(namespace, "dram", keys, stored)`` every key that comes into
        (stored) or goes out of DRAM from now on: the KV events (``kvtierd.events``)."""
        self._watch = changed
        for ns in self.namespaces.values():
            self._watch_namespace(ns)

    def _watch_namespace(self, ns: Namespace) -> None:
        changed = self._watch
        ns.index.watch = None if changed is None else functools.partial(changed, ns.name, "dram")

    def publish_index(self, ns: Namespace) -> None:
        """Let ``ns``'s clients search its key index (when the store publishes)."""
        ns.index.table.set_lower_tiers(self.spill_enabled)
        ns.index.published = self.publish and ns.index.table.fd is not None

    @staticmethod
    def unpublish(ns: Namespace) -> None:
        ns.index.published = False

    def drop_namespace(self, ns: Namespace) -> None:
        del self.namespaces[ns.name]
        ns.index.table.close()  # its clients see SUPERSEDED and ask the daemon

    def forget_if_unused(self, ns: Namespace) -> None:
        """Drop a namespace that holds nothing and that nobody uses (no sessions, extents,
        blocks or reservations): thousands of declared-and-abandoned namespaces must not
        grow the index, Stats or /metrics without bound.  Declaring it again starts fresh."""
        if (ns.sessions or ns.extents or ns.committed or ns.reserved or ns.in_flight
                or self.namespaces.get(ns.name) is not ns):
            return
        system = self.system_sessions.get(ns.name)
        if system is not None and (system.leases or system.reservations):
            return
        self.system_sessions.pop(ns.name, None)
        self.drop_namespace(ns)
        self.options.on_forget(ns.name)

    def system_session(self, ns: Namespace) -> Session:
        """The tiering layer's session in ``ns`` (created on first use; never expires)."""
        session = self.system_sessions.get(ns.name)
        if session is None or session.ns is not ns:
            session = Session(self.next_id(), "", ns, Peer(0, 0, 0), self.clock(), system=True)
            self.system_sessions[ns.name] = session
        return session

    def live_segments(self) -> list[Segment]:
        """Every DRAM segment in use now (any thread: a snapshot taken under the GIL;
        the cluster tier's agent maps these and lets go of the others)."""
        return [e.segment for ns in list(self.namespaces.values()) for e in list(ns.extents)]

    # ------------------------------------------------ pins and reads
    def hazards(self, ns: Namespace) -> HazardSet:
        """The slots of ``ns`` its clients lease without a call (see csrc/index.c), read
        from the pages now, after a full fence."""
        hazards = collect_hazards(ns.pages.values(), ns.hazards)
        ns.hazards = hazards
        return hazards

    def pinned(self, ns: Namespace) -> Pinned:
        """What is pinned in ``ns`` now, by calls and without (``Pinned``)."""
        return Pinned(ns, self.hazards(ns))

    def held_seconds(self, started: float) -> float:
        """Seconds since ``started`` (a lease's or reservation's), on the store's clock."""
        return self.clock() - started

    def access(self, n: int) -> int:
        """Take ``n`` access sequence numbers; the first."""
        first = self.next_access
        self.next_access += n
        return first

    def note_reads(self, ns: Namespace) -> None:
        """Mark the blocks ``ns``'s clients read without a call as read (their CLOCK bit
        and persisted last access), from the pages' rings: hints, checked natively."""
        if not ns.pages:
            return
        seen = {v for page in ns.pages.values() for v in page.accessed()}
        if not seen:
            return
        if len(seen) > MAX_READ_HINTS:  # hints: a page full of them costs a bounded sweep
            seen = set(itertools.islice(seen, MAX_READ_HINTS))
        hints = np.fromiter(seen, dtype=np.uint64, count=len(seen))
        _touched, prefetched = ns.table.touch(hints, self.access(len(hints)), hints=True)
        self.prefetched_reads += prefetched

    def pin(self, ns: Namespace, refs: npt.NDArray[np.uint64]) -> None:
        ns.table.pin(refs)

    def end_leases(self, leases: Sequence[Lease]) -> None:
        """Unpin every block of ``leases`` (a doomed block whose last pin this was is
        freed by the table) and forget them."""
        for lease in leases:
            lease.ns.table.unpin(lease.refs)
            del lease.session.leases[lease.id]
            del self.leases[lease.id]

    @staticmethod
    def slot_of(block: Block) -> int:
        """``block``'s slot as a client's page names it."""
        return hazard_of(block.extent.segment.segment_id, block.slot)

    # ------------------------------------------------ the one commit transition
    def commit_slots(self, ns: Namespace, commits: Commits,
                     release: npt.NDArray[np.uint64] = _NO_REFS, *,
                     handles: bool | None = None) -> list[Block]:
        """The one commit transition (RESERVED -> COMMITTED), for a Commit call and a
        page's commit records alike: the slot entries (``BlockTable.commit``, with the
        ``release`` slots freed in the same call: all or nothing, ValueError changes
        nothing), then the key index -- the moment a reader can find them.  Returns
        the blocks made (handles; with ``handles`` False or, when None,
        ``commit_handles`` off, none)."""
        if not len(commits):
            if len(release):
                ns.table.release_claims(release)
            return []
        # The keys go in the shared index in the same native call, from the slot entries
        # it just wrote, when the table has room for them (else they go in after, and
        # the table grows for them).
        index = ns.index.table.room_for(len(commits))
        published = ns.table.commit(commits.refs, commits.keys, commits.lengths,
                                    commits.checksums, first_access=self.access(len(commits)),
                                    epoch=self.boot_epoch,
                                    release=release if len(release) else None, index=index)
        if published is None:
            ns.index.add_committed(commits.refs, commits.keys)
        else:
            ns.index.committed_published(commits.refs, commits.keys, *published)
        if not (self.commit_handles if handles is None else handles):
            return []
        sums = commits.checksums
        sums = [None] * len(commits) if sums is None else (
            sums.tolist() if isinstance(sums, np.ndarray) else list(sums))
        by_id = ns.by_id
        return [Block(ns, key, by_id[_slot_ref.segment_of(r)], _slot_ref.slot_of(r), length, c, gen)
                for r, gen, key, length, c in zip(
                    commits.refs.tolist(), commits.gens.tolist(), commits.keys,
                    commits.lengths.tolist(), sums, strict=True)]

    def commit_ring(self, ns: Namespace, page: SessionPage, held: npt.NDArray[np.uint64],
                    exists: Callable[[list[bytes]], Sequence[bool]] | None,
                    answer_min: int = -1) -> RingCommit | None:
        """``commit_slots`` of a writer's whole commit ring in one native call
        (``BlockTable.commit_ring``: the records read from ``page`` and checked against
        ``held``, the session's grant words, which it ends; the slot entries; the
        shared index), when the ring is the plain case: every record names a grant
        held, no grant or key twice, every key new (to the index and, asked, to
        ``exists``, the tiers below).  None, with nothing changed, for any other ring,
        and whenever the store wants more than the native call gives: block handles,
        a namespace with reservations in flight (their keys are not in the index), keys
        kept outside the shared table, a table that must grow first.  With
        ``answer_min`` >= 0 the writer is answered in the same call when its grants left
        number that many (the page's tail then moves past the ring)."""
        index = ns.index.table
        if self.commit_handles or ns.in_flight or index.unpublished:
            return None
        room = index.room_for(_page.RING_RECORDS)
        if room is None:
            return None
        got = ns.table.commit_ring(page.mapping, page.commits_tail, ns.block_bytes, held, room,
                                   first_access=self.next_access, epoch=self.boot_epoch,
                                   exists=exists, want_keys=ns.index.watch is not None,
                                   answer_min=answer_min)
        if got is None:
            return None
        if got.answered:
            page.finished_commits(got.n)
        self.access(got.n)
        ns.index.committed_published(got.refs, got.keys or (), got.done, got.left)
        return got
