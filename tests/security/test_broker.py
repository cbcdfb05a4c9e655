"""Attacks on a node's NATS, against the configuration `epibus up` runs (the embedded server with
authentication): each is refused by the broker, and the stream, its config and the registry are unchanged."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from bus.broker.presence import live_nodes, signed_heartbeat
from bus.client import enrol
from bus.client.client import connect
from bus.client.connection import open_nats
from bus.errors import Forbidden
from bus.identity.signing import AgentKey, node_key
from bus.intake.follow import StreamFollower
from bus.model.auth import Enrolment
from bus.model.requests import EnrolRequest, build_request
from bus.model.vocab import Role
from bus.subjects import (
    AGENT_KEYS_BUCKET,
    RECALL,
    STREAM,
    TOMBSTONES_BUCKET,
    VECTORS_STREAM,
    event_subject,
    heartbeat_key,
    heartbeat_subject,
    vector_subject,
)
from epibus.node.node import Node, NodeConfig
from tests.conftest import finding
from tests.support import enrol_agent, eventually, operator_credentials

REFUSED_WITHIN_S = 2.0


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[tuple[Node, Path]]:
    home = tmp_path / "home"
    async with Node(NodeConfig(home=home, mirror="off")) as node:
        assert node.authenticated
        yield node, home


async def _enrol(node: Node, home: Path, agent: AgentKey, projects: list[str], roles: list[Role]) -> None:
    await enrol_agent(node.nats_url, home, agent, roles=roles, projects=projects)


class Violations:
    """The permission errors nats-py reports for one connection (lowercased by nats-py)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def record(self, error: Exception) -> None:
        self.seen.append(str(error))

    def about(self, subject: str) -> bool:
        return any("permissions violation" in s and subject.lower() in s for s in self.seen)

    def subscription_refused(self, subject: str) -> bool:
        return any("subscription" in v and subject.lower() in v for v in self.seen)


async def _as(node: Node, key: AgentKey, violations: Violations) -> NatsClient:
    return await nats.connect(node.nats_url, error_cb=violations.record, allow_reconnect=False, **key.nats_credentials)


async def _stream_state(node: Node, home: Path) -> dict[str, Any]:
    nc = await nats.connect(node.nats_url, **operator_credentials(home))
    try:
        js = nc.jetstream()
        info = await js.stream_info(STREAM)
        # The registry's keys as the stream holds them (nats-py's kv.keys() can come back short while it is written).
        agents = await js.stream_info(f"KV_{AGENT_KEYS_BUCKET}", subjects_filter=f"$KV.{AGENT_KEYS_BUCKET}.>")
        return {
            "config": info.config.as_dict(),
            "messages": info.state.messages,
            "agents": sorted(s.removeprefix(f"$KV.{AGENT_KEYS_BUCKET}.") for s in agents.state.subjects or {}),
        }
    finally:
        await nc.close()


async def test_a_process_without_an_enrolled_key_cannot_connect(secured: tuple[Node, Path]) -> None:
    node, _ = secured
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(node.nats_url, allow_reconnect=False, connect_timeout=2)
    stranger = AgentKey.generate("stranger")
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(node.nats_url, allow_reconnect=False, connect_timeout=2, **stranger.nats_credentials)


async def test_an_enrolled_agent_cannot_delete_purge_or_reconfigure_the_stream_nor_write_the_registry(
    secured: tuple[Node, Path], project: str
) -> None:
    node, home = secured
    async with connect(node.nats_url, agent="alice", home=home, outbox=False) as alice:
        await alice.publish(alice.event("finding", finding(1), project=project))
    mallory = AgentKey.generate("mallory")
    await _enrol(node, home, mallory, [project], [Role.agent])
    before = await _stream_state(node, home)
    violations = Violations()
    nc = await _as(node, mallory, violations)
    js = nc.jetstream(timeout=REFUSED_WITHIN_S)
    tombstone = f"$KV.{TOMBSTONES_BUCKET}.{project}.{'0' * 64}"
    attacks = {
        "$JS.API.STREAM.DELETE.EPI": js.delete_stream(STREAM),
        "$JS.API.STREAM.PURGE.EPI": js.purge_stream(STREAM),
        "$JS.API.STREAM.UPDATE.EPI": js.update_stream(StreamConfig(name=STREAM, subjects=["epi.>"], max_age=3)),
        "$JS.API.STREAM.MSG.DELETE.EPI": js.delete_msg(STREAM, 1),
        f"$KV.{AGENT_KEYS_BUCKET}.alice": nc.publish(f"$KV.{AGENT_KEYS_BUCKET}.alice", b"x"),
        tombstone: nc.publish(tombstone, b"x"),
        "$JS.API.STREAM.DELETE.KV_epibus_agents": js.delete_stream(f"KV_{AGENT_KEYS_BUCKET}"),
    }
    for subject, attack in attacks.items():
        with contextlib.suppress(nats.errors.TimeoutError, TimeoutError):  # the broker drops it: error_cb hears
            await attack
        await eventually(functools.partial(violations.about, subject), timeout_s=5)
    await nc.close()
    assert await _stream_state(node, home) == before


