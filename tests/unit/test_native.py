"""kvtier._accel (copy_into, prefault) against both implementations.

Every test taking the ``accel`` fixture runs twice: on the C extension
``kvtier._native`` and on the numpy fallback (``KVTIER_FORCE_PY=1``), so both
keep one contract, one set of exceptions and one set of messages.
"""

from __future__ import annotations

import importlib
import importlib.util
import mmap
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import kvtier
from kvtier import _accel

PAGE = 4096
MIB = 1 << 20
# Above the 4 MiB threshold of csrc/native.c, so the threaded paths run,
# and not a multiple of the page size, so the last chunk is a partial one.
BIG = 5 * MIB + 3

HAVE_NATIVE = importlib.util.find_spec("kvtier._native") is not None
NOT_BUILT = "kvtier._native is not built (run: python setup.py build_ext --inplace)"
needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason=NOT_BUILT)


@pytest.fixture(params=["native", "python"])
def accel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """kvtier._accel reloaded to use the implementation named by the param."""
    native = request.param == "native"
    if native:
        if not HAVE_NATIVE:
            pytest.skip(NOT_BUILT)
        monkeypatch.delenv("KVTIER_FORCE_PY", raising=False)
    else:
        monkeypatch.setenv("KVTIER_FORCE_PY", "1")
    mod = importlib.reload(_accel)
    assert mod.NATIVE is native
    yield mod
    monkeypatch.undo()
    importlib.reload(_accel)


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def make_mmap(n: int) -> mmap.mmap:
    m = mmap.mmap(-1, n)
    m[:] = b"\xaa" * n
    return m


def make_bytearray(n: int) -> bytearray:
    return bytearray(b"\xaa" * n)


def make_numpy(n: int) -> np.ndarray[Any, Any]:
    return np.full(n, 0xAA, dtype=np.uint8)


DESTINATIONS: dict[str, Callable[[int], Any]] = {
    "mmap": make_mmap,
    "bytearray": make_bytearray,
    "numpy": make_numpy,
}

# ------------------------------------------------------------------ copy_into


@pytest.mark.parametrize("size", [0, 1, PAGE - 1, PAGE, BIG])
@pytest.mark.parametrize("kind", sorted(DESTINATIONS))
def test_copy_into_is_byte_exact_and_leaves_the_rest_of_dst_alone(
    accel: ModuleType, kind: str, size: int
) -> None:
    src = random_bytes(size)
    dst = DESTINATIONS[kind](size + 7)
    assert accel.copy_into(dst, src) == size
    got = bytes(memoryview(dst))
    assert got[:size] == src
    assert got[size:] == b"\xaa" * 7


