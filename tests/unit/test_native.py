"""kvtier._accel (copy_into, prefault, checksum, gather, scatter, scatter_hash,
pwrite_full, pread_full) against both implementations.

Every test taking the ``accel`` fixture runs twice: on the C extension
``kvtier._native`` and on the Python fallback (``KVTIER_FORCE_PY=1``: numpy,
the xxhash package, os.pwritev/os.preadv), so both keep one contract, one set
of exceptions and one set of messages.
"""

from __future__ import annotations

import errno
import mmap
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import xxhash

import kvtier

from .conftest import HAVE_NATIVE, NOT_BUILT

PAGE = 4096
MIB = 1 << 20
# Above the 4 MiB threshold of csrc/native.c, so the threaded paths run,
# and not a multiple of the page size, so the last chunk is a partial one.
BIG = 5 * MIB + 3

needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason=NOT_BUILT)


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
    # under the name kvtier, whatever directory it is installed from.
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


# ------------------------------------------------------------------- checksum

XXH3_EMPTY = 0x2D06800538D394C2  # XXH3-64, seed 0, of b"" (xxHash's test vectors)


def test_checksum_known_answer(accel: ModuleType) -> None:
    assert accel.checksum(b"") == XXH3_EMPTY
    assert accel.checksum(bytearray()) == XXH3_EMPTY


# XXH3's code paths: 0, 1-3, 4-8, 9-16, 17-128, 129-240 and longer inputs,
# with the edges of each; 70 KiB and 1 MiB+3 are above the GIL threshold.
@pytest.mark.parametrize(
    "size", [0, 1, 3, 4, 8, 9, 15, 16, 17, 128, 129, 240, 241, 1024, 70 << 10, MIB + 3]
)
def test_checksum_equals_xxhash(accel: ModuleType, size: int) -> None:
    data = random_bytes(size, seed=size)
    want = xxhash.xxh3_64_intdigest(data)
    assert accel.checksum(data) == want
    assert accel.checksum(bytearray(data)) == want
    assert accel.checksum(np.frombuffer(data, dtype=np.uint8)) == want
    m = mmap.mmap(-1, max(size, 1))
    m[:size] = data
    assert accel.checksum(memoryview(m)[:size]) == want
    m.close()


def test_checksum_hashes_the_bytes_of_any_dtype_and_shape(accel: ModuleType) -> None:
    arr = np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000)
    assert accel.checksum(arr) == xxhash.xxh3_64_intdigest(arr.tobytes())
    scalar = np.array(1.5)  # zero-dimensional
    assert accel.checksum(scalar) == xxhash.xxh3_64_intdigest(scalar.tobytes())
    data = random_bytes(300 << 10)
    # an unaligned start, above the GIL threshold
    assert accel.checksum(memoryview(data)[3:]) == xxhash.xxh3_64_intdigest(data[3:])


