"""vLLM general plugin (entry point ``vllm.general_plugins: kvtier``).

vLLM calls :func:`register` in each of its processes before it builds a KV connector or
an executor.  It does two things:

* registers ``KVTierConnector`` with vLLM's connector factory, so
  ``"kv_connector": "KVTierConnector"`` works without ``kv_connector_module_path``;
* keeps vLLM-CPU's model threads as they are without a connector (:func:`keep_cpu_threads`):
  vLLM-CPU reserves one more core whenever *any* KV connector is configured (for NIXL's
  transfer thread), and a different number of OpenMP threads sums the model's floats in a
  different order, so the same prompt gets a different greedy answer (docs/decisions.md,
  "Output parity").  A kvtier engine must answer exactly as the same engine without it.

Kept apart from :mod:`kvtier.vllm` so loading the plugin imports nothing heavy.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Final

#: vLLM's own variable for the cores its CPU backend leaves to other processes; set, it wins.
RESERVED_CPU_ENV: Final = "VLLM_CPU_NUM_OF_RESERVED_CPU"
CONNECTOR: Final = "KVTierConnector"

logger = logging.getLogger("vllm.kvtier")


def register() -> None:
    """Register ``KVTierConnector`` and keep vLLM-CPU's thread count (idempotent)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # an engine without KV connectors: nothing to register
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR, "kvtier.vllm", CONNECTOR)
    except ValueError:
        pass  # already registered: plugins may load more than once per process
    keep_cpu_threads()


class _WithoutConnector:
    """``config`` as vLLM-CPU's core reservation sees it with no KV connector configured."""

    kv_transfer_config = None

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def is_kvtier_alone(kv_transfer_config: Any) -> bool:
    """Whether the engine's only KV connector is kvtier's (a MultiConnector that also runs
    NIXL, or any other connector, keeps vLLM's reservation)."""
    return getattr(kv_transfer_config, "kv_connector", None) == CONNECTOR


def reservation_config(config: Any) -> Any:
    """The config vLLM-CPU should reserve cores for: ``config`` itself, or, for an engine
    whose only connector is kvtier's and whose operator did not set
    ``VLLM_CPU_NUM_OF_RESERVED_CPU``, ``config`` seen without a connector."""
    ktc = getattr(config, "kv_transfer_config", None)
    if ktc is None or not is_kvtier_alone(ktc) or RESERVED_CPU_ENV in os.environ:
        return config
    logger.info("kvtier: the model keeps the CPU threads it has without a KV connector "
                "(vLLM-CPU would reserve one more core for a connector, and another thread "
                "count changes the model's answers); set %s to choose", RESERVED_CPU_ENV)
    return _WithoutConnector(config)


def keep_cpu_threads() -> None:
    """Wrap vLLM-CPU's ``OMPProcessManager`` so a kvtier engine's core reservation is
    the one it has without a connector (idempotent; nothing where vLLM has no such class)."""
    try:
        from vllm.utils import ompmultiprocessing
    except ImportError:
        return
    manager = getattr(ompmultiprocessing, "OMPProcessManager", None)
    init = getattr(manager, "__init__", None)
    if manager is None or init is None or getattr(init, "_kvtier_wrapped", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        init(self, reservation_config(config), *args, **kwargs)

    __init__._kvtier_wrapped = True  # type: ignore[attr-defined]
    manager.__init__ = __init__
