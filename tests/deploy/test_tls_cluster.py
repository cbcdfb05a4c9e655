"""What the TLS of the shipped cluster keeps out, on the three servers of deploy/nats/cluster.conf run on loopback
with the certificates `epibus certs` writes: routes form only between servers the CA signed, and only a client
that trusts the CA and shows the client certificate gets in, through `open_nats` as the epibus node connects."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from nats.js.api import StorageType, StreamConfig

from bus.client.connection import open_nats
from bus.errors import Unavailable
from bus.host.ports import free_ports
from bus.host.tls import CA_ENV, CERT_ENV, KEY_ENV
from epibus.fleet.certs import generate
from tests.conftest import postgres_database
from tests.deploy.support import (
    ClusterPorts,
    NatsNode,
    Nodes,
    env_of,
    meta_of_three,
    mounted_certs,
    poll,
    route_peers,
    service,
    start_cluster_node,
    wait_for,
)
from tests.support import journal_event_ids, start_node_process, stop_node_process

pytestmark = pytest.mark.slow


def cert_sha256(path: Path) -> str:
    """The fingerprint nats-server logs with a certificate it refused."""
    return hashlib.sha256(x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(Encoding.DER)).hexdigest()


def others(cluster: Nodes, node: NatsNode) -> set[str]:
    return {n.name for n in cluster.nodes if n is not node}


async def test_every_server_routes_to_the_other_two_over_verified_tls(cluster: Nodes) -> None:
    for node in cluster.nodes:
        assert await asyncio.to_thread(route_peers, node) == others(cluster, node), cluster.diagnostics()
        _, varz = await asyncio.to_thread(node.monitor, "/varz")
        assert (varz["tls_required"], varz["tls_verify"]) == (True, True), f"{node.name}: clients without mTLS"
        routes = varz["cluster"]
        assert (routes.get("tls_required"), routes.get("tls_verify")) == (True, True), f"{node.name}: {routes}"


async def test_a_server_with_a_certificate_from_another_ca_cannot_join_the_routes(
    cluster: Nodes, cluster_certs: Path, tmp_path: Path
) -> None:
    # The impostor trusts the cluster's CA (its certificate is public) and claims to be nats-1 on loopback,
    # with a certificate another CA signed: only the cluster's own check can keep it out.
    generate(tmp_path / "other-ca", servers=["nats-1"])
    impostor_certs = tmp_path / "impostor-certs"
    impostor_certs.mkdir()
    shutil.copy2(cluster_certs / "ca.crt", impostor_certs / "ca.crt")
    for name in ("nats-1.crt", "nats-1.key"):
        shutil.copy2(tmp_path / "other-ca" / name, impostor_certs / name)
    refused = cert_sha256(impostor_certs / "nats-1.crt")

    _, varz = await asyncio.to_thread(cluster.nodes[0].monitor, "/varz")
    routes = sorted(int(url.rsplit(":", 1)[1]) for url in varz["cluster"]["urls"])
    assert len(routes) == 3, varz["cluster"]
    impostor = start_cluster_node(
        tmp_path, "nats-4", impostor_certs, ClusterPorts(*free_ports(3)), routes, like="nats-1"
    )
    try:
        # Each server has seen the impostor dial in and refused its certificate.
        await poll(
            "every server to refuse the impostor's route certificate",
            Nodes([*cluster.nodes, impostor]),
            lambda: all(
                "certificate signed by unknown authority" in n.log_text() and refused in n.log_text()
                for n in cluster.nodes
            ),
        )
        assert await asyncio.to_thread(route_peers, impostor) == set(), impostor.log_text()[-3000:]
        for node in cluster.nodes:
            assert await asyncio.to_thread(route_peers, node) == others(cluster, node), cluster.diagnostics()
        assert await asyncio.to_thread(meta_of_three, cluster), "the JetStream meta group changed"
    finally:
        impostor.stop()


async def test_a_client_with_the_ca_and_the_client_certificate_publishes_and_reads_through_the_cluster(
    cluster: Nodes, client_tls: ssl.SSLContext
) -> None:
    first, _, last = cluster.nodes
    writer = await open_nats([first.client_url], name="tls-writer", timeout_s=5)
    reader = await open_nats([last.client_url], name="tls-reader", timeout_s=5)
    try:
        js = writer.jetstream(timeout=10)
        config = StreamConfig(name="TLS", subjects=["tls.>"], storage=StorageType.FILE, num_replicas=3)
        await wait_for("creating an R3 stream over TLS", cluster, lambda: js.add_stream(config))
        ack = await wait_for("publishing over TLS", cluster, lambda: js.publish("tls.check", b"sealed"))
        got = await reader.jetstream(timeout=10).get_msg("TLS", ack.seq)
        assert (got.subject, got.data) == ("tls.check", b"sealed")

        # The server's own view: each connection is TLS 1.3 and showed the client certificate.
        for node, name in ((first, "tls-writer"), (last, "tls-reader")):
            _, connz = await asyncio.to_thread(node.monitor, "/connz?auth=true")
            (conn,) = [c for c in connz["connections"] if c.get("name") == name]
            assert conn["tls_version"] == "1.3", conn
            assert conn["tls_peer_certs"][0]["subject"] == "CN=epibus,O=epibus", conn
    finally:
        await writer.close()
        await reader.close()


async def test_a_plain_client_is_refused(cluster: Nodes) -> None:
    node = cluster.nodes[0]

    def speak_plain() -> tuple[dict[str, object], bytes, int]:
        with socket.create_connection(("127.0.0.1", node.client_port), timeout=10) as sock:
            info = json.loads(sock.makefile("rb").readline().split(b" ", 1)[1])
            sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
            answer = b""
            while chunk := sock.recv(4096):  # until the server closes the connection
                answer += chunk
            return info, answer, sock.getsockname()[1]

    info, answer, port = await asyncio.to_thread(speak_plain)
    assert (info["tls_required"], info["tls_verify"]) == (True, True), info
    assert b"PONG" not in answer, f"the server answered a plain client: {answer!r}"
    # The server's own record of the connection: closed at the handshake it never got.
    _, closed = await asyncio.to_thread(node.monitor, "/connz?state=closed")
    (conn,) = [c for c in closed["connections"] if c["port"] == port]
    assert conn["reason"] == "TLS Handshake Failure", conn
    assert conn["in_msgs"] == 0, conn
    _, connz = await asyncio.to_thread(node.monitor, "/connz")
    assert connz["num_connections"] == 0, connz


@pytest.mark.parametrize(
    ("case", "refused_because"),
    [
        ("no client certificate", "client didn't provide a certificate"),
        ("a client certificate from another CA", "certificate signed by unknown authority"),
        ("trusting another CA", None),  # refused by the client: the server's certificate does not verify
    ],
)
async def test_a_client_without_the_ca_and_a_certificate_it_signed_is_refused(
    case: str,
    refused_because: str | None,
    cluster: Nodes,
    cluster_certs: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = tmp_path / "other-ca"
    generate(other)
    ca, cert = {
        "no client certificate": (cluster_certs, None),
        "a client certificate from another CA": (cluster_certs, other),
        "trusting another CA": (other, cluster_certs),
    }[case]
    monkeypatch.setenv(CA_ENV, str(ca / "ca.crt"))
    for name, suffix in ((CERT_ENV, "crt"), (KEY_ENV, "key")):
        if cert is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(cert / f"client.{suffix}"))

    node = cluster.nodes[0]
    with pytest.raises(Unavailable) as refused:
        await open_nats([node.client_url], name="refused", timeout_s=3)
    if refused_because is None:
        assert "certificate verify failed" in str(refused.value), refused.value
    else:
        # The log line of the refusal names the certificate when there was one.
        shown = cert_sha256(cert / "client.crt") if cert is not None else ""
        await poll(
            "the server to log why",
            cluster,
            lambda: any(refused_because in line and shown in line for line in node.log_text().splitlines()),
        )
    _, connz = await asyncio.to_thread(node.monitor, "/connz")
    assert connz["num_connections"] == 0, connz


def compose_node_env(cluster: Nodes, certs: Path, home: Path, journal_url: str) -> dict[str, str]:
    """The epibus service's environment from docker-compose.yml, its paths and server names made local: the
    mounted certificate files become the ones `epibus certs` wrote, nats-N the loopback servers, and the journal
    on the postgres service a database of this machine's PostgreSQL (test_compose_services checks the URL)."""
    env = env_of(service("epibus"))
    assert "@postgres:5432/" in env["EPIBUS_JOURNAL_URL"], env["EPIBUS_JOURNAL_URL"]
    env["EPIBUS_JOURNAL_URL"] = journal_url
    mounted = mounted_certs("epibus")
    for key, value in env.items():
        if PurePosixPath(value) in mounted:
            env[key] = str(certs / mounted[PurePosixPath(value)])
    urls = env["EPIBUS_NATS_URL"]
    for node in cluster.nodes:
        urls = urls.replace(f"tls://{node.name}:4222", node.client_url)
    assert urls == ",".join(n.client_url for n in cluster.nodes), urls
    # The vector mirror loads an embedding model and is not what this checks.
    return env | {"EPIBUS_NATS_URL": urls, "EPIBUS_HOME": str(home), "EPIBUS_MIRROR": "off"}


