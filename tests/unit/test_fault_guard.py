"""The fault guard: a SIGBUS in kvtier._native's memory helpers becomes OSError(EFAULT).

Real faults, no mocks: a file in /dev/shm is mapped, then truncated through
another descriptor (as a hostile client holding a writable fd would), and the
native helpers touch the vanished pages.  In this process the guard is
installed and every such call must raise OSError(EFAULT) and leave the
process working; subprocesses show that what the guard does not cover (no
guard, a fault outside a guarded call, a SIGBUS sent by kill, a SIGSEGV)
still kills the process as before, with faulthandler still reporting it.
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import mmap
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import xxhash

from kvtier import _accel

PAGE = 4096
MIB = 1 << 20

HAVE_NATIVE = importlib.util.find_spec("kvtier._native") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_NATIVE or not _accel.NATIVE,
    reason="needs kvtier._native in use (built, and KVTIER_FORCE_PY unset)",
)

FAULT_RE = re.compile(r"^memory fault \(SIGBUS\) at byte (\d+) of (\S+): ")

MakeMap = Callable[[int, int], mmap.mmap]


@pytest.fixture(scope="module", autouse=True)
def guard() -> None:
    """The guard, installed once for this process (it cannot be uninstalled)."""
    from kvtier import _native

    _native.install_fault_guard()
    assert _native.fault_guard_installed()


@pytest.fixture
def truncated() -> Iterator[MakeMap]:
    """Map ``size`` bytes of a fresh /dev/shm file, then truncate it to ``keep``.

    The truncation goes through a second descriptor, as a client's would; the
    mapping's pages past ``keep`` are gone and touching them raises SIGBUS.
    """
    maps: list[mmap.mmap] = []

    def make(size: int, keep: int) -> mmap.mmap:
        fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="kvt-fault-")
        try:
            other = os.open(path, os.O_RDWR)
            os.unlink(path)
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size)
            m[:keep] = b"\x5a" * keep
            os.ftruncate(other, keep)
            os.close(other)
        finally:
            os.close(fd)
        maps.append(m)
        return m

    yield make
    for m in maps:
        m.close()


def fault_of(exc: pytest.ExceptionInfo[OSError]) -> tuple[str, int]:
    """(buffer name, byte offset) from a guarded call's OSError, checked."""
    assert exc.value.errno == errno.EFAULT
    assert _accel.is_memory_fault(exc.value)
    assert str(exc.value.strerror).startswith(_accel.MEMORY_FAULT)
    match = FAULT_RE.match(str(exc.value.strerror))
    assert match is not None, exc.value.strerror
    return match.group(2), int(match.group(1))


# The calls under test, by name: each touches the truncated mapping it is
# given, and the error must name the buffer given here.
OPS: dict[str, tuple[str, Callable[[mmap.mmap], object]]] = {
    "checksum": ("buf", lambda m: _accel.checksum(m)),
    "copy_into dst": ("dst", lambda m: _accel.copy_into(m, bytes(len(m)))),
    "copy_into src": ("src", lambda m: _accel.copy_into(bytearray(len(m)), m)),
    "gather dst": ("dst", lambda m: _accel.gather(m, [bytes(10), bytes(len(m) - 10)])),
    "gather piece": ("pieces[1]", lambda m: _accel.gather(bytearray(len(m) + 10), [b"0" * 10, m])),
    "scatter src": ("src", lambda m: _accel.scatter(m, [bytearray(10), bytearray(len(m) - 10)])),
    "scatter piece": ("pieces[1]", lambda m: _accel.scatter(bytes(len(m) + 10), [bytearray(10), m])),
    "prefault": ("buf", lambda m: _accel.prefault(m)),
    "scatter_hash src": ("srcs[1]", lambda m: _accel.scatter_hash(
        [b"ab", m], [[bytearray(2)], [bytearray(10), bytearray(len(m) - 10)]])),
    "scatter_hash tail": ("srcs[0]", lambda m: _accel.scatter_hash([m], [[bytearray(10)]])),
    "scatter_hash piece": ("pieces[1][1]", lambda m: _accel.scatter_hash(
        [b"ab", bytes(len(m) + 10)], [[bytearray(2)], [bytearray(10), m]])),
    "scatter_hash_at src": ("srcs[1]", lambda m: _accel.scatter_hash_at(
        [b"ab", m], [bytearray(2), bytearray(len(m))], [0, 0], len(m))),
    "scatter_hash_at base": ("bases[1]", lambda m: _accel.scatter_hash_at(
        [b"ab", bytes(len(m) - 10)], [bytearray(2), m], [0, 10], len(m))),
}


