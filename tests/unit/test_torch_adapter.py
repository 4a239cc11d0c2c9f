"""kvtier.torch against a real kvtierd: round trips, prefixes, skips, geometry, aliasing.

The CUDA path cannot run here (CPU-only torch); its device-agnostic part (the
device-side gather / index_copy_ and the cudaHostRegister bookkeeping) runs on
CPU tensors with a fake cudart.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvtier  # noqa: E402
import kvtier.torch as kt  # noqa: E402
from tests.conftest import DaemonProc, temp_daemon  # noqa: E402

PAGES = 8
LAYERS = 2
TOKENS = 4
HEADS = 2
DIM = 8
DTYPES = ["float32", "bfloat16", "float16", "int8"]
LAYOUTS = ["kv", "fused", "single"]


@pytest.fixture(scope="module")
def kvd() -> Iterator[DaemonProc]:
    # Every test takes a namespace (an extent) of its own: small extents, room for all.
    with temp_daemon(capacity="128MiB", extent="1MiB") as d:
        yield d


def make_cache(layout: str, dtype: str, *, seed: int | None = 0, layers: int = LAYERS,
               tokens: int = TOKENS) -> list[Any]:
    """A cache of ``layout``: random bytes (seed) or zeros (seed None)."""
    heads = 2 * HEADS if layout == "fused" else HEADS
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def array() -> Any:
        t = torch.zeros((PAGES, tokens, heads, DIM), dtype=getattr(torch, dtype))
        if gen is not None:  # any bit pattern, NaNs included: the copy must be byte-exact
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
        return t

    if layout == "kv":
        return [(array(), array()) for _ in range(layers)]
    return [array() for _ in range(layers)]


def layout_for(cache: list[Any], layout: str) -> kvtier.paged.PagedKVLayout:
    return kt.fused_layout_of(cache) if layout == "fused" else kt.layout_of(cache)


def arrays(cache: list[Any]) -> list[Any]:
    return [a for layer in cache for a in (layer if isinstance(layer, tuple) else (layer,))]


def page_bytes(cache: list[Any], page: int) -> bytes:
    return b"".join(a[page].contiguous().view(torch.uint8).numpy().tobytes()
                    for a in arrays(cache))


def client_for(d: DaemonProc, lay: kvtier.paged.PagedKVLayout) -> kvtier.Client:
    model = f"test-{uuid.uuid4().hex[:8]}"  # a fresh namespace per test
    return kvtier.Client(d.socket_dir, **kt.namespace_for(lay, model))


def keys_of(n: int) -> list[bytes]:
    tag = uuid.uuid4().bytes
    return [tag + i.to_bytes(4, "big") for i in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_byte_exact(kvd: DaemonProc, layout: str, dtype: str) -> None:
    src = make_cache(layout, dtype)
    lay = layout_for(src, layout)
    keys = keys_of(3)
    with client_for(kvd, lay) as c:
        assert kt.save(c, src, [3, 1, 4], keys, layout=lay) == 3
        # The stored block is the page of every layer, layer-major, K before V.
        assert c.get(keys[:1])[0].tobytes() == page_bytes(src, 3)
        dst = make_cache(layout, dtype, seed=None)
        assert kt.load(c, keys, dst, [0, 2, 5], layout=lay) == 3
    for got, want in ((0, 3), (2, 1), (5, 4)):
        assert page_bytes(dst, got) == page_bytes(src, want)
    zero = bytes(len(page_bytes(dst, 0)))
    assert all(page_bytes(dst, p) == zero for p in (1, 3, 4, 6, 7))


def test_load_reports_the_time_of_its_parts_when_asked(kvd: DaemonProc) -> None:
    src = make_cache("kv", "bfloat16")
    lay = kt.layout_of(src)
    keys = keys_of(2)
    with client_for(kvd, lay) as c:
        assert kt.save(c, src, [0, 1], keys) == 2
        dst = make_cache("kv", "bfloat16", seed=None)
        phases: dict[str, float] = {"acquire": 1.0}
        assert kt.load(c, keys, dst, [2, 3], phases=phases) == 2
        assert set(phases) == {"acquire", "copy"}
        assert phases["acquire"] > 1.0 and phases["copy"] > 0  # added to what was there
        empty: dict[str, float] = {}
        assert kt.load(c, [], dst, [], phases=empty) == 0
        assert empty == {}  # no call, no time
    assert page_bytes(dst, 2) == page_bytes(src, 0)


def test_load_stops_at_the_first_missing_key(kvd: DaemonProc) -> None:
    src = make_cache("kv", "bfloat16")
    lay = kt.layout_of(src)
    keys = keys_of(4)
    with client_for(kvd, lay) as c:
        assert kt.save(c, src, [0, 1], keys[:2]) == 2
        dst = make_cache("kv", "bfloat16", seed=None)
        assert kt.load(c, keys, dst, torch.tensor([7, 6, 5, 4])) == 2
        assert kt.load(c, keys[2:], dst, [5, 4]) == 0
    assert page_bytes(dst, 7) == page_bytes(src, 0)
    assert page_bytes(dst, 6) == page_bytes(src, 1)
    zero = bytes(len(page_bytes(dst, 0)))
    assert page_bytes(dst, 5) == zero and page_bytes(dst, 4) == zero


def test_save_skips_present_keys_without_reading_their_pages(kvd: DaemonProc) -> None:
    src = make_cache("single", "float16")
    lay = kt.layout_of(src)
    keys = keys_of(3)
    with client_for(kvd, lay) as c:
        assert kt.save(c, src, [0, 1], keys[:2]) == 2
        before = page_bytes(src, 0)
        for a in arrays(src):
            a[0].fill_(1.5)  # a present key's page changes: it is not written again
        assert kt.save(c, src, [0, 1, 2], keys) == 1
        assert kt.save(c, src, [0, 1, 2], keys) == 0
        got = c.get(keys)
    assert [g.tobytes() for g in got] == [before, page_bytes(src, 1), page_bytes(src, 2)]


def test_empty_batches_do_nothing(kvd: DaemonProc) -> None:
    src = make_cache("single", "float32")
    with client_for(kvd, kt.layout_of(src)) as c:
        assert kt.save(c, src, [], []) == 0
        assert kt.load(c, [], src, []) == 0


def test_geometry_mismatch_names_what_differs(kvd: DaemonProc) -> None:
    src = make_cache("kv", "bfloat16")
    lay = kt.layout_of(src)
    with kvtier.Client(kvd.socket_dir, namespace=f"t/{uuid.uuid4().hex}",
                       block_bytes=lay.block_bytes * 2, model_uid="m") as c:
        with pytest.raises(kt.GeometryMismatch, match=(
                rf"namespace block_bytes is {lay.block_bytes * 2}, but this cache's page is "
                rf"2 layers x 2 arrays x 4 tokens x 2 heads x 8 dims x 2 bytes \(bfloat16\) = "
                rf"{lay.block_bytes}")):
            kt.save(c, src, [0], keys_of(1))
    with client_for(kvd, lay) as c:
        longer = make_cache("kv", "bfloat16", tokens=2 * TOKENS)
        with pytest.raises(kt.GeometryMismatch, match=r"page_tokens 8 != 4"):
            kt.load(c, keys_of(1), longer, [0], layout=lay)
        half = make_cache("kv", "float16")
        with pytest.raises(kt.GeometryMismatch, match=r"dtype float16 != bfloat16"):
            kt.save(c, half, [0], keys_of(1), layout=lay)
        with pytest.raises(kt.GeometryMismatch, match=r"the cache has 3 layers, the layout 2"):
            kt.save(c, make_cache("kv", "bfloat16", layers=3), [0], keys_of(1), layout=lay)
        with pytest.raises(kt.GeometryMismatch, match=r"layer 0 has 1 arrays, layout 'kv' has 2"):
            kt.save(c, make_cache("single", "bfloat16"), [0], keys_of(1), layout=lay)


def test_short_blocks_are_refused_before_any_copy(kvd: DaemonProc) -> None:
    src = make_cache("single", "float32")
    lay = kt.layout_of(src)
    keys = keys_of(2)
    with client_for(kvd, lay) as c:
        c.put(keys, [np.ones(lay.block_bytes, np.uint8), np.ones(16, np.uint8)])
        dst = make_cache("single", "float32", seed=None)
        with pytest.raises(kt.GeometryMismatch, match=r"block 1 holds 16 bytes"):
            kt.load(c, keys, dst, [0, 1])
    assert not any(bool(a.view(torch.uint8).any()) for a in arrays(dst))


@pytest.mark.parametrize(("ids", "message"), [
    ([0, 8], r"page id 8 is out of range: the cache has 8 pages"),
    ([-1, 0], r"page id -1 is out of range"),
    ([0], r"keys and page_ids differ in length \(2 != 1\)"),
    ([0.0, 1.0], r"page_ids must be a 1-D sequence of ints"),
    ([[0, 1]], r"page_ids must be a 1-D sequence of ints"),
])
def test_bad_page_ids(kvd: DaemonProc, ids: Any, message: str) -> None:
    src = make_cache("single", "int8")
    with client_for(kvd, kt.layout_of(src)) as c:
        with pytest.raises(ValueError, match=message):
            kt.save(c, src, ids, keys_of(2))
        with pytest.raises(ValueError, match=message):
            kt.load(c, keys_of(2), src, ids)


def test_load_refuses_a_page_twice(kvd: DaemonProc) -> None:
    src = make_cache("single", "int8")
    with client_for(kvd, kt.layout_of(src)) as c:
        assert kt.save(c, src, [1, 1], keys_of(2)) == 2  # one page under two keys is fine
        with pytest.raises(ValueError, match=r"page id 3 appears twice"):
            kt.load(c, keys_of(3), src, [3, 0, 3])


def test_slots_are_aliased_without_copying(kvd: DaemonProc) -> None:
    src = make_cache("kv", "bfloat16")
    lay = kt.layout_of(src)
    keys = keys_of(2)
    shape = (LAYERS * 2, TOKENS, HEADS, DIM)
    with client_for(kvd, lay) as c:
        with c.reserve(keys) as r:
            for i in r.reserved:
                buf = r.buffers[i]
                assert buf is not None
                t = kt.slot_tensor(buf, torch.bfloat16, shape)
                assert t.data_ptr() == buf.ctypes.data
                assert t.shape == shape and t.dtype == torch.bfloat16
                t.copy_(torch.full(shape, float(i + 1)))  # writes land in the slot itself
            r.commit()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "buffer is not writable" warning either
            with c.acquire(keys) as lease:
                for i, view in enumerate(lease.views):
                    t = kt.slot_tensor(view, torch.bfloat16, shape)
                    assert t.data_ptr() == view.ctypes.data
                    assert bool((t == float(i + 1)).all())
                del t


def test_slot_tensor_refuses_non_slot_arrays() -> None:
    with pytest.raises(ValueError, match="flat C-contiguous uint8"):
        kt.slot_tensor(np.zeros((2, 2), np.uint8))


def test_non_contiguous_and_inference_caches(kvd: DaemonProc) -> None:
    # k and v as strided views of one [pages, 2, ...] tensor per layer (not contiguous).
    whole = [torch.randn(PAGES, 2, TOKENS, HEADS, DIM) for _ in range(LAYERS)]
    src = [(w[:, 0], w[:, 1]) for w in whole]
    lay = kt.layout_of(src)
    keys = keys_of(2)
    with client_for(kvd, lay) as c:
        assert kt.save(c, src, [2, 6], keys) == 2
        with torch.inference_mode():
            wdst = [torch.zeros(PAGES, 2, TOKENS, HEADS, DIM) for _ in range(LAYERS)]
            cdst = make_cache("kv", "float32", seed=None)
        for dst in ([(w[:, 0], w[:, 1]) for w in wdst], cdst):
            assert kt.load(c, keys, dst, [1, 0]) == 2
            assert page_bytes(dst, 1) == page_bytes(src, 2)
            assert page_bytes(dst, 0) == page_bytes(src, 6)


# ------------------------------------------------ checksums: verified while copying
def checked_client(d: DaemonProc, lay: kvtier.paged.PagedKVLayout) -> kvtier.Client:
    model = f"test-{uuid.uuid4().hex[:8]}"
    return kvtier.Client(d.socket_dir, **kt.namespace_for(lay, model), checksum=True)


def strided_pages(seed: int | None) -> list[Any]:
    """A "single" cache whose pages are not contiguous: load takes per-page torch copies."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out = []
    for _ in range(LAYERS):
        t = torch.zeros(PAGES, HEADS, TOKENS, DIM)
        if gen is not None:
            t.copy_(torch.randn(t.shape, generator=gen))
        out.append(t.transpose(1, 2))
    return out


