"""Node presence: each node's signed heartbeat in the nodes bucket tells a fan-out whose answers to wait for. A
recall returns once every live node with a mirror has answered, not after a timeout; a node killed with SIGKILL
is reported missing until its heartbeat expires, then leaves the live set; a forged or garbage heartbeat is
ignored and counted. Real nats-server, real nodes (one a separate `epibus up` process), real embedding model."""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from bus.broker import presence
from bus.broker.presence import live_nodes, signed_heartbeat
from bus.broker.streams import HEARTBEAT_TTL_S, open_bucket
from bus.client.client import EpibusClient, connect
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from bus.subjects import NODES_BUCKET, RECALL, VERIFY, heartbeat_key
from epibus.node.node import Node, NodeConfig
from tests.conftest import finding
from tests.support import eventually, start_node_process, stop_node_process

TIMEOUT_S = 60.0  # what the asker allows; every answer here must come long before it


def _config(nats_server: NatsServer, tmp_path: Path, name: str, mirror: str = "edge") -> NodeConfig:
    return NodeConfig(
        home=tmp_path / name,
        nats_url=nats_server.url,
        name=name,
        mirror=mirror,
        journal_url=f"sqlite:///{tmp_path / (name + '.db')}",
    )


@pytest.fixture
async def node_a(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Node]:
    async with Node(_config(nats_server, tmp_path, "node-a")) as node:
        yield node


@pytest.fixture
async def alice(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[EpibusClient]:
    async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as client:
        yield client


def _indexed_one(node: Node) -> bool:
    return node.mirror is not None and node.mirror.indexed >= 1


async def _published_and_indexed(alice: EpibusClient, project: str, nodes: list[Node]) -> str:
    event = alice.event("finding", finding(text="the cache is flushed on every deploy"), project=project)
    await alice.publish(event)
    for node in nodes:
        assert node.mirror is not None
        await eventually(functools.partial(_indexed_one, node), timeout_s=60)
    return event.artifact_id


async def test_a_recall_returns_with_both_nodes_answers_long_before_its_timeout(
    nats_server: NatsServer, tmp_path: Path, node_a: Node, alice: EpibusClient, project: str
) -> None:
    async with Node(_config(nats_server, tmp_path, "node-b")) as node_b:
        artifact = await _published_and_indexed(alice, project, [node_a, node_b])
        live = await live_nodes(_js(alice))
        assert live.known
        assert live.answering(RECALL) == {"node-a", "node-b"}
        started = time.monotonic()
        answer = await alice.recall("deploys empty the cache", project, k=3, timeout_s=TIMEOUT_S)
        took_s = time.monotonic() - started
    assert sorted(answer.nodes) == ["node-a", "node-b"]
    assert answer.missing_nodes == []
    assert not answer.partial
    assert [h["artifact_id"] for h in answer.hits] == [artifact]
    assert took_s < TIMEOUT_S / 4, took_s  # it ended on the last answer, not on the clock


async def test_a_node_killed_with_sigkill_is_reported_missing_then_leaves_the_live_set(
    nats_server: NatsServer, tmp_path: Path, node_a: Node, alice: EpibusClient, project: str
) -> None:
    process, _ = start_node_process(
        tmp_path / "node-b", "--nats", nats_server.url, "--name", "node-b", "--mirror", "edge"
    )
    try:
        await eventually(lambda: _answering(alice, RECALL, {"node-a", "node-b"}), timeout_s=60)  # its mirror is serving
        await _published_and_indexed(alice, project, [node_a])
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        killed_at = time.monotonic()
        answer = await alice.recall("deploys empty the cache", project, k=3, timeout_s=2)
        assert answer.nodes == ["node-a"]
        assert answer.missing_nodes == ["node-b"]
        assert answer.partial
        assert "node-b" in answer.as_dict()["missing_nodes"]
        verify = await alice.verify_nodes(project, timeout_s=2)
        assert {a["node"]: "error" in a for a in verify} == {"node-a": False, "node-b": True}
        await eventually(lambda: _answering(alice, VERIFY, {"node-a"}), timeout_s=HEARTBEAT_TTL_S * 5)
        assert time.monotonic() - killed_at >= HEARTBEAT_TTL_S - 1.5  # it stayed live until its record expired
        started = time.monotonic()
        answer = await alice.recall("deploys empty the cache", project, k=3, timeout_s=TIMEOUT_S)
        assert answer.nodes == ["node-a"]
        assert answer.missing_nodes == []
        assert time.monotonic() - started < TIMEOUT_S / 4
    finally:
        stop_node_process(process)


def _js(client: EpibusClient) -> JetStreamContext:
    assert client.nc is not None
    return client.nc.jetstream()


async def _answering(client: EpibusClient, subject: str, nodes: set[str]) -> bool:
    return (await live_nodes(_js(client))).answering(subject) == nodes


async def test_a_node_that_stops_withdraws_its_heartbeat_at_once(
    nats_server: NatsServer, tmp_path: Path, node_a: Node, alice: EpibusClient
) -> None:
    async with Node(_config(nats_server, tmp_path, "node-b", mirror="off")):
        assert set((await live_nodes(_js(alice))).nodes) == {"node-a", "node-b"}
    assert set((await live_nodes(_js(alice))).nodes) == {"node-a"}


async def test_forged_and_garbage_heartbeats_are_ignored_and_counted(
    nats_server: NatsServer, node_a: Node, alice: EpibusClient, project: str
) -> None:
    assert node_a.nc is not None
    kv = await open_bucket(node_a.nc.jetstream(), NODES_BUCKET)  # an open server: any process may write
    real = node_a.key
    mallory = AgentKey.generate("node")
    now = datetime.now(UTC)
    impostor = signed_heartbeat(mallory, "node-a", [RECALL, VERIFY], at=now)
    tampered = signed_heartbeat(mallory, "ghost", [VERIFY], at=now).model_copy(update={"node": "ghost-2"})
    former = AgentKey.generate("node")
    replayed = signed_heartbeat(former, "ghost-3", [VERIFY], at=now - timedelta(hours=1))
    records = {
        "node.not-json": b"\xff\xfe not a heartbeat",
        "node.wrong-shape": b'{"node": "x", "services": "all", "extra": 1}',
        heartbeat_key(real.public_key) + "X": impostor.model_dump_json().encode(),  # not its signer's key
        heartbeat_key(mallory.public_key): tampered.model_dump_json().encode(),  # signed, then changed
        heartbeat_key(former.public_key): replayed.model_dump_json().encode(),  # signed long ago
    }
    ignored_before = presence.quarantine.count
    for key, value in records.items():
        await kv.put(key, value)
    live = await live_nodes(_js(alice))
    assert set(live.nodes) == {"node-a"}
    assert live.nodes["node-a"].public_key == real.public_key
    assert set(live.ignored) == set(records), live.ignored
    assert presence.quarantine.count == ignored_before + len(records)
    started = time.monotonic()
    answers = await alice.verify_nodes(project, timeout_s=TIMEOUT_S)
    assert [a["node"] for a in answers] == ["node-a"]  # nobody forged is waited for or reported
    assert time.monotonic() - started < TIMEOUT_S / 4