async def test_an_agent_reads_the_live_nodes_but_cannot_announce_itself_as_one(
    secured: tuple[Node, Path], project: str
) -> None:
    node, home = secured
    mallory = AgentKey.generate("mallory")
    await _enrol(node, home, mallory, [project], [Role.agent])
    violations = Violations()
    nc = await _as(node, mallory, violations)
    live = await live_nodes(nc.jetstream(timeout=REFUSED_WITHIN_S))
    assert live.known, live.why  # what every fan-out of an agent reads first
    assert set(live.nodes) == {node.name}
    forged = signed_heartbeat(mallory, "mallory-node", [RECALL], at=datetime.now(UTC)).model_dump_json().encode()
    subject = heartbeat_subject(heartbeat_key(mallory.public_key))
    with contextlib.suppress(nats.errors.TimeoutError, TimeoutError):  # the broker drops it: error_cb hears
        await nc.jetstream(timeout=REFUSED_WITHIN_S).publish(subject, forged)
    await eventually(lambda: violations.about(subject), timeout_s=5)
    await nc.close()
    assert node.nc is not None
    after = await live_nodes(node.nc.jetstream())
    assert set(after.nodes) == {node.name}
    assert after.ignored == {}  # the forged record never reached the bucket


async def test_an_agent_can_neither_read_nor_plant_the_fleets_shared_vectors(
    secured: tuple[Node, Path], project: str
) -> None:
    node, home = secured
    mallory = AgentKey.generate("mallory")
    await _enrol(node, home, mallory, [project], [Role.agent])
    subject = vector_subject("0" * 64)
    violations = Violations()
    nc = await _as(node, mallory, violations)
    js = nc.jetstream(timeout=REFUSED_WITHIN_S)
    attacks = {
        subject: js.publish(subject, b"\0" * 1536, stream=VECTORS_STREAM),
        f"$JS.API.DIRECT.GET.{VECTORS_STREAM}": js.get_last_msg(VECTORS_STREAM, subject, direct=True),
        f"$JS.API.STREAM.MSG.GET.{VECTORS_STREAM}": js.get_last_msg(VECTORS_STREAM, subject),
        f"$JS.API.STREAM.INFO.{VECTORS_STREAM}": js.stream_info(VECTORS_STREAM),
    }
    for refused, attack in attacks.items():
        with contextlib.suppress(nats.errors.TimeoutError, TimeoutError):  # the broker drops it: error_cb hears
            await attack
        await eventually(functools.partial(violations.about, refused), timeout_s=5)
    await nc.close()
    node_nc = await nats.connect(node.nats_url, **operator_credentials(home))
    try:
        assert (await node_nc.jetstream().stream_info(VECTORS_STREAM)).state.messages == 0
    finally:
        await node_nc.close()


async def test_an_agent_publishes_only_in_its_own_projects(secured: tuple[Node, Path], project: str) -> None:
    node, home = secured
    mallory = AgentKey.generate("mallory")
    await _enrol(node, home, mallory, [project], [Role.agent])
    before = await _stream_state(node, home)
    violations = Violations()
    nc = await _as(node, mallory, violations)
    other = event_subject("someone-elses", "finding", "x")
    with pytest.raises(nats.errors.TimeoutError):
        await nc.jetstream(timeout=REFUSED_WITHIN_S).publish(other, b"{}")
    await eventually(lambda: violations.about(other))
    await nc.close()
    assert (await _stream_state(node, home))["messages"] == before["messages"]


