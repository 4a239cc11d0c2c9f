"""The optional TCP listener: TLS only, client certificates, cert-based admin."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc
from tests.conftest import DaemonProc, start_daemon, stop_daemon

#: What these tests check does not depend on the client transport (the adapters,
#: the tools and the daemon's own interfaces); they run once, on the default (fast).
pytestmark = pytest.mark.one_transport


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost, and two client certificates."""
    d = str(tmp_path_factory.mktemp("pki"))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "2", "-subj", "/CN=kvtier-test-ca", cwd=d)
    for name, cn, ext in (
        ("server", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ("admin", "ops-admin", "extendedKeyUsage=clientAuth"),
        ("other", "someone-else", "extendedKeyUsage=clientAuth"),
    ):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile",
                 f"{name}.ext", cwd=d)
    return {k: os.path.join(d, k) for k in os.listdir(d)}


def _tls_daemon(workdir: str, pki: dict[str, str], auth: str) -> tuple[DaemonProc, int]:
    d = start_daemon(
        workdir,
        "--set", "server.tcp_address=127.0.0.1:0",
        "--set", f"server.tls_cert={pki['server.pem']}",
        "--set", f"server.tls_key={pki['server.key']}",
        "--set", f"server.tls_client_ca={pki['ca.pem']}",
        "--set", f"server.tls_client_auth={auth}",
        "--set", "access.admin=[uid:0, cert:ops-admin]",
    )
    m = re.search(r"tcp\+tls 127\.0\.0\.1:(\d+)", d.log())
    assert m, d.log()
    return d, int(m.group(1))


@pytest.fixture
def mtls(workdir: str, pki: dict[str, str]) -> Iterator[tuple[DaemonProc, int]]:
    d, port = _tls_daemon(workdir, pki, "required")
    yield d, port
    stop_daemon(d)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _creds(pki: dict[str, str], client: str | None) -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=_read(pki["ca.pem"]))
    return grpc.ssl_channel_credentials(
        root_certificates=_read(pki["ca.pem"]), private_key=_read(pki[f"{client}.key"]),
        certificate_chain=_read(pki[f"{client}.pem"]))


def _health(channel: grpc.Channel) -> str:
    resp = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="kvtier.v1.KVTier"), timeout=5)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def test_tcp_listener_without_tls_is_refused_at_start(workdir: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtierd", "--set", f"server.socket_dir={workdir}/s",
         "--set", "server.tcp_address=0.0.0.0:0"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert ("server.tcp_address '0.0.0.0:0' needs TLS: set server.tls_cert and server.tls_key "
            "(kvtierd never serves TCP in plaintext, on loopback or elsewhere)") in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "kvtierd", "--set", f"server.socket_dir={workdir}/s",
         "--set", "server.tcp_address=127.0.0.1:0"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "needs TLS" in out.stderr


def test_plaintext_and_certificateless_clients_are_refused(mtls: tuple[DaemonProc, int],
                                                           pki: dict[str, str]) -> None:
    d, port = mtls
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        with pytest.raises(grpc.RpcError) as exc:
            _health(ch)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(f"127.0.0.1:{port}", _creds(pki, None)) as ch:
        with pytest.raises(grpc.RpcError) as exc:
            _health(ch)  # client certificates are required
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(f"127.0.0.1:{port}", _creds(pki, "admin")) as ch:
        assert _health(ch) == "SERVING"
    assert d.alive()


def test_admin_over_tls_is_authorized_by_certificate_name(mtls: tuple[DaemonProc, int],
                                                          pki: dict[str, str]) -> None:
    d, port = mtls
    import kvtier

    with kvtier.Client(d.socket_dir, namespace="tls/ns", block_bytes=4096, model_uid="m") as c:
        c.put([b"a"], [b"x"])
    with grpc.secure_channel(f"127.0.0.1:{port}", _creds(pki, "admin")) as ch:
        stub = pb_grpc.KVTierStub(ch)
        stats = stub.Stats(pb.StatsRequest(), timeout=10)
        assert [n.name for n in stats.namespaces] == ["tls/ns"]
        assert list(stub.Check(pb.CheckRequest(), timeout=30).problems) == []
        with pytest.raises(grpc.RpcError) as exc:  # the data path needs a local session
            stub.Lookup(pb.LookupRequest(keys=[b"a"]), timeout=10)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.secure_channel(f"127.0.0.1:{port}", _creds(pki, "other")) as ch:
        with pytest.raises(grpc.RpcError) as exc:
            pb_grpc.KVTierStub(ch).Check(pb.CheckRequest(), timeout=10)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert exc.value.details() == ("certificate 'someone-else' is not a daemon admin "
                                       "(access.admin)")
        stats = pb_grpc.KVTierStub(ch).Stats(pb.StatsRequest(), timeout=10)
        assert list(stats.namespaces) == []  # no admin right anywhere: no namespaces shown


def test_server_only_tls_gives_tcp_callers_no_identity(workdir: str,
                                                       pki: dict[str, str]) -> None:
    d, port = _tls_daemon(workdir, pki, "none")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError):
                _health(ch)  # still no plaintext
        for client in (None, "admin"):  # a certificate is not asked for, so never trusted
            with grpc.secure_channel(f"127.0.0.1:{port}", _creds(pki, client)) as ch:
                assert _health(ch) == "SERVING"
                with pytest.raises(grpc.RpcError) as exc:
                    pb_grpc.KVTierStub(ch).Stats(pb.StatsRequest(), timeout=10)
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stop_daemon(d)


def test_a_taken_tcp_port_is_one_line_naming_the_key(workdir: str, pki: dict[str, str]) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        out = subprocess.run(
            [sys.executable, "-m", "kvtierd", "--set", f"server.socket_dir={workdir}/t/s",
             "--set", f"dram.shm_dir=/dev/shm/kvtier-test-tcp-{os.getpid()}",
             "--set", "metrics.address=", "--set", f"server.tcp_address=127.0.0.1:{port}",
             "--set", f"server.tls_cert={pki['server.pem']}",
             "--set", f"server.tls_key={pki['server.key']}"],
            capture_output=True, text=True, timeout=60)
    finally:
        holder.close()
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert [ln for ln in out.stderr.splitlines() if ln.startswith("kvtierd: ")] == [
        f"kvtierd: cannot listen on server.tcp_address '127.0.0.1:{port}' (in use, or not an "
        "address of this host)"], out.stderr
    assert not os.path.exists(f"{workdir}/t")
    assert not os.path.exists(f"/dev/shm/kvtier-test-tcp-{os.getpid()}")