@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_hash_rows_equals_seeded_xxhash_of_each_row(accel: ModuleType, rows: int) -> None:
    stride, start, stop = 128, 1, 104
    data = random_bytes(rows * stride + 5, seed=rows)
    seeds = (np.arange(rows, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(77)
    got = np.frombuffer(accel.hash_rows(data, stride, start, stop, seeds), dtype=np.uint64)
    want = [xxhash.xxh3_64_intdigest(data[i * stride + start : i * stride + stop], int(sd))
            for i, sd in enumerate(seeds)]
    assert got.tolist() == want
    # the last row may end before the row's stride does
    assert accel.hash_rows(data[: max(rows - 1, 0) * stride + stop], stride, start, stop,
                           seeds) == got.tobytes()


def test_hash_rows_refuses_what_does_not_fit(accel: ModuleType) -> None:
    seeds = np.zeros(2, dtype=np.uint64)
    with pytest.raises(ValueError, match="need stride >= 1 and 0 <= start <= stop <= stride"):
        accel.hash_rows(bytes(256), 128, 5, 129, seeds)
    with pytest.raises(ValueError, match="seeds has 3 bytes, not a multiple of 8"):
        accel.hash_rows(bytes(256), 128, 0, 128, b"abc")
    with pytest.raises(ValueError, match=r"buf has 200 bytes, 2 rows of stride 128 need 232"):
        accel.hash_rows(bytes(200), 128, 0, 104, seeds)


def test_checksum_is_unsigned_64_bit(accel: ModuleType) -> None:
    values = [accel.checksum(random_bytes(16, seed=i)) for i in range(64)]
    assert all(0 <= v < 1 << 64 for v in values)
    assert any(v >= 1 << 63 for v in values)  # the top bit does not make it negative


def test_checksum_errors(accel: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^buf is not C-contiguous$"):
        accel.checksum(np.zeros((4, 8), dtype=np.uint8)[:, ::2])
    with pytest.raises(ValueError, match=r"^buf is not C-contiguous$"):
        accel.checksum(memoryview(bytes(16))[::2])
    with pytest.raises(TypeError):
        accel.checksum(5)
    with pytest.raises(TypeError):
        accel.checksum("text is not a buffer")


def test_checksum_releases_buffer(accel: ModuleType) -> None:
    m = make_mmap(128 << 10)
    assert accel.checksum(m) == xxhash.xxh3_64_intdigest(b"\xaa" * (128 << 10))
    m.close()


def test_checksum_from_many_threads_at_once(accel: ModuleType) -> None:
    datas = [random_bytes(BIG, seed=i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(accel.checksum, datas))
    assert got == [xxhash.xxh3_64_intdigest(d) for d in datas]


# ------------------------------------------------------------ gather, scatter


def mixed_pieces(seed: int = 0) -> list[Any]:
    """Writable pieces of many kinds, dtypes and sizes, empty ones included, random content."""
    rng = np.random.default_rng(seed)
    pieces: list[Any] = [
        bytearray(rng.integers(0, 256, 1, dtype=np.uint8).tobytes()),
        bytearray(),
        rng.random((3, 5)).astype(np.float32),
        np.empty(0, dtype=np.float64),
        rng.integers(-(2**62), 2**62, 7, dtype=np.int64),
        rng.integers(0, 2**16, (2, 3, 4), dtype=np.uint16),
        np.array(2.5),  # zero-dimensional
        make_mmap(PAGE + 3),
        memoryview(bytearray(rng.integers(0, 256, 1000, dtype=np.uint8).tobytes()))[17:500],
    ]
    for n in rng.integers(0, 300, 200):
        pieces.append(bytearray(rng.integers(0, 256, int(n), dtype=np.uint8).tobytes()))
    return pieces


def flat_bytes(pieces: list[Any]) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) if memoryview(p).ndim != 1 or
                    memoryview(p).format != "B" else bytes(p) for p in pieces)


def zeros_like(pieces: list[Any]) -> list[Any]:
    return [np.zeros_like(np.asarray(memoryview(p))) for p in pieces]


def test_gather_then_scatter_round_trip_with_many_pieces(accel: ModuleType) -> None:
    pieces = mixed_pieces()
    want = b"".join(np.asarray(memoryview(p)).tobytes() for p in pieces)
    total = len(want)
    dst = make_bytearray(total + 7)
    assert accel.gather(dst, pieces) == total
    assert dst[:total] == want
    assert dst[total:] == b"\xaa" * 7
    back = zeros_like(pieces)
    assert accel.scatter(bytes(dst), back) == total
    for got, orig in zip(back, pieces, strict=True):
        assert got.tobytes() == np.asarray(memoryview(orig)).tobytes()


@pytest.mark.parametrize(
    "sizes",
    [
        [0],
        [],
        [5 * MIB + 3],  # one piece, threaded
        [MIB + 1, 0, 3 * MIB + 7, 1, 2 * MIB],  # pieces that straddle the thread chunks
        [4093] * 2000,  # many small pieces, threaded in total
    ],
)
def test_gather_scatter_sizes_across_the_threaded_path(
    accel: ModuleType, sizes: list[int]
) -> None:
    data = random_bytes(sum(sizes) + 11, seed=len(sizes))
    offs = np.cumsum([0, *sizes]).tolist()
    pieces = [data[a:b] for a, b in zip(offs, offs[1:], strict=False)]
    total = sum(sizes)
    dst = make_mmap(total + 11)
    assert accel.gather(dst, pieces) == total
    assert dst[:total] == data[:total]
    assert dst[total:] == b"\xaa" * 11
    back = [bytearray(n) for n in sizes]
    assert accel.scatter(data, back) == total  # src longer than needed: the rest ignored
    assert [bytes(b) for b in back] == pieces
    dst.close()


def test_gather_scatter_take_any_iterable(accel: ModuleType) -> None:
    parts = [b"ab", b"", b"cde"]
    dst = bytearray(8)
    assert accel.gather(dst, iter(parts)) == 5
    assert accel.gather(dst, tuple(parts)) == 5
    assert dst == b"abcde\x00\x00\x00"
    outs = (bytearray(2), bytearray(3))
    assert accel.scatter(b"vwxyz", (o for o in outs)) == 5
    assert outs == (bytearray(b"vw"), bytearray(b"xyz"))


def test_gather_scatter_with_no_pieces(accel: ModuleType) -> None:
    assert accel.gather(bytearray(), []) == 0
    assert accel.scatter(b"", []) == 0


def sequential_model(buf: bytearray, spans: list[tuple[int, int]], flat_at: int, gather: bool) -> None:
    """What the documented order means: piece after piece, each read in full, then written."""
    off = flat_at
    for start, n in spans:
        if gather:
            buf[off : off + n] = bytes(buf[start : start + n])
        else:
            buf[start : start + n] = bytes(buf[off : off + n])
        off += n


@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("scale", [1, 64 << 10])  # small, and above the 4 MiB thread threshold
def test_gather_scatter_overlapping_views_copy_in_order(
    accel: ModuleType, gather: bool, scale: int
) -> None:
    # Pieces and the flat buffer are views of one buffer: pieces overlap the
    # flat part and (for scatter, where they are written) each other.
    size = 100 * scale
    data = random_bytes(size)
    spans = [(3 * scale, 20 * scale), (10 * scale, 15 * scale), (40 * scale, 30 * scale),
             (0, 0), (45 * scale, 10 * scale)]
    flat_at = 12 * scale + 1
    total = sum(n for _, n in spans)
    want = bytearray(data)
    sequential_model(want, spans, flat_at, gather)
    buf = bytearray(data)
    mv = memoryview(buf)
    pieces = [mv[a : a + n] for a, n in spans]
    flat = mv[flat_at : flat_at + total]
    if gather:
        assert accel.gather(flat, pieces) == total
    else:
        assert accel.scatter(flat, pieces) == total
    del pieces, flat
    mv.release()
    assert buf == want


@pytest.mark.parametrize("size", [100, 3 * MIB])  # one thread; 6 MiB in all: several threads
def test_scatter_into_pieces_that_overlap_each_other_later_wins(
    accel: ModuleType, size: int
) -> None:
    src = random_bytes(2 * size, seed=size)
    buf = make_bytearray(size + size // 2)
    mv = memoryview(buf)
    pieces = [mv[:size], mv[size // 2 :]]
    assert accel.scatter(src, pieces) == 2 * size
    del pieces
    mv.release()
    assert buf == src[: size // 2] + src[size:]


@needs_native
def test_native_scatter_into_overlapping_pieces_over_threads() -> None:
    # Pieces overlap only each other (not src): a later piece's bytes win.
    from kvtier import _native

    size = 8 * MIB
    src = random_bytes(2 * size, seed=3)
    buf = bytearray(size + MIB)
    mv = memoryview(buf)
    pieces = [mv[0:size], mv[MIB : MIB + size]]
    assert _native.scatter(src, pieces, 4) == 2 * size
    assert buf[:MIB] == src[:MIB]
    assert buf[MIB:] == src[size:]


@needs_native
@pytest.mark.parametrize("threads", [0, 1, 2, 3, 7, 64, 1000])
def test_native_gather_scatter_any_thread_count_is_byte_exact(threads: int) -> None:
    from kvtier import _native

    sizes = [3 * MIB + 5, 1, 0, 6 * MIB + PAGE, 777] + [PAGE + 1] * 300
    data = random_bytes(sum(sizes), seed=threads)
    offs = np.cumsum([0, *sizes]).tolist()
    pieces = [data[a:b] for a, b in zip(offs, offs[1:], strict=False)]
    dst = make_mmap(len(data) + 1)
    assert _native.gather(dst, pieces, threads) == len(data)
    assert dst[: len(data)] == data
    assert dst[len(data) :] == b"\xaa"
    back = [make_bytearray(n) for n in sizes]
    assert _native.scatter(data, back, threads=threads) == len(data)
    assert b"".join(back) == data
    dst.close()
    with pytest.raises(ValueError, match=r"^threads must be >= 0, got -1$"):
        _native.gather(bytearray(4), [b"ab"], -1)
    with pytest.raises(ValueError, match=r"^threads must be >= 0, got -3$"):
        _native.scatter(b"ab", [bytearray(2)], threads=-3)


def test_gather_too_small_dst_raises_exact_message(accel: ModuleType) -> None:
    dst = bytearray(b"x" * 10)
    with pytest.raises(ValueError, match=r"^dst holds 10 bytes, pieces have 11$"):
        accel.gather(dst, [bytes(4), np.zeros(1, dtype=np.float32), bytes(3)])
    assert dst == b"x" * 10


def test_scatter_too_small_src_raises_exact_message(accel: ModuleType) -> None:
    outs = [bytearray(b"x" * 6), np.full(2, 7, dtype=np.int32)]
    with pytest.raises(ValueError, match=r"^src has 13 bytes, pieces need 14$"):
        accel.scatter(bytes(13), outs)
    assert outs[0] == b"x" * 6 and outs[1].tolist() == [7, 7]


def test_gather_scatter_non_contiguous_raises(accel: ModuleType) -> None:
    strided = np.zeros((4, 8), dtype=np.uint8)[:, ::2]
    with pytest.raises(ValueError, match=r"^dst is not C-contiguous$"):
        accel.gather(strided, [b"ab"])
    with pytest.raises(ValueError, match=r"^src is not C-contiguous$"):
        accel.scatter(memoryview(bytes(16))[::2], [bytearray(2)])
    with pytest.raises(ValueError, match=r"^pieces\[2\] is not C-contiguous$"):
        accel.gather(bytearray(64), [b"a", b"", memoryview(bytes(16))[::2], b"b"])
    with pytest.raises(ValueError, match=r"^pieces\[1\] is not C-contiguous$"):
        accel.scatter(bytes(64), [bytearray(2), strided])
    # dst is checked before the pieces, as the native code does
    with pytest.raises(ValueError, match=r"^dst is not C-contiguous$"):
        accel.gather(strided, [strided])


def test_gather_scatter_read_only_raises(accel: ModuleType) -> None:
    with pytest.raises(TypeError, match=r"^dst is read-only$"):
        accel.gather(bytes(16), [b"ab"])
    frozen = np.zeros(4, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match=r"^pieces\[1\] is read-only$"):
        accel.scatter(bytes(16), [bytearray(2), frozen])
    with pytest.raises(TypeError, match=r"^pieces\[0\] is read-only$"):
        accel.scatter(bytes(16), [b"ab"])
    # gather reads the pieces and scatter reads src: read-only is fine there
    assert accel.gather(bytearray(4), [frozen]) == 4
    assert accel.scatter(frozen, [bytearray(4)]) == 4


def test_gather_scatter_non_buffers_raise_type_error(accel: ModuleType) -> None:
    with pytest.raises(TypeError):
        accel.gather(bytearray(16), 5)  # pieces not iterable
    with pytest.raises(TypeError):
        accel.scatter(bytes(16), None)
    with pytest.raises(TypeError):
        accel.gather(bytearray(16), [b"ab", 5])
    with pytest.raises(TypeError):
        accel.scatter(bytes(16), [bytearray(2), "text"])
    with pytest.raises(TypeError):
        accel.gather("not a buffer", [b"ab"])


def test_gather_scatter_release_every_buffer_on_success_and_error(accel: ModuleType) -> None:
    # A leaked export would make mmap.close() raise BufferError.
    def maps() -> tuple[mmap.mmap, mmap.mmap, mmap.mmap]:
        return make_mmap(10), make_mmap(10), make_mmap(10)

    flat, a, b = make_mmap(20), make_mmap(10), make_mmap(10)
    assert accel.gather(flat, [a, b]) == 20
    assert accel.scatter(flat, [a, b]) == 20
    for m in (flat, a, b):
        m.close()
    failures: list[tuple[str, Callable[[Any, Any, Any], Any]]] = [
        ("too small", lambda f, x, y: accel.gather(f, [x, y])),
        ("too small", lambda f, x, y: accel.scatter(f, [x, y])),
        ("strided piece", lambda f, x, y: accel.gather(f, [x, y, memoryview(bytes(4))[::2]])),
        ("read-only piece", lambda f, x, y: accel.scatter(f, [x, y, b"z"])),
        ("non-buffer", lambda f, x, y: accel.gather(f, [x, y, 5])),
    ]
    for what, call in failures:
        flat, a, b = maps()
        with pytest.raises((ValueError, TypeError)) as raised:
            call(flat, a, b)
        for m in (flat, a, b):
            m.close()  # while the traceback is still alive
        assert raised.value is not None, what


def test_gather_scatter_from_many_threads_at_once(accel: ModuleType) -> None:
    srcs = [random_bytes(BIG, seed=i) for i in range(4)]
    halves = [[s[: BIG // 2], s[BIG // 2 :]] for s in srcs]
    dsts = [bytearray(BIG) for _ in srcs]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(accel.gather, dsts, halves)) == [BIG] * 4
    assert dsts == srcs
    outs = [[bytearray(BIG // 2), bytearray(BIG - BIG // 2)] for _ in srcs]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(accel.scatter, srcs, outs)) == [BIG] * 4
    assert [b"".join(o) for o in outs] == srcs


# --------------------------------------------------------------- scatter_hash


def split(data: bytes, sizes: list[int]) -> list[bytes]:
    offs = np.cumsum([0, *sizes]).tolist()
    return [data[a:b] for a, b in zip(offs, offs[1:], strict=False)]


# Per source: the sizes of its pieces, and how many bytes of it follow them.
# Sizes straddle the 16 KiB copy-and-hash chunks of csrc/native.c; the last
# case is above 4 MiB in all, so the native call runs on several threads.
SCATTER_HASH_CASES = [
    [([], 0)],
    [([], 5)],  # nothing to copy: the source is hashed all the same
    [([1, 0, 16383, 16385, 3], 0), ([0], 0), ([100 << 10], 7)],
    [([2 << 20], 0)] * 3 + [([MIB + 1, 0, MIB - 1], 4093)],
]


@pytest.mark.parametrize("case", SCATTER_HASH_CASES)
def test_scatter_hash_fills_the_pieces_and_returns_each_sources_checksum(
    accel: ModuleType, case: list[tuple[list[int], int]]
) -> None:
    srcs = [random_bytes(sum(sizes) + tail, seed=i) for i, (sizes, tail) in enumerate(case)]
    outs = [[make_bytearray(n) for n in sizes] for sizes, _ in case]
    hashes = accel.scatter_hash(srcs, outs)
    assert hashes == [xxhash.xxh3_64_intdigest(s) for s in srcs]
    assert hashes == [accel.checksum(s) for s in srcs]
    for src, (sizes, _), pieces in zip(srcs, case, outs, strict=True):
        assert [bytes(p) for p in pieces] == split(src, sizes)


@pytest.mark.parametrize("case", SCATTER_HASH_CASES)
def test_scatter_copy_fills_the_same_pieces_without_a_hash(
    accel: ModuleType, case: list[tuple[list[int], int]]
) -> None:
    """``scatter_copy`` (native: ``scatter_hash(..., hash=False)``): every piece as
    ``scatter_hash`` fills it, the source's bytes past its pieces read by nobody."""
    srcs = [random_bytes(sum(sizes) + tail, seed=i) for i, (sizes, tail) in enumerate(case)]
    outs = [[make_bytearray(n) for n in sizes] for sizes, _ in case]
    assert accel.scatter_copy(srcs, outs) is None
    for src, (sizes, _), pieces in zip(srcs, case, outs, strict=True):
        assert [bytes(p) for p in pieces] == split(src, sizes)
    with pytest.raises(ValueError, match="overlaps"):
        buf = bytearray(100)
        accel.scatter_copy([memoryview(buf)[:50]], [[memoryview(buf)[40:90]]])


def test_scatter_hash_into_block_major_pages_of_any_dtype(accel: ModuleType) -> None:
    # As kvtier.torch loads a vLLM cache: one source per block, one piece per
    # layer, each piece a page row of a strided [pages, page_bytes] view.
    layers, pages, page_bytes = 3, 5, 3000
    backing = np.zeros((pages, layers, page_bytes), dtype=np.uint8)  # block-major
    rows = [backing[:, layer, :] for layer in range(layers)]
    extra = np.zeros((pages, 2, 2), dtype=np.float64)  # a 32-byte page of another dtype
    blocks = [random_bytes(layers * page_bytes + 32, seed=10 + b) for b in range(3)]
    targets = [4, 0, 2]
    pieces = [[r[p] for r in rows] + [extra[p]] for p in targets]
    assert accel.scatter_hash(blocks, pieces) == [xxhash.xxh3_64_intdigest(b) for b in blocks]
    for block, p in zip(blocks, targets, strict=True):
        assert backing[p].tobytes() + extra[p].tobytes() == block
    assert not backing[[1, 3]].any() and not extra[[1, 3]].any()


def test_scatter_hash_of_a_scribbled_source_differs_from_its_stored_checksum(
    accel: ModuleType
) -> None:
    srcs = [bytearray(random_bytes(300 << 10, seed=i)) for i in range(3)]
    stored = [accel.checksum(s) for s in srcs]
    srcs[1][123_457] ^= 0x01
    outs = [[make_bytearray(len(s))] for s in srcs]
    got = accel.scatter_hash(srcs, outs)
    assert [g == s for g, s in zip(got, stored, strict=True)] == [True, False, True]
    assert got[1] == xxhash.xxh3_64_intdigest(bytes(srcs[1]))
    assert bytes(outs[1][0]) == bytes(srcs[1])  # copied as it is: the caller decides


def test_scatter_hash_takes_any_iterables_and_no_sources(accel: ModuleType) -> None:
    assert accel.scatter_hash([], []) == []
    assert accel.scatter_hash(iter([]), ()) == []
    outs = (bytearray(2), bytearray(3))
    got = accel.scatter_hash((s for s in [b"vwxyz", b""]), [(o for o in outs), iter([])])
    assert got == [xxhash.xxh3_64_intdigest(b"vwxyz"), xxhash.xxh3_64_intdigest(b"")]
    assert outs == (bytearray(b"vw"), bytearray(b"xyz"))


def test_scatter_hash_sources_may_share_memory(accel: ModuleType) -> None:
    data = random_bytes(50_000, seed=3)
    with memoryview(data) as view:
        srcs = [view, view[100:], view[:10]]
        outs = [[bytearray(50_000)], [bytearray(10), bytearray(20)], [bytearray(10)]]
        assert accel.scatter_hash(srcs, outs) == [
            xxhash.xxh3_64_intdigest(data), xxhash.xxh3_64_intdigest(data[100:]),
            xxhash.xxh3_64_intdigest(data[:10])]
        del srcs
    assert bytes(outs[1][1]) == data[110:130]


def test_scatter_hash_refuses_a_piece_that_overlaps_a_source_or_piece(
    accel: ModuleType
) -> None:
    buf = make_bytearray(100)
    with memoryview(buf) as view:
        cases = [
            ([view[:50]], [[view[40:60]]]),  # a piece inside its own source
            ([b"x" * 10, view[:50]], [[view[49:59]], []]),  # inside another block's source
            ([b"x" * 20, b"y" * 20], [[view[:10], view[60:70]], [view[5:15]]]),  # two pieces
            ([b"x" * 20], [[view[:10], view[:10]]]),  # one piece twice
        ]
        for srcs, pieces in cases:
            with pytest.raises(ValueError, match=r"^a piece overlaps a source or another piece$"):
                accel.scatter_hash(srcs, pieces)
        del srcs, pieces, cases
        # Adjacent is not overlapping; an empty piece overlaps nothing.
        got = accel.scatter_hash([view[:50]], [[view[50:60], view[20:20], view[60:100]]])
        assert got == [xxhash.xxh3_64_intdigest(b"\xaa" * 50)]
    assert buf == b"\xaa" * 100  # nothing was copied by a refused call


def test_scatter_hash_argument_errors(accel: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^srcs and pieces differ in length \(2 != 1\)$"):
        accel.scatter_hash([b"a", b"b"], [[bytearray(1)]])
    with pytest.raises(ValueError, match=r"^srcs\[1\] has 3 bytes, pieces\[1\] need 5$"):
        accel.scatter_hash([b"ab", b"cde"], [[bytearray(2)], [bytearray(4), bytearray(1)]])
    strided = np.zeros((4, 8), dtype=np.uint8)[:, ::2]
    with pytest.raises(ValueError, match=r"^srcs\[0\] is not C-contiguous$"):
        accel.scatter_hash([strided], [[bytearray(1)]])
    with pytest.raises(ValueError, match=r"^pieces\[1\]\[0\] is not C-contiguous$"):
        accel.scatter_hash([b"ab", bytes(64)], [[], [strided]])
    with pytest.raises(TypeError, match=r"^pieces\[0\]\[1\] is read-only$"):
        accel.scatter_hash([bytes(8)], [[bytearray(2), b"ab"]])
    for srcs, pieces in [(5, []), ([b"ab"], 5), ([b"ab"], [5]), ([b"ab"], [[5]]),
                         (["text"], [[]])]:
        with pytest.raises(TypeError):
            accel.scatter_hash(srcs, pieces)


def test_scatter_hash_releases_every_buffer_on_success_and_error(accel: ModuleType) -> None:
    src, a, b = make_mmap(20), make_mmap(10), make_mmap(10)
    assert accel.scatter_hash([src], [[a, b]]) == [xxhash.xxh3_64_intdigest(b"\xaa" * 20)]
    for m in (src, a, b):
        m.close()
    failures: list[Callable[[Any, Any, Any], Any]] = [
        lambda s, x, y: accel.scatter_hash([s], [[x, y, bytearray(1)]]),  # too small
        lambda s, x, y: accel.scatter_hash([s, s], [[x], [y, memoryview(bytes(4))[::2]]]),
        lambda s, x, y: accel.scatter_hash([s, s], [[x], [y, b"z"]]),  # read-only piece
        lambda s, x, y: accel.scatter_hash([s, s], [[x], [y, 5]]),
        lambda s, x, y: accel.scatter_hash([s, s], [[x], [x]]),  # overlap
        lambda s, x, y: accel.scatter_hash([s, s], [[x]]),  # lengths differ
    ]
    for call in failures:
        src, a, b = make_mmap(20), make_mmap(10), make_mmap(10)
        with pytest.raises((ValueError, TypeError)):
            call(src, a, b)
        for m in (src, a, b):
            m.close()  # a leaked export would raise BufferError


@pytest.mark.parametrize("hash", [True, False])
def test_scatter_hash_at_copies_each_source_to_its_offset_and_hashes_it(
    accel: ModuleType, hash: bool
) -> None:
    """One piece a source, named by its base and offset; bases repeat; sources of any
    buffer type and shape (C-contiguous), each 1..limit bytes; the rest of each base
    is left alone."""
    base_a, base_b = make_numpy(1 << 20), make_bytearray(64 << 10)
    srcs: list[Any] = [random_bytes(5000, seed=1), np.arange(1024, dtype=np.float32),
                       bytearray(random_bytes(1, seed=2)), memoryview(random_bytes(8192, 3))]
    bases: list[Any] = [base_a, base_a, base_b, base_a]
    offsets = [0, 8192, 65535, (1 << 20) - 8192]
    hashes, nbytes = accel.scatter_hash_at(srcs, bases, offsets, 8192, hash=hash)
    flat = [bytes(memoryview(src).cast("B")) for src in srcs]
    assert nbytes == [5000, 4096, 1, 8192]
    assert hashes == ([xxhash.xxh3_64_intdigest(f) for f in flat] if hash else None)
    expect_a = bytearray(b"\xaa" * (1 << 20))
    for f, off in [(flat[0], 0), (flat[1], 8192), (flat[3], (1 << 20) - 8192)]:
        expect_a[off:off + len(f)] = f
    assert base_a.tobytes() == bytes(expect_a)
    assert base_b == b"\xaa" * 65535 + flat[2]
    assert accel.scatter_hash_at([], [], [], 1, hash=hash) == ([] if hash else None, [])


def test_scatter_hash_at_argument_errors_copy_nothing(accel: ModuleType) -> None:
    base = make_bytearray(100)
    strided = np.zeros((4, 8), dtype=np.uint8)[:, ::2]
    cases: list[tuple[type[Exception], str, tuple[Any, ...]]] = [
        (ValueError, r"^srcs, bases and offsets differ in length \(2, 1, 2\)$",
         ([b"a", b"b"], [base], [0, 1], 10)),
        (ValueError, r"^srcs\[1\] is 11 bytes \(1\.\.10 allowed\)$",
         ([b"a", bytes(11)], [base, base], [0, 1], 10)),
        (ValueError, r"^srcs\[0\] is 0 bytes \(1\.\.10 allowed\)$", ([b""], [base], [0], 10)),
        (ValueError, r"^offsets\[0\] = -1 is negative$", ([b"a"], [base], [-1], 10)),
        (ValueError, r"^bases\[1\] holds 100 bytes, srcs\[1\] needs 5 at offset 96$",
         ([b"a", bytes(5)], [base, base], [0, 96], 10)),
        (ValueError, r"^srcs\[0\] is not C-contiguous$", ([strided], [base], [0], 64)),
        (ValueError, r"^bases\[0\] is not C-contiguous$", ([b"a"], [strided], [0], 64)),
        (TypeError, r"^bases\[0\] is read-only$", ([b"a"], [bytes(10)], [0], 10)),
        (ValueError, r"^a piece overlaps a source or another piece$",
         ([b"ab", b"cd"], [base, base], [10, 11], 10)),
        (TypeError, "", ([b"a"], [base], ["0"], 10)),
        (TypeError, "", ([5], [base], [0], 10)),
        (TypeError, "", ([b"a"], [base], 5, 10)),
    ]
    for exc, message, args in cases:
        with pytest.raises(exc, match=message):
            accel.scatter_hash_at(*args)
    with memoryview(base) as view:  # a source inside its own piece
        with pytest.raises(ValueError, match="overlaps"):
            accel.scatter_hash_at([view[:5]], [base], [3], 10)
    assert base == b"\xaa" * 100  # nothing was copied by a refused call
    m = make_mmap(20)
    with pytest.raises(ValueError):
        accel.scatter_hash_at([b"ab", bytes(30)], [m, m], [0, 0], 40)
    m.close()  # every buffer released: a leaked export would raise BufferError


@needs_native
@pytest.mark.parametrize("threads", [0, 1, 2, 3, 7, 64, 1000])
def test_native_scatter_hash_any_thread_count_is_byte_exact(threads: int) -> None:
    from kvtier import _native

    # 9 sources of 0..3 MiB, 14 MiB in all: one job per source at most.
    sizes = [3 * MIB + 5, 1, 0, 2 * MIB, 777, MIB + PAGE, 3 * MIB, 2 * MIB + 1, 3 * MIB - 1]
    srcs = [random_bytes(n, seed=i) for i, n in enumerate(sizes)]
    outs = [[make_bytearray(n // 3), make_bytearray(n - n // 3)] for n in sizes]
    assert _native.scatter_hash(srcs, outs, threads) == [xxhash.xxh3_64_intdigest(s) for s in srcs]
    assert [b"".join(o) for o in outs] == srcs
    with pytest.raises(ValueError, match=r"^threads must be >= 0, got -2$"):
        _native.scatter_hash([b"ab"], [[bytearray(2)]], threads=-2)


def test_scatter_hash_from_many_threads_at_once(accel: ModuleType) -> None:
    srcs = [[random_bytes(BIG, seed=i)] for i in range(4)]
    outs = [[[bytearray(BIG // 2), bytearray(BIG - BIG // 2)]] for _ in srcs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(accel.scatter_hash, srcs, outs))
    assert got == [[xxhash.xxh3_64_intdigest(s[0])] for s in srcs]
    assert [b"".join(o[0]) for o in outs] == [s[0] for s in srcs]


# ---------------------------------------------------- pwrite_full, pread_full


def aligned(n: int, fill: int = 0) -> mmap.mmap:
    """A page-aligned buffer (anonymous mmap), as O_DIRECT needs."""
    m = mmap.mmap(-1, n)
    if fill:
        m[:] = bytes([fill]) * n
    return m


def test_pwrite_pread_round_trip_on_a_normal_file(accel: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = random_bytes(BIG)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.lseek(fd, 5, os.SEEK_SET)
        # unaligned offset and length: fine on a buffered fd
        assert accel.pwrite_full(fd, data, 1001) == BIG
        assert accel.pwrite_full(fd, memoryview(data)[:3], 0) == 3
        assert accel.pwrite_full(fd, b"", 0) == 0
        assert os.lseek(fd, 0, os.SEEK_CUR) == 5  # the fd's position neither used nor moved
        assert path.read_bytes() == data[:3] + bytes(998) + data
        buf = make_bytearray(BIG)
        assert accel.pread_full(fd, buf, 1001) == BIG
        assert buf == data
        arr = np.zeros(7, dtype=np.float64)
        assert accel.pread_full(fd, arr, 1001, threads=1) == 56
        assert arr.tobytes() == data[:56]
        assert os.lseek(fd, 0, os.SEEK_CUR) == 5
    finally:
        os.close(fd)


def test_pread_short_at_end_of_file_leaves_the_rest_alone(
    accel: ModuleType, tmp_path: Path
) -> None:
    path = tmp_path / "f"
    data = random_bytes(10_000)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = make_bytearray(16_384)
        assert accel.pread_full(fd, buf, 0) == 10_000
        assert buf[:10_000] == data and buf[10_000:] == b"\xaa" * 6384
        buf = make_bytearray(100)
        assert accel.pread_full(fd, buf, 9_950) == 50
        assert buf[:50] == data[9_950:] and buf[50:] == b"\xaa" * 50
        assert accel.pread_full(fd, buf, 10_000) == 0
        assert accel.pread_full(fd, buf, 1 << 40) == 0
        assert buf[50:] == b"\xaa" * 50
    finally:
        os.close(fd)


def test_pread_short_at_end_of_file_on_the_threaded_path(
    accel: ModuleType, tmp_path: Path
) -> None:
    # 24 MiB is split into 4 chunks of 6 MiB; the file ends inside the second.
    path = tmp_path / "f"
    size = 9 * MIB + 5
    data = random_bytes(size)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = aligned(24 * MIB, fill=0xAA)
        assert accel.pread_full(fd, buf, 0) == size
        assert buf[:size] == data
        assert buf[size:] == b"\xaa" * (24 * MIB - size)
        buf.close()
    finally:
        os.close(fd)


def test_pwrite_pread_bad_fd_raise_oserror_ebadf(accel: ModuleType, tmp_path: Path) -> None:
    closed = os.open(tmp_path / "gone", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(closed)
    for fd in (-1, closed):
        with pytest.raises(OSError) as raised:
            accel.pwrite_full(fd, b"abc", 0)
        assert raised.value.errno == errno.EBADF
        assert raised.value.strerror == os.strerror(errno.EBADF)
        with pytest.raises(OSError) as raised:
            accel.pread_full(fd, bytearray(3), 0)
        assert raised.value.errno == errno.EBADF


def test_pwrite_to_read_only_fd_and_pread_from_write_only_fd_raise_ebadf(
    accel: ModuleType, tmp_path: Path
) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    m = make_mmap(PAGE)
    for flags, call in ((os.O_RDONLY, accel.pwrite_full), (os.O_WRONLY, accel.pread_full)):
        fd = os.open(path, flags)
        try:
            with pytest.raises(OSError) as raised:
                call(fd, m, 0)
            assert raised.value.errno == errno.EBADF
        finally:
            os.close(fd)
    m.close()  # the buffer was released on the error paths
    assert path.read_bytes() == b"x" * 100


def test_pwrite_pread_argument_errors(accel: ModuleType, tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(TypeError, match=r"^buf is read-only$"):
            accel.pread_full(fd, bytes(8), 0)
        with pytest.raises(ValueError, match=r"^buf is not C-contiguous$"):
            accel.pwrite_full(fd, memoryview(bytes(16))[::2], 0)
        with pytest.raises(ValueError, match=r"^buf is not C-contiguous$"):
            accel.pread_full(fd, np.zeros((4, 8), dtype=np.uint8)[:, ::2], 0)
        with pytest.raises(ValueError, match=r"^offset must be >= 0, got -1$"):
            accel.pwrite_full(fd, b"ab", -1)
        with pytest.raises(ValueError, match=r"^offset must be >= 0, got -5$"):
            accel.pread_full(fd, bytearray(2), -5)
        with pytest.raises(ValueError, match=r"^threads must be >= 0, got -1$"):
            accel.pwrite_full(fd, b"ab", 0, -1)
        with pytest.raises(ValueError, match=r"^threads must be >= 0, got -2$"):
            accel.pread_full(fd, bytearray(2), 0, threads=-2)
        with pytest.raises(TypeError):
            accel.pwrite_full(fd, "text", 0)
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)


@pytest.fixture
def direct_dir() -> Iterator[Path]:
    """A fresh directory on a disk file system (not tmpfs, which refuses O_DIRECT)."""
    path = Path(tempfile.mkdtemp(prefix="kvt-odirect-", dir="/var/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def open_direct(path: Path, flags: int) -> int:
    """os.open with O_DIRECT; skips the test only where the file system refuses O_DIRECT."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        pytest.skip("no O_DIRECT on this platform")
    try:
        return os.open(path, flags | o_direct, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip(f"{path.parent} does not support O_DIRECT")
        raise


@pytest.mark.skipif(sys.platform != "linux", reason="O_DIRECT semantics are Linux's")
@pytest.mark.parametrize("size", [PAGE, 2 * MIB, 24 * MIB])  # 24 MiB: the threaded path
def test_pwrite_pread_with_o_direct(accel: ModuleType, direct_dir: Path, size: int) -> None:
    path = direct_dir / "spill"
    data = random_bytes(size, seed=size)
    src = aligned(size)
    src[:] = data
    fd = open_direct(path, os.O_RDWR | os.O_CREAT)
    try:
        try:
            assert accel.pwrite_full(fd, src, 2 * PAGE) == size
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                pytest.skip(f"{direct_dir} refuses O_DIRECT writes")
            raise
        assert accel.pwrite_full(fd, memoryview(src)[:PAGE], 0) == PAGE
        dst = aligned(size, fill=0xAA)
        assert accel.pread_full(fd, dst, 2 * PAGE) == size
        assert dst[:] == data
        assert accel.pread_full(fd, memoryview(dst)[:PAGE], PAGE) == PAGE
        assert dst[:PAGE] == bytes(PAGE)  # the hole between the two writes
        dst.close()
    finally:
        os.close(fd)
    src.close()
    with path.open("rb") as f:
        assert f.read() == data[:PAGE] + bytes(PAGE) + data


@pytest.mark.skipif(sys.platform != "linux", reason="O_DIRECT semantics are Linux's")
@pytest.mark.parametrize("size", [PAGE + 100, 9 * MIB + 5])
def test_pread_with_o_direct_short_at_end_of_file(
    accel: ModuleType, direct_dir: Path, size: int
) -> None:
    # A file size that is not a multiple of the block size: the read that
    # reaches it ends at an unaligned position.  The device transfers whole
    # blocks, so the tail of the last block past the end of the file may be
    # written (the file system has zeros there); everything after it is left
    # alone, which needs the read clamped at the end of the file (a direct
    # read past it zero-fills the buffer to the end of the request).
    path = direct_dir / "spill"
    data = random_bytes(size)
    path.write_bytes(data)
    n = 24 * MIB if size > MIB else 3 * PAGE
    block_end = -(-size // PAGE) * PAGE
    fd = open_direct(path, os.O_RDONLY)
    try:
        buf = aligned(n, fill=0xAA)
        assert accel.pread_full(fd, buf, 0) == size
        assert buf[:size] == data
        assert buf[size:block_end] in (bytes(block_end - size), b"\xaa" * (block_end - size))
        assert buf[block_end:] == b"\xaa" * (n - block_end)
        assert accel.pread_full(fd, memoryview(buf)[:PAGE], size // PAGE * PAGE + PAGE) == 0
        buf.close()
    finally:
        os.close(fd)


@needs_native
@pytest.mark.parametrize("threads", [0, 1, 2, 3, 7, 64, 1000])
def test_native_pwrite_pread_any_thread_count(threads: int, tmp_path: Path) -> None:
    from kvtier import _native

    size = 9 * MIB + PAGE + 5
    data = random_bytes(size, seed=threads)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert _native.pwrite_full(fd, data, 7, threads) == size
        buf = make_mmap(size + 1)
        assert _native.pread_full(fd, buf, 7, threads=threads) == size
        assert buf[:size] == data
        assert buf[size:] == b"\xaa"
        buf.close()
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == bytes(7) + data


def test_pwrite_pread_release_the_gil(accel: ModuleType, tmp_path: Path) -> None:
    # Several threads doing file I/O at once still all complete correctly.
    datas = [random_bytes(BIG, seed=i) for i in range(4)]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        offs = [i * BIG for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda d, o: accel.pwrite_full(fd, d, o), datas, offs)) == [BIG] * 4
        bufs = [bytearray(BIG) for _ in datas]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda b, o: accel.pread_full(fd, b, o), bufs, offs)) == [BIG] * 4
        assert bufs == datas
    finally:
        os.close(fd)
