"""Daemon logging: one line per significant event, JSON for machines, text for people.

``log.format`` picks the shape: ``text`` (``time LEVEL logger: message``),
``json`` (one object per line: ``ts``, ``level``, ``logger``, ``msg``, the
``event`` name when the call gave one, and the event's fields), or ``auto``
(the default): JSON unless stderr is a terminal, so journald, Docker and log
shippers get parseable lines and a person at a shell gets readable ones.

Significant events carry a stable ``event`` name and their numbers as fields
so a log pipeline can count them without parsing prose::

    log.info("recovery: warm start, ...", extra=event("start", warm=True, blocks=n))

Nothing on the per-block hot path logs; faults that can repeat per block are
counted in metrics and logged once per batch.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

#: The record attribute the ``event()`` helper sets (kept apart from logging's own).
_EVENT_ATTR = "kvtier_event"


def event(name: str, **fields: Any) -> dict[str, Any]:
    """``extra=`` for a log call: the event's stable name and its fields."""
    return {_EVENT_ATTR: (name, fields)}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, UTC timestamps with milliseconds."""

    def __init__(self, instance: str = "") -> None:
        super().__init__()
        self.instance = instance

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.instance:
            out["instance"] = self.instance
        tagged = getattr(record, _EVENT_ATTR, None)
        if tagged is not None:
            name, fields = tagged
            out["event"] = name
            for key, value in fields.items():
                out.setdefault(key, value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def use_json(fmt: str, stream: TextIO) -> bool:
    """Whether ``log.format`` ``fmt`` means JSON on ``stream``."""
    if fmt == "auto":
        isatty = getattr(stream, "isatty", None)
        return not (isatty is not None and isatty())
    return fmt == "json"


def setup(level: str, fmt: str, *, instance: str = "", stream: TextIO | None = None) -> None:
    """Install the one root handler the daemon logs through (replacing any earlier one)."""
    stream = stream if stream is not None else sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(instance) if use_json(fmt, stream)
                         else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # grpc and asyncio are chatty at debug; their warnings still come through.
    for noisy in ("grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, root.level))


class Throttle:
    """At most one log line per ``interval`` seconds for each kind of repeated event.

    ``throttle(key)`` returns None while lines of that kind are being held
    back, else how many were held back since the last one (to say "+N more").
    A failing disk fails every block; its log says so once per interval, and
    the metrics count every block.  Thread-safe (spill I/O runs on workers).
    """

    def __init__(self, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __call__(self, key: str) -> int | None:
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._held[key] = self._held.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._held.pop(key, 0)


def more(n: int) -> str:
    """The suffix for a throttled line: how many like it were held back."""
    return f" (+{n} more like it held back)" if n else ""
