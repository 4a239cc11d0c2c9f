"""``kvtierd``: run the daemon.  ``kvtierd`` alone runs on embedded defaults."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from kvtier.errors import KVTierError
from kvtierd import logs
from kvtierd.app import create_daemon
from kvtierd.config import Config, ConfigError, config_to_dict, load_config

log = logging.getLogger("kvtierd")


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


async def _serve(cfg: Config) -> None:
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
    try:
        import uvloop

        uvloop.run(_serve(cfg))
    except KVTierError as exc:
        print(f"kvtierd: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
