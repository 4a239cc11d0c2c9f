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
from typing import Any


def build(path: str | os.PathLike[str], *, layers: int = 2, hidden: int = 128, heads: int = 4,
          kv_heads: int = 2, vocab: int = 1000, intermediate: int | None = None,
          dtype: str = "float32", max_positions: int = 16384, seed: int = 0) -> Path:
    """Write the model to ``path`` (created) and return it."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, torch_dtype=dtype)
    return write(path, config, vocab=vocab, dtype=dtype, seed=seed, meta={
        "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
        "vocab": vocab, "dtype": dtype, "seed": seed})


def write(path: str | os.PathLike[str], config: Any, *, vocab: int, dtype: str, seed: int,
          meta: dict[str, Any], pad: bool = False) -> Path:
    """A random-weight model of ``config`` (seeded) and a word-level tokenizer of ``vocab``
    words, written to ``path`` (created) with ``meta`` beside them.  Token 0 is ``<pad>``
    (and the pad token) with ``pad``, else ``<unk>``; 1 and 2 are ``<s>`` and ``</s>``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    zero = "<pad>" if pad else "<unk>"
    words = {zero: 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token=zero))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=zero, bos_token="<s>",
                                   eos_token="</s>", **({"pad_token": zero} if pad else {}))
    fast.save_pretrained(out)
    (out / "kvtier-tinymodel.json").write_text(json.dumps(meta))
    return out
