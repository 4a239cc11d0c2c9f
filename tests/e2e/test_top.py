"""kvtier top against a real daemon: --once, and the live screen under a pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kvtier
from tests.conftest import DaemonProc, start_daemon, stop_daemon

#: What these tests check does not depend on the client transport (the adapters,
#: the tools and the daemon's own interfaces); they run once, on the default (fast).
pytestmark = pytest.mark.one_transport

ROWS, COLS = 24, 80
NS = "top/e2e/bf16"
BLOCK = 64 << 10


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLUMNS", "LINES") and not k.startswith("KVTIER_")}
    env["TERM"] = "xterm-256color"
    return env


class Screen:
    """A minimal VT100 screen: enough of xterm to replay what kvtier top writes.

    Printable characters, CR, LF, cursor home/position, erase in line/display,
    the alternate screen and cursor visibility.  A character written past the
    last column wraps (as on a terminal with autowrap) and is counted in
    ``overflows``: a line wider than the screen.
    """

    CSI = re.compile(r"\x1b\[([?0-9;]*)([@-~])")

    def __init__(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols
        self.grid = [[" "] * cols for _ in range(rows)]
        self.y = self.x = 0
        self.overflows = 0
        self.alt = False
        self.cursor_visible = True
        self.unknown: set[str] = set()

    def feed(self, text: str) -> None:
        i = 0
        while i < len(text):
            ch = text[i]
            if ch == "\x1b":
                m = self.CSI.match(text, i)
                if m is None:  # incomplete at the end of what was read so far
                    return
                self._csi(m.group(1), m.group(2))
                i = m.end()
                continue
            if ch == "\r":
                self.x = 0
            elif ch == "\n":
                self._linefeed()
            elif ch >= " ":
                if self.x >= self.cols:
                    self.overflows += 1
                    self.x = 0
                    self._linefeed()
                self.grid[self.y][self.x] = ch
                self.x += 1
            i += 1

    def _linefeed(self) -> None:
        if self.y == self.rows - 1:
            self.grid = self.grid[1:] + [[" "] * self.cols]
        else:
            self.y += 1

    def _csi(self, params: str, final: str) -> None:
        if params.startswith("?") and final in "hl":
            on = final == "h"
            for p in params[1:].split(";"):
                if p == "1049":
                    self.alt = on
                    self.grid = [[" "] * self.cols for _ in range(self.rows)]
                elif p == "25":
                    self.cursor_visible = on
            return
        nums = [int(p) if p else 0 for p in params.split(";")] if params else []
        if final == "H":
            row = (nums[0] if nums and nums[0] else 1) - 1
            col = (nums[1] if len(nums) > 1 and nums[1] else 1) - 1
            self.y, self.x = min(row, self.rows - 1), min(col, self.cols - 1)
        elif final == "K" and (not nums or nums[0] == 0):
            for x in range(min(self.x, self.cols), self.cols):
                self.grid[self.y][x] = " "
        elif final == "J" and (not nums or nums[0] == 0):
            self._csi("", "K")
            for y in range(self.y + 1, self.rows):
                self.grid[y] = [" "] * self.cols
        elif final == "J" and nums[0] == 2:
            self.grid = [[" "] * self.cols for _ in range(self.rows)]
        elif final != "m":
            self.unknown.add(params + final)

    def lines(self) -> list[str]:
        return ["".join(r).rstrip() for r in self.grid]

    def text(self) -> str:
        return "\n".join(self.lines())


def _controlling_tty() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    # As from a terminal: Ctrl-C interrupts.  (A test run started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python keeps it so.)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class TopInPty:
    """``python -m kvtier.top`` on an 80x24 pseudo-terminal, its output read continuously."""

    def __init__(self, socket_dir: str, interval: float = 0.5) -> None:
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
        self.attrs_before = termios.tcgetattr(self.slave)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.top", "--socket", socket_dir,
             "--interval", str(interval)],
            stdin=self.slave, stdout=self.slave, stderr=self.slave, env=_env(),
            # Its own session with the pty as controlling terminal, as in a real
            # terminal: Ctrl-C sends SIGINT and a resize SIGWINCH.
            start_new_session=True, preexec_fn=_controlling_tty,
        )
        self.output = bytearray()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while not self.stop.is_set():
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(self.master, 65536)
                except OSError:
                    return
                with self.lock:
                    self.output += data

    def screen(self, since: int = 0, cols: int = COLS) -> Screen:
        """The screen after replaying the output (from byte ``since``, at ``cols`` wide)."""
        with self.lock:
            text = bytes(self.output[since:]).decode("utf-8", "replace")
        s = Screen(ROWS, cols)
        s.feed(text)
        return s

    def resize(self, rows: int, cols: int) -> int:
        """Resize the terminal (the kernel sends SIGWINCH); the output offset before it."""
        with self.lock:
            at = len(self.output)
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        return at

    def wait_for(self, pred: Callable[[Screen], bool], timeout: float = 30, since: int = 0,
                 cols: int = COLS) -> Screen:
        deadline = time.monotonic() + timeout
        while True:
            s = self.screen(since, cols)
            if pred(s):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"screen never matched; it shows:\n{s.text()}")
            if self.proc.poll() is not None:
                raise AssertionError(f"kvtier top exited {self.proc.returncode}:\n{s.text()}")
            time.sleep(0.1)

    def press(self, key: bytes) -> None:
        os.write(self.master, key)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.stop.set()
        self.reader.join(5)
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def top_factory() -> Iterator[Callable[..., TopInPty]]:
    started: list[TopInPty] = []

    def start(socket_dir: str, interval: float = 0.5) -> TopInPty:
        t = TopInPty(socket_dir, interval)
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()


def _traffic(d: DaemonProc, stop: threading.Event, n_keys: int = 16) -> None:
    """Write new blocks (and look them up) until ``stop``."""
    with kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BLOCK, model_uid="m") as c:
        i = 0
        while not stop.is_set():
            keys = kvtier.block_keys(list(range(i, i + 16 * n_keys)), 16, salt=b"top")
            blocks = [np.full(BLOCK, k % 251, np.uint8) for k in range(n_keys)]
            c.put(keys, blocks)
            c.lookup(keys)
            i += 16 * n_keys
            time.sleep(0.02)


def _dram_write_rate(s: Screen) -> float:
    """The DRAM row's write column in bytes/s (the row's last two words: "12.3 MiB/s")."""
    for line in s.lines():
        if line.split()[:1] == ["dram"]:
            value, unit = line.split()[-2:]
            scale = {"B/s": 1, "KiB/s": 1 << 10, "MiB/s": 1 << 20, "GiB/s": 1 << 30,
                     "TiB/s": 1 << 40}[unit]
            return float(value) * scale
    return 0.0


def test_once_prints_namespaces_tiers_and_rpcs_as_plain_text(daemon: DaemonProc,
                                                            transport: str) -> None:
    with kvtier.Client(daemon.socket_dir, namespace=NS, block_bytes=BLOCK, model_uid="m") as c:
        keys = kvtier.block_keys(list(range(16 * 8)), 16, salt=b"once")
        assert c.put(keys, [np.full(BLOCK, i, np.uint8) for i in range(8)]) == 8
        assert c.lookup(keys) == 8
        assert len(c.get(keys)) == 8
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.top", "--socket", daemon.socket_dir, "--once",
         "--interval", "0.2"],
        capture_output=True, text=True, timeout=60, env=_env(),
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "\x1b" not in out.stdout
    assert all(len(line) <= 80 for line in lines), out.stdout
    assert lines[0].startswith("kvtierd ") and "rates over the last" in out.stdout
    ns = [line for line in lines if line.startswith(NS)]
    assert ns and ns[0].split()[1] == "8", out.stdout  # 8 blocks
    # The lookup and the get made without a call are the client's report: a table of
    # their own (the namespace's row there, no cut), in no figure of the daemon's.
    if transport == "fast":
        at = next(i for i, line in enumerate(lines) if line.startswith("client-reported"))
        assert lines[at - 1].startswith("reported by clients, without a call"), out.stdout
        assert len(ns) == 2 and ns[1] == lines[at + 1] and ns[1].split()[-1] == "0", out.stdout
    else:
        assert len(ns) == 1 and not any(line.startswith("client-reported") for line in lines)
    assert any(line.split()[:1] == ["dram"] for line in lines), out.stdout
    at = next(i for i, line in enumerate(lines) if line.startswith("slowest rpcs"))
    methods = [line.split()[0] for line in lines[at + 1:] if line.strip()]
    # The client called Reserve and Commit (its lookup and its get's lease were answered
    # from the shared index: no call), and top called Stats: the three, each once.
    called = {r.method for r in daemon.stats().rpcs}
    assert {"Reserve", "Commit", "Stats"} <= called
    assert not called & {"Lookup", "Acquire", "Release"}
    assert len(methods) == len(set(methods)) == 3 and set(methods) <= called, out.stdout


def test_live_screen_shows_traffic_fits_80_columns_and_q_restores_the_terminal(
        daemon: DaemonProc, top_factory: Callable[..., TopInPty]) -> None:
    top = top_factory(daemon.socket_dir)
    stop = threading.Event()
    writer = threading.Thread(target=_traffic, args=(daemon, stop), daemon=True)
    writer.start()
    try:
        # A rate over an interval (the first frame shows since-start averages).
        screen = top.wait_for(lambda s: NS in s.text() and "rates over the last" in s.text()
                              and _dram_write_rate(s) > 0)
    finally:
        stop.set()
        writer.join(30)
    assert screen.alt and not screen.cursor_visible
    assert screen.lines()[0].startswith("kvtierd ")
    assert "q: quit" in screen.text()
    assert any(line.startswith("slowest rpcs") for line in screen.lines())
    assert screen.overflows == 0 and screen.unknown == set()
    assert top.proc.poll() is None

    top.press(b"q")
    assert top.proc.wait(5) == 0
    time.sleep(0.3)  # the reader drains the last bytes
    after = top.screen()
    assert not after.alt and after.cursor_visible  # alternate screen left, cursor shown
    assert after.overflows == 0
    assert termios.tcgetattr(top.slave) == top.attrs_before  # cbreak mode undone


def test_a_vanished_daemon_is_shown_and_top_keeps_running_until_q(
        workdir: str, top_factory: Callable[..., TopInPty]) -> None:
    d = start_daemon(workdir)
    try:
        with kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BLOCK, model_uid="m") as c:
            c.put([b"k"], [np.zeros(BLOCK, np.uint8)])
        top = top_factory(d.socket_dir)
        top.wait_for(lambda s: NS in s.text())
    finally:
        stop_daemon(d)
    top.wait_for(lambda s: "daemon unreachable:" in s.lines()[0])
    time.sleep(1.5)  # three more refreshes against no daemon
    screen = top.screen()
    assert top.proc.poll() is None, screen.text()
    assert "daemon unreachable:" in screen.lines()[0] and "retrying" in screen.text()
    assert screen.overflows == 0
    top.press(b"q")
    assert top.proc.wait(5) == 0
    assert termios.tcgetattr(top.slave) == top.attrs_before


def test_a_resize_redraws_at_once_to_the_new_width_and_ctrl_c_restores_the_terminal(
        daemon: DaemonProc, top_factory: Callable[..., TopInPty]) -> None:
    with kvtier.Client(daemon.socket_dir, namespace=NS, block_bytes=BLOCK, model_uid="m") as c:
        c.put([b"k"], [np.zeros(BLOCK, np.uint8)])
    top = top_factory(daemon.socket_dir, interval=30)  # no refresh would come by itself
    top.wait_for(lambda s: NS in s.text())
    since = top.resize(ROWS, 60)
    # Drawn again within moments, every line cut to 60 columns (the header is wider).
    narrow = top.wait_for(lambda s: s.lines()[0].startswith("kvtierd "), timeout=5,
                          since=since, cols=60)
    assert narrow.overflows == 0
    assert len(narrow.lines()[0]) == 60 and NS in narrow.text()

    top.press(b"\x03")  # Ctrl-C
    assert top.proc.wait(5) == 130
    time.sleep(0.3)
    after = top.screen()
    assert not after.alt and after.cursor_visible
    assert termios.tcgetattr(top.slave) == top.attrs_before
