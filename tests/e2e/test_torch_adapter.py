"""kvtier.torch across processes: one process saves pages, another loads them, byte-exact.

Run as a script, this file is the child: ``python test_torch_adapter.py SOCKET save|load``
prints one JSON line per (layout, dtype).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

LAYOUTS = ["kv", "fused", "single"]
DTYPES = ["float32", "bfloat16", "float16", "int8"]
PAGES, LAYERS, TOKENS, HEADS, DIM = 8, 3, 4, 2, 16
SAVED = [5, 2, 7]  # pages the saver stores, in key order
LOADED = [0, 6, 1, 3]  # where the loader puts them (the 4th key was never saved)


def child(sock: str, action: str) -> None:
    import torch

    import kvtier
    import kvtier.torch as kt

    if action == "load":
        sys.stdin.readline()  # started early (torch imported) while the saver runs: wait for it

    def cache(layout: str, dtype: str, seed: int | None) -> list[Any]:
        heads = 2 * HEADS if layout == "fused" else HEADS
        gen = torch.Generator().manual_seed(seed) if seed is not None else None

        def array() -> torch.Tensor:
            t = torch.zeros((PAGES, TOKENS, heads, DIM), dtype=getattr(torch, dtype))
            if gen is not None:
                raw = t.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
            return t

        if layout == "kv":
            return [(array(), array()) for _ in range(LAYERS)]
        return [array() for _ in range(LAYERS)]

    def page(c: list[Any], p: int) -> bytes:
        flat = [a for layer in c for a in (layer if isinstance(layer, tuple) else (layer,))]
        return b"".join(a[p].view(torch.uint8).numpy().tobytes() for a in flat)

    for li, layout in enumerate(LAYOUTS):
        for di, dtype in enumerate(DTYPES):
            src = cache(layout, dtype, seed=100 * li + di)
            lay = kt.fused_layout_of(src) if layout == "fused" else kt.layout_of(src)
            keys = kvtier.block_keys(range(TOKENS * 4), TOKENS, salt=f"{layout}/{dtype}")
            with kvtier.Client(sock, **kt.namespace_for(lay, "e2e-torch")) as c:
                if action == "save":
                    out = {"saved": kt.save(c, src, SAVED, keys[:3], layout=lay)}
                else:
                    dst = cache(layout, dtype, seed=None)
                    n = kt.load(c, keys, dst, LOADED, layout=lay)
                    same = [page(dst, d) == page(src, s) for d, s in zip(LOADED, SAVED, strict=False)]
                    zero = bytes(len(page(dst, 0)))
                    untouched = all(page(dst, p) == zero for p in range(PAGES) if p not in LOADED[:n])
                    again = kt.save(c, src, SAVED, keys[:3], layout=lay)  # all present now
                    out = {"loaded": n, "same": same, "untouched": untouched, "again": again}
            print(json.dumps({"layout": layout, "dtype": dtype, "pid": os.getpid(), **out}),
                  flush=True)


def start_child(sock: str, action: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, sock, action], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rows_of(proc: subprocess.Popen[str], stdin: str = "") -> list[dict[str, Any]]:
    out, err = proc.communicate(stdin, timeout=120)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
else:
    import pytest

    pytest.importorskip("torch")

    from tests.conftest import DaemonProc, start_daemon, stop_daemon

    @pytest.fixture
    def kvd(workdir: str) -> Iterator[DaemonProc]:
        # 12 geometries, 12 namespaces: small extents so none is evicted for another.
        d = start_daemon(workdir, extent="256KiB")
        yield d
        stop_daemon(d)
        assert d.proc.returncode == 0, d.log()

    def test_save_in_one_process_load_in_another(kvd: DaemonProc) -> None:
        daemon = kvd
        saver = start_child(daemon.socket_dir, "save")
        loader = start_child(daemon.socket_dir, "load")  # imports torch meanwhile, then waits
        try:
            saved = rows_of(saver)
            loaded = rows_of(loader, "go\n")
        finally:
            for p in (saver, loader):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        combos = [(lay, dt) for lay in LAYOUTS for dt in DTYPES]
        assert [(r["layout"], r["dtype"]) for r in saved] == combos
        assert [(r["layout"], r["dtype"]) for r in loaded] == combos
        assert saved[0]["pid"] != loaded[0]["pid"]
        for s, got in zip(saved, loaded, strict=True):
            assert s["saved"] == 3, s
            assert got["loaded"] == 3 and got["same"] == [True] * 3 and got["untouched"], got
            assert got["again"] == 0, got  # saving from another process skips present keys

    def _bench_module() -> Any:
        import importlib.util
        import pathlib

        path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu" / "h2d_d2h.py"
        spec = importlib.util.spec_from_file_location("h2d_d2h", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    def test_gpu_bench_dry_run(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
        """bench/gpu/h2d_d2h.py --dry-run: its own daemon, every step but CUDA, all verified."""
        bench = _bench_module()
        with pytest.raises(SystemExit) as exc:
            bench.main(["--help"])
        assert exc.value.code == 0 and "--dry-run" in capsys.readouterr().out
        out = tmp_path / "rows.jsonl"
        assert bench.main(["--dry-run", "--sizes", "64KiB,2MiB", "--json", str(out)]) == 0
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert rows == printed
        copies = {(r["direction"], r["memory"], r["size"]) for r in rows if r["figure"] == "copy"}
        assert copies == {(d, m, s) for d in ("h2d", "d2h") for s in (64 << 10, 2 << 20)
                          for m in ("kvtier-unregistered", "kvtier", "pageable")}
        assert {r["op"] for r in rows if r["figure"] == "kvtier.torch"} == {"save", "load"}
        assert all(r["verified"] and r["dry_run"] for r in rows)
        assert rows[-1]["figure"] == "summary"

    def test_gpu_bench_says_why_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
        assert _bench_module().main([]) == 2
        assert "no GPU" in capsys.readouterr().err
