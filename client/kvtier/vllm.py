"""vLLM KV connector: a vLLM engine saves and loads its prefix KV through kvtierd.

``pip install kvtier[vllm]``, start ``kvtierd``, then::

    vllm serve MODEL --kv-transfer-config \\
        '{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier.vllm","kv_role":"kv_both"}'

(once kvtier is installed, ``"kv_connector":"KVTierConnector"`` alone works too: kvtier
registers it through vLLM's ``vllm.general_plugins`` entry point, :mod:`kvtier._vllm_plugin`).

What it does, per request:

* **Scheduler** (``get_num_new_matched_tokens``): the prompt's full-block keys are
  ``kvtier.block_keys`` over its token ids with a salt (the connector's ``salt``, the
  request's ``cache_salt`` and LoRA adapter), so hits survive engine restarts and hold
  across processes and hosts.  One ``Lookup`` per request (per tensor-parallel rank,
  concurrently), with ``prefetch`` so blocks below DRAM are promoted before the load.  It
  claims the leading blocks every rank holds, beyond what vLLM's own prefix cache has,
  never the block holding the last prompt token.  Requests with multimodal inputs or
  prompt embeddings are never matched nor saved (their KV is not a function of the token
  ids alone).
* **Worker** (``start_load_kv``): one ``Acquire`` per loading request; each leased block
  is copied whole into its vLLM block of every layer (``kvtier.torch.load``: one copy per
  byte on CPU, one DMA from page-locked slots on CUDA), before the step's forward pass;
  with ``load_mode: "async"`` in a background thread instead, the request waiting in
  ``WAITING_FOR_REMOTE_KVS`` until ``get_finished`` reports it (``"auto"``: in the
  background only when a block to load was below DRAM at the lookup).  ``wait_for_save``: every block of
  the step that became full is gathered from all layers into reserved slots and committed
  in one ``Reserve`` + ``Commit`` for the whole step (blocks already stored are skipped).
* **Roles** (``kv_role``, for disaggregated prefill/decode): ``kv_both`` saves and loads;
  ``kv_producer`` saves within the step (its HTTP answer leaves after its blocks are
  committed) and announces them in ``kv_transfer_params``; ``kv_consumer`` loads and never
  saves, waiting up to ``producer_wait`` for announced blocks still in flight
  (:mod:`kvtier._vllm_roles`; ``kvtier pd-proxy`` in front, :mod:`kvtier.pd_proxy`).
* **Failure is a recompute**: kvtierd down (at start or later), restarted, a block evicted
  between lookup and load, a checksum failure, a full cache: the request is served all the
  same.  Blocks that did not load are reported through ``get_block_ids_with_load_errors``
  and vLLM recomputes them (the connector sets vLLM's ``kv_load_failure_policy`` to
  ``recompute`` unless ``load_failure_policy: "fail"`` is configured).  Every RPC has a
  deadline (``timeout``); each kind of failure is counted and logged at most once a minute.

A kvtier block is one vLLM block of every layer (the pages of all layers of one block,
layer-major), copied byte for byte: the block interior stays the attention backend's own
(vLLM's CPU backend keeps K transposed inside a block), which is why the namespace names
the device type, the attention backend and vLLM's minor version besides the model and the
geometry.  Each tensor-parallel rank stores its own shard in its own namespace (a latent
every rank holds alike, MLA's, is stored once).  Hybrid models (several KV cache groups:
sliding window + full attention) keep vLLM's hybrid allocator: each group's blocks have
keys of their own, and a sliding-window group loads only its window (:mod:`kvtier._kv_groups`).

``kv_connector_extra_config`` keys (all optional): see :class:`ConnectorConfig`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Final

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier import errors
from kvtier import torch as kt
from kvtier._core import Tier
from kvtier._kv_groups import (
    FULL,
    NULL_BLOCK_ID,
    SLIDING,
    CacheGeometry,
    GroupPlan,
    Unsupported,
    fails_whole,
    geometry_of,
    load_range,
    longest_hit,
    plan_groups,
)
from kvtier._reconnect import LazyClient
from kvtier._vllm_roles import Role, Waits, announced_blocks, producer_params
from kvtier.client import Client
from kvtier.hashing import block_keys, request_salt
from kvtier.paged import NamespaceArgs, PagedKVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A name under "vllm." so the engine's log handlers (and format) apply.
logger = init_logger("vllm.kvtier")

LOAD_MODES: Final = ("sync", "async", "off", "auto")
#: Background saves queued at most before wait_for_save waits for them.
_MAX_PENDING_SAVES: Final = 8
FAILURE_POLICIES: Final = ("recompute", "fail")
#: Keys of the model's config.json that do not change its KV.
_VOLATILE_CONFIG: Final = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})
#: Counters the connector keeps (vLLM stats and Prometheus ``vllm:kvtier_<name>``).
COUNTERS: Final = (
    "lookups",           # scheduler: Lookup calls
    "lookup_seconds",    # scheduler: time in Lookup calls (the engine's scheduling loop waits)
    "wait_seconds",      # scheduler (kv_consumer): requests held for announced blocks, from
                         # the first hold to the lookup that let them go
    "lower_blocks",      # scheduler: claimed blocks below DRAM at the lookup (to be promoted)
    "hit_tokens",        # scheduler: prompt tokens claimed from kvtier
    "refused_requests",  # scheduler: requests never matched (multimodal, prompt embeds)
    "loaded_blocks",     # worker: blocks copied from kvtier into the paged cache
    "load_seconds",      # worker: time in loads (Acquire, copies, Release)
    "load_acquire_seconds",  # worker: of load_seconds, the Acquire (kvtierd's promotions)
    "load_copy_seconds",     # worker: of load_seconds, the copies (and checksums)
    "failed_blocks",     # worker: blocks claimed but not loaded (reported to vLLM)
    "saved_blocks",      # worker: blocks committed to kvtier
    "skipped_blocks",    # worker: blocks to save that kvtier already had
    "save_seconds",      # worker: time in saves (Reserve, copies, Commit)
    "failures_unavailable",  # kvtierd unreachable or past the deadline
    "failures_evicted",      # claimed blocks gone by the time of the load
    "failures_corrupted",    # blocks that failed their checksum (never served)
    "failures_capacity",     # saves refused for lack of room
    "failures_other",        # anything else (logged with its message)
)


# ---------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` of the connector; unknown keys are refused."""

    #: kvtierd's socket directory (default: ``$KVTIER_SOCKET_DIR``, else
    #: ``$XDG_RUNTIME_DIR/kvtier``, else ``/tmp/kvtier-$UID``, as every kvtier client).
    socket_dir: str | None = None
    #: First component of the namespace names (engines with different prefixes never share).
    namespace_prefix: str = "vllm"
    #: Hashed into every key: engines with different salts never share blocks (tenants).
    salt: str = ""
    #: ``sync``: load in the step that computes the request's tail, before its forward pass;
    #: ``async``: load in a background thread while other requests' steps run (the request
    #: waits in ``WAITING_FOR_REMOTE_KVS``); ``auto``: ``sync`` when every block to load was
    #: in DRAM at the lookup, ``async`` when one was below it (SSD, shared or cluster tier:
    #: a read from disk does not hold up the other requests' step); ``off``: save only.
    load_mode: str = "sync"
    #: Store the blocks this engine computes.
    save: bool = True
    #: Copy saves in the background, off the step that computed them (CPU caches).  Off by
    #: default: a save still in flight when the engine stops is lost.
    async_save: bool = False
    #: The model's identity in namespaces (default: the model path or name and its
    #: revision, with a digest of its config; set it to share across paths, e.g. "llama3-8b@rev2").
    model_id: str | None = None
    #: Deadline of each kvtierd call, seconds.
    timeout: float = 2.0
    #: xxh3-64 over every saved block, verified on every load.
    checksum: bool = True
    #: Lookups start promoting SSD/shared-tier hits into DRAM.
    prefetch: bool = True
    #: What vLLM does with blocks that failed to load: ``recompute`` them, or ``fail`` the request.
    load_failure_policy: str = "recompute"
    #: ``kv_consumer``: seconds a request waits for blocks its producer announced (in
    #: ``kv_transfer_params``) that kvtierd does not show yet, before recomputing them.
    producer_wait: float = 5.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        names = list(defaults)
        unknown = sorted(set(extra) - set(names))
        if unknown:
            raise ValueError(f"kvtier.vllm: unknown kv_connector_extra_config key(s) "
                             f"{', '.join(map(repr, unknown))}; known keys: {', '.join(names)}")
        out: dict[str, Any] = {}
        for name, value in extra.items():
            default = defaults[name]
            if name in ("socket_dir", "model_id"):
                if value is not None and (not isinstance(value, str) or not value):
                    raise ValueError(f"kvtier.vllm: {name} must be a non-empty string, "
                                     f"got {value!r}")
            elif isinstance(default, bool):
                value = _as_bool(name, value)
            elif isinstance(default, float):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                        not 0 < value <= 600:
                    raise ValueError(f"kvtier.vllm: {name} must be seconds in (0, 600], "
                                     f"got {value!r}")
                value = float(value)
            elif not isinstance(value, str):
                raise ValueError(f"kvtier.vllm: {name} must be a string, got {value!r}")
            out[name] = value
        cfg = cls(**out)
        if cfg.load_mode not in LOAD_MODES:
            raise ValueError(f"kvtier.vllm: load_mode must be one of {', '.join(LOAD_MODES)}, "
                             f"got {cfg.load_mode!r}")
        if cfg.load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kvtier.vllm: load_failure_policy must be one of "
                             f"{', '.join(FAILURE_POLICIES)}, got {cfg.load_failure_policy!r}")
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,32}", cfg.namespace_prefix):
            raise ValueError(f"kvtier.vllm: namespace_prefix must be 1..32 characters of "
                             f"[A-Za-z0-9._-], got {cfg.namespace_prefix!r}")
        return cfg


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError(f"kvtier.vllm: {name} must be true or false, got {value!r}")