@pytest.mark.parametrize("size", [4 * PAGE, 512 << 10])  # GIL held; GIL released
@pytest.mark.parametrize("op", sorted(OPS))
def test_fault_in_a_guarded_call_raises_efault_naming_buffer_and_byte(
    truncated: MakeMap, op: str, size: int
) -> None:
    m = truncated(size, PAGE)
    with pytest.raises(OSError) as exc:
        OPS[op][1](m)
    name, offset = fault_of(exc)
    assert name == OPS[op][0]
    # The byte named is in a page that is gone, not in the one still there.
    assert PAGE <= offset < size
    # Every buffer was released: an mmap with a live export cannot close.
    m.close()


@pytest.mark.parametrize("op", sorted(OPS))
def test_process_keeps_working_after_a_caught_fault(truncated: MakeMap, op: str) -> None:
    m = truncated(8 * PAGE, 0)
    for _ in range(3):
        with pytest.raises(OSError):
            OPS[op][1](m)
    data = np.random.default_rng(1).integers(0, 256, 8 * PAGE, dtype=np.uint8).tobytes()
    dst = bytearray(len(data))
    assert _accel.copy_into(dst, data) == len(data) and dst == data
    assert _accel.checksum(data) == xxhash.xxh3_64_intdigest(data)
    pieces = [bytearray(100), bytearray(len(data) - 100)]
    assert _accel.scatter(data, pieces) == len(data)
    out = bytearray(len(data))
    assert _accel.gather(out, pieces) == len(data) and out == data
    fresh = mmap.mmap(-1, len(data))
    assert _accel.prefault(fresh) == 8
    fresh.close()


def test_the_pages_still_there_stay_readable(truncated: MakeMap) -> None:
    m = truncated(4 * PAGE, 2 * PAGE)
    with pytest.raises(OSError):
        _accel.checksum(m)
    with memoryview(m) as view:
        assert _accel.checksum(view[: 2 * PAGE]) == xxhash.xxh3_64_intdigest(b"\x5a" * 2 * PAGE)


