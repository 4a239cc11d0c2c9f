"""End-to-end: one process saves JAX cache pages with kvtier.jax, another loads them, byte-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import DaemonProc

#: What these tests check does not depend on the client transport (the adapters,
#: the tools and the daemon's own interfaces); they run once, on the default (fast).
pytestmark = pytest.mark.one_transport

pytest.importorskip("jax")

#: Run as ``python -c SCRIPT socket_dir save|load configs_json``.  The caches are
#: random bytes from fixed seeds, so the loader can rebuild what the saver had.
SCRIPT = r'''
import json, sys
import numpy as np
import jax.numpy as jnp
import kvtier, kvtier.jax as kj
from kvtier.paged import dtype_of

socket_dir, action, configs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
LAYERS, PAGES, PT, HEADS, DIM = 3, 16, 16, 2, 64
SAVED = [3, 0, 14, 7, 9, 1]          # the saver's pages, in key order
FREE = [2, 4, 5, 8, 10, 11, 12, 13]  # where the loader puts them (8 keys asked, 6 stored)

def cache(layout, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = dtype_of(dtype)
    heads = 2 * HEADS if layout == "fused" else HEADS
    def arr():
        raw = rng.integers(0, 256, (PAGES, PT, heads, DIM * dt.itemsize), np.uint8)
        return raw.view(dt)
    if layout == "kv":
        return [(arr(), arr()) for _ in range(LAYERS)]
    return [arr() for _ in range(LAYERS)]

def flat(c):
    return [np.asarray(a).view(np.uint8)
            for layer in c for a in (layer if isinstance(layer, tuple) else (layer,))]

def to_jax(c):
    return [tuple(jnp.asarray(a) for a in l) if isinstance(l, tuple) else jnp.asarray(l)
            for l in c]

for seed, (layout, dtype) in enumerate(configs):
    host = cache(layout, dtype, seed)
    jc = to_jax(host)
    lay = kj.fused_layout_of(jc) if layout == "fused" else kj.layout_of(jc)
    keys = kvtier.block_keys(list(range(8 * PT)), PT, salt=f"{layout}/{dtype}".encode())
    with kvtier.Client(socket_dir, **kj.namespace_for(lay, "e2e-model@1")) as c:
        if action == "save":
            print(layout, dtype, "SAVED", kj.save(c, jc, SAVED, keys[:6], layout=lay))
            continue
        dst_host = cache(layout, dtype, seed=999)
        out, n = kj.load(c, keys, to_jax(dst_host), FREE, layout=lay)
    want, before, got = flat(host), flat(dst_host), flat(out)
    ok = n == 6
    for j in range(len(got)):
        ok &= np.array_equal(got[j][FREE[:6]], want[j][SAVED])
        rest = [p for p in range(PAGES) if p not in FREE[:6]]
        ok &= np.array_equal(got[j][rest], before[j][rest])
    print(layout, dtype, "LOADED", n, "OK" if ok else "MISMATCH")
'''

CONFIGS = [["kv", "bfloat16"], ["fused", "bfloat16"], ["single", "float16"], ["kv", "int8"],
           ["kv", "float32"]]


def run(d: DaemonProc, action: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, d.socket_dir, action,
                          json.dumps(CONFIGS)],
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def test_pages_saved_by_one_process_load_byte_exact_in_another(daemon: DaemonProc) -> None:
    assert run(daemon, "save") == [f"{lay} {dt} SAVED 6" for lay, dt in CONFIGS]
    # The saver has exited; a fresh process with a different cache loads the prefix.
    assert run(daemon, "load") == [f"{lay} {dt} LOADED 6 OK" for lay, dt in CONFIGS]
    assert daemon.check() == []


#: A tensor-parallel cache: every array sharded over 2 (forced host) devices on the head axis.
SHARDED = r'''
import sys
import ml_dtypes
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import kvtier, kvtier.jax as kj

assert len(jax.devices()) == 2
sharding = NamedSharding(Mesh(np.array(jax.devices()), ("tp",)), P(None, None, "tp", None))
rng = np.random.default_rng(7)

def arr():
    raw = rng.integers(0, 256, (8, 16, 2, 128), np.uint8).view(ml_dtypes.bfloat16)
    return jax.device_put(raw, sharding)

def flat(c):
    return [np.asarray(a).view(np.uint8) for layer in c for a in layer]

src, dst = [(arr(), arr()) for _ in range(2)], [(arr(), arr()) for _ in range(2)]
want, before = flat(src), flat(dst)
lay = kj.layout_of(src)
with kvtier.Client(sys.argv[1], **kj.namespace_for(lay, "sharded")) as c:
    keys = [b"a", b"b", b"c"]
    assert kj.save(c, src, [1, 5, 6], keys) == 3
    out, n = kj.load(c, keys, dst, [0, 2, 7])
assert n == 3 and out[0][0].sharding == sharding
for g, w, b in zip(flat(out), want, before):
    assert np.array_equal(g[[0, 2, 7]], w[[1, 5, 6]])
    assert np.array_equal(g[[1, 3, 4, 5, 6]], b[[1, 3, 4, 5, 6]])
print("SHARDED OK")
'''


def test_a_cache_sharded_over_devices_round_trips(daemon: DaemonProc) -> None:
    """Two CPU devices stand in for a TP group: save takes the staged path, load the sharding."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, "-c", SHARDED, daemon.socket_dir], env=env,
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "SHARDED OK"
