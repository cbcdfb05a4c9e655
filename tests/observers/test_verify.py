"""Reconciling stream, journal and mirror by event id, and repairing them."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from bus.client.client import connect
from bus.host.server import NatsServer
from bus.model.ids import point_id
from bus.model.vocab import ReceiptLevel
from epibus.node.node import Node, NodeConfig
from observers.mirror.server import ServerVectorStore
from observers.mirror.store import Filter
from tests.conftest import finding
from tests.support import eventually, journal_event_ids


async def test_verify_finds_what_each_store_lacks_and_repair_makes_them_agree(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    config = NodeConfig(
        home=tmp_path / "node", nats_url=nats_server.url, name="node-a", journal_url=f"sqlite:///{tmp_path / 'j.db'}"
    )
    async with Node(config) as node:
        assert node.journal is not None
        assert node.store is not None
        assert node.mirror is not None
        async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
            events = [alice.event("finding", finding(i), project=project) for i in range(6)]
            await alice.publish_many(events, wait_for=ReceiptLevel.journaled)
            await eventually(lambda: node.mirror is not None and node.mirror.indexed == 6, timeout_s=30)
            (clean,) = await alice.verify_nodes(project)
            assert clean["clean"] is True
            assert clean["stream_events"] == 6

            # Damage each store behind the observers' backs.
            with node.journal.engine.begin() as conn:
                conn.execute(text("DELETE FROM events WHERE event_id = :e"), {"e": str(events[0].event_id)})
            await node.store.delete([point_id(events[1].event_id)])
            await node.store.set_payload(Filter(equals={"artifact_id": events[2].artifact_id}), {"trust": "verified"})

            (found,) = await alice.verify_nodes(project)
            assert (found["journal"]["missing"], found["journal"]["sample_missing"]) == (1, [str(events[0].event_id)])
            assert found["mirror"]["missing"] == 1
            assert found["mirror"]["sample_missing"] == [str(events[1].event_id)]
            assert found["mirror"]["sample_stale"] == [str(events[2].event_id)]
            assert found["clean"] is False

            (repaired,) = await alice.verify_nodes(project, repair=True)
            assert repaired["repaired"] is True
            assert repaired["clean"] is True
        assert sorted(journal_event_ids(node.journal.url, project)) == sorted(str(e.event_id) for e in events)
        (restored,) = await node.store.retrieve([point_id(events[1].event_id)])
        assert restored.payload["artifact_id"] == events[1].artifact_id
        (fixed,) = await node.store.retrieve([point_id(events[2].event_id)])
        assert fixed.payload["trust"] == "unverified"


@pytest.mark.parametrize("mirror", ["edge", "server"])
async def test_reindex_rebuilds_the_mirror_and_swaps_it_in_without_losing_new_events(
    nats_server: NatsServer, tmp_path: Path, project: str, mirror: str
) -> None:
    config = NodeConfig(
        home=tmp_path / "node",
        nats_url=nats_server.url,
        name="node-a",
        journal_url=f"sqlite:///{tmp_path / 'j.db'}",
        mirror=mirror,
        qdrant_url=str(tmp_path / "qdrant") if mirror == "server" else None,
    )
    async with Node(config) as node:
        assert node.store is not None
        assert node.mirror is not None
        async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
            before = [alice.event("finding", finding(i), project=project) for i in range(8)]
            await alice.publish_many(before, wait_for=ReceiptLevel.journaled)
            await eventually(lambda: node.mirror is not None and node.mirror.indexed == 8, timeout_s=30)
            old_store_id = (await node.store.describe()).store_id
            seen: list[tuple[str, int, int]] = []
            (answer,) = await alice.reindex_nodes(lambda n, d, t: seen.append((n, d, t)))
            assert answer["points"] == 8
            assert "error" not in answer
            assert seen
            assert seen[-1][0] == "node-a"
            assert seen[-1][1] == seen[-1][2]
            assert (await node.store.describe()).store_id != old_store_id  # the swapped-in collection
            after = alice.event("finding", finding(100, text="published after the swap"), project=project)
            await alice.publish(after)
            await eventually(lambda: node.mirror is not None and node.mirror.indexed >= 1, timeout_s=30)
            (report,) = await alice.verify_nodes(project)
        assert report["clean"] is True
        found = await node.store.retrieve([point_id(e.event_id) for e in [*before, after]])
        assert len(found) == 9
        assert not (tmp_path / "node" / "mirror.new").exists()
        if mirror == "server":  # the alias now names the rebuilt collection, and the old one is gone
            assert isinstance(node.store, ServerVectorStore)
            client = node.store.client
            (alias,) = [a for a in client.get_aliases().aliases if a.alias_name == "epibus"]
            assert alias.collection_name == node.store.real_collection
            assert [c.name for c in client.get_collections().collections] == [node.store.real_collection]
