"""Checks of kvtier.sglang_jax's plugin point, run in the sglang-jax venv by
test_sglang_jax.py::test_plugin_point (sglang-jax cannot be imported on kvtier's 3.11).

Prints ``OK`` after every check passed; any failure is an AssertionError's traceback.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from sgl_jax.srt.mem_cache import kv_cache_builder  # noqa: E402

import kvtier.sglang_jax as ks  # noqa: E402


def main() -> None:
    # Importing the module installed the hook, once.
    assert kv_cache_builder.init_hicache is ks.init_hicache
    original = ks._original_init_hicache
    assert original is not None and original.__module__ == kv_cache_builder.__name__
    ks.install()
    assert ks._original_init_hicache is original  # idempotent: never wraps itself

    # The selection: absent, empty or 0 is the engine's own pool; 1 or JSON is kvtier's.
    assert ks.Config.from_env(None) is None
    assert ks.Config.from_env("") is None
    assert ks.Config.from_env("0") is None
    assert ks.Config.from_env("1") == ks.Config()
    cfg = ks.Config.from_env('{"socket_dir": "/run/k", "salt": "t", "timeout": 1.5}')
    assert cfg == ks.Config(socket_dir="/run/k", salt="t", timeout=1.5)
    for bad, why in (('{"sockets": "/x"}', "unknown key"), ("[1]", "JSON object"),
                     ("yes", "JSON object")):
        try:
            ks.Config.from_env(bad)
        except ValueError as exc:
            assert why in str(exc), exc
        else:
            raise AssertionError(f"{bad!r} was accepted")

    # The namespace: named by the model's last path part and a digest of what shapes its
    # pages; model_uid keeps the identity, so another model of that name is refused.
    from kvtier.paged import PagedKVLayout

    lay = PagedKVLayout("packed", 2, 16, 2, 128, "bfloat16", 2)

    def args_for(path: str, cfg: ks.Config) -> Any:
        return ks.namespace_args(cfg, SimpleNamespace(model_path=path, dtype="bfloat16",
                                                      kv_cache_dtype="auto", revision=None), lay)

    with tempfile.TemporaryDirectory() as tmp:  # one model's config at two paths
        one, two, other = (os.path.join(tmp, *p) for p in (("a", "llama"), ("b", "llama"),
                                                            ("c", "llama")))
        for path, layers in ((one, 2), (two, 2), (other, 3)):
            os.makedirs(path)
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump({"num_hidden_layers": layers, "transformers_version": path}, f)
        a, b, c = (args_for(p, ks.Config()) for p in (one, two, other))
        assert a["namespace"] == b["namespace"] and a["namespace"].startswith("llama-"), a
        assert a["namespace"].endswith("/packed-L2-p16-h2-d128-bfloat16-k2"), a
        assert a["model_uid"] != b["model_uid"] and a["model_uid"].startswith(one + "#")
        assert c["namespace"] != a["namespace"]  # another config: another digest
        named = ks.Config(model="llama3-8b@rev1")
        assert args_for(one, named) == args_for(two, named)
        assert a["block_bytes"] == lay.block_bytes

    calls: list[tuple[Any, ...]] = []
    ks._original_init_hicache = lambda *a: calls.append(a)
    try:
        # Not selected: the engine's own init_hicache, with the same arguments.
        os.environ.pop(ks.ENV, None)
        args = (object(), SimpleNamespace(hicache_storage="none"), None, None)
        ks.init_hicache(*args)
        assert calls == [args]
        # Selected, but a tree kvtier cannot serve: the engine's own pool, and a warning.
        os.environ[ks.ENV] = "1"
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
        ks.logger.addHandler(handler)
        ks.init_hicache(*args)
        assert len(calls) == 2 and any("UnifiedRadixCache" in m for m in seen), seen
        # Selected, a tree kvtier can serve, but a device pool that is not one packed
        # array per layer: the engine's own pool again.
        import numpy as np
        from sgl_jax.srt.mem_cache.unified_cache_components import ComponentType
        from sgl_jax.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        tree = object.__new__(UnifiedRadixCache)
        tree.tree_components, tree.is_eagle = (ComponentType.FULL,), False
        four_d = SimpleNamespace(kv_buffer=[np.zeros((4, 16, 2, 128), np.float32)])
        alloc = SimpleNamespace(get_kvcache=lambda: four_d)
        ks.init_hicache(tree, SimpleNamespace(hicache_storage="none"), None, alloc)
        assert len(calls) == 3 and type(tree) is UnifiedRadixCache
        assert any("not one packed array per layer" in m for m in seen), seen
    finally:
        ks._original_init_hicache = original
        os.environ.pop(ks.ENV, None)
    print("OK")


if __name__ == "__main__":
    main()
