"""What an enrolled agent can learn of the fleet's enrolments: the agents it shares a project with (cut to the
projects shared) and the nodes, through a node's view; never the registry or the stream's enrolment records,
which name every agent, key and project. Mallory is in project M; Carol in M and A; Alice in A only."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest

from bus.broker.ask import ask_one
from bus.enrolment.registry import AgentRegistry
from bus.identity.confinement import confine
from bus.identity.signing import AgentKey, node_key
from bus.model.requests import EnrolmentViewReply, EnrolmentViewRequest
from bus.model.vocab import Role
from bus.subjects import (
    AGENT_KEYS_BUCKET,
    ENROLMENT_VIEW,
    ENROLMENTS_FILTER,
    STREAM,
    js_api,
    kv_stream,
    kv_subject,
)
from epibus.node.node import Node, NodeConfig
from tests.security.test_broker import Violations
from tests.security.test_confinement import raw, refused
from tests.support import enrol_agent


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    async with Node(NodeConfig(home=tmp_path / "home", mirror="off")) as running:
        assert running.authenticated
        yield running


async def enrolled(node: Node, name: str, projects: list[str]) -> AgentKey:
    key = AgentKey.load_or_create(node.config.home, name)
    await enrol_agent(node.nats_url, node.config.home, key, roles=[Role.agent], projects=projects)
    return key


async def view_of(node: Node, key: AgentKey, **asked: object) -> EnrolmentViewReply:
    nc = await nats.connect(node.nats_url, **key.nats_credentials)
    try:
        request = EnrolmentViewRequest.model_validate(asked)
        return await ask_one(nc, ENROLMENT_VIEW, request, EnrolmentViewReply, signer=key, timeout_s=10)
    finally:
        await nc.close()


async def test_an_agent_reads_neither_the_registry_nor_the_enrolment_records_at_the_broker(
    node: Node, project: str
) -> None:
    mallory = await enrolled(node, "mallory", [f"{project}-m"])
    await enrolled(node, "alice", [f"{project}-a"])
    violations = Violations()
    nc = await raw(node, mallory, violations)
    try:
        registry = kv_stream(AGENT_KEYS_BUCKET)
        info = js_api("STREAM.INFO", registry)
        await refused(violations, info, nc.request(info, b'{"subjects_filter": ">"}', timeout=2))
        get = js_api("STREAM.MSG.GET", registry)
        body = f'{{"last_by_subj": "{kv_subject(AGENT_KEYS_BUCKET, "alice")}"}}'.encode()
        await refused(violations, get, nc.request(get, body, timeout=2))
        direct = js_api("DIRECT.GET", registry, kv_subject(AGENT_KEYS_BUCKET, "alice"))
        await refused(violations, direct, nc.request(direct, b"", timeout=2))
        records = js_api("DIRECT.GET", STREAM, ENROLMENTS_FILTER)
        await refused(violations, records, nc.request(records, b"", timeout=2))
    finally:
        await nc.close()


async def test_the_view_shows_only_agents_sharing_a_project_cut_to_the_projects_shared(
    node: Node, project: str
) -> None:
    mine, theirs = f"{project}-m", f"{project}-a"
    mallory = await enrolled(node, "mallory", [mine])
    await enrolled(node, "alice", [theirs])
    carol = await enrolled(node, "carol", [mine, theirs])
    seen = await view_of(node, mallory, agents=["alice", "carol", "mallory"])
    agents = {r.enrolment.agent_id for r in seen.records}
    assert "alice" not in agents
    assert {"carol", "mallory"} <= agents
    assert {r.enrolment.agent_id: r.enrolment.projects for r in seen.records if r.enrolment.agent_id == "carol"} == {
        "carol": [mine]
    }
    assert {e.agent_id: (e.public_key, e.projects) for e in seen.current} == {
        "carol": (carol.public_key, [mine]),
        "mallory": (mallory.public_key, [mine]),
    }
    assert seen.scope == [mine]
    assert node_key(node.config.home).public_key in seen.node_keys
    assert theirs not in seen.model_dump_json()  # no record, current or node entry names Alice's project
    # Through the client's registry, as admission reads it: Alice is unknown here, Carol is herself.
    nc = await nats.connect(node.nats_url, **mallory.nats_credentials)
    try:
        confine(nc, mallory)
        registry = AgentRegistry(nc.jetstream())
        assert await registry.get("alice") is None
        found = await registry.get("carol")
        assert found is not None
        assert found.projects == (mine,)
    finally:
        await nc.close()


async def test_an_agent_removed_from_a_shared_project_is_seen_leaving_and_nothing_after(
    node: Node, project: str
) -> None:
    mine, theirs = f"{project}-m", f"{project}-a"
    mallory = await enrolled(node, "mallory", [mine])
    await enrolled(node, "carol", [mine, theirs])
    first = await view_of(node, mallory)
    await enrolled(node, "carol", [theirs])  # moved out of Mallory's project
    later = await view_of(node, mallory, after_seq=first.last_seq, agents=["carol"])
    carols = [r.enrolment.projects for r in later.records if r.enrolment.agent_id == "carol"]
    assert carols == [[]]  # the removal, and nothing of where Carol went
    assert [e.projects for e in later.current] == [[]]
