"""A node whose mirror engine dies under it (kill -9, as SIGBUS on a mapped page would): the node's journal never
notices, the next mirror call starts the engine again on the same files, recall answers with every claim, and
status and /metrics count the restart. The engine never outlives the node."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

from bus.client.client import connect
from bus.host.server import NatsServer
from bus.model.vocab import ReceiptLevel
from epibus.monitoring.health import node_health
from epibus.node.node import Node, NodeConfig
from observers.mirror.edge_process import EdgeProcessVectorStore
from tests.conftest import finding
from tests.support import eventually

TEXTS = ["the cache is cold after every deploy", "dns lookups flap under load", "disks fill up at night"]


async def test_a_node_whose_mirror_engine_is_killed_starts_it_again_and_loses_nothing(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    config = NodeConfig(home=tmp_path / "node", nats_url=nats_server.url, journal_url=f"sqlite:///{tmp_path / 'j.db'}")
    async with (
        Node(config) as node,
        connect(nats_server.url, agent="alice", home=tmp_path / "a", outbox=False) as alice,
    ):
        store = node.store
        assert isinstance(store, EdgeProcessVectorStore)
        assert store._process is not None
        first = store._process.pid
        assert psutil.Process(first).ppid() == os.getpid()
        events = [alice.event("finding", finding(text=text), project=project) for text in TEXTS[:2]]
        await alice.publish_many(events, wait_for=ReceiptLevel.indexed)
        os.kill(first, signal.SIGKILL)
        later = alice.event("finding", finding(text=TEXTS[2]), project=project)
        await alice.publish(later, wait_for=ReceiptLevel.indexed, timeout_s=60)  # the mirror carried on
        for text in TEXTS:
            hits = (await alice.recall(text, project, k=1)).hits
            assert hits[0]["content"] == text
        assert store._process is not None
        second = store._process.pid
        assert second != first
        assert store.restarts == 1
        await eventually(lambda: node_health(node)["mirror"].get("engine_restarts") == 1, timeout_s=5)
    assert not psutil.pid_exists(second) or psutil.Process(second).status() == psutil.STATUS_ZOMBIE
