"""The session pages the channel hands out, and what the daemon reads from them.

With the fast path on, ``SessionOpened`` carries the namespace's shared index
(read-only; ``kvtierd.shared_index``), which the client searches for a
``Lookup`` without calling, and a page of the session's own (read-write,
``SessionPage``): lookup counters where the client adds what it looked up,
its hazards and, for a writer, grants and a commit ring.  The daemon adds
the counters to the namespace's client-reported figures before each scrape
and each Stats and when the session ends, never to its own (host-wide)
figures, and trusts them for nothing else (``kvtierd.counters``).  A client
whose table says ``SUPERSEDED`` asks for the new one with
``MapSegments(want_index=True)``.

``SessionPages`` keeps the open sessions' pages: it makes a page with the
session's share of the hazard limits, folds the counters, and lets a page go
when its session ends.  The commit ring is read elsewhere (``doorbell`` hands
it to the store).
"""

from __future__ import annotations

from kvtierd.config import LimitsConfig
from kvtierd.shared_index import HAZARDS_N, SessionPage
from kvtierd.store import Namespace, Session, Store


class SessionPages:
    """Session id -> its page, for the sessions that were sent a shared index."""

    def __init__(self, store: Store, limits: LimitsConfig, max_keys: int) -> None:
        self.store = store
        self.limits = limits
        self.max_keys = max_keys
        self._pages: dict[int, SessionPage] = {}

    def new(self, session: Session, *, writes: bool) -> SessionPage:
        """A page for ``session`` (not yet kept: ``attach`` keeps it once sent);
        ``writes``: with a write area.  Raises ``OSError`` out of memory or fds."""
        return SessionPage(session.ns.name, self.limits.max_leases_per_session, writes=writes,
                           max_hazards=self._hazard_share(session),
                           max_reservations=self.limits.max_reservations_per_session)

    def attach(self, session: Session, page: SessionPage) -> None:
        """Keep ``page`` for ``session`` once its fd went to the client."""
        page.close_fd()  # the mapping stays: the client's counts and hazards are read there
        self.store.attach_page(session, page)
        self._pages[session.id] = page

    def has(self, session_id: int) -> bool:
        return session_id in self._pages

    def detach(self, session_id: int) -> SessionPage | None:
        """Forget the session's page (it is ending); the caller folds and closes it."""
        return self._pages.pop(session_id, None)

    def fold_last(self, session: Session, page: SessionPage) -> None:
        """Fold a detached page's counts for the last time (its session is ending)."""
        self.store.note_reads(session.ns)
        self._fold(self.store.namespaces.get(page.namespace), [page])

    def fold(self) -> None:
        """Add what the sessions' clients counted in their pages since the last fold
        to their namespaces' client-reported figures (on the loop; before each scrape
        and each Stats).  Never to the daemon's own: those count what it did."""
        by_ns: dict[str, list[SessionPage]] = {}
        for page in self._pages.values():
            by_ns.setdefault(page.namespace, []).append(page)
        for name, pages in by_ns.items():
            ns = self.store.namespaces.get(name)
            if ns is not None:
                self.store.note_reads(ns)  # CLOCK bits and prefetch hits of reads without a call
            self._fold(ns, pages)

    def _fold(self, ns: Namespace | None, pages: list[SessionPage]) -> None:
        """The pages' counts since their last take, each cut to what its client could
        have done (``SessionPage.take``), summed, to the namespace's client-reported
        figures (``Store.add_reported``: cut to what the host could have done)."""
        block_bytes = 0 if ns is None else ns.block_bytes
        total = [0] * 7
        cut = False
        for page in pages:
            for i, step in enumerate(page.take(max_keys=self.max_keys, block_bytes=block_bytes)):
                total[i] += step
            cut = cut or page.cut
        if ns is not None and (any(total) or cut):
            self.store.add_reported(ns, tuple(total), cut=cut)

    def _hazard_share(self, session: Session) -> int:
        """Hazard entries a new session's page may use: what is left of its uid's
        ``limits.max_hazards_per_uid`` and its namespace's ``max_hazards_per_namespace``
        after the shares of the sessions open now (at most ``HAZARDS_N``).  A share
        never changes while its session lives (a client relies on its hazards), so
        the bound holds whatever order sessions come and go in."""
        uid, name = session.peer.uid, session.ns.name
        by_uid = by_ns = 0
        for other in self.store.sessions.values():
            page = self._pages.get(other.id)
            if page is None:
                continue
            if other.peer.uid == uid:
                by_uid += page.max_hazards
            if other.ns.name == name:
                by_ns += page.max_hazards
        return max(0, min(HAZARDS_N, self.limits.max_hazards_per_uid - by_uid,
                          self.limits.max_hazards_per_namespace - by_ns))
