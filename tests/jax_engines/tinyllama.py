"""A random-weight Llama that sglang-jax loads offline, written without torch.

``build(path)`` writes a ``transformers`` config, seeded random float32 weights
(``safetensors.numpy``) and the same word-level tokenizer as ``tests/vllm/tinymodel.py``
(``PreTrainedTokenizerFast``, which sglang-jax needs).  Runs in the sglang-jax venv (no
torch there).  head_dim is 128: sglang-jax's attention pads head_dim to 128 and its
projections assume it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def build(path: str | os.PathLike[str], *, layers: int = 2, hidden: int = 256, heads: int = 2,
          kv_heads: int = 2, vocab: int = 1000, intermediate: int = 512, seed: int = 0) -> Path:
    """Write the model to ``path`` (created) and return it."""
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, torch_dtype="float32")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    t = {"model.embed_tokens.weight": w(vocab, hidden),
         "model.norm.weight": np.ones(hidden, np.float32), "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        t[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = w(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = w(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, intermediate)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
    (out / "kvtier-tinyllama.json").write_text(json.dumps(
        {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
         "vocab": vocab, "seed": seed}))
    return out


if __name__ == "__main__":
    import sys

    build(sys.argv[1])
