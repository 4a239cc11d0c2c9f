"""Warm start: re-attach the segments a previous daemon left in the shm directory.

What a previous run left is untrusted input, like a network request: a crash
can leave any state, a bug any value, and the data files were writable by
clients.  So every ``*.meta`` file is attached and validated
(``Segment.attach``: header, geometry, sizes); a segment that fails is
removed ("reformatted") with the reason logged, never half-used, and so is a
data file without metadata (format 1 kept both in one ``.seg`` file: such
files from an older kvtierd are a cold start).  Then the store adopts every
valid segment (``store.adoption.adopt_segment``: ``BlockTable.adopt`` in native code), which
checks every slot first — state, key length, length, flags, generation, access
sequence, commit epoch, the entry checksum, and whether a client cut its data off;
a slot that fails is freed and counted with its reason
(``RecoveryReport.dropped_slots``).
Valid extents are adopted most recently used first, so when ``dram.capacity``
shrank the coldest extents are the ones dropped.  The store's ``check()``
runs after the last one (kvtierd runs it right after READY, off the loop).  Data pages are not touched here (the daemon never
reads payload); they are locked in the background after the daemon is ready.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import logging
import os
import time
from typing import Final

import numpy as np

from kvtier import _native
from kvtier.errors import CapacityExhausted, FailedPrecondition
from kvtierd import shared_index
from kvtierd.logs import event
from kvtierd.segments import (
    DATA_SUFFIX,
    META_SUFFIX,
    SLOT_ENTRY_BYTES,
    TABLE_OFFSET,
    Segment,
    SegmentInvalid,
)
from kvtierd.store import Store
from kvtierd.store.adoption import adopt_segment, check_adoptable, finish_recovery

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RecoveryReport:
    """What a start found: per-namespace recovered blocks, what was dropped and why."""

    seconds: float = 0.0
    segments: int = 0
    blocks: dict[str, int] = dataclasses.field(default_factory=dict)
    dropped: list[str] = dataclasses.field(default_factory=list)
    #: Slots of adopted segments that failed validation, by reason.
    dropped_slots: collections.Counter[str] = dataclasses.field(
        default_factory=collections.Counter)
    #: What ``Store.check()`` reported after adoption (empty when all adds up).
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def warm(self) -> bool:
        return bool(self.blocks)


def recover(store: Store, shm_dir: str, *, check: bool = True) -> RecoveryReport:
    """Attach and adopt every valid segment in ``shm_dir``; blocking I/O (run before serving).

    With ``check`` the store's ``check()`` runs at the end (``report.problems``).
    kvtierd passes False and runs the same check right after it is ready, off the
    event loop (``app._check_after_recovery``): it costs seconds per million
    blocks, which a warm start must not wait for.
    """
    t0 = time.monotonic()
    report = RecoveryReport()
    attached: list[tuple[tuple[int, int], Segment]] = []
    lasts: dict[int, np.ndarray] = {}  # segment id -> its committed slots' last accesses
    metas = sorted(glob.glob(os.path.join(shm_dir, "*" + META_SUFFIX)))
    for path in metas:
        try:
            seg = Segment.attach(path, segment_id=store.new_segment_id())
        except (SegmentInvalid, OSError) as exc:
            _drop(report, path, f"reformatted: {exc}")
            _remove(path[: -len(META_SUFFIX)] + DATA_SUFFIX)
            continue
        if seg.size_fault is not None:
            log.warning("segment %s: %s; its size is restored, slots past byte %d are dropped",
                        os.path.basename(seg.path), seg.size_fault, seg.intact_bytes,
                        extra=event("segment_size_fault", segment=os.path.basename(seg.path),
                                    reason=seg.size_fault))
        usage, lasts[seg.segment_id] = _usage(seg)
        attached.append((usage, seg))
    with_meta = {p[: -len(META_SUFFIX)] + DATA_SUFFIX for p in metas}
    for path in sorted(glob.glob(os.path.join(shm_dir, "*" + DATA_SUFFIX))):
        if path not in with_meta:
            _drop(report, path, "reformatted: no metadata file beside it (lost, or a format 1 "
                  "segment of an older kvtierd)")
    attached = _one_layout_per_namespace(attached, report)
    attached.sort(key=lambda item: -item[0][1])  # most recently used first
    recent = _median_access([lasts[seg.segment_id] for _, seg in attached])
    lasts.clear()
    expect: collections.Counter[str] = collections.Counter()  # blocks still to adopt
    for (committed, _), seg in attached:
        expect[seg.namespace] += committed
    for (committed, _), seg in attached:
        room = expect[seg.namespace]
        expect[seg.namespace] -= committed
        try:
            check_adoptable(store, seg)
        except (CapacityExhausted, FailedPrecondition) as exc:
            seg.close(unlink=True, free=True)
            _drop(report, seg.path, f"dropped: {exc}")
            continue
        # Every slot validated natively (tests/unit/slot_oracle.py states the same rules
        # in numpy, and the tests prove the two equal).
        n, dropped = adopt_segment(store, seg, referenced_from=recent, expect=room)
        if dropped:
            report.dropped_slots.update(dropped)
            log.warning("segment %s (namespace %r): dropped slots: %s", os.path.basename(seg.path),
                        seg.namespace, ", ".join(f"{count} {why}" for why, count in dropped.items()),
                        extra=event("slots_dropped", segment=os.path.basename(seg.path),
                                    namespace=seg.namespace, reasons=dict(dropped)))
        report.segments += 1
        report.blocks[seg.namespace] = report.blocks.get(seg.namespace, 0) + n
    finish_recovery(store)
    shared_index.drop_prepared()  # (made ahead for extents that were dropped)
    if check:
        report.problems = store.check()
        log_problems(report.problems)
    report.seconds = time.monotonic() - t0
    for name, ns in store.namespaces.items():
        log.info("namespace %r: warm, %d blocks recovered in %d extents (block_bytes=%d, "
                 "model_uid=%r)", name, ns.recovered, len(ns.extents), ns.block_bytes,
                 ns.model_uid, extra=event("namespace_recovered", namespace=name,
                                           blocks=ns.recovered, extents=len(ns.extents)))
    log.info("recovery: %s start, %d blocks in %d segments in %.3f s%s%s",
             "warm" if report.warm else "cold", sum(report.blocks.values()), report.segments,
             report.seconds, f"; {len(report.dropped)} segment files dropped" if report.dropped
             else "",
             f"; {sum(report.dropped_slots.values())} slots dropped" if report.dropped_slots
             else "",
             extra=event("start", warm=report.warm, blocks=sum(report.blocks.values()),
                         segments=report.segments, seconds=round(report.seconds, 6),
                         dropped_segments=len(report.dropped),
                         dropped_slots=sum(report.dropped_slots.values())))
    return report


def log_problems(problems: list[str]) -> None:
    """Log what a check after recovery found (each is a bug: please report it)."""
    for problem in problems:
        log.error("after recovery: %s", problem, extra=event("check_failed", problem=problem))


#: The median of the adopted blocks' last accesses is taken over at most about this many
#: of them (every k-th of each extent): a threshold for the CLOCK bits, not a figure that
#: needs every block (an exact median of 4M cost ~20 ms of a warm start).
MEDIAN_SAMPLE: Final = 1 << 18


def _median_access(lasts: list[np.ndarray]) -> int:
    """The median of the last accesses of the committed slots (``_usage``) of the
    extents to adopt, from an even sample of at most ~``MEDIAN_SAMPLE`` of them (every
    k-th of each extent): adopted blocks at or past it keep their CLOCK bit (the hand
    takes the older half first)."""
    total = sum(len(x) for x in lasts)
    if not total:
        return 0
    step = max(1, total // MEDIAN_SAMPLE)
    return int(np.median(np.concatenate([x[::step] for x in lasts])))


def _usage(seg: Segment) -> tuple[tuple[int, int], np.ndarray]:
    """(committed blocks, most recent access) of a segment, read from its slot table,
    and the last accesses of its committed slots (``_median_access``): one native pass
    over the table, the GIL released (``_native.slot_usage``)."""
    n = seg.layout.n_slots
    table = memoryview(seg.meta)[TABLE_OFFSET : TABLE_OFFSET + n * SLOT_ENTRY_BYTES]
    try:
        count, newest, lasts = _native.slot_usage(table)
    finally:
        table.release()
    return (count, newest), np.frombuffer(lasts, dtype=np.uint64)


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
                seg.close(unlink=True, free=True)
                _drop(report, seg.path,
                      f"dropped: namespace {name!r} extent {seg.index} has block_bytes={bb} "
                      f"model_uid={uid!r}, its other extents (holding more blocks) have "
                      f"block_bytes={win_bb} model_uid={win_uid!r}")
    return kept


def _drop(report: RecoveryReport, path: str, why: str) -> None:
    log.warning("segment %s %s", os.path.basename(path), why,
                extra=event("segment_dropped", segment=os.path.basename(path), reason=why))
    report.dropped.append(f"{os.path.basename(path)}: {why}")
    _remove(path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
