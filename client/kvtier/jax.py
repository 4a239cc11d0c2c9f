"""Save and load pages of a JAX paged KV cache through kvtierd (``pip install kvtier[jax]``).

One block is one page of every layer (layout: :mod:`kvtier.paged`), so a
prompt prefix of ``n`` pages is ``n`` keys from ``kvtier.block_keys``::

    import kvtier, kvtier.jax as kj

    cache = [(k, v) for k, v in kv_arrays]   # per layer [pages, page_tokens, kv_heads, head_dim]
    layout = kj.layout_of(cache)             # kj.packed_layout_of(...) for the JAX engines'
                                             # [pages, tokens, heads, packing, head_dim]
    with kvtier.Client(**kj.namespace_for(layout, "llama3-8b@rev1")) as client:
        keys = kvtier.block_keys(token_ids, layout.page_tokens, salt=b"tenant")
        kj.save(client, cache, page_ids, keys)         # skips keys already stored
        # ... later, in this or any other process on the host:
        cache, n = kj.load(client, keys, cache, free_page_ids)
        # pages free_page_ids[:n] now hold the first n blocks; the old cache
        # arrays were donated (updated in place) and must not be used again

Copies per page (a page of all layers), by backend and direction:

* ``save`` on CPU: **1** -- the jax buffers are read through zero-copy numpy
  views (``np.asarray``) and each block is gathered from the layers' page
  slices straight into its shared-memory slot (``_accel.gather``, GIL
  released).  On GPU/TPU: the wanted pages are first gathered on the device
  (``jnp.take``, one device-local copy), then one device->host transfer per
  layer array moves only those pages (all transfers in flight together), then
  one host copy into the slot; the runtime may stage the transfer through a
  pinned buffer (one more host copy).
* ``load`` on CPU: **1** -- the cache arrays are donated (through a jitted
  identity, so each result exclusively owns its host buffer) and each block
  is scattered from its slot straight into the pages of those buffers
  (``_accel.scatter``, GIL released, one call per block; the tests check that
  the arrays keep their buffers).  With ``donate=False``, or for arrays not
  on one CPU device: each leased slot is aliased as a jax array with no copy
  (``jax.device_put(..., may_alias=True)`` of a numpy view of the slot; the
  tests check the pointers) and a jitted ``dynamic_update_slice`` copies each
  page into the cache (in place when donated).  On GPU/TPU:
  ``jax.device_put`` of the slot views (one host->device transfer per block;
  the runtime may stage it through a pinned buffer first), then the same
  in-place update on the device (one device-local copy).

``snapshot`` + ``save_snapshot`` are ``save`` in two halves, for an engine that donates
its arrays to the next step: ``snapshot`` gathers the pages on the device into new arrays
and starts their transfer to the host (it returns at once, and the next step cannot touch
them); ``save_snapshot``, on any thread, copies them into the reserved slots and commits
(one copy more than ``save`` on CPU, the same copies on accelerators).

``stage`` + ``load_staged`` are ``load`` in two halves, for an engine whose step must not
wait for kvtierd and whose arrays only its step may touch: ``stage``, on any thread, leases
the blocks, copies each out of its slot into a host array of its own (``Client.get``,
guarded and verified; the lease ends there) and places it with the cache's sharding
(``device_put``: on CPU it aliases the host array, on GPU/TPU it starts the transfer);
``load_staged``, in the step, writes them into the donated arrays (the jitted in-place
update of the accelerator path).  Copies per page: on CPU two (one off the step, one in
it, where ``load`` makes one); on GPU/TPU the host copy, the transfer and the device copy,
as ``load`` with the fault guard.

``load_leased`` is ``load`` from a lease the caller took first, for an engine that
must know its blocks are held before it commits to loading them (``kvtier.sglang_jax``).

Pages move as their bits (unsigned ints of the dtype's width, bitcast inside
the jitted functions at no cost), never as floats: XLA's CPU backend computes
bfloat16 in float32 and would otherwise turn signalling NaNs into quiet ones
(and rewrite the whole array on every update).  Every dtype is byte-exact.

The lease is held until every copy out of shared memory has finished
(``block_until_ready``), so the daemon cannot reuse a slot while it is read.

``jax.dlpack.from_dlpack`` is not used for the aliasing: jax asks numpy for a
legacy (unversioned) DLPack capsule, which numpy refuses for read-only arrays
(leased slots are read-only) and which cannot carry bfloat16 or the float8
types at all.  ``device_put(may_alias=True)`` aliases all of them on CPU when
the address is 64-byte aligned (slots are page aligned); where it cannot, it
copies, which is slower but still correct.

Every copy out of or into a slot that the CPU makes runs under the client's
fault guard (``kvtier._accel``): when a writer of the namespace truncates a
data file, ``load`` stops at the first block whose memory is gone and
returns the pages before it (that block is deleted as corrupted), and
``save`` raises ``FailedPrecondition`` with its reservation aborted -- the
process lives on.  So where ``load`` would alias the slots (``donate=False``,
caches not on one CPU device, accelerators), a guarding client first copies
each leased block into a private host array (``_accel.copy_into``, one more
host copy) and XLA reads that, never the slot; ``KVTIER_FAULT_GUARD=0``
restores the zero-copy aliasing.

A cache sharded over several devices (e.g. tensor parallel, heads split)
works: ``save`` then takes the device-gather path, ``load`` places each block
with the sharding of the cache's first array.  The page axis (axis 0) should
not be sharded.  Compilation: ``load`` compiles one small function per cache
geometry (and group of up to 8 arrays), ``save`` on accelerators one gather
per batch-size bucket.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax import lax

from kvtier import _accel, errors
from kvtier.client import Client, Lease, Reservation
from kvtier.paged import (
    GeometryMismatch,
    NamespaceArgs,
    PagedKVLayout,
    cache_arrays,
    dtype_of,
    fused_layout_of,
    layout_of,
    namespace_for,
    packed_layout_of,
    valid_page_ids,
)

#: A layer: one array (layouts "fused", "single") or a (k, v) pair (layout "kv").
Layer = TypeVar("Layer", jax.Array, tuple[jax.Array, jax.Array])


#: Arrays one jitted update takes (bounds its compile time; see _update_group).
_GROUP = 8
#: Page batches of the device-side gather (save, accelerators) are padded to
#: powers of two up to this, then to its multiples, to bound recompilation.
_CHUNK = 16


def save(client: Client, cache: Sequence[Layer], page_ids: Sequence[int] | npt.ArrayLike,
         keys: Sequence[bytes], *, layout: PagedKVLayout | None = None) -> int:
    """Store page ``page_ids[i]`` of ``cache`` under ``keys[i]``; returns how many were written.

    Keys already stored (or being written by another client) are skipped;
    their pages are not read.  One Reserve and one Commit for the whole batch.
    ``layout`` defaults to ``layout_of(cache)`` (pass ``fused_layout_of(cache)``
    for a vLLM-TPU cache).  Raises ``GeometryMismatch`` when the cache does
    not match ``layout`` or the client's ``block_bytes``, ValueError for bad
    page ids.
    """
    lay, arrays = _prepare(client, cache, layout)
    ids = valid_page_ids(page_ids, len(keys), int(arrays[0].shape[0]), unique=False)
    if not ids:
        return 0
    with client.reserve(keys) as r:
        todo = r.reserved
        if todo:
            pages = [ids[i] for i in todo]
            host = _host_views(arrays)
            # (r._guarded: a slot whose memory is gone aborts, FailedPrecondition.)
            if host is not None:  # one CPU device: read the jax buffers in place
                for i, page in zip(todo, pages, strict=True):
                    r._guarded(_accel.gather, _slot(r.buffers[i]), [h[page] for h in host])
            else:  # accelerators: move only the wanted pages, one transfer per array
                _fill(r, enumerate(todo), _pages_to_host(arrays, pages))
            del host
        return r.commit()


class Snapshot:
    """Pages of a cache copied out of it by :func:`snapshot`, for :func:`save_snapshot`.

    Nothing done to the cache afterwards changes it: an engine may donate and overwrite
    its arrays in the next step while the snapshot is stored from another thread.
    """

    __slots__ = ("_arrays", "layout", "pages")

    def __init__(self, arrays: list[jax.Array], pages: int, layout: PagedKVLayout) -> None:
        self._arrays, self.pages, self.layout = arrays, pages, layout

    def __len__(self) -> int:
        return self.pages

    def host(self) -> list[np.ndarray]:
        """Per cache array, its pages' bytes on the host (``[pages, page bytes]`` uint8,
        padded rows after ``pages``); waits for the transfer :func:`snapshot` started."""
        return [_as_u8(np.asarray(h)) for h in jax.device_get(self._arrays)]


def snapshot(cache: Sequence[Layer], page_ids: Sequence[int], *,
             layout: PagedKVLayout | None = None) -> Snapshot:
    """Start copying pages ``page_ids`` of ``cache`` out of it; returns at once.

    One gather of the pages into new arrays on the cache's devices (a device-local copy,
    dispatched asynchronously: JAX orders it before any later use of the cache, donation
    included), whose transfer to the host starts now.  :func:`save_snapshot` stores it,
    from any thread.  Raises as :func:`save`.
    """
    lay = layout if layout is not None else layout_of(cache)
    arrays = _flatten(cache, lay)
    ids = valid_page_ids(page_ids, len(page_ids), int(arrays[0].shape[0]), unique=False)
    if not ids:
        return Snapshot([], 0, lay)
    gathered = _gather(arrays, ids)
    for g in gathered:
        g.copy_to_host_async()
    return Snapshot(gathered, len(ids), lay)


def save_snapshot(client: Client, snap: Snapshot, keys: Sequence[bytes]) -> int:
    """Store page ``i`` of ``snap`` under ``keys[i]``; returns how many were written.

    As :func:`save`: keys already stored are skipped, one Reserve and one Commit.  Waits
    for the snapshot's transfer (if any page is to be written); then one host copy per
    page into its slot.  Raises ``GeometryMismatch`` when the client's ``block_bytes`` is
    not the snapshot's, ValueError when ``keys`` is not one per page.
    """
    if len(keys) != snap.pages:
        raise ValueError(f"keys and the snapshot's pages differ in length "
                         f"({len(keys)} != {snap.pages})")
    snap.layout.check_block_bytes(client.block_bytes)
    if not keys:
        return 0
    with client.reserve(keys) as r:
        if r.reserved:
            _fill(r, zip(r.reserved, r.reserved, strict=True), snap.host())
        return r.commit()


def load(client: Client, keys: Sequence[bytes], cache: Sequence[Layer],
         page_ids: Sequence[int] | npt.ArrayLike, *, layout: PagedKVLayout | None = None,
         donate: bool = True) -> tuple[list[Layer], int]:
    """Fill ``page_ids[i]`` from the block of ``keys[i]`` for the leading stored keys.

    Returns the new cache (same structure as ``cache``) and the number of
    pages loaded, ``n``: the blocks of ``keys[:n]`` are stored, ``keys[n]``
    is not.  Other pages keep their contents.  With ``donate`` (the default)
    the cache arrays are donated and updated in place, so the arrays of
    ``cache`` must not be used afterwards (unless ``n == 0``: then ``cache``'s
    own arrays are returned).  ``donate=False`` leaves them valid at the
    price of one copy of every array.  Raises as :func:`save`, and ValueError
    when a page id appears twice.

    A block whose slot memory is gone under the copy (its data file truncated
    by a writer of the namespace) ends the load there: ``n`` counts the pages
    before it, that block is deleted as corrupted.  (Then ``n`` may be 0 with
    the cache donated all the same: use the returned arrays, always.)
    """
    lay, arrays = _prepare(client, cache, layout)
    ids = valid_page_ids(page_ids, len(keys), int(arrays[0].shape[0]), unique=True)
    if not ids:
        return list(cache), 0
    with client.acquire(keys) as lease:
        return _load_leased(client, lease, cache, arrays, ids, lay, donate)


def load_leased(client: Client, lease: Lease, cache: Sequence[Layer], page_ids: Sequence[int],
                *, layout: PagedKVLayout | None = None, donate: bool = True) -> tuple[list[Layer], int]:
    """:func:`load` from a lease the caller took (``client.acquire(keys)``), and end it.

    For an engine that must know its blocks are leased before it commits to loading
    them (sglang-jax's HiCache un-tombstones its tree nodes before the copy).
    ``page_ids[i]`` receives the block of ``lease.keys[i]``, for the lease's hits;
    ``page_ids`` may be longer (the pages after the hits keep their contents).  The
    lease is released (or ended) on return and on error.  Returns and raises as
    :func:`load`.
    """
    with lease:
        lay, arrays = _prepare(client, cache, layout)
        ids = valid_page_ids(page_ids, len(page_ids), int(arrays[0].shape[0]), unique=True)
        if len(ids) < lease.hits:
            raise ValueError(f"the lease holds {lease.hits} blocks, page_ids has {len(ids)}")
        return _load_leased(client, lease, cache, arrays, ids[: lease.hits], lay, donate)


def _load_leased(client: Client, lease: Lease, cache: Sequence[Layer], arrays: list[jax.Array],
                 ids: list[int], lay: PagedKVLayout, donate: bool) -> tuple[list[Layer], int]:
    """The body of :func:`load` once ``lease`` is held (the caller's ``with`` ends it)."""
    n = lease.hits
    if n == 0:
        return list(cache), 0
    if donate and _on_one_cpu(arrays):
        arrays, gone = _load_in_place(arrays, lease.views[:n], ids[:n], lay)
        if gone is not None:
            _after_copies(lease.drop_gone, gone)  # released; a miss from there on
            return cast(list[Layer], _rebuild(arrays, lay)), gone
        _after_copies(lease.release, wait=False)
        return cast(list[Layer], _rebuild(arrays, lay)), n
    views = list(lease.views)
    if client.fault_guard:  # XLA reads private copies, never a slot (outside the guard)
        views, gone = _private_copies(views, lay)
        if gone is not None:
            lease.drop_gone(gone)
            n = gone
            if n == 0:
                return list(cache), 0
    blocks = _block_arrays(views, lay, arrays[0].sharding)
    del views
    if not donate:  # update copies instead, so the caller's arrays stay valid
        arrays = [jnp.array(a, copy=True) for a in arrays]
    _update_pages(arrays, blocks, ids)  # ids[:n]
    for a in arrays:  # every read of the slots is done: the lease may go
        a.block_until_ready()
    del blocks
    if not lease.done:
        _after_copies(lease.release, wait=False)
    return cast(list[Layer], _rebuild(arrays, lay)), n


class Staged:
    """Blocks read out of kvtier by :func:`stage`, on their way into a cache
    (:func:`load_staged`).

    They are copies of their own: the lease that read them is over, so kvtierd may reuse
    or evict the slots, and nothing but :func:`load_staged` reads them.  ``len()`` is the
    number of blocks staged: the leading stored keys of those :func:`stage` was given.
    """

    __slots__ = ("_blocks", "layout")

    def __init__(self, blocks: list[jax.Array], layout: PagedKVLayout) -> None:
        self._blocks, self.layout = blocks, layout

    def __len__(self) -> int:
        return len(self._blocks)


def stage(client: Client, keys: Sequence[bytes], *, layout: PagedKVLayout,
          sharding: jax.sharding.Sharding) -> Staged:
    """Read the leading stored blocks of ``keys`` out of kvtier for :func:`load_staged`.

    :func:`load` in two halves, for an engine whose step must not wait for kvtierd: this
    one runs on any thread, and touches no cache.  One lease, each block copied out of
    its slot into a host array of its own (``Client.get``: guarded, the copies checked
    against the checksums when the client has them, the lease released when the copies
    are done), then placed with
    ``sharding`` (the cache's: ``jax.device_put``, which on a CPU device aliases the host
    array, no copy, and elsewhere starts the host-to-device transfer, not waited for).
    Raises as ``Client.get`` (``Corrupted`` for a block that fails its checksum, which
    is deleted) and ``GeometryMismatch`` when the client's ``block_bytes`` is not
    ``layout``'s.  A block whose slot memory is gone ends the staging there.
    """
    layout.check_block_bytes(client.block_bytes)
    if not keys:
        return Staged([], layout)
    host = client.get(keys)  # numpy's buffers are 64-byte aligned: device_put may alias
    return Staged(_block_arrays(host, layout, sharding) if host else [], layout)


def load_staged(staged: Staged, cache: Sequence[Layer], page_ids: Sequence[int], *,
                layout: PagedKVLayout | None = None) -> tuple[list[Layer], int]:
    """Fill ``page_ids[i]`` with staged block ``i`` (:func:`stage`); returns the new cache
    and ``len(staged)``.

    The device half of :func:`load`: one jitted in-place update per block and group of
    up to 8 arrays, dispatched (the cache's arrays are donated: use the returned ones).
    ``page_ids`` may be longer than the staged blocks (the pages after them keep their
    contents).  Raises ``GeometryMismatch`` when ``cache`` is not of the staged blocks'
    layout, ValueError for bad or repeated page ids (both before anything is donated).
    """
    lay = layout if layout is not None else layout_of(cache)
    arrays = _flatten(cache, lay)
    if (staged.layout.block_bytes, staged.layout.array_page_shape) != \
            (lay.block_bytes, lay.array_page_shape):
        raise GeometryMismatch(f"the staged blocks are {staged.layout.describe()}, a page "
                               f"of this cache is {lay.describe()}")
    ids = valid_page_ids(page_ids, len(page_ids), int(arrays[0].shape[0]), unique=True)
    n = len(staged)
    if len(ids) < n:
        raise ValueError(f"{n} blocks are staged, page_ids has {len(ids)}")
    if n == 0:
        return list(cache), 0
    _update_pages(arrays, staged._blocks, ids[:n])
    return cast(list[Layer], _rebuild(arrays, lay)), n


def _update_pages(arrays: list[jax.Array], blocks: Sequence[jax.Array],
                  ids: Sequence[int]) -> None:
    """Page ``ids[i]`` of every array set from ``blocks[i]`` (for the blocks there are),
    in place: ``arrays`` (donated) are replaced by the updated ones."""
    for block, page in zip(blocks, ids, strict=False):
        for first in range(0, len(arrays), _GROUP):
            group = arrays[first : first + _GROUP]
            arrays[first : first + _GROUP] = _update(group, block, page, first)


def _after_copies(end: Callable[..., None], *args: Any, **kw: Any) -> None:
    """End a lease once its blocks are copied (the cache arrays were donated: raising now
    would lose them).  A lease whose session died with kvtierd (killed or restarted
    under the copy) is gone already, and the bytes copied were committed ones."""
    try:
        end(*args, **kw)
    except errors.KVTierError:
        pass


# ---------------------------------------------------------------- internals
def _prepare(client: Client, cache: Sequence[Layer],
             layout: PagedKVLayout | None) -> tuple[PagedKVLayout, list[jax.Array]]:
    lay = layout if layout is not None else layout_of(cache)
    arrays = _flatten(cache, lay)
    lay.check_block_bytes(client.block_bytes)
    return lay, arrays


def _flatten(cache: Sequence[Layer], lay: PagedKVLayout) -> list[jax.Array]:
    """The cache's arrays in storage order, checked against ``lay``."""
    want = dtype_of(lay.dtype)
    return cache_arrays(cache, lay, jax.Array, "jax.Array", lambda a: str(a.dtype),
                        lambda a: a.dtype == want)


def _rebuild(arrays: list[jax.Array],
             lay: PagedKVLayout) -> list[jax.Array] | list[tuple[jax.Array, jax.Array]]:
    """``arrays`` (storage order) as the layers of a cache of ``lay``."""
    if lay.arrays_per_layer == 2:
        return [(arrays[2 * i], arrays[2 * i + 1]) for i in range(lay.num_layers)]
    return arrays


def _bucket(n: int) -> int:
    """Batch sizes the jitted functions see: powers of two up to _CHUNK, then its multiples."""
    if n <= _CHUNK:
        return 1 << (n - 1).bit_length()
    return -(-n // _CHUNK) * _CHUNK


def _slot(buf: np.ndarray | None) -> np.ndarray:
    assert buf is not None  # reserved indices always have a buffer
    return buf


def _host_views(arrays: Sequence[jax.Array]) -> list[np.ndarray] | None:
    """Zero-copy uint8 numpy views of arrays on one CPU device, else None.

    The views must not outlive the call: while one exists jax cannot donate
    the buffer (it silently copies instead).
    """
    for a in arrays:
        devices = a.devices()
        if len(devices) != 1 or next(iter(devices)).platform != "cpu":
            return None
    # np.asarray of a CPU jax array is a read-only view of its buffer (checked by the
    # tests); uint8 because bfloat16 cannot be exported through the buffer protocol.
    return [_as_u8(np.asarray(a)) for a in arrays]


def _as_u8(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8)


def _on_one_cpu(arrays: Sequence[jax.Array]) -> bool:
    for a in arrays:
        devices = a.devices()
        if len(devices) != 1 or next(iter(devices)).platform != "cpu":
            return False
    return True


#: Identity with the arguments donated: the results own their buffers (the
#: donated ones, or fresh copies where XLA cannot alias), and the caller's
#: arrays are deleted -- nothing else can observe those buffers any more.
_own = jax.jit(lambda xs: xs, donate_argnums=0)


def _private_copies(views: Sequence[np.ndarray], lay: PagedKVLayout
                    ) -> tuple[list[np.ndarray], int | None]:
    """Each leased block copied into a new host array (guarded), and the first block
    whose slot memory was gone (the copies stop there), or None."""
    out: list[np.ndarray] = []
    for i, v in enumerate(views):
        if len(v) != lay.block_bytes:
            raise GeometryMismatch(f"block {i} holds {len(v)} bytes, a page of this cache is "
                                   f"{lay.describe()}")
        # 64-byte aligned (numpy's allocations are), so device_put can alias it on CPU.
        dst = np.empty(len(v), dtype=np.uint8)
        try:
            _accel.copy_into(dst, v)
        except OSError as exc:
            if not _accel.is_memory_fault(exc):
                raise
            return out, i
        out.append(dst)
    return out, None


def _load_in_place(arrays: list[jax.Array], views: Sequence[np.ndarray], ids: Sequence[int],
                   lay: PagedKVLayout) -> tuple[list[jax.Array], int | None]:
    """The CPU load path: scatter each block straight into the pages of the arrays.

    After donation through ``_own`` each array exclusively owns its host
    buffer, so writing into it (through a numpy view at its
    ``unsafe_buffer_pointer``) before anyone reads the array again is
    invisible to JAX except as the new contents: one copy per page, at memcpy
    speed, one GIL-free ``_accel.scatter`` per block -- instead of one
    dispatched XLA update per block and array group.  Returns the arrays and the
    first block whose slot memory was gone (the copies stop there), or None.
    """
    owned: list[jax.Array] = _own(arrays)
    page_bytes = lay.array_page_bytes
    pages = []
    for a in owned:
        a.block_until_ready()
        size = int(a.shape[0]) * page_bytes
        raw = (ctypes.c_uint8 * size).from_address(a.unsafe_buffer_pointer())
        pages.append(np.ctypeslib.as_array(raw).reshape(int(a.shape[0]), page_bytes))
    for i, (view, page) in enumerate(zip(views, ids, strict=True)):
        if len(view) != lay.block_bytes:
            raise GeometryMismatch(f"block {i} holds {len(view)} bytes, a page of this cache "
                                   f"is {lay.describe()}")
        try:
            _accel.scatter(view, [p[page] for p in pages])
        except OSError as exc:
            if not _accel.is_memory_fault(exc):
                raise
            return owned, i
    return owned, None


_spec: Callable[..., jax.sharding.PartitionSpec] = jax.sharding.PartitionSpec  # (untyped)


@jax.jit
def _take(a: jax.Array, ids: jax.Array) -> jax.Array:
    """Pages ``ids`` of ``a``, as unsigned ints of the same width (bits kept exactly).

    An array on a mesh of explicit axes (sglang-jax's and tpu-inference's caches) names
    the gather's output sharding, which JAX will not guess: ``a``'s own, but the page
    axis whole (the pages taken are few, and any may sit on any shard)."""
    bits = _as_bits(a)
    sharding = jax.typeof(a).sharding
    mesh = getattr(sharding, "mesh", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and any(
            t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        spec = tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
        out = jax.sharding.NamedSharding(sharding.mesh, _spec(None, *spec[1:]))
        return bits.at[ids].get(mode="clip", out_sharding=out)
    return jnp.take(bits, ids, axis=0, mode="clip")


def _gather(arrays: Sequence[jax.Array], pages: list[int]) -> list[jax.Array]:
    """Only ``pages`` of each array, as new arrays of their bits on the same devices (the
    batch padded to a bucket size, so rows ``len(pages)..`` repeat the last page)."""
    pad = _bucket(len(pages)) - len(pages)
    ids = jnp.asarray(pages + [pages[-1]] * pad, dtype=jnp.int32)
    return [_take(a, ids) for a in arrays]


def _pages_to_host(arrays: Sequence[jax.Array], pages: list[int]) -> list[np.ndarray]:
    """Only ``pages`` of each array, on the host: a device gather, then one transfer each."""
    return [_as_u8(np.asarray(h)) for h in jax.device_get(_gather(arrays, pages))]


def _fill(r: Reservation, pairs: Iterable[tuple[int, int]], rows: Sequence[np.ndarray]) -> None:
    """For each ``(row, i)`` of ``pairs``: reserved block ``i`` from that row of every
    array's host pages ``rows``.

    ``r._guarded``: a slot whose memory is gone aborts the reservation
    (FailedPrecondition)."""
    for k, i in pairs:
        r._guarded(_accel.gather, _slot(r.buffers[i]), [h[k] for h in rows])


def _block_arrays(views: Sequence[np.ndarray], lay: PagedKVLayout,
                  sharding: jax.sharding.Sharding) -> list[jax.Array]:
    """Each leased block as a ``[arrays, page_tokens, heads, head_dim]`` jax array of its bits.

    The dtype is the unsigned int of the cache dtype's width (see ``_as_bits``).

    On a CPU device these alias the slots (no copy); elsewhere they are
    transferred.  ``views`` are the lease's read-only uint8 views.
    """
    bits = _bits_dtype(dtype_of(lay.dtype))
    shape = (lay.num_layers * lay.arrays_per_layer, *lay.array_page_shape)
    typed = []
    for i, v in enumerate(views):
        if len(v) != lay.block_bytes:
            raise GeometryMismatch(f"block {i} holds {len(v)} bytes, a page of this cache is "
                                   f"{lay.describe()}")
        typed.append(v.view(bits).reshape(shape))
    out: list[jax.Array] = jax.device_put(typed, sharding, may_alias=True)
    return out


def _update_group(arrays: Sequence[jax.Array], block: jax.Array, page: int | jax.Array,
                  first: int | jax.Array) -> list[jax.Array]:
    """``arrays[g]`` with page ``page`` set to ``block[first + g]``, for each g.

    ``block`` holds the bits of one block: unsigned ints of the width of the
    cache's dtype (see ``_as_bits``).  One update of one page per array, so
    XLA emits each as an in-place ``dynamic-update-slice`` of the donated
    array with the slice of the block fused in: one copy per array page.
    (A chain of updates of the same array, or a scatter, becomes a loop over
    the whole array on CPU once the bitcasts are fused around it.)  Groups
    of at most ``_GROUP`` arrays bound the compile time: one function serves
    every group of a cache (``first`` is traced), so a layout compiles at
    most twice, whatever its number of layers or of blocks loaded.
    """
    out = []
    for g, a in enumerate(arrays):
        src = lax.dynamic_slice_in_dim(block, first + g, 1, axis=0)
        bits = lax.dynamic_update_slice_in_dim(_as_bits(a), src, page, axis=0)
        out.append(lax.bitcast_convert_type(bits, a.dtype))
    return out


def _as_bits(a: jax.Array) -> jax.Array:
    """``a`` reinterpreted as unsigned ints of its width (free: XLA makes it a bitcast).

    Moving the bits rather than the floats keeps every byte: XLA's CPU backend
    computes bfloat16 (and other narrow floats) in float32 and would quiet a
    signalling NaN on the way.
    """
    return lax.bitcast_convert_type(a, _bits_dtype(a.dtype))


def _bits_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return np.dtype(f"u{dtype.itemsize}")


_update = jax.jit(_update_group, donate_argnums=0)


__all__ = [
    "GeometryMismatch",
    "NamespaceArgs",
    "PagedKVLayout",
    "Snapshot",
    "Staged",
    "fused_layout_of",
    "layout_of",
    "load",
    "load_leased",
    "load_staged",
    "namespace_for",
    "packed_layout_of",
    "save",
    "save_snapshot",
    "snapshot",
    "stage",
]
