"""kvtierd: the per-host KV-cache tiering daemon.

Where things are:
  app.py             wiring: create_daemon() builds and starts everything
  service.py         where a gRPC request enters (validation, error mapping)
  session_channel.py the session socket: namespace declaration, fd passing, liveness
  store/             block tables, key indexes, CLOCK, reservations, leases (layers: docstring)
  segments.py        the shared-memory segment format (mechanism: where bytes live)
  config.py          typed, frozen configuration
  metrics.py         Prometheus metrics
"""
