"""Paged KV-cache geometry shared by the framework adapters (``kvtier.jax``, ``kvtier.torch``).

A serving engine keeps its KV cache as per-layer arrays with a page axis
first.  kvtier stores **one page across all layers** as one block,
layer-major, so a prefix of ``n`` pages is ``n`` blocks and each block can be
loaded into any free page of another process's cache::

    block = layer 0 [array 0 page][array 1 page] | layer 1 [...] | ... | layer L-1 [...]

where each "array page" is the C-contiguous ``[page_tokens, heads, head_dim]``
slice of that layer's array at the page index.  Supported per-layer layouts:

``"kv"``      K and V as two arrays ``[pages, page_tokens, kv_heads, head_dim]``
              (the layer is a ``(k, v)`` pair; K is stored first).
``"fused"``   one array ``[pages, page_tokens, 2 * kv_heads, head_dim]`` with K
              and V interleaved along the head axis, as vLLM's TPU backend
              (``num_combined_kv_heads``) stores them.
``"single"``  one array ``[pages, page_tokens, kv_heads, head_dim]`` (K only, or
              an MLA latent cache, or any one-array-per-layer cache).
``"packed"``  one array ``[pages, page_tokens, ceil(2 * kv_heads / packing), packing,
              head_dim]``: K and V interleaved along the heads (K0, V0, K1, ...), ``packing``
              heads of a narrow dtype side by side (1 for 32-bit, 2 for bfloat16, 4 for
              8-bit), as the JAX engines keep them (tpu-inference's ``runner.kv_caches``,
              sglang-jax's ``MHATokenToKVPool.kv_buffer``).

The bytes of a page are copied as they are (no dtype conversion, no
transposition), so a load into a cache of the same layout is bit-exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol, TypedDict, TypeVar

import numpy as np

LAYOUTS: Final = ("kv", "fused", "single", "packed")
#: The daemon's limit on namespace names (characters of [A-Za-z0-9._/-]).
_NAME_MAX: Final = 128
#: Sizes of the dtypes numpy lacks, so a torch-only install (no ml_dtypes) can size a page.
_ITEMSIZES: Final = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
                     "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}


class _Paged(Protocol):
    """An engine's cache array (a ``jax.Array``, a ``torch.Tensor``): pages first."""

    @property
    def shape(self) -> Any: ...


_A = TypeVar("_A", bound=_Paged)


