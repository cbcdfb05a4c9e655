"""The deploy fixtures: certificates from `epibus certs` and the shipped cluster config running on loopback."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.host.tls import CA_ENV, CERT_ENV, KEY_ENV, nats_tls_context
from epibus.fleet.certs import generate
from tests.deploy.support import Nodes, start_cluster


@pytest.fixture
def cluster_certs(tmp_path: Path) -> Path:
    """What `epibus certs DIR` writes for the compose cluster (its defaults: nats-1, nats-2, nats-3)."""
    generate(tmp_path / "certs")
    return tmp_path / "certs"


@pytest.fixture
def client_tls(cluster_certs: Path, monkeypatch: pytest.MonkeyPatch) -> ssl.SSLContext:
    """The epibus node's settings as compose gives them (CA, client certificate and key), and the context
    `open_nats` builds from them; for a plain nats-py client."""
    monkeypatch.setenv(CA_ENV, str(cluster_certs / "ca.crt"))
    monkeypatch.setenv(CERT_ENV, str(cluster_certs / "client.crt"))
    monkeypatch.setenv(KEY_ENV, str(cluster_certs / "client.key"))
    context = nats_tls_context()
    assert context is not None
    return context


@pytest.fixture
def cluster(tmp_path: Path, cluster_certs: Path) -> Iterator[Nodes]:
    """The three nodes of deploy/nats/cluster.conf on loopback, with TLS on clients and routes.

    The file runs as shipped except for addresses, the store and where the TLS files are: -a/-p/-m/--cluster/
    --routes replace the compose hostnames and fixed ports with free loopback ports, and only the store_dir line
    and the TLS directory are rewritten. Each node's TLS directory holds what compose mounts into it."""
    nodes = start_cluster(tmp_path, cluster_certs)
    try:
        yield nodes
    finally:
        nodes.stop_all()
