"""A random-weight Llama that vLLM loads offline (no weights can be downloaded here).

``build(path)`` writes a ``transformers`` checkpoint and a word-level tokenizer
(``tokenizers``, wrapped as ``PreTrainedTokenizerFast``) to ``path``.  The
weights come from a fixed seed, so two builds with the same arguments are the
same model; prompts are given as token ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def build(path: str | os.PathLike[str], *, layers: int = 2, hidden: int = 128, heads: int = 4,
          kv_heads: int = 2, vocab: int = 1000, intermediate: int | None = None,
          dtype: str = "float32", max_positions: int = 16384, seed: int = 0) -> Path:
    """Write the model to ``path`` (created) and return it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, torch_dtype=dtype)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out)
    (out / "kvtier-tinymodel.json").write_text(json.dumps(
        {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
         "vocab": vocab, "dtype": dtype, "seed": seed}))
    return out
