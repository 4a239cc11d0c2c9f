"""kvtier.jax against a real kvtierd: byte-exact round trips, partial hits, errors, zero copy.

One daemon serves the whole module (starting one per test would dominate
the run time); every test works in a namespace of its own.  Caches are tiny
(2 layers, 12 pages) because jit compiles per shape on a 2-core machine.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvtier
from tests.conftest import DaemonProc, temp_daemon

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kvtier.jax as kj  # noqa: E402
from kvtier.paged import GeometryMismatch, PagedKVLayout, dtype_of  # noqa: E402

LAYERS, PAGES, PAGE_TOKENS, KV_HEADS, HEAD_DIM = 2, 12, 16, 2, 64
DTYPES = ["float32", "bfloat16", "float16", "int8"]
LAYOUTS = ["kv", "fused", "single"]


@pytest.fixture(scope="module")
def shared_daemon() -> Iterator[DaemonProc]:
    with temp_daemon(capacity="64MiB", extent="2MiB") as d:
        yield d


def make_cache(layout: str, dtype: str, seed: int, pages: int = PAGES) -> list[Any]:
    """Random bytes (NaN and denormal patterns included) viewed as ``dtype``."""
    rng = np.random.default_rng(seed)
    dt = dtype_of(dtype)
    heads = 2 * KV_HEADS if layout == "fused" else KV_HEADS

    def array() -> jax.Array:
        raw = rng.integers(0, 256, (pages, PAGE_TOKENS, heads, HEAD_DIM * dt.itemsize), np.uint8)
        return jnp.asarray(raw.view(dt))

    if layout == "kv":
        return [(array(), array()) for _ in range(LAYERS)]
    return [array() for _ in range(LAYERS)]


def layout_for(cache: list[Any], layout: str) -> PagedKVLayout:
    return kj.fused_layout_of(cache) if layout == "fused" else kj.layout_of(cache)


def host_bytes(cache: list[Any]) -> list[np.ndarray]:
    """Copies of the cache's arrays as uint8, in storage order."""
    flat = [a for layer in cache for a in (layer if isinstance(layer, tuple) else (layer,))]
    return [np.array(a).view(np.uint8) for a in flat]


def client_for(d: DaemonProc, lay: PagedKVLayout, **kw: Any) -> kvtier.Client:
    args = kj.namespace_for(lay, f"test-{uuid.uuid4().hex[:8]}")
    args.update(kw)  # type: ignore[typeddict-item]
    return kvtier.Client(d.socket_dir, **args)


def keys_for(n: int) -> list[bytes]:
    tag = uuid.uuid4().hex[:8]
    return [f"{tag}-{i}".encode() for i in range(n)]


def pointers(cache: list[Any]) -> list[int]:
    flat = [a for layer in cache for a in (layer if isinstance(layer, tuple) else (layer,))]
    return [a.unsafe_buffer_pointer() for a in flat]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_byte_exact(shared_daemon: DaemonProc, layout: str, dtype: str) -> None:
    src = make_cache(layout, dtype, seed=1)
    dst = make_cache(layout, dtype, seed=2)
    lay = layout_for(src, layout)
    assert (lay.layout, lay.dtype) == (layout, dtype)
    src_ids, dst_ids = [1, 4, 7, 9, 10], [0, 2, 3, 5, 11]
    keys = keys_for(5)
    want_src, before = host_bytes(src), host_bytes(dst)
    with client_for(shared_daemon, lay) as c:
        assert kj.save(c, src, src_ids, keys, layout=lay) == 5
        assert kj.save(c, src, src_ids, keys, layout=lay) == 0  # all present: skipped
        ptrs = pointers(dst)
        out, n = kj.load(c, keys, dst, dst_ids, layout=lay)
    assert n == 5
    assert pointers(out) == ptrs  # donated: updated in place, no copy of the cache
    got = host_bytes(out)
    for j, arr in enumerate(got):
        for s, t in zip(src_ids, dst_ids, strict=True):
            assert np.array_equal(arr[t], want_src[j][s]), (j, s, t)
        rest = [p for p in range(PAGES) if p not in dst_ids]
        assert np.array_equal(arr[rest], before[j][rest])
    if layout == "kv":
        assert all(isinstance(layer, tuple) and len(layer) == 2 for layer in out)


