"""sglang-jax HiCache with its host tier in kvtierd: pages that outlive the engine and are
shared by every replica on the host.

sglang-jax (0.1.0rc0) keeps HiCache's host tier (L2) in an in-process ``LRUHostKVPool``:
it dies with the engine and no other replica sees it.  With this module the host tier
is a ``HostKVPool`` whose pages live in kvtierd's shared memory, one kvtier block per
engine page (all layers, ``kvtier.jax``'s "packed" layout), keyed by the page's token
prefix (``kvtier.block_keys`` salted with ``kvtier.hashing.request_salt``, as the vLLM
connector keys its blocks), so any engine process of the same model finds them::

    kvtierd &                                         # one per host
    KVTIER_SGLANG_JAX='{"socket_dir": "/run/kvtier"}' \\
        python -m kvtier.sglang_jax --model-path ... --page-size 16 \\
        --enable-unified-radix-tree --hicache-storage none

``python -m kvtier.sglang_jax`` takes ``sgl_jax.launch_server``'s arguments.  With the
``Engine`` API, ``import kvtier.sglang_jax`` at the top of the script (the scheduler is a
spawned process that imports the script again, and with it this module).

**The plugin point.**  sglang-jax has no option to choose the host pool:
``kv_cache_builder.init_hicache`` builds ``LRUHostKVPool`` itself.  Importing this module
calls :func:`install`, which replaces that one function with :func:`init_hicache`; it
builds kvtier's pool when ``KVTIER_SGLANG_JAX`` is set and hands everything else to the
original.  kvtier's pool also changes how the tree cache (``UnifiedRadixCache``) meets
the host tier, through :class:`KVTierRadixCache`, a subclass the cache is switched to:

* **save**: a page written back to the host (``write_backup``) is stored under its
  prefix key (``kvtier.jax.save``, one Reserve + Commit per node; keys some replica
  stored already are skipped);
* **match**: where the engine's tree ends before the prompt's last full page, one
  ``Lookup`` of the remaining pages' keys; the pages kvtierd holds join the tree as host
  tombstones (evicted from the device, backed up on the host), so the engine loads them
  as it loads its own host pages and reports them as cached tokens;
* **load**: before the tree commits to a load (``init_load_back``) the blocks are leased
  (one ``Acquire`` per node); blocks kvtierd no longer holds leave the tree and are
  recomputed.  The copy into the device cache (``kvtier.jax.load_leased``) runs where the
  engine scatters its own host pages (``flush_load``, donation-safe).

**Failure is a recompute**: kvtierd down at start or later, restarted, a page evicted
between lookup and load, a full cache: pages that cannot be saved or leased are not
used, and the engine computes them.  Nothing here raises into the scheduler.

Supported: ``UnifiedRadixCache`` with the FULL component only (no SWA, no recurrent
state), no EAGLE, no data-parallel attention, one JAX process.  Elsewhere the engine's
own pool is built, with a warning.  A tensor-parallel mesh on one host goes through
``kvtier.jax``'s multi-device path (a block holds every head); it is untested here (the
tests run one CPU device).

``KVTIER_SGLANG_JAX`` is ``1`` (defaults) or a JSON object of :class:`Config`'s fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import jax
import numpy as np

# sglang-jax needs Python >= 3.12; kvtier's own checks run on 3.11, where these are Any.
from sgl_jax.srt.mem_cache import kv_cache_builder
from sgl_jax.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sgl_jax.srt.mem_cache.host_kv_pool import HostKVPool
from sgl_jax.srt.mem_cache.radix_cache import RadixKey
from sgl_jax.srt.mem_cache.unified_cache_components import (
    BASE_COMPONENT_TYPE,
    ComponentType,
)
from sgl_jax.srt.mem_cache.unified_radix_cache import UnifiedRadixCache, UnifiedTreeNode

from kvtier import errors
from kvtier import jax as kj
from kvtier._reconnect import LazyClient
from kvtier.client import Client, Lease
from kvtier.hashing import block_keys, request_salt
from kvtier.paged import NamespaceArgs, PagedKVLayout, namespace_for, packed_layout_of

logger = logging.getLogger("kvtier.sglang_jax")

#: The environment variable that selects kvtier's host pool (and configures it).
ENV: Final = "KVTIER_SGLANG_JAX"
#: Keys of the model's config.json that do not change its KV (left out of model_uid).
_VOLATILE_CONFIG: Final = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """``KVTIER_SGLANG_JAX``'s fields (all optional)."""

    #: kvtierd's socket directory (None: the client's default, ``$KVTIER_SOCKET_DIR``).
    socket_dir: str | None = None
    #: The model's identity (None: the model path): engines share pages only when it and
    #: the digest of the model's config.json, dtypes, layout and sglang-jax's minor
    #: version agree.
    model: str | None = None
    #: Hashed into every key: engines with different salts never share pages (tenants).
    salt: str = ""
    #: Deadline of each kvtier call, seconds.
    timeout: float = 5.0
    #: While kvtierd cannot be reached, the engine tries again after 0.5 s, doubling up
    #: to this many seconds (a connect attempt runs on the scheduler thread).
    retry_max: float = 30.0

    @classmethod
    def from_env(cls, text: str | None) -> Config | None:
        """The config ``text`` selects, or None when it selects the engine's own pool.

        Raises ValueError for text that is neither ``1``/``0`` nor a JSON object of known
        fields (a typo must not silently serve without kvtier)."""
        if text is None or text.strip() in ("", "0"):
            return None
        if text.strip() == "1":
            return cls()
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{ENV} must be 1 or a JSON object, got {text!r}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{ENV} must be 1 or a JSON object, got {text!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{ENV}: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        return cls(**raw)


# ---------------------------------------------------------------- the plugin point
_original_init_hicache: Callable[..., None] | None = None


def install() -> None:
    """Make sglang-jax's ``init_hicache`` build kvtier's pool when ``KVTIER_SGLANG_JAX``
    is set (idempotent; importing this module calls it).

    ``kv_cache_builder.build_kv_cache`` calls ``init_hicache`` through its module's
    globals, so replacing that attribute is the whole hook.
    """
    global _original_init_hicache
    if _original_init_hicache is None:
        _original_init_hicache = kv_cache_builder.init_hicache
        kv_cache_builder.init_hicache = init_hicache


def init_hicache(cache: Any, server_args: Any, mesh: Any, token_to_kv_pool_allocator: Any) -> None:
    """``kv_cache_builder.init_hicache`` with kvtier's host pool where selected."""
    assert _original_init_hicache is not None
    cfg = Config.from_env(os.environ.get(ENV))
    if cfg is None:
        _original_init_hicache(cache, server_args, mesh, token_to_kv_pool_allocator)
        return
    why = _unsupported(cache, server_args)
    if why:
        logger.warning("kvtier: %s; HiCache keeps sglang-jax's own host pool", why)
        _original_init_hicache(cache, server_args, mesh, token_to_kv_pool_allocator)
        return
    device_pool = token_to_kv_pool_allocator.get_kvcache()
    if int(getattr(device_pool, "dp_size", 1)) != 1:
        logger.warning("kvtier: data-parallel attention (dp_size %s) shards the page axis; "
                       "HiCache keeps sglang-jax's own host pool", device_pool.dp_size)
        _original_init_hicache(cache, server_args, mesh, token_to_kv_pool_allocator)
        return
    try:
        layout = packed_layout_of(device_pool.kv_buffer)
    except (AttributeError, TypeError, ValueError) as exc:
        logger.warning("kvtier: the device KV pool (%s) is not one packed array per layer "
                       "(%s); HiCache keeps sglang-jax's own host pool",
                       type(device_pool).__name__, exc)
        _original_init_hicache(cache, server_args, mesh, token_to_kv_pool_allocator)
        return
    # The engine's host budget, as LRUHostKVPool sizes it: pages this engine tracks in
    # its tree.  kvtierd's capacity is its own (dram.capacity), shared by all replicas.
    pages = int(server_args.hicache_ratio * device_pool.size) // device_pool.page_size
    args = namespace_args(cfg, server_args, layout)
    pool = KVTierHostKVPool(device_pool, pages, layout, _Link(cfg, args))
    from sgl_jax.srt.mem_cache.hicache_controller import HiCacheController

    cache.__class__ = KVTierRadixCache
    cache.host_pool = pool
    cache.hicache_controller = HiCacheController(pool, device_pool)
    cache.hicache_enabled = True
    cache.write_through_threshold = server_args.hicache_write_through_threshold
    cache.write_policy = server_args.hicache_write_policy
    cache.kvtier_salt = cfg.salt
    cache.kvtier_keys = []
    logger.info("kvtier: HiCache host tier in kvtierd namespace %s (%d pages tracked, page of "
                "%d bytes)", args["namespace"], pages, layout.block_bytes)


def _unsupported(cache: Any, server_args: Any) -> str | None:
    if type(cache) is not UnifiedRadixCache:
        return (f"the tree cache is {type(cache).__name__}, kvtier needs UnifiedRadixCache "
                "(--enable-unified-radix-tree)")
    if tuple(cache.tree_components) != (ComponentType.FULL,):
        return "the tree has state beyond full attention (recurrent/SWA)"
    if cache.is_eagle:
        return "EAGLE's bigram keys are not token prefixes"
    if jax.process_count() != 1:
        return "several JAX processes (multi-host) share this engine"
    if server_args.hicache_storage != "none":
        return f"hicache_storage is {server_args.hicache_storage!r}"
    return None


def namespace_args(cfg: Config, server_args: Any, layout: PagedKVLayout) -> NamespaceArgs:
    """The namespace of the engine's pages: ``<model's last path part>-<digest>/<geometry>``,
    its ``model_uid`` ``<identity>#<digest>``.  Engines share pages only when both agree
    (the daemon refuses a namespace declared again with another ``model_uid``: that
    engine serves without kvtier, logged), so the same model mounted at another path
    shares once ``model`` names it alike."""
    identity = cfg.model or str(server_args.model_path)
    digest = _fingerprint(server_args, layout)
    short = identity.rstrip("/").rsplit("/", 1)[-1][:40] or "model"
    args = namespace_for(layout, f"{short}-{digest}")
    args["model_uid"] = f"{identity[:200]}#{digest}"
    return args


def _fingerprint(server_args: Any, layout: PagedKVLayout) -> str:
    """A digest of what shapes a page's bytes beyond its geometry: the model's config,
    the dtypes, sglang-jax's minor version."""
    import sgl_jax

    config: Any = None
    path = Path(str(server_args.model_path)) / "config.json"
    try:
        raw = json.loads(path.read_text())
        config = {k: v for k, v in raw.items() if k not in _VOLATILE_CONFIG}
    except (OSError, ValueError):
        config = str(server_args.model_path)  # a hub id: its name stands for it
    parts = {"config": config, "revision": getattr(server_args, "revision", None),
             "dtype": str(server_args.dtype), "kv_cache_dtype": str(server_args.kv_cache_dtype),
             "layout": layout.describe(),
             "sglang-jax": ".".join(str(sgl_jax.__version__).split(".")[:2])}
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the kvtier client
class _Link:
    """The namespace's client, opened lazily: None while kvtierd cannot be reached (tried
    again after 0.5 s, doubling up to 30 s).  Once open, the client rides through daemon
    restarts itself.  Failures are logged at most once a minute per kind."""

    def __init__(self, cfg: Config, args: NamespaceArgs) -> None:
        self._cfg, self.args = cfg, args
        self._warned: dict[str, float] = {}
        self.failures: dict[str, int] = {}
        self._lazy = LazyClient(
            lambda: Client(cfg.socket_dir, **args, timeout=cfg.timeout),
            on_failure=lambda exc: self.failed("connect", exc), on_open=self._opened,
            retry_max=cfg.retry_max)

    def _opened(self, client: Client) -> None:
        logger.info("kvtier: namespace %s at %s", self.args["namespace"], client.grpc_path)

    def client(self) -> Client | None:
        return self._lazy.get()

    def close(self) -> None:
        self._lazy.close()

    def failed(self, what: str, exc: BaseException | str) -> None:
        """Count a failure (the engine recomputes) and log it, once a minute per kind."""
        self.failures[what] = self.failures.get(what, 0) + 1
        now = time.monotonic()
        if now - self._warned.get(what, -1e9) >= 60.0:
            self._warned[what] = now
            why = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
            logger.warning("kvtier: %s failed (%s); recomputing instead (%d so far)", what,
                           why, self.failures[what])


# ---------------------------------------------------------------- the host pool
class KVTierHostKVPool(HostKVPool):  # type: ignore[misc]
    """HiCache's host tier in kvtierd: ``HostKVPool``'s page-id contract over kvtier keys.

    A host page id is this engine's handle of one kvtier block: the tree cache allocates
    ids (``alloc``), :class:`KVTierRadixCache` binds each to its page's prefix key, and
    ``free`` forgets the binding -- the block stays in kvtierd for other engines and for
    this one after a restart (kvtierd evicts it under its own policy).  Transfers:

    * ``stage_backup`` (D2H, on the thread that owns the KV buffer): ``kvtier.jax.save``
      of the pages straight into reserved slots, committed; ``flush_backup`` has nothing
      left to do.  A failed save is logged and counted, never raised: the page's key is
      then missing, and a load of it is a recompute.
    * ``lease`` (from ``init_load_back``, before the tree commits to the load): one
      Acquire; ``flush_load`` copies the leased blocks into the device pages
      (``kvtier.jax.load_leased``) and ends the lease; ``stage_load`` has nothing to do.
    """

    def __init__(self, device_pool: Any, pool_size: int, layout: PagedKVLayout,
                 link: _Link) -> None:
        if pool_size <= 0:
            raise ValueError(f"pool_size must be positive, got {pool_size}")
        self._device_pool = device_pool
        self._size = pool_size
        self.layout = layout
        self.link = link
        self._lock = threading.Lock()
        self._free: list[int] = list(range(pool_size))
        self._allocated = [False] * pool_size  # O(1) double-free checks
        self._keys: list[bytes | None] = [None] * pool_size
        self._leases: dict[tuple[int, ...], Lease] = {}
        self._unsaved: set[int] = set()  # ids whose save failed, until the tree asks
        #: Pages saved (committed or already stored) and loaded, for tests and metrics.
        self.saved = 0
        self.loaded = 0

    # -- HostKVPool
    def reserve(self) -> int | None:
        ids = self.alloc(1)
        return None if ids is None else int(ids[0])

    def release(self, buffer_id: int) -> None:
        self.free([buffer_id])

    def available_size(self) -> int:
        with self._lock:
            return len(self._free)

    def total_size(self) -> int:
        return self._size

    def alloc(self, need_pages: int) -> np.ndarray | None:
        """``need_pages`` free ids (all or nothing), unbound, or None."""
        if need_pages <= 0:
            raise ValueError(f"need_pages must be positive, got {need_pages}")
        with self._lock:
            if len(self._free) < need_pages:
                return None
            ids = self._free[:need_pages]
            del self._free[:need_pages]
            for pid in ids:
                self._allocated[pid] = True
        return np.asarray(ids, dtype=np.int64)

    def free(self, host_page_ids: Any) -> None:
        """Forget the ids' keys and return them; the blocks stay in kvtierd."""
        with self._lock:
            for pid in dict.fromkeys(int(p) for p in host_page_ids):
                if not 0 <= pid < self._size:
                    raise ValueError(f"page id={pid} outside pool range [0, {self._size})")
                if not self._allocated[pid]:
                    raise RuntimeError(f"double free of page id={pid}")
                self._allocated[pid] = False
                self._keys[pid] = None
                self._unsaved.discard(pid)
                self._free.append(pid)

    def bind(self, host_page_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """Name the kvtier block each allocated id stands for."""
        if len(host_page_ids) != len(keys):
            raise ValueError(f"ids and keys differ in length ({len(host_page_ids)} != "
                             f"{len(keys)})")
        with self._lock:
            for pid, key in zip(host_page_ids, keys, strict=True):
                self._keys[int(pid)] = key

    def keys_of(self, host_page_ids: Sequence[int]) -> list[bytes]:
        out = []
        for pid in host_page_ids:
            key = self._keys[int(pid)]
            if key is None:
                raise RuntimeError(f"host page id={pid} has no kvtier key bound")
            out.append(key)
        return out

    def copy_into(self, device_indices: list[int], host_buffer_ids: list[int]) -> None:
        self.stage_backup(device_indices, host_buffer_ids)

    def copy_to_device(self, host_buffer_ids: list[int], device_indices: list[int]) -> None:
        if self.lease(host_buffer_ids):
            self.flush_load(host_buffer_ids, device_indices)

    # -- D2H
    def stage_backup(self, device_indices: list[int], host_buffer_ids: list[int]) -> None:
        """Save the device pages under the ids' keys (never raises for kvtier's sake)."""
        if len(device_indices) != len(host_buffer_ids):
            raise ValueError(f"device_indices ({len(device_indices)}) and host_buffer_ids "
                             f"({len(host_buffer_ids)}) differ in length")
        if not host_buffer_ids:
            return
        keys = self.keys_of(host_buffer_ids)
        client = self.link.client()
        try:
            if client is None:
                raise errors.Unavailable("kvtierd cannot be reached")
            kj.save(client, self._device_pool.kv_buffer, [int(p) for p in device_indices], keys,
                    layout=self.layout)
        except (errors.KVTierError, OSError) as exc:
            self.link.failed("save", exc)
            with self._lock:
                self._unsaved.update(int(b) for b in host_buffer_ids)
            return
        self.saved += len(keys)

    def take_unsaved(self, host_buffer_ids: Sequence[int]) -> bool:
        """Whether the save of any of these ids failed (and forget that it did)."""
        ids = {int(b) for b in host_buffer_ids}
        with self._lock:
            failed = bool(ids & self._unsaved)
            self._unsaved -= ids
        return failed

    def flush_backup(self, host_buffer_ids: list[int]) -> None:
        """Nothing: ``stage_backup`` committed the pages already."""

    # -- H2D
    def lease(self, host_buffer_ids: Sequence[int]) -> bool:
        """Lease the ids' blocks for a load; False (nothing held) unless every one is here."""
        ids = tuple(int(b) for b in host_buffer_ids)
        client = self.link.client()
        if client is None or not ids:
            return False
        try:
            lease = client.acquire(self.keys_of(ids))
        except (errors.KVTierError, OSError) as exc:
            self.link.failed("acquire", exc)
            return False
        if lease.hits < len(ids):
            self._end(lease)
            self.link.failed("load", f"{len(ids) - lease.hits} of {len(ids)} host pages are "
                             "gone from kvtierd")
            return False
        with self._lock:
            old = self._leases.pop(ids, None)
            self._leases[ids] = lease
        if old is not None:
            self._end(old)
        return True

    def unlease(self, host_buffer_ids: Sequence[int]) -> None:
        """End the lease of a load the tree did not go on with."""
        with self._lock:
            lease = self._leases.pop(tuple(int(b) for b in host_buffer_ids), None)
        if lease is not None:
            self._end(lease)

    def stage_load(self, host_buffer_ids: list[int]) -> None:
        """Nothing: the blocks are leased, ``flush_load`` copies them in one pass."""

    def flush_load(self, host_buffer_ids: list[int], device_indices: list[int]) -> None:
        """Copy the leased blocks into the device pages; the cache arrays are replaced."""
        if len(host_buffer_ids) != len(device_indices):
            raise ValueError(f"host_buffer_ids ({len(host_buffer_ids)}) and device_indices "
                             f"({len(device_indices)}) differ in length")
        if not host_buffer_ids:
            return
        with self._lock:
            lease = self._leases.pop(tuple(int(b) for b in host_buffer_ids), None)
        client = self.link.client()
        if lease is None or client is None:
            # init_load_back leases every page before the tree un-tombstones it: reaching
            # here without one is a bug in this module, not a kvtier failure.
            raise RuntimeError(f"flush_load of host pages {host_buffer_ids} without a lease")
        dp = self._device_pool
        cache, n = kj.load_leased(client, lease, list(dp.kv_buffer),
                                  [int(p) for p in device_indices], layout=self.layout)
        dp.kv_buffer[:] = cache
        self.loaded += n
        if n < len(host_buffer_ids):  # a leased slot's memory vanished (truncated file)
            logger.error("kvtier: %d of %d leased pages could not be read (their data file "
                         "was truncated); those device pages hold stale data",
                         len(host_buffer_ids) - n, len(host_buffer_ids))

    def precompile_transfers(self, max_pages: int | None = None) -> None:
        """Nothing to warm: on one CPU device the copies are memcpy, elsewhere
        ``kvtier.jax`` compiles one small function per cache geometry on first use."""

    def _end(self, lease: Lease) -> None:
        try:
            lease.release(wait=False)
        except errors.KVTierError:  # its session died with kvtierd: released already
            pass


# ---------------------------------------------------------------- the tree cache
class KVTierRadixCache(UnifiedRadixCache):  # type: ignore[misc]
    """``UnifiedRadixCache`` whose host tier is kvtierd (set by :func:`init_hicache`).

    Adds kvtier's keys to what the tree already does: ids it allocates for a node's
    backup are bound to the node's prefix keys; a match that ends before the prompt's
    pages do looks the rest up in kvtierd and grafts the hits as host tombstones; a load
    leases its blocks first and drops the nodes whose blocks are gone.
    """

    host_pool: KVTierHostKVPool
    kvtier_salt: str
    kvtier_keys: list[list[bytes]]  # keys of the nodes being backed up (innermost last)

    # -- keys
    def kvtier_node_keys(self, node: Any) -> list[bytes]:
        """The prefix keys of ``node``'s own pages."""
        tokens: list[int] = []
        path = []
        n = node
        while n is not None and n is not self.root_node:
            path.append(n)
            n = n.parent
        for p in reversed(path):
            tokens.extend(int(t) for t in p.key.token_ids)
        keys = block_keys(tokens, self.page_size, self._salt(node.key))
        return keys[len(keys) - len(node.key) // self.page_size:]

    def _salt(self, key: Any) -> bytes:
        return request_salt(self.kvtier_salt, key.extra_key if key is not None else None, None)

    # -- save
    def write_backup(self, node: Any, write_back: bool = False) -> int:
        if node is self.root_node or node.backuped:
            return 0
        self.kvtier_keys.append(self.kvtier_node_keys(node))
        try:
            done: int = super().write_backup(node, write_back)
        finally:
            self.kvtier_keys.pop()
        cd = node.component_data[BASE_COMPONENT_TYPE]
        if done and cd.host_value is not None:
            ids = [int(b) for b in cd.host_value]
            if self.host_pool.take_unsaved(ids):
                # Not backed up after all (kvtierd down, full): the node stays a device
                # node, and its next hit tries again -- once kvtierd is back, it saves.
                cd.host_value = None
                self.host_pool.free(ids)
                return 0
        return done

    def _reserve_host_slots(self, num_pages: int) -> Any:
        pages = super()._reserve_host_slots(num_pages)
        if pages is not None:
            self.host_pool.bind([int(p) for p in pages], self.kvtier_keys[-1])
        return pages

    # -- match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        if self.disable or params.full_only:
            return result
        try:
            grafted = self._graft(params.key, result)
        except (errors.KVTierError, OSError) as exc:
            self.host_pool.link.failed("lookup", exc)
            grafted = False
        return super().match_prefix(params) if grafted else result

    def _graft(self, key: Any, result: Any) -> bool:
        """Add the pages kvtierd holds beyond ``result`` as one host tombstone node."""
        ps = self.page_size
        pages = len(key) // ps
        end = result.last_host_node
        depth = 0
        n = end
        while n is not self.root_node:
            depth += len(n.key)
            n = n.parent
        if depth % ps or depth // ps >= pages:
            return False
        rest = RadixKey(list(key.token_ids[depth : pages * ps]), key.extra_key, key.dp_rank)
        if self.get_child_key_fn(rest) in end.children:
            return False  # a dead node of the same tokens (evicted, not backed up) is there
        client = self.host_pool.link.client()
        if client is None:
            return False
        keys = block_keys(list(key.token_ids[: pages * ps]), ps, self._salt(key))[depth // ps:]
        hits = client.lookup(keys, prefetch=True)
        if hits == 0:
            return False
        ids = self._reserve_host_slots_unbound(hits)  # may evict host leaves
        if ids is None:
            return False
        if end is not self.root_node and \
                end.parent.children.get(self.get_child_key_fn(end.key)) is not end:
            self.host_pool.free(ids)  # the eviction took ``end`` itself
            return False
        self.host_pool.bind(ids, keys[:hits])
        node = UnifiedTreeNode(self.tree_components)
        node.parent = end
        node.key = rest[: hits * ps]
        node.component_data[BASE_COMPONENT_TYPE].host_value = np.asarray(ids, dtype=np.int64)
        end.children[self.get_child_key_fn(node.key)] = node
        self._update_evictable_leaf_sets(node)
        self._update_evictable_leaf_sets(end)
        return True

    def _reserve_host_slots_unbound(self, num_pages: int) -> list[int] | None:
        pages = super()._reserve_host_slots(num_pages)
        return None if pages is None else [int(p) for p in pages]

    # -- load
    def init_load_back(self, last_host_node: Any, host_hit_length: int,
                       mem_quota: int | None = None) -> Any:
        if host_hit_length <= 0:
            return super().init_load_back(last_host_node, host_hit_length, mem_quota)
        chain = []
        node = last_host_node
        while node is not self.root_node and node.evicted and node.backuped:
            chain.append(node)
            node = node.parent
        chain.reverse()
        leased = []
        for i, n in enumerate(chain):
            ids = [int(b) for b in n.component_data[BASE_COMPONENT_TYPE].host_value]
            if not self.host_pool.lease(ids):
                # n's blocks are gone from kvtierd: n and what hangs below it leave the
                # tree (recomputed); the chain above n can still load.
                lost = sum(len(c.key) for c in chain[i:])
                self._drop_subtree(n)
                last_host_node = chain[i - 1] if i else n.parent
                host_hit_length = max(0, host_hit_length - lost)
                break
            leased.append(ids)
        if host_hit_length <= 0 or not leased:
            for ids in leased:
                self.host_pool.unlease(ids)
            return np.empty((0,), dtype=np.int32), last_host_node, []
        out = super().init_load_back(last_host_node, host_hit_length, mem_quota)
        planned = {tuple(h) for h, _ in out[2]}
        for ids in leased:
            if tuple(ids) not in planned:
                self.host_pool.unlease(ids)
        return out

    def _drop_subtree(self, node: Any) -> None:
        """Remove ``node`` (a host tombstone) and its subtree (tombstones too: nothing
        below a tombstone is on the device), freeing their host ids."""
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            cd = n.component_data[BASE_COMPONENT_TYPE]
            if cd.host_value is not None:
                self.host_pool.free([int(b) for b in cd.host_value])
                cd.host_value = None
            self.evictable_host_leaves.discard(n)
            self.evictable_device_leaves.discard(n)
        parent = node.parent
        self._remove_leaf_from_parent(node)
        self._update_evictable_leaf_sets(parent)


install()


def main() -> None:
    """``python -m kvtier.sglang_jax``: sglang-jax's ``launch_server`` with this module
    imported in every process it spawns (they import the main module again)."""
    from sgl_jax.launch_server import main as launch

    launch()


if __name__ == "__main__":
    main()