async def test_the_node_as_compose_configures_it_connects_over_tls_and_journals_an_event(
    cluster: Nodes, cluster_certs: Path, tmp_path: Path
) -> None:
    home = tmp_path / "node-home"
    with postgres_database() as journal_url:
        env = compose_node_env(cluster, cluster_certs, home, journal_url)
        await node_journals_over_tls(cluster, home, env)
        assert journal_event_ids(journal_url, "demo"), "the node's PostgreSQL journal holds no event"


async def node_journals_over_tls(cluster: Nodes, home: Path, env: dict[str, str]) -> None:
    process, status = await asyncio.to_thread(start_node_process, home, env=env)
    try:
        published = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "epibus", "publish", "unknown", "-p", "demo", "--question", "does tls hold?",
             "--impact", "0.2", "--wait", "journaled", "--json"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )  # fmt: skip
        assert published.returncode == 0, published.stderr
        assert json.loads(published.stdout.strip().splitlines()[-1])["level"] == "journaled"

        def node_connection() -> dict[str, Any] | None:
            for node in cluster.nodes:
                _, connz = node.monitor("/connz?auth=true")
                for conn in connz["connections"]:
                    if str(conn.get("name", "")).startswith("epibus-node:"):
                        return dict(conn)
            return None

        conn = await asyncio.to_thread(node_connection)
        assert conn is not None, f"no server lists the node's connection; node status {status}"
        assert conn["tls_version"] == "1.3", conn
        assert conn["tls_peer_certs"][0]["subject"] == "CN=epibus,O=epibus", conn
    finally:
        await asyncio.to_thread(stop_node_process, process)
