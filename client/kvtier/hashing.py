"""Content-derived block keys: ``block_keys(tokens, block_tokens, salt)``.

Keys depend only on the token ids, the block size and an explicit salt:
never on a process seed, a Python ``hash()`` or the library version, so two
processes on two machines get the same keys (LESSONS: vLLM's random
``NONE_HASH`` silently dropped hit rates to zero).  Each key chains on the
*full* previous key (``key_i = H(key_{i-1} || tokens_i)``) so equal blocks
after different prefixes get different keys, and the hash is BLAKE2b with a
128-bit digest: cryptographic, so a tenant cannot craft a prompt whose key
collides with another prompt's (LESSONS: truncated or weak keys merged
different prefixes, Mooncake#644).  Known-answer vectors pin the output in
``tests/unit/test_hashing.py``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Digest width in bytes (128 bits, never truncated: a collision must stay out of reach).
KEY_BYTES = 16
#: Domain tag for the first block, so kvtier keys never equal other BLAKE2b uses.
_DOMAIN = b"kvtier.block_keys.v1"
#: Domain of request salts.  It names the vLLM connector, which defined it first; every
#: engine integration salts with it, so engines name the same tokens the same way.
_SALT_DOMAIN = "kvtier.vllm.v1"


def block_keys(
    tokens: Sequence[int] | np.ndarray,
    block_tokens: int,
    salt: bytes | str = b"",
) -> list[bytes]:
    """Chained prefix keys, one per *full* block of ``block_tokens`` tokens.

    ``tokens`` are non-negative token ids (< 2**63).  A trailing partial block
    gets no key (it cannot be reused as a whole block).  ``salt`` separates
    tenants or model builds; it is hashed in full.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    if isinstance(salt, str):
        salt = salt.encode()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and int(arr.min()) < 0:
        raise ValueError("tokens must be non-negative")
    if arr.size and arr.dtype.kind == "u" and int(arr.max()) >= 2**63:
        raise ValueError("tokens must be < 2**63")
    data = arr.astype("<i8", copy=False).tobytes()
    n_blocks = arr.size // block_tokens
    step = block_tokens * 8
    prev = hashlib.blake2b(
        _DOMAIN + struct.pack("<IQ", len(salt), block_tokens) + salt, digest_size=KEY_BYTES
    ).digest()
    keys: list[bytes] = []
    for i in range(n_blocks):
        prev = hashlib.blake2b(prev + data[i * step : (i + 1) * step], digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


def request_salt(salt: str, cache_salt: str | None, lora: Any) -> bytes:
    """The key salt of a request: the engine integration's ``salt``, the request's
    ``cache_salt`` (a tenant's), its LoRA adapter (anything with ``lora_name``,
    ``lora_int_id``, ``lora_path``; None for the base model).  Every engine integration
    (``kvtier.vllm``, ``kvtier.sglang_jax``) salts its keys with it."""
    adapter = None
    if lora is not None:
        adapter = [str(getattr(lora, "lora_name", "")), int(getattr(lora, "lora_int_id", 0)),
                   str(getattr(lora, "lora_path", ""))]
    return json.dumps([_SALT_DOMAIN, salt, cache_salt or "", adapter]).encode()