def test_partial_hit_loads_only_the_prefix(shared_daemon: DaemonProc) -> None:
    src = make_cache("kv", "bfloat16", seed=3)
    dst = make_cache("kv", "bfloat16", seed=4)
    lay = kj.layout_of(src)
    keys = keys_for(5)
    want, before = host_bytes(src), host_bytes(dst)
    with client_for(shared_daemon, lay) as c:
        assert kj.save(c, src, [0, 1, 2], keys[:3]) == 3
        out, n = kj.load(c, keys, dst, [6, 7, 8, 9, 10])
        assert n == 3
        c._reap_release()  # load sends its Release without waiting for the answer
        assert int(c.stats()["leases"]) == 0  # released once the pages were copied
    got = host_bytes(out)
    for j in range(len(got)):
        assert np.array_equal(got[j][6:9], want[j][0:3])
        assert np.array_equal(got[j][9:], before[j][9:])
        assert np.array_equal(got[j][:6], before[j][:6])


def test_nothing_stored_returns_the_cache_unchanged(shared_daemon: DaemonProc) -> None:
    cache = make_cache("single", "float32", seed=5)
    with client_for(shared_daemon, kj.layout_of(cache)) as c:
        out, n = kj.load(c, keys_for(3), cache, [0, 1, 2])
        assert n == 0 and all(a is b for a, b in zip(out, cache, strict=True))
        out, n = kj.load(c, [], cache, [])
        assert n == 0
        assert kj.save(c, cache, [], []) == 0


def test_save_skips_present_keys_and_keeps_their_blocks(shared_daemon: DaemonProc) -> None:
    first = make_cache("kv", "float16", seed=6)
    second = make_cache("kv", "float16", seed=7)
    lay = kj.layout_of(first)
    keys = keys_for(4)
    with client_for(shared_daemon, lay) as c:
        assert kj.save(c, first, [0, 1], keys[:2]) == 2
        assert kj.save(c, second, [0, 1, 2, 3], keys) == 2  # keys[:2] present: skipped
        out, n = kj.load(c, keys, make_cache("kv", "float16", seed=8), [4, 5, 6, 7])
    assert n == 4
    got, a, b = host_bytes(out), host_bytes(first), host_bytes(second)
    for j in range(len(got)):
        assert np.array_equal(got[j][4:6], a[j][0:2])  # the first writer's blocks stay
        assert np.array_equal(got[j][6:8], b[j][2:4])


def test_load_of_more_than_one_chunk(shared_daemon: DaemonProc) -> None:
    pages = 40
    src = make_cache("single", "int8", seed=9, pages=pages)
    dst = make_cache("single", "int8", seed=10, pages=pages)
    lay = kj.layout_of(src)
    src_ids = list(range(pages - 1, -1, -2)) + [0, 2, 4]  # 23 blocks: chunks of 16 and 7
    dst_ids = list(range(len(src_ids)))
    keys = keys_for(len(src_ids))
    want = host_bytes(src)
    with client_for(shared_daemon, lay) as c:
        assert kj.save(c, src, src_ids, keys) == len(keys)
        out, n = kj.load(c, keys, dst, np.asarray(dst_ids))
    assert n == len(keys)
    got = host_bytes(out)
    for j in range(len(got)):
        assert np.array_equal(got[j][dst_ids], want[j][src_ids])


def test_donate_false_leaves_the_old_cache_valid(shared_daemon: DaemonProc) -> None:
    src = make_cache("fused", "bfloat16", seed=11)
    dst = make_cache("fused", "bfloat16", seed=12)
    lay = kj.fused_layout_of(src)
    before = host_bytes(dst)
    keys = keys_for(2)
    with client_for(shared_daemon, lay) as c:
        kj.save(c, src, [3, 4], keys, layout=lay)
        out, n = kj.load(c, keys, dst, [0, 1], layout=lay, donate=False)
    assert n == 2
    assert all(np.array_equal(x, y) for x, y in zip(host_bytes(dst), before, strict=True))
    assert np.array_equal(host_bytes(out)[0][:2], host_bytes(src)[0][3:5])


