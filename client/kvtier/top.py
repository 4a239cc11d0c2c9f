"""``kvtier top``: a live terminal view of one kvtierd, refreshed like top(1).

One screen, readable at 80 columns: a header (version, uptime, boot epoch,
warm/cold, sessions, leases, reservations); the tiers (occupancy, blocks,
read and write throughput); the spill counters (demotions and promotions per
second, queue depth, faults, checksum failures); the namespaces (blocks,
leased, sessions, hit ratio of Acquire calls over the last interval and since
start), most active first; what clients report doing without a call, per
namespace, apart and labelled as theirs (lookups and acquires per second, their
hit ratio, bytes read per second, folds cut to a bound); and the five slowest
RPC methods by p99.

Every figure but the client-reported table is the daemon's own: what it did or
saw.  The client-reported table is what tenants' pages say (bounded by what the
host could do, never verified) and is in no other figure on the screen.

Everything comes from the Stats RPC.  Its byte, block, hit and call counts are
cumulative since the daemon started, so a rate is the difference between two
samples over their time delta.  Without a previous sample (the first frame, or
after the daemon restarted and its counters began again) rates are averages
since the daemon started, and the screen says so.

``render`` is pure (two samples in, lines out); ``main`` is the terminal
loop: raw ANSI on the alternate screen, stdin in cbreak mode, ``select`` on
stdin for ``q`` with the refresh interval as timeout, SIGWINCH to redraw at a
new size, and the terminal restored however it exits.  ``--once`` prints one
frame as plain text for scripts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import signal
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NamedTuple, TextIO

from kvtier._admin import fetch_stats
from kvtier._fmt import table
from kvtier._wire import TIER_NAMES
from kvtier.errors import KVTierError
from kvtier.units import format_bytes
from kvtier.v1 import kvtier_pb2 as pb

#: How many RPC methods the slowest-RPC table shows.
SLOWEST_RPCS = 5
#: How many namespaces the client-reported table shows (the most active).
REPORTED_ROWS = 5

#: A Stats call that takes longer than this counts as "unreachable": long
#: enough for a daemon busy with a large commit, short enough that ``q`` (read
#: between calls) still answers within a few seconds.
STATS_TIMEOUT = 3.0

# Terminal control (VT100/xterm; every terminal emulator in use knows these).
_ALT_SCREEN_ON, _ALT_SCREEN_OFF = "\x1b[?1049h", "\x1b[?1049l"
_CURSOR_HIDE, _CURSOR_SHOW = "\x1b[?25l", "\x1b[?25h"
# Synchronized output: the terminal shows a frame only once it is complete
# (no tearing); terminals without it ignore the sequence.
_FRAME_BEGIN, _FRAME_END = "\x1b[?2026h", "\x1b[?2026l"
_HOME, _ERASE_LINE, _ERASE_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"


class Sample(NamedTuple):
    """One Stats answer and the local monotonic time it arrived."""

    t: float
    stats: pb.StatsResponse


# ------------------------------------------------------------------ rendering


def _duration(seconds: float) -> str:
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _rate(n: float) -> str:
    return f"{format_bytes(n)}/s"


def _ratio(hits: int, misses: int) -> str:
    asked = hits + misses
    return f"{hits / asked:.1%}" if asked else "-"


def _fit(name: str, width: int) -> str:
    """``name`` cut to ``width`` characters, a trailing ``~`` marking a cut."""
    return name if len(name) <= width else name[: max(width - 1, 0)] + "~"


def _fitted_table(rows: list[list[str]], width: int, left: tuple[int, ...] = (0,)) -> list[str]:
    """``table`` lines, column 0 (a name) shortened so the lines fit ``width``."""
    lines = table(rows, left).splitlines()
    excess = max(len(line) for line in lines) - width
    if excess > 0:
        longest = max(len(r[0]) for r in rows[1:]) if len(rows) > 1 else 0
        keep = max(longest - excess, 4)
        rows = [rows[0]] + [[_fit(r[0], keep), *r[1:]] for r in rows[1:]]
        lines = table(rows, left).splitlines()
    return [line[:width] for line in lines]


def _comparable(prev: Sample | None, cur: Sample) -> Sample | None:
    """``prev`` when its counters can be subtracted from ``cur``'s; None when the daemon
    restarted in between (another boot epoch, or its uptime went back) or no time passed."""
    if prev is None or cur.t <= prev.t:
        return None
    p, c = prev.stats, cur.stats
    if p.boot_epoch != c.boot_epoch or c.uptime_seconds < p.uptime_seconds:
        return None
    return prev


def _io_by_tier(s: pb.StatsResponse) -> dict[pb.Tier, pb.TierIO]:
    return {io.tier: io for io in s.io}


def render(prev: Sample | None, cur: Sample, width: int = 80, height: int | None = None,
           *, live: bool = False) -> list[str]:
    """The screen for ``cur`` as lines of at most ``width`` characters (plain text).

    Rates are over ``cur.t - prev.t``; with no usable ``prev`` (None, or the daemon
    restarted since) they are averages since the daemon started.  With ``height``,
    the namespace table is cut so the whole screen fits in ``height`` lines (the
    most active namespaces stay).  ``live`` adds the key hint to the status line.
    """
    base = _comparable(prev, cur)
    s = cur.stats
    if base is not None:
        dt = cur.t - base.t
        ps = base.stats
        span = f"rates over the last {dt:.1f} s"
    else:
        dt = max(s.uptime_seconds, 1e-9)
        ps = pb.StatsResponse()  # all counters zero: rates are since-start averages
        span = "rates: averages since start"

    def per_s(now: float, before: float) -> float:
        return max(now - before, 0) / dt

    head = [
        f"kvtierd {s.daemon_version or '?'}  up {_duration(s.uptime_seconds)}  "
        f"epoch {s.boot_epoch}  {'warm' if s.warm_start else 'cold'}  sessions {s.sessions}  "
        f"leases {s.leases}  reservations {s.reservations}  granted {s.granted_blocks}",
        span + ("   q: quit" if live else ""),
        "",
    ]

    # Tiers: the daemon's tier list, plus any tier that has I/O but no occupancy row.
    io_now, io_before = _io_by_tier(s), _io_by_tier(ps)
    order = [t.tier for t in s.tiers] + sorted(set(io_now) - {t.tier for t in s.tiers})
    occupancy = {t.tier: t for t in s.tiers}
    trows = [["tier", "used", "total", "use%", "blocks", "read", "write"]]
    for tier in order:
        name = TIER_NAMES.get(tier, f"tier{tier}")
        t = occupancy.get(tier)
        if t is None or not t.total_bytes:  # the shared tier: its filesystem's quota governs
            used = total = pct = "-"
            blocks = str(t.committed_blocks) if t is not None and t.committed_blocks else "-"
        elif tier == pb.TIER_CLUSTER:  # what this host lends; its use is the master's to know
            used = pct = blocks = "-"
            total = format_bytes(t.total_bytes)
        else:
            in_use = t.total_bytes - t.free_bytes
            used, total = format_bytes(in_use), format_bytes(t.total_bytes)
            pct, blocks = f"{in_use / t.total_bytes:.1%}", str(t.committed_blocks)
        now_io, before_io = io_now.get(tier, pb.TierIO()), io_before.get(tier, pb.TierIO())
        trows.append([name, used, total, pct, blocks,
                      _rate(per_s(now_io.read_bytes, before_io.read_bytes)),
                      _rate(per_s(now_io.written_bytes, before_io.written_bytes))])
    tiers = _fitted_table(trows, width) if len(trows) > 1 else ["no tiers"]

    faults = sum(s.spill_faults.values())
    spill = [
        f"spill: demotions {per_s(s.demotions, ps.demotions):.1f}/s  "
        f"promotions {per_s(s.promotions, ps.promotions):.1f}/s  "
        f"queue {s.spill_queue_depth}  faults {faults}  "
        f"bad checksums {s.spill_checksum_failures}"
    ]

    # Namespaces, most active first: lookups/acquires asked in the interval, then
    # blocks that came or went, then sessions and size.
    before_ns = {n.name: n for n in ps.namespaces}

    def activity(n: pb.NamespaceStats) -> tuple[int, int, int, int]:
        b = before_ns.get(n.name, pb.NamespaceStats())
        asked = (n.hits + n.misses) - (b.hits + b.misses)
        return (-max(asked, 0), -abs(n.committed_blocks - b.committed_blocks), -n.sessions,
                -n.committed_blocks)

    nrows = [["namespace", "blocks", "leased", "sessions", "hit now", "hit total"]]
    for n in sorted(s.namespaces, key=lambda n: (activity(n), n.name)):
        b = before_ns.get(n.name, pb.NamespaceStats())
        dh, dm = max(n.hits - b.hits, 0), max(n.misses - b.misses, 0)
        nrows.append([n.name, str(n.committed_blocks), str(n.leased_blocks), str(n.sessions),
                      _ratio(dh, dm) if base is not None else "-", _ratio(n.hits, n.misses)])

    reported = _reported_table(s, ps, per_s, base is not None, width)

    slow = sorted(s.rpcs, key=lambda r: (-r.p99_seconds, -r.max_seconds, r.method))[:SLOWEST_RPCS]
    rrows = [["slowest rpcs", "calls", "calls/s", "errors", "p50 ms", "p99 ms", "max ms"]]
    before_calls = {r.method: r.calls for r in ps.rpcs}
    for r in slow:
        rrows.append([r.method, str(r.calls), f"{per_s(r.calls, before_calls.get(r.method, 0)):.1f}",
                      str(r.errors), f"{r.p50_seconds * 1e3:.3f}", f"{r.p99_seconds * 1e3:.3f}",
                      f"{r.max_seconds * 1e3:.3f}"])
    rpcs = _fitted_table(rrows, width) if slow else ["no RPCs yet"]

    fixed = head + tiers + spill + [""] + [""] + reported + rpcs
    if not s.namespaces:
        namespaces = ["no namespaces"]
    else:
        namespaces = _fitted_table(nrows, width)
        room = None if height is None else height - len(fixed)
        if room is not None and len(namespaces) > room:
            shown = max(room - 2, 0)  # keep the heading and a "more" line
            hidden = len(namespaces) - 1 - shown
            namespaces = namespaces[: 1 + shown] + [f"... {hidden} more namespaces"]
    lines = head + tiers + spill + [""] + namespaces + [""] + reported + rpcs
    return [line[:width] for line in lines]


def _reported_table(s: pb.StatsResponse, ps: pb.StatsResponse,
                    per_s: Callable[[float, float], float], interval: bool,
                    width: int) -> list[str]:
    """The client-reported table and a blank line after it, or nothing when no client
    reported anything: per namespace (the most active ``REPORTED_ROWS``), lookups and
    acquires per second, their hit ratio (over the interval when there is one, else
    since start), bytes read per second, and the folds cut to a bound."""
    before = {n.name: n.client_reported for n in ps.namespaces}
    rows = []
    for n in s.namespaces:
        r = n.client_reported
        if not (r.lookups or r.acquires or r.cut):
            continue
        b = before.get(n.name, pb.ClientReported()) if interval else pb.ClientReported()
        hits = max(r.lookup_hits - b.lookup_hits, 0) + max(r.acquire_hits - b.acquire_hits, 0)
        misses = (max(r.lookup_misses - b.lookup_misses, 0)
                  + max(r.acquire_misses - b.acquire_misses, 0))
        keys = per_s(r.lookups + r.acquires, b.lookups + b.acquires)
        rows.append((-keys, n.name, [
            n.name, f"{per_s(r.lookups, b.lookups):.1f}", f"{per_s(r.acquires, b.acquires):.1f}",
            _ratio(hits, misses), _rate(per_s(r.read_bytes, b.read_bytes)), str(r.cut)]))
    if not rows:
        return []
    rows.sort(key=lambda x: (x[0], x[1]))
    table = [["client-reported", "lookups/s", "acquires/s", "hit", "read", "cut"]]
    table += [r for _k, _n, r in rows[:REPORTED_ROWS]]
    title = "reported by clients, without a call (bounded, not verified; in no figure above):"
    more = [f"... {len(rows) - REPORTED_ROWS} more"] if len(rows) > REPORTED_ROWS else []
    return [title, *_fitted_table(table, width), *more, ""]


def render_unreachable(error: str, socket: str | None, interval: float,
                       last: Sample | None, now: float, width: int = 80) -> list[str]:
    """The screen while the daemon does not answer: why, and that top keeps trying."""
    lines = [
        f"daemon unreachable: {error}",
        f"socket {socket or '(default)'}; retrying every {interval:g} s   q: quit",
    ]
    if last is not None:
        lines.append(f"last answer {_duration(now - last.t)} ago "
                     f"(kvtierd {last.stats.daemon_version}, epoch {last.stats.boot_epoch})")
    return [line[:width] for line in lines]


# ------------------------------------------------------------------- terminal


def _terminal_size(fd: int) -> tuple[int, int]:
    """(columns, lines) of the terminal on ``fd``, asked of the terminal itself so a
    resize is seen even when COLUMNS/LINES are set in the environment."""
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        size = shutil.get_terminal_size()
    return max(size.columns, 1), max(size.lines, 1)


def _frame(lines: list[str], columns: int, rows: int) -> str:
    """Escape codes that draw ``lines`` from the top-left corner and blank the rest.

    Each line is erased before it is written (not after: at the last column a
    terminal is in its pending-wrap state, where erase-to-end would take the last
    character), and no newline follows the bottom row (it would scroll).
    """
    shown = [_ERASE_LINE + line[:columns] for line in lines[:rows]]
    body = "\r\n".join(shown)
    tail = "\r\n" + _ERASE_BELOW if len(shown) < rows else ""
    return _FRAME_BEGIN + _HOME + body + tail + _FRAME_END


@contextlib.contextmanager
def _terminal(in_fd: int, out: TextIO) -> Iterator[None]:
    """cbreak mode on ``in_fd`` and the alternate screen on ``out``; both undone on
    any exit (return, exception, Ctrl-C, SIGTERM/SIGHUP turned into SystemExit)."""
    saved = termios.tcgetattr(in_fd)

    def leave(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        tty.setcbreak(in_fd, termios.TCSANOW)
        out.write(_ALT_SCREEN_ON + _CURSOR_HIDE)
        out.flush()
        yield
    finally:
        try:
            out.write(_CURSOR_SHOW + _ALT_SCREEN_OFF)
            out.flush()
        finally:
            termios.tcsetattr(in_fd, termios.TCSADRAIN, saved)
            for sig, handler in old.items():
                signal.signal(sig, handler)


@contextlib.contextmanager
def _winch_pipe() -> Iterator[int]:
    """A pipe's read end that becomes readable when the terminal is resized."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)

    def on_winch(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(w, b"w")

    old = signal.signal(signal.SIGWINCH, on_winch)
    try:
        yield r
    finally:
        signal.signal(signal.SIGWINCH, old)
        os.close(r)
        os.close(w)


def _fetch(socket: str | None, timeout: float) -> Sample:
    stats = fetch_stats(socket, timeout=timeout)
    return Sample(time.monotonic(), stats)


def live(socket: str | None, interval: float, iterations: int | None = None,
         in_fd: int | None = None, out: TextIO | None = None) -> int:
    """The refreshing screen until ``q`` (0), ``iterations`` frames (0), end of input (0)
    or Ctrl-C (130).  A daemon that does not answer is shown, and asked again."""
    in_fd = sys.stdin.fileno() if in_fd is None else in_fd
    out = sys.stdout if out is None else out
    out_fd = out.fileno()
    prev: Sample | None = None
    cur: Sample | None = None
    error: str | None = None
    frames = 0

    def draw() -> None:
        columns, rows = _terminal_size(out_fd)
        if error is not None or cur is None:
            lines = render_unreachable(error or "no answer yet", socket, interval, cur,
                                       time.monotonic(), columns)
        else:
            lines = render(prev, cur, columns, rows, live=True)
        out.write(_frame(lines, columns, rows))
        out.flush()

    try:
        with _terminal(in_fd, out), _winch_pipe() as winch:
            next_fetch = time.monotonic()
            while True:
                if time.monotonic() >= next_fetch:
                    try:
                        sample = _fetch(socket, min(STATS_TIMEOUT, max(interval, 1.0)))
                    except (KVTierError, OSError) as exc:
                        error = f"{type(exc).__name__}: {exc}"
                    else:
                        prev, cur, error = cur, sample, None
                    next_fetch = time.monotonic() + interval
                    draw()
                    frames += 1
                    if iterations is not None and frames >= iterations:
                        return 0
                wait = max(next_fetch - time.monotonic(), 0.0)
                ready, _, _ = select.select([in_fd, winch], [], [], wait)
                if winch in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.read(winch, 64)
                    draw()
                if in_fd in ready:
                    try:
                        keys = os.read(in_fd, 64)
                    except OSError:  # EIO: the terminal hung up
                        keys = b""
                    if not keys or b"q" in keys.lower():  # q, or the terminal went away
                        return 0
    except KeyboardInterrupt:
        return 130


def once(socket: str | None, interval: float, out: TextIO) -> int:
    """One plain-text frame: rates over two samples ``interval`` apart (the same figures
    the live screen shows), or since-start averages from one sample when it is 0."""
    try:
        first = _fetch(socket, STATS_TIMEOUT)
        if interval > 0:
            time.sleep(interval)
            prev: Sample | None = first
            cur = _fetch(socket, STATS_TIMEOUT)
        else:
            prev, cur = None, first
    except (KVTierError, OSError) as exc:
        print(f"kvtier top: daemon unreachable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    columns = shutil.get_terminal_size((80, 24)).columns
    out.write("\n".join(render(prev, cur, columns)) + "\n")
    out.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvtier top",
        description="Live view of kvtierd: tiers, throughput, spill, namespaces, slowest RPCs. "
                    "q quits.")
    p.add_argument("--socket", metavar="DIR", help="daemon socket directory (default: as kvtierd)")
    p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                   help="seconds between refreshes (default 1); with --once, between the two "
                        "samples the rates come from (0: averages since the daemon started)")
    p.add_argument("--once", action="store_true",
                   help="print one frame as plain text (no escape codes) and exit")
    p.add_argument("--iterations", type=int, metavar="N",
                   help="exit after N frames (default: until q)")
    args = p.parse_args(argv)
    if args.interval < 0 or (args.interval == 0 and not args.once):
        p.error("--interval must be positive (0 only with --once)")
    if args.iterations is not None and args.iterations < 1:
        p.error("--iterations must be at least 1")
    if args.once:
        return once(args.socket, args.interval, sys.stdout)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("kvtier top: needs a terminal on stdin and stdout; use --once for scripts",
              file=sys.stderr)
        return 2
    return live(args.socket, args.interval, args.iterations)


if __name__ == "__main__":
    sys.exit(main())
