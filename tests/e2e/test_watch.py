"""Semantic watch across two nodes on one stream: a standing question registered once is matched by every node's
mirror and pushed once; unrelated claims are not pushed; a retraction after the push sends a follow-up; a watcher
that was away reads what it missed from its cursor, once; an agent of another project can neither watch the
project nor read what it pushes; a forgotten claim's notices are erased."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from bus.broker.ask import Refused
from bus.broker.loops import cancel_and_wait
from bus.client.client import EpibusClient
from bus.client.watch import PushedNotice, Watches
from bus.errors import ConfigError, Forbidden
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from bus.model.event import Envelope
from bus.model.vocab import Role
from bus.model.watch import MAX_WATCHES_PER_AGENT
from bus.subjects import WATCH_STREAM, notices_filter, pushed_filter
from epibus import Node, NodeConfig, connect
from tests.support import enrol_agent, eventually

CLAIM = "the connection pool runs out of sockets under load"
ABOUT = "we exhaust database connections when traffic spikes"
UNRELATED = "nightly backups silently skip the largest table"


@pytest.fixture
async def two_nodes(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[tuple[Node, Node]]:
    def config(name: str) -> NodeConfig:
        return NodeConfig(
            home=tmp_path / name, nats_url=nats_server.url, name=name, journal_url=f"sqlite:///{tmp_path / name}.db"
        )

    async with Node(config("node-a")) as a, Node(config("node-b")) as b:
        yield a, b


async def stored_notices(js: JetStreamContext, owner_key: str) -> dict[str, int]:
    """Notices per subject as the stream holds them, read past every node's counters."""
    info = await js.stream_info(WATCH_STREAM, subjects_filter=notices_filter(owner_key))
    return dict(info.state.subjects or {})


async def read_notices(watches: Watches, after_seq: int, count: int) -> list[PushedNotice]:
    """The first `count` notices after `after_seq`, waiting up to 20 s for them."""
    found = await watches.poll(after_seq=after_seq, limit=count, wait_s=20)
    assert len(found) == count, found
    return found


def claim(client: EpibusClient, text: str, project: str) -> Envelope:
    return client.event("finding", {"text": text, "impact": 0.5, "confidence": 0.7, "subject": "db"}, project=project)


def held(node: Node, watch_id: str) -> bool:
    return node.live_mirror is not None and node.live_mirror.watches.book.get(watch_id) is not None


def indexed_on(node: Node, count: int) -> bool:
    return node.mirror is not None and node.mirror.indexed >= count