async def test_an_agent_cannot_listen_to_other_inboxes_nor_to_node_requests(
    secured: tuple[Node, Path], project: str
) -> None:
    node, home = secured
    mallory = AgentKey.generate("mallory")
    await _enrol(node, home, mallory, [project], [Role.agent])
    violations = Violations()
    nc = await _as(node, mallory, violations)
    for subject in ("_INBOX.>", "epibus.>", "epi.>"):
        await nc.subscribe(subject)
        await eventually(functools.partial(violations.subscription_refused, subject))
    await nc.close()


async def test_only_an_admin_enrols_and_a_revoked_agent_can_no_longer_connect(
    secured: tuple[Node, Path], project: str
) -> None:
    node, home = secured
    mallory = AgentKey.generate("mallory")
    await _enrol(node, home, mallory, [project], [Role.agent])
    nc = await nats.connect(node.nats_url, **mallory.nats_credentials)
    impostor = AgentKey.generate("impostor")
    request = build_request(
        EnrolRequest, agent_id="impostor", public_key=impostor.public_key, projects=["*"], roles=[Role.admin]
    )
    with pytest.raises(Forbidden, match="only an admin"):
        await enrol.enrol(nc, mallory, request)
    await nc.close()
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(node.nats_url, allow_reconnect=False, connect_timeout=2, **impostor.nats_credentials)

    admin = node_key(home)
    nc = await nats.connect(node.nats_url, **admin.nats_credentials)
    await enrol.revoke(nc, admin, "mallory")
    listed = {a["agent_id"]: a for a in await enrol.list_agents(nc, admin)}
    await nc.close()
    assert listed["mallory"]["revoked_at"] is not None
    assert "impostor" not in listed
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(node.nats_url, allow_reconnect=False, connect_timeout=2, **mallory.nats_credentials)


async def test_an_unsigned_or_forged_enrolment_request_is_answered_with_a_refusal(
    secured: tuple[Node, Path], project: str
) -> None:
    node, home = secured
    mallory = AgentKey.generate("mallory")
    await _enrol(node, home, mallory, [project], [Role.agent])
    nc = await nats.connect(node.nats_url, **mallory.nats_credentials)
    body = json.dumps({"agent_id": "x", "public_key": mallory.public_key, "projects": ["*"]}).encode()
    unsigned = await nc.request("epibus.agent.enrol", body, timeout=5)
    assert "not signed" in json.loads(unsigned.data)["error"]
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    # The node's name and key on the request, mallory's signature: the node's key does not verify it.
    now = datetime.now(UTC)
    headers = node_key(home).sign_request("epibus.agent.enrol", inbox, body, signed_at=now)
    forged_signature = mallory.sign_request("epibus.agent.enrol", inbox, body, signed_at=now)["Epibus-Signature"]
    headers["Epibus-Signature"] = forged_signature
    await nc.publish("epibus.agent.enrol", body, reply=inbox, headers=headers)
    forged = await sub.next_msg(timeout=5)
    assert "does not verify" in json.loads(forged.data)["error"]
    await nc.close()
    agents = (await _stream_state(node, home))["agents"]
    assert "x" not in agents


