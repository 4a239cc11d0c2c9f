"""The KV cache groups of a vLLM engine, as kvtier stores them (used by :mod:`kvtier.vllm`).

vLLM's hybrid allocator gives each kind of layer its own *KV cache group*, with its own
block table: full attention (MLA included), sliding-window attention, Mamba.  A request
holds one block list per group, and a prefix hit of ``T`` blocks must hold in every group
at once.  This module turns an engine's ``KVCacheConfig`` into one :class:`GroupPlan` per
group and holds the rules that follow from the group's spec:

* **Keys name the group.**  A model with one group keeps the plain chained keys of
  ``kvtier.block_keys`` (caches written before hybrid support stay valid).  With several
  groups, group ``g``'s key of block ``i`` is ``blake2b(tag_g ‖ key_i)`` at the same width,
  where ``tag_g`` names the group's index and spec: two groups never share a key, even when
  their layouts are equal and they share a namespace.
* **Namespaces follow the layout.**  Groups whose blocks have the same geometry share a
  namespace (one session, one eviction order for the model); a group whose latent is replicated over
  tensor-parallel ranks (MLA: ``max_tp_shards == 1``) gets a namespace naming the ranks
  that share it (``tp0-3of4``) instead of one per rank, and only the first of those ranks
  writes it; every rank reads it.
* **A sliding-window group needs only its window.**  vLLM keeps, for a request whose first
  ``T`` blocks are computed, only the blocks a token after them can attend to
  (``SlidingWindowManager.get_num_skipped_tokens``); the blocks before are the null block.
  So a hit of ``T`` blocks needs the group's blocks ``[first_block(T), T)`` and only those
  are loaded; :func:`longest_hit` finds the longest ``T`` for which every group has what
  it needs, as vLLM's hybrid ``find_longest_cache_hit`` does for its own prefix cache.

Specs that hold no per-block KV (Mamba state, circular buffers, chunked local attention,
HiSparse pools, EAGLE drafter groups) are refused with :class:`Unsupported`, naming them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

#: The block id of vLLM's null block (the first block of the pool, never handed out): a
#: sliding-window group's blocks outside the window point at it.
NULL_BLOCK_ID: Final = 0
#: Window checks :func:`longest_hit` makes per sliding-window group at most before it gives
#: up on kvtier's blocks for the request (each failed check moves the hit left by at least
#: one block; a gap in a window is rare: it takes an eviction).
MAX_WINDOW_CHECKS: Final = 8
_TAG_DOMAIN: Final = b"kvtier.vllm.group\x00"

FULL: Final = "full"
SLIDING: Final = "sliding"


class Unsupported(RuntimeError):
    """This engine's configuration cannot use the connector (it then stays off, logged)."""


@dataclasses.dataclass(frozen=True, slots=True)
class CacheGeometry:
    """What one vLLM block of every layer of a group is, from the group's KV cache spec."""

    num_layers: int
    block_tokens: int
    kv_heads: int
    head_size: int
    dtype: str
    page_bytes: int  # one block of one layer

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.page_bytes

    def describe(self) -> str:
        return (f"L{self.num_layers}-p{self.block_tokens}-h{self.kv_heads}-d{self.head_size}"
                f"-{self.dtype}")


def _spec_geometry(spec: Any, num_layers: int) -> CacheGeometry:
    missing = [a for a in ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes")
               if not hasattr(spec, a)]
    if missing:
        raise Unsupported(f"the KV cache spec {type(spec).__name__} has no {', '.join(missing)}")
    return CacheGeometry(num_layers=num_layers, block_tokens=int(spec.block_size),
                         kv_heads=int(spec.num_kv_heads), head_size=int(spec.head_size),
                         dtype=str(spec.dtype).removeprefix("torch."),
                         page_bytes=int(spec.page_size_bytes))


def geometry_of(kv_cache_config: KVCacheConfig, group: int = 0) -> CacheGeometry:
    """The geometry of KV cache group ``group``; Unsupported for a spec with no paged KV."""
    groups = kv_cache_config.kv_cache_groups
    if not 0 <= group < len(groups):
        raise Unsupported(f"the KV cache has {len(groups)} groups, no group {group}")
    g = groups[group]
    return _spec_geometry(g.kv_cache_spec, len(g.layer_names))


