"""``kvtier demo``: time-to-first-token with and without kvtier, in one command.

It starts a private ``kvtierd`` (its own sockets, shared-memory directory, a
small DRAM tier and an SSD tier in temp directories; stopped and removed at
the end) and serves one prompt with a small JAX transformer with a paged KV
cache four ways:

1. **cold**: this process prefills the whole prompt, then saves its full
   pages to kvtier (``kvtier.jax.save``);
2. **DRAM hit**: a fresh Python process (nothing in its memory) plans with
   ``kvtier.plan_prefix``, loads the cached pages (``kvtier.jax.load``) and
   prefills only the rest (at least the last token);
3. the same after **SIGKILL and restart of kvtierd** (the warm restart
   re-adopts the shared-memory segments);
4. the same after the pages were **pushed out of DRAM to the SSD tier** by
   another namespace's traffic.

Each hit path must reproduce the cold path's next-token logits
(``np.allclose`` within ``ATOL``/``RTOL``); otherwise the demo exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import IO, Any

import numpy as np

from kvtier.errors import KVTierError

ATOL = 1e-4
RTOL = 1e-4
MiB = 1 << 20


class DemoError(RuntimeError):
    """The demo could not run (a process failed, the daemon did not start...)."""


# --------------------------------------------------------------------------- daemon
@dataclasses.dataclass
class Daemon:
    """A private kvtierd: started, SIGKILLed, restarted and stopped by the demo."""

    base: str
    shm_dir: str
    ssd_dir: str
    capacity: int
    extent: int
    ssd_capacity: int
    ssd_file: int
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def socket_dir(self) -> str:
        return os.path.join(self.base, "sock")

    @property
    def log_path(self) -> str:
        return os.path.join(self.base, "kvtierd.log")

    def args(self) -> list[str]:
        sets = {
            "instance": "kvtier-demo",
            "server.socket_dir": self.socket_dir,
            "dram.shm_dir": self.shm_dir,
            "dram.capacity": str(self.capacity),
            "dram.extent_size": str(self.extent),
            "dram.mlock": "false",
            "spill.ssd_dir": self.ssd_dir,
            "spill.ssd_capacity": str(self.ssd_capacity),
            "spill.ssd_file_size": str(self.ssd_file),
            "metrics.address": "",
        }
        out = [sys.executable, "-m", "kvtierd"]
        for k, v in sets.items():
            out += ["--set", f"{k}={v}"]
        return out

    def start(self) -> None:
        from kvtier._admin import wait_serving

        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts + 1}\n".encode())
            log.flush()
            # Its own session: a Ctrl-C in the terminal reaches the demo, which stops it.
            self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        self.starts += 1
        try:
            wait_serving(self.socket_dir, self.proc, timeout=60)
        except (RuntimeError, TimeoutError) as exc:
            raise DemoError(f"kvtierd did not start: {exc}\n{self.log_tail()}") from None

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs; shared memory and SSD files stay."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def stats(self) -> Any:
        from kvtier._admin import fetch_stats

        return fetch_stats(self.socket_dir, timeout=10)

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
        except OSError:
            return ""
        return "kvtierd log (last lines):\n" + "\n".join("  " + t for t in tail)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Cleanup that Ctrl-C (or SIGTERM) must not cut short.  A signal that arrives
    meanwhile is held, not lost: once the cleanup is done it is raised as
    KeyboardInterrupt (unless an exception is already on its way out)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: types.FrameType | None) -> None:
        held.append(signum)

    saved = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        if held and sys.exc_info()[0] is None:
            raise KeyboardInterrupt(f"signal {held[0]} (held during cleanup)")


@contextlib.contextmanager
def workspace() -> Iterator[tuple[str, str, str]]:
    """(base dir for sockets/logs/results, shm dir, ssd dir), all removed at the end."""
    base = tempfile.mkdtemp(prefix="kvtier-demo-", dir="/tmp")  # short: socket paths <= 107 B
    shm = f"/dev/shm/kvtier-demo-{uuid.uuid4().hex[:12]}" if os.path.isdir("/dev/shm") else \
        os.path.join(base, "shm")
    # /var/tmp is on disk where /tmp may be tmpfs: the SSD tier wants a real filesystem.
    spill_root = tempfile.mkdtemp(prefix="kvtier-demo-", dir="/var/tmp"
                                  if os.access("/var/tmp", os.W_OK) else None)
    try:
        yield base, shm, os.path.join(spill_root, "ssd")
    finally:
        with shielded():
            for path in (base, shm, spill_root):
                shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- results
@dataclasses.dataclass
class PathResult:
    key: str
    label: str
    tiers: list[str]
    load_tokens: int
    prefill_tokens: int
    ttft_s: float
    plan_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    max_abs_diff: float = 0.0
    allclose: bool = True
    next_token: int = -1
    note: str = ""

    def tiers_text(self) -> str:
        if not self.tiers:
            return "-"
        return " ".join(f"{t}×{n}" for t, n in Counter(self.tiers).items())


def _compare(res: PathResult, logits: np.ndarray, cold: np.ndarray) -> None:
    res.max_abs_diff = float(np.max(np.abs(logits - cold)))
    res.allclose = bool(logits.shape == cold.shape and
                        np.allclose(logits, cold, atol=ATOL, rtol=RTOL))
    res.next_token = int(np.argmax(logits))


# --------------------------------------------------------------------------- worker runs
def run_worker(base: str, key: str, params: dict[str, Any], on_phase: Any) -> tuple[
        dict[str, Any], np.ndarray]:
    """Serve the prompt in a fresh Python process; returns its result and logits."""
    logits_out = os.path.join(base, f"logits-{key}.npy")
    args = dict(params, logits_out=logits_out)
    err_path = os.path.join(base, f"worker-{key}.stderr")
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.demo.worker", json.dumps(args)],
                                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    result: dict[str, Any] | None = None
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "phase" in msg:
                on_phase(msg["phase"])
            elif "result" in msg:
                result = msg["result"]
        rc = proc.wait(120)
    finally:
        with shielded():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
    if rc != 0 or result is None:
        with open(err_path, errors="replace") as f:
            tail = "".join(f.readlines()[-25:])
        raise DemoError(f"the {key} process failed (exit {rc}):\n{tail}")
    return result, np.load(logits_out)


# --------------------------------------------------------------------------- UI
class UI:
    """rich progress and tables (to stderr with --json, so stdout is the JSON alone)."""

    def __init__(self, json_mode: bool) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = Console(stderr=json_mode, highlight=False)
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description:<46}"),
                                 BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=self.console, disable=json_mode)

    def print(self, *items: Any) -> None:
        self.console.print(*items)

    def task(self, description: str, total: int) -> Any:
        return self.progress.add_task(description, total=total)

    def advance(self, task: Any, n: float = 1, description: str | None = None) -> None:
        if description is None:
            self.progress.update(task, advance=n)
        else:
            self.progress.update(task, advance=n, description=description)

    def finish(self, task: Any) -> None:
        t = self.progress.tasks[[x.id for x in self.progress.tasks].index(task)]
        self.progress.update(task, completed=t.total)

    def table(self, results: list[PathResult]) -> Any:
        from rich import box
        from rich.table import Table

        cold = results[0].ttft_s
        tab = Table(title="time to first token", title_justify="left", box=box.SIMPLE_HEAD,
                    pad_edge=False, collapse_padding=True)
        for col in ("path", "tiers", "loaded", "prefill", "TTFT ms", "speedup",
                    "max |Δ|", "ok"):
            tab.add_column(col, justify="left" if col in ("path", "tiers") else "right",
                           no_wrap=True)
        for r in results:
            ref = r.key == "cold"
            tab.add_row(
                r.label, r.tiers_text(), str(r.load_tokens), str(r.prefill_tokens),
                f"{r.ttft_s * 1e3:.1f}", "1.0x" if ref else f"{cold / r.ttft_s:.1f}x",
                "ref." if ref else f"{r.max_abs_diff:.1e}",
                "" if ref else ("[green]yes[/]" if r.allclose else "[bold red]NO[/]"),
            )
        return tab


# --------------------------------------------------------------------------- the demo
def _tier_names(client: Any, keys: list[bytes]) -> list[str]:
    return [t.name for t in client.lookup_tiers(keys)]


def _corrupt_one_block(client: Any, keys: list[bytes]) -> None:
    """--corrupt-for-test: replace one stored page by a perturbed copy (a real bad block)."""
    key = keys[len(keys) // 2]
    (block,) = client.get([key])
    bad = block.view(np.float32).copy()
    bad += 0.5
    client.delete([key])
    client.put([key], [bad.view(np.uint8)])


def _push_out_of_dram(ui: UI, daemon: Daemon, ns: Any, keys: list[bytes]) -> str:
    """Store other prompts' pages until this prompt's pages live on the SSD tier only.

    DRAM evicts its least recently used blocks of the namespace, demoting
    each to the SSD tier first (write-back); the prompt's pages are the oldest.
    """
    import kvtier

    block_bytes = int(ns["block_bytes"])
    per_batch = max(16, daemon.capacity // block_bytes // 8)
    limit = 4 * daemon.capacity // block_bytes  # pages, at most
    task = ui.task("4 push it to SSD: other prompts' pages", limit)
    rng = np.random.default_rng(1)
    written = 0
    with kvtier.Client(daemon.socket_dir, **ns) as client:
        while written < limit:
            batch = [f"other-prompt-page-{written + i:08d}".encode() for i in range(per_batch)]
            client.put(batch, [rng.integers(0, 256, block_bytes, np.uint8)
                               for _ in range(per_batch)])
            written += per_batch
            ui.advance(task, per_batch)
            tiers = _tier_names(client, keys)  # Lookup: no side effects on the LRU
            if len(tiers) == len(keys) and "DRAM" not in tiers:
                break
        ui.progress.update(task, total=written, completed=written)
        tiers = _tier_names(client, keys)
    if len(tiers) < len(keys) or "DRAM" in tiers:
        raise DemoError(f"after {written} other pages the prompt's {len(keys)} pages are on "
                        f"{dict(Counter(tiers))}, not all on SSD")
    return f"{written} other pages ({written * block_bytes / MiB:.1f} MiB) stored"


def run_demo(args: argparse.Namespace, ui: UI) -> dict[str, Any]:
    import kvtier
    from kvtier import jax as kvjax
    from kvtier.demo.model import CONFIGS, Model, make_prompt, setup_jax

    model_name = "tiny" if args.tiny else "default"
    cfg = CONFIGS[model_name]
    n = args.prompt_tokens or (256 if args.tiny else 2048)
    bb = cfg.kv_block_bytes
    full_pages = n // cfg.page_tokens
    capacity = max(4 * MiB, _pow2_at_least(3 * full_pages * bb))
    results: list[PathResult] = []
    failures: list[str] = []
    info: dict[str, Any] = {}

    with workspace() as (base, shm_dir, ssd_dir), ui.progress:
        daemon = Daemon(base, shm_dir, ssd_dir, capacity=capacity, extent=capacity // 8,
                        ssd_capacity=8 * capacity + 4 * full_pages * bb, ssd_file=capacity)
        ui.print(f"[bold]kvtier demo[/]: {n}-token prompt, seed {args.seed}; model: "
                 f"{cfg.describe()}")
        ui.print(f"private kvtierd: DRAM {capacity // MiB} MiB in {shm_dir}, SSD tier in "
                 f"{ssd_dir}; prompt = {full_pages} full pages = "
                 f"{full_pages * bb / MiB:.1f} MiB")
        ui.print("hit paths run in fresh Python processes; they share only a JAX compilation "
                 "cache (programs, no data). TTFT excludes compilation and warm-up.")
        jax_cache = os.path.join(base, "jax-cache")
        setup_jax(jax_cache)
        try:
            t = ui.task("start kvtierd", 1)
            daemon.start()
            ui.finish(t)

            # 1. cold: compute the prompt, keep its logits, save its full pages.
            tokens = make_prompt(cfg, n, args.seed)
            model = Model(cfg, args.seed, n)
            model_uid = f"kvtier-demo@{model_name}-seed{args.seed}"
            ns = kvjax.namespace_for(kvjax.layout_of(model.new_cache()), model_uid)
            if ns["block_bytes"] != bb:
                raise DemoError(f"block_bytes {ns['block_bytes']} != {bb}")
            t = ui.task("1 cold prefill: compile", model.chunks(n))
            model.warm_up()
            ui.advance(t, 0, "1 cold prefill (this process)")
            table = list(range(model.pages))
            t0 = time.perf_counter()
            cache, logits = model.prefill(model.new_cache(), table, tokens, 0,
                                          on_chunk=lambda _: ui.advance(t))
            cold_s = time.perf_counter() - t0
            cold = np.asarray(logits)
            keys = kvtier.block_keys(tokens, cfg.page_tokens)
            with kvtier.Client(daemon.socket_dir, **ns) as client:
                t1 = time.perf_counter()
                saved = kvjax.save(client, cache, table[:full_pages], keys)
                save_s = time.perf_counter() - t1
                if args.corrupt_for_test:
                    _corrupt_one_block(client, keys)
            del cache
            results.append(PathResult("cold", "1 cold prefill", [], 0, n, cold_s,
                                      prefill_s=cold_s, next_token=int(np.argmax(cold)),
                                      note=f"saved {saved} pages in {save_s * 1e3:.1f} ms"))

            params = {"socket": daemon.socket_dir, "model_uid": model_uid, "model": model_name,
                      "prompt_tokens": n, "seed": args.seed, "compilation_cache": jax_cache}
            phases = {"started": "started", "compiled": "compiled", "warmed": "warmed up"}

            def hit(key: str, label: str, note: str = "") -> PathResult:
                task = ui.task(f"{label}: new process", 4)

                def on_phase(phase: str) -> None:
                    ui.advance(task, 1, f"{label}: {phases.get(phase, phase)}")

                res, got = run_worker(base, key, params, on_phase)
                ui.finish(task)
                r = PathResult(key, label, res["tiers"], res["load_tokens"],
                               res["prefill_tokens"], res["ttft_s"], res["plan_s"],
                               res["load_s"], res["prefill_s"], note=note)
                _compare(r, got, cold)
                results.append(r)
                return r

            # 2. a fresh process finds the prefix in DRAM.
            hit("dram", "2 DRAM hit")

            # 3. SIGKILL the daemon, restart it: the segments are re-adopted.
            t = ui.task("3 kill -9 kvtierd, restart it", 1)
            daemon.kill()
            t0 = time.perf_counter()
            daemon.start()
            restart_s = time.perf_counter() - t0
            s = daemon.stats()
            ui.finish(t)
            info["warm_restart"] = {"warm_start": s.warm_start,
                                    "recovered_blocks": s.recovered_blocks,
                                    "restart_s": restart_s}
            hit("restart", "3 kill -9, restart",
                f"warm start {s.warm_start}, {s.recovered_blocks} blocks re-adopted, "
                f"ready in {restart_s:.2f} s")

            # 4. push the pages out of DRAM (demoted to SSD first), then hit them there.
            before = daemon.stats()
            filled = _push_out_of_dram(ui, daemon, ns, keys)
            mid = daemon.stats()
            r = hit("ssd", "4 SSD hit")
            after = daemon.stats()
            r.note = (f"{filled}; demotions {mid.demotions - before.demotions}, "
                      f"promotions {after.promotions - mid.promotions}")
            info["ssd"] = {"demotions": mid.demotions - before.demotions,
                           "promotions": after.promotions - mid.promotions,
                           "evictions": mid.evictions - before.evictions}
        finally:
            with shielded():
                daemon.stop()

    for r in results[1:]:
        if not r.allclose:
            failures.append(f"{r.label}: logits differ from the cold path (max |diff| "
                            f"{r.max_abs_diff:.3e} > atol {ATOL:g} + rtol {RTOL:g} * |cold|)")
        if r.load_tokens == 0:
            failures.append(f"{r.label}: nothing was loaded from kvtier")
    ssd = next((r for r in results if r.key == "ssd"), None)
    if ssd is not None and "SSD" not in ssd.tiers:
        failures.append("4 SSD hit: the prefix was not found on the SSD tier")
    return {
        "ok": not failures,
        "failures": failures,
        "tolerance": {"atol": ATOL, "rtol": RTOL, "dtype": "float32"},
        "model": model_name,
        "model_config": dataclasses.asdict(cfg),
        "prompt_tokens": n,
        "page_tokens": cfg.page_tokens,
        "seed": args.seed,
        "block_bytes": bb,
        "paths": [dataclasses.asdict(r) for r in results],
        "daemon": info,
    }


def plot(path: str, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = out["paths"]
    labels = [p["label"].split(" ", 1)[-1] for p in paths]
    ms = [p["ttft_s"] * 1e3 for p in paths]
    colors = ["#999999"] + ["#2b8cbe" if p["allclose"] else "#d7301f" for p in paths[1:]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars = ax.bar(labels, ms, color=colors)
    if max(ms) > 10 * min(ms):
        from matplotlib.ticker import ScalarFormatter

        ax.set_yscale("log")
        ax.set_ylim(bottom=min(ms) / 3, top=max(ms) * 2)
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.set_ylabel("time to first token (ms, log scale)")
    else:
        ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"kvtier demo: {out['prompt_tokens']}-token prompt, {out['model']} model")
    for bar, value in zip(bars, ms, strict=True):
        ax.annotate(f"{value:.1f} ms", (bar.get_x() + bar.get_width() / 2, value),
                    ha="center", va="bottom", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvtier demo",
        description="Serve one prompt cold, then from kvtier in fresh processes (DRAM, after a "
        "daemon SIGKILL + restart, from the SSD tier); compare TTFT and check the logits match. "
        "Starts (and stops) a private kvtierd in temp directories.")
    p.add_argument("--prompt-tokens", type=int, default=0, metavar="N",
                   help="prompt length (default 2048; 256 with --tiny)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed (default 0)")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny model and prompt: the correctness path in seconds (for CI)")
    p.add_argument("--plot", metavar="PNG", help="write a bar chart of the TTFTs (matplotlib)")
    p.add_argument("--json", action="store_true",
                   help="print the results as JSON on stdout (progress and table go to stderr)")
    p.add_argument("--corrupt-for-test", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prompt_tokens and args.prompt_tokens < 32:  # two pages: one to load, one to prefill
        p.error("--prompt-tokens must be at least 32")
    return args


def _raise_on_sigterm(signum: int, frame: types.FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    try:
        import jax  # noqa: F401  (the model and kvtier.jax)

        ui = UI(args.json)
    except ImportError as exc:
        print(f"kvtier demo needs the demo extra (pip install 'kvtier[demo]'): {exc}",
              file=sys.stderr)
        return 2
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm) if main_thread else None
    try:
        out = run_demo(args, ui)
    except KeyboardInterrupt:
        ui.print("[bold red]interrupted[/]: kvtierd stopped, temp directories removed")
        return 130
    except (DemoError, KVTierError) as exc:
        ui.print(f"[bold red]kvtier demo failed:[/] {type(exc).__name__}: {exc}")
        return 1
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    results = [PathResult(**p) for p in out["paths"]]
    ui.print(ui.table(results))
    for r in results:
        parts = [] if r.key == "cold" else [
            f"plan {r.plan_s * 1e3:.1f} + load {r.load_s * 1e3:.1f} + prefill "
            f"{r.prefill_s * 1e3:.1f} ms"]
        ui.print(f"  {r.label}: " + "; ".join(parts + ([r.note] if r.note else [])))
    ui.print(f"logits compared with the cold path: np.allclose(atol={ATOL:g}, rtol={RTOL:g}) "
             f"on float32; next token {results[0].next_token}")
    if args.plot:
        plot(args.plot, out)
        ui.print(f"plot written to {args.plot}")
    if args.json:
        stream: IO[str] = sys.stdout
        stream.write(json.dumps(out, indent=2) + "\n")
    if not out["ok"]:
        ui.print("[bold red]FAILED[/]: " + "; ".join(out["failures"]))
        return 1
    ui.print("[bold green]OK[/]: every path reproduced the cold path's logits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