async def test_an_agent_reads_its_own_projects_and_nothing_of_others(secured: tuple[Node, Path], project: str) -> None:
    node, home = secured
    other = f"{project}-x"
    async with connect(node.nats_url, agent="alice", home=home, outbox=False) as alice:
        secret = alice.event("finding", finding(1), project=other)
        await alice.publish(secret)
    bob = AgentKey.load_or_create(home, "bob")
    await _enrol(node, home, bob, [project], [Role.agent])
    async with connect(node.nats_url, agent="bob", home=home, outbox=False) as client:
        claim = client.event("finding", finding(2), project=project)
        await client.publish(claim)
        # A state change folds the project first: a read the broker confines to bob's project.
        await client.transition("resolved", {"resolution": "stale"}, project=project, artifact_id=claim.artifact_id)
        view = await client.project_view(project)
        assert view.fold.artifacts[claim.artifact_id].resolution == "stale"

    violations = Violations()
    nc = await _as(node, bob, violations)
    js = nc.jetstream(timeout=REFUSED_WITHIN_S)
    config = ConsumerConfig(name="peek", filter_subject=f"epi.{other}.>", ack_policy=AckPolicy.NONE)
    attempts = {
        f"$JS.API.CONSUMER.CREATE.EPI.peek.epi.{other}.>": js.add_consumer(STREAM, config),
        "$JS.API.CONSUMER.CREATE.EPI": js.add_consumer(STREAM, ConsumerConfig(filter_subject=f"epi.{other}.>")),
        "$JS.API.STREAM.MSG.GET.EPI": js.get_msg(STREAM, 1),
        "$JS.API.STREAM.INFO.EPI": js.stream_info(STREAM, subjects_filter="epi.>"),
        f"$JS.API.DIRECT.GET.EPI.epi.{other}.>": js.get_msg(STREAM, subject=f"epi.{other}.>", direct=True),
    }
    for subject, attempt in attempts.items():
        with contextlib.suppress(nats.errors.TimeoutError, TimeoutError):
            await attempt
        await eventually(functools.partial(violations.about, subject), timeout_s=5)
    await nc.close()


async def test_a_client_refuses_to_publish_outside_its_projects_before_anything_is_written(
    secured: tuple[Node, Path], project: str
) -> None:
    node, home = secured
    bob = AgentKey.load_or_create(home, "bob")
    await _enrol(node, home, bob, [project], [Role.agent])
    before = await _stream_state(node, home)
    async with connect(node.nats_url, agent="bob", home=home) as client:
        with pytest.raises(Forbidden, match="enrolled in"):
            await client.publish(client.event("finding", finding(1), project=f"{project}-x"))
        assert await client.outbox_depth() == 0
    assert (await _stream_state(node, home))["messages"] == before["messages"]


async def test_following_another_project_is_forbidden_not_a_hang(secured: tuple[Node, Path], project: str) -> None:
    node, home = secured
    bob = AgentKey.load_or_create(home, "bob")
    await _enrol(node, home, bob, [project], [Role.agent])
    nc = await open_nats([node.nats_url], name="bob", timeout_s=5, key=bob)
    js = nc.jetstream(timeout=REFUSED_WITHIN_S)
    follower = StreamFollower(js, STREAM, f"epi.{project}-x.>", start_seq=None, closed=lambda: nc.is_closed)
    with pytest.raises(Forbidden, match="refused"):
        await anext(follower.messages())
    await nc.close()


async def test_a_local_first_connect_never_changes_an_enrolled_agent(secured: tuple[Node, Path], project: str) -> None:
    node, home = secured
    carol = AgentKey.load_or_create(home, "carol")
    await _enrol(node, home, carol, [project], [Role.admin])
    await enrol.enrol_locally([node.nats_url], home, carol)  # what a client does when its connect is refused
    admin = node_key(home)
    nc = await nats.connect(node.nats_url, **admin.nats_credentials)
    listed = {a["agent_id"]: a for a in await enrol.list_agents(nc, admin)}
    await nc.close()
    assert listed["carol"]["roles"] == ["admin"]
    assert listed["carol"]["projects"] == [project]


async def test_a_local_enrolment_the_keeper_wrote_but_has_not_applied_yet_still_lets_the_agent_in(
    secured: tuple[Node, Path], project: str
) -> None:
    node, home = secured
    dora = AgentKey.generate("dora")  # not under the home: the keeper does not enrol it on its own
    assert node.enrolments is not None
    # the keeper's pass has written the registry and not yet reloaded the server (its next pass is up to 2 s off)
    first_use = Enrolment(
        agent_id="dora",
        public_key=dora.public_key,
        owner="dora",
        roles=(Role.agent,),
        projects=("*",),
        enrolled_by="test",
        enrolled_at=datetime.now(UTC),
    )
    assert await node.enrolments.registry.enrol_if_absent(first_use) is not None
    await enrol.enrol_locally([node.nats_url], home, dora)  # what a refused client does, then it connects again
    nc = await open_nats([node.nats_url], name="dora", timeout_s=5, key=dora)
    assert nc.is_connected
    await nc.close()
