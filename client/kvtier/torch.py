"""Save and load pages of a PyTorch paged KV cache through kvtierd (``pip install kvtier[torch]``).

One block is one page of every layer (layout: :mod:`kvtier.paged`), so a
prompt prefix of ``n`` pages is ``n`` keys from ``kvtier.block_keys``.  Caches
are updated in place (torch tensors are mutable)::

    import kvtier, kvtier.torch as kt

    cache = [(k, v) for k, v in kv_tensors]  # per layer [pages, page_tokens, kv_heads, head_dim]
    layout = kt.layout_of(cache)             # kt.fused_layout_of(...) for K/V on one head axis
    with kvtier.Client(**kt.namespace_for(layout, "llama3-8b@rev1")) as client:
        kt.pin(client)                       # CUDA: page-lock the slots now (else on first use)
        keys = kvtier.block_keys(token_ids, layout.page_tokens, salt=b"tenant")
        kt.save(client, cache, page_ids, keys)           # skips keys already stored
        # ... later, in this or any other process on the host:
        n = kt.load(client, keys, cache, free_page_ids)  # pages free_page_ids[:n] filled
        kt.unpin(client)                     # before close: unregisters the slots at once

Copies per page (a page of all layers), by device and direction:

* CPU ``save``: **1** -- each block is gathered from the layers' page slices
  straight into its shared-memory slot (``_accel.gather``, GIL released).
  CPU ``load``: **1** -- each leased slot is scattered into the pages
  (``_accel.scatter``; with ``checksum=True``, ``_accel.scatter_hash``, which
  verifies each block in the same pass over its slot).  (Caches whose arrays are not contiguous take one
  ``Tensor.copy_`` per array page instead: still one copy of each byte.)
* CUDA ``save``: the wanted pages are gathered on the GPU into a staging
  buffer (``index_select`` + ``stack``: two device-local copies at HBM speed),
  then **1 DMA** per block, GPU -> slot.  CUDA ``load``: **1 DMA** per block,
  slot -> GPU staging, then one device-local ``index_copy_`` into the pages.
  The DMAs are true DMAs because the client's shared-memory segments are
  registered with ``cudaHostRegister`` (once per segment, on first use or by
  :func:`pin`).  If the driver refuses to register them, a warning says so
  and the copies run from pageable memory: the driver then stages each one
  through its own pinned buffer (one more host copy each way, synchronous).
  A segment larger than 64 GiB is registered in 64 GiB pieces.

Slots are aliased as tensors without copying (``torch.frombuffer``;
:func:`slot_tensor`).  ``save`` and ``load`` return when their copies are
done: the reservation (``save``) and the lease (``load``) are held until
then -- on CUDA the current stream is synchronized first -- so nothing is
committed before its bytes have landed and the daemon never reuses a slot
while it is read.  The copies run on the current CUDA stream.

Every copy out of or into a slot that the CPU makes runs under the client's
fault guard (``kvtier._accel``): when a writer of the namespace truncates a
data file, ``load`` stops at the first block whose memory is gone and
returns the pages before it (that block is deleted as corrupted; the caller
prefills the rest), and ``save`` raises ``FailedPrecondition`` with its
reservation aborted -- the process lives on.  So the slow paths copy through
a private block (one more host copy): caches whose arrays are not
contiguous, and device copies from pageable slots (no CUDA, or
``cudaHostRegister`` refused), which the runtime would otherwise make from
the slot itself, outside the guard.  Registered slots are read and written
by DMA, which a truncation cannot make fault (the registration holds the
pages).  With the guard off (``KVTIER_FAULT_GUARD=0``) those paths copy
straight from and into the slots, as before.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import mmap
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Final, TypeAlias

import numpy as np
import torch

from kvtier import _accel
from kvtier.client import Client
from kvtier.paged import (
    GeometryMismatch,
    NamespaceArgs,
    PagedKVLayout,
    cache_arrays,
    fused_layout_of,
    layout_of,
    namespace_for,
    valid_page_ids,
)

#: A layer: one tensor (layouts "fused", "single") or a (k, v) pair (layout "kv").
Layer: TypeAlias = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

#: Device staging per round of a CUDA save/load (blocks are moved in chunks this big).
_STAGE_BYTES: Final = 256 << 20
#: cudaHostRegister takes a segment in pieces of at most this many bytes.
_REGISTER_CHUNK = 64 << 30
#: cudaHostRegisterPortable: the pages are pinned for every CUDA context.
_REGISTER_PORTABLE: Final = 1
#: cudaErrorHostMemoryAlreadyRegistered: someone else pinned it (usable; not ours to undo).
_ALREADY_REGISTERED: Final = 712


# ---------------------------------------------------------------- API
def save(client: Client, cache: Sequence[Layer], page_ids: Sequence[int] | torch.Tensor,
         keys: Sequence[bytes], *, layout: PagedKVLayout | None = None) -> int:
    """Store page ``page_ids[i]`` of ``cache`` under ``keys[i]``; returns how many were written.

    Keys already stored (or being written by another client) are skipped;
    their pages are not read.  One Reserve and one Commit for the whole batch.
    ``layout`` defaults to ``layout_of(cache)`` (pass ``fused_layout_of(cache)``
    for K/V interleaved on the head axis).  Raises ``GeometryMismatch`` when
    the cache does not match ``layout`` or the client's ``block_bytes``,
    ValueError for bad page ids.
    """
    lay, arrays = _prepare(client, cache, layout)
    ids = valid_page_ids(page_ids, len(keys), int(arrays[0].shape[0]), unique=False)
    if not ids:
        return 0
    with client.reserve(keys) as r, torch.inference_mode():
        todo = r.reserved
        if todo:
            slots = [_buffer(r.buffers[i]) for i in todo]
            pages = [ids[i] for i in todo]
            # A slot whose memory is gone: FailedPrecondition, the reservation aborted.
            if _staged(arrays[0].device):
                r._guarded(_save_staged, client, arrays, lay, slots, pages)
            else:
                r._guarded(_save_cpu, arrays, lay, slots, pages, client.fault_guard)
            del slots
        return r.commit()


def load(client: Client, keys: Sequence[bytes], cache: Sequence[Layer],
         page_ids: Sequence[int] | torch.Tensor, *, layout: PagedKVLayout | None = None,
         phases: dict[str, float] | None = None) -> int:
    """Fill page ``page_ids[i]`` from the block of ``keys[i]`` for the leading stored keys.

    Returns the number of pages loaded, ``n``: the blocks of ``keys[:n]`` are
    stored, ``keys[n]`` is not.  The cache is updated in place; other pages
    keep their contents.  Raises as :func:`save`, and ValueError when a page
    id appears twice.

    With a ``checksum=True`` client a block that fails its checksum raises
    ``kvtier.errors.Corrupted`` naming its key, and is deleted from kvtier (a
    later load stops before it), as ``Client.acquire`` does.  On a CPU cache
    the native copy checks the blocks as it copies them (one pass over the
    slots instead of two): then the pages ``page_ids[:hits]`` may have been
    written before the error is raised, and none of them counts as loaded.

    A block whose slot memory is gone under the copy (its data file truncated
    by a writer of the namespace) ends the load there: the pages before it
    count as loaded, that block is deleted as corrupted, and the page it was
    copied into (and later ones) may be partly written.

    ``phases``, when given, gains the seconds this call spent in its parts (added to what
    it holds): ``"acquire"`` (the lease: kvtierd's answer, including its promotion of
    blocks below DRAM, and the client's checksum pass when it verifies apart) and
    ``"copy"`` (the copies into the cache, hashing them when fused).
    """
    lay, arrays = _prepare(client, cache, layout)
    ids = valid_page_ids(page_ids, len(keys), int(arrays[0].shape[0]), unique=True)
    if not ids:
        return 0
    host = None if _staged(arrays[0].device) else _host_u8(arrays)
    # Verify while copying: the lease leaves the checksums to scatter_hash.
    fused = client.checksum and host is not None
    t0 = time.perf_counter()
    with client.acquire(keys, verify=not fused) as lease, torch.inference_mode():
        t1 = time.perf_counter()
        n = lease.hits
        views = list(lease.views)
        for i, v in enumerate(views):
            if len(v) != lay.block_bytes:
                raise GeometryMismatch(f"block {i} holds {len(v)} bytes, a page of this cache is "
                                       f"{lay.describe()}")
        bad: list[int] = []
        gone: int | None = None  # the first block whose slot memory was gone
        if n:
            if _staged(arrays[0].device):
                gone = _load_staged(client, arrays, lay, views, ids[:n])
            elif fused:
                assert host is not None
                bad, gone = _load_cpu_verified(host, views, ids[:n], lease.checksums)
            else:
                gone = _load_cpu(arrays, lay, views, ids[:n], host)
        del views
        if phases is not None:
            phases["acquire"] = phases.get("acquire", 0.0) + (t1 - t0)
            phases["copy"] = phases.get("copy", 0.0) + (time.perf_counter() - t1)
        if gone is not None:
            bad = [i for i in bad if i < gone]
        if bad:
            lease.drop_corrupted(bad)  # raises Corrupted for the first
        if gone is not None:
            lease.drop_gone(gone)  # released; the block is deleted, a miss from there on
            return gone
        lease.release(wait=False)  # every copy is done: no need to wait for the answer
    return n


def slot_tensor(buf: np.ndarray, dtype: torch.dtype = torch.uint8,
                shape: Sequence[int] | None = None) -> torch.Tensor:
    """A CPU tensor over the memory of a slot view, without copying.

    ``buf`` is a flat uint8 view from ``Reservation.buffers`` (writable) or
    ``Lease.views`` (read-only); ``tensor.data_ptr()`` is its address.  The
    tensor keeps the view (so the mapping) alive.  torch has no read-only
    tensors: never write into one over a leased view (it is the stored block),
    nor use either after its lease or reservation has ended.  torch's own
    copies from or into such a tensor are not fault-guarded: a writer of the
    namespace truncating the data file under them kills the process with
    SIGBUS (``save`` and ``load`` copy with the guarded helpers instead).
    """
    if buf.ndim != 1 or buf.dtype != np.uint8 or not buf.flags.c_contiguous:
        raise ValueError(f"a slot view is a flat C-contiguous uint8 array, got {buf.dtype} "
                         f"{buf.shape}")
    if buf.flags.writeable:
        t = torch.frombuffer(buf, dtype=torch.uint8)
    else:
        # torch.frombuffer warns (once per process) about read-only buffers; a ctypes array
        # at the same address is the same zero-copy alias without it, and carries the view.
        raw = (ctypes.c_ubyte * buf.nbytes).from_address(buf.ctypes.data)
        setattr(raw, "_kvtier_view", buf)  # noqa: B010 (the tensor keeps the view alive)
        t = torch.frombuffer(raw, dtype=torch.uint8)
    if dtype != torch.uint8:
        t = t.view(dtype)
    return t.view(tuple(shape)) if shape is not None else t


def pin(client: Client) -> int:
    """Register every segment ``client`` has mapped now with ``cudaHostRegister``.

    Optional: ``save``/``load`` register the segments they touch on first
    use; calling this at start-up takes that cost (pinning takes time in
    proportion to the memory) out of the first requests.  Segments mapped
    later are registered when first used.  Returns the bytes registered by
    kvtier for this client in all.  Raises RuntimeError without CUDA.
    """
    if not _PIN_ON_CPU and not torch.cuda.is_available():
        raise RuntimeError("kvtier.torch.pin needs CUDA (torch.cuda.is_available() is False)")
    pins = _pins_of(client)
    with pins.lock:
        pins.sync(client)
        for seg in list(pins.index):
            pins.register(seg)
        return pins.pinned_bytes()


def unpin(client: Client) -> int:
    """Unregister ``client``'s segments (``cudaHostUnregister``); returns the bytes released.

    Call it when done with the client (before or after ``close()``), never
    while a ``save``/``load`` of this client runs.  A registered segment stays
    mapped until it is unregistered (kvtier holds a view of it, so the driver
    never has pinned pages unmapped under it): without ``unpin``, until the
    client is garbage collected.  A later ``save``/``load`` registers again
    what it uses.
    """
    pins = _PINS.get(client)
    if pins is None:
        return 0
    with pins.lock:
        return pins.close()


# ---------------------------------------------------------------- geometry
def _prepare(client: Client, cache: Sequence[Layer],
             layout: PagedKVLayout | None) -> tuple[PagedKVLayout, list[torch.Tensor]]:
    lay = layout if layout is not None else layout_of(cache)
    arrays = _flatten(cache, lay)
    lay.check_block_bytes(client.block_bytes)
    return lay, arrays


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _flatten(cache: Sequence[Layer], lay: PagedKVLayout) -> list[torch.Tensor]:
    """The cache's tensors in storage order (layer-major, K before V), checked against
    ``lay``, all on one device."""
    arrays = cache_arrays(cache, lay, torch.Tensor, "torch.Tensor",
                          lambda a: _dtype_name(a.dtype),
                          lambda a: _dtype_name(a.dtype) == lay.dtype)
    device = arrays[0].device
    for a in arrays:
        if a.device != device:
            raise ValueError(f"the cache spans devices ({a.device} and {device})")
    return arrays


def _buffer(buf: np.ndarray | None) -> np.ndarray:
    assert buf is not None  # reserved indices always have a buffer
    return buf


# ---------------------------------------------------------------- CPU
def _staged(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the staged (device-side gather + one DMA) path."""
    return device.type != "cpu"


def native_copies(cache: Sequence[Layer], layout: PagedKVLayout | None = None) -> bool:
    """Whether :func:`save` and :func:`load` copy this CPU cache natively (gather/scatter,
    GIL released, one copy per byte); False: one torch copy per array page (slower)."""
    lay = layout if layout is not None else layout_of(cache)
    return _host_u8(_flatten(cache, lay)) is not None


def _host_u8(arrays: Sequence[torch.Tensor]) -> list[np.ndarray] | None:
    """``[pages, page_bytes]`` uint8 numpy views of CPU tensors whose every page is
    contiguous (None if one's is not).

    The pages themselves may lie any stride apart: in a block-major layout (vLLM's
    one backing buffer, ``VLLM_KV_CACHE_LAYOUT``) other layers' pages sit between two
    of a layer's, so the layer tensor is not contiguous while each of its pages is.
    The views alias the tensors (no copy).
    """
    out: list[np.ndarray] = []
    for a in arrays:
        if a.device.type != "cpu" or a.ndim < 1 or int(a.shape[0]) == 0:
            return None
        if not a[0].is_contiguous() or (a.ndim > 1 and a.stride(-1) != 1):
            return None
        u8 = a.detach().view(torch.uint8).numpy()
        pages, page_bytes = int(u8.shape[0]), int(u8[0].size)
        if pages > 1 and u8.strides[0] < page_bytes:
            return None  # pages overlap: not a paged cache
        out.append(np.lib.stride_tricks.as_strided(u8, shape=(pages, page_bytes),
                                                   strides=(u8.strides[0], 1)))
    return out


def _block_shape(lay: PagedKVLayout) -> tuple[int, ...]:
    return (lay.num_layers * lay.arrays_per_layer, *lay.array_page_shape)


def _torch_dtype(lay: PagedKVLayout) -> torch.dtype:
    dtype = getattr(torch, lay.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise GeometryMismatch(f"torch has no dtype {lay.dtype!r}")
    return dtype


def _save_cpu(arrays: Sequence[torch.Tensor], lay: PagedKVLayout, slots: Sequence[np.ndarray],
              pages: Sequence[int], guarded: bool = True) -> None:
    """Copy page ``pages[i]`` into slot ``slots[i]`` (guarded copies raise OSError(EFAULT)
    for a slot whose memory is gone).  ``guarded``: arrays that are not contiguous are
    first copied into a private block (torch), then into the slot (guarded); else
    straight into the slot."""
    host = _host_u8(arrays)
    if host is not None:
        for slot, page in zip(slots, pages, strict=True):
            _accel.gather(slot, [h[page] for h in host])
        return
    dtype, shape = _torch_dtype(lay), _block_shape(lay)
    private = torch.empty(shape, dtype=dtype) if guarded else None
    for slot, page in zip(slots, pages, strict=True):
        block = private if private is not None else slot_tensor(slot, dtype, shape)
        for j, a in enumerate(arrays):
            block[j].copy_(a[page])
        if private is not None:
            _accel.copy_into(slot, _u8(private))


def _u8(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor (no copy)."""
    return t.view(torch.uint8).numpy().reshape(-1)


def _faulted(copy: Any, *args: Any) -> bool:
    """Run the guarded ``copy(*args)``; whether a slot's memory was gone under it."""
    try:
        copy(*args)
    except OSError as exc:
        if not _accel.is_memory_fault(exc):
            raise
        return True
    return False


def _first_gone(copy: Any, n: int) -> int | None:
    """Run ``copy(i)`` for i in range(n), guarded copies each; the first i whose slot
    memory was gone (the copies stop there), or None."""
    for i in range(n):
        try:
            copy(i)
        except OSError as exc:
            if not _accel.is_memory_fault(exc):
                raise
            return i
    return None


def _load_cpu(arrays: Sequence[torch.Tensor], lay: PagedKVLayout, views: Sequence[np.ndarray],
              pages: Sequence[int], host: Sequence[np.ndarray] | None) -> int | None:
    """Copy block ``views[i]`` into page ``pages[i]``; ``host`` is ``_host_u8(arrays)``.
    Returns the first block whose slot memory was gone (the copies stop there), or None.
    Arrays that are not contiguous take the block through a private one (the guarded
    copy out of the slot, then a torch copy per array page)."""
    if host is not None:
        return _first_gone(lambda i: _accel.scatter(views[i], [h[pages[i]] for h in host]),
                           len(views))
    dtype, shape = _torch_dtype(lay), _block_shape(lay)
    private = torch.empty(shape, dtype=dtype)

    def one(i: int) -> None:
        _accel.copy_into(_u8(private), views[i])
        for j, a in enumerate(arrays):
            a[pages[i]].copy_(private[j])

    return _first_gone(one, len(views))


def _load_cpu_verified(host: Sequence[np.ndarray], views: Sequence[np.ndarray],
                       pages: Sequence[int], checksums: Sequence[int | None]
                       ) -> tuple[list[int], int | None]:
    """Copy block ``views[i]`` into page ``pages[i]`` and hash it in the same pass (one
    native call for all blocks); returns the indices of the blocks whose hash is not
    their committed ``checksums[i]`` (None: nothing to compare), and the first block
    whose slot memory was gone (None: none; the blocks from it on are not loaded)."""
    try:
        hashes = _accel.scatter_hash(views, [[h[page] for h in host] for page in pages])
    except OSError as exc:
        if not _accel.is_memory_fault(exc):
            raise
        # Which block: again one by one (the fault's message names it, but in words).
        hashes = []
        for view, page in zip(views, pages, strict=True):
            try:
                hashes += _accel.scatter_hash([view], [[h[page] for h in host]])
            except OSError as again:
                if not _accel.is_memory_fault(again):
                    raise
                break
    bad = [i for i, (got, want) in enumerate(zip(hashes, checksums, strict=False))
           if want is not None and got != want]
    return bad, (len(hashes) if len(hashes) < len(views) else None)


# ---------------------------------------------------------------- CUDA (and other devices)
def _save_staged(client: Client, arrays: Sequence[torch.Tensor], lay: PagedKVLayout,
                 slots: Sequence[np.ndarray], pages: Sequence[int]) -> None:
    """Gather the pages on the device, then one device->host copy per block into its slot
    (into a private block first, then a guarded copy into the slot, when the slots are
    pageable and the client guards)."""
    device = arrays[0].device
    dtype, shape = _torch_dtype(lay), _block_shape(lay)
    with _transfers(client, device, slots) as non_blocking:
        private = (torch.empty(shape, dtype=dtype) if _bounce(client, device) else None)
        for start, stop in _chunks(len(slots), lay.block_bytes):
            idx = torch.tensor(pages[start:stop], dtype=torch.long, device=device)
            staged = torch.stack([a.index_select(0, idx) for a in arrays], dim=1)
            for k in range(stop - start):
                if private is None:
                    slot_tensor(slots[start + k], dtype, shape).copy_(staged[k],
                                                                      non_blocking=non_blocking)
                else:
                    private.copy_(staged[k])  # synchronous: pageable memory
                    _accel.copy_into(slots[start + k], _u8(private))


def _load_staged(client: Client, arrays: Sequence[torch.Tensor], lay: PagedKVLayout,
                 views: Sequence[np.ndarray], pages: Sequence[int]) -> int | None:
    """One host->device copy per block into a staging buffer, then one index_copy_ per
    array.  Pageable slots of a guarding client go through a private block (a guarded
    copy out of the slot first).  Returns the first block whose slot memory was gone
    (the blocks before it are loaded, none after), or None."""
    device = arrays[0].device
    dtype, shape = _torch_dtype(lay), _block_shape(lay)
    with _transfers(client, device, views) as non_blocking:
        bounce = _bounce(client, device)
        for start, stop in _chunks(len(views), lay.block_bytes):
            staged = torch.empty((stop - start, *shape), dtype=dtype, device=device)
            done = stop - start
            for k in range(stop - start):
                if not bounce:
                    staged[k].copy_(slot_tensor(views[start + k], dtype, shape),
                                    non_blocking=non_blocking)
                    continue
                private = torch.empty(shape, dtype=dtype)  # one each: copies may be in flight
                if _faulted(_accel.copy_into, _u8(private), views[start + k]):
                    done = k
                    break
                staged[k].copy_(private, non_blocking=non_blocking)
            if done:
                idx = torch.tensor(pages[start:start + done], dtype=torch.long, device=device)
                for j, a in enumerate(arrays):
                    a.index_copy_(0, idx, staged[:done, j])
            if done < stop - start:
                return start + done
    return None


def _bounce(client: Client, device: torch.device) -> bool:
    """Whether copies between the slots and ``device`` go through a private host block:
    the client guards, and the runtime would read or write pageable slots with the CPU
    (not CUDA, or cudaHostRegister refused), outside the guard."""
    if not client.fault_guard:
        return False
    if device.type != "cuda" and not _PIN_ON_CPU:
        return True
    pins = _PINS.get(client)
    return pins is None or pins.refused is not None


def _chunks(n: int, block_bytes: int) -> Iterator[tuple[int, int]]:
    per = max(1, _STAGE_BYTES // block_bytes)
    for start in range(0, n, per):
        yield start, min(start + per, n)


@contextmanager
def _transfers(client: Client, device: torch.device,
               slots: Sequence[np.ndarray]) -> Iterator[bool]:
    """Around a batch of copies between ``slots`` and ``device``; yields ``non_blocking``.

    On CUDA: registers the segments of the slots first, and synchronizes the
    current stream at the end -- also when a copy failed half way -- so no
    DMA is in flight when the caller commits or releases the slots.
    """
    if device.type != "cuda" and not _PIN_ON_CPU:
        yield False
        return
    pins = _pins_of(client)
    with pins.lock:
        pins.sync(client)
        for s in slots:
            pins.ensure(int(s.ctypes.data), s.nbytes)
        pins.busy += 1
    try:
        yield device.type == "cuda"
    finally:
        try:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        finally:
            with pins.lock:
                pins.busy -= 1


# ---------------------------------------------------------------- cudaHostRegister
#: Tests set this to exercise the registration logic on CPU tensors with a fake cudart.
_PIN_ON_CPU = False


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


@dataclasses.dataclass(eq=False)
class _Segment:
    """One mapped segment of the client: where it is, and its registration."""

    mm: mmap.mmap
    base: int
    size: int
    hold: np.ndarray | None = None  # a view that keeps the mapping alive while registered
    ptrs: list[int] = dataclasses.field(default_factory=list)  # registered pieces (ours)
    pinned: bool = False  # registered (by us or, error 712, by someone else)


class _Pins:
    """The segments of one client registered with cudaHostRegister.

    A registered segment is kept mapped by a numpy view of it (``hold``): the
    client unmaps a segment the daemon dropped (or all of them on close or
    reconnect) unless a view is alive, so registered pages can never be
    unmapped, and their addresses reused, under the driver.  Segments the
    client no longer lists are unregistered, and released, at the next
    ``sync`` with no copy in flight.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.index: list[_Segment] = []  # the client's current mappings, by base address
        self.bases: list[int] = []
        self.stale: list[_Segment] = []  # registered, no longer the client's
        self.busy = 0  # copies in flight (stale segments wait for 0)
        self.refused: str | None = None  # why registration failed: pageable copies from then on
        self._maps: object = None
        self._version = (-1, -1)

    def sync(self, client: Client) -> None:
        """Follow the client's mappings (new segments, dropped ones, a new session)."""
        maps = client._maps
        mapped = _mappings(client)
        key = (maps.version, len(mapped))
        if maps is not self._maps or key != self._version:
            current = {id(mm): mm for mm in mapped.values()}
            old = {id(s.mm): s for s in self.index}
            index = []
            for ident, mm in current.items():
                seg = old.pop(ident, None)
                if seg is None and not mm.closed:
                    with memoryview(mm) as view:
                        base = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
                    seg = _Segment(mm, base, len(mm))
                if seg is not None:
                    index.append(seg)
            self.stale += [s for s in old.values() if s.pinned]
            index.sort(key=lambda s: s.base)
            self.index = index
            self.bases = [s.base for s in index]
            self._maps, self._version = maps, key
        if self.stale and not self.busy:
            for seg in self.stale:
                self.unregister(seg)
            self.stale = []

    def ensure(self, address: int, nbytes: int) -> None:
        """Register the segment holding ``[address, address + nbytes)`` if it is not yet."""
        k = bisect.bisect_right(self.bases, address) - 1
        if k < 0:
            return
        seg = self.index[k]
        if address + nbytes <= seg.base + seg.size and not seg.pinned:
            self.register(seg)

    def register(self, seg: _Segment) -> None:
        if seg.pinned or self.refused is not None:
            return
        cudart = _cudart()
        seg.hold = np.frombuffer(seg.mm, dtype=np.uint8)
        try:
            for off in range(0, seg.size, _REGISTER_CHUNK):
                ptr, n = seg.base + off, min(_REGISTER_CHUNK, seg.size - off)
                res = cudart.cudaHostRegister(ptr, n, _REGISTER_PORTABLE)
                code = int(res)
                if code == 0:
                    seg.ptrs.append(ptr)
                elif code != _ALREADY_REGISTERED:
                    self.refused = f"cudaHostRegister failed: {cudart.cudaGetErrorString(res)}"
                    self.unregister(seg)
                    warnings.warn(f"kvtier.torch: {self.refused} (error {code}); copies between "
                                  "kvtier slots and the GPU run from pageable memory (slower)",
                                  RuntimeWarning, stacklevel=2)
                    return
        except BaseException:
            self.unregister(seg)
            raise
        seg.pinned = True

    def unregister(self, seg: _Segment) -> None:
        if seg.ptrs:
            cudart = _cudart()
            for ptr in seg.ptrs:
                cudart.cudaHostUnregister(ptr)
        seg.ptrs = []
        seg.pinned = False
        seg.hold = None

    def pinned_bytes(self) -> int:
        return sum(s.size for s in self.index if s.pinned)

    def close(self) -> int:
        """Unregister everything and forget the mappings (the next ``sync`` starts afresh)."""
        released = sum(s.size for s in self.index + self.stale if s.ptrs)
        for seg in self.index + self.stale:
            self.unregister(seg)
        self.index, self.bases, self.stale = [], [], []
        self._maps, self._version = None, (-1, -1)
        return released


def _mappings(client: Client) -> Mapping[int, mmap.mmap]:
    """segment id -> mmap of the segments ``client`` has mapped now."""
    return client._maps.mappings()


_PINS: weakref.WeakKeyDictionary[Client, _Pins] = weakref.WeakKeyDictionary()
_PINS_LOCK = threading.Lock()


def _pins_of(client: Client) -> _Pins:
    with _PINS_LOCK:
        pins = _PINS.get(client)
        if pins is None:
            pins = _PINS[client] = _Pins()
            # Not at exit: the process's end releases everything, CUDA may be going already.
            weakref.finalize(client, _release, pins).atexit = False
        return pins


def _release(pins: _Pins) -> None:
    """A collected client's registrations (a finalizer: never raises)."""
    try:
        with pins.lock:
            pins.close()
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"kvtier.torch: unregistering a closed client's segments failed: {exc}",
                      RuntimeWarning, stacklevel=1)


__all__ = [
    "GeometryMismatch",
    "Layer",
    "NamespaceArgs",
    "PagedKVLayout",
    "fused_layout_of",
    "layout_of",
    "load",
    "namespace_for",
    "native_copies",
    "pin",
    "save",
    "slot_tensor",
    "unpin",
]
