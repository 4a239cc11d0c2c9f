"""Admin calls the command-line tools share: health, Stats, Check, waiting for a daemon.

``kvtier`` (the CLI), ``kvtier bench``, ``doctor``, ``top`` and the demo import
these from here; the CLI only dispatches to the tools, so nothing here (or in
the tools) imports ``kvtier.cli``.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

import grpc

from kvtier._core import DEFAULT_TIMEOUT, grpc_options, socket_paths
from kvtier._paths import explain_unreachable
from kvtier._session import SessionLink, admin_request
from kvtier._wire import SESSION_METADATA
from kvtier.errors import KVTierError, Unavailable, from_rpc_error
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc


def admin_call(socket: str | None, method: str, request: Any, timeout: float) -> Any:
    """One admin call in an admin session.

    The daemon learns who we are from the session channel (``SO_PEERCRED``):
    ``OpenAdmin`` there gives a token that authorizes the call as far as our
    uid's rights reach.  The session lasts as long as the call.
    """
    grpc_path, session_path = socket_paths(socket)
    link = SessionLink(session_path, timeout)
    try:
        resp, _ = link.request(admin_request())
        metadata = ((SESSION_METADATA, resp.opened.token),)
        with grpc.insecure_channel(f"unix:{grpc_path}", options=grpc_options()) as channel:
            try:
                return getattr(pb_grpc.KVTierStub(channel), method)(
                    request, timeout=timeout, metadata=metadata)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from None
    finally:
        link.close()


def health(socket: str | None, timeout: float = 5.0) -> str:
    """The gRPC health status of the KVTier service ("SERVING" when all is well)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    grpc_path, _ = socket_paths(socket)
    with grpc.insecure_channel(f"unix:{grpc_path}", options=grpc_options()) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvtier.v1.KVTier"), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise Unavailable(explain_unreachable(grpc_path)) from None
            raise from_rpc_error(exc) from None
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def wait_serving(socket: str, proc: subprocess.Popen[Any] | None = None,
                 timeout: float = 30) -> None:
    """Poll the daemon's health until SERVING; raise if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"kvtierd exited with status {proc.returncode}")
        try:
            if health(socket, timeout=1) == "SERVING":
                return
        except KVTierError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"kvtierd on {socket} did not become ready in {timeout:.0f} s")


def fetch_stats(socket: str | None, timeout: float = DEFAULT_TIMEOUT) -> pb.StatsResponse:
    """One Stats call (in an admin session of its own)."""
    resp: pb.StatsResponse = admin_call(socket, "Stats", pb.StatsRequest(), timeout)
    return resp


def run_check(socket: str | None, timeout: float = DEFAULT_TIMEOUT) -> list[str]:
    """The daemon's consistency check: the problems it found (empty when consistent)."""
    resp: pb.CheckResponse = admin_call(socket, "Check", pb.CheckRequest(), timeout)
    return list(resp.problems)
