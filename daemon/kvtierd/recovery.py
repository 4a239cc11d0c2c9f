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
from kvtierd.logs import event
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


def _usage(seg: Segment) -> tuple[int, int]:
    """(committed blocks, most recent access) of a segment, read from its slot table."""
    table = seg.scan(copy=False)
    committed = table["last_access"][table["state"] == SlotState.COMMITTED]
    usage = (int(committed.size), int(committed.max()) if committed.size else 0)
    del table, committed  # release the view of the mapping
    return usage


def recover(store: Store, shm_dir: str) -> RecoveryReport:
    """Attach and adopt every valid segment in ``shm_dir``; blocking I/O (run before serving)."""
    t0 = time.monotonic()
    report = RecoveryReport()
    attached: list[tuple[tuple[int, int], Segment]] = []
    for path in sorted(glob.glob(os.path.join(shm_dir, "*.seg"))):
        try:
            seg = Segment.attach(path, segment_id=store.new_segment_id())
        except (SegmentInvalid, OSError) as exc:
            _drop(report, path, f"reformatted: {exc}")
            continue
        attached.append((_usage(seg), seg))
    attached = _one_layout_per_namespace(attached, report)
    attached.sort(key=lambda item: -item[0][1])  # most recently used first
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
                 ns.model_uid, extra=event("namespace_recovered", namespace=name,
                                           blocks=ns.recovered, extents=len(ns.extents)))
    log.info("recovery: %s start, %d blocks in %d segments in %.3f s%s",
             "warm" if report.warm else "cold", sum(report.blocks.values()), report.segments,
             report.seconds, f"; {len(report.dropped)} segment files dropped" if report.dropped
             else "",
             extra=event("start", warm=report.warm, blocks=sum(report.blocks.values()),
                         segments=report.segments, seconds=round(report.seconds, 6),
                         dropped_segments=len(report.dropped)))
    return report


def _one_layout_per_namespace(
    attached: list[tuple[tuple[int, int], Segment]], report: RecoveryReport
) -> list[tuple[tuple[int, int], Segment]]:
    """Extents of one namespace that disagree on (block_bytes, model_uid) are never mixed:
    the layout holding the most blocks stays (ties: the most recently used), the
    others are dropped.  A client declaring another layout later reformats it."""
    groups: dict[str, dict[tuple[int, str], list[tuple[tuple[int, int], Segment]]]] = {}
    for item in attached:
        seg = item[1]
        layout = (seg.layout.block_bytes, seg.model_uid)
        groups.setdefault(seg.namespace, {}).setdefault(layout, []).append(item)
    kept: list[tuple[tuple[int, int], Segment]] = []
    for name, by_layout in groups.items():
        ranked = sorted(by_layout.items(), key=lambda kv: (
            -sum(u[0] for u, _ in kv[1]), -max(u[1] for u, _ in kv[1])))
        (win_bb, win_uid), winners = ranked[0]
        kept.extend(winners)
        for (bb, uid), losers in ranked[1:]:
            for _, seg in losers:
                seg.close(unlink=True)
                _drop(report, seg.path,
                      f"dropped: namespace {name!r} extent {seg.index} has block_bytes={bb} "
                      f"model_uid={uid!r}, its other extents (holding more blocks) have "
                      f"block_bytes={win_bb} model_uid={win_uid!r}")
    return kept


def _drop(report: RecoveryReport, path: str, why: str) -> None:
    log.warning("segment %s %s", os.path.basename(path), why,
                extra=event("segment_dropped", segment=os.path.basename(path), reason=why))
    report.dropped.append(f"{os.path.basename(path)}: {why}")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


