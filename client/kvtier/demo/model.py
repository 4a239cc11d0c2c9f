"""A small decoder-only transformer in JAX with a paged KV cache.

Random but seeded weights (the demo is about the cache, not the text), float32
so that a prefix loaded from kvtier and a prefix computed from scratch give the
same next-token logits up to float rounding.  Llama-shaped: RMSNorm, RoPE,
grouped-query attention, SwiGLU MLP.

The KV cache is what a serving engine keeps: per layer a ``(k, v)`` pair of
``[pages, page_tokens, kv_heads, head_dim]`` arrays, and a *page table* that
maps the sequence's logical pages to physical pages.  Prefill runs in chunks
of fixed shapes (``chunk_tokens`` for long stretches, ``page_tokens`` for
short tails, padded), so XLA compiles two programs once and every prefill
after :func:`Model.warm_up` is compile-free.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

#: Per layer ``(k, v)``, each ``[pages, page_tokens, kv_heads, head_dim]``.
Cache = list[tuple[jax.Array, jax.Array]]
Params = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab: int = 512
    d_model: int = 256
    layers: int = 4
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 768
    page_tokens: int = 16
    chunk_tokens: int = 256  # the long-stretch prefill chunk (a multiple of page_tokens)
    rope_theta: float = 10000.0

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one page across all layers (K and V): the namespace's block_bytes."""
        return self.layers * 2 * self.page_tokens * self.kv_heads * self.head_dim * 4

    def describe(self) -> str:
        return (f"{self.layers} layers, d_model {self.d_model}, {self.q_heads} query / "
                f"{self.kv_heads} KV heads x {self.head_dim}, SwiGLU {self.ffn}, vocab "
                f"{self.vocab}, float32, pages of {self.page_tokens} tokens "
                f"({self.kv_block_bytes // 1024} KiB per page)")


DEFAULT = ModelConfig()
TINY = ModelConfig(vocab=128, d_model=64, layers=2, q_heads=4, kv_heads=2, head_dim=16, ffn=128,
                   page_tokens=16, chunk_tokens=64)
CONFIGS: dict[str, ModelConfig] = {"default": DEFAULT, "tiny": TINY}


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """Seeded random weights, scaled 1/sqrt(fan_in) so activations stay O(1).

    Drawn with numpy (no XLA compilation), then moved to the device.
    """
    rng = np.random.default_rng(seed)
    L, D, F = cfg.layers, cfg.d_model, cfg.ffn

    def w(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.float32(math.sqrt(shape[-2])))

    def ones(*shape: int) -> jax.Array:
        return jnp.ones(shape, jnp.float32)

    return {
        "embed": jnp.asarray(rng.standard_normal((cfg.vocab, D), np.float32)),
        "attn_norm": ones(L, D),
        "wq": w(L, D, cfg.q_heads * cfg.head_dim),
        "wk": w(L, D, cfg.kv_heads * cfg.head_dim),
        "wv": w(L, D, cfg.kv_heads * cfg.head_dim),
        "wo": w(L, cfg.q_heads * cfg.head_dim, D),
        "mlp_norm": ones(L, D),
        "w_gate": w(L, D, F),
        "w_up": w(L, D, F),
        "w_down": w(L, F, D),
        "final_norm": ones(D),
        "unembed": w(D, cfg.vocab),
    }


def setup_jax(compilation_cache: str | None = None) -> None:
    """Exact float32 matmuls everywhere; optionally a persistent compilation cache.

    The cache holds compiled programs only (no weights, no KV): processes
    after the first skip XLA compilation, which TTFT excludes anyway.
    """
    update = cast(Callable[[str, object], None], jax.config.update)  # untyped in jax
    update("jax_default_matmul_precision", "highest")
    if compilation_cache:
        update("jax_compilation_cache_dir", compilation_cache)
        update("jax_persistent_cache_min_compile_time_secs", 0)
        update("jax_persistent_cache_min_entry_size_bytes", -1)


def make_prompt(cfg: ModelConfig, n_tokens: int, seed: int) -> np.ndarray:
    """A seeded random prompt of token ids."""
    return np.random.default_rng(seed + 1).integers(0, cfg.vocab, n_tokens, dtype=np.int32)