@pytest.mark.parametrize("size", [4 * PAGE, 6 * MIB])  # one thread; threads asked for
def test_fault_in_overlapping_views_raises_efault(truncated: MakeMap, size: int) -> None:
    # Views of one buffer take the memmove paths; the error names whichever
    # of the buffers holds the address that faulted.
    from kvtier import _native

    m = truncated(size, 0)
    with memoryview(m) as view:
        calls: list[tuple[set[str], Callable[[], object]]] = [
            ({"dst", "src"}, lambda: _native.copy(view[1:], view[:-1], 4)),
            ({"dst", "pieces[0]"},
             lambda: _native.gather(view[: size // 2], [view[size // 4 : 3 * size // 4]], 4)),
            ({"src", "pieces[0]"},
             lambda: _native.scatter(view[: size // 2], [view[size // 4 : 3 * size // 4]], 4)),
        ]
        for names, call in calls:
            with pytest.raises(OSError) as exc:
                call()
            assert fault_of(exc)[0] in names
    m.close()


THREADED_OPS: dict[str, Callable[[Any, mmap.mmap], object]] = {
    "copy dst": lambda n, m: n.copy(m, bytes(len(m)), 4),
    "copy src": lambda n, m: n.copy(bytearray(len(m)), m, 4),
    "gather dst": lambda n, m: n.gather(m, [bytes(len(m) // 2)] * 2, 4),
    "gather piece": lambda n, m: n.gather(bytearray(len(m) + 1), [b"x", m], 4),
    "scatter src": lambda n, m: n.scatter(m, [bytearray(len(m) // 2) for _ in range(2)], 4),
    "scatter piece": lambda n, m: n.scatter(bytes(len(m) + 1), [bytearray(1), m], 4),
    "prefault": lambda n, m: n.prefault(m, 4),
    # Two sources, so two threads: the other one's copy must not hang or hide the fault.
    "scatter_hash src": lambda n, m: n.scatter_hash(
        [bytes(4 * MIB), m], [[bytearray(4 * MIB)], [bytearray(len(m))]], 4),
    "scatter_hash piece": lambda n, m: n.scatter_hash(
        [bytes(4 * MIB), bytes(len(m))], [[bytearray(4 * MIB)], [m]], 4),
}


@pytest.mark.parametrize("keep", [14 * MIB, 0])  # the last of 4 chunks; all of them
@pytest.mark.parametrize("op", sorted(THREADED_OPS))
def test_threaded_call_with_pages_gone_raises_and_does_not_hang(
    truncated: MakeMap, op: str, keep: int
) -> None:
    from kvtier import _native

    m = truncated(16 * MIB, keep)
    outcome: list[BaseException | object] = []

    def call() -> None:
        try:
            outcome.append(THREADED_OPS[op](_native, m))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "the call hung after a fault"
    [exc] = outcome
    assert isinstance(exc, OSError) and exc.errno == errno.EFAULT, exc
    match = FAULT_RE.match(str(exc.strerror))
    assert match is not None, exc.strerror
    assert keep <= int(match.group(1)) < 16 * MIB
    m.close()


def test_faults_in_many_threads_at_once_are_each_caught(truncated: MakeMap) -> None:
    m = truncated(256 << 10, 0)  # 64 KiB or more: checksum releases the GIL

    def hammer(_: int) -> int:
        caught = 0
        for _ in range(50):
            try:
                _accel.checksum(m)
            except OSError as exc:
                caught += exc.errno == errno.EFAULT
        return caught

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(hammer, range(4))) == [50] * 4


def test_system_calls_on_gone_pages_fail_with_efault_too(
    truncated: MakeMap, tmp_path: Any
) -> None:
    m = truncated(4 * PAGE, 0)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * 4 * PAGE)
        for call in (_accel.pread_full, _accel.pwrite_full):
            with pytest.raises(OSError) as exc:
                call(fd, m, 0)
            assert exc.value.errno == errno.EFAULT
            assert _accel.is_memory_fault(exc.value)
    finally:
        os.close(fd)


def test_is_memory_fault_is_only_true_for_efault() -> None:
    assert _accel.is_memory_fault(OSError(errno.EFAULT, "Bad address"))
    assert not _accel.is_memory_fault(OSError(errno.ENOENT, "No such file"))
    assert not _accel.is_memory_fault(ValueError("memory fault (SIGBUS)"))


def test_install_fault_guard_is_idempotent() -> None:
    from kvtier import _native

    assert _native.install_fault_guard() is False  # the fixture installed it
    assert _native.fault_guard_installed() is True
    assert _accel.install_fault_guard() is True


def test_fallback_cannot_guard_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_FORCE_PY", "1")
    try:
        mod = importlib.reload(_accel)
        assert not mod.NATIVE
        assert mod.install_fault_guard() is False
    finally:
        monkeypatch.undo()
        importlib.reload(_accel)
    assert _accel.NATIVE


# ------------------------------------------------------------ in subprocesses

# A child's prelude: m is a 16-page mapping of a /dev/shm file truncated to 0.
PRELUDE = """\
import errno, faulthandler, mmap, os, signal, sys, tempfile
import numpy as np
from kvtier import _native
fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="kvt-fault-")
os.unlink(path)
os.ftruncate(fd, 16 * 4096)
m = mmap.mmap(fd, 16 * 4096)
os.ftruncate(fd, 0)

def guarded_call_raises():
    try:
        _native.checksum(m)
    except OSError as exc:
        assert exc.errno == errno.EFAULT, exc
        print("caught", flush=True)
    else:
        raise AssertionError("no fault")
"""


def no_core_dump() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_child(body: str) -> subprocess.CompletedProcess[str]:
    """Run PRELUDE + body in a fresh interpreter without faulthandler or core dumps."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        preexec_fn=no_core_dump,
    )


def test_without_the_guard_a_fault_kills_the_process_with_sigbus() -> None:
    proc = run_child("""
        _native.checksum(m)
        print("survived")
    """)
    assert proc.returncode == -signal.SIGBUS, proc.stdout + proc.stderr
    assert "survived" not in proc.stdout


def test_with_the_guard_a_fault_outside_guarded_calls_still_kills() -> None:
    proc = run_child("""
        assert _native.install_fault_guard()
        guarded_call_raises()
        print(int(np.frombuffer(m, dtype=np.uint8).sum()))  # numpy: not guarded
        print("survived")
    """)
    assert proc.returncode == -signal.SIGBUS, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["caught"]


def test_faulthandler_enabled_first_still_reports_an_unguarded_sigbus() -> None:
    proc = run_child("""
        faulthandler.enable()
        _native.install_fault_guard()
        guarded_call_raises()  # ours runs first, and does not involve faulthandler
        np.frombuffer(m, dtype=np.uint8).sum()
    """)
    assert proc.returncode == -signal.SIGBUS, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["caught"]
    assert "Fatal Python error: Bus error" in proc.stderr
    assert proc.stderr.count("Fatal Python error") == 1


def test_a_sigbus_sent_by_kill_is_not_taken_for_a_fault() -> None:
    proc = run_child("""
        _native.install_fault_guard()
        guarded_call_raises()
        os.kill(os.getpid(), signal.SIGBUS)
        print("survived")
    """)
    assert proc.returncode == -signal.SIGBUS, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["caught"]


def test_the_guard_leaves_sigsegv_alone() -> None:
    proc = run_child("""
        import ctypes
        _native.install_fault_guard()
        ctypes.c_char.from_address(8).value  # a NULL-page read: SIGSEGV
        print("survived")
    """)
    assert proc.returncode == -signal.SIGSEGV, proc.stdout + proc.stderr