def test_load_with_checksums_hashes_while_copying_not_before(
        kvd: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier import _accel

    src = make_cache("kv", "bfloat16")
    lay = kt.layout_of(src)
    keys = keys_of(3)
    calls: list[str] = []
    for name in ("checksum", "scatter", "scatter_hash"):
        real = getattr(_accel, name)
        monkeypatch.setattr(_accel, name, lambda *a, _n=name, _f=real, **k: (
            calls.append(_n), _f(*a, **k))[1])
    with checked_client(kvd, lay) as c:
        assert kt.save(c, src, [3, 1, 4], keys) == 3
        calls.clear()
        dst = make_cache("kv", "bfloat16", seed=None)
        assert kt.load(c, keys, dst, [0, 2, 5]) == 3
        assert calls == ["scatter_hash"]  # one pass, one call for all blocks
        with c.acquire(keys):  # the lease of a plain acquire still checks by itself
            pass
        assert calls == ["scatter_hash", "checksum", "checksum", "checksum"]
    for got, want in ((0, 3), (2, 1), (5, 4)):
        assert page_bytes(dst, got) == page_bytes(src, want)


@pytest.mark.parametrize("cache", ["native", "torch copies"])
def test_load_raises_corrupted_for_a_scribbled_slot_and_drops_its_block(
        kvd: DaemonProc, cache: str) -> None:
    from kvtier import errors

    def make(seed: int | None) -> list[Any]:
        return make_cache("single", "float32", seed=seed) if cache == "native" else \
            strided_pages(seed)

    src = make(0)
    lay = kt.layout_of(src)
    assert kt.native_copies(src) is (cache == "native")
    keys = keys_of(4)
    with checked_client(kvd, lay) as c:
        with c.reserve(keys) as r:  # as kt.save, keeping a writable view of each slot
            for i in range(4):
                r.write(i, page_bytes(src, i))
            scribble = r.buffers[2]
            r.commit()
        assert scribble is not None
        scribble[100] ^= 0x10  # a buggy writer, after the commit
        dst = make(None)
        with pytest.raises(errors.Corrupted,
                           match=rf"^block {keys[2].hex()} failed its checksum$") as exc:
            kt.load(c, keys, dst, [7, 6, 5, 4])
        assert exc.value.key == keys[2]
        assert c.lookup(keys) == 2  # dropped: a miss from there on
        assert kvd.stats().leases == 0
        # What vLLM's connector does next: load again, the good prefix this time.
        dst = make(None)
        assert kt.load(c, keys, dst, [7, 6, 5, 4]) == 2
    assert page_bytes(dst, 7) == page_bytes(src, 0)
    assert page_bytes(dst, 6) == page_bytes(src, 1)
    zero = bytes(len(page_bytes(dst, 0)))
    assert page_bytes(dst, 5) == zero and page_bytes(dst, 4) == zero
    assert kvd.check() == []


def test_load_drops_every_scribbled_block_and_names_the_first(kvd: DaemonProc) -> None:
    from kvtier import errors

    src = make_cache("fused", "float16")
    lay = kt.fused_layout_of(src)
    keys = keys_of(3)
    with checked_client(kvd, lay) as c:
        with c.reserve(keys) as r:
            for i in range(3):
                r.write(i, page_bytes(src, i))
            slots = [r.buffers[0], r.buffers[2]]
            r.commit()
        for slot in slots:
            assert slot is not None
            slot[-1] ^= 0x01
        with pytest.raises(errors.Corrupted, match=rf"^block {keys[0].hex()} failed") as exc:
            kt.load(c, keys, make_cache("fused", "float16", seed=None), [0, 1, 2], layout=lay)
        assert exc.value.key == keys[0]
        assert c.lookup(keys) == 0
        assert c.lookup(keys[1:]) == 1  # the good one stays, the second bad one is gone too


# ------------------------------------------------ the staged (CUDA) path on CPU tensors
class FakeCudart:
    """cudaHostRegister / cudaHostUnregister bookkeeping, as the CUDA runtime would see it."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.live: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        assert flags == 1  # portable
        self.calls.append(("register", ptr, size))
        if self.fail:
            return self.fail
        assert all(ptr + size <= p or p + n <= ptr for p, n in self.live.items()), "overlap"
        self.live[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr, 0))
        assert ptr in self.live, "unregistering what is not registered"
        del self.live[ptr]
        return 0

    def cudaGetErrorString(self, code: int) -> str:  # noqa: N802
        return f"fake error {code}"

    def covers(self, address: int, n: int) -> bool:
        return any(p <= address and address + n <= p + s for p, s in self.live.items())


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(kt, "_cudart", lambda: fake)
    monkeypatch.setattr(kt, "_staged", lambda device: True)
    monkeypatch.setattr(kt, "_PIN_ON_CPU", True)
    return fake


@pytest.mark.parametrize("layout", LAYOUTS)
def test_staged_path_round_trip_registers_segments(kvd: DaemonProc, fake_cuda: FakeCudart,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   layout: str) -> None:
    monkeypatch.setattr(kt, "_REGISTER_CHUNK", 256 << 10)  # 1 MiB extents: 4 pieces each
    monkeypatch.setattr(kt, "_STAGE_BYTES", 1)  # one block per staging round
    src = make_cache(layout, "bfloat16")
    lay = layout_for(src, layout)
    keys = keys_of(4)
    seen: list[tuple[int, int]] = []
    real = kt._Pins.ensure

    def ensure(self: Any, address: int, nbytes: int) -> None:
        real(self, address, nbytes)
        assert fake_cuda.covers(address, nbytes), "a slot copied without being registered"
        seen.append((address, nbytes))

    monkeypatch.setattr(kt._Pins, "ensure", ensure)
    with client_for(kvd, lay) as c:
        assert kt.save(c, src, [7, 0, 3, 5], keys, layout=lay) == 4
        dst = make_cache(layout, "bfloat16", seed=None)
        assert kt.load(c, keys, dst, [1, 2, 3, 4], layout=lay) == 4
        assert len(seen) == 8
        # Whole segments, in pieces of at most 256 KiB, back to back.
        segs = [s for s in kt._PINS[c].index if s.pinned]
        assert segs
        assert sorted(fake_cuda.live) == sorted(s.base + off for s in segs
                                                for off in range(0, s.size, 256 << 10))
        assert all(size <= 256 << 10 for size in fake_cuda.live.values())
        pinned = sum(fake_cuda.live.values())
        assert pinned == sum(s.size for s in segs)
        assert kt.unpin(c) == pinned
        assert fake_cuda.live == {}
    for got, want in ((1, 7), (2, 0), (3, 3), (4, 5)):
        assert page_bytes(dst, got) == page_bytes(src, want)


def test_pin_registers_new_segments_on_first_use(kvd: DaemonProc,
                                                 fake_cuda: FakeCudart) -> None:
    # 512 KiB blocks, 1 MiB extents: one per extent, so the 15 later blocks need new ones.
    cache = [torch.zeros(24, 64, 8, 256, dtype=torch.float32)]
    for i in range(24):
        cache[0][i].fill_(float(i))
    lay = kt.layout_of(cache)
    assert lay.block_bytes == 512 << 10
    keys = keys_of(20)
    with client_for(kvd, lay) as c:
        assert kt.save(c, cache, list(range(5)), keys[:5]) == 5
        first = kt.pin(c)
        assert first == sum(fake_cuda.live.values()) > 0
        assert kt.save(c, cache, list(range(5, 20)), keys[5:]) == 15  # new extents appear
        assert sum(fake_cuda.live.values()) > first
        dst = [torch.zeros_like(cache[0])]
        assert kt.load(c, keys, dst, list(range(23, 3, -1))) == 20
        assert kt.unpin(c) > first and fake_cuda.live == {}
        assert kt.unpin(c) == 0
    for k in range(20):
        assert bool((dst[0][23 - k] == float(k)).all())


def test_refused_registration_warns_and_copies_anyway(kvd: DaemonProc, fake_cuda: FakeCudart) -> None:
    fake_cuda.fail = 2  # cudaErrorMemoryAllocation
    src = make_cache("kv", "float16")
    lay = kt.layout_of(src)
    keys = keys_of(2)
    with client_for(kvd, lay) as c:
        with pytest.warns(RuntimeWarning, match="cudaHostRegister failed: fake error 2"):
            assert kt.save(c, src, [0, 1], keys) == 2
        dst = make_cache("kv", "float16", seed=None)
        assert kt.load(c, keys, dst, [1, 0]) == 2
        assert fake_cuda.live == {}
        assert [k for k, _, _ in fake_cuda.calls] == ["register"]  # not retried
    assert page_bytes(dst, 1) == page_bytes(src, 0)


def test_registered_segments_stay_mapped_until_unpinned(kvd: DaemonProc,
                                                        fake_cuda: FakeCudart) -> None:
    src = make_cache("single", "float32")
    lay = kt.layout_of(src)
    c = client_for(kvd, lay)
    kt.save(c, src, [0], keys_of(1))
    maps = list(c._maps._maps.values())
    pinned = kt.pin(c)
    assert pinned
    c.close()  # the client cannot unmap registered segments...
    assert any(not mm.closed for mm in maps)
    assert kt.unpin(c) == pinned  # ...until they are unregistered
    assert fake_cuda.live == {}


def test_pin_needs_cuda(kvd: DaemonProc) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    src = make_cache("single", "float32")
    with client_for(kvd, kt.layout_of(src)) as c:
        with pytest.raises(RuntimeError, match="kvtier.torch.pin needs CUDA"):
            kt.pin(c)
        assert kt.unpin(c) == 0  # nothing was registered


def test_import_kvtier_does_not_import_torch_and_bf16_needs_no_ml_dtypes() -> None:
    code = (
        "import sys\n"
        "sys.modules['ml_dtypes'] = None\n"  # a torch-only install has no ml_dtypes
        "import kvtier, kvtier.paged as p\n"
        "assert 'torch' not in sys.modules\n"
        "lay = p.PagedKVLayout('kv', 2, 16, 8, 128, 'bfloat16')\n"
        "assert lay.block_bytes == 2 * 2 * 16 * 8 * 128 * 2, lay.block_bytes\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr


def test_pages_any_stride_apart_take_the_native_copy(kvd: DaemonProc) -> None:
    """vLLM views one buffer per block-major layout: a layer's pages lie other layers'
    pages apart.  Each page is contiguous, so save and load take the native gather and
    scatter (no per-page torch copies), byte-exact; a page that is not contiguous falls
    back to torch copies."""
    page = TOKENS * HEADS * DIM
    raw = torch.randn(PAGES * LAYERS * page)
    # Block-major: block b holds layer 0's page, then layer 1's.
    src = [torch.as_strided(raw, (PAGES, TOKENS, HEADS, DIM), (LAYERS * page, HEADS * DIM, DIM, 1),
                            layer * page) for layer in range(LAYERS)]
    assert not src[0].is_contiguous() and kt._host_u8(src) is not None
    assert kt._host_u8([src[0].transpose(1, 2)]) is None  # pages themselves strided
    lay = kt.layout_of(src)
    keys = keys_of(3)
    with client_for(kvd, lay) as c:
        assert kt.save(c, src, [1, 4, 7], keys) == 3
        raw2 = torch.zeros_like(raw)
        dst = [torch.as_strided(raw2, src[0].shape, src[0].stride(), layer * page)
               for layer in range(LAYERS)]
        assert kt.load(c, keys, dst, [0, 2, 5]) == 3
        for s_page, d_page in ((1, 0), (4, 2), (7, 5)):
            assert page_bytes(dst, d_page) == page_bytes(src, s_page)
        assert not any(bool(d[1].any()) for d in dst)  # the other pages untouched
