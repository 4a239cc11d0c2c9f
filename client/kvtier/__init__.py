"""kvtier: client library for the kvtierd KV-cache tiering daemon.

    import kvtier
    with kvtier.Client(namespace="qwen3-8b/tp1/bf16", block_bytes=2 << 20,
                       model_uid="qwen3-8b@2025-05") as c:
        keys = kvtier.block_keys(token_ids, block_tokens=16, salt=b"tenant-a")
        c.put(keys, blocks)          # stores what is not there yet
        n = c.lookup(keys)           # leading keys present
        with c.acquire(keys) as lease:   # zero-copy read-only views
            ...
"""

__version__ = "0.1.0"

from kvtier import errors
from kvtier._core import KeyStatus, Tier
from kvtier.aio import AsyncClient, AsyncLease, AsyncReservation
from kvtier.client import Client, Lease, Reservation
from kvtier.hashing import block_keys
from kvtier.prefix import PrefixPlan, aplan_prefix, plan_prefix

__all__ = [
    "AsyncClient",
    "AsyncLease",
    "AsyncReservation",
    "Client",
    "KeyStatus",
    "PrefixPlan",
    "Lease",
    "Reservation",
    "Tier",
    "__version__",
    "aplan_prefix",
    "block_keys",
    "errors",
    "plan_prefix",
]
