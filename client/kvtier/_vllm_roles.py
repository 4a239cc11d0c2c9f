"""The vLLM connector's ``kv_role`` and what a producer tells its consumer (P/D).

vLLM's connectors read ``kv_transfer_config.kv_role`` the same way: ``kv_producer``
computes prompts and hands their KV on, ``kv_consumer`` takes KV and computes the rest,
``kv_both`` does both.  For kvtier:

* ``kv_both``: as configured (``save``, ``load_mode``, ``async_save``).
* ``kv_producer`` (a P/D prefill server): saves, and loads the prefixes kvtier already
  has (a producer is also a cache).  Its saves run inside the step (``async_save`` is
  ignored): a prefill server's answer is the one token of a ``max_tokens=1`` request, and
  the decode server may ask for the blocks the moment that answer arrives, so the blocks
  are committed before the step's output -- hence the HTTP answer -- leaves the engine.
  Its ``request_finished`` returns ``{"kvtier": {"blocks": N}}`` as
  ``kv_transfer_params``: the leading prompt blocks kvtier holds for the request.
* ``kv_consumer`` (a P/D decode server): loads and never saves.  It finds a prompt's
  blocks by the prompt's keys alone; if its request carries a producer's
  ``kv_transfer_params`` and its kvtierd shows fewer of those blocks than announced
  (a cluster-tier copy still on its way), it holds the request back (vLLM retries it
  next step) for up to ``producer_wait`` seconds, then loads what there is and
  recomputes the rest.

The last, partial block of a prompt (and the block holding its last token) is never
claimed: the consumer recomputes it, as vLLM's own prefix cache does (see
docs/decisions.md for the measurement).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Final

ROLES: Final = ("kv_producer", "kv_consumer", "kv_both")
#: The key of ``kv_transfer_params`` kvtier reads and writes; other connectors' keys
#: (NIXL's ``do_remote_prefill``...) are left alone.
PARAMS_KEY: Final = "kvtier"


@dataclasses.dataclass(frozen=True, slots=True)
class Role:
    """What the connector does in this engine, from ``kv_role`` and its config."""

    role: str
    save: bool
    load: bool
    async_save: bool

    @property
    def producer(self) -> bool:
        return self.role == "kv_producer"

    @property
    def consumer(self) -> bool:
        return self.role == "kv_consumer"

    @classmethod
    def of(cls, kv_role: str | None, *, save: bool, load: bool, async_save: bool) -> Role:
        """The role's policy; ValueError for an unknown role or a consumer that cannot load."""
        role = kv_role or "kv_both"
        if role not in ROLES:
            raise ValueError(f"kvtier.vllm: kv_role must be one of {', '.join(ROLES)}, "
                             f"got {kv_role!r}")
        if role == "kv_consumer":
            if not load:
                raise ValueError('kvtier.vllm: a kv_consumer loads: load_mode "off" leaves it '
                                 "nothing to do")
            return cls(role, save=False, load=True, async_save=False)
        if role == "kv_producer":
            return cls(role, save=True, load=load, async_save=False)
        return cls(role, save=save, load=load, async_save=async_save)


def producer_params(blocks: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` a producer's answer carries."""
    return {PARAMS_KEY: {"blocks": int(blocks)}}


def announced_blocks(params: Mapping[str, Any] | None) -> int:
    """Blocks a producer announced in a request's ``kv_transfer_params`` (0: none, or
    anything that is not a producer's announcement: a client controls this field)."""
    if not isinstance(params, Mapping):
        return 0
    ours = params.get(PARAMS_KEY)
    if not isinstance(ours, Mapping):
        return 0
    n = ours.get("blocks")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return 0
    return n


class Waits:
    """Requests a consumer holds back for announced blocks not yet in its kvtierd.

    A held request is asked about again every step; its lookup is repeated at most every
    :data:`RECHECK` seconds (an idle engine steps in a tight loop), and never sooner after
    the end of the last one than that lookup took: a lookup of blocks still on their way
    asks the cluster (a round trip to its master, 10-25 ms on a loaded host), and lookups
    back to back would take the CPU the producer's publish needs (see bench/results/HISTORY.md, the P/D section).
    """

    #: Seconds between two lookups of a held request, at least.
    RECHECK: Final = 0.005

    def __init__(self, limit: float) -> None:
        self.limit = limit
        #: request id -> (deadline, when its next lookup is due); deadline None: gave up.
        self._held: dict[str, tuple[float | None, float]] = {}
        #: request id -> when it was first held (until :meth:`waited` reports it).
        self._since: dict[str, float] = {}

    def recheck(self, req_id: str) -> bool:
        """False while a held request's last lookup is too recent to repeat."""
        return self.due_in(req_id) <= 0

    def due_in(self, req_id: str) -> float:
        """Seconds until a held request's next lookup is due (<= 0: now)."""
        entry = self._held.get(req_id)
        return 0.0 if entry is None else entry[1] - time.monotonic()

    def hold(self, req_id: str, found: int, wanted: int, looked: float = 0.0) -> bool:
        """True: ask again next step (``found`` < ``wanted``, within the time limit);
        ``looked``: the seconds the lookup that found ``found`` took.

        Once a request has waited ``limit`` seconds it is never held again.
        """
        now = time.monotonic()
        entry = self._held.get(req_id)
        if found >= wanted or self.limit <= 0 or (entry is not None and entry[0] is None):
            return False
        deadline = entry[0] if entry is not None else now + self.limit
        if deadline is not None and now < deadline:
            self._held[req_id] = (deadline, now + max(self.RECHECK, looked))
            self._since.setdefault(req_id, now)
            return True
        self._held[req_id] = (None, now)
        return False

    def waited(self, req_id: str) -> float:
        """Seconds from a request's first hold to now (0: never held), reported once:
        call it when :meth:`hold` lets the request go."""
        since = self._since.pop(req_id, None)
        return 0.0 if since is None else time.monotonic() - since

    def forget(self, req_id: str) -> None:
        self._held.pop(req_id, None)
        self._since.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._held)


__all__ = ["PARAMS_KEY", "ROLES", "Role", "Waits", "announced_blocks", "producer_params"]