async def test_a_watch_fires_once_across_nodes_follows_up_on_retraction_and_resumes_from_its_cursor(
    two_nodes: tuple[Node, Node], nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    a, b = two_nodes
    async with (
        connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice,
        connect(nats_server.url, agent="carol", home=tmp_path / "carol", outbox=False) as carol,
    ):
        watch = await alice.watch(ABOUT, project)
        assert watch.about == ABOUT
        assert watch.projects == [project]
        # Registered through one node, held by both.
        await eventually(lambda: all(held(n, watch.watch_id) for n in (a, b)))
        pool = claim(carol, CLAIM, project)
        await carol.publish(pool)
        await carol.publish(claim(carol, UNRELATED, project))
        await eventually(lambda: indexed_on(a, 2) and indexed_on(b, 2), timeout_s=30)
        (first,) = await read_notices(alice.watches, 0, 1)
        assert (first.notice.notice, first.notice.text, first.notice.author) == ("match", CLAIM, "carol")
        assert first.notice.watch_id == watch.watch_id
        assert first.notice.score >= watch.threshold
        pushers = [n.live_mirror.pusher.stats for n in (a, b) if n.live_mirror is not None]
        await eventually(lambda: sum(s.matched for s in pushers) == 2)  # each node matched it ...
        assert sum(s.pushed for s in pushers) == 1  # ... and the stream kept one
        assert sum(s.duplicates for s in pushers) == 1
        assert sum((await stored_notices(alice.js, alice.key.public_key)).values()) == 1  # the unrelated claim: none

        # Away: the claim is retracted and another matching claim is made; back, from the cursor: each once.
        await carol.transition("resolved", {"resolution": "retracted"}, project=project, artifact_id=pool.artifact_id)
        again = claim(carol, "we run out of database connections at peak", project)
        await carol.publish(again)
        missed = await read_notices(alice.watches, first.seq, 2)
        kinds = sorted((p.notice.notice, p.notice.artifact_id) for p in missed)
        assert kinds == sorted([("no_longer_trusted", pool.artifact_id), ("match", again.artifact_id)])
        # A node that finds the other's follow-up already there pushes none: one or two tried, one stored.
        await eventually(lambda: sum(s.follow_ups for s in pushers) >= 1)
        assert sum((await stored_notices(alice.js, alice.key.public_key)).values()) == 3

        # Forgotten: the claim's notices leave the stream (its text was in them).
        report = await carol.forget(project, again.artifact_id, reason="personal data")
        await eventually(lambda: sum(s.erased for s in pushers) >= 1, timeout_s=20)
        proof = await carol.prove_forgotten(report)
        # Forget's proof names the pushed copies, on every node with a mirror: none left on the stream.
        assert {name: answer["watch_notices"] for name, answer in proof.nodes.items()} == {"node-a": 0, "node-b": 0}
        info = await alice.js.stream_info(WATCH_STREAM, subjects_filter=pushed_filter(project, again.artifact_id))
        assert not info.state.subjects
        listed, limit = await alice.watches.list_own()
        assert [w.watch_id for w in listed] == [watch.watch_id]
        assert limit == MAX_WATCHES_PER_AGENT
        assert await alice.watches.stop(watch.watch_id)
        assert not await alice.watches.stop(watch.watch_id)  # stopped already
        assert (await alice.watches.list_own())[0] == []


async def test_one_node_refuses_a_watch_outside_the_agents_projects_and_matches_what_a_reindex_takes(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    config = NodeConfig(
        home=tmp_path / "a", nats_url=nats_server.url, name="a", journal_url=f"sqlite:///{tmp_path}/a.db"
    )
    async with Node(config) as a:  # the one node answering: it enrols bob as its operator asks
        await watch_of_another_project(a, nats_server, tmp_path, project)
        await matched_by_a_reindex(a, nats_server, tmp_path, f"{project}-r")


async def matched_by_a_reindex(a: Node, nats_server: NatsServer, tmp_path: Path, project: str) -> None:
    """A claim that a reindex takes before the live mirror reached it is matched by the rebuild, once."""
    async with (
        connect(nats_server.url, agent="dora", home=tmp_path / "dora", outbox=False) as dora,
        connect(nats_server.url, agent="erin", home=tmp_path / "erin", outbox=False) as erin,
    ):
        watch = await dora.watch(ABOUT, project)
        await eventually(lambda: held(a, watch.watch_id))
        live = a.live_mirror
        assert live is not None
        assert live._task is not None
        await cancel_and_wait([live._task])  # the live mirror stops short of the claim
        pool = claim(erin, CLAIM, project)
        await erin.publish(pool)
        await live.reindex()
        (pushed,) = await read_notices(dora.watches, 0, 1)
        assert (pushed.notice.artifact_id, pushed.notice.watch_id) == (pool.artifact_id, watch.watch_id)
        assert sum((await stored_notices(dora.js, dora.key.public_key)).values()) == 1


async def watch_of_another_project(a: Node, nats_server: NatsServer, tmp_path: Path, project: str) -> None:
    bob = AgentKey.load_or_create(tmp_path / "bob", "bob")
    await enrol_agent(nats_server.url, a.config.home, bob, roles=[Role.agent], projects=[f"{project}-b"])
    async with (
        connect(nats_server.url, agent="bob", home=tmp_path / "bob", outbox=False) as bob_client,
        connect(nats_server.url, agent="carol", home=tmp_path / "carol", outbox=False) as carol,
    ):
        with pytest.raises(Forbidden, match=f"project {project}: only its members"):
            await bob_client.watch(ABOUT, project)
        with pytest.raises(Forbidden, match="reviewers and admins"):
            await bob_client.watch(ABOUT, f"{project}-b", audit=True)
        with pytest.raises(ConfigError, match="threshold"):
            await bob_client.watch(ABOUT, f"{project}-b", threshold=1.5)
        own = await bob_client.watch(ABOUT, f"{project}-b")
        await carol.publish(claim(carol, CLAIM, project))
        await eventually(lambda: indexed_on(a, 1), timeout_s=30)
        assert await stored_notices(bob_client.js, bob.public_key) == {}
        assert own.projects == [f"{project}-b"]
        for _ in range(MAX_WATCHES_PER_AGENT - 1):
            await bob_client.watch(ABOUT, f"{project}-b")
        with pytest.raises(Refused, match=r"limit watches per agent \(32\) reached"):
            await bob_client.watch(ABOUT, f"{project}-b")
