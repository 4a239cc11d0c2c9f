"""Warm start: re-attach the segments a previous daemon left in the shm directory.

Every ``*.seg`` file is attached and validated (``Segment.attach``); a file
that fails validation is removed ("reformatted") with the reason logged,
never half-used.  Valid extents are adopted by the store most recently used
first, so when ``dram.capacity`` shrank the coldest extents are the ones
dropped.  Data pages are not touched here (the daemon never reads payload);
they are locked in the background after the daemon is ready.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import time

from kvtier.errors import CapacityExhausted, FailedPrecondition
from kvtierd.segments import Segment, SegmentInvalid, SlotState
from kvtierd.store import Store

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RecoveryReport:
    """What a start found: per-namespace recovered blocks, what was dropped and why."""

    seconds: float = 0.0
    segments: int = 0
    blocks: dict[str, int] = dataclasses.field(default_factory=dict)
    dropped: list[str] = dataclasses.field(default_factory=list)

    @property
    def warm(self) -> bool:
        return bool(self.blocks)


def _recency(seg: Segment) -> int:
    table = seg.scan(copy=False)
    committed = table["last_access"][table["state"] == SlotState.COMMITTED]
    recency = int(committed.max()) if committed.size else 0
    del table, committed  # release the view of the mapping
    return recency


def recover(store: Store, shm_dir: str) -> RecoveryReport:
    """Attach and adopt every valid segment in ``shm_dir``; blocking I/O (run before serving)."""
    t0 = time.monotonic()
    report = RecoveryReport()
    attached: list[tuple[int, Segment]] = []
    for path in sorted(glob.glob(os.path.join(shm_dir, "*.seg"))):
        try:
            seg = Segment.attach(path, segment_id=store.new_segment_id())
        except (SegmentInvalid, OSError) as exc:
            _drop(report, path, f"reformatted: {exc}")
            continue
        attached.append((_recency(seg), seg))
    attached.sort(key=lambda item: -item[0])
    for _, seg in attached:
        try:
            n = store.adopt_extent(seg)
        except (CapacityExhausted, FailedPrecondition) as exc:
            seg.close(unlink=True)
            _drop(report, seg.path, f"dropped: {exc}")
            continue
        report.segments += 1
        report.blocks[seg.namespace] = report.blocks.get(seg.namespace, 0) + n
    store.finish_recovery()
    report.seconds = time.monotonic() - t0
    for name, ns in store.namespaces.items():
        log.info("namespace %r: warm, %d blocks recovered in %d extents (block_bytes=%d, "
                 "model_uid=%r)", name, ns.recovered, len(ns.extents), ns.block_bytes,
                 ns.model_uid)
    log.info("recovery: %s start, %d blocks in %d segments in %.3f s%s",
             "warm" if report.warm else "cold", sum(report.blocks.values()), report.segments,
             report.seconds, f"; {len(report.dropped)} segment files dropped" if report.dropped
             else "")
    return report


def _drop(report: RecoveryReport, path: str, why: str) -> None:
    log.warning("segment %s %s", os.path.basename(path), why)
    report.dropped.append(f"{os.path.basename(path)}: {why}")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


