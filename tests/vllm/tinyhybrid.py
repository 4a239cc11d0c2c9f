"""Random-weight hybrid and MLA models that vLLM loads offline, as :mod:`tinymodel` does.

``build(path, kind)`` writes a ``transformers`` checkpoint of one of :data:`KINDS` and a
word-level tokenizer: ``gemma3`` (sliding-window and full-attention layers: two KV cache
groups under vLLM's hybrid allocator), ``mistral-sw`` (every layer sliding-window: one
sliding-window group) and ``deepseek-v2`` (multi-head latent attention, dense MLPs).
The weights come from a fixed seed; prompts are given as token ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.vllm import tinymodel

KINDS = ("gemma3", "mistral-sw", "deepseek-v2")


def _config(kind: str, *, layers: int, window: int, vocab: int, dtype: str) -> Any:
    from transformers import DeepseekV2Config, Gemma3TextConfig, MistralConfig

    common: dict[str, Any] = {"vocab_size": vocab, "num_hidden_layers": layers,
                              "max_position_embeddings": 8192, "bos_token_id": 1,
                              "eos_token_id": 2, "pad_token_id": 0,
                              "tie_word_embeddings": False, "dtype": dtype}
    if kind == "gemma3":
        # Alternating sliding-window and full-attention layers (Gemma-3 uses 5:1).
        return Gemma3TextConfig(
            hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, sliding_window=window,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                         for i in range(layers)], query_pre_attn_scalar=32,
            architectures=["Gemma3ForCausalLM"], **common)
    if kind == "mistral-sw":
        return MistralConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, sliding_window=window,
                             architectures=["MistralForCausalLM"], **common)
    if kind == "deepseek-v2":
        # MLA with dense MLPs only (first_k_dense_replace covers every layer): no MoE.
        return DeepseekV2Config(
            hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
            # vLLM's CPU MLA kernels take only DeepSeek's latent width: 512 + 64 = 576.
            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
            head_dim=64,
            first_k_dense_replace=layers, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, architectures=["DeepseekV2ForCausalLM"],
            # Wider random weights: with the default 0.02 every prompt yields one repeated
            # token, and a wrong KV would go unnoticed.
            initializer_range=0.2, **common)
    raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")


def build(path: str | os.PathLike[str], kind: str, *, layers: int = 4, window: int = 256,
          vocab: int = 1000, dtype: str = "float32", seed: int = 0) -> Path:
    """Write the model to ``path`` (created) and return it."""
    config = _config(kind, layers=layers, window=window, vocab=vocab, dtype=dtype)
    return tinymodel.write(path, config, vocab=vocab, dtype=dtype, seed=seed, pad=True, meta={
        "kind": kind, "layers": layers, "window": window, "vocab": vocab, "dtype": dtype,
        "seed": seed})
