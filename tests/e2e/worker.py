"""A client process driven by the e2e tests: ``python worker.py SOCKET ACTION ...``.

Prints ``READY`` (and other markers) on stdout between phases so a test can
kill it at a chosen point.
"""

from __future__ import annotations

import json
import random
import sys
import time

import numpy as np

import kvtier


def block_for(ns: str, key: bytes, size: int) -> np.ndarray:
    """Deterministic content that names its namespace and key (checkable by anyone)."""
    seed = int.from_bytes(key[:8].ljust(8, b"\0"), "little") ^ hash_ns(ns)
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def hash_ns(ns: str) -> int:
    return int.from_bytes(kvtier.block_keys([len(ns)], 1, ns.encode())[0][:8], "little")


def main() -> int:
    sock, action = sys.argv[1], sys.argv[2]
    args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    ns = args.get("namespace", "e2e/ns")
    bb = args.get("block_bytes", 65536)
    c = kvtier.Client(sock, namespace=ns, block_bytes=bb, model_uid=args.get("model_uid", "m"))
    if action == "put":
        keys = [bytes.fromhex(k) for k in args["keys"]]
        n = c.put(keys, [block_for(ns, k, bb - i % 7) for i, k in enumerate(keys)])
        print(f"PUT {n}", flush=True)
    elif action == "verify":
        keys = [bytes.fromhex(k) for k in args["keys"]]
        got = c.get(keys)
        ok = len(got) == len(keys) and all(
            np.array_equal(g, block_for(ns, k, bb - i % 7)) for i, (k, g) in enumerate(zip(keys, got, strict=False))
        )
        print(f"VERIFY {len(got)} {'OK' if ok else 'BAD'}", flush=True)
    elif action == "hold":
        # Reserve some keys and lease others, then wait to be killed.
        held = [bytes.fromhex(k) for k in args["lease"]]
        lease = c.acquire(held)
        r = c.reserve([bytes.fromhex(k) for k in args["reserve"]])
        print(f"HELD {lease.hits} {len(r.reserved)}", flush=True)
        time.sleep(300)
    elif action == "stress":
        rng = random.Random(args["seed"])
        universe = [f"{args['seed']}-{i}".encode() for i in range(args["universe"])]
        ops = refused = 0
        deadline = time.monotonic() + args["seconds"]
        while time.monotonic() < deadline:
            keys = rng.sample(universe, rng.randint(1, 16))
            op = rng.random()
            if op < 0.45:
                try:
                    c.put(keys, [block_for(ns, k, bb) for k in keys])
                except kvtier.errors.CapacityExhausted:
                    refused += 1  # legitimate under pressure: everything else is pinned
            elif op < 0.9:
                with c.acquire(keys) as lease:
                    for k, v in zip(lease.keys, lease.views, strict=False):
                        if not np.array_equal(v, block_for(ns, k, bb)):
                            print(f"CORRUPT {k!r}", flush=True)
                            return 1
            elif op < 0.95:
                c.delete(keys[:2])
            else:
                c.lookup(keys)
            ops += 1
        print(f"STRESS {ops} {refused}", flush=True)
    else:
        print(f"unknown action {action}", file=sys.stderr)
        return 2
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
