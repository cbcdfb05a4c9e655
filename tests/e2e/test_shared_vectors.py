"""Embed once per fleet, as two nodes live it: the second node, catching up on what the first indexed, takes the
vectors the first shared instead of running its model, and its mirror answers recall as the first one's does."""

from __future__ import annotations

import math
from pathlib import Path

from bus.client.client import connect
from bus.host.server import NatsServer
from bus.model.ids import point_id
from bus.model.vocab import ReceiptLevel
from epibus.node.node import Node, NodeConfig
from observers.mirror.embed import FastEmbedder
from observers.mirror.fleet_vectors import FleetEmbedder
from tests.conftest import finding
from tests.support import eventually

TEXTS = [f"incident {i}: the {what} failed after the deploy" for i, what in enumerate(
    ["cache", "queue", "dns resolver", "disk", "scheduler", "load balancer", "token refresh", "log shipper"]
)]  # fmt: skip


def node_config(server: NatsServer, home: Path, name: str) -> NodeConfig:
    return NodeConfig(home=home, nats_url=server.url, name=name, journal_url=f"sqlite:///{home / 'journal.db'}")


def model_and_fleet(node: Node) -> tuple[FastEmbedder, FleetEmbedder]:
    assert node.embedder is not None
    fleet = node.embedder.inner
    assert isinstance(fleet, FleetEmbedder)
    assert isinstance(fleet.model, FastEmbedder)
    return fleet.model, fleet


async def test_a_node_catching_up_takes_the_vectors_another_node_embedded(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    async with Node(node_config(nats_server, tmp_path / "a", "node-a")) as first:
        async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
            events = [alice.event("finding", finding(text=text), project=project) for text in TEXTS]
            await alice.publish_many(events, wait_for=ReceiptLevel.published)
        await eventually(lambda: first.mirror is not None and first.mirror.indexed == len(TEXTS), timeout_s=60)
        model, fleet = model_and_fleet(first)
        assert model.texts_embedded == len(TEXTS)
        assert fleet.stats.shared == len(TEXTS)
        assert first.store is not None
        ids = [point_id(e.event_id) for e in events]
        first_points = {p.id: p.vector for p in await first.store.retrieve(ids)}

    async with Node(node_config(nats_server, tmp_path / "b", "node-b")) as second:
        await eventually(lambda: second.mirror is not None and second.mirror.indexed == len(TEXTS), timeout_s=60)
        model, fleet = model_and_fleet(second)
        assert fleet.stats.taken == len(TEXTS)
        assert fleet.stats.refused == 0
        assert model.texts_embedded == 1  # the first vector from node-a, checked against its own model
        assert second.store is not None
        second_points = {p.id: p.vector for p in await second.store.retrieve(ids)}
        assert sorted(second_points) == sorted(first_points)
        for point, vector in second_points.items():
            assert all(math.isclose(x, y, abs_tol=1e-6) for x, y in zip(vector, first_points[point], strict=True))
        async with connect(nats_server.url, agent="bob", home=tmp_path / "bob", outbox=False) as bob:
            hits = (await bob.recall("the dns resolver broke after a release", project, k=1)).hits
        assert hits[0]["content"] == TEXTS[2]