# ---------------------------------------------------------------- keys, salts, namespaces
def model_fingerprint(vllm_config: VllmConfig, model_id: str | None) -> tuple[str, str]:
    """(identity, digest): the model's name and a digest of everything that shapes its KV bytes.

    The digest covers the model's config (architecture, rope, ...), dtype, KV cache dtype,
    quantization, the device type, the attention backend and vLLM's major.minor version (the
    block interior is the backend's, and may change between vLLM releases).
    """
    from vllm.platforms import current_platform

    mc = vllm_config.model_config
    identity = model_id or f"{mc.model}@{mc.revision or 'default'}"
    try:
        hf = {k: v for k, v in mc.hf_config.to_dict().items() if k not in _VOLATILE_CONFIG}
    except Exception:  # noqa: BLE001 (a config that cannot be listed is still a config)
        hf = {"repr": repr(mc.hf_config)}
    attention = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    parts = {
        "identity": identity,
        "config": hf,
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "quantization": str(mc.quantization),
        "device": str(current_platform.device_type),
        "attention_backend": str(attention or "auto"),
        "vllm": ".".join(vllm.__version__.split(".")[:2]),
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return identity, hashlib.sha256(text.encode()).hexdigest()[:16]


def namespace_args(prefix: str, identity: str, digest: str, geometry: CacheGeometry,
                   tp_rank: int, tp_size: int, replicas: int = 1) -> NamespaceArgs:
    """``kvtier.Client`` keywords of tensor-parallel rank ``tp_rank``'s namespace.

    ``replicas`` > 1: the ranks ``tp_rank .. tp_rank + replicas - 1`` hold identical KV (an
    MLA latent): one namespace for all of them (``tp0-3of4``), with no single rank in it.
    """
    base = identity.rsplit("@", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    short = re.sub(r"[^A-Za-z0-9._-]", "-", base)[:40] or "model"
    ranks = f"{tp_rank}-{tp_rank + replicas - 1}" if replicas > 1 else f"{tp_rank}"
    name = f"{prefix}/{short}-{digest}/tp{ranks}of{tp_size}/{geometry.describe()}"
    uid = f"{identity[:200]}#{digest}"
    return NamespaceArgs(namespace=name[:128], block_bytes=geometry.block_bytes, model_uid=uid)


def refusal(request: Request) -> str | None:
    """Why a request's KV must not be matched or saved by token ids (None: it may be)."""
    if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    return None


def claimable_blocks(hits_per_rank: Sequence[int], prompt_tokens: int, block_tokens: int) -> int:
    """Leading blocks to claim: held by every rank, not covering the last prompt token."""
    if not hits_per_rank:
        return 0
    usable = max(0, prompt_tokens - 1) // block_tokens
    return max(0, min(min(hits_per_rank), usable))


# ---------------------------------------------------------------- counters and logs
class _Counters:
    """Thread-safe counters; ``take()`` returns and resets them (one stats interval)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        if value:
            with self._lock:
                self._data[name] = self._data.get(name, 0) + value

    def take(self) -> dict[str, float]:
        with self._lock:
            data, self._data = self._data, {}
        return data


class _Throttle:
    """Logs each kind of event at most once per ``interval`` s, saying how many it held back."""

    def __init__(self, interval: float = 60.0) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        suffix = f" ({held} more like it in the last {self._interval:.0f} s)" if held else ""
        logger.warning("kvtier: " + message + suffix, *args, exc_info=exc_info)


def _failure_kind(exc: BaseException) -> str:
    if isinstance(exc, errors.Corrupted):
        return "corrupted"
    if isinstance(exc, errors.CapacityExhausted):
        return "capacity"
    if isinstance(exc, (errors.Unavailable, errors.SessionLost, OSError)):
        return "unavailable"
    return "other"


class _Link:
    """A kvtier client for one namespace, (re)connected lazily with backoff.

    ``client()`` is None while kvtierd cannot be reached; it tries again after 0.5 s,
    doubling up to 30 s.  Once connected, the client rides through daemon restarts itself.
    """

    def __init__(self, cfg: ConnectorConfig, args: NamespaceArgs, counters: _Counters,
                 throttle: _Throttle) -> None:
        self._cfg, self.args = cfg, args
        self._counters, self._throttle = counters, throttle
        self._lazy = LazyClient(
            lambda: Client(cfg.socket_dir, **args, timeout=cfg.timeout, checksum=cfg.checksum),
            on_failure=self._connect_failed, on_open=self._opened)

    def _connect_failed(self, exc: BaseException) -> None:
        self._counters.add(f"failures_{_failure_kind(exc)}")
        self._throttle.warn("connect", "cannot open namespace %s (%s: %s); is kvtierd "
                            "running? Serving without it, retrying", self.args["namespace"],
                            type(exc).__name__, exc)

    def _opened(self, client: Client) -> None:
        logger.info("kvtier: namespace %s (block %d bytes) at %s", self.args["namespace"],
                    self.args["block_bytes"], client.grpc_path)

    def client(self) -> Client | None:
        return self._lazy.get()

    def close(self) -> None:
        self._lazy.close()


# ---------------------------------------------------------------- stats surfaced by vLLM
@dataclasses.dataclass
class KVTierConnectorStats(KVConnectorStats):
    """Counters of one interval (sums across workers and the scheduler)."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k in COUNTERS:
            v = self.data.get(k, 0)
            if v:
                out[k] = round(v, 4) if k.endswith("_seconds") else int(v)
        return out


class KVTierPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtier_<counter>_total`` for each of :data:`COUNTERS`, per engine."""

    def __init__(self, vllm_config: VllmConfig,
                 metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {
            name: self._counter_cls(name=f"vllm:kvtier_{name}",
                                    documentation=f"kvtier connector: {name.replace('_', ' ')}",
                                    labelnames=labelnames)
            for name in COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in (transfer_stats_data or {}).items():
            counter = self._counters.get(name)
            if counter is not None and value:
                counter.labels(*labels).inc(value)


# ---------------------------------------------------------------- scheduler -> worker
@dataclasses.dataclass(frozen=True, slots=True)
class LoadSpec:
    """Blocks of one request to load: ``keys[i]`` into vLLM block ``block_ids[i]``."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    #: Load in the background (vLLM was told the load is asynchronous); None: as the
    #: worker's ``load_mode`` says.
    background: bool | None = None
    #: The KV cache group the blocks belong to (vLLM's group index).
    group: int = 0


@dataclasses.dataclass
class KVTierMetadata(KVConnectorMetadata):
    """One step's work: loads per request, and one batch of blocks to save."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    save_keys: list[bytes] = dataclasses.field(default_factory=list)
    save_block_ids: list[int] = dataclasses.field(default_factory=list)
    #: The KV cache group of each block to save (empty: every one is group 0's).
    save_groups: list[int] = dataclasses.field(default_factory=list)
    #: Every vLLM block handed to a request in this step (the only ones it may write).
    new_block_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Request:
    """The scheduler's view of one request."""

    request: Request
    salt: bytes
    refused: str | None
    prompt_keys: list[bytes]
    #: The request's vLLM blocks, per KV cache group.
    block_ids: list[list[int]] = dataclasses.field(default_factory=list)
    stored: int = 0  # leading blocks kvtier holds (found or saved)
    hits: int | None = None  # claimable blocks found by the last lookup (None: not looked up)
    hits_local: int = 0  # vLLM's own blocks that lookup counted on
    group_keys: dict[int, list[bytes]] = dataclasses.field(default_factory=dict)
    tiers: list[Tier] = dataclasses.field(default_factory=list)
    local_tokens: int = 0  # tokens vLLM's own prefix cache had at the lookup
    lookup_failed: bool = False  # the last lookup did not reach kvtierd (on some rank)
    background: bool = False  # vLLM was told this request's load is asynchronous
    looked: float = 0.0  # seconds the last lookup took

    def keys_upto(self, blocks: int, block_tokens: int) -> list[bytes]:
        if blocks <= len(self.prompt_keys):
            return self.prompt_keys[:blocks]
        tokens = self.request.all_token_ids[: blocks * block_tokens]
        return block_keys(list(tokens), block_tokens, self.salt)

    def prompt_keys_of(self, plan: GroupPlan) -> list[bytes]:
        """The prompt's keys in group ``plan`` (derived once per request)."""
        keys = self.group_keys.get(plan.index)
        if keys is None:
            keys = self.group_keys[plan.index] = plan.keys(self.prompt_keys)
        return keys


class _Scheduler:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 cfg: ConnectorConfig, counters: _Counters, throttle: _Throttle,
                 tp_size: int | None = None) -> None:
        """``tp_size``: the shards a block is stored in (default: the tensor-parallel size;
        1 where one process holds every rank's KV, as a JAX engine's global arrays do)."""
        self._cfg, self._counters, self._throttle = cfg, counters, throttle
        tp = int(vllm_config.parallel_config.tensor_parallel_size) if tp_size is None \
            else tp_size
        self._plans = plan_groups(kv_cache_config, tp)
        self._block = self._plans[0].block_tokens
        # vLLM takes block-level load failures from single-group models only, and recomputes
        # from the first bad block as full attention would: with several groups, or a
        # sliding window, every load is an asynchronous receive, failed as a whole.
        self._fail_whole = fails_whole(kv_cache_config)
        self._windows = any(p.kind == SLIDING for p in self._plans)
        identity, digest = model_fingerprint(vllm_config, cfg.model_id)
        links: dict[str, _Link] = {}
        #: Per plan, one link per copy of the group (per rank; one for a replicated latent).
        self._plan_links: list[list[_Link]] = []
        for plan in self._plans:
            mine = []
            for shard in range(0, tp, plan.replicas):
                args = namespace_args(cfg.namespace_prefix, identity, digest, plan.geometry,
                                      shard, tp, plan.replicas)
                link = links.get(args["namespace"])
                if link is None:
                    link = links[args["namespace"]] = _Link(cfg, args, counters, throttle)
                mine.append(link)
            self._plan_links.append(mine)
        self._links = list(links.values())
        copies = max(len(links) for links in self._plan_links)
        self._pool = ThreadPoolExecutor(copies, thread_name_prefix="kvtier-lookup") \
            if copies > 1 else None
        self._reqs: dict[str, _Request] = {}
        self._loads: list[LoadSpec] = []
        self._lookup_failed = False  # the lookup in progress did not reach some copy
        for link in self._links:
            link.client()  # connect now, not in the first request's lookup

    def _state(self, request: Request) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            why = refusal(request)
            salt = request_salt(self._cfg.salt, getattr(request, "cache_salt", None),
                                getattr(request, "lora_request", None))
            keys = [] if why else block_keys(list(request.prompt_token_ids or ()), self._block,
                                             salt)
            st = self._reqs[request.request_id] = _Request(request, salt, why, keys)
            if why:
                self._counters.add("refused_requests")
                logger.debug("kvtier: request %s not cached by kvtier: %s", request.request_id,
                             why)
        return st

    def _lookup_one(self, link: _Link, keys: list[bytes]) -> list[Tier] | None:
        """The tiers of the leading present keys; None when kvtierd could not be asked."""
        client = link.client()
        if client is None:
            return None
        try:
            return client.lookup_tiers(keys, prefetch=self._cfg.prefetch)
        except Exception as exc:  # noqa: BLE001 (a cache lookup never takes the engine down)
            kind = _failure_kind(exc)
            self._counters.add(f"failures_{kind}")
            self._throttle.warn(f"lookup-{kind}", "lookup in %s failed (%s: %s); the prompt is "
                                "computed", link.args["namespace"], type(exc).__name__, exc)
            return None

    def _held(self, plan_at: int, keys: list[bytes]) -> list[Tier]:
        """The tiers of the leading ``keys`` every copy of group ``plan_at`` holds."""
        if not keys:
            return []
        links = self._plan_links[plan_at]
        if self._pool is None or len(links) == 1:
            answers = [self._lookup_one(link, keys) for link in links]
        else:
            answers = list(self._pool.map(lambda link: self._lookup_one(link, keys), links))
        if any(a is None for a in answers):
            self._lookup_failed = True  # (kvtierd unreachable for some copy: a P/D consumer
            # does not wait for its producer's blocks then)
        return min((a or [] for a in answers), key=len)

    def _lookup(self, st: _Request, local: int, usable: int) -> int:
        """The request's hit in blocks (``local`` when kvtier adds none); sets what kvtier
        holds (``stored``) and the tiers of the hit."""
        at = {p.index: i for i, p in enumerate(self._plans)}
        self._lookup_failed = False
        full_hits: list[int] = []
        tiers: list[Tier] | None = None
        for i, plan in enumerate(self._plans):
            if plan.kind == FULL:
                # Every full block, the one holding the last token too: it is never claimed,
                # but if kvtier has it the step that recomputes it need not offer it again.
                held = self._held(i, st.prompt_keys_of(plan))
                full_hits.append(len(held))
                tiers = held if tiers is None else tiers

        def present(plan: GroupPlan, start: int, stop: int) -> int:
            return len(self._held(at[plan.index], st.prompt_keys_of(plan)[start:stop]))

        hit = longest_hit(self._plans, present, local, usable, full_hits)
        if self._windows:
            st.stored = max(st.stored, hit)
        else:
            st.stored = max(st.stored, min(full_hits))
        st.tiers = (tiers or [])[:hit]
        st.lookup_failed = self._lookup_failed
        return hit

    def matched(self, request: Request, num_computed_tokens: int) -> int:
        st = self._state(request)
        if st.refused or self._cfg.load_mode == "off":
            return 0
        prompt = len(request.prompt_token_ids or ())
        usable = max(0, prompt - 1) // self._block
        local = num_computed_tokens // self._block
        # Blocks vLLM's own prefix cache supplies were saved when this engine computed them,
        # or were loaded from kvtier: saving them again would cost a Reserve for nothing.
        st.stored = max(st.stored, local)
        if usable * self._block <= num_computed_tokens:
            return 0  # vLLM already has every block kvtier could give
        # A full-attention hit is a prefix, whatever vLLM has; a window is looked up beyond
        # vLLM's own blocks only, so it depends on them.
        base = local if self._windows else 0
        if st.hits is None or st.hits_local != base:
            self._counters.add("lookups")
            t0 = time.perf_counter()
            st.hits, st.hits_local = self._lookup(st, base, usable), base
            st.looked = time.perf_counter() - t0
            self._counters.add("lookup_seconds", st.looked)
        st.local_tokens = num_computed_tokens
        return max(0, st.hits * self._block - num_computed_tokens)

    def load_async(self, request: Request) -> bool:
        """Whether the request's claimed blocks load in the background (``async``, or
        ``auto`` with a block below DRAM at the lookup); remembered for its load."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return False
        if self._fail_whole:
            st.background = True  # see __init__: the only way vLLM takes a failed load
        elif self._cfg.load_mode == "auto":
            first = st.local_tokens // self._block
            st.background = any(t != Tier.DRAM for t in st.tiers[first:])
        else:
            st.background = self._cfg.load_mode == "async"
        return st.background

    def hit_sources(self, request: Request, tokens: int) -> dict[CacheHitSource, int]:
        st = self._reqs.get(request.request_id)
        if not tokens or st is None:
            return {}
        first = st.local_tokens // self._block
        out: dict[CacheHitSource, int] = {}
        for i in range(first, first + math.ceil(tokens / self._block)):
            tier = st.tiers[i] if i < len(st.tiers) else Tier.DRAM
            src = CacheHitSource.HOST if tier == Tier.DRAM else CacheHitSource.DISK
            n = min(self._block, tokens - (i - first) * self._block)
            out[src] = out.get(src, 0) + n
        return out

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        hits, st.hits = st.hits, None  # a later scheduling attempt looks up afresh
        if num_external <= 0 or not hits:
            return
        all_ids = blocks.get_block_ids()
        local = st.local_tokens // self._block
        hit = min(local + math.ceil(num_external / self._block), hits)
        loads = []
        for plan in self._plans:
            ids = all_ids[plan.index]
            # A sliding-window group loads only the blocks of the window before the hit.
            start, stop = load_range(plan, local, min(hit, len(ids)))
            if stop > start:
                loads.append(LoadSpec(request.request_id, st.prompt_keys_of(plan)[start:stop],
                                      list(ids[start:stop]), st.background, plan.index))
        if loads:
            self._loads.extend(loads)
            self._counters.add("hit_tokens", num_external)
            self._counters.add("lower_blocks", sum(1 for t in st.tiers[local:hit]
                                                   if t != Tier.DRAM))

    def build_meta(self, out: SchedulerOutput) -> KVTierMetadata:
        meta = KVTierMetadata(loads=self._loads)
        self._loads = []
        for new in out.scheduled_new_reqs:
            for ids in new.block_ids or ():
                meta.new_block_ids.extend(ids)
        for new_ids in out.scheduled_cached_reqs.new_block_ids:
            for ids in new_ids or ():
                meta.new_block_ids.extend(ids)
        if not self._cfg.save:
            return meta
        for new in out.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = [list(ids) for ids in new.block_ids]
                self._add_saves(meta, st, new.num_computed_tokens
                                + out.num_scheduled_tokens.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                st.block_ids = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                if len(st.block_ids) != len(new_ids):
                    # Never seen scheduled as new: positions unknown, so saving could put a
                    # block under another block's key.  Stop saving this request.
                    st.refused = st.refused or "block ids out of step"
                    continue
                for mine, ids in zip(st.block_ids, new_ids, strict=True):
                    mine.extend(ids)
            self._add_saves(meta, st, cached.num_computed_tokens[i]
                            + out.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _add_saves(self, meta: KVTierMetadata, st: _Request, tokens_after_step: int) -> None:
        if st.refused:
            return
        # Tokens whose KV exists after this step: scheduled draft tokens are not among
        # all_token_ids, so they never are.
        tokens = min(tokens_after_step, len(st.request.all_token_ids))
        if not st.block_ids:
            return
        full = min([tokens // self._block, *(len(st.block_ids[p.index]) for p in self._plans)])
        if full <= st.stored:
            return
        base = st.keys_upto(full, self._block)[st.stored: full]
        for plan in self._plans:
            ids = st.block_ids[plan.index][st.stored: full]
            for key, block in zip(plan.keys(base), ids, strict=True):
                # Every block of a sliding-window group is saved (each block boundary can be
                # a later hit, whose window it is); one vLLM already dropped is not there.
                if plan.kind == SLIDING and block == NULL_BLOCK_ID:
                    continue
                meta.save_keys.append(key)
                meta.save_block_ids.append(block)
                meta.save_groups.append(plan.index)
        st.stored = full

    def connector_output(self, output: KVConnectorOutput) -> None:
        # A request whose load failed as a whole (several groups, or a window) is recomputed
        # from vLLM's own prefix cache: look it up again, and save what it recomputes.
        for req_id in getattr(output, "failed_recving", None) or ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.stored, st.hits = 0, None
        bad = getattr(output, "invalid_block_ids", None)
        if not bad:
            return
        for st in self._reqs.values():  # blocks that failed to load are recomputed: save them
            for i, b in enumerate(st.block_ids[0][: st.stored] if st.block_ids else ()):
                if b in bad:
                    st.stored = i
                    break

    def hold(self, request: Request, waits: Waits) -> bool:
        """Whether a consumer's request waits for blocks its producer announced
        (``kv_transfer_params``) that the lookup did not find yet; the next attempt
        looks up afresh."""
        st = self._reqs.get(request.request_id)
        if st is None or st.refused or st.hits is None or st.lookup_failed:
            return False  # (kvtierd unreachable: waiting would only delay the recompute)
        usable = max(0, len(request.prompt_token_ids or ()) - 1) // self._block
        wanted = min(announced_blocks(getattr(request, "kv_transfer_params", None)), usable)
        if not waits.hold(request.request_id, st.hits, wanted, st.looked):
            self._counters.add("wait_seconds", waits.waited(request.request_id))
            return False
        st.hits = None
        return True

    def finished(self, request: Request) -> int:
        """Forget a request; returns the leading prompt blocks kvtier holds for it."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return 0
        return min(st.stored, len(request.prompt_token_ids or ()) // self._block)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        for link in self._links:
            link.close()


# ---------------------------------------------------------------- worker
def page_views(tensors: Sequence[torch.Tensor], num_blocks: int
               ) -> tuple[list[Any], PagedKVLayout]:
    """Each layer's KV as arrays of whole blocks, ``[num_blocks, 1, 1, block elements]``.

    A layer tensor is ``[num_blocks, ...]`` (one array: vLLM's CPU backend, FlashInfer) or
    ``[2, num_blocks, ...]`` (K and V arrays: FlashAttention); either must be contiguous, so
    the view aliases it (no copy).  A block's bytes are copied whole, never token slices.
    """
    if not tensors:
        raise Unsupported("the engine registered no KV cache tensors")
    cache: list[Any] = []
    pair = None
    for t in tensors:
        if t.ndim >= 2 and t.shape[0] == 2 and t.shape[1] % num_blocks == 0 and \
                t.shape[0] % num_blocks != 0:
            is_pair = True
        elif t.shape[0] % num_blocks == 0:
            is_pair = False
        else:
            raise Unsupported(f"a KV cache tensor of shape {list(t.shape)} has no axis of "
                              f"{num_blocks} blocks where kvtier looks for it")
        if pair is not None and is_pair != pair:
            raise Unsupported("KV cache tensors of different layouts across layers")
        pair = is_pair
        try:
            if is_pair:
                cache.append((t[0].view(num_blocks, 1, 1, -1), t[1].view(num_blocks, 1, 1, -1)))
            else:
                cache.append(t.view(num_blocks, 1, 1, -1))
        except RuntimeError as exc:
            raise Unsupported(f"a KV cache tensor of shape {list(t.shape)} and strides "
                              f"{list(t.stride())} is not contiguous per block: {exc}") from None
    first = cache[0][0] if pair else cache[0]
    layout = PagedKVLayout("kv" if pair else "single", len(cache), 1, 1, int(first.shape[-1]),
                           str(first.dtype).removeprefix("torch."))
    return cache, layout


@dataclasses.dataclass(frozen=True, slots=True)
class _GroupIO:
    """Where one KV cache group's blocks go: its namespace, its layers' block views."""

    plan: GroupPlan
    link: _Link
    cache: list[Any]
    layout: PagedKVLayout
    writes: bool  # this rank stores the group (one rank per copy of a replicated latent)


#: One group's save: its blocks' keys and what to store under them (the blocks' ids, or
#: what the worker's ``_detach`` made of them for a background save).
_SaveWork = tuple[_GroupIO, list[bytes], Any]


class _Worker:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 cfg: ConnectorConfig, counters: _Counters, throttle: _Throttle) -> None:
        self._vllm_config, self._kv_cache_config = vllm_config, kv_cache_config
        self._cfg, self._counters, self._throttle = cfg, counters, throttle
        #: Per KV cache group (vLLM's index); empty until register() (or when it failed:
        #: every load then fails, so vLLM recomputes what the scheduler claimed).
        self._groups: dict[int, _GroupIO] = {}
        self._links: list[_Link] = []
        self._link: _Link | None = None  # the first group's (one-group models: the only one)
        self._cache: list[Any] = []
        self._layout: PagedKVLayout | None = None
        #: Several groups or a window: a failed load fails its request (see _Scheduler).
        self._fail_whole = fails_whole(kv_cache_config)
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._saver: ThreadPoolExecutor | None = None
        #: Background saves in submission order, with the vLLM blocks each one reads.
        self._pending: list[tuple[Future[None], frozenset[int]]] = []
        self._loader: ThreadPoolExecutor | None = None
        #: Background loads (load_mode "async"): request id -> blocks that did not load.
        self._loading: dict[str, Future[list[int]]] = {}
        self._loaded_async = False

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp = int(self._vllm_config.parallel_config.tensor_parallel_size)
        rank = int(get_tensor_model_parallel_rank()) if tp > 1 else 0
        plans = plan_groups(self._kv_cache_config, tp)
        identity, digest = model_fingerprint(self._vllm_config, self._cfg.model_id)
        num_blocks = int(self._kv_cache_config.num_blocks)
        links: dict[str, _Link] = {}
        groups: dict[int, _GroupIO] = {}
        for plan in plans:
            missing = [n for n in plan.layer_names if n not in kv_caches]
            if missing:
                raise Unsupported(f"layers {missing[:3]} have no KV cache tensor")
            cache, layout = page_views([kv_caches[n] for n in plan.layer_names], num_blocks)
            if layout.block_bytes != plan.geometry.block_bytes:
                raise Unsupported(f"a block of the KV cache tensors of group {plan.index} is "
                                  f"{layout.block_bytes} bytes, the KV cache spec says "
                                  f"{plan.geometry.block_bytes}")
            args = namespace_args(self._cfg.namespace_prefix, identity, digest, plan.geometry,
                                  plan.shard(rank), tp, plan.replicas)
            link = links.get(args["namespace"])
            if link is None:
                link = links[args["namespace"]] = _Link(self._cfg, args, self._counters,
                                                        self._throttle)
            groups[plan.index] = _GroupIO(plan, link, cache, layout, plan.writes(rank))
        first = groups[plans[0].index]
        on_cpu = all(t.device.type == "cpu" for t in kv_caches.values())
        if on_cpu:
            logger.info("kvtier: CPU KV cache of %d blocks, %s", num_blocks,
                        "native block copies" if kt.native_copies(first.cache, first.layout)
                        else "per-page torch copies (a page is not contiguous)")
        if len(plans) > 1 or first.plan.replicas > 1:
            logger.info("kvtier: KV cache groups %s", ", ".join(
                f"{g.plan.describe()} -> {g.link.args['namespace']}"
                f"{'' if g.writes else ' (read only: another rank stores it)'}"
                for g in groups.values()))
        self._start_threads(saves=self._cfg.async_save and on_cpu)
        self._groups, self._links = groups, list(links.values())
        self._link, self._cache, self._layout = first.link, first.cache, first.layout
        for link in self._links:
            link.client()  # connect now; says so in the log if kvtierd is not there

    def _start_threads(self, saves: bool) -> None:
        """The background threads: one for saves (``saves``), one for loads (``load_mode``
        ``async`` or ``auto``)."""
        if saves:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvtier-save")
        if self._cfg.load_mode in ("async", "auto"):
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")

    def _failed(self, what: str, exc: BaseException, namespace: str) -> None:
        kind = _failure_kind(exc)
        self._counters.add(f"failures_{kind}")
        self._throttle.warn(f"{what}-{kind}", "%s in %s failed (%s: %s); %s", what, namespace,
                            type(exc).__name__, exc,
                            "the blocks are recomputed" if what == "load" else "not stored",
                            exc_info=kind == "other")  # "other" may be a bug: keep its trace

    def load(self, meta: KVTierMetadata) -> None:
        """Copy the step's hits into their blocks: now, or in the background (async)."""
        if not meta.loads:
            return
        by_req: dict[str, list[LoadSpec]] = {}
        for spec in meta.loads:  # one spec per request and KV cache group
            by_req.setdefault(spec.req_id, []).append(spec)
        for req_id, specs in by_req.items():
            first = specs[0]
            background = first.background if first.background is not None else \
                self._loader is not None
            if not background and not self._fail_whole:
                self._load_errors.update(self._load_specs(specs))
                continue
            if self._loader is None:  # vLLM waits for get_finished to name it: load it now
                fut: Future[list[int]] = Future()
                fut.set_result(self._load_specs(specs))
                self._loading[req_id] = fut
                continue
            if not self._loaded_async:
                self._loaded_async = True
                logger.info("kvtier: loading in the background (load_mode %s); requests wait "
                            "for their blocks in WAITING_FOR_REMOTE_KVS", self._cfg.load_mode)
            self._loading[req_id] = self._loader.submit(self._load_specs, specs, True)

    def finished_loads(self) -> set[str]:
        """Requests whose background load ended; their failed blocks join :meth:`load_errors`
        (several groups: the request joins :meth:`failed_loads`).

        vLLM asks for load errors right after this, in the same step, as it requires.
        """
        done = {r for r, fut in self._loading.items() if fut.done()}
        for req_id in done:
            failed = self._finish_load(req_id, self._loading.pop(req_id).result())
            if self._fail_whole:
                if failed:
                    self._failed_reqs.add(req_id)
            else:
                self._load_errors.update(failed)
        return done

    def failed_loads(self) -> set[str]:
        """Requests :meth:`finished_loads` named whose load failed, in part or whole (models
        with several KV cache groups: vLLM recomputes such a request)."""
        out, self._failed_reqs = self._failed_reqs, set()
        return out

    def _finish_load(self, req_id: str, failed: list[int]) -> list[int]:
        """On the engine's thread, once the load of ``req_id`` that :meth:`load` left to
        the load thread (or to vLLM's ``get_finished``) is done: what is left of it to
        do, done; returns the vLLM blocks that did not load (``failed``, the load thread's
        answer, and any more).  The torch worker's copies are done by then: nothing left."""
        return failed

    def _load_specs(self, specs: Sequence[LoadSpec], background: bool = False) -> list[int]:
        """Load one request's hits (every group); returns the vLLM blocks that did not load.

        ``background``: on the load thread (:meth:`_finish_load` follows on the engine's)."""
        t0 = time.perf_counter()
        failed: list[int] = []
        for spec in specs:
            io = self._groups.get(spec.group)
            client = io.link.client() if io is not None else None
            if io is None or client is None:
                self._counters.add("failures_unavailable")
                n = 0
            else:
                n = self._load_one(client, spec, io, background)
            self._counters.add("loaded_blocks", n)
            self._counters.add("failed_blocks", len(spec.keys) - n)
            failed.extend(spec.block_ids[n:])
        self._counters.add("load_seconds", time.perf_counter() - t0)
        return failed

    def _copy_in(self, client: Client, spec: LoadSpec, io: _GroupIO,
                 phases: dict[str, float], background: bool = False) -> int:
        """Copy the leading stored blocks of ``spec`` into the engine's cache; how many.

        ``background``: on the load thread (the torch worker copies alike either way).
        Raises as ``kvtier.torch.load`` (the JAX engines' worker copies through
        ``kvtier.jax`` instead)."""
        return kt.load(client, spec.keys, io.cache, spec.block_ids, layout=io.layout,
                       phases=phases)

    def _copy_out(self, client: Client, io: _GroupIO, keys: list[bytes], source: Any) -> int:
        """Store ``source`` under ``keys``; how many were written.  ``source``: blocks of
        the engine's cache (their ids), or what :meth:`_detach` made of them."""
        return kt.save(client, io.cache, source, keys, layout=io.layout)

    def _load_one(self, client: Client, spec: LoadSpec, io: _GroupIO,
                  background: bool = False) -> int:
        ns = io.link.args["namespace"]
        for attempt in range(2):
            try:
                phases: dict[str, float] = {}
                try:
                    n = self._copy_in(client, spec, io, phases, background)
                finally:
                    self._counters.add("load_acquire_seconds", phases.get("acquire", 0.0))
                    self._counters.add("load_copy_seconds", phases.get("copy", 0.0))
            except errors.Corrupted as exc:
                # The client dropped the bad block (it becomes a miss, counted by the daemon);
                # the blocks before it are still good: load those once more.
                self._failed("load", exc, ns)
                if attempt == 0 and exc.key in spec.keys:
                    continue
                return 0
            except Exception as exc:  # noqa: BLE001 (a failed load is a recompute, not an outage)
                self._failed("load", exc, ns)
                return 0
            if n < len(spec.keys):
                self._counters.add("failures_evicted")
                self._throttle.warn("load-evicted", "%d of %d blocks of request %s were gone "
                                    "from %s at load time; they are recomputed",
                                    len(spec.keys) - n, len(spec.keys), spec.req_id, ns)
            return n
        return 0

    def load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def save(self, meta: KVTierMetadata) -> None:
        """Store the step's new full blocks: in the background for a CPU cache.

        A background save overlaps the step's output (the first token of a prefill)
        instead of delaying it.  Its source blocks stay valid until :meth:`settle`,
        which the connector calls at the start of the next step, before anything can
        free and overwrite them.  CUDA caches are saved at once (their copies are DMAs
        ordered on the engine's stream).  A group whose copy another rank stores (an MLA
        latent) is not saved by this one.
        """
        if not meta.save_keys or not self._groups:
            return
        default = next(iter(self._groups))
        groups = meta.save_groups or [default] * len(meta.save_keys)
        batches: dict[int, tuple[list[bytes], list[int]]] = {}
        seen: set[bytes] = set()
        for k, b, g in zip(meta.save_keys, meta.save_block_ids, groups, strict=True):
            io = self._groups.get(g)
            if io is None or not io.writes or k in seen:  # k seen: two requests, one prefix
                continue
            seen.add(k)
            keys, ids = batches.setdefault(g, ([], []))
            keys.append(k)
            ids.append(b)
        if not batches:
            return
        work: list[_SaveWork] = [(self._groups[g], keys, ids)
                                 for g, (keys, ids) in batches.items()]
        if self._saver is None:
            self._save_now(work)
            return
        if len(self._pending) >= _MAX_PENDING_SAVES:
            self.settle()
        work, blocks = self._detach(work)
        if work:
            self._pending.append((self._saver.submit(self._save_now, work), blocks))

    def _detach(self, work: list[_SaveWork]) -> tuple[list[_SaveWork], frozenset[int]]:
        """What a background save of ``work`` reads, and the vLLM blocks it reads until it
        ends (:meth:`settle`).  A CPU cache's save reads the blocks themselves."""
        return work, frozenset(b for _, _, ids in work for b in ids)

    def _save_now(self, work: list[_SaveWork]) -> None:
        t0 = time.perf_counter()
        try:
            for io, keys, source in work:
                client = io.link.client()
                if client is None:
                    continue
                try:
                    written = self._copy_out(client, io, keys, source)
                except Exception as exc:  # noqa: BLE001 (a failed save is a later miss)
                    self._failed("save", exc, io.link.args["namespace"])
                    continue
                self._counters.add("saved_blocks", written)
                self._counters.add("skipped_blocks", len(keys) - written)
        finally:
            self._counters.add("save_seconds", time.perf_counter() - t0)

    def settle(self, reused: Collection[int] | None = None) -> None:
        """Wait for the background saves that read a block of ``reused`` (None: all).

        Saves run in order, so waiting for one waits for every earlier one too.
        """
        last = -1
        for i, (_, blocks) in enumerate(self._pending):
            if reused is None or not blocks.isdisjoint(reused):
                last = i
        for fut, _ in self._pending[: last + 1]:
            fut.result()  # _save_now never raises
        self._pending = [(f, b) for f, b in self._pending[last + 1:] if not f.done()]

    def close(self) -> None:
        self.settle()
        if self._saver is not None:
            self._saver.shutdown(wait=True)
        if self._loader is not None:
            # A load still queued is never started (its request goes with the engine);
            # one under way ends before the links close.
            self._loader.shutdown(wait=True, cancel_futures=True)
        for link in self._links:
            link.close()


# ---------------------------------------------------------------- the connector
class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for kvtierd (``kv_connector: "KVTierConnector"``).

    It supports vLLM's hybrid allocator (``SupportsHMA``): every KV cache group is stored
    under keys of its own (:mod:`kvtier._kv_groups`), so hybrid models keep the allocator
    (and its memory savings) with the connector on.
    """

    _cache_hit_source = CacheHitSource.HOST
    #: What moves the bytes on the worker side (:mod:`kvtier.vllm_tpu` has a JAX one).
    _worker_class: type[_Worker] = _Worker
    #: One process holds every tensor-parallel rank's KV in global arrays (JAX engines):
    #: a block is stored whole, in one namespace.
    _one_shard: bool = False
    #: Saves leave the step whatever ``async_save`` says (but a producer's, which its
    #: answer waits for): the worker snapshots the blocks (JAX engines).
    _saves_off_the_step: bool = False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        # kv_role (P/D): a consumer never saves, a producer saves within the step.
        self._kv_role = self._role_policy(self._kv_transfer_config.kv_role, cfg)
        self._cfg = dataclasses.replace(cfg, save=self._kv_role.save,
                                        async_save=self._kv_role.async_save)
        self._waits = Waits(cfg.producer_wait) if self._kv_role.consumer else None
        #: The last step scheduled no tokens (set by build_connector_meta).
        self._idle = False
        if role == KVConnectorRole.SCHEDULER and self._kv_role.role != "kv_both":
            logger.info("kvtier: %s: %s", self._kv_role.role,
                        "loads, never saves" if self._kv_role.consumer else
                        "saves within the step, announces its blocks in kv_transfer_params")
        if self._cfg.load_failure_policy == "recompute":
            # vLLM fails a request whose blocks did not load unless told otherwise; for a
            # cache a failed load is a miss.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self._counters = _Counters()
        self._throttle = _Throttle()
        self._scheduler: _Scheduler | None = None
        self._worker: _Worker | None = None
        try:
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler = _Scheduler(vllm_config, kv_cache_config, self._cfg,
                                             self._counters, self._throttle,
                                             tp_size=1 if self._one_shard else None)
            else:
                self._worker = self._worker_class(vllm_config, kv_cache_config, self._cfg,
                                                  self._counters, self._throttle)
        except Unsupported as exc:
            logger.error("kvtier: the connector is off for this engine: %s", exc)

    @classmethod
    def _role_policy(cls, kv_role: str | None, cfg: ConnectorConfig) -> Role:
        """What this connector does under ``kv_role`` with ``cfg`` (ValueError: a bad role)."""
        return Role.of(kv_role, save=cfg.save, load=cfg.load_mode != "off",
                       async_save=cfg.async_save or cls._saves_off_the_step)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a wrong answer

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is None:
            return
        try:
            self._worker.register(kv_caches)
        except Unsupported as exc:
            # The worker stays, with no groups: should the scheduler claim a hit, its load
            # fails and vLLM recomputes it, instead of running on blocks never loaded.
            logger.error("kvtier: the connector is off for this engine: %s", exc)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # The first call of every step, before anything is written: a block freed since a
        # background save began (finished or preempted request) and handed out again in this
        # step must not be rewritten while that save copies it.  Blocks a running request
        # holds are never rewritten, so saves of those keep running.
        if self._worker is not None:
            meta = kv_connector_metadata
            self._worker.settle(meta.new_block_ids if isinstance(meta, KVTierMetadata) else None)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVTierMetadata)
            self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # sync loads complete in start_load_kv; async ones before get_finished says so

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # every layer is saved at once in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVTierMetadata)
            self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return None, self._worker.finished_loads() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = super().get_transfer_results(finished_req_ids)
        if self._worker is not None:
            out.failed_recving = self._worker.failed_loads()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self._counters.take()
        return KVTierConnectorStats(data=data) if data else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        waits = self._waits
        if waits is not None:
            due = waits.due_in(request.request_id)
            if due > 0 and not self._idle:
                return None, False  # held back, and looked up a moment ago
            if due > 0:
                # The last step ran nothing: the engine is stepping only to retry held
                # requests (vLLM sleeps 1 ms between such steps, a core kept busy while
                # the producer's host publishes the blocks).  Wait for the lookup here.
                time.sleep(min(due, waits.RECHECK))
                if not waits.recheck(request.request_id):
                    return None, False
        n = self._scheduler.matched(request, num_computed_tokens)
        if waits is not None and self._scheduler.hold(request, waits):
            return None, False  # vLLM asks again next step
        return n, n > 0 and self._scheduler.load_async(request)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        if self._scheduler is None:
            return {}
        return self._scheduler.hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        # A step that runs nothing: the engine is idle but for requests it cannot schedule.
        self._idle = int(getattr(scheduler_output, "total_num_scheduled_tokens", 1) or 0) == 0
        if self._scheduler is None:
            return KVTierMetadata()
        return self._scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        stored = self._scheduler.finished(request) if self._scheduler is not None else 0
        if self._waits is not None:
            self._waits.forget(request.request_id)
        if self._kv_role.producer:  # committed already: a producer saves within the step
            return False, producer_params(stored)
        # Saves are done by the end of each step: free the blocks now.  (A request aborted
        # while its background load runs keeps them until the worker reports the load
        # done: vLLM itself holds the blocks of requests in WAITING_FOR_REMOTE_KVS.)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls this instead of request_finished once the connector supports HMA (for
        # every model, hybrid or not); what a request's end means does not depend on groups.
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVTierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = [
    "COUNTERS",
    "CacheGeometry",
    "ConnectorConfig",
    "KVTierConnector",
    "KVTierConnectorStats",
    "KVTierMetadata",
    "LoadSpec",
    "Unsupported",
    "claimable_blocks",
    "geometry_of",
    "model_fingerprint",
    "namespace_args",
    "page_views",
    "refusal",
    "request_salt",
]
