"""The memcpy baselines: the copies a put or a get does, measured alone."""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier import _accel
from kvtier.bench.common import percentile
from kvtier.bench.workers import _bufs
from kvtier.units import MiB


def measure_memcpy(block: int, batch: int, budget_s: float, min_reps: int,
                   one_block: bool = True) -> dict[str, Any]:
    """Single-thread np.copyto of a batch of distinct blocks: ``rates`` of each repetition.

    With ``one_block`` also the copy_into and reused-single-block variants.
    """
    src = _bufs(block, batch, 1)
    dst = _bufs(block, batch, 2)

    def timed(copy: Callable[[int], object]) -> list[float]:
        rates: list[float] = []
        t_end = time.perf_counter() + budget_s
        copy(0)  # warm
        while len(rates) < min_reps or time.perf_counter() < t_end:
            t0 = time.perf_counter()
            for i in range(batch):
                copy(i)
            rates.append(batch * block / (time.perf_counter() - t0))
        return rates

    if not one_block:
        return {"rates": timed(lambda i: np.copyto(dst[i], src[i]))}
    batch_rates = timed(lambda i: np.copyto(dst[i], src[i]))
    one_rates = timed(lambda i: np.copyto(dst[0], src[0]))
    accel_rates = timed(lambda i: _accel.copy_into(dst[i], src[i]))
    return {
        "block_bytes": block,
        "rates": batch_rates,
        "one_block_bytes_per_s": percentile(one_rates, 50),
        "copy_into_bytes_per_s": percentile(accel_rates, 50),
        "copy_into_native": _accel.NATIVE,
    }


#: The shared-memory file the moving-slots baseline copies into (successive windows).
MOVING_POOL_BYTES = 256 * MiB


def measure_moving_copy(block: int, batch: int, budget_s: float, min_reps: int) -> float | None:
    """Median rate of one batch of distinct blocks copied (``copy_into``) into successive
    batch-sized windows of a pre-faulted shared-memory file: the copy a put makes into
    the slots the daemon hands out, which move through the pool, with no control plane
    at all.  What a put can reach at best (``bench/copy_ceiling.py`` measures it alone);
    None when no shared-memory file can be made."""
    span = block * batch
    pool = max(span, MOVING_POOL_BYTES // span * span)
    try:
        fd, path = tempfile.mkstemp(prefix="kvt-bench-moving-", dir="/dev/shm")
    except OSError:
        return None
    try:
        os.unlink(path)
        os.ftruncate(fd, pool)
        with mmap.mmap(fd, pool) as mm:
            shm = np.frombuffer(mm, np.uint8)
            shm[::4096] = 1  # pre-faulted, as the daemon's extents are
            src = _bufs(block, batch, 1)
            windows = pool // span
            rates: list[float] = []
            t_end = time.perf_counter() + budget_s
            w = 0
            while len(rates) < min_reps or time.perf_counter() < t_end:
                base = (w % windows) * span
                w += 1
                t0 = time.perf_counter()
                for i in range(batch):
                    _accel.copy_into(shm[base + i * block: base + (i + 1) * block], src[i])
                rates.append(span / (time.perf_counter() - t0))
            del shm
        return percentile(rates, 50)
    except OSError:
        return None
    finally:
        os.close(fd)


def memcpy_summary(before: dict[str, Any], after: dict[str, Any] | None) -> dict[str, Any]:
    """The denominator: the median over the repetitions before and after a size's runs."""
    rates = list(before["rates"]) + (list(after["rates"]) if after else [])
    out = {k: v for k, v in before.items() if k != "rates"}
    out.update(
        bytes_per_s=percentile(rates, 50),
        best_bytes_per_s=max(rates),
        reps=len(rates),
        before_bytes_per_s=percentile(before["rates"], 50),
        after_bytes_per_s=percentile(after["rates"], 50) if after else None,
    )
    return out
