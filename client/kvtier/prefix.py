"""Prefix reuse: the one call a scheduler needs before prefilling a prompt.

``plan_prefix(client, token_ids, block_tokens=16)`` derives the prompt's block
keys, asks the daemon how many leading blocks any tier holds (and, by
default, starts promoting the ones below DRAM so the load that follows finds
them in shared memory), and splits the prompt into tokens whose KV can be
loaded and tokens that must be prefilled.  The last prompt token is always
prefilled -- its forward pass produces the first output token's logits -- so
at most ``len(tokens) - 1`` tokens are loaded, in whole blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvtier._core import Tier
from kvtier.aio import AsyncClient
from kvtier.client import Client
from kvtier.hashing import block_keys


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixPlan:
    """How much of a prompt kvtier can serve."""

    keys: list[bytes]  # one per full block of the prompt
    tiers: list[Tier]  # tier of each leading cached block
    block_tokens: int
    prompt_tokens: int

    @property
    def cached_blocks(self) -> int:
        """Leading blocks present in some tier."""
        return len(self.tiers)

    @property
    def load_blocks(self) -> int:
        """Blocks worth loading: cached, and not covering the prompt's last token."""
        usable = max(0, self.prompt_tokens - 1) // self.block_tokens
        return min(self.cached_blocks, usable)

    @property
    def load_tokens(self) -> int:
        return self.load_blocks * self.block_tokens

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.load_tokens

    @property
    def load_keys(self) -> list[bytes]:
        return self.keys[: self.load_blocks]

    @property
    def store_keys(self) -> list[bytes]:
        """Keys of the full blocks the prefill computes (to save after it)."""
        return self.keys[self.load_blocks :]


def _tokens(token_ids: Sequence[int] | Any) -> int:
    return len(token_ids)


def plan_prefix(client: Client, token_ids: Sequence[int] | Any, *, block_tokens: int,
                salt: bytes | str = b"", prefetch: bool = True) -> PrefixPlan:
    """Look up a prompt's prefix; with ``prefetch`` start promoting lower-tier hits."""
    keys = block_keys(token_ids, block_tokens, salt)
    tiers = client.lookup_tiers(keys, prefetch=prefetch) if keys else []
    return PrefixPlan(keys, tiers, block_tokens, _tokens(token_ids))


async def aplan_prefix(client: AsyncClient, token_ids: Sequence[int] | Any, *,
                       block_tokens: int, salt: bytes | str = b"",
                       prefetch: bool = True) -> PrefixPlan:
    """:func:`plan_prefix` for ``AsyncClient``."""
    keys = block_keys(token_ids, block_tokens, salt)
    tiers = await client.lookup_tiers(keys, prefetch=prefetch) if keys else []
    return PrefixPlan(keys, tiers, block_tokens, _tokens(token_ids))
