"""The differential test with whole nodes: a node that was live while a random history was published, a second
node that catches up afterwards, and the first node's mirror after `reindex`, against the client's fold. Real
embedding model, real edge mirrors, the node's own runners. Fewer examples than the in-process paths: each
starts two nodes (EPIBUS_NODE_EXAMPLES to change it)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import nats
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from bus.client.project_view import load_project
from bus.host.server import NatsServer
from bus.model.review import review_status
from bus.model.state import ArtifactState
from epibus.node.node import Node, NodeConfig
from observers.journal import Journal
from observers.reads import review_policy
from observers.verify import verify
from tests.e2e.test_differential import journal_events, journal_states, mirror_states
from tests.e2e.test_one_truth import caught_up
from tests.histories import Op, build, differences, fresh_project, histories, make_keys, publish, register_keys

EXAMPLES = int(os.environ.get("EPIBUS_NODE_EXAMPLES", "6"))


def kept_events(journal: Journal, project: str) -> dict[str, str]:
    return {e: status for e, status in journal_events(journal, project).items() if status != "forgotten"}


def node_config(server: NatsServer, home: Path, agent: str) -> NodeConfig:
    return NodeConfig(home=home, nats_url=server.url, name=agent, journal_url=f"sqlite:///{home / 'journal.db'}")


async def node_states(node: Node, project: str) -> tuple[dict[str, ArtifactState], dict[str, ArtifactState]]:
    assert node.journal is not None
    assert node.store is not None
    return await journal_states(node.journal, project), await mirror_states(node.store, project)


async def assert_clean(node: Node, project: str) -> None:
    assert node.js is not None
    assert node.journal is not None
    report = await verify(node.js, node.journal, node.mirror, project=project)
    assert report.clean, report.as_dict()


async def run_nodes(server: NatsServer, history: list[Op], workdir: Path) -> None:
    project = fresh_project()
    keys = make_keys()  # agents of this example's own: its enrolment records reach no other example
    await register_keys(server.url, keys)
    paths: dict[str, dict[str, ArtifactState]] = {}
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        async with Node(node_config(server, workdir / "live", "live")) as live:
            await caught_up(live)  # its consumers exist: what follows arrives live, in small batches
            await publish(js, build(history, keys, project))
            await caught_up(live)
            paths["fold"] = dict((await load_project(js, project)).fold.artifacts)
            paths["live journal"], paths["live mirror"] = await node_states(live, project)
            await assert_clean(live, project)
            async with Node(node_config(server, workdir / "second", "second")) as second:
                await caught_up(second)
                paths["caught-up journal"], paths["caught-up mirror"] = await node_states(second, project)
                await assert_clean(second, project)
                assert second.journal is not None
                assert live.journal is not None
                # A node that saw an artifact's events before its forget keeps a redacted row for each.
                assert kept_events(second.journal, project) == kept_events(live.journal, project)
                # One review policy on both nodes and in the client's fold, even one set after the last claim.
                policy = (await load_project(js, project)).authority.policy(project)
                for node in (live, second):
                    assert node.journal is not None
                    assert await asyncio.to_thread(review_policy, node.journal, project) == policy, node.name
            await live.reindex_mirror()
            _, paths["reindexed mirror"] = await node_states(live, project)
            await assert_clean(live, project)
        assert differences(paths) == {}, history
        reviews = {name: {aid: review_status(s, policy) for aid, s in states.items()} for name, states in paths.items()}
        assert all(found == reviews["fold"] for found in reviews.values()), reviews
    finally:
        await nc.close()


@pytest.mark.timeout(1200)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # shrinking restarts two nodes per step: too slow
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(history=histories)
def test_nodes_agree_after_live_catch_up_and_reindex(
    shared_nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory, history: list[Op]
) -> None:
    asyncio.run(run_nodes(shared_nats_server, history, tmp_path_factory.mktemp("nodes-example")))
