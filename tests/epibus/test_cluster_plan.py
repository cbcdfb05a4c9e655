"""The cluster's route secret, `epibus up`'s route options and the cluster plan, read back from the files they
write. The running cluster is tested in tests/e2e/test_cluster.py."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from bus.errors import ConfigError
from bus.host.routes import ClusterRoutes, make_route_secret, read_route_secret
from bus.identity.signing import NODE_KEY_FILE, AgentKey, node_key
from epibus.cluster.local import CLUSTER_FILE, Supervisor, cluster_routes, plan_members, share_node_key


def test_the_route_secret_is_made_once_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "cluster" / "route.secret"
    secret = make_route_secret(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(secret) == 64
    assert make_route_secret(path) == secret == path.read_text().strip()


def test_a_route_secret_others_can_read_or_that_is_no_secret_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "route.secret"
    make_route_secret(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        read_route_secret(path)
    path.write_text("hunter2\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="64 hex digits"):
        read_route_secret(path)


def test_route_options_come_together_or_not_at_all(tmp_path: Path) -> None:
    secret_file = tmp_path / "route.secret"
    secret = make_route_secret(secret_file)
    assert cluster_routes(None, None, None) is None
    with pytest.raises(ConfigError, match="--cluster-port, --routes and --route-secret-file"):
        cluster_routes(6222, None, secret_file)
    with pytest.raises(ConfigError, match="--routes"):
        cluster_routes(6222, "6222,six", secret_file)
    with pytest.raises(ConfigError, match="not an IPv4 address"):
        cluster_routes(6222, "6222,example.org:6223", secret_file)
    routes = cluster_routes(6222, "6222,6223,6224", secret_file)
    loopback = (("127.0.0.1", 6222), ("127.0.0.1", 6223), ("127.0.0.1", 6224))
    assert routes == ClusterRoutes(port=6222, routes=loopback, secret=secret)
    hosts = cluster_routes(6222, "10.213.0.1:6222,10.213.0.2:6223", secret_file, host="10.213.0.1")
    assert hosts == ClusterRoutes(
        port=6222, routes=(("10.213.0.1", 6222), ("10.213.0.2", 6223)), secret=secret, host="10.213.0.1"
    )


def test_the_cluster_block_listens_on_loopback_and_dials_with_the_secret(tmp_path: Path) -> None:
    secret = make_route_secret(tmp_path / "route.secret")
    block = ClusterRoutes(port=6222, routes=(("127.0.0.1", 6222), ("127.0.0.1", 6223)), secret=secret).config_block()
    assert 'listen: "127.0.0.1:6222"' in block
    assert f'password: "{secret}"' in block
    assert f"nats-route://route:{secret}@127.0.0.1:6223" in block


def test_the_plan_keeps_its_ports_and_size(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="3 to 5"):
        plan_members(tmp_path, 2)
    supervisor = Supervisor(tmp_path, 3)
    supervisor.write_info()
    kept = json.loads((tmp_path / "cluster" / CLUSTER_FILE).read_text())
    assert [n["name"] for n in kept["nodes"]] == ["node-1", "node-2", "node-3"]
    assert plan_members(tmp_path, 3) == supervisor.members
    assert all(n["host"] == "127.0.0.1" for n in kept["nodes"])
    for node in kept["nodes"]:  # a cluster file written before nodes had a host
        del node["host"]
    (tmp_path / "cluster" / CLUSTER_FILE).write_text(json.dumps(kept))
    assert plan_members(tmp_path, 3) == supervisor.members
    ports = [p for m in supervisor.members for p in (m.client, m.monitor, m.route)]
    assert len(set(ports)) == 9
    with pytest.raises(ConfigError, match="has 3 nodes, not 4"):
        plan_members(tmp_path, 4)


def test_every_node_gets_the_cluster_node_key_and_never_another(tmp_path: Path) -> None:
    root, member = tmp_path / "cluster", tmp_path / "cluster" / "node-1"
    share_node_key(root, member)
    assert node_key(member).public_key == node_key(root).public_key
    assert stat.S_IMODE((member / NODE_KEY_FILE).stat().st_mode) == 0o600
    other = tmp_path / "cluster" / "node-2"
    AgentKey.load_or_create_at(other / NODE_KEY_FILE, "node")
    with pytest.raises(ConfigError, match="is not the cluster's node key"):
        share_node_key(root, other)
