#!/usr/bin/env python3
"""Host<->GPU copy bandwidth from kvtier slots vs torch pinned and pageable memory.

Starts a private kvtierd (temp sockets, a fresh /dev/shm/kvtier-bench-* directory),
fills slots, and measures on one GPU, for each transfer size (default 2 MiB and
64 MiB) and direction (h2d: host -> device, d2h: device -> host):

  kvtier              slots registered with cudaHostRegister (``kvtier.torch.pin``)
  kvtier-unregistered the same slots before registration (pageable shared memory)
  torch-pinned        ``torch.empty(...).pin_memory()`` buffers
  pageable            ``torch.empty(...)`` buffers (touched first)

Each figure moves one pass over ``n`` distinct host buffers (n x size ~ 256 MiB)
to/from ``n`` device buffers with ``copy_(non_blocking=True)``, then synchronizes;
passes repeat for ``--seconds``.  GB/s = 1e9 bytes/s of wall time.  Then
``kvtier.torch.save``/``load`` of a paged bf16 cache (2 MiB pages: 32 layers x
(K, V) x 16 tokens x 8 heads x 128) end to end.  Every copy is checked.

One JSON line per figure on stdout (progress on stderr), a summary line last:

    python bench/gpu/h2d_d2h.py                  # ~30 s on one GPU
    python bench/gpu/h2d_d2h.py --dry-run        # no GPU: everything else, on CPU tensors
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

MiB = 1 << 20
#: Host bytes per pass (n distinct buffers of one size).
PASS_BYTES = 256 * MiB
#: Paged cache of the end-to-end figures: 2 MiB pages.
E2E_GEOMETRY = dict(layers=32, tokens=16, heads=8, dim=128)
E2E_PAGES = 128  # on the GPU (256 MiB); half are saved, then loaded into the other half

Row = dict[str, Any]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="h2d_d2h.py",
        description="Host<->GPU copy bandwidth: kvtier slots (cudaHostRegister) vs torch "
                    "pinned vs pageable memory, plus kvtier.torch save/load.  One JSON "
                    "line per figure on stdout.")
    p.add_argument("--sizes", default="2MiB,64MiB",
                   help="transfer sizes, comma-separated (default 2MiB,64MiB)")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="time per figure (default 1.0; the whole run stays under 2 minutes)")
    p.add_argument("--device", default="cuda:0", help="the GPU (default cuda:0)")
    p.add_argument("--no-e2e", action="store_true",
                   help="skip the kvtier.torch save/load figures")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU needed: run every step on CPU tensors with tiny sizes and no "
                        "cudaHostRegister, to check the script, daemon and kvtier.torch")
    p.add_argument("--json", metavar="PATH", help="also write the JSON lines to PATH")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        log("h2d_d2h: torch is not installed (pip install torch, a CUDA build)")
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        why = ("torch was built without CUDA" if torch.version.cuda is None
               else "torch sees no CUDA device")
        log(f"h2d_d2h: no GPU: {why} (torch {torch.__version__}, torch.version.cuda = "
            f"{torch.version.cuda}).  Run it on a machine with an NVIDIA GPU and a CUDA "
            "build of torch, or pass --dry-run to check everything but the GPU.")
        return 2
    from kvtier.bench import positive_size

    sizes = [positive_size(s) for s in args.sizes.split(",") if s.strip()]
    bench = Bench(args, sizes)
    started = time.monotonic()
    try:
        bench.run()
    finally:
        if args.json:
            with open(args.json, "w") as f:
                for row in bench.rows:
                    f.write(json.dumps(row) + "\n")
    log(f"done in {time.monotonic() - started:.1f} s")
    return 0 if all(r.get("verified", True) for r in bench.rows) else 1


class Bench:
    def __init__(self, args: argparse.Namespace, sizes: list[int]) -> None:
        import torch

        self.torch = torch
        self.args = args
        self.dry = bool(args.dry_run)
        self.sizes = sizes
        self.seconds = 0.02 if self.dry else args.seconds
        self.device = torch.device("cpu" if self.dry else args.device)
        self.cuda = self.device.type == "cuda"
        self.rows: list[Row] = []
        name = (torch.cuda.get_device_name(self.device) if self.cuda
                else f"cpu ({platform.processor() or platform.machine()})")
        self.base: Row = {"bench": "gpu_h2d_d2h", "dry_run": self.dry, "device": name,
                          "torch": torch.__version__, "host": platform.node()}

    # ------------------------------------------------------------ plumbing
    def emit(self, **row: Any) -> None:
        full = {**self.base, **row}
        self.rows.append(full)
        print(json.dumps(full), flush=True)

    def count(self, size: int) -> int:
        """Host buffers per pass for ``size``."""
        return 2 if self.dry else max(2, PASS_BYTES // size)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def rate(self, nbytes_per_pass: int, one_pass: Callable[[], None]) -> Row:
        """Repeat ``one_pass`` for ``self.seconds`` (at least 3 passes); GB/s of wall time."""
        one_pass()  # warm-up: first-touch, allocator, driver paths
        self.sync()
        passes, spent, best = 0, 0.0, 0.0
        while passes < 3 or spent < self.seconds:
            t0 = time.perf_counter()
            one_pass()
            self.sync()
            dt = time.perf_counter() - t0
            passes, spent = passes + 1, spent + dt
            best = max(best, nbytes_per_pass / dt / 1e9)
        return {"gb_per_s": round(nbytes_per_pass * passes / spent / 1e9, 3),
                "best_gb_per_s": round(best, 3), "passes": passes,
                "seconds": round(spent, 3)}

    def copies(self, direction: str, host: Sequence[Any], dev: Sequence[Any]) -> Callable[[], None]:
        nb = self.cuda

        def h2d() -> None:
            for h, d in zip(host, dev, strict=True):
                d.copy_(h, non_blocking=nb)

        def d2h() -> None:
            for h, d in zip(host, dev, strict=True):
                h.copy_(d, non_blocking=nb)

        return h2d if direction == "h2d" else d2h

    def figure(self, direction: str, memory: str, size: int, host: Sequence[Any],
               dev: Sequence[Any], src: Sequence[Any], **extra: Any) -> None:
        """Measure one direction for one kind of host memory, then check the bytes."""
        torch = self.torch
        if direction == "d2h":
            for d, s in zip(dev, src, strict=True):
                d.copy_(s)
        r = self.rate(size * len(host), self.copies(direction, host, dev))
        if direction == "h2d":  # host held src's bytes: the device buffers must now too
            ok = all(torch.equal(d, s) for d, s in zip(dev, src, strict=True))
        else:
            ok = all(torch.equal(h.to(self.device), s) for h, s in zip(host, src, strict=True))
        self.emit(figure="copy", direction=direction, memory=memory, size=size,
                  buffers=len(host), verified=ok, **r, **extra)

    # ------------------------------------------------------------ the run
    def run(self) -> None:
        from kvtier.bench import capacity_for
        from kvtier.bench.servers import own_daemon

        extent = 64 * MiB
        e2e_block = self.e2e_layout().block_bytes
        capacity = sum(capacity_for([s], self.count(s), extent) for s in self.sizes)
        capacity += capacity_for([e2e_block], E2E_PAGES, extent)
        info: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(prefix="kvt-gpu-", dir="/tmp") as work, \
                own_daemon(work, capacity, extent, info) as sock:
            for size in self.sizes:
                self.bench_size(sock, size)
            if not self.args.no_e2e:
                self.bench_e2e(sock)
        self.summary()

    def patterns(self, size: int, n: int) -> list[Any]:
        """``n`` device buffers of distinct random bytes (the reference contents)."""
        torch = self.torch
        gen = torch.Generator(device=self.device).manual_seed(size)
        return [torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.device,
                              generator=gen) for _ in range(n)]

    def bench_size(self, sock: str, size: int) -> None:
        import kvtier
        import kvtier.torch as kt

        torch = self.torch
        n = self.count(size)
        log(f"{size // MiB if size >= MiB else size / MiB:g} MiB x {n} buffers")
        src = self.patterns(size, n)
        dev = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(n)]
        with kvtier.Client(sock, namespace=f"gpu-bench-{size}", block_bytes=size,
                           model_uid="gpu-bench") as c:
            # kvtier slots: d2h into reserved slots, h2d from leased ones; unregistered first.
            keys = [uuid.uuid4().bytes for _ in range(n)]
            with c.reserve(keys) as r:
                slots = [kt.slot_tensor(_buf(b)) for b in r.buffers]
                assert all(t.data_ptr() == _buf(b).ctypes.data
                           for t, b in zip(slots, r.buffers, strict=True))
                self.figure("d2h", "kvtier-unregistered", size, slots, dev, src)
                del slots
                r.commit()
            with c.acquire(keys) as lease:
                views = [kt.slot_tensor(v) for v in lease.views]
                self.figure("h2d", "kvtier-unregistered", size, views, dev, src)
                if self.cuda:
                    t0 = time.perf_counter()
                    pinned = kt.pin(c)
                    pin_s = time.perf_counter() - t0
                    self.emit(figure="pin", size=size, pinned_bytes=pinned,
                              seconds=round(pin_s, 3),
                              gb_per_s=round(pinned / pin_s / 1e9, 3) if pin_s else None)
                registered = all(v.is_pinned() for v in views) if self.cuda else False
                self.figure("h2d", "kvtier", size, views, dev, src, is_pinned=registered)
                del views
            c.delete(keys)
            keys = [uuid.uuid4().bytes for _ in range(n)]
            with c.reserve(keys) as r:
                if self.cuda:
                    kt.pin(c)  # slots in segments mapped since (normally none)
                slots = [kt.slot_tensor(_buf(b)) for b in r.buffers]
                registered = all(t.is_pinned() for t in slots) if self.cuda else False
                self.figure("d2h", "kvtier", size, slots, dev, src, is_pinned=registered)
                del slots
                r.commit()
            c.delete(keys)
            kt.unpin(c)
        # torch pinned memory and plain pageable memory, same sizes, same device buffers.
        if self.cuda:
            pinned_bufs = [torch.empty(size, dtype=torch.uint8).pin_memory() for _ in range(n)]
            for direction in ("h2d", "d2h"):
                if direction == "h2d":
                    for h, s in zip(pinned_bufs, src, strict=True):
                        h.copy_(s)
                self.figure(direction, "torch-pinned", size, pinned_bufs, dev, src)
            del pinned_bufs
        pageable = [torch.empty(size, dtype=torch.uint8) for _ in range(n)]
        for direction in ("h2d", "d2h"):
            if direction == "h2d":
                for h, s in zip(pageable, src, strict=True):
                    h.copy_(s)
            self.figure(direction, "pageable", size, pageable, dev, src)

    def e2e_layout(self) -> Any:
        from kvtier.paged import PagedKVLayout

        g = dict(layers=2, tokens=4, heads=2, dim=16) if self.dry else E2E_GEOMETRY
        return PagedKVLayout("kv", g["layers"], g["tokens"], g["heads"], g["dim"], "bfloat16")

    def bench_e2e(self, sock: str) -> None:
        """kvtier.torch.save of half the pages of a paged cache, load into the other half."""
        import kvtier
        import kvtier.torch as kt

        torch = self.torch
        lay = self.e2e_layout()
        pages = 8 if self.dry else E2E_PAGES
        half = pages // 2
        shape = (pages, lay.page_tokens, lay.kv_heads, lay.head_dim)
        gen = torch.Generator(device=self.device).manual_seed(7)
        cache = [(torch.randn(shape, generator=gen, device=self.device).to(torch.bfloat16),
                  torch.randn(shape, generator=gen, device=self.device).to(torch.bfloat16))
                 for _ in range(lay.num_layers)]
        log(f"kvtier.torch save/load: {half} pages of {lay.describe()}")
        saved, loaded = list(range(half)), list(range(half, pages))
        with kvtier.Client(sock, **kt.namespace_for(lay, "gpu-bench")) as c:
            if self.cuda:
                kt.pin(c)
            keys: list[bytes] = []

            def save_pass() -> None:
                nonlocal keys
                if keys:
                    c.delete(keys)
                keys = [uuid.uuid4().bytes for _ in range(half)]
                assert kt.save(c, cache, saved, keys) == half

            def load_pass() -> None:
                assert kt.load(c, keys, cache, loaded) == half

            nbytes = half * lay.block_bytes
            r = self.rate(nbytes, save_pass)
            self.emit(figure="kvtier.torch", op="save", pages=half, block_bytes=lay.block_bytes,
                      verified=True, **r)
            r = self.rate(nbytes, load_pass)
            ok = all(torch.equal(a[half:], a[:half]) for layer in cache for a in layer)
            self.emit(figure="kvtier.torch", op="load", pages=half, block_bytes=lay.block_bytes,
                      verified=ok, **r)
            c.delete(keys)
            kt.unpin(c)

    def summary(self) -> None:
        """kvtier / torch-pinned and kvtier / pageable per size and direction."""
        rates = {(r["memory"], r["size"], r["direction"]): r["gb_per_s"]
                 for r in self.rows if r.get("figure") == "copy"}
        out = {}
        for (memory, size, direction), gbps in rates.items():
            if memory != "kvtier":
                continue
            for base in ("torch-pinned", "pageable"):
                other = rates.get((base, size, direction))
                if other:
                    out[f"{direction}_{size}_vs_{base}"] = round(gbps / other, 3)
        self.emit(figure="summary", ratios=out,
                  verified=all(r.get("verified", True) for r in self.rows))


def _buf(b: Any) -> Any:
    assert b is not None
    return b


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
