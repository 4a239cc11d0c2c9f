"""The cluster tier, daemon side: a ``spill.tier.LowerTier`` over the agent process.

:class:`ClusterTier` turns tier calls (present, read, write, delete) into
requests to the agent (:mod:`.link`, which starts, supervises and talks to
it) naming DRAM slots as (segment id, offset) (:mod:`.slots`).

While no agent is ready, every call fails at once with ``ClusterDown``
(``OSError`` ENOTCONN): the tiering policy counts it and goes on with the
local tiers; so do calls while the master does not answer (``link``'s
breaker).  Mooncake's answers become misses (-704: not there), ``SpillFull``
(-200: no room), or ``OSError`` with a kind for the metrics (-900: master
unreachable, -800: the transfer failed, e.g. the owning host is gone).

Every read checks the object's tagged header and the data's xxh3 (``format``)
before the block counts as read; an object that fails is removed from the
cluster (for every host: it is bad for all of them) and counted as
``checksum``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import numpy as np

from kvtier import _accel
from kvtier._wire import TIER_NAMES
from kvtier.errors import Corrupted
from kvtierd.cluster import agent as agent_mod
from kvtierd.cluster.format import HEADER_BYTES, BadObject, Naming
from kvtierd.cluster.link import (
    RC_RPC,
    AgentLink,
    ClusterCounters,
    ClusterDown,
    ClusterSettings,
)
from kvtierd.cluster.slots import SlotMapper
from kvtierd.logs import Throttle, event, more
from kvtierd.segments import Segment
from kvtierd.spill.ssd import SpillFull
from kvtierd.spill.tier import TIER_CLUSTER, Geometry, HandOff, RemoteTier

log = logging.getLogger(__name__)
_throttle = Throttle()

#: Mooncake's return codes (mooncake-store's ErrorCode); -900 is ``link.RC_RPC``.
RC_NO_SPACE: Final = -200
RC_NOT_FOUND: Final = -704
RC_TRANSFER: Final = -800
#: Objects per message to the agent (bounded messages; each still one Mooncake batch).
BATCH: Final = 256
#: Objects per put message (~0.5 KiB each: name, header, three int64s; one Mooncake
#: batch each): a commit of up to this many blocks is published in one batch.
PUT_BATCH: Final = 1024

__all__ = ["ClusterDown", "ClusterSettings", "ClusterTier"]


def _rc_error(rc: int, what: str) -> OSError:
    """The OSError for a Mooncake error code (its errno picks the metrics' kind)."""
    if rc == RC_RPC:
        return OSError(errno.EHOSTDOWN, f"{what}: the Mooncake master is unreachable (-900)")
    if rc == RC_TRANSFER:
        return OSError(errno.ECOMM, f"{what}: the transfer failed (-800; the host holding "
                                    "the object gone or unreachable)")
    if rc == agent_mod.RC_BAD_REQUEST:
        return OSError(errno.EINVAL, f"{what}: refused by the agent (offset outside its "
                                     "mapping of the segment)")
    return OSError(errno.EIO, f"{what}: Mooncake error {rc}")


class ClusterTier(RemoteTier):
    """:class:`~kvtierd.spill.tier.LowerTier` over Mooncake Store (through the agent)."""

    tier = TIER_CLUSTER
    name = TIER_NAMES[TIER_CLUSTER]
    local = False
    cross_host = True
    durable_writes = False  # cache-only: the cluster may drop any object (eviction, hosts)
    batched = True

    def __init__(self, settings: ClusterSettings, naming: Naming, *,
                 segments: Callable[[], Iterable[Segment]]) -> None:
        """``segments``: the daemon's live DRAM segments (called on worker threads)."""
        self.settings = settings
        self.naming = naming
        self.counters = ClusterCounters()
        self._link = AgentLink(settings, self.counters, on_joined=self._on_joined)
        self._slots = SlotMapper(self._link, segments)

    def _on_joined(self) -> None:
        self._slots.premap_all()

    # ------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """Start the agent's supervisor; returns at once (joining may take seconds or fail)."""
        self._link.open()

    def close(self) -> None:
        self._link.stop()
        self._slots.close()
        self._link.join()

    @property
    def down_reason(self) -> str | None:
        """Why the agent is not ready (None while it is): doctor, stats, logs."""
        return self._link.down_reason

    @property
    def segment_name(self) -> str:
        """This host's segment in the cluster (Mooncake's ``host:port``), "" when down."""
        a = self._link.agent
        return a.segment_name if a is not None else ""

    @property
    def ready(self) -> bool:
        return self._link.agent is not None

    @property
    def prefault(self) -> str:
        """What the agent said of pre-faulting its segment ("" : nothing yet, or off)."""
        a = self._link.agent
        return a.prefault if a is not None else ""

    def connect(self, *, on_fault: Callable[[str], None], hand_off: HandOff | None,
                on_lost: Callable[[str, bytes], None] | None) -> None:
        self._link.report_faults_to(on_fault)

    def premap(self, seg: Segment) -> None:
        """Have the agent map a new DRAM extent ahead of its first publish
        (``SlotMapper.premap``); the store calls this from the event loop."""
        self._slots.premap(seg)

    # ------------------------------------------------------------ LowerTier
    def present(self, namespace: str, keys: Sequence[bytes],
                geometry: Geometry | None) -> list[bool]:
        """One ``batch_is_exist`` per :data:`BATCH` keys (one master round trip)."""
        if geometry is None or not keys:
            return [False] * len(keys)
        names = [self.naming.name(namespace, k, *geometry) for k in keys]
        out: list[bool] = []
        for i in range(0, len(names), BATCH):
            rcs = self._link.call("exist", names[i : i + BATCH])
            if any(rc < 0 for rc in rcs):
                raise _rc_error(min(rcs), "existence check")
            out.extend(rc == 1 for rc in rcs)
        return out

    async def present_async(self, namespace: str, keys: Sequence[bytes],
                            geometry: Geometry | None) -> list[bool]:
        """``present`` on the event loop: the same one query per :data:`BATCH` keys,
        its answer read by the loop itself."""
        if geometry is None or not keys:
            return [False] * len(keys)
        names = [self.naming.name(namespace, k, *geometry) for k in keys]
        out: list[bool] = []
        for i in range(0, len(names), BATCH):
            rcs = await self._link.call_async("exist", names[i : i + BATCH])
            if any(rc < 0 for rc in rcs):
                raise _rc_error(min(rcs), "existence check")
            out.extend(rc == 1 for rc in rcs)
        return out

    def read_into(self, namespace: str, key: bytes, dst: memoryview,
                  geometry: Geometry) -> tuple[int, int]:
        (res,) = self.read_many(namespace, [(key, dst)], geometry)
        if isinstance(res, BaseException):
            raise res
        return res

    def read_many(self, namespace: str, items: Sequence[tuple[bytes, memoryview]],
                  geometry: Geometry) -> list[tuple[int, int] | BaseException]:
        """Read each block into its slot, verified: (length, checksum), or the exception
        ``read_into`` would raise for it.  Raises ``OSError`` when none could be tried."""
        a = self._link.ready_agent()
        self._slots.drop_retired(a)
        bb = geometry.block_bytes
        out: list[tuple[int, int] | BaseException] = []
        for i in range(0, len(items), BATCH):
            chunk = items[i : i + BATCH]
            req: list[list[Any]] = []
            names: list[str] = []
            early: dict[int, BaseException] = {}
            for j, (key, dst) in enumerate(chunk):
                try:
                    if len(dst) < bb:
                        raise OSError(errno.EINVAL, f"slot of {len(dst)} bytes < block_bytes")
                    sid, off = self._slots.locate(a, dst)
                except OSError as exc:
                    early[j] = exc
                    continue
                name = self.naming.name(namespace, key, *geometry)
                names.append(name)
                req.append([name, sid, off, bb])
            answers = iter(self._link.call("get", req, agent=a) if req else [])
            for j, (key, dst) in enumerate(chunk):
                if j in early:
                    out.append(early[j])
                    continue
                rc, raw = next(answers)
                out.append(self._verify(namespace, key, dst, geometry, rc, raw))
        return out

    def _verify(self, namespace: str, key: bytes, dst: memoryview, geometry: Geometry,
                rc: int, raw: bytes | None) -> tuple[int, int] | BaseException:
        if rc == RC_NOT_FOUND:
            return KeyError(key)
        if rc < 0:
            return _rc_error(rc, f"read of {key.hex()}")
        try:
            if rc != geometry.block_bytes + HEADER_BYTES or raw is None:
                raise BadObject(f"object of {rc} bytes, not {geometry.block_bytes} + "
                                f"{HEADER_BYTES}")
            head = self.naming.unpack(namespace, raw, key, *geometry)
            try:
                got = _accel.checksum(dst[: head.length])
            except OSError as exc:
                return exc  # EFAULT: the slot, not the copy
            if got != head.checksum:
                raise BadObject("data failed its checksum")
        except BadObject as exc:
            self.counters.checksum_failures += 1
            held = _throttle("cluster/read/checksum")
            if held is not None:
                log.warning("cluster tier: block %s of %r: %s; removing it from the cluster%s",
                            key.hex(), namespace, exc, more(held),
                            extra=event("spill_fault", tier="cluster", op="read",
                                        kind="checksum", namespace=namespace,
                                        held_back=held))
            with contextlib.suppress(OSError):
                self._link.call("remove", [self.naming.name(namespace, key, *geometry)])
            return Corrupted(f"cluster block {key.hex()} of {namespace!r}: {exc}")
        self.counters.reads += 1
        self.counters.read_bytes += head.length
        return head.length, head.checksum

    def write(self, namespace: str, key: bytes, src: memoryview, length: int,
              checksum: int | None, geometry: Geometry) -> bool:
        (res,) = self.write_many(namespace, [key], [src], [length], [checksum], geometry)
        if isinstance(res, BaseException):
            raise res
        return res

    def write_many(self, namespace: str, keys: Sequence[bytes], srcs: Sequence[memoryview],
                   lengths: Sequence[int], checksums: Sequence[int | None],
                   geometry: Geometry) -> list[bool | BaseException]:
        """``write`` of each block (columns: key, src, length, checksum) as one Mooncake batch per
        :data:`PUT_BATCH` objects: one message to the agent, one
        ``batch_put_from_multi_buffers`` (the master allocates and seals the whole
        batch in one round trip each).  Each result is True or the exception ``write``
        would have raised for that block: EFAULT (its slot), ``SpillFull``, or the
        ``OSError`` of a failed put -- a batch that failed as a whole (the agent gone,
        the master unreachable) gives each of its blocks that error, as writing them
        one by one would have.  Raises ``ClusterDown`` when no agent is ready."""
        a = self._link.ready_agent()
        self._slots.drop_retired(a)
        bb, mh = geometry.block_bytes, geometry.model_hash
        out: list[bool | BaseException] = [True] * len(keys)
        checked: set[int] = set()
        todo: list[int] = []  # the items that reach the agent
        sids: list[int] = []
        offs: list[int] = []
        sums: list[int] = []
        for i, (src, length, checksum) in enumerate(zip(srcs, lengths, checksums, strict=True)):
            try:
                if checksum is None:
                    checksum = _accel.checksum(src[:length])  # EFAULT: the slot's loss
                sid, off = self._slots.locate(a, src, checked)
            except OSError as exc:
                out[i] = exc
                continue
            todo.append(i)
            sids.append(sid)
            offs.append(off)
            sums.append(checksum)
        prefix = self.naming.prefix(namespace, bb, mh)
        written = time.time_ns()
        for c in range(0, len(todo), PUT_BATCH):
            idx = todo[c : c + PUT_BATCH]
            names = [keys[i] for i in idx]
            sizes = np.array([lengths[i] for i in idx], dtype=np.int64)
            headers = self.naming.pack_many(namespace, names, sizes.tolist(),
                                            sums[c : c + PUT_BATCH], bb, mh, written)
            try:
                rcs = self._link.call("put", [prefix + k.hex() for k in names],
                                 np.array(sids[c : c + PUT_BATCH], dtype=np.int64).tobytes(),
                                 np.array(offs[c : c + PUT_BATCH], dtype=np.int64).tobytes(),
                                 sizes.tobytes(), bb, headers, self.settings.config.replicas,
                                 agent=a)
            except OSError as exc:  # the whole batch: each block's error, as one by one
                for i in idx:
                    out[i] = exc
                continue
            for i, key, rc in zip(idx, names, rcs, strict=True):
                if rc == RC_NO_SPACE:
                    out[i] = SpillFull(f"the cluster has no room for {key.hex()} (-200)")
                elif rc < 0:
                    out[i] = _rc_error(rc, f"write of {key.hex()}")
                else:
                    self.counters.writes += 1
                    self.counters.write_bytes += lengths[i]
        return out

    def sync(self) -> None:
        pass  # a put is complete when it returns

    def delete(self, namespace: str, keys: Sequence[bytes],
               geometry: Geometry | None = None) -> set[bytes]:
        if geometry is None or not keys:
            return set()
        found: set[bytes] = set()
        for i in range(0, len(keys), BATCH):
            chunk = list(keys[i : i + BATCH])
            rcs = self._link.call("remove", [self.naming.name(namespace, k, *geometry)
                                        for k in chunk])
            bad = [rc for rc in rcs if rc < 0 and rc != RC_NOT_FOUND]
            if bad:
                raise _rc_error(bad[0], "remove")
            found.update(k for k, rc in zip(chunk, rcs, strict=True) if rc == 0)
        self.counters.removed += len(found)
        return found

    def check(self) -> list[str]:
        return []