@dataclasses.dataclass(frozen=True, slots=True)
class GroupPlan:
    """How kvtier stores one KV cache group of an engine."""

    index: int  # vLLM's KV cache group index (into every per-group block list)
    kind: str  # FULL or SLIDING
    geometry: CacheGeometry
    layer_names: tuple[str, ...]
    #: SLIDING: the tokens a new token attends back to (its own included), plus the
    #: trailing tokens vLLM keeps beyond them (``extra_retained_tokens``).
    window: int = 0
    retained: int = 0
    #: Consecutive tensor-parallel ranks holding identical KV of this group (MLA: all).
    replicas: int = 1
    #: Hashed into every key of the group; empty for a model with one group (plain keys).
    tag: bytes = b""

    @property
    def block_tokens(self) -> int:
        return self.geometry.block_tokens

    def describe(self) -> str:
        extra = f"{self.window}" if self.kind == SLIDING else ""
        return f"g{self.index}-{self.kind}{extra}"

    def first_block(self, hit_blocks: int) -> int:
        """The first block vLLM keeps of a request whose first ``hit_blocks`` blocks are
        computed (the ones before are null): 0 for full attention."""
        if self.kind != SLIDING:
            return 0
        # vLLM's SlidingWindowManager.get_num_skipped_tokens, in whole blocks.
        skipped = max(0, hit_blocks * self.block_tokens - self.window + 1 - self.retained)
        return min(skipped // self.block_tokens, hit_blocks)

    def keys(self, base: Sequence[bytes]) -> list[bytes]:
        """The group's keys of blocks whose plain chained keys are ``base``."""
        if not self.tag:
            return list(base)
        prefix = _TAG_DOMAIN + self.tag + b"\x00"
        return [hashlib.blake2b(prefix + k, digest_size=len(k)).digest() for k in base]

    def shard(self, rank: int) -> int:
        """The first tensor-parallel rank of the ranks holding ``rank``'s copy."""
        return rank - rank % self.replicas

    def writes(self, rank: int) -> bool:
        """Whether tensor-parallel rank ``rank`` stores this group (one rank per copy)."""
        return rank % self.replicas == 0


def _spec_kind(spec: KVCacheSpec) -> tuple[str, int, int]:
    """(kind, window, retained) of a spec; Unsupported for a spec with no per-block KV."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiddenStateCacheSpec,
        RSWASpec,
        SinkFullAttentionSpec,
        SlidingWindowSpec,
    )

    name = type(spec).__name__
    if isinstance(spec, SlidingWindowSpec):
        if not spec.prefix_cacheable or spec.prefix_replay_tokens:
            raise Unsupported(f"the KV cache spec {name} (bounded replay) cannot be cached by "
                              "prefix")
        return SLIDING, int(spec.sliding_window), int(spec.extra_retained_tokens)
    if isinstance(spec, (RSWASpec, SinkFullAttentionSpec, HiddenStateCacheSpec)):
        raise Unsupported(f"the KV cache spec {name} is not supported by kvtier (supported: "
                          "FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)")
    if isinstance(spec, FullAttentionSpec):
        # Also a sliding-window or chunked-local layer when the hybrid allocator is off:
        # vLLM then keeps every block, as for full attention.
        return FULL, 0, 0
    raise Unsupported(f"the KV cache spec {name} is not supported by kvtier (supported: "
                      "FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)")


def _replicas(spec: Any, tp_size: int) -> int:
    """Consecutive TP ranks holding identical KV of ``spec`` (vLLM's ``_layer_tp_replicas``)."""
    shards = getattr(spec, "max_tp_shards", None)
    if not shards or tp_size <= 1:
        return 1
    replicas = max(1, tp_size // int(shards))
    if tp_size % replicas:
        raise Unsupported(f"{tp_size} tensor-parallel ranks do not split into groups of "
                          f"{replicas} replicas ({type(spec).__name__}, max_tp_shards {shards})")
    return replicas


def _check_group(group: KVCacheGroupSpec, index: int) -> None:
    if getattr(group, "is_eagle_group", False):
        raise Unsupported(f"KV cache group {index} holds EAGLE/MTP drafter layers, whose last "
                          "block is not final; kvtier does not support speculative drafter "
                          "groups")
    if getattr(group, "host_resident", False):
        raise Unsupported(f"KV cache group {index} lives in a host pool (HiSparse); kvtier "
                          "does not support it")


def plan_groups(kv_cache_config: KVCacheConfig, tp_size: int = 1) -> list[GroupPlan]:
    """One plan per KV cache group vLLM transfers, in group order.

    Raises Unsupported (naming the spec) for a group kvtier cannot store, and for groups
    whose blocks hold different numbers of tokens.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise Unsupported("the KV cache has no groups (an attention-free model)")
    transfer = getattr(kv_cache_config, "transfer_group_ids", None)
    indices = list(transfer) if transfer is not None else list(range(len(groups)))
    if not indices:
        raise Unsupported("no KV cache group takes part in KV transfer")
    plans: list[GroupPlan] = []
    for i in indices:
        group = groups[i]
        _check_group(group, i)
        spec = group.kv_cache_spec
        kind, window, retained = _spec_kind(spec)
        geometry = _spec_geometry(spec, len(group.layer_names))
        plans.append(GroupPlan(index=i, kind=kind, geometry=geometry,
                               layer_names=tuple(group.layer_names), window=window,
                               retained=retained, replicas=_replicas(spec, tp_size)))
    sizes = sorted({p.block_tokens for p in plans})
    if len(sizes) > 1:
        raise Unsupported(f"KV cache groups with different block sizes ({', '.join(map(str, sizes))}"
                          f" tokens: {', '.join(type(groups[p.index].kv_cache_spec).__name__ for p in plans)}); "
                          "kvtier needs one block size for every group")
    if len(groups) == 1:
        return plans  # one group: plain keys, as before hybrid support
    return [dataclasses.replace(p, tag=f"{p.describe()}:{p.geometry.describe()}".encode())
            for p in plans]


def fails_whole(kv_cache_config: KVCacheConfig) -> bool:
    """Whether a failed load must fail its request as a whole, not from its first bad block.

    vLLM takes block-level load errors (``invalid_block_ids``) from models with one KV cache
    group only, and then recomputes from the first bad block as full attention would; a
    sliding-window group would recompute on a window whose blocks were never loaded (the
    null block).  Such models report failed loads through ``failed_recving`` instead.
    """
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    return len(groups) > 1 or any(isinstance(g.kv_cache_spec, SlidingWindowSpec)
                                  for g in groups)


#: ``present(plan, start, stop)``: how many of the plan's keys of blocks ``start..stop-1``
#: kvtier holds, counted from ``start`` (every copy of the group: the least of them).
Present = Callable[[GroupPlan, int, int], int]


def longest_hit(plans: Sequence[GroupPlan], present: Present, local: int, usable: int,
                full_hits: Sequence[int] | None = None) -> int:
    """The most leading blocks (at most ``usable``) a request can have computed with vLLM's
    own ``local`` blocks and kvtier's: every full-attention group holds each block beyond
    ``local``, every sliding-window group the blocks of the window before the hit.  Returns
    ``local`` when kvtier adds nothing.

    ``full_hits``: the full-attention groups' leading blocks held, when the caller looked
    them up already (one per full plan, in order); else ``present`` is asked from ``local``.
    """
    hit = usable
    if hit <= local:
        return local
    full = [p for p in plans if p.kind == FULL]
    if full_hits is not None:
        if len(full_hits) != len(full):
            raise ValueError(f"full_hits has {len(full_hits)} entries for {len(full)} "
                             "full-attention groups")
        hit = min([hit, *full_hits])
    else:
        for p in full:
            hit = min(hit, local + present(p, local, hit))
            if hit <= local:
                return local
    sliding = [p for p in plans if p.kind == SLIDING]
    checked: dict[int, int] = {}  # plan index -> the hit its window was last found for
    budget = {p.index: MAX_WINDOW_CHECKS for p in sliding}
    while hit > local and any(checked.get(p.index) != hit for p in sliding):
        for p in sliding:
            while hit > local and checked.get(p.index) != hit:
                if budget[p.index] == 0:
                    return local
                budget[p.index] -= 1
                start = max(local, p.first_block(hit))
                n = present(p, start, hit)
                if start + n >= hit:
                    checked[p.index] = hit
                else:
                    hit = start + n  # block start+n is missing: no window reaching it holds
    return max(hit, local)


def load_range(plan: GroupPlan, local: int, hit: int) -> tuple[int, int]:
    """The blocks ``[start, stop)`` of ``plan`` a hit of ``hit`` blocks beyond vLLM's
    ``local`` ones loads (a sliding-window group: only its window)."""
    return max(local, plan.first_block(hit)), hit


__all__ = [
    "FULL",
    "MAX_WINDOW_CHECKS",
    "NULL_BLOCK_ID",
    "SLIDING",
    "CacheGeometry",
    "GroupPlan",
    "Present",
    "Unsupported",
    "fails_whole",
    "geometry_of",
    "load_range",
    "longest_hit",
    "plan_groups",
]