def empty_cache(cfg: ModelConfig, pages: int) -> Cache:
    shape = (pages, cfg.page_tokens, cfg.kv_heads, cfg.head_dim)
    return [(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
            for _ in range(cfg.layers)]


def _rms_norm(x: jax.Array, w: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def _rope(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of ``x`` ``[tokens, heads, head_dim]`` at positions ``pos``."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = pos.astype(jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _chunk(params: Params, cache: Cache, page_table: jax.Array, tokens: jax.Array,
           start: jax.Array, n_valid: jax.Array, cfg: ModelConfig) -> tuple[Cache, jax.Array]:
    """Prefill ``tokens[:n_valid]`` at positions ``start...``; logits after the last valid one.

    Writes each token's K/V into the page ``page_table[pos // page_tokens]``
    (padding tokens are dropped) and attends causally over every page of the
    page table, so earlier tokens -- computed or loaded -- are simply there.
    """
    C, pt = tokens.shape[0], cfg.page_tokens
    pages = cache[0][0].shape[0]
    idx = jnp.arange(C, dtype=jnp.int32)
    pos = start + idx
    valid = idx < n_valid
    write_page = jnp.where(valid, page_table[jnp.minimum(pos // pt, page_table.shape[0] - 1)],
                           pages)  # out of range: dropped
    write_off = pos % pt
    max_tokens = page_table.shape[0] * pt
    mask = jnp.arange(max_tokens, dtype=jnp.int32)[None, :] <= pos[:, None]  # [C, T]
    groups = cfg.q_heads // cfg.kv_heads
    scale = 1.0 / math.sqrt(cfg.head_dim)

    x = params["embed"][tokens]
    out: Cache = []
    for layer in range(cfg.layers):
        h = _rms_norm(x, params["attn_norm"][layer])
        q = (h @ params["wq"][layer]).reshape(C, cfg.kv_heads, groups, cfg.head_dim)
        k = (h @ params["wk"][layer]).reshape(C, cfg.kv_heads, cfg.head_dim)
        v = (h @ params["wv"][layer]).reshape(C, cfg.kv_heads, cfg.head_dim)
        q = _rope(q.reshape(C, cfg.q_heads, cfg.head_dim), pos, cfg.rope_theta).reshape(q.shape)
        k = _rope(k, pos, cfg.rope_theta)
        kc, vc = cache[layer]
        kc = kc.at[write_page, write_off].set(k, mode="drop")
        vc = vc.at[write_page, write_off].set(v, mode="drop")
        keys = kc[page_table].reshape(max_tokens, cfg.kv_heads, cfg.head_dim)
        vals = vc[page_table].reshape(max_tokens, cfg.kv_heads, cfg.head_dim)
        scores = jnp.einsum("cngd,tnd->ngct", q, keys) * scale
        scores = jnp.where(mask[None, None], scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1)
        att = jnp.einsum("ngct,tnd->cngd", probs, vals).reshape(C, cfg.q_heads * cfg.head_dim)
        x = x + att @ params["wo"][layer]
        h = _rms_norm(x, params["mlp_norm"][layer])
        gate = jax.nn.silu(h @ params["w_gate"][layer]) * (h @ params["w_up"][layer])
        x = x + gate @ params["w_down"][layer]
        out.append((kc, vc))
    last = _rms_norm(x[n_valid - 1], params["final_norm"])
    return out, last @ params["unembed"]


_chunk_jit = jax.jit(_chunk, static_argnames=("cfg",))


class Model:
    """Weights plus the compiled chunked prefill of one prompt length."""

    def __init__(self, cfg: ModelConfig, seed: int, prompt_tokens: int) -> None:
        self.cfg = cfg
        self.params = init_params(cfg, seed)
        self.prompt_tokens = prompt_tokens
        #: Logical pages of the prompt: the page table's length (the attention span).
        self.pages = -(-prompt_tokens // cfg.page_tokens)

    def new_cache(self) -> Cache:
        return empty_cache(self.cfg, self.pages)

    def prefill(self, cache: Cache, page_table: Sequence[int], tokens: np.ndarray, start: int,
                on_chunk: Callable[[int], None] | None = None) -> tuple[Cache, jax.Array]:
        """Prefill ``tokens`` (positions ``start...``); returns the cache and the last logits.

        The logits are ready (``block_until_ready``) on return.
        """
        if len(tokens) == 0:
            raise ValueError("nothing to prefill: the last prompt token is always prefilled")
        cfg = self.cfg
        table = jnp.asarray(np.asarray(page_table, np.int32))
        logits: jax.Array | None = None
        done = 0
        while done < len(tokens):
            rest = len(tokens) - done
            size = cfg.chunk_tokens if rest > cfg.page_tokens else cfg.page_tokens
            n = min(size, rest)
            chunk = np.zeros(size, np.int32)
            chunk[:n] = tokens[done : done + n]
            result: tuple[Cache, jax.Array] = _chunk_jit(
                self.params, cache, table, jnp.asarray(chunk), jnp.int32(start + done),
                jnp.int32(n), cfg=cfg)
            cache, logits = result
            done += n
            if on_chunk is not None:
                logits.block_until_ready()
                on_chunk(n)
        assert logits is not None
        logits.block_until_ready()
        return cache, logits

    def chunks(self, n_tokens: int) -> int:
        """How many prefill chunks ``n_tokens`` take."""
        count, rest = 0, n_tokens
        while rest > 0:
            rest -= self.cfg.chunk_tokens if rest > self.cfg.page_tokens else rest
            count += 1
        return count

    def warm_up(self) -> None:
        """Compile (and run once) both chunk shapes on a scratch cache."""
        cfg = self.cfg
        scratch = self.new_cache()
        table = list(range(self.pages))
        long = min(self.prompt_tokens, cfg.chunk_tokens)
        tokens = np.zeros(long, np.int32)
        if long > cfg.page_tokens:
            self.prefill(scratch, table, tokens, 0)
        self.prefill(scratch, table, tokens[: min(long, cfg.page_tokens)], 0)
