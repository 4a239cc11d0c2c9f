"""kvtierd: the per-host KV-cache tiering daemon.

Where things are (docs/architecture.md walks a put, a get and a restart through them):
  app.py             wiring: create_daemon() builds and starts everything
  service.py         where a gRPC request enters (validation, error mapping)
  session_channel/   the session socket: namespace declaration, fd passing, liveness,
                     FastCalls, session pages, doorbells (parts: docstring)
  access.py          who may do what: principals, namespace rules, quotas
  store/             block tables, key indexes, CLOCK, reservations, leases: Store holds
                     its parts (state, budget, allocator, operations, fast path: docstring)
  block_table.py     a namespace's DRAM blocks in native records (csrc/blocks.c)
  shared_index.py    a namespace's DRAM keys, published for clients to search (csrc/index.c)
  tiering/           moving blocks between DRAM and the tiers below (parts: docstring)
  spill/             the tiers below DRAM: the LowerTier protocol, the SSD tier (ssd*.py:
                     files, key index, namespace ids, listings, allocation,
                     re-adoption, check) and the shared tier
  cluster/           the cluster tier: blocks shared between hosts through Mooncake Store
                     (tier.py the LowerTier calls, link.py the agent and its requests,
                     slots.py DRAM slots named to the agent, agent.py, format.py)
  segments.py        the shared-memory segment format (mechanism: where bytes live)
  layout.py          the slot entries as csrc/layout.h defines them (dtypes, structs)
  recovery.py        warm start: re-attach the segments a previous daemon left
  events.py          KV events for cache-aware routers
  counters.py        the daemon's totals, and what clients report about themselves
  lease_watch.py     the leases clients make without a call, as the daemon verifies them
  config.py          typed, frozen configuration
  metrics.py         Prometheus metrics
  logs.py            logging (JSON or text)
  systemd.py         sd_notify
"""
