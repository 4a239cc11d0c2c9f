"""``kvtierd``: run the daemon.  ``kvtierd`` alone runs on embedded defaults."""

from __future__ import annotations

import os

# numpy's OpenBLAS starts a thread per core at import that spins between calls; the
# daemon does no linear algebra, and on a small host those threads take a core from
# the event loop and from recovery (before any import of numpy; the operator's own
# setting wins).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from kvtier.errors import KVTierError  # noqa: E402
from kvtierd import logs  # noqa: E402
from kvtierd.config import Config, ConfigError, config_to_dict, load_config  # noqa: E402

log = logging.getLogger("kvtierd")

#: How long a thread holds the GIL while another waits for it (CPython's default is
#: 5 ms).  When clients keep the event loop busy it never gives the GIL up by itself,
#: and the I/O threads (demotions' SSD writes and syncs, promotions' reads, segment
#: and spill file creation) get it back after each system call only when this
#: interval forces a switch.  A waiting thread asks for the switch only after a whole
#: interval in which the holder never let the GIL go: the loop (uvloop) lets it go
#: and takes it back at every I/O callback, and each time the waiter's wait starts
#: over.  So the interval must be shorter than the gaps between the loop's callbacks
#: under a flood of calls.  At 5 ms an SSD sync took up to 1 s; at 0.2 ms, once the
#: loop served calls faster (2026-12-07), a new extent took up to 0.34 s to create
#: and a tenant's put waited for it; at 50 us creation stays under 10 ms
#: (docs/decisions.md).
GIL_SWITCH_INTERVAL = 0.00005


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvtierd",
        description="Per-host KV-cache tiering daemon. Precedence: built-in defaults < "
        "--config FILE (or $KVTIER_CONFIG) < KVTIER_* environment < --set.",
    )
    p.add_argument("--config", metavar="FILE", help="YAML config file (see config/kvtier.yaml)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                   help="override one key, e.g. --set dram.capacity=2GiB (repeatable)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration as JSON and exit")
    return p.parse_args(argv)


def _prepare_warm_start(cfg: Config) -> None:
    """Before the rest of kvtierd is imported (a third of a second): the key index
    tables a warm start will fill, made from the segment headers in ``dram.shm_dir``
    and populated by threads meanwhile (``shared_index.prepare_tables``)."""
    from kvtierd import segments, shared_index

    shared_index.prepare_tables(
        segments.slots_by_namespace(cfg.dram.shm_dir, max_bytes=cfg.dram.capacity))


async def _serve(cfg: Config) -> None:
    from kvtierd.app import create_daemon  # (after _prepare_warm_start: see there)

    daemon = await create_daemon(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: stopping (grace %.1f s)", cfg.server.grace)
    await daemon.stop()


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        cfg = load_config(args.config, overrides=args.set)
    except ConfigError as exc:
        print(f"kvtierd: config error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(config_to_dict(cfg), indent=2))
        return 0
    logs.setup(cfg.log.level, cfg.log.format, instance=cfg.instance)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    _prepare_warm_start(cfg)
    try:
        import uvloop

        uvloop.run(_serve(cfg))
    except KVTierError as exc:
        print(f"kvtierd: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
