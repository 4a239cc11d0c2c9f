"""plan_prefix against a real daemon: how much of a prompt loads, how much prefills."""

from __future__ import annotations

import asyncio

import numpy as np

import kvtier
from tests.conftest import DaemonProc

BT = 16
BB = 4096


def _client(d: DaemonProc) -> kvtier.Client:
    return kvtier.Client(d.socket_dir, namespace="prefix", block_bytes=BB, model_uid="m")


def test_plan_splits_load_and_prefill(daemon: DaemonProc) -> None:
    tokens = list(range(1000, 1000 + 100))  # 6 full blocks of 16 + 4 tokens
    with _client(daemon) as c:
        cold = kvtier.plan_prefix(c, tokens, block_tokens=BT)
        assert (len(cold.keys), cold.cached_blocks, cold.load_tokens) == (6, 0, 0)
        assert cold.prefill_tokens == 100 and cold.store_keys == cold.keys
        # Store the first 4 blocks: 64 tokens load, 36 prefill.
        c.put(cold.keys[:4], [np.full(BB, i, np.uint8) for i in range(4)])
        warm = kvtier.plan_prefix(c, tokens, block_tokens=BT)
        assert warm.cached_blocks == 4 and warm.tiers == [kvtier.Tier.DRAM] * 4
        assert (warm.load_tokens, warm.prefill_tokens) == (64, 36)
        assert warm.load_keys == cold.keys[:4] and warm.store_keys == cold.keys[4:]
        # A different salt (tenant) shares nothing.
        other = kvtier.plan_prefix(c, tokens, block_tokens=BT, salt=b"tenant-b")
        assert other.cached_blocks == 0


def test_the_last_token_is_always_prefilled(daemon: DaemonProc) -> None:
    tokens = list(range(64))  # exactly 4 blocks
    with _client(daemon) as c:
        keys = kvtier.block_keys(tokens, BT)
        c.put(keys, [np.zeros(BB, np.uint8)] * 4)
        plan = kvtier.plan_prefix(c, tokens, block_tokens=BT)
        assert plan.cached_blocks == 4
        # All 64 tokens are cached, but the forward pass of token 63 yields the logits:
        # load 3 blocks (48 tokens), prefill 16.
        assert (plan.load_blocks, plan.load_tokens, plan.prefill_tokens) == (3, 48, 16)
        assert kvtier.plan_prefix(c, [], block_tokens=BT).prefill_tokens == 0


def test_async_plan_matches(daemon: DaemonProc) -> None:
    tokens = list(range(40))

    async def go() -> kvtier.PrefixPlan:
        async with kvtier.AsyncClient(daemon.socket_dir, namespace="prefix", block_bytes=BB,
                                      model_uid="m") as ac:
            return await kvtier.aplan_prefix(ac, tokens, block_tokens=BT)

    with _client(daemon) as c:
        c.put(kvtier.block_keys(tokens, BT), [np.ones(BB, np.uint8)] * 2)
    plan = asyncio.run(go())
    assert (plan.cached_blocks, plan.load_tokens, plan.prefill_tokens) == (2, 32, 8)
