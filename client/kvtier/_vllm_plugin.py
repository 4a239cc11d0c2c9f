"""vLLM general plugin (entry point ``vllm.general_plugins: kvtier``).

vLLM calls :func:`register` in each of its processes before it builds a KV connector, so
``"kv_connector": "KVTierConnector"`` works without ``kv_connector_module_path``.  Kept
apart from :mod:`kvtier.vllm` so loading the plugin imports nothing heavy.
"""

from __future__ import annotations


def register() -> None:
    """Register ``KVTierConnector`` with vLLM's connector factory (idempotent)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # an engine without KV connectors: nothing to register
        return
    try:
        KVConnectorFactory.register_connector("KVTierConnector", "kvtier.vllm",
                                              "KVTierConnector")
    except ValueError:
        pass  # already registered: plugins may load more than once per process
