"""The mirror and recall on real NATS, a real embedding model and real Qdrant engines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.broker.loops import stop_all
from bus.client.client import EpibusClient, connect
from bus.errors import Unavailable
from bus.host.server import NatsServer
from bus.intake.reader import replay
from bus.intake.runner import ConsumerRunner
from bus.model.ids import point_id
from bus.model.vocab import ReceiptLevel
from epibus.node.node import Node, NodeConfig
from observers.journal import Journal, JournalObserver
from observers.mirror.backends import open_store
from observers.mirror.embed import CachedEmbedder, FastEmbedder
from observers.mirror.observer import MirrorObserver
from observers.mirror.store import Filter, Point
from tests.conftest import finding
from tests.support import eventually

TOPICS = {
    "the connection pool runs out of sockets under load": "we exhaust database connections when traffic spikes",
    "nightly backups silently skip the largest table": "the biggest table is missing from our backups",
    "tls certificates expire without any alert": "nobody gets warned before certs run out",
    "the search index is rebuilt on every deploy": "deployments trigger a full reindex of search",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> FastEmbedder:
    return FastEmbedder(tmp_path_factory.mktemp("models")).load_blocking()


@pytest.fixture
async def mirrored_node(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Node]:
    config = NodeConfig(
        home=tmp_path / "node-a", nats_url=nats_server.url, name="node-a", journal_url=f"sqlite:///{tmp_path / 'a.db'}"
    )
    async with Node(config) as node:
        yield node


async def publish_topics(client: EpibusClient, project: str) -> dict[str, str]:
    ids = {}
    for text in TOPICS:
        event = client.event("finding", finding(text=text), project=project)
        await client.publish(event)
        ids[text] = event.artifact_id
    return ids


async def indexed(node: Node, count: int) -> None:
    assert node.mirror is not None
    await eventually(lambda: node.mirror is not None and node.mirror.indexed >= count, timeout_s=30)


async def test_paraphrases_find_their_targets_and_a_retraction_leaves_only_the_safe_door(
    mirrored_node: Node, nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
        ids = await publish_topics(alice, project)
        await indexed(mirrored_node, len(TOPICS))
        for text, paraphrase in TOPICS.items():
            answer = await alice.recall(paraphrase, project, k=2)
            assert answer.hits[0]["artifact_id"] == ids[text], (paraphrase, answer.hits)
            assert answer.nodes == ["node-a"]
            assert answer.hits[0]["provenance"]["actor"] == "alice"
        target = ids["tls certificates expire without any alert"]
        await alice.transition("resolved", {"resolution": "retracted"}, project=project, artifact_id=target)
        assert mirrored_node.mirror is not None

        async def retracted_everywhere() -> bool:
            safe = await alice.recall("certificates expiring silently", project, k=4)
            return target not in {h["artifact_id"] for h in safe.hits}

        await eventually(retracted_everywhere, timeout_s=20)
        audit = await alice.audit_recall("certificates expiring silently", project, k=4)
        (hit,) = [h for h in audit.hits if h["artifact_id"] == target]
        assert hit["state"]["resolution"] == "retracted"


async def test_recall_without_any_mirror_is_an_error_not_an_empty_list(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
        with pytest.raises(Unavailable, match="no node with a mirror answered"):
            await alice.recall("anything", project, timeout_s=0.5)


async def test_two_nodes_answer_and_hits_merge_by_event_id(
    mirrored_node: Node, nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    config = NodeConfig(
        home=tmp_path / "node-b", nats_url=nats_server.url, name="node-b", journal_url=f"sqlite:///{tmp_path / 'b.db'}"
    )
    async with (
        Node(config) as second,
        connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice,
    ):
        ids = await publish_topics(alice, project)
        await indexed(mirrored_node, len(TOPICS))
        await indexed(second, len(TOPICS))
        answer = await alice.recall("our backups miss a table", project, k=10)
    assert sorted(answer.nodes) == ["node-a", "node-b"]
    assert len({h["event_id"] for h in answer.hits}) == len(answer.hits) == len(TOPICS)
    assert answer.hits[0]["artifact_id"] == ids["nightly backups silently skip the largest table"]


async def test_redelivery_and_reembedding_never_duplicate_a_point(
    mirrored_node: Node, nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
        events = [alice.event("finding", finding(i), project=project) for i in range(30)]
        await alice.publish_many(events)
        await indexed(mirrored_node, 30)
        store, mirror = mirrored_node.store, mirrored_node.mirror
        assert store is not None
        assert mirror is not None
        assert mirrored_node.journal is not None
        again = MirrorObserver(
            store, mirror.embedder, name="mirror-replay", journal=mirrored_node.journal, node="node-a"
        )
        await replay(alice.js, again)  # every event through the mirror a second time
    found = await store.retrieve([point_id(e.event_id) for e in events])
    assert sorted(p.id for p in found) == sorted(point_id(e.event_id) for e in events)
    assert len(await store.point_ids(Filter(equals={"project": project}))) == 30


class SwitchableStore:
    """The real edge store behind a switch that makes it refuse, as a store that went down would."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.down = True

    def _check(self) -> None:
        if self.down:
            raise Unavailable("qdrant-edge", "connection refused")

    async def upsert(self, points: Sequence[Point]) -> None:
        self._check()
        await self.inner.upsert(points)

    async def delete(self, ids: Sequence[Any]) -> None:
        self._check()
        await self.inner.delete(ids)

    async def retrieve(self, ids: Sequence[Any]) -> list[Point]:
        self._check()
        return list(await self.inner.retrieve(ids))

    async def search(self, vector: Sequence[float], where: Filter, *, limit: int) -> list[Any]:
        self._check()
        return list(await self.inner.search(vector, where, limit=limit))

    async def set_payload(self, where: Filter, payload: Mapping[str, Any]) -> None:
        self._check()
        await self.inner.set_payload(where, payload)

    async def describe(self) -> Any:
        self._check()
        return await self.inner.describe()

    async def point_ids(self, where: Filter | None = None) -> list[Any]:
        self._check()
        return list(await self.inner.point_ids(where))

    async def close(self) -> None:
        await self.inner.close()