class GeometryMismatch(ValueError):
    """A cache does not match a namespace's ``block_bytes`` (the message says what differs)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PagedKVLayout:
    """The geometry of one paged KV cache."""

    layout: str  # one of LAYOUTS
    num_layers: int
    page_tokens: int
    kv_heads: int  # K (or V) heads; a fused array has 2 * kv_heads along its head axis
    head_dim: int
    dtype: str  # numpy dtype name ("bfloat16" via ml_dtypes, "float16", ...)
    packing: int = 1  # "packed" only: heads side by side in the packing axis

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        for name in ("num_layers", "page_tokens", "kv_heads", "head_dim", "packing"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.packing != 1 and self.layout != "packed":
            raise ValueError(f"packing is a property of the 'packed' layout; layout "
                             f"{self.layout!r} needs packing=1, got {self.packing}")

    @property
    def arrays_per_layer(self) -> int:
        return 2 if self.layout == "kv" else 1

    @property
    def heads_per_array(self) -> int:
        """Length of an array's head axis (for "packed": the axis before ``packing``)."""
        if self.layout == "packed":
            return -(-2 * self.kv_heads // self.packing)
        return 2 * self.kv_heads if self.layout == "fused" else self.kv_heads

    @property
    def itemsize(self) -> int:
        size = _ITEMSIZES.get(self.dtype)
        return size if size is not None else dtype_of(self.dtype).itemsize

    @property
    def array_page_shape(self) -> tuple[int, ...]:
        """Shape of one page of one array: ``(page_tokens, heads, head_dim)``, and for
        "packed" ``(page_tokens, heads, packing, head_dim)``."""
        if self.layout == "packed":
            return (self.page_tokens, self.heads_per_array, self.packing, self.head_dim)
        return (self.page_tokens, self.heads_per_array, self.head_dim)

    @property
    def array_page_bytes(self) -> int:
        return math.prod(self.array_page_shape) * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: one page of every array of every layer."""
        return self.num_layers * self.arrays_per_layer * self.array_page_bytes

    def describe(self) -> str:
        """``block_bytes`` spelled out, for error messages."""
        packs = f" x {self.packing} packed" if self.layout == "packed" else ""
        return (f"{self.num_layers} layers x {self.arrays_per_layer} arrays x "
                f"{self.page_tokens} tokens x {self.heads_per_array} heads{packs} x "
                f"{self.head_dim} dims x {self.itemsize} bytes ({self.dtype}) = "
                f"{self.block_bytes}")

    def offsets(self) -> list[tuple[int, int]]:
        """(layer, array) -> byte offset inside a block, in storage order."""
        return [(i * self.array_page_bytes, self.array_page_bytes)
                for i in range(self.num_layers * self.arrays_per_layer)]

    def check_block_bytes(self, block_bytes: int) -> None:
        """Raise GeometryMismatch unless a namespace of ``block_bytes`` fits this cache exactly."""
        if block_bytes != self.block_bytes:
            raise GeometryMismatch(
                f"namespace block_bytes is {block_bytes}, but this cache's page is "
                f"{self.describe()}; declare the namespace with block_bytes="
                f"{self.block_bytes} (and a model_uid naming this geometry)")


def dtype_of(name: str) -> np.dtype[Any]:
    """A numpy dtype by name, bfloat16 and the float8 types included (via ml_dtypes)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # jax's dependency: bfloat16, float8_*

        dtype: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
        return dtype


def layout_of(cache: Sequence[Any]) -> PagedKVLayout:
    """Infer the layout of a cache given as per-layer arrays or (k, v) pairs.

    Arrays need ``.shape`` and ``.dtype`` (JAX, torch, numpy).  A 4-D array
    per layer is ``"single"`` unless ``fused=True`` is meant: use
    :func:`fused_layout_of` for vLLM TPU caches, whose shape alone cannot say.
    """
    return _infer(cache, fused=False)


def fused_layout_of(cache: Sequence[Any]) -> PagedKVLayout:
    """Layout of a vLLM-TPU style cache: per layer ``[pages, page_tokens, 2*kv_heads, head_dim]``."""
    return _infer(cache, fused=True)


def packed_layout_of(cache: Sequence[Any]) -> PagedKVLayout:
    """Layout of a JAX engine's cache (tpu-inference, sglang-jax): per layer one array
    ``[pages, page_tokens, ceil(2*kv_heads/packing), packing, head_dim]``.

    ``kv_heads`` is read as ``heads * packing / 2``: the head slots the array holds (a
    padded odd head count under packing counts its padding).
    """
    if len(cache) == 0:
        raise ValueError("the cache has no layers")
    first = cache[0]
    if isinstance(first, (tuple, list)):
        raise ValueError("a packed KV cache has one array per layer, not (k, v) pairs")
    shape = tuple(int(d) for d in first.shape)
    if len(shape) != 5:
        raise ValueError(f"packed layer arrays must be [pages, page_tokens, heads, packing, "
                         f"head_dim], got shape {shape}")
    dtype = _dtype_name(first.dtype)
    for li, a in enumerate(cache):
        if isinstance(a, (tuple, list)) or tuple(int(d) for d in a.shape) != shape \
                or _dtype_name(a.dtype) != dtype:
            raise ValueError(f"layer {li} is not shaped like layer 0 ({shape} {dtype}): "
                             "all layers must match")
    _, page_tokens, heads, packing, head_dim = shape
    if heads * packing % 2:
        raise ValueError(f"a packed KV array holds K and V: heads x packing must be even, got "
                         f"{heads} x {packing}")
    return PagedKVLayout("packed", len(cache), page_tokens, heads * packing // 2, head_dim,
                         dtype, packing)


def _infer(cache: Sequence[Any], *, fused: bool) -> PagedKVLayout:
    if len(cache) == 0:
        raise ValueError("the cache has no layers")
    first = cache[0]
    pair = isinstance(first, (tuple, list))
    arrays = list(first) if pair else [first]
    if pair and len(arrays) != 2:
        raise ValueError(f"a layer given as a tuple must be (k, v), got {len(arrays)} arrays")
    shape = tuple(int(d) for d in arrays[0].shape)
    if len(shape) != 4:
        raise ValueError(f"layer arrays must be [pages, page_tokens, heads, head_dim], "
                         f"got shape {shape}")
    dtype = _dtype_name(arrays[0].dtype)
    for li, layer in enumerate(cache):
        items = list(layer) if pair else [layer]
        if (isinstance(layer, (tuple, list))) != pair or len(items) != len(arrays):
            raise ValueError(f"layer {li} is not shaped like layer 0 (mixing (k, v) pairs and "
                             "single arrays)")
        for a in items:
            if tuple(int(d) for d in a.shape) != shape or _dtype_name(a.dtype) != dtype:
                raise ValueError(f"layer {li} has shape {tuple(a.shape)} {_dtype_name(a.dtype)}"
                                 f", layer 0 has {shape} {dtype}: all layers must match")
    _, page_tokens, heads, head_dim = shape
    if pair:
        return PagedKVLayout("kv", len(cache), page_tokens, heads, head_dim, dtype)
    if fused:
        if heads % 2:
            raise ValueError(f"a fused KV array has 2 * kv_heads heads; got {heads}")
        return PagedKVLayout("fused", len(cache), page_tokens, heads // 2, head_dim, dtype)
    return PagedKVLayout("single", len(cache), page_tokens, heads, head_dim, dtype)


def _dtype_name(dtype: Any) -> str:
    """'bfloat16', 'float16', ... for numpy, JAX and torch dtypes alike."""
    text = str(dtype)
    return text.removeprefix("torch.")


class NamespaceArgs(TypedDict):
    """Keyword arguments of ``kvtier.Client`` for a cache geometry."""

    namespace: str
    block_bytes: int
    model_uid: str


def namespace_for(layout: PagedKVLayout, model: str) -> NamespaceArgs:
    """``Client`` keywords for caches of ``layout`` of model ``model`` (a name with revision).

    The namespace name spells out the geometry, so caches whose pages differ
    (even with equal ``block_bytes``: "kv" vs "fused") never share blocks::

        kvtier.Client(socket_dir, **kvtier.paged.namespace_for(layout, "qwen3-8b@2025-05"))

    ``model`` is the ``model_uid`` as given; in the name (at most 128
    characters of ``[A-Za-z0-9._/-]``) other characters become ``-`` and a
    long model name is shortened to a prefix plus a hash of it.  Two models
    whose names collide that way are still kept apart: the daemon refuses a
    namespace declared again with another ``model_uid``.
    """
    geometry = (f"{layout.layout}-L{layout.num_layers}-p{layout.page_tokens}"
                f"-h{layout.kv_heads}-d{layout.head_dim}-{layout.dtype}")
    if layout.layout == "packed":
        geometry += f"-k{layout.packing}"
    name = re.sub(r"[^A-Za-z0-9._/-]", "-", model) or "-"
    room = _NAME_MAX - len(geometry) - 1
    if len(name) > room:
        digest = hashlib.sha256(model.encode()).hexdigest()[:16]
        name = f"{name[: room - len(digest) - 1]}-{digest}"
    return NamespaceArgs(namespace=f"{name}/{geometry}", block_bytes=layout.block_bytes,
                         model_uid=model)


def cache_arrays(cache: Sequence[Any], lay: PagedKVLayout, kind: type[_A], kind_name: str,
                 dtype_text: Callable[[_A], str], dtype_matches: Callable[[_A], bool]
                 ) -> list[_A]:
    """The cache's arrays in storage order (layer-major, K before V), checked against
    ``lay``: each a ``kind`` (``kind_name`` in errors) of the layout's page shape and of
    its dtype (``dtype_matches``; ``dtype_text`` names it), all with one page count.
    Raises GeometryMismatch, or TypeError for an array of another kind."""
    if len(cache) != lay.num_layers:
        raise GeometryMismatch(f"the cache has {len(cache)} layers, the layout {lay.num_layers}")
    want_shape = lay.array_page_shape
    arrays: list[_A] = []
    for li, layer in enumerate(cache):
        items = list(layer) if isinstance(layer, (tuple, list)) else [layer]
        if len(items) != lay.arrays_per_layer:
            raise GeometryMismatch(f"layer {li} has {len(items)} arrays, layout "
                                   f"{lay.layout!r} has {lay.arrays_per_layer}")
        for a in items:
            if not isinstance(a, kind):
                raise TypeError(f"layer {li} holds a {type(a).__name__}, not a {kind_name}")
            shape = tuple(int(d) for d in a.shape)
            if len(shape) != 1 + len(want_shape) or shape[1:] != want_shape \
                    or not dtype_matches(a):
                text = dtype_text(a)
                raise GeometryMismatch(
                    f"layer {li} has an array of shape {list(shape)} {text}; layout "
                    f"{lay.layout!r} needs [pages, {', '.join(map(str, want_shape))}] "
                    f"{lay.dtype} ({differences(shape, text, want_shape, lay.dtype)})")
            arrays.append(a)
    pages = int(arrays[0].shape[0])
    for a in arrays:
        if int(a.shape[0]) != pages:
            raise GeometryMismatch(f"arrays differ in page count ({a.shape[0]} != {pages})")
    return arrays


def differences(shape: tuple[int, ...], dtype: str, want: tuple[int, ...],
                want_dtype: str) -> str:
    """What differs between a cache array and a layout, e.g. ``page_tokens 32 != 16``."""
    if len(shape) != 1 + len(want):
        return f"{len(shape)} dimensions, not {1 + len(want)}"
    names = (("page_tokens", "heads", "packing", "head_dim") if len(want) == 4
             else ("page_tokens", "heads", "head_dim"))
    out = [f"{n} {got} != {exp}" for n, got, exp in zip(names, shape[1:], want, strict=True)
           if got != exp]
    if dtype != want_dtype:
        out.append(f"dtype {dtype} != {want_dtype}")
    return ", ".join(out)


def valid_page_ids(ids_in: Any, n_keys: int, pages: int, *, unique: bool) -> list[int]:
    """Validated page ids (a 1-D sequence of ints, or anything with ``tolist()``).

    Raises ValueError when they are not ints, not one per key, out of
    ``0..pages-1``, or (with ``unique``) when one appears twice.
    """
    raw = ids_in.tolist() if hasattr(ids_in, "tolist") else ids_in
    ids = np.asarray(raw)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"page_ids must be a 1-D sequence of ints, got {ids.dtype} {ids.shape}")
    if len(ids) != n_keys:
        raise ValueError(f"keys and page_ids differ in length ({n_keys} != {len(ids)})")
    out = [operator.index(i) for i in ids.tolist()]
    bad = [i for i in out if not 0 <= i < pages]
    if bad:
        raise ValueError(f"page id {bad[0]} is out of range: the cache has {pages} pages")
    if unique and len(set(out)) != len(out):
        dup = next(i for k, i in enumerate(out) if i in out[:k])
        raise ValueError(f"page id {dup} appears twice: each block needs a page of its own")
    return out
