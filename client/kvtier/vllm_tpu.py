"""vLLM TPU (``tpu-inference``) KV connector: the engine's offload tier is kvtierd.

``pip install kvtier vllm-tpu``, start ``kvtierd``, then::

    vllm serve MODEL --kv-transfer-config \\
        '{"kv_connector":"TPUOffloadConnector","kv_connector_module_path":"kvtier.vllm_tpu","kv_role":"kv_both"}'

The TPU platform admits only its own connector names (``TPUConnector``,
``TPUConnectorHMA``, ``TPUOffloadConnector``, ``RaidenOffloadConnector``), and vLLM loads
the class of that name from ``kv_connector_module_path`` before its own registry: so this
module's :class:`TPUOffloadConnector` takes the place of tpu-inference's (whose host tier is
a dict in the engine process) under the name the platform expects.

It is :class:`kvtier.vllm.KVTierConnector` with another worker: the scheduler side, the
keys (``kvtier.hashing``: a prompt's blocks have the same keys here as in the torch
connector and in sglang-jax, only the namespaces differ), the roles (``kv_role``, P/D with
``kvtier pd-proxy``), the counters and ``kv_connector_extra_config``
(:class:`kvtier.vllm.ConnectorConfig`) are that connector's.  What differs:

* **Bytes move through** :mod:`kvtier.jax`.  tpu-inference keeps one ``jax.Array`` per
  layer, ``[num_blocks, block_size, ceil(2*kv_heads/packing), packing, head_dim]`` with K
  and V heads interleaved (``kvtier.paged.packed_layout_of``); a kvtier block is one vLLM
  block of every layer, in layer order.  The runner donates those arrays to every step and
  gets new ones back, so the worker reads ``runner.kv_caches`` at each load and save and
  assigns the updated arrays back after a load (``kvtier.jax.load`` donates them in turn).
  tpu-inference hands the connector its runner (``register_runner``), never the arrays.
* **One namespace for the whole model.**  One process drives every chip of the mesh and
  its arrays are global (sharded over the chips): a block is stored whole, whatever the
  tensor-parallel size, and a host with another mesh shape shares it.
* **Loads in two halves.**  ``load_mode`` ``sync`` (and ``auto``'s DRAM hits) load in
  the step, before its forward pass (``kvtier.jax.load``).  A background load (``async``,
  ``auto``'s hits below DRAM; the request waits in ``WAITING_FOR_REMOTE_KVS``) cannot
  write the arrays from its thread, since the next step donates them: the load thread
  reads the blocks out of kvtier into arrays of their own (``kvtier.jax.stage``: one
  lease, a host copy per block, its transfer to the cache's devices started), and the
  first step that finds them staged writes them into the runner's arrays
  (``kvtier.jax.load_staged``: one in-place device update per block, dispatched) before
  ``get_finished`` reports the request loaded.
* **Saves leave the step**: the step only snapshots the blocks to save
  (``kvtier.jax.snapshot``: a gather on the device into new arrays, their transfer to the
  host started), which no later step can touch; a background thread writes the host bytes
  into kvtier's slots and commits (``kvtier.jax.save_snapshot``).  The save holds no vLLM
  block, so nothing waits for it but ``shutdown``.  ``async_save`` is ignored: a
  ``kv_producer`` saves within the step (its answer tells the consumer the blocks are
  there), ``kv_both`` beside it.
* **Failure is a recompute**, as with the torch connector: kvtierd down or restarted, a
  block gone, a bad checksum -- the blocks not loaded are reported to vLLM, which
  recomputes them.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import jax

from kvtier import jax as kj
from kvtier._kv_groups import Unsupported, plan_groups
from kvtier.client import Client
from kvtier.paged import packed_layout_of
from kvtier.vllm import (
    KVTierConnector,
    LoadSpec,
    _GroupIO,
    _Link,
    _SaveWork,
    _Worker,
    logger,
    model_fingerprint,
    namespace_args,
)

if TYPE_CHECKING:
    import torch


class _JaxWorker(_Worker):
    """The worker of a tpu-inference engine: the runner's layer arrays, re-read each time.

    ``_GroupIO.cache`` holds each group's layer indices into ``runner.kv_caches`` (the
    arrays themselves change every step).
    """

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._runner: Any = None
        #: Per KV cache group, where its arrays live (what staged blocks are placed with).
        self._shardings: dict[int, jax.sharding.Sharding] = {}
        #: Background loads' blocks read out of kvtier (by the load thread), per request,
        #: for the step that reports the request loaded (_finish_load).
        self._staged: dict[str, list[tuple[LoadSpec, _GroupIO, kj.Staged]]] = {}
        self._staged_lock = threading.Lock()

    def register(self, kv_caches: Any) -> None:
        raise Unsupported("tpu-inference registers its runner (register_runner), not arrays")

    def register_runner(self, runner: Any) -> None:
        """Find each KV cache group's layer arrays in ``runner.kv_caches``.

        Raises Unsupported when a group's arrays are not packed pages of the size the
        engine's KV cache spec gives (the connector is then off for this engine).
        """
        caches = list(getattr(runner, "kv_caches", None) or ())
        if not caches or not all(isinstance(a, jax.Array) for a in caches):
            raise Unsupported("the runner holds no jax.Array KV caches (runner.kv_caches)")
        dp = int(getattr(runner, "dp_size", 1) or 1)
        if dp > 1:
            # The page axis is then split over the data-parallel ranks, each scheduling
            # its own blocks: untested, so refused rather than risked.
            raise Unsupported(f"data-parallel attention (dp_size {dp}) is not supported")
        plans = plan_groups(self._kv_cache_config, 1)
        index: dict[str, int] = dict(getattr(runner, "layer_name_to_kvcache_index", None)
                                     or {})
        if not index and len(plans) == 1 and len(plans[0].layer_names) == len(caches):
            index = {n: i for i, n in enumerate(plans[0].layer_names)}
        identity, digest = model_fingerprint(self._vllm_config, self._cfg.model_id)
        links: dict[str, _Link] = {}
        groups: dict[int, _GroupIO] = {}
        shardings: dict[int, jax.sharding.Sharding] = {}
        for plan in plans:
            missing = [n for n in plan.layer_names if n not in index]
            if missing:
                raise Unsupported(f"layers {missing[:3]} have no KV cache array")
            layers = [int(index[n]) for n in plan.layer_names]
            try:
                layout = packed_layout_of([caches[i] for i in layers])
            except (ValueError, IndexError) as exc:
                raise Unsupported(f"the KV cache arrays of group {plan.index} are not "
                                  f"tpu-inference's packed pages: {exc}") from None
            if layout.block_bytes != plan.geometry.block_bytes:
                raise Unsupported(f"a block of the KV cache arrays of group {plan.index} is "
                                  f"{layout.block_bytes} bytes ({layout.describe()}), the "
                                  f"KV cache spec says {plan.geometry.block_bytes}")
            args = namespace_args(self._cfg.namespace_prefix, identity, digest,
                                  plan.geometry, 0, 1)
            link = links.get(args["namespace"])
            if link is None:
                link = links[args["namespace"]] = _Link(self._cfg, args, self._counters,
                                                        self._throttle)
            groups[plan.index] = _GroupIO(plan, link, layers, layout, True)
            shardings[plan.index] = caches[layers[0]].sharding
        first = groups[plans[0].index]
        logger.info("kvtier: tpu-inference KV cache, %d layer arrays of %s on %s",
                    len(caches), first.layout.describe(),
                    ", ".join(sorted({d.platform for d in caches[0].devices()})))
        self._runner = runner
        self._start_threads(saves=self._cfg.async_save)
        if self._saver is not None:
            logger.info("kvtier: saves leave the step: it snapshots the blocks, a background "
                        "thread stores them")
        self._groups, self._links, self._shardings = groups, list(links.values()), shardings
        self._link, self._cache, self._layout = first.link, first.cache, first.layout
        for link in self._links:
            link.client()  # connect now; says so in the log if kvtierd is not there

    def _arrays(self, io: _GroupIO) -> tuple[list[Any], list[jax.Array]]:
        caches = list(self._runner.kv_caches)
        return caches, [caches[i] for i in io.cache]

    def _put_back(self, io: _GroupIO, caches: list[Any], new: list[Any]) -> None:
        """The group's arrays ``new`` (its donated ones' successors) into the runner's."""
        for i, a in zip(io.cache, new, strict=True):
            caches[i] = a
        self._runner.kv_caches = caches

    def _copy_in(self, client: Client, spec: LoadSpec, io: _GroupIO,
                 phases: dict[str, float], background: bool = False) -> int:
        t0 = time.perf_counter()
        if background:
            # The load thread: read the blocks out of kvtier, their transfer started; the
            # arrays are the step's (it donates them), so a later step writes them in.
            staged = kj.stage(client, spec.keys, layout=io.layout,
                              sharding=self._shardings[spec.group])
            with self._staged_lock:
                self._staged.setdefault(spec.req_id, []).append((spec, io, staged))
            phases["copy"] = time.perf_counter() - t0
            return len(staged)
        caches, arrays = self._arrays(io)
        # The arrays are donated (updated in place on one CPU device): from here on only
        # the returned ones are valid, so they go back to the runner whatever n is.
        new, n = kj.load(client, spec.keys, arrays, spec.block_ids, layout=io.layout)
        self._put_back(io, caches, new)
        phases["copy"] = time.perf_counter() - t0
        return n

    def finished_loads(self) -> set[str]:
        """As the torch worker's, once the runner holds live arrays.  tpu-inference's fused
        decode loop (``enable_continue_decode``) asks before it hands the runner the
        successors of the arrays it donated: the loads read by then wait for the next step."""
        runner = self._runner
        if self._loading and runner is not None and any(a.is_deleted()
                                                        for a in runner.kv_caches):
            return set()
        return super().finished_loads()

    def _finish_load(self, req_id: str, failed: list[int]) -> list[int]:
        """The staged blocks of ``req_id`` written into the runner's arrays (the step's
        device update: the arrays donated, their successors assigned back); a group whose
        update fails is reported failed whole (vLLM recomputes it)."""
        with self._staged_lock:
            staged = self._staged.pop(req_id, [])
        t0 = time.perf_counter()
        for spec, io, blocks in staged:
            try:
                caches, arrays = self._arrays(io)
                new, _ = kj.load_staged(blocks, arrays, spec.block_ids, layout=io.layout)
                self._put_back(io, caches, new)
            except Exception as exc:  # noqa: BLE001 (a failed load is a recompute)
                self._failed("load", exc, io.link.args["namespace"])
                self._counters.add("failed_blocks", len(blocks))
                failed = failed + spec.block_ids[: len(blocks)]
        if staged:
            spent = time.perf_counter() - t0
            self._counters.add("load_copy_seconds", spent)
            self._counters.add("load_seconds", spent)
        return failed

    def _detach(self, work: list[_SaveWork]) -> tuple[list[_SaveWork], frozenset[int]]:
        """Each group's blocks to save snapshotted (``kvtier.jax.snapshot``: a gather on
        the device, its transfer to the host started): the step that donates the arrays
        next cannot touch them, so the background save holds no vLLM block."""
        out: list[_SaveWork] = []
        for io, keys, ids in work:
            if io.link.client() is None:
                continue  # kvtierd is not there: nothing to copy (as _save_now would skip)
            try:
                _, arrays = self._arrays(io)
                out.append((io, keys, kj.snapshot(arrays, ids, layout=io.layout)))
            except Exception as exc:  # noqa: BLE001 (a failed save is a later miss)
                self._failed("save", exc, io.link.args["namespace"])
        return out, frozenset()

    def _copy_out(self, client: Client, io: _GroupIO, keys: list[bytes], source: Any) -> int:
        if isinstance(source, kj.Snapshot):  # in the background (_detach)
            return kj.save_snapshot(client, source, keys)
        _, arrays = self._arrays(io)  # in the step (a kv_producer's saves)
        return kj.save(client, arrays, source, keys, layout=io.layout)


class TPUOffloadConnector(KVTierConnector):
    """kvtier's connector for tpu-inference, under a name the TPU platform admits
    (``kv_connector: "TPUOffloadConnector"``, ``kv_connector_module_path: "kvtier.vllm_tpu"``).
    """

    _worker_class = _JaxWorker
    _one_shard = True
    _saves_off_the_step = True

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        return  # tpu-inference calls register_runner instead

    def register_runner(self, runner: Any) -> None:
        """tpu-inference's worker hook: the runner whose ``kv_caches`` the connector uses."""
        worker = self._worker
        if not isinstance(worker, _JaxWorker):
            return
        try:
            worker.register_runner(runner)
        except Unsupported as exc:
            # The worker stays, with no groups: should the scheduler claim a hit, its load
            # fails and vLLM recomputes it, instead of running on blocks never loaded.
            logger.error("kvtier: the connector is off for this engine: %s", exc)


__all__ = ["TPUOffloadConnector"]