async def test_a_mirror_that_was_down_catches_up_without_loss_or_duplicates(
    nats_server: NatsServer, model: FastEmbedder, tmp_path: Path, project: str
) -> None:
    inner = await open_store("edge", tmp_path / "mirror", model.model_id, model.dimension)
    store = SwitchableStore(inner)
    embedder = CachedEmbedder(model, tmp_path / "cache.db")
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}")
    journal.migrate()
    observer = MirrorObserver(store, embedder, name="mirror-flaky", journal=journal)
    nc = await nats.connect(nats_server.url)
    runner = ConsumerRunner(nc, observer, batch_size=16, ack_wait_s=3.0, fetch_timeout_s=0.2)
    journal_runner = ConsumerRunner(nc, JournalObserver(journal), fetch_timeout_s=0.2)
    try:
        async with asyncio.TaskGroup() as group:
            journaling = group.create_task(journal_runner.run())
            task = group.create_task(runner.run())
            async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
                events = [alice.event("finding", finding(i), project=project) for i in range(40)]
                await alice.publish_many(events, wait_for=ReceiptLevel.published)
            await eventually(lambda: runner.stats.degraded, timeout_s=10)
            store.down = False
            await eventually(lambda: observer.indexed == 40, timeout_s=60)
            await stop_all([task, journaling])
        assert runner.stats.dead_lettered == {}
        assert runner.stats.degraded is False
        assert sorted(await inner.point_ids()) == sorted(point_id(e.event_id) for e in events)
    finally:
        await nc.close()
        embedder.close()
        await inner.close()
        journal.close()