def test_staged_path_round_trips(shared_daemon: DaemonProc,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator save path (device gather + one transfer per array), run on CPU."""
    monkeypatch.setattr(kj, "_host_views", lambda arrays: None)
    src = make_cache("kv", "bfloat16", seed=13)
    dst = make_cache("kv", "bfloat16", seed=14)
    lay = kj.layout_of(src)
    keys = keys_for(3)
    with client_for(shared_daemon, lay) as c:
        assert kj.save(c, src, [11, 0, 5], keys) == 3
        out, n = kj.load(c, keys, dst, [1, 2, 3])
    assert n == 3
    got, want = host_bytes(out), host_bytes(src)
    for j in range(len(got)):
        assert np.array_equal(got[j][1:4], want[j][[11, 0, 5]])


# ---------------------------------------------------------------- errors
def test_geometry_mismatch_names_the_quantities(shared_daemon: DaemonProc) -> None:
    cache = make_cache("kv", "bfloat16", seed=15)
    lay = kj.layout_of(cache)
    with kvtier.Client(shared_daemon.socket_dir, namespace=f"gm-{uuid.uuid4().hex[:6]}",
                       block_bytes=lay.block_bytes * 2, model_uid="m") as c:
        for call in (lambda: kj.save(c, cache, [0], keys_for(1)),
                     lambda: kj.load(c, keys_for(1), cache, [0])):
            with pytest.raises(GeometryMismatch) as exc:
                call()
            msg = str(exc.value)
            assert f"block_bytes is {lay.block_bytes * 2}" in msg
            assert ("2 layers x 2 arrays x 16 tokens x 2 heads x 64 dims x 2 bytes (bfloat16) "
                    f"= {lay.block_bytes}") in msg
            assert f"block_bytes={lay.block_bytes}" in msg
    # A cache that does not match the layout it is given: the message says what differs.
    wrong = make_cache("kv", "float16", seed=16)
    with client_for(shared_daemon, lay) as c, pytest.raises(GeometryMismatch) as exc:
        kj.save(c, wrong, [0], keys_for(1), layout=lay)
    assert "dtype float16 != bfloat16" in str(exc.value)
    fused = make_cache("fused", "bfloat16", seed=17)
    with client_for(shared_daemon, lay) as c, pytest.raises(GeometryMismatch) as exc:
        kj.save(c, fused, [0], keys_for(1), layout=lay)
    assert "layer 0 has 1 arrays" in str(exc.value)
    single = kj.layout_of(fused)  # 4 heads as "single"
    with client_for(shared_daemon, single) as c, pytest.raises(GeometryMismatch) as exc:
        kj.save(c, make_cache("single", "bfloat16", seed=18), [0], keys_for(1), layout=single)
    assert "heads 2 != 4" in str(exc.value)


def test_bad_page_ids_are_refused(shared_daemon: DaemonProc) -> None:
    cache = make_cache("single", "float32", seed=19)
    with client_for(shared_daemon, kj.layout_of(cache)) as c:
        with pytest.raises(ValueError, match=f"page id {PAGES} is out of range: the cache has "
                                             f"{PAGES} pages"):
            kj.save(c, cache, [0, PAGES], keys_for(2))
        with pytest.raises(ValueError, match="page id -1 is out of range"):
            kj.load(c, keys_for(1), cache, [-1])
        with pytest.raises(ValueError, match=r"differ in length \(2 != 1\)"):
            kj.save(c, cache, [0], keys_for(2))
        with pytest.raises(ValueError, match="page id 3 appears twice"):
            kj.load(c, keys_for(2), cache, [3, 3])
        with pytest.raises(ValueError, match="1-D sequence of ints"):
            kj.save(c, cache, [0.5], keys_for(1))
        assert int(c.stats()["reservations"]) == 0  # nothing was reserved by a refused call


def test_namespace_for_separates_geometries_of_equal_block_bytes() -> None:
    kv = kj.layout_of(make_cache("kv", "float32", seed=20, pages=2))
    fused = kj.fused_layout_of(make_cache("fused", "float32", seed=20, pages=2))
    assert kv.block_bytes == fused.block_bytes
    a, b = kj.namespace_for(kv, "m@1"), kj.namespace_for(fused, "m@1")
    assert a["namespace"] != b["namespace"] and a["model_uid"] == b["model_uid"] == "m@1"
    assert a == {"namespace": "m-1/kv-L2-p16-h2-d64-float32", "block_bytes": kv.block_bytes,
                 "model_uid": "m@1"}
    long = kj.namespace_for(kv, "org/" + "x" * 200 + "@rev")
    assert len(long["namespace"]) == 128 and long["namespace"].endswith("/kv-L2-p16-h2-d64-float32")
    assert long["model_uid"] == "org/" + "x" * 200 + "@rev"


def test_namespace_for_names_are_accepted_by_the_daemon(shared_daemon: DaemonProc) -> None:
    lay = kj.layout_of(make_cache("kv", "bfloat16", seed=20, pages=2))
    for model in ("Qwen/Qwen3-8B@2025-05 (tp=1)", "org/" + "x" * 200):
        with kvtier.Client(shared_daemon.socket_dir, **kj.namespace_for(lay, model)) as c:
            assert c.lookup([b"k"]) == 0


def test_import_kvtier_does_not_import_jax() -> None:
    code = "import sys, kvtier; assert 'jax' not in sys.modules, 'jax imported'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------- zero copy
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_slots_are_aliased_without_copy(shared_daemon: DaemonProc, dtype: str) -> None:
    """Load: a leased slot becomes a jax array over the same memory (no copy in that step)."""
    cache = make_cache("kv", dtype, seed=21)
    lay = kj.layout_of(cache)
    keys = keys_for(3)
    with client_for(shared_daemon, lay) as c:
        kj.save(c, cache, [0, 1, 2], keys)
        with c.acquire(keys) as lease:
            blocks = kj._block_arrays(lease.views, lay, cache[0][0].sharding)
            for v, b in zip(lease.views, blocks, strict=True):
                assert b.unsafe_buffer_pointer() == v.ctypes.data
                assert b.unsafe_buffer_pointer() == v.__array_interface__["data"][0]
                # the bits: unsigned ints of the dtype's width, so no float op touches them
                assert b.dtype == np.dtype(f"u{dtype_of(dtype).itemsize}")
                assert b.shape == (4, 16, 2, 64)
            assert np.array_equal(np.asarray(blocks[1][2]).view(np.uint8),
                                  host_bytes(cache)[2][1])  # layer 1's K page of page 1
            del blocks
        # Writable slots prove it the other way round: a write after the aliasing shows.
        with c.reserve(keys_for(1)) as r:
            buf = r.buffers[0]
            assert buf is not None
            buf[:] = 0
            (block,) = kj._block_arrays([buf], lay, cache[0][0].sharding)
            assert block.unsafe_buffer_pointer() == buf.ctypes.data
            buf[: lay.array_page_bytes] = 0x11
            assert np.asarray(block[0]).view(np.uint8).min() == 0x11
            del block
            r.abort()


def test_cpu_save_reads_the_jax_buffers_in_place() -> None:
    """Save: the page slices handed to the gather are views of the jax buffers (no copy)."""
    cache = make_cache("fused", "bfloat16", seed=22)
    flat = list(cache)
    views = kj._host_views(flat)
    assert views is not None
    for a, v in zip(flat, views, strict=True):
        assert v.ctypes.data == a.unsafe_buffer_pointer()
        assert v.flags.c_contiguous and v[3].flags.c_contiguous
    del views


def test_load_updates_in_place_whatever_the_cache_size() -> None:
    """The jitted update writes one page, not the whole array (donation + one update per array).

    A chain of updates or a scatter with the bitcasts fused around it makes
    XLA's CPU backend sweep the whole array on every call; that would show
    as a cost growing with the number of pages (here 256x).
    """
    block = jnp.zeros((2, PAGE_TOKENS, KV_HEADS, HEAD_DIM), jnp.uint16)

    def best_of(pages: int) -> float:
        arrays = [jnp.zeros((pages, PAGE_TOKENS, KV_HEADS, HEAD_DIM), jnp.bfloat16) + 1
                  for _ in range(2)]
        ptrs = [a.unsafe_buffer_pointer() for a in arrays]
        arrays = kj._update(arrays, block, 3, 0)  # compile
        jax.block_until_ready(arrays)
        best = float("inf")
        for _ in range(15):
            t = time.perf_counter()
            arrays = kj._update(arrays, block, 5, 0)
            jax.block_until_ready(arrays)
            best = min(best, time.perf_counter() - t)
        assert [a.unsafe_buffer_pointer() for a in arrays] == ptrs
        assert int(np.asarray(arrays[1][5]).view(np.uint16).max()) == 0  # the page was written
        return best

    small, big = best_of(16), best_of(16 * 256)  # 2 x 8 MiB: a sweep takes milliseconds
    assert big < max(10 * small, 0.001), (small, big)


def make_packed(dtype: str, seed: int, packing: int, pages: int = PAGES) -> list[jax.Array]:
    """A JAX engine's cache (tpu-inference, sglang-jax): per layer one array
    ``[pages, page_tokens, 2*kv_heads/packing, packing, head_dim]`` of random bytes."""
    rng = np.random.default_rng(seed)
    dt = dtype_of(dtype)
    shape = (pages, PAGE_TOKENS, 2 * KV_HEADS // packing, packing, HEAD_DIM * dt.itemsize)
    return [jnp.asarray(rng.integers(0, 256, shape, np.uint8).view(dt)) for _ in range(LAYERS)]


@pytest.mark.parametrize(("dtype", "packing"), [("float32", 1), ("bfloat16", 2), ("int8", 4)])
def test_packed_layout_round_trip_is_byte_exact(shared_daemon: DaemonProc, dtype: str,
                                                packing: int) -> None:
    src = make_packed(dtype, seed=31, packing=packing)
    dst = make_packed(dtype, seed=32, packing=packing)
    lay = kj.packed_layout_of(src)
    assert (lay.layout, lay.kv_heads, lay.packing, lay.dtype) == ("packed", KV_HEADS, packing,
                                                                   dtype)
    assert lay.block_bytes == LAYERS * PAGE_TOKENS * 2 * KV_HEADS * HEAD_DIM * lay.itemsize
    assert f"-k{packing}" in kj.namespace_for(lay, "m")["namespace"]
    keys = keys_for(3)
    want, before = host_bytes(src), host_bytes(dst)
    with client_for(shared_daemon, lay) as c:
        assert kj.save(c, src, [2, 5, 8], keys, layout=lay) == 3
        out, n = kj.load(c, keys, dst, [1, 6, 11], layout=lay)
    assert n == 3
    got = host_bytes(out)
    for a in range(LAYERS):
        for s_page, d_page in zip([2, 5, 8], [1, 6, 11], strict=True):
            assert np.array_equal(got[a][d_page], want[a][s_page])
        for page in set(range(PAGES)) - {1, 6, 11}:
            assert np.array_equal(got[a][page], before[a][page])


def test_packed_layout_refuses_a_cache_of_another_geometry(shared_daemon: DaemonProc) -> None:
    lay = kj.packed_layout_of(make_packed("bfloat16", seed=33, packing=2))
    other = make_packed("bfloat16", seed=34, packing=1)  # same bytes per page, other shape
    assert kj.packed_layout_of(other).block_bytes == lay.block_bytes
    with client_for(shared_daemon, lay) as c, pytest.raises(GeometryMismatch, match="packing"):
        kj.save(c, other, [0], keys_for(1), layout=lay)
    with pytest.raises(ValueError, match="one array per layer"):
        kj.packed_layout_of([(other[0], other[1])])


def test_load_leased_fills_the_lease_hits_and_ends_the_lease(shared_daemon: DaemonProc) -> None:
    src = make_packed("float32", seed=35, packing=1)
    dst = make_packed("float32", seed=36, packing=1)
    lay = kj.packed_layout_of(src)
    keys = keys_for(4)
    want, before = host_bytes(src), host_bytes(dst)
    with client_for(shared_daemon, lay) as c:
        assert kj.save(c, src, [0, 1], keys[:2], layout=lay) == 2
        lease = c.acquire(keys)  # 2 hits of 4: the pages after them keep their bytes
        assert lease.hits == 2
        out, n = kj.load_leased(c, lease, dst, [7, 3, 4, 5], layout=lay)
        assert (n, lease.done) == (2, True)
        deadline = time.monotonic() + 10  # released without waiting for the answer
        while shared_daemon.stats().leases and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shared_daemon.stats().leases == 0
    got = host_bytes(out)
    for a in range(LAYERS):
        assert np.array_equal(got[a][7], want[a][0])
        assert np.array_equal(got[a][3], want[a][1])
        for page in (4, 5):
            assert np.array_equal(got[a][page], before[a][page])


def test_stage_then_load_staged_is_byte_exact_and_the_lease_ends_at_the_stage(
        shared_daemon: DaemonProc) -> None:
    """``stage`` reads the leading stored blocks into copies of their own (no lease held
    after it: kvtierd may drop the blocks, the copies stay), touching no cache;
    ``load_staged`` writes them in place (the arrays donated), the pages after the staged
    blocks keep their bytes, every bit pattern of bfloat16 kept.  A cache of another
    geometry and short page ids are refused before anything is donated."""
    src = make_packed("bfloat16", seed=37, packing=2)
    dst = make_packed("bfloat16", seed=38, packing=2)
    lay = kj.packed_layout_of(src)
    keys = keys_for(4)
    want, before = host_bytes(src), host_bytes(dst)
    with client_for(shared_daemon, lay) as c:
        assert kj.save(c, src, [0, 1, 2], keys[:3], layout=lay) == 3
        assert len(kj.stage(c, [], layout=lay, sharding=dst[0].sharding)) == 0
        staged = kj.stage(c, [keys[0], keys[1], keys[3], keys[2]], layout=lay,
                          sharding=dst[0].sharding)
        assert len(staged) == 2  # keys[3] is not stored: the rest is a miss
        deadline = time.monotonic() + 10  # released without waiting for the answer
        while shared_daemon.stats().leases and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shared_daemon.stats().leases == 0
        assert c.delete(keys[:3]) == 3  # the staged copies are their own
    assert all(np.array_equal(a, b) for a, b in zip(host_bytes(dst), before, strict=True))
    other = make_packed("bfloat16", seed=39, packing=1)
    with pytest.raises(GeometryMismatch, match="staged blocks"):
        kj.load_staged(staged, other, [3, 4], layout=kj.packed_layout_of(other))
    with pytest.raises(ValueError, match="2 blocks are staged"):
        kj.load_staged(staged, dst, [3], layout=lay)
    assert not any(a.is_deleted() for a in dst + other)
    out, n = kj.load_staged(staged, dst, [9, 3, 4], layout=lay)
    assert n == 2 and all(a.is_deleted() for a in dst)
    got = host_bytes(out)
    for a in range(LAYERS):
        assert np.array_equal(got[a][9], want[a][0])
        assert np.array_equal(got[a][3], want[a][1])
        for page in set(range(PAGES)) - {9, 3}:
            assert np.array_equal(got[a][page], before[a][page])


def test_the_device_gather_names_its_sharding_on_a_mesh_of_explicit_axes() -> None:
    """sglang-jax's and tpu-inference's caches live on a mesh of explicit axes, where JAX
    will not guess a gather's output sharding; the accelerators' save path gathers the
    pages there (``_pages_to_host``: a device gather, then one transfer per array)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((1, 1), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    spec: Any = PartitionSpec("data", None, "tensor", None, None)
    host = np.random.default_rng(0).random((8, 4, 2, 1, 16), dtype=np.float32)
    cache = jax.device_put(host, NamedSharding(mesh, spec))
    staged = kj._pages_to_host([cache], [5, 2, 7])
    assert np.array_equal(staged[0][:3], host[[5, 2, 7]].view(np.uint8))