def test_copy_into_counts_bytes_of_multibyte_items(accel: ModuleType) -> None:
    src = np.arange(BIG // 4 * 3, dtype=np.float32).reshape(3, -1)
    dst = np.zeros(src.shape, dtype=np.float32)
    assert accel.copy_into(dst, src) == src.nbytes
    assert np.array_equal(dst, src)


def test_copy_into_from_a_memoryview_slice(accel: ModuleType) -> None:
    data = random_bytes(BIG + 100)
    dst = bytearray(BIG)
    assert accel.copy_into(dst, memoryview(data)[100:]) == BIG
    assert dst == data[100:]


@pytest.mark.parametrize("shift", [1, -1])
def test_copy_into_overlapping_views_acts_like_memmove(accel: ModuleType, shift: int) -> None:
    data = random_bytes(BIG + 1)
    buf = bytearray(data)
    mv = memoryview(buf)
    if shift > 0:
        assert accel.copy_into(mv[1:], mv[:-1]) == BIG
        assert buf == data[:1] + data[:-1]
    else:
        assert accel.copy_into(mv[:-1], mv[1:]) == BIG
        assert buf == data[1:] + data[-1:]


def test_copy_into_too_small_dst_raises_exact_message(accel: ModuleType) -> None:
    dst = bytearray(b"x" * 10)
    with pytest.raises(ValueError, match=r"^dst holds 10 bytes, src has 20$"):
        accel.copy_into(dst, bytes(20))
    assert dst == b"x" * 10


def test_copy_into_non_contiguous_dst_raises(accel: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^dst is not C-contiguous$"):
        accel.copy_into(np.zeros((4, 8), dtype=np.uint8)[:, ::2], bytes(4))
    with pytest.raises(ValueError, match=r"^dst is not C-contiguous$"):
        accel.copy_into(np.zeros((4, 8), dtype=np.uint8, order="F"), bytes(4))


def test_copy_into_non_contiguous_src_raises(accel: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^src is not C-contiguous$"):
        accel.copy_into(bytearray(16), memoryview(bytes(16))[::2])


def test_copy_into_read_only_dst_raises(accel: ModuleType) -> None:
    with pytest.raises(TypeError, match=r"^dst is read-only$"):
        accel.copy_into(bytes(16), bytes(4))


def test_copy_into_non_buffer_raises_type_error(accel: ModuleType) -> None:
    with pytest.raises(TypeError):
        accel.copy_into(bytearray(16), 5)
    with pytest.raises(TypeError):
        accel.copy_into("not a buffer", bytes(4))


def test_copy_into_releases_buffers_on_success_and_error(accel: ModuleType) -> None:
    # A leaked export would make mmap.close() raise BufferError.
    m = make_mmap(10)
    accel.copy_into(m, bytes(10))
    with pytest.raises(ValueError) as raised:
        accel.copy_into(m, bytes(20))
    m.close()  # while the traceback is still alive
    assert raised.value is not None


def test_copy_into_from_many_threads_at_once(accel: ModuleType) -> None:
    srcs = [random_bytes(BIG, seed=i) for i in range(4)]
    dsts = [bytearray(BIG) for _ in srcs]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(accel.copy_into, dsts, srcs)) == [BIG] * 4
    assert dsts == srcs


@needs_native
@pytest.mark.parametrize("threads", [0, 1, 2, 3, 7, 64, 1000])
@pytest.mark.parametrize("size", [BIG, 9 * MIB + PAGE + 5])
def test_native_copy_any_thread_count_is_byte_exact(threads: int, size: int) -> None:
    from kvtier import _native

    src = random_bytes(size)
    dst = make_mmap(size + 1)
    assert _native.copy(dst, src, threads=threads) == size
    assert dst[:size] == src
    assert dst[size:] == b"\xaa"


@needs_native
def test_native_negative_threads_raise() -> None:
    from kvtier import _native

    with pytest.raises(ValueError, match=r"^threads must be >= 0, got -1$"):
        _native.copy(bytearray(4), bytes(4), threads=-1)
    with pytest.raises(ValueError, match=r"^threads must be >= 0, got -2$"):
        _native.prefault(bytearray(4), -2)


# ------------------------------------------------------------------- prefault


def test_prefault_keeps_content_and_counts_pages(accel: ModuleType) -> None:
    size = 3 * PAGE + 100
    data = random_bytes(size)
    m = mmap.mmap(-1, size)
    m[:] = data
    assert accel.prefault(m) == 4
    assert m[:] == data
    m.close()


@pytest.mark.parametrize("threads_path_size", [8 * MIB + 5, 33 * MIB])
def test_prefault_of_big_buffer_keeps_content(accel: ModuleType, threads_path_size: int) -> None:
    data = random_bytes(threads_path_size)
    buf = bytearray(data)
    pages = accel.prefault(buf)
    # bytearray storage need not be page aligned: it may overlap one more page.
    assert pages in (-(-threads_path_size // PAGE), -(-threads_path_size // PAGE) + 1)
    assert buf == data


@pytest.mark.parametrize(
    ("start", "stop", "pages"),
    [(0, 0, 0), (0, 1, 1), (PAGE, 2 * PAGE, 1), (100, 100 + PAGE, 2), (PAGE - 1, PAGE + 1, 2)],
)
def test_prefault_counts_every_page_an_unaligned_view_overlaps(
    accel: ModuleType, start: int, stop: int, pages: int
) -> None:
    m = mmap.mmap(-1, 4 * PAGE)  # mmap memory is page aligned
    data = random_bytes(4 * PAGE)
    m[:] = data
    assert accel.prefault(memoryview(m)[start:stop]) == pages
    assert m[:] == data
    m.close()


@pytest.mark.skipif(sys.platform != "linux", reason="counts Linux minor page faults")
def test_prefault_makes_later_writes_fault_free(accel: ModuleType) -> None:
    # The point of prefault: after it, writing the buffer takes no page faults.
    # (This also catches a no-op fallback: numpy skips ``a[s] = a[s]``.)
    pages = 1024
    m = mmap.mmap(-1, pages * PAGE)  # fresh shared memory, like a /dev/shm segment
    v = np.frombuffer(m, dtype=np.uint8)
    assert accel.prefault(m) == pages
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    v[::PAGE] = 1
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < pages // 10, f"{faults} faults writing {pages} prefaulted pages"
    del v
    m.close()


def test_prefault_read_only_buffer_raises(accel: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"^buf is read-only$"):
        accel.prefault(bytes(PAGE))
    frozen = np.zeros(PAGE, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match=r"^buf is read-only$"):
        accel.prefault(frozen)
    path = tmp_path / "ro"
    path.write_bytes(b"x" * PAGE)
    with (
        path.open("rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m,
        pytest.raises(TypeError, match=r"^buf is read-only$"),
    ):
        accel.prefault(m)


def test_prefault_non_contiguous_buffer_raises(accel: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^buf is not C-contiguous$"):
        accel.prefault(np.zeros((4, 8), dtype=np.uint8)[:, ::2])


def test_prefault_releases_buffer(accel: ModuleType) -> None:
    m = make_mmap(PAGE)
    assert accel.prefault(m) == 1
    m.close()


# ----------------------------------------------------------------------- stub


@needs_native
def test_native_stub_matches_module(tmp_path: Path) -> None:
    pytest.importorskip("mypy.stubtest", reason="mypy is not installed (pip install -e .[dev])")
    # Both the runtime import and mypy's stub lookup must find the package
    # under the name kvtier, whatever directory (client/) it lives in.
    (tmp_path / "kvtier").symlink_to(Path(next(iter(kvtier.__path__))).resolve())
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "MYPYPATH": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kvtier._native"],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("dst_off", "src_off", "size"),
                         [(0, 0, 256 << 10), (3, 5, (256 << 10) + 63), (15, 1, (1 << 20) + 17),
                          (1, 0, (5 << 20) + 3)])
def test_streaming_copy_at_odd_alignments_is_byte_exact(
        dst_off: int, src_off: int, size: int, threads: int) -> None:
    """Copies >= 256 KiB take the non-temporal-store path: head, 64-byte body, tail."""
    native = pytest.importorskip("kvtier._native", reason="the C extension is not built")
    src = np.frombuffer(random_bytes(size + src_off, seed=size), dtype=np.uint8)[src_off:]
    dst = make_mmap(size + dst_off + 64)
    dst[:] = b"\xee" * len(dst)
    view = np.frombuffer(dst, dtype=np.uint8)
    assert native.copy(view[dst_off : dst_off + size], src, threads) == size
    assert bytes(view[dst_off : dst_off + size]) == src.tobytes()
    assert bytes(view[:dst_off]) == b"\xee" * dst_off
    assert bytes(view[dst_off + size :]) == b"\xee" * 64
    del view
    dst.close()
