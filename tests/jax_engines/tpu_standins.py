"""Stand-ins for TPU hardware, so tpu-inference's engine runs on this CPU (tests only).

tpu-inference 0.32.0 assumes a TPU in a few places that a CPU cannot satisfy; each is
replaced here, and nothing else is.  kvtier's own code carries none of this: on a TPU host
the engine runs as shipped and the connector (``kvtier.vllm_tpu``) is the same.

* ``utils.get_device_name`` raises "Expected TPU devices" (the engine sizes its HBM by the
  device kind): it names a stand-in kind instead.
* The step and sampling functions are compiled with TPU-only XLA options
  (``models/common/compiler_options.py``), which the CPU compiler refuses: none are given.
  ``sampling.py`` binds its options when it is imported, so :func:`install` runs before
  vLLM is imported.
* The ragged paged attention is a Pallas TPU kernel (it asks jax for the TPU's generation
  even in interpret mode): :func:`paged_attention` is the same computation in plain JAX over
  the same cache layout (``[pages, page_size, ceil(2*kv_heads/packing), packing,
  head_dim]``, K and V heads interleaved), writing the step's K/V into the cache as the
  kernel does.  Quantized KV and attention sinks are not stood in for.

The mesh is one CPU device through the engine's own option
(``additional_config={"sharding": {"sharding_strategy": {"device_indexes": [0]}}}``, see
``vllm_tpu_engine.py``): ``make_optimized_mesh`` reads TPU chip coordinates otherwise.
"""

from __future__ import annotations

import sys
from typing import Any

#: The device kind the stand-in reports (any kind tpu-inference knows; this one's HBM
#: limit, 32 GiB, only bounds the engine's estimate of free memory).
STAND_IN_KIND = "TPU v6e"


def stand_in_device_name(num_devices: int | None = None) -> str:
    """``tpu_inference.utils.get_device_name`` for a CPU: the stand-in kind."""
    return STAND_IN_KIND if num_devices is None else f"{STAND_IN_KIND}-{num_devices}"


def no_tpu_compiler_options() -> dict[str, str]:
    """The engine's TPU-only XLA compiler options, for a CPU: none."""
    return {}


def paged_attention(q: Any, k: Any, v: Any, kv_cache: Any, kv_lens: Any, page_indices: Any,
                    cu_q_lens: Any, distribution: Any, *, sm_scale: float = 1.0,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    q_scale: float | None = None, k_scale: float | None = None,
                    v_scale: float | None = None, update_kv_cache: bool = True,
                    use_causal_mask: bool = True, **_tuning: Any) -> tuple[Any, Any]:
    """The ragged paged attention kernel's contract in plain JAX (traceable, fixed shapes).

    ``q`` ``[tokens, q_heads, head_dim]``, ``k``/``v`` ``[tokens, kv_heads, head_dim]``;
    sequence ``s`` owns query tokens ``cu_q_lens[s]:cu_q_lens[s+1]``, the last of its
    ``kv_lens[s]`` positions, and pages ``page_indices[s*P:(s+1)*P]``; the first
    ``distribution[2]`` sequences are live.  Returns the attention output and the cache
    with the step's K/V written.  Every sequence's pages are gathered at once and each
    token attends over all of them with the other sequences' positions masked: memory
    ``tokens x q_heads x seqs x P x page_size`` floats, fine for the tests' tiny engines.
    """
    import jax
    import jax.numpy as jnp
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import merge_kv

    if q_scale is not None or k_scale is not None or v_scale is not None:
        raise NotImplementedError("the stand-in attention has no quantized KV")
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    num_pages, page_size, slots, packing, padded_dim = kv_cache.shape
    seqs = kv_lens.shape[0]
    per_seq = page_indices.shape[0] // seqs
    span = per_seq * page_size
    live = distribution[2]
    t = jnp.arange(tokens)
    # The sequence of each token: how many live sequences end at or before it (the entries
    # of cu_q_lens past the live ones are padding, not sorted: no searchsorted).
    ends = jnp.where(jnp.arange(seqs) < live, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    seq = jnp.minimum(jnp.sum(ends[None, :] <= t[:, None], axis=1), seqs - 1)
    valid = t < cu_q_lens[jnp.minimum(live, seqs)]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    table = page_indices.reshape(seqs, per_seq)
    if update_kv_cache:
        page = table[seq, jnp.clip(pos // page_size, 0, per_seq - 1)]
        page = jnp.where(valid, page, num_pages)  # past the end: the write is dropped
        kv_cache = kv_cache.at[page, pos % page_size].set(
            merge_kv(k, v).astype(kv_cache.dtype), mode="drop")
    kv = kv_cache[table].reshape(seqs, span, slots * packing, padded_dim)
    kv = kv[:, :, : 2 * kv_heads, :head_dim].reshape(seqs, span, kv_heads, 2, head_dim)
    group = q_heads // kv_heads
    keys = jnp.repeat(kv[:, :, :, 0], group, axis=2).astype(jnp.float32)
    values = jnp.repeat(kv[:, :, :, 1], group, axis=2).astype(jnp.float32)
    scores = jnp.einsum("thd,slhd->thsl", q.astype(jnp.float32), keys) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    at = jnp.arange(span)[None, None, :]
    ok = (jnp.arange(seqs)[None, :, None] == seq[:, None, None]) \
        & (at < kv_lens[seq][:, None, None]) & valid[:, None, None]
    if use_causal_mask:
        ok = ok & (at <= pos[:, None, None])
        if sliding_window is not None:
            ok = ok & (at > pos[:, None, None] - sliding_window)
    scores = jnp.where(ok[:, None], scores, -1e30).reshape(tokens, q_heads, seqs * span)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("thk,khd->thd", weights, values.reshape(seqs * span, q_heads, head_dim))
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype), kv_cache


def install() -> None:
    """Put the stand-ins in place; before ``vllm`` (and tpu-inference's sampler) is imported."""
    import tpu_inference.models.common.compiler_options as options

    if "tpu_inference.layers.jax.sample.sampling" in sys.modules:
        raise RuntimeError("install() must run before tpu-inference's sampler is imported")
    options.get_step_fn_compiler_options = no_tpu_compiler_options
    options.get_sampling_compiler_options = no_tpu_compiler_options
    import tpu_inference.layers.common.attention_interface as attention
    import tpu_inference.utils as utils

    utils.get_device_name = stand_in_device_name
    attention.ragged_paged_attention = paged_attention
    # Modules imported so far that bound these names themselves.
    for name, module in list(sys.modules.items()):
        if not name.startswith("tpu_inference.") or module in (options, utils):
            continue
        for attr, stand_in in (("get_device_name", stand_in_device_name),
                               ("get_step_fn_compiler_options", no_tpu_compiler_options),
                               ("get_sampling_compiler_options", no_tpu_compiler_options)):
            if getattr(module, attr, None) is not None:
                setattr(module, attr, stand_in)


def offload_copies_in_plain_jax() -> None:
    """tpu-inference's own offload connector (``TPUOffloadConnector`` with its
    ``LocalCPUBackend``, a benchmark's baseline) scatters loaded blocks into the cache with
    a Pallas DMA kernel (TPU only): in its place, the same gather and scatter in plain JAX
    that tpu-inference itself uses under attention data parallelism."""
    import tpu_inference.offload.tpu_offload_connector as offload
    import tpu_inference.offload.utils as copies

    offload.stack_kv_cache_cross_layers = copies.pure_jax_stack_kv_cache_cross_layers
    offload.update_kv_caches_one = copies.pure_jax_update_kv_caches_one
