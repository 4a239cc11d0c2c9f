"""DRAM slots named to the cluster agent as (segment id, offset).

The agent maps each segment's data file once (its descriptor passed over the
socket) and registers it with the transfer engine, so bytes move between the
cluster and the slot with no copy in either process.  Before a transfer the
segment's data file is checked for its size (``fstat``): a client that cut it
short would make the agent fault (SIGBUS); its slot is the writer's loss
(``EFAULT``), as on the other tiers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

import numpy as np

from kvtierd.cluster.link import AgentLink, AgentProcess, ClusterDown
from kvtierd.segments import Segment

#: How often the segments the agent maps are compared with the live ones.
DROP_CHECK_SECONDS: Final = 1.0


class SlotMapper:
    """Which segments the agent maps: mapped ahead, on first use, dropped when retired."""

    def __init__(self, link: AgentLink, segments: Callable[[], Iterable[Segment]]) -> None:
        """``segments``: the daemon's live DRAM segments (called on worker threads)."""
        self._link = link
        self._segments = segments
        self._by_map: dict[int, Segment] = {}
        #: Maps new DRAM extents into the agent ahead of their first publish.
        self._mapper = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvtier-cluster-map")

    def premap_all(self) -> None:
        """``premap`` every live extent (those made before the agent joined)."""
        for seg in self._segments():
            self.premap(seg)

    def close(self) -> None:
        self._mapper.shutdown(wait=False, cancel_futures=True)

    def locate(self, a: AgentProcess, view: memoryview,
               checked: set[int] | None = None) -> tuple[int, int]:
        """(segment id, offset) of a DRAM slot view, its segment mapped by the agent;
        ``checked``: the segments whose size this batch has checked already."""
        mm = view.obj
        seg = self._by_map.get(id(mm))
        if seg is None or seg.mm is not mm:
            self._by_map = {id(s.mm): s for s in self._segments()}
            seg = self._by_map.get(id(mm))
            if seg is None:
                raise OSError(errno.EINVAL, "cluster tier: a buffer outside the DRAM segments")
        size = seg.layout.data_bytes
        if checked is None or seg.segment_id not in checked:
            if os.fstat(seg.fd).st_size < size:  # a client cut it short: the agent would fault
                raise OSError(errno.EFAULT,
                              f"segment {os.path.basename(seg.path)} was cut short")
            if checked is not None:
                checked.add(seg.segment_id)
        offset = _address(view) - _address(mm)
        if seg.segment_id not in a.mapped:
            with a.map_lock:
                if seg.segment_id not in a.mapped:
                    self._link.call("seg", seg.segment_id, size, fds=[seg.fd], agent=a)
                    a.mapped.add(seg.segment_id)
        return seg.segment_id, offset

    def premap(self, seg: Segment) -> None:
        """Have the agent map a DRAM extent now, on a thread of its own, rather than at
        the extent's first publish (which then waits for the mapping: 1-10 ms); the
        store calls this for every extent it makes (``Store.attach_cluster``), from the
        event loop. Whatever goes wrong is left to that first publish."""
        a = self._link.agent
        if a is None or self._link.stopping:
            return
        with contextlib.suppress(RuntimeError):  # shut down: the daemon is stopping
            self._mapper.submit(self._premap, a, seg)

    def _premap(self, a: AgentProcess, seg: Segment) -> None:
        if seg.segment_id in a.mapped or not a.ready:
            return
        if seg.segment_id not in {s.segment_id for s in self._segments()}:
            return  # retired meanwhile: its descriptor may be gone
        size = seg.layout.data_bytes
        try:
            if os.fstat(seg.fd).st_size < size:
                return  # cut short: the publish path says so
            with a.map_lock:
                if seg.segment_id not in a.mapped:
                    self._link.call("seg", seg.segment_id, size, fds=[seg.fd], agent=a)
                    a.mapped.add(seg.segment_id)
        except (OSError, ClusterDown):
            pass

    def drop_retired(self, a: AgentProcess) -> None:
        """Let the agent unmap segments the daemon retired (their memory is freed only
        when no process maps them)."""
        now = time.monotonic()
        if now - a.last_drop_check < DROP_CHECK_SECONDS or not a.mapped:
            return
        a.last_drop_check = now
        live = {s.segment_id for s in self._segments()}
        with a.map_lock:
            for sid in a.mapped - live:
                self._link.call("drop", sid, agent=a)
                a.mapped.discard(sid)


def _address(buf: Any) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)

